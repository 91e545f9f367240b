"""The raw reader: one request over a socket of its own, read through h11.

It exists for what httpx hides: a client that never reads, one that takes N bytes per read, one
with a small receive buffer, or one that leaves by FIN or RST at an exact moment. Leaving by FIN
is ``shutdown(SHUT_WR)`` (the client then drains what is in flight so the close stays orderly);
leaving by RST arms a zero linger and closes. :func:`hang_up` serves the httpx reader too.

Bounded as the httpx reader is: every byte received counts against the stream's cap (heads and
1xx answers within :data:`HEAD_ROOM` of it), a body that is not a stream against
:attr:`Stream.body_cap <labkit.lab.stream.Stream.body_cap>`, a kept wire against
:data:`~labkit.lab.kept.KEPT`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import h11

from labkit.lab.stream import EventSplitter, ReadOptions, Stream, json_or_text
from labkit.machine import linger_zero

if TYPE_CHECKING:
    from labkit.lab.client import Request

MIB = 1 << 20
HEAD_ROOM = MIB  # bytes of heads (and 1xx answers) the raw reader takes beyond a stream's cap
BASE_HEADERS = {"Accept-Encoding": "identity", "Accept": "text/event-stream, application/json"}


async def hang_up(result: Stream, options: ReadOptions, sock: socket.socket, recv: Any) -> None:
    """FIN by shutting our sending side, then reading what is left until the peer closes; RST by
    arming a zero linger (the caller's close sends it)."""
    result.left, result.left_at = options.leave_by, time.perf_counter()
    if options.leave_by == "rst":
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger_zero())
    else:
        with contextlib.suppress(OSError):  # already gone: the server closed first
            sock.shutdown(socket.SHUT_WR)
        with contextlib.suppress(Exception):  # a timeout, the peer's RST or close ends the drain
            await asyncio.wait_for(_drain(recv), options.drain_after_fin_s)
    result.ended = time.perf_counter()


async def _drain(recv: Any) -> None:
    while await recv():
        pass


async def read_raw(
    url: str, request: Request, options: ReadOptions, result: Stream, leave: asyncio.Event, hold: asyncio.Event | None
) -> None:
    parts = urlsplit(url)
    if parts.scheme != "http":
        raise OSError(f"the raw reader speaks plain http only, not {parts.scheme}")
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    loop = asyncio.get_running_loop()
    info = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    sock = socket.socket(info[0][0], socket.SOCK_STREAM)
    try:
        sock.setblocking(False)
        if options.rcvbuf is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, options.rcvbuf)
        await loop.sock_connect(sock, info[0][4])
        result.sent, result.socket = time.perf_counter(), sock
        conn = h11.Connection(h11.CLIENT)
        await loop.sock_sendall(sock, _wire(conn, f"{host}:{port}", request))
        if hold is not None:
            await asyncio.wait_for(hold.wait(), max(0.0, result.sent + options.bound_s - time.perf_counter()))
        if options.read:
            await _read_socket(sock, conn, result, options, leave)
        else:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(leave.wait(), max(0.0, result.sent + options.bound_s - time.perf_counter()))
        if result.ended is None:
            planned = leave.is_set() or result.should_leave(options) or options.bound_s < options.timeout
            if not planned and result.error is None:
                result.error = f"no end within the {options.timeout:g} s bound of one request"
            await hang_up(result, options, sock, lambda: loop.sock_recv(sock, 65536))
    finally:
        result.socket = None
        sock.close()


def _wire(conn: h11.Connection, host: str, request: Request) -> bytes:
    payload = b"" if request.body is None else json.dumps(request.body).encode()
    fields = [("Host", host), ("Connection", "close"), *BASE_HEADERS.items(), *request.headers.items()]
    if request.body is not None:
        fields += [("Content-Type", "application/json"), ("Content-Length", str(len(payload)))]
    wire = conn.send(h11.Request(method=request.method, target=request.path, headers=fields)) or b""
    if payload:
        wire += conn.send(h11.Data(data=payload)) or b""
    return wire + (conn.send(h11.EndOfMessage()) or b"")


async def _read_socket(
    sock: socket.socket, conn: h11.Connection, result: Stream, options: ReadOptions, leave: asyncio.Event
) -> None:
    loop, splitter, kept = asyncio.get_running_loop(), EventSplitter(), bytearray()
    received, most = 0, options.max_bytes + HEAD_ROOM  # every byte counts, heads and 1xx answers too
    flag = asyncio.ensure_future(leave.wait())
    try:
        while not leave.is_set() and not result.should_leave(options):
            left = result.body_end_by(options) - time.perf_counter()
            if left <= 0:
                if result.closed:
                    result.unended()
                return
            recv = asyncio.ensure_future(loop.sock_recv(sock, options.read_bytes))
            await asyncio.wait({recv, flag}, timeout=max(0.0, left), return_when=asyncio.FIRST_COMPLETED)
            if not recv.done():
                recv.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await recv
                if result.closed and not leave.is_set():
                    result.unended()
                return
            data = recv.result()
            received += len(data)
            if received > most:
                result.error = f"the answer passed the client's cap of {options.max_bytes:,} bytes"
                break
            if options.keep_wire:
                if not result.keep(len(data)):
                    break
                result.wire += data
            result.reads += bool(data)
            conn.receive_data(data)
            try:
                complete = _raw_events(conn, result, splitter, kept, options)
            except h11.RemoteProtocolError:
                if data or result.headers_at is None:
                    raise
                complete = True  # closed mid-body: a cut stream, not a client error
            if complete or not data or result.error:
                result.ended = time.perf_counter()
                break
            if options.pace:
                await asyncio.sleep(options.pace)
    finally:
        flag.cancel()
    if result.headers_at is not None and not result.content_type.startswith("text/event-stream") and not result.error:
        result.body = json_or_text(bytes(kept))


def _raw_events(conn: h11.Connection, result: Stream, splitter: EventSplitter, kept: bytearray, o: ReadOptions) -> bool:
    now = time.perf_counter()
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            return False
        if isinstance(event, h11.Response):
            headers: dict[str, str] = {}
            for k, v in event.headers:  # a repeated field's values joined, as httpx joins them
                name, value = k.decode("latin-1").lower(), v.decode("latin-1")
                headers[name] = f"{headers[name]}, {value}" if name in headers else value
            result.note_head(event.status_code, headers, now)
            if result.error:  # a head refused by name (an encoding not asked for, a field sent twice)
                return True
        elif isinstance(event, h11.Data):
            if result.content_type.startswith("text/event-stream"):
                if not result.take(splitter, bytes(event.data), now, o):
                    return True
            elif not result.take_body(kept, bytes(event.data)):
                return True
        elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
            return True
