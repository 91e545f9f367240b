"""The lab's two readers against a real server: what they record is what was sent.

Timing is never asserted here; counts, bytes, order and the server's state after a client leaves
are. (The hostile cases, where a server misbehaves, are in test_lab_client.py.)
"""
from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time

import pytest

from labkit.lab import LocalLab, ReadOptions, Request, Stream
from labkit.lab.client import percentile, read, run_sync
from labkit.lab.stream import EventSplitter, TimedEvent
from labkit.sse import sse_comment, sse_event

SHORT = Request("/v1/stream", {"prompt": "The capital of Italy is", "max_new_tokens": 12, "ignore_eos": True})
LONG = Request("/v1/stream", {"prompt": "Once upon a time", "max_new_tokens": 200, "ignore_eos": True})


@pytest.fixture(scope="module")
def lab(tiny_gpt2):
    with LocalLab(tiny_gpt2, max_batch=8) as target:
        yield target


@pytest.fixture(autouse=True)
def settled_after(request):
    yield
    if "lab" in request.fixturenames:
        books = request.getfixturevalue("lab").idle_books(timeout=10)
        assert books["cache_whole"] and books["open_streams"] == 0 and books["running"] == 0, books


def one(lab: LocalLab, request: Request, options: ReadOptions | None = None, **how) -> Stream:
    return run_sync(read(lab.url, request, options, **how))


def released(lab: LocalLab, rid: str) -> dict:
    return lab.released([rid], timeout=10)[0]


# --------------------------------------------------------------------------- pure parts


def test_event_splitter_charges_each_event_its_own_bytes_and_comments_to_the_next():
    first, ping, second = sse_event('{"a":1}', event="x", id=1), sse_comment("ping"), sse_event('{"b":2}', id=2)
    events = EventSplitter().feed(first + ping + second, now=1.0)
    assert [e.nbytes for e in events] == [len(first), len(ping) + len(second)]
    assert [e.data for e in events] == [{"a": 1}, {"b": 2}]


def _stream(newline: bytes) -> bytes:
    lines = [b"event: start", b"id: 1", b'data: {"a":1}', b"", b": ping", b"", b'data: {"b":', b"data: 2}",
             b"id: 2", b"", b"event: token", b'data: {"c":3}', b"", b"data: cut"]  # fmt: skip
    return newline.join(lines)


def _charged(splitter: EventSplitter, reads: list[bytes]) -> tuple[list[tuple], int]:
    events = [e for i, chunk in enumerate(reads) for e in splitter.feed(chunk, now=float(i))]
    return [(e.nbytes, e.event, e.id, repr(e.data)) for e in events], splitter.pending


@pytest.mark.parametrize("newline", [b"\n", b"\r\n", b"\r"], ids=["lf", "crlf", "cr"])
def test_event_splitter_charges_the_same_bytes_wherever_the_reads_are_cut(newline):
    stream = _stream(newline)
    whole, pending = _charged(EventSplitter(), [stream])
    assert len(whole) == 3 and sum(n for n, *_ in whole) + pending == len(stream)
    for cut in range(1, len(stream)):
        assert _charged(EventSplitter(), [stream[:cut], stream[cut:]]) == (whole, pending), f"cut at {cut}"
    assert _charged(EventSplitter(), [stream[i : i + 1] for i in range(len(stream))]) == (whole, pending)


@pytest.mark.parametrize("newline", [b"\n", b"\r\n", b"\r"], ids=["lf", "crlf", "cr"])
def test_a_complete_stream_leaves_nothing_pending_whatever_its_line_ends(newline):
    stream = newline.join([b"data: 1", b"", b"data: 2", b"", b""])
    for reads in ([stream], [stream[i : i + 1] for i in range(len(stream))]):
        splitter = EventSplitter()
        assert len([e for chunk in reads for e in splitter.feed(chunk, now=0.0)]) == 2 and splitter.pending == 0


def test_openai_chunks_are_read_as_tokens_finish_and_usage():
    stream = Stream(api="openai-chat")
    for data in ({"choices": [{"delta": {"role": "assistant"}, "finish_reason": None}]},
                 {"choices": [{"delta": {"content": "Hi"}, "finish_reason": None}]},
                 {"choices": [{"delta": {"content": " there"}, "finish_reason": None}]},
                 {"choices": [{"delta": {}, "finish_reason": "length"}]},
                 {"choices": [], "usage": {"completion_tokens": 2}}, "[DONE]"):  # fmt: skip
        stream.add(TimedEvent(1.0, 10, "message", "", data if isinstance(data, str) else json.dumps(data)))
    assert (stream.chunks, stream.tokens, stream.text, stream.finish_reason) == (2, 2, "Hi there", "length")
    assert stream.completed


def test_percentile_interpolates_and_skips_missing_values():
    assert percentile([1, 2, 3, 4, None], 50) == 2.5 and percentile(range(101), 99) == 99.0
    assert percentile([], 50) != percentile([], 50)  # NaN


def test_run_sync_works_inside_a_running_loop():
    async def outer() -> int:
        async def inner() -> int:
            return 7

        return run_sync(inner())  # what a notebook cell does under ipykernel's loop

    assert asyncio.run(outer()) == 7


RENDERED = """
from labkit.lab.client import run_sync
rendered = []
class Costly:
    def __repr__(self):
        rendered.append(1)
        return "Costly"
async def made():
    return Costly()
assert isinstance(run_sync(made()), Costly)
print(len(rendered))
"""


def test_run_sync_never_renders_its_result():
    """asyncio.run ends by building its main task's repr, where SIGINT's handler is Python's own
    (a script's, not pytest's: hence a process of its own): a returned Stream of 1,000 events that
    each carry a 1 MiB id was rendered whole, 2 GB, from a hostile server's answer of 1 MB."""
    done = subprocess.run([sys.executable, "-c", RENDERED], capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.strip() == "0", done.stdout


@pytest.mark.parametrize("line", [b"data: ab\n", b"event: x\n", b": comment\n"])
def test_an_event_that_never_ends_stops_at_the_event_cap(line):
    """Data lines with no blank line pile up in the parser; the cap on one event bounds them."""
    stream, splitter, options = Stream(), EventSplitter(), ReadOptions(max_event_bytes=4096)
    reads = [stream.take(splitter, line * 64, 0.0, options) for _ in range(100)]
    assert reads.index(False) == 4096 // (64 * len(line)) and stream.events == [], reads
    assert stream.error == "an event passed the client's cap of 4,096 bytes of data"


# --------------------------------------------------------------------------- against a server


@pytest.mark.parametrize("raw", [False, True], ids=["httpx", "raw"])
def test_every_event_is_recorded_in_order_with_its_bytes(lab, raw):
    r = one(lab, SHORT, raw=raw)
    assert r.ok and r.status == 200 and [e.event for e in r.events] == ["start"] + ["token"] * 12 + ["done"]
    assert r.request_id == r.events[0].data["request_id"]
    assert sum(e.nbytes for e in r.events) + r.unfinished_bytes == r.total_bytes and r.unfinished_bytes == 0
    assert r.last_event_id == str(len(r.events)) and len(r.gaps) == 11 and r.finish_reason == "length"
    assert r.usage == {"prompt_tokens": r.events[0].data["prompt_tokens"], "completion_tokens": 12}


def test_both_readers_read_the_same_stream(lab):
    assert one(lab, SHORT, raw=True).token_ids == one(lab, SHORT).token_ids


@pytest.mark.parametrize("raw", [False, True], ids=["httpx", "raw"])
def test_a_refusal_is_recorded_with_its_json_body(lab, raw):
    r = one(lab, Request("/v1/stream", {"prompt": ""}), raw=raw)
    assert r.status == 422 and r.events == [] and r.body["error"]["type"] == "invalid_request"
    assert r.error.startswith("HTTP 422: ") and not r.ok


@pytest.mark.parametrize("raw", [False, True], ids=["httpx", "raw"])
@pytest.mark.parametrize("how", ["fin", "rst"])
def test_a_reader_leaves_after_n_tokens_and_the_server_releases(lab, how, raw):
    r = one(lab, LONG, ReadOptions(leave_after_tokens=3, leave_by=how), raw=raw)
    assert r.left == how and 3 <= r.chunks < 200 and not r.completed and r.error is None and r.failure is None
    assert released(lab, r.request_id)["finish_reason"] == "cancelled"


def test_a_paced_raw_reader_taking_a_few_bytes_a_read_reads_the_same_events(lab):
    whole = one(lab, SHORT, raw=True)
    paced = one(lab, SHORT, ReadOptions(read_bytes=7, pace=0.001), raw=True)
    assert paced.ok and paced.token_ids == whole.token_ids
    assert [e.nbytes for e in paced.events][1:] == [e.nbytes for e in whole.events][1:]  # start's id differs
    assert len({e.time for e in paced.events}) == len(paced.events)  # no two events came in one 7-byte read


def test_a_raw_reader_leaves_when_told_to(lab):
    async def run() -> Stream:
        flag, result = asyncio.Event(), Stream()
        reader = asyncio.ensure_future(read(lab.url, LONG, ReadOptions(leave_by="rst"), leave=flag, result=result))
        while len(result.token_times) < 3 and not reader.done():
            await asyncio.sleep(0.005)
        flag.set()
        return await reader

    r = run_sync(run())
    assert r.left == "rst" and r.error is None and 3 <= r.chunks < 200 and not r.completed


def test_a_reader_that_never_reads_leaves_on_time(lab):
    r = one(lab, LONG, ReadOptions(read=False, leave_after_s=0.2, leave_by="rst"))
    assert r.left == "rst" and r.events == [] and r.status == 0 and r.error is None


def test_a_reader_that_never_reads_needs_a_time_to_leave():
    with pytest.raises(ValueError, match="leave_after_s"):
        ReadOptions(read=False)


def test_a_raw_read_that_runs_out_of_time_is_an_error(lab):
    """256 bytes every 0.05 s takes seconds for a 200-token stream, however fast the engine."""
    r = one(lab, LONG, ReadOptions(pace=0.05, read_bytes=256, timeout=0.3), raw=True)
    assert r.error == "no end within the 0.3 s bound of one request" and r.left == "fin"


def test_a_launch_sends_every_request_before_any_stream_ends(lab):
    launch = lab.launch([SHORT] * 4)
    assert len(launch.streams) == 4 and launch.tokens == 48 and launch.row()["failed"] == 0
    assert max(s.sent for s in launch.streams) < min(s.ended for s in launch.streams)


def test_connecting_is_bounded_by_the_read_timeout_too():
    """A listener whose accept queue is full drops the SYN: without a bound, connect retries for minutes."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    fillers = []
    try:
        for _ in range(4):
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(listener.getsockname())
            fillers.append(s)
        start = time.perf_counter()
        r = run_sync(read(f"http://127.0.0.1:{listener.getsockname()[1]}", SHORT, ReadOptions(timeout=0.5), raw=True))
        assert time.perf_counter() - start < 5 and r.error
    finally:
        for s in fillers:
            s.close()
        listener.close()
