"""The lab's client stays bounded against a hostile server: every body it reads has a cap, every
request an overall deadline that a trickle cannot reset, compression is declined, and a failure
is one clear line. Each test runs a misbehaving server on 127.0.0.1 (tests/hostile_helpers.py)."""
from __future__ import annotations

import asyncio
import gc
import gzip
import json
import resource
import time
import tracemalloc

import pytest
from hostile_helpers import (
    SSE_HEAD,
    bomb,
    canned,
    chunk,
    cut_after_ids,
    cut_mid_chunk,
    endless_stream,
    gzip_bomb,
    hostile,
    huge_json,
    informational_flood,
    malformed,
    redirect,
    reset_mid_head,
    silent,
    sse_body,
    trickle_json,
    trickle_stream,
)

from labkit.lab import ReadOptions, Request, Target
from labkit.lab import kept as kept_module
from labkit.lab.client import JSON_CAP, async_client, get_json, read, run_sync
from labkit.lab.kept import Kept
from labkit.lab.probe import connect
from labkit.lab.stream import REFUSAL_CAP
from labkit.lab.target import TargetError


def completion(target: Target, options: ReadOptions | None = None, **how) -> object:
    return target.read(target.request("hi", 8), options, **how)


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@pytest.mark.parametrize("raw", [False, True], ids=["httpx", "raw"])
def test_an_endless_stream_is_cut_at_the_stream_cap_with_a_line_naming_it(raw):
    before = peak_rss_mib()
    with hostile(endless_stream) as url:
        stream = completion(Target(url), ReadOptions(timeout=60, max_bytes=16 << 20), raw=raw)
    assert stream.error == "the stream passed the client's cap of 16,777,216 bytes"
    assert 16 << 20 < stream.total_bytes < (16 << 20) + (4 << 20)
    assert peak_rss_mib() - before < 400, "the client kept far more than the stream cap"


def test_events_beyond_the_event_cap_end_the_read():
    with hostile(endless_stream) as url:
        stream = completion(Target(url), ReadOptions(timeout=60, max_events=100))
    assert stream.error == "the stream passed the client's cap of 100 events" and len(stream.events) == 100


def test_a_huge_json_answer_is_refused_at_the_json_cap():
    with hostile(huge_json) as url:
        started = time.monotonic()
        with pytest.raises(OSError, match=f"cap of {JSON_CAP >> 20} MiB"):
            get_json(url, "/v1/models", timeout=60)
    assert time.monotonic() - started < 30


@pytest.mark.parametrize("raw", [False, True], ids=["httpx", "raw"])
@pytest.mark.parametrize("status", ["503 Service Unavailable", "200 OK"])
def test_a_refusal_is_read_no_further_than_its_cap(raw, status):
    """Parsed, 8 MiB of ``[{},...]`` is about 240 MB, and a launch holds 32 requests: a body
    other than the one asked for (an error, JSON where a stream was asked) is read to 64 KiB,
    enough to say what it is, and the rest is never read."""
    body = b"[" + b"{}," * (3 << 20) + b"{}]"
    head = f"HTTP/1.1 {status}\ncontent-type: application/json\ncontent-length: {len(body)}"
    with hostile(canned(head, body)) as url:
        stream = completion(Target(url, api="openai"), ReadOptions(timeout=30), raw=raw)
    said = "HTTP 503" if status.startswith("503") else "answered application/json"
    assert stream.error.startswith(f"{said}: [{{}},{{}},"), stream.error
    assert isinstance(stream.body, str) and len(stream.body) == REFUSAL_CAP, "kept to the cap, unparsed"
    assert REFUSAL_CAP <= stream.total_bytes <= 2 * REFUSAL_CAP


def test_the_json_a_get_asked_for_is_read_to_the_json_cap():
    body = json.dumps({"data": [{"id": f"m{i}"} for i in range(20_000)]}).encode()  # 300 KB: past a refusal's cap
    head = f"HTTP/1.1 200 OK\ncontent-type: application/json\ncontent-length: {len(body)}"
    with hostile(canned(head, body)) as url:
        status, answer = get_json(url, "/v1/models", timeout=30)
    assert status == 200 and len(answer["data"]) == 20_000


@pytest.mark.parametrize("raw", [False, True], ids=["httpx", "raw"])
def test_a_completion_asked_for_whole_is_read_to_a_megabyte(raw):
    body = json.dumps({"choices": [{"text": "x" * (2 << 20), "finish_reason": "length"}]}).encode()
    head = f"HTTP/1.1 200 OK\ncontent-type: application/json\ncontent-length: {len(body)}"
    with hostile(canned(head, body)) as url:
        target = Target(url, api="openai")
        stream = target.read(target.request("hi", 8, stream=False), ReadOptions(timeout=30), raw=raw)
    assert "answer larger than the client's cap of 1 MiB" in stream.error and stream.body is None


@pytest.mark.parametrize("raw", [False, True], ids=["httpx", "raw"])
def test_streams_alive_together_keep_within_one_cap(raw, monkeypatch):
    """Each stream's own caps would let eight endless streams keep 512 MiB; together they keep
    within the process's one cap, and what they kept is given back once they are gone."""
    kept = Kept(cap=8 << 20)
    monkeypatch.setattr(kept_module, "KEPT", kept)
    streams = _eight(endless_stream, raw)
    capped = [s for s in streams if s.error == "the lab's streams passed the client's cap of 8,388,608 bytes kept in all"]
    assert capped and 0 < kept.held <= kept.cap
    assert sum(s._account[0] for s in streams if s._account) == kept.held
    del streams, capped
    gc.collect()
    assert kept.held == 0, "a stream's charge is given back when it is collected"


def _eight(behaviour, raw: bool, **options) -> list:
    """Eight streams at once from a hostile server, each with caps far above what it sends."""
    options = ReadOptions(**{"timeout": 60, "max_events": 10**6, **options})
    with hostile(behaviour) as url:
        target = Target(url, api="openai")
        requests = [target.request("hi", 10**6)] * 8

        async def each_raw() -> list:
            return list(await asyncio.gather(*(target.stream(r, options, raw=True) for r in requests)))

        return run_sync(each_raw()) if raw else target.launch(requests, options).streams


def _repeated(event: bytes, head: bytes = SSE_HEAD) -> object:
    async def behave(w) -> None:  # one event (or comment) over and over, as fast as the client reads
        w.write(head)
        piece = chunk(event * max(1, (256 << 10) // len(event)))
        for _ in range(4096):
            w.write(piece)
            await w.drain()

    return behave


ATTACKS = {  # each would keep hundreds of megabytes in eight streams if the cap counted only data characters
    "a long id on every event": _repeated(b"id: " + b"i" * 200_000 + b"\ndata: {}\n\n"),
    "a long event name": _repeated(b"event: " + b"e" * 200_000 + b"\ndata: {}\n\n"),
    "text of one emoji and much else": _repeated(
        b'data: {"choices": [{"text": "' + b"a" * 100_000 + b'\\ud83d\\ude00"}]}\n\n'),
    "text that is not a string": _repeated(b'data: {"choices": [{"text": [' + b"1e15," * 40_000 + b'"x"]}]}\n\n'),
    "a huge usage": _repeated(b'data: {"choices": [], "usage": {"x": [' + b"{}," * 100_000 + b"{}]}}\n\n"),
    "a head of many fields": canned("HTTP/1.1 200 OK\ncontent-type: text/event-stream\n"
                                    + "\n".join(f"x{i}: {i}" for i in range(8000)), b"", hold_s=5),
}  # fmt: skip


@pytest.mark.parametrize("raw", [False, True], ids=["httpx", "raw"])
@pytest.mark.parametrize("attack", list(ATTACKS))
def test_what_eight_hostile_streams_keep_in_memory_stays_near_the_one_cap(attack, raw, monkeypatch):
    """Measured with tracemalloc: whatever a hostile server puts where (ids, names, text that
    grows when decoded or made a string, parsed usage, the head's fields), eight streams keep
    within about the one cap, and each attack ends its streams with a failure."""
    kept = Kept(cap=4 << 20)
    monkeypatch.setattr(kept_module, "KEPT", kept)
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        streams = _eight(ATTACKS[attack], raw, max_event_bytes=4 << 20)
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert held < kept.cap * 3 // 2 + (2 << 20), f"{held / 2**20:.1f} MiB kept by eight streams"  # uncapped: ~512
    assert all(s.failure for s in streams), [s.failure for s in streams]
    del streams
    gc.collect()
    assert kept.held == 0


def test_a_kept_wire_is_charged_to_the_one_cap(monkeypatch):
    """Comments make no events, so only the kept wire can reach the cap."""
    kept = Kept(cap=1 << 20)
    monkeypatch.setattr(kept_module, "KEPT", kept)
    with hostile(_repeated(b": " + b"c" * 1000 + b"\n")) as url:
        stream = completion(Target(url, api="openai"), ReadOptions(timeout=60, keep_wire=True, max_event_bytes=64 << 20),
                            raw=True)  # fmt: skip
    assert stream.error == "the lab's streams passed the client's cap of 1,048,576 bytes kept in all"
    assert not stream.events and stream._account[0] >= len(stream.wire) > (1 << 20) - (64 << 10)


def test_a_gzip_bomb_is_never_inflated():
    """The client asks for identity, so a gzip answer is refused by name, never decoded."""
    before = peak_rss_mib()
    with hostile(gzip_bomb) as url, pytest.raises(OSError, match="Content-Encoding: gzip, where the client asked for identity"):
        get_json(url, "/v1/models", timeout=30)
    assert peak_rss_mib() - before < 200


def test_a_trickled_json_answer_ends_at_its_deadline():
    with hostile(trickle_json) as url:
        started = time.monotonic()
        with pytest.raises(OSError, match="no end within the 2 s bound"):
            get_json(url, "/v1/models", timeout=2.0)
    assert time.monotonic() - started < 6


@pytest.mark.parametrize("raw", [False, True], ids=["httpx", "raw"])
def test_a_trickled_stream_ends_at_its_deadline(raw):
    with hostile(trickle_stream) as url:
        started = time.monotonic()
        stream = completion(Target(url), ReadOptions(timeout=2.0), raw=raw)
    assert stream.error == "no end within the 2 s bound of one request" and stream.failure
    assert time.monotonic() - started < 6


@pytest.mark.parametrize("raw", [False, True], ids=["httpx", "raw"])
def test_a_reset_mid_head_is_said_in_words(raw):
    with hostile(reset_mid_head) as url:
        stream = completion(Target(url), ReadOptions(timeout=10), raw=raw)
    assert not stream.ok and "no detail" not in stream.failure
    assert "reset" in stream.failure or "before a whole head" in stream.failure, stream.failure


@pytest.mark.parametrize("raw", [False, True], ids=["httpx", "raw"])
def test_a_stream_cut_mid_chunk_is_a_failure_not_a_success(raw):
    with hostile(cut_mid_chunk) as url:
        stream = completion(Target(url), ReadOptions(timeout=10), raw=raw)
    assert stream.chunks == 3 and not stream.ok and stream.failure is not None
    assert not stream.completed


@pytest.mark.parametrize("raw", [False, True], ids=["httpx", "raw"])
def test_a_cut_stream_keeps_the_last_event_id_it_read_to_resume_from(raw):
    with hostile(cut_after_ids) as url:
        stream = Target(url, api="labkit").read(Request("/v1/stream", {"prompt": "hi"}), ReadOptions(timeout=10), raw=raw)
    assert stream.tokens == 3 and not stream.completed and stream.failure is not None
    assert stream.last_event_id == "3" and stream.unfinished_bytes > 0


def test_a_redirect_names_its_status_and_where_it_points():
    with hostile(redirect) as url:
        stream = completion(Target(url))
    assert stream.error == "HTTP 302 redirect to elsewhere.example:8080"


def test_the_probe_has_a_time_limit_of_its_own(monkeypatch):
    """Streams trickled forever: each probe request ends at its bound and the whole probe at its
    budget, with one line saying so."""
    import labkit.lab.probe as probe

    monkeypatch.setattr(probe, "PROBE_TIMEOUT_S", 1.0)
    with hostile(trickle_stream) as url:
        started = time.monotonic()
        with pytest.raises(TargetError, match="no end within the 1 s bound"):
            connect(url)
    assert time.monotonic() - started < 10


def test_a_raw_read_of_a_refusal_keeps_the_json_body():
    with hostile(redirect) as url:
        stream = run_sync(read(url, Request("/v1/stream", {"prompt": "x"}), raw=True))
    assert stream.status == 302 and stream.error.startswith("HTTP 302 redirect")


@pytest.mark.parametrize("api", ["labkit", "openai"])
@pytest.mark.parametrize("payload", [b'{"id": "x", "text": 1}', b'{"choices": [1, "a"]}', b"[" * 50000,
                                     b'{"choices": [{"text": {"a": 1}, "finish_reason": null}]}',
                                     b'{"id": 1e999, "text": "x"}'],
                         ids=["bad-id", "bad-choices", "deep", "text-not-a-string", "id-past-any-integer"])
@pytest.mark.parametrize("raw", [False, True], ids=["httpx", "raw"])
def test_a_malformed_event_is_the_stream_s_error_never_a_crash(api, payload, raw):
    with hostile(malformed(payload)) as url:
        stream = completion(Target(url, api=api), ReadOptions(timeout=10), raw=raw)
    assert stream.status == 200 and stream.error is None
    if api == "labkit":  # a token event of the wrong shape, and no done event: not a whole stream
        assert not stream.ok and stream.failure is not None
    else:  # an OpenAI reader skips what it cannot use; [DONE] ended the stream
        assert stream.completed


def test_interim_answers_without_end_count_toward_the_cap():
    with hostile(informational_flood) as url:
        stream = completion(Target(url), ReadOptions(timeout=30, max_bytes=1 << 20, keep_wire=True), raw=True)
    assert stream.error == "the answer passed the client's cap of 1,048,576 bytes" and len(stream.wire) < 3 << 20


OPENAI = "HTTP/1.1 200 OK\ncontent-type: text/event-stream\ntransfer-encoding: chunked"


def _choice(text: str, finish: str | None = None) -> str:
    return json.dumps({"choices": [{"index": 0, "text": text, "finish_reason": finish}]})


def _openai(*payloads: str, head: str = OPENAI, raw: bool = False, **options) -> object:
    with hostile(canned(head, sse_body(*payloads))) as url:
        return completion(Target(url, api="openai"), ReadOptions(timeout=10, **options), raw=raw)


@pytest.mark.parametrize("raw", [False, True], ids=["httpx", "raw"])
def test_one_chunk_of_many_choices_is_no_tokens_but_an_error(raw):
    """The lab asks for one choice: a chunk of 500 empty choices and one real one is not 501 tokens."""
    many = json.dumps({"choices": [{}] * 500 + [{"index": 0, "text": "x", "finish_reason": None}]})
    stream = _openai(_choice("a"), many, _choice("", "length"), "[DONE]", raw=raw)
    assert stream.chunks == 1 and stream.tokens == 1 and not stream.ok
    assert "501 choices in one chunk" in stream.failure


def test_a_choice_that_is_neither_a_token_nor_an_end_is_not_counted():
    stream = _openai(_choice("a"), json.dumps({"choices": [{}]}), _choice("b"), _choice("", "length"), "[DONE]")
    assert (stream.chunks, stream.text, stream.ok) == (2, "ab", True)


@pytest.mark.parametrize("count", [-7, True, 10**21, "5", 9], ids=["negative", "bool", "huge", "text", "over-max"])
def test_a_usage_count_that_is_no_count_is_an_error_and_never_the_tokens(count):
    usage = json.dumps({"choices": [], "usage": {"completion_tokens": count}})
    stream = _openai(_choice("a"), _choice("b"), _choice("", "length"), usage, "[DONE]")
    assert stream.tokens == 2 and not stream.ok and "is not a count of at most 8" in stream.failure


def test_a_usage_count_within_the_request_s_limit_is_the_tokens():
    usage = json.dumps({"choices": [], "usage": {"completion_tokens": 8}})
    stream = _openai(_choice("ab"), _choice("", "length"), usage, "[DONE]")
    assert (stream.tokens, stream.chunks, stream.ok) == (8, 1, True)


def test_the_last_text_sent_with_the_finish_reason_is_a_token():
    """vLLM and llama.cpp send the last token's text in the chunk that ends the answer (a review)."""
    stream = _openai(_choice("a"), _choice("b", "length"), "[DONE]")
    assert (stream.chunks, stream.text, stream.finish_reason, stream.ok) == (2, "ab", "length", True)


@pytest.mark.parametrize("raw", [False, True], ids=["httpx", "raw"])
def test_more_token_chunks_than_the_request_asked_for_are_an_error_not_tokens(raw):
    stream = _openai(*[_choice("a")] * 200, _choice("", "length"), "[DONE]", raw=raw)
    assert stream.chunks == 8 and not stream.ok and "more token chunks than the 8 tokens asked for" in stream.failure


def test_more_labkit_token_events_than_max_new_tokens_are_an_error():
    token = 'event: token\ndata: {"index": 0, "id": 1, "text": "a"}'
    with hostile(canned(OPENAI, b"".join(chunk(f"{token}\n\n".encode()) for _ in range(20)) + b"0\r\n\r\n")) as url:
        stream = completion(Target(url, api="labkit"), ReadOptions(timeout=10))
    assert stream.chunks == 8 and not stream.ok and "more token chunks than the 8 tokens asked for" in stream.failure


def test_a_usage_count_below_the_token_chunks_read_is_an_error():
    usage = json.dumps({"choices": [], "usage": {"completion_tokens": 1}})
    stream = _openai(_choice("a"), _choice("b"), _choice("", "length"), usage, "[DONE]")
    assert stream.tokens == 2 and not stream.ok and "fewer than the 2 token chunks" in stream.failure


@pytest.mark.parametrize("data", ["hello world", "[1, 2]", '{"created": ' + "9" * 5000 + "}"],
                         ids=["text", "not-an-object", "past-the-digit-limit"])
def test_a_chunk_that_is_not_a_json_object_is_an_error_not_silence(data):
    stream = _openai(_choice("a"), data, _choice("b"), _choice("", "length"), "[DONE]")
    assert stream.chunks == 2 and not stream.ok and "not a JSON object" in stream.failure


@pytest.mark.parametrize("raw", [False, True], ids=["httpx", "raw"])
@pytest.mark.parametrize("field, said", [("content-type: application/json", "more than one Content-Type"),
                                         ("content-encoding: gzip\ncontent-encoding: identity", "Content-Encoding: gzip, identity")],
                         ids=["content-type", "content-encoding"])  # fmt: skip
def test_a_head_field_sent_twice_is_refused_by_name_by_both_readers(raw, field, said):
    """The raw reader kept the last of two values and httpx joined them: one stream, two verdicts (a review)."""
    stream = _openai(_choice("a"), _choice("", "length"), "[DONE]", head=f"{OPENAI}\n{field}", raw=raw)
    assert not stream.ok and stream.chunks == 0 and said in stream.failure


@pytest.mark.parametrize("end", ["[DONE]", _choice("", "length")], ids=["after-done", "after-finish"])
def test_tokens_after_the_stream_s_end_are_an_error_not_tokens(end):
    stream = _openai(_choice("a"), end, *[_choice("more")] * 100, "[DONE]")
    assert stream.chunks == 1 and not stream.ok and "after the" in stream.failure


@pytest.mark.parametrize("raw", [False, True], ids=["httpx", "raw"])
def test_an_event_past_the_per_event_cap_ends_the_read(raw):
    stream = _openai(_choice("a"), _choice("x" * (2 << 20)), "[DONE]", raw=raw, max_event_bytes=1 << 20)
    assert stream.error == "an event passed the client's cap of 1,048,576 bytes of data" and stream.chunks == 1


def test_a_stream_of_tiny_json_keeps_about_its_wire_size():
    """Two thousand events of 2,000 empty objects each (12 MB on the wire) are kept as text: parsed
    at once they would be a gigabyte of dicts."""
    before = peak_rss_mib()
    event = json.dumps({"x": [{}] * 2000})
    with hostile(canned(OPENAI, b"".join(chunk(f"data: {event}\n\n".encode()) for _ in range(2000)) + b"0\r\n\r\n")) as url:
        stream = completion(Target(url, api="openai"), ReadOptions(timeout=30))
    assert len(stream.events) == 2000 and stream.error is None
    assert peak_rss_mib() - before < 150


@pytest.mark.parametrize("raw", [False, True], ids=["httpx", "raw"])
def test_a_media_type_is_read_whatever_its_case(raw):
    stream = _openai(_choice("a"), _choice("", "length"), "[DONE]", raw=raw,
                     head=OPENAI.replace("text/event-stream", "Text/Event-Stream"))  # fmt: skip
    assert stream.ok and stream.chunks == 1


@pytest.mark.parametrize("raw", [False, True], ids=["httpx", "raw"])
def test_a_compressed_stream_not_asked_for_is_refused_by_name(raw):
    body = gzip.compress(f"data: {_choice('a')}\n\ndata: [DONE]\n\n".encode())
    head = f"HTTP/1.1 200 OK\ncontent-type: text/event-stream\ncontent-encoding: gzip\ncontent-length: {len(body)}"
    with hostile(canned(head, body)) as url:
        stream = completion(Target(url, api="openai"), ReadOptions(timeout=10), raw=raw)
    assert "Content-Encoding: gzip, where the client asked for identity" in stream.failure


def test_with_gzip_asked_for_a_bomb_inflates_no_further_than_the_cap():
    before = peak_rss_mib()
    body = bomb()
    head = f"HTTP/1.1 200 OK\ncontent-type: text/event-stream\ncontent-encoding: gzip\ncontent-length: {len(body)}"
    with hostile(canned(head, body)) as url:
        stream = completion(Target(url, api="openai"), ReadOptions(timeout=30, gzip=True, max_bytes=4 << 20, max_event_bytes=64 << 20))
    assert stream.error == "the stream passed the client's cap of 4,194,304 bytes"
    assert stream.total_bytes <= (4 << 20) + (1 << 20), "inflated a megabyte at a time"
    assert peak_rss_mib() - before < 200


def test_with_gzip_asked_for_stacked_layers_are_refused_by_name():
    body = gzip.compress(bomb())
    head = f"HTTP/1.1 200 OK\ncontent-type: text/event-stream\ncontent-encoding: gzip, gzip\ncontent-length: {len(body)}"
    with hostile(canned(head, body)) as url:
        stream = completion(Target(url, api="openai"), ReadOptions(timeout=30, gzip=True))
    assert "Content-Encoding: gzip, gzip, where the client asked for one layer of gzip" in stream.failure
    assert stream.total_bytes == 0


def test_a_json_read_of_an_event_stream_stops_at_the_json_cap():
    with hostile(endless_stream) as url, pytest.raises(OSError, match=f"cap of {JSON_CAP:,} bytes"):
        get_json(url, "/v1/models", timeout=30)


@pytest.mark.parametrize("raw", [False, True], ids=["httpx", "raw"])
def test_a_server_that_never_answers_ends_at_the_bound_in_one_clear_line(raw):
    with hostile(silent) as url:
        stream = completion(Target(url), ReadOptions(timeout=2.0), raw=raw)
    assert stream.error == "no end within the 2 s bound of one request"


@pytest.mark.parametrize("raw", [False, True], ids=["httpx", "raw"])
def test_a_body_that_does_not_end_with_its_stream_is_waited_for_briefly(raw):
    """[DONE], then the connection stays open: the tokens are kept, and the read ends a short
    grace later saying why, not at the request's bound (nor at once: a reader that leaves by FIN
    without draining, drain_after_fin_s=0, still reads the body's end)."""
    body = chunk(f"data: {_choice('a')}\n\n".encode()) + chunk(b"data: [DONE]\n\n")
    with hostile(canned(OPENAI, body, hold_s=30)) as url:
        started = time.monotonic()
        stream = completion(Target(url, api="openai"), ReadOptions(timeout=20, drain_after_fin_s=0.0), raw=raw)
    assert stream.chunks == 1 and stream.completed
    assert stream.error == "the body did not end within 2 s of the stream's end"
    assert 1.5 < time.monotonic() - started < 6


def test_the_probe_keeps_a_few_model_ids_of_a_sane_length():
    """Every request carries the model id the probe found: not a 7 MB one, nor the millionth."""
    from labkit.lab import probe

    listed = json.dumps({"data": [{"id": "m" * 600}] + [{"id": f"model-{i}"} for i in range(1000)]}).encode()
    head = f"HTTP/1.1 200 OK\ncontent-type: application/json\ncontent-length: {len(listed)}"
    with hostile(canned(head, listed)) as url:
        ids, said = probe._models(Target(url, api="openai"))
    assert said == "yes" and ids == tuple(f"model-{i}" for i in range(probe.MAX_MODELS - 1))
    only_long = json.dumps({"data": [{"id": "m" * 600}]}).encode()
    with hostile(canned(f"HTTP/1.1 200 OK\ncontent-type: application/json\ncontent-length: {len(only_long)}",
                        only_long)) as url:  # fmt: skip
        assert probe._models(Target(url, api="openai")) == ((), "no model id of 1 to 512 characters")


@pytest.mark.parametrize("raw", [False, True], ids=["httpx", "raw"])
def test_a_body_that_ends_a_moment_after_its_stream_is_whole_even_without_a_drain(raw):
    """The deadline probes leave by FIN with no drain (drain_after_fin_s=0): a body's end that comes
    half a second after [DONE] is still read, and the stream is ok."""

    async def end_later(w) -> None:
        w.write((OPENAI.replace("\n", "\r\n") + "\r\n\r\n").encode() + chunk(f"data: {_choice('a')}\n\n".encode())
                + chunk(b"data: [DONE]\n\n"))  # fmt: skip
        await w.drain()
        await asyncio.sleep(0.5)
        w.write(b"0\r\n\r\n")
        await w.drain()
        await asyncio.sleep(5)

    with hostile(end_later) as url:
        stream = completion(Target(url, api="openai"), ReadOptions(timeout=20, drain_after_fin_s=0.0), raw=raw)
    assert stream.ok and stream.error is None and stream.chunks == 1


@pytest.mark.parametrize("queued", [False, True], ids=["one-after-another", "queued-for-the-connection"])
def test_bytes_past_an_answer_s_end_fail_it_and_never_answer_the_next_request(queued):
    """A second, unasked answer sent right behind the first sat in the kept-alive connection, and
    the next request on a shared client read it as its own without reaching the server (a review:
    50 "EVIL" tokens for an 8-token request). Now the first fails, and its connection is closed."""
    evil = f"{OPENAI}\n\n".replace("\n", "\r\n").encode() + sse_body(*[_choice("EVIL")] * 5, "[DONE]")
    behave, connections = canned(OPENAI, sse_body(_choice("ok"), _choice("", "length"), "[DONE]") + evil), []

    async def counted(w) -> None:
        connections.append(w)
        await behave(w)

    async def twice(url: str) -> list:
        request = Target(url, api="openai").request("hi", 8)
        async with async_client(url, 1, 10) as client:  # one connection: the second waits for the first's
            if not queued:
                return [await read(url, request, ReadOptions(timeout=10), client=client) for _ in range(2)]
            return list(await asyncio.gather(*(read(url, request, ReadOptions(timeout=10), client=client)
                                               for _ in range(2))))  # fmt: skip

    with hostile(counted) as url:
        first, second = run_sync(twice(url))
    assert "bytes past its answer's end, unasked for" in first.failure and first.text == "ok"
    assert second.text == "ok" and len(connections) == 2  # asked of the server, on a new connection


@pytest.mark.parametrize("raw", [False, True], ids=["httpx", "raw"])
def test_a_read_ends_with_the_run_s_budget_whatever_its_own_bound(raw):
    """A target that trickles pings holds each read to its own bound (300 s by default); a run
    with ``max_seconds`` ends them all by its end (a review: six such reads held a run 30 min)."""
    from labkit.lab.client import BUDGET_SPENT, RUN_ENDS

    with hostile(trickle_stream) as url:
        budget = RUN_ENDS.set(time.perf_counter() + 0.5)
        try:
            start = time.perf_counter()
            stream = completion(Target(url, api="openai"), ReadOptions(timeout=60), raw=raw)
        finally:
            RUN_ENDS.reset(budget)
    assert stream.error == BUDGET_SPENT and time.perf_counter() - start < 5


def test_a_blank_line_after_an_answer_is_ignored_as_rfc_9112_says():
    stream = _openai(_choice("ok"), _choice("", "length"), "[DONE]", head=OPENAI)
    with hostile(canned(OPENAI, sse_body(_choice("ok"), _choice("", "length"), "[DONE]") + b"\r\n")) as url:
        blank = completion(Target(url, api="openai"), ReadOptions(timeout=10))
    assert stream.ok and blank.ok and blank.text == stream.text == "ok"
