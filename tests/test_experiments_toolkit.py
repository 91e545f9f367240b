"""The experiment toolkit against a real server: what the clients record is what was sent.

Timing is never asserted here; counts, bytes, order and the server's state after a client
leaves are.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from labkit.experiments.client import (
    EventSplitter,
    ReadOptions,
    StreamResult,
    async_client,
    launch_in_turn,
    launch_streams,
    percentiles,
    run_sync,
    timed_stream,
)
from labkit.experiments.rawhttp import Leave, RawConnection, raw_stream
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


async def _one(url: str, body: dict, options: ReadOptions | None = None) -> StreamResult:
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


def _stream(newline: bytes) -> bytes:
    """Events, a comment between them, a multi-line event and an unfinished tail, with ``newline``."""
    lines = [
        b"event: start",
        b"id: 1",
        b'data: {"a":1}',
        b"",
        b": ping",
        b"",
        b'data: {"b":',
        b"data: 2}",
        b"id: 2",
        b"",
        b"event: token",
        b'data: {"c":3}',
        b"",
        b"data: cut",
    ]
    return newline.join(lines)


def _charged(splitter: EventSplitter, reads: list[bytes]) -> tuple[list[tuple], int]:
    events = [e for i, read in enumerate(reads) for e in splitter.feed(read, now=float(i))]
    return [(e.nbytes, e.event, e.id, repr(e.data)) for e in events], splitter.pending


@pytest.mark.parametrize("newline", [b"\n", b"\r\n", b"\r"], ids=["lf", "crlf", "cr"])
def test_event_splitter_charges_the_same_bytes_wherever_the_reads_are_cut(newline):
    stream = _stream(newline)
    whole, pending = _charged(EventSplitter(), [stream])
    assert len(whole) == 3 and sum(n for n, *_ in whole) + pending == len(stream)
    for cut in range(1, len(stream)):
        assert _charged(EventSplitter(), [stream[:cut], stream[cut:]]) == (whole, pending), f"cut at {cut}"
    assert _charged(EventSplitter(), [stream[i : i + 1] for i in range(len(stream))]) == (whole, pending)


def test_event_splitter_stamps_an_event_with_the_read_that_completed_it():
    first, second = sse_event('{"a":1}', id=1), sse_event('{"b":2}', id=2)
    splitter = EventSplitter()
    assert splitter.feed(first[:-1], now=1.0) == []  # the blank line's LF has not come yet
    events = splitter.feed(first[-1:] + second, now=2.0)
    assert [(e.time, e.nbytes) for e in events] == [(2.0, len(first)), (2.0, len(second))]


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
    r = run_sync(_one(server.url, BODY, ReadOptions(sleep=0.01)))
    assert len(r.tokens) == 12 and r.finish_reason == "length"


def test_raw_client_reads_the_same_stream_as_httpx(server):
    raw = run_sync(raw_stream(server.url, BODY))
    lib = run_sync(_one(server.url, BODY))
    assert raw.error is None and raw.status == 200 and raw.content_type.startswith("text/event-stream")
    assert raw.token_ids == lib.token_ids and raw.text == lib.text
    assert [e.event for e in raw.events] == [e.event for e in lib.events]
    assert raw.request_id == raw.events[0].data["request_id"] == raw.headers["x-request-id"]
    assert raw.last_event_id == str(len(raw.events)) and raw.unfinished_bytes == 0
    assert sum(e.nbytes for e in raw.events) == raw.total_bytes  # h11 undid the chunking: SSE bytes only


def test_raw_client_paced_a_few_bytes_a_read_reads_the_same_events(server):
    whole = run_sync(raw_stream(server.url, BODY))
    paced = run_sync(raw_stream(server.url, BODY, ReadOptions(read_bytes=7, sleep=0.001)))
    assert paced.error is None and paced.token_ids == whole.token_ids
    assert [e.nbytes for e in paced.events][1:] == [e.nbytes for e in whole.events][1:]  # start's id differs
    assert len({e.time for e in paced.events}) == len(paced.events)  # no two events came in one 7-byte read


def test_raw_client_records_a_refusal_with_its_json_body(server):
    r = run_sync(raw_stream(server.url, {"prompt": ""}))
    assert r.status == 422 and r.events == [] and r.error is None
    assert r.body["error"]["type"] == "invalid_request" and r.ended is not None


@pytest.mark.parametrize("how", ["fin", "rst"])
def test_raw_client_leaves_by_fin_or_rst_and_the_server_releases(server, how):
    r = run_sync(raw_stream(server.url, LONG, leave_after_tokens=2, leave_by=how))
    assert r.left == how and len(r.tokens) == 2 and r.error is None
    _assert_settled(server)
    assert _released_record(server, r.request_id).finish_reason == "cancelled"


def test_raw_client_leaves_when_its_flag_is_set(server):
    async def run() -> StreamResult:
        flag, result = Leave(), StreamResult(sent=0.0)
        reader = asyncio.ensure_future(raw_stream(server.url, LONG, leave=flag, result=result, leave_by="rst"))
        while len(result.tokens) < 3 and not reader.done():
            await asyncio.sleep(0.005)
        flag.set()
        return await reader

    r = run_sync(run())
    assert r.left == "rst" and r.error is None and 3 <= len(r.tokens) < 200 and r.terminal is None
    _assert_settled(server)


def test_raw_client_that_never_reads_leaves_on_time(server):
    r = run_sync(raw_stream(server.url, LONG, read=False, leave_after_s=0.2, leave_by="rst"))
    assert r.left == "rst" and r.events == [] and r.status == 0 and r.error is None


def test_raw_client_that_never_reads_needs_a_time_to_leave():
    with pytest.raises(ValueError, match="leave_after_s"):
        ReadOptions(read=False)


def test_raw_connection_sets_its_receive_buffer_before_connecting():
    import socket

    conn = RawConnection("http://127.0.0.1:1", rcvbuf=4096)
    try:
        assert conn.sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) == 2 * 4096  # Linux doubles it
    finally:
        conn.close()


def test_raw_client_records_a_stream_the_server_cut_as_cut_not_as_an_error():
    """What a ``drop`` policy does: chunked head, one event and half of the next, then close."""
    first, second = sse_event('{"a":1}', id=1), sse_event('{"b":2}', id=2)
    sent = first + second[:5]

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
        writer.write(head + f"{len(sent):x}\r\n".encode() + sent + b"\r\n")
        await writer.drain()
        writer.close()

    async def run() -> StreamResult:
        cutter = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = cutter.sockets[0].getsockname()[1]
        async with cutter:
            return await raw_stream(f"http://127.0.0.1:{port}", BODY)

    r = run_sync(run())
    assert r.error is None and r.status == 200 and r.left is None and r.ended is not None
    assert [e.data for e in r.events] == [{"a": 1}] and r.terminal is None
    assert r.total_bytes == len(sent) and r.unfinished_bytes == 5


def test_a_raw_read_that_runs_out_of_time_is_an_error(server):
    """256 bytes every 0.05 s reads the ~14 kB of a 200-token stream in about 3 s, however fast
    the engine: the 0.3 s bound comes first."""
    r = run_sync(raw_stream(server.url, LONG, sleep=0.05, read_bytes=256, timeout=0.3))
    assert r.error is not None and r.error.startswith("TimeoutError") and r.left == "fin"


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


def test_connecting_is_bounded_by_the_reader_timeout_too():
    """A listener whose accept queue is full drops the SYN: without a bound, connect retries for minutes."""
    import socket as socketlib

    listener = socketlib.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    fillers = []
    try:
        for _ in range(4):  # fill the accept queue (nobody accepts)
            s = socketlib.socket()
            s.setblocking(False)
            s.connect_ex(listener.getsockname())
            fillers.append(s)
        url = "http://127.0.0.1:%d" % listener.getsockname()[1]
        start = time.perf_counter()
        r = run_sync(raw_stream(url, BODY, timeout=0.5))
        assert time.perf_counter() - start < 5 and r.error
    finally:
        for s in fillers:
            s.close()
        listener.close()


@pytest.mark.parametrize("newline", [b"\n", b"\r\n", b"\r"], ids=["lf", "crlf", "cr"])
def test_a_complete_stream_leaves_nothing_pending_whatever_its_line_ends(newline):
    """sse-starlette ends lines with CRLF: its last blank line's LF is not an unfinished event."""
    stream = newline.join([b"data: 1", b"", b"data: 2", b"", b""])
    for reads in ([stream], [stream[i : i + 1] for i in range(len(stream))]):
        splitter = EventSplitter()
        events = [e for read in reads for e in splitter.feed(read, now=0.0)]
        assert len(events) == 2 and splitter.pending == 0
    splitter = EventSplitter()
    splitter.feed(stream + b"data: 3", now=0.0)
    assert splitter.pending == len(b"data: 3") + (1 if newline == b"\r\n" else 0)


def test_a_server_that_stalls_before_the_planned_leave_is_recorded_as_timed_out():
    """Leaving after 5 tokens was the plan; a server that sends one and stalls must not look like it."""
    import socket as socketlib
    import threading

    listener = socketlib.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    done = threading.Event()

    def stall() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(65536)
            event = b'event: token\ndata: {"token_id": 1, "text": "a"}\n\n'
            conn.sendall(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                + b"%x\r\n" % len(event)
                + event
                + b"\r\n"
            )
            done.wait(10)

    server = threading.Thread(target=stall, daemon=True)
    server.start()
    try:
        url = "http://127.0.0.1:%d" % listener.getsockname()[1]
        r = run_sync(raw_stream(url, BODY, leave_after_tokens=5, timeout=0.5))
        assert r.error and "TimeoutError" in r.error
    finally:
        done.set()
        server.join(10)
        listener.close()
