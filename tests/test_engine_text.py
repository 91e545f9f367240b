"""The text a sequence emits: UTF-8-safe deltas and stop strings matched across token boundaries."""
from engine_helpers import PROMPTS, drain, make_engine, solo


def _boundary_stop(model, prompt):
    """A stop string that starts inside one token's text and ends inside the next one's."""
    engine = make_engine(model)
    rid = engine.submit(prompt, max_new_tokens=16)
    deltas = []
    for _ in range(100):
        if not engine.has_work():
            break
        deltas += [e.text for e in engine.step() if getattr(e, "rid", None) == rid and hasattr(e, "text")]
    for i in range(2, len(deltas) - 1):
        left, right = deltas[i], deltas[i + 1]
        if len(left) >= 1 and len(right) >= 1:
            return "".join(deltas[:i]), left[-1:] + right[:1]
    raise AssertionError(f"no two adjacent non-empty deltas in {deltas!r}")


def test_stop_string_split_across_two_tokens_ends_the_sequence_and_is_not_emitted(tiny_model):
    prompt = PROMPTS[6]
    before, stop = _boundary_stop(tiny_model, prompt)
    out = solo(tiny_model, prompt, max_new_tokens=16, stop=[stop])
    assert out.reason == "stop"
    assert stop not in out.text
    full = solo(tiny_model, prompt, max_new_tokens=16).text
    assert out.text == full[: full.index(stop)]


def test_stop_strings_never_appear_in_emitted_text_for_any_of_several_stops(tiny_model):
    full = solo(tiny_model, PROMPTS[7], max_new_tokens=16).text
    stops = [full[5:7], "zzzz-not-there"]
    out = solo(tiny_model, PROMPTS[7], max_new_tokens=16, stop=stops)
    assert out.reason == "stop" and out.text == full[: full.index(stops[0])]


def test_text_deltas_never_split_a_character_under_random_sampling(tiny_model):
    engine = make_engine(tiny_model)
    rids = [engine.submit(p, max_new_tokens=48, temperature=3.0, seed=i) for i, p in enumerate(PROMPTS[:8])]
    deltas: dict[str, list[str]] = {r: [] for r in rids}
    tokens: dict[str, list[int]] = {r: [] for r in rids}
    while engine.has_work():
        for e in engine.step():
            if hasattr(e, "text"):
                deltas[e.rid].append(e.text)
                tokens[e.rid].append(e.token_id)
    for rid in rids:
        whole = tiny_model.tokenizer.decode(tokens[rid], skip_special_tokens=True)
        assert "".join(deltas[rid]) == whole
        if "\ufffd" not in whole:
            assert all("\ufffd" not in d for d in deltas[rid])


def test_usage_counts_prompt_and_completion_tokens(tiny_gpt2):
    engine = make_engine(tiny_gpt2)
    rid = engine.submit(PROMPTS[0], max_new_tokens=5)
    out = drain(engine)[rid]
    assert out.usage.prompt_tokens == len(tiny_gpt2.tokenizer.encode(PROMPTS[0]))
    assert out.usage.completion_tokens == 5
