"""Token ids to streamable text, with the real GPT-2 and SmolLM2 tokenizers, and stop strings."""
from __future__ import annotations

import random
import time
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models

from labkit.engine.detok import CONTEXT_TOKENS, IncrementalDetokenizer, StopMatcher, StopResult
from labkit.models.tokenizers import gpt2_tokenizer, smollm2_tokenizer

TEXTS = {
    "english": "The quick brown fox jumps over the lazy dog. It's 3:15, isn't it?\n\nYes.",
    "emoji": "Party 🎉🥳 family 👨‍👩‍👧‍👦 thumbs 👍🏽 flag 🇯🇵 ✅",
    "cjk": "東京は日本の首都です。한국어 문장도 있습니다。中文句子，还有！",
    "accented": "Café naïve façade, Ærøskøbing, Łódź, São Paulo, e\u0301 combining, Ñandú.",
    "mixed": "def f(x):\n    return x  # ∑ α→β\r\n\tend 🙂 東",
}


@pytest.fixture(scope="module", params=["gpt2", "smollm2"])
def tokenizer(request):
    return gpt2_tokenizer() if request.param == "gpt2" else smollm2_tokenizer()


def stream(tok, ids: Sequence[int], prompt_ids: Sequence[int] = ()) -> tuple[list[str], str]:
    detok = IncrementalDetokenizer(tok, prompt_ids)
    return [detok.push(i) for i in ids], detok.flush()


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


# --------------------------------------------------------------------------- detokenizer


@pytest.mark.parametrize("name", TEXTS)
def test_deltas_concatenate_to_decode_of_all_ids(tokenizer, name: str) -> None:
    ids = encode(tokenizer, TEXTS[name])
    deltas, tail = stream(tokenizer, ids)
    assert "".join(deltas) + tail == tokenizer.decode(ids) == TEXTS[name]


@pytest.mark.parametrize("name", TEXTS)
def test_no_delta_holds_half_a_character(tokenizer, name: str) -> None:
    deltas, tail = stream(tokenizer, encode(tokenizer, TEXTS[name]))
    assert all("\ufffd" not in d for d in deltas) and tail == ""


def test_characters_split_across_tokens_are_emitted_whole(tokenizer) -> None:
    ids = encode(tokenizer, TEXTS["cjk"])
    assert any(tokenizer.decode([i]).endswith("\ufffd") for i in ids), "no split character"
    deltas, _ = stream(tokenizer, ids)
    assert "" in deltas  # a token that only starts a character sends nothing yet
    assert all("\ufffd" not in d for d in deltas)


@pytest.mark.parametrize("name", TEXTS)
def test_with_prompt_context_deltas_are_the_text_after_the_prompt(tokenizer, name: str) -> None:
    prompt = encode(tokenizer, "Translate this, please:")
    ids = encode(tokenizer, " " + TEXTS[name])
    deltas, tail = stream(tokenizer, ids, prompt)
    full, head = tokenizer.decode(prompt + ids), tokenizer.decode(prompt)
    assert "".join(deltas) + tail == full[len(head):] == tokenizer.decode(ids)


def test_flush_releases_an_incomplete_character_as_decode_would(tokenizer) -> None:
    ids = encode(tokenizer, "東京")
    first_byte_token = next(i for i in ids if tokenizer.decode([i]) == "\ufffd")
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.push(first_byte_token) == ""
    assert detok.flush() == tokenizer.decode([first_byte_token]) == "\ufffd"


def test_special_tokens_add_no_text_unless_asked() -> None:
    tok = smollm2_tokenizer()
    eos = tok.eos_token_id
    assert IncrementalDetokenizer(tok).push(eos) == ""
    assert IncrementalDetokenizer(tok, skip_special_tokens=False).push(eos) == tok.eos_token


class DecodeSpy:
    """Wraps a tokenizer and records how many ids each decode call was given."""

    def __init__(self, tok) -> None:
        self.tok, self.sizes = tok, []

    def decode(self, ids, **kwargs) -> str:
        self.sizes.append(len(ids))
        return self.tok.decode(ids, **kwargs)


def test_each_decode_sees_a_short_window_however_long_the_sequence() -> None:
    spy = DecodeSpy(gpt2_tokenizer())
    ids = encode(spy.tok, " ".join(TEXTS.values()) * 20)
    deltas, tail = stream(spy, ids)
    assert "".join(deltas) + tail == spy.tok.decode(ids)
    assert len(ids) > 1000 and max(spy.sizes) <= 3 * CONTEXT_TOKENS


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 50256), max_size=30))
def test_any_gpt2_ids_even_invalid_utf8_concatenate_to_decode(ids: list[int]) -> None:
    tok = gpt2_tokenizer()
    deltas, tail = stream(tok, ids)
    assert "".join(deltas) + tail == tok.decode(ids, skip_special_tokens=True)


# A SentencePiece-style tokenizer (Llama 2's decoder: "▁" for space, byte fallback, and the
# leading space of the whole text stripped) with a tiny hand-made vocabulary.
_WORDS = ["▁The", "▁cat", "▁sat", "▁on", "▁mat", "!"]


@pytest.fixture(scope="module")
def sp_tokenizer() -> Tokenizer:
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    vocab.update({w: 259 + i for i, w in enumerate(_WORDS)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(["<s>", "</s>"])
    return tok


def sp_ids(*pieces: str) -> list[int]:
    """Word pieces by vocabulary id; anything else as byte-fallback tokens."""
    out: list[int] = []
    for piece in pieces:
        out += [259 + _WORDS.index(piece)] if piece in _WORDS else [3 + b for b in piece.encode()]
    return out


def test_sentencepiece_first_delta_keeps_its_space_after_a_prompt(sp_tokenizer) -> None:
    prompt, gen = [1, *sp_ids("▁The", "▁cat")], sp_ids("▁sat", "▁on", "東", "!")
    deltas, tail = stream(sp_tokenizer, gen, prompt)
    assert sp_tokenizer.decode(gen) == "sat on東!"  # decoded alone, the space is gone
    assert deltas == [" sat", " on", "", "", "東", "!"] and tail == ""


def test_sentencepiece_without_prompt_matches_decode(sp_tokenizer) -> None:
    gen = sp_ids("▁sat", "東京🙂", "▁on", "▁mat") * 30
    deltas, tail = stream(sp_tokenizer, gen)
    assert "".join(deltas) + tail == sp_tokenizer.decode(gen)
    assert all("\ufffd" not in d for d in deltas)


# --------------------------------------------------------------------------- stop strings


def run_stops(stops: Sequence[str], deltas: Sequence[str]) -> tuple[list[str], bool, str]:
    """Push deltas until a stop matches, as the engine does; (texts sent, stopped, flushed)."""
    matcher, texts = StopMatcher(stops), []
    for delta in deltas:
        text, stopped = matcher.push(delta)
        texts.append(text)
        if stopped:
            return texts, True, matcher.flush()
    return texts, False, matcher.flush()


@pytest.mark.parametrize("deltas", [["a\n", "\nb"], ["a", "\n", "\n", "b"], ["a\n\nb"]])
def test_blank_line_stop_matches_across_deltas(deltas: list[str]) -> None:
    texts, stopped, tail = run_stops(["\n\n"], deltas)
    assert "".join(texts) == "a" and stopped and tail == ""


def test_stop_arriving_one_letter_per_delta_matches() -> None:
    assert run_stops(["END"], ["The ", "E", "N", "D", " more"])[:2] == (["The ", "", "", ""], True)


def test_stop_string_at_the_very_start_emits_nothing() -> None:
    assert StopMatcher(["Hi"]).push("Hi there") == StopResult("", True)


def test_overlapping_stops_the_first_completed_wins() -> None:
    assert run_stops(["ab", "abc"], ["xab", "cd"])[:2] == (["x"], True)
    assert run_stops(["abc", "b"], ["a", "bc"])[:2] == (["", "a"], True)


def test_only_the_longest_tail_that_could_start_a_stop_is_held_back() -> None:
    matcher = StopMatcher(["abc", "xyz"])
    assert matcher.push("1ab") == StopResult("1", False)
    assert matcher.push("d") == StopResult("abd", False)
    assert matcher.push("aab") == StopResult("a", False)


def test_false_start_is_released_at_flush() -> None:
    assert run_stops(["END"], ["fin", "EN"]) == (["fin", ""], False, "EN")


def test_nothing_is_emitted_after_a_stop() -> None:
    matcher = StopMatcher(["."])
    assert matcher.push("a.b") == StopResult("a", True)
    assert matcher.push("more") == StopResult("", True) and matcher.flush() == ""


def test_no_stops_passes_everything_through() -> None:
    assert run_stops([], ["a", "b"]) == (["a", "b"], False, "")


@pytest.mark.parametrize("stops", [[""], ["ok", ""]])
def test_empty_stop_string_is_rejected(stops: list[str]) -> None:
    with pytest.raises(ValueError):
        StopMatcher(stops)


def test_a_bare_string_is_not_mistaken_for_a_list_of_stops() -> None:
    with pytest.raises(TypeError):
        StopMatcher("END")  # type: ignore[arg-type]


@pytest.mark.parametrize("stop", ["ond li", "\n\n", "🥳 fam", "です。"])
def test_stop_in_a_real_token_stream_is_never_sent(tokenizer, stop: str) -> None:
    text = "First line.\n\nSecond line. " + TEXTS["emoji"] + " " + TEXTS["cjk"]
    detok, matcher, sent = IncrementalDetokenizer(tokenizer), StopMatcher([stop]), ""
    for token_id in encode(tokenizer, text):
        result = matcher.push(detok.push(token_id))
        sent += result.text
        if result.stopped:
            break
    assert result.stopped and sent == text[: text.index(stop)] and stop not in sent


@settings(max_examples=200, deadline=None)
@given(st.text("abc\n", max_size=20), st.lists(st.text("abc\n", min_size=1, max_size=3),
                                                min_size=1, max_size=3),
       st.lists(st.integers(0, 20), max_size=6))
def test_stop_matching_does_not_depend_on_how_text_is_cut(text: str, stops: list[str],
                                                           cuts: list[int]) -> None:
    whole = StopMatcher(stops).push(text)
    bounds = [0, *sorted(set(c for c in cuts if 0 < c < len(text))), len(text)]
    texts, stopped, tail = run_stops(stops, [text[a:b] for a, b in zip(bounds, bounds[1:])])
    expected = whole.text if whole.stopped else text
    assert ("".join(texts) + tail, stopped) == (expected, whole.stopped)
    assert not any(s in "".join(texts) + tail for s in stops)


@settings(max_examples=300, deadline=None)
@given(st.text("abc", max_size=24), st.lists(st.text("abc", min_size=1, max_size=4), min_size=1, max_size=5))
def test_the_stop_that_ends_first_wins_and_only_a_possible_start_is_held(text: str, stops: list[str]) -> None:
    matcher = StopMatcher(stops)
    result = matcher.push(text)
    found = [(text.find(s) + len(s), text.find(s)) for s in stops if s in text]
    if found:
        assert result == StopResult(text[: min(found)[1]], True)
        return
    held = text[len(result.text):]
    assert not result.stopped and text.startswith(result.text) and matcher.flush() == held
    could_start = [n for n in range(len(text) + 1) if any(s.startswith(text[len(text) - n:]) for s in stops)]
    assert len(held) == max(could_start)


def _push_time(matcher: StopMatcher, deltas: list[str]) -> float:
    best = float("inf")
    for _ in range(3):
        matcher.flush()
        start = time.perf_counter()
        for delta in deltas:
            matcher.push(delta)
        best = min(best, time.perf_counter() - start)
    return best


def test_matching_time_does_not_grow_with_the_number_of_stops() -> None:
    # Stops that keep almost matching (same letters, one that never comes), so each delta leaves a
    # tail that could start many of them. Matching once cost every stop on every delta.
    rng = random.Random(12)
    many = ["".join(rng.choice("ab") for _ in range(10)) + "!" for _ in range(2000)]
    deltas = ["".join(rng.choice("ab") for _ in range(4)) for _ in range(500)]
    few_time = _push_time(StopMatcher(many[:1]), deltas)
    many_time = _push_time(StopMatcher(many), deltas)
    assert many_time < 10 * few_time, (many_time, few_time)  # 2000 times the stops, not 2000 times the time
