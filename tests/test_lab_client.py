"""The lab's client stays bounded against a hostile server: every body it reads has a cap, every
request an overall deadline that a trickle cannot reset, compression is declined, and a failure
is one clear line. Each test runs a misbehaving server on 127.0.0.1 (tests/hostile_helpers.py)."""
from __future__ import annotations

import resource
import time

import pytest
from hostile_helpers import (
    cut_after_ids,
    cut_mid_chunk,
    endless_stream,
    gzip_bomb,
    hostile,
    huge_json,
    informational_flood,
    malformed,
    redirect,
    trickle_json,
    trickle_stream,
)

from labkit.lab import ReadOptions, Request, Target
from labkit.lab.client import JSON_CAP, get_json, read, run_sync
from labkit.lab.probe import connect
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


def test_a_gzip_bomb_is_never_inflated():
    """The client asks for identity and never decodes: the half megabyte stays half a megabyte."""
    before = peak_rss_mib()
    with hostile(gzip_bomb) as url:
        status, body = get_json(url, "/v1/models", timeout=30)
    assert status == 200 and isinstance(body, str) and len(body) < 2 << 20
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
                                     b'{"choices": [{"text": {"a": 1}, "finish_reason": null}]}'],
                         ids=["bad-id", "bad-choices", "deep", "text-not-a-string"])
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
