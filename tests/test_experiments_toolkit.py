"""The experiment toolkit against a real server: what the clients record is what was sent.

Timing is never asserted here; counts, bytes, order and the server's state after a client
leaves are.
"""
from __future__ import annotations

import asyncio
import time

import pytest

from labkit.experiments.client import (
    EventSplitter, ReadOptions, StreamResult, async_client, launch_in_turn, launch_streams, percentiles,
    run_sync, timed_stream)
from labkit.experiments.rawhttp import ChunkedDecoder, raw_stream
from labkit.sse import sse_comment, sse_event

BODY = {"prompt": "The capital of Italy is", "max_new_tokens": 12}
LONG = {"prompt": "Once upon a time", "max_new_tokens": 200}


@pytest.fixture(scope="module")
def server(tiny_gpt2):
    from labkit.server import serve_in_thread

    with serve_in_thread(tiny_gpt2, max_batch=8) as srv:
        yield srv


@pytest.fixture(autouse=True)
def cache_whole_after(request):
    yield
    if "server" in request.fixturenames:
        _assert_settled(request.getfixturevalue("server"))


def _assert_settled(srv, timeout: float = 10.0) -> None:
    """Every stream gone from the hub and the engine, every block back, the books consistent."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = srv.engine.stats()
        if srv.hub.open_streams == 0 and stats["running"] == 0 and stats["waiting"] == 0:
            break
        time.sleep(0.02)
    stats = srv.engine.stats()
    assert (srv.hub.open_streams, stats["running"], stats["waiting"]) == (0, 0, 0), stats
    assert stats["free_blocks"] == stats["total_blocks"]
    srv.engine.check_integrity()


def _released_record(srv, rid: str, timeout: float = 5.0):
    """The hub's record once the engine's finish reached the loop (it arrives a moment after)."""
    deadline = time.monotonic() + timeout
    record = srv.hub.record(rid)
    while (record is None or record.released is None) and time.monotonic() < deadline:
        time.sleep(0.01)
        record = srv.hub.record(rid)
    return record


async def _one(url: str, body: dict, options: ReadOptions = ReadOptions()) -> StreamResult:
    async with async_client(url) as client:
        return await timed_stream(client, body, options=options)


# --------------------------------------------------------------------------- pure parts


def test_event_splitter_charges_each_event_its_own_bytes_and_comments_to_the_next():
    first, ping, second = sse_event('{"a":1}', event="x", id=1), sse_comment("ping"), sse_event('{"b":2}', id=2)
    events = EventSplitter().feed(first + ping + second, now=1.0)
    assert [e.nbytes for e in events] == [len(first), len(ping) + len(second)]
    assert [e.data for e in events] == [{"a": 1}, {"b": 2}]


def test_event_splitter_keeps_a_cut_event_pending():
    data = sse_event('{"a":1}', id=1)
    splitter = EventSplitter()
    assert splitter.feed(data[:5], 0.0) == [] and splitter.pending == 5
    assert len(splitter.feed(data[5:], 1.0)) == 1 and splitter.pending == 0


def test_chunked_decoder_gives_the_same_body_whatever_the_chunking():
    wire = b"5\r\nhello\r\n1;ext=1\r\n \r\n6\r\nworld!\r\n0\r\n\r\n"
    whole = ChunkedDecoder()
    assert whole.feed(wire) == b"hello world!" and whole.done
    split = ChunkedDecoder()
    assert b"".join(split.feed(wire[i : i + 1]) for i in range(len(wire))) == b"hello world!" and split.done


def test_percentiles_interpolate_and_skip_missing_values():
    assert percentiles([1, 2, 3, 4, None], (50,)) == {"p50": 2.5}
    assert percentiles(range(101), (50, 99)) == {"p50": 50.0, "p99": 99.0}
    empty = percentiles([], (50, 99))
    assert set(empty) == {"p50", "p99"} and all(v != v for v in empty.values())


def test_run_sync_works_inside_a_running_loop():
    async def inner() -> int:
        await asyncio.sleep(0)
        return 7

    async def outer() -> int:
        return run_sync(inner())  # what a notebook cell does under ipykernel's loop

    assert asyncio.run(outer()) == 7


# --------------------------------------------------------------------------- against a server


def test_timed_stream_records_every_event_in_order_with_its_bytes(server):
    r = run_sync(_one(server.url, BODY))
    assert r.status == 200 and r.error is None
    assert r.content_type.startswith("text/event-stream")
    kinds = [e.event for e in r.events]
    assert kinds == ["start"] + ["token"] * 12 + ["done"]
    assert r.request_id == r.events[0].data["request_id"]
    assert sum(e.nbytes for e in r.events) + r.unfinished_bytes == r.total_bytes
    assert r.unfinished_bytes == 0 and r.last_event_id == str(len(r.events))
    assert r.ttft is not None and len(r.gaps) == 11 and r.finish_reason == "length"
    assert r.usage == {"prompt_tokens": r.events[0].data["prompt_tokens"], "completion_tokens": 12}


def test_a_refusal_is_recorded_with_its_json_body(server):
    r = run_sync(_one(server.url, {"prompt": ""}))
    assert r.status == 422 and r.events == [] and r.body["error"]["type"] == "invalid_request"


@pytest.mark.parametrize("how", ["fin", "rst"])
def test_httpx_reader_leaves_after_n_tokens_and_the_server_releases(server, how):
    r = run_sync(_one(server.url, LONG, ReadOptions(leave_after_tokens=3, leave_by=how)))
    assert r.left == how and len(r.tokens) == 3 and r.terminal is None
    _assert_settled(server)
    assert _released_record(server, r.request_id).finish_reason == "cancelled"


def test_slow_reader_still_reads_everything(server):
    r = run_sync(_one(server.url, BODY, ReadOptions(sleep_per_chunk=0.01)))
    assert len(r.tokens) == 12 and r.finish_reason == "length"


def test_raw_client_reads_the_same_stream_as_httpx(server):
    raw = run_sync(raw_stream(server.url, BODY))
    lib = run_sync(_one(server.url, BODY))
    assert raw.error is None and raw.status == 200
    assert raw.token_ids == lib.token_ids and raw.text == lib.text
    assert raw.request_id == raw.events[0].data["request_id"]
    assert raw.last_event_id == str(len(raw.events)) and raw.unfinished_bytes == 0


@pytest.mark.parametrize("how", ["fin", "rst"])
def test_raw_client_leaves_by_fin_or_rst_and_the_server_releases(server, how):
    r = run_sync(raw_stream(server.url, LONG, leave_after_tokens=2, leave_by=how))
    assert r.left == how and len(r.tokens) == 2 and r.error is None
    _assert_settled(server)
    assert _released_record(server, r.request_id).finish_reason == "cancelled"


def test_raw_client_that_never_reads_leaves_on_time(server):
    r = run_sync(raw_stream(server.url, LONG, read=False, leave_after_s=0.2, leave_by="rst"))
    assert r.left == "rst" and r.events == [] and r.status == 0


def test_launch_streams_sends_every_request_before_any_stream_ends(server):
    launch = run_sync(launch_streams(server.url, [BODY] * 4))
    assert len(launch.results) == 4 and launch.tokens == 48
    assert max(r.sent for r in launch.results) < min(r.ended for r in launch.results)
    assert launch.makespan == max(r.ended for r in launch.results) - min(r.sent for r in launch.results)


def test_launch_in_turn_sends_each_request_after_the_previous_stream_ended(server):
    in_turn = run_sync(launch_in_turn(server.url, [BODY] * 3))
    assert in_turn.tokens == 36
    for before, after in zip(in_turn.results, in_turn.results[1:]):
        assert after.sent >= before.ended
