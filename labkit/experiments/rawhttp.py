"""A raw-socket HTTP/1.1 client on h11: for the moments a library client hides.

httpx decides when bytes are read and how a connection ends. The buffers, disconnect and
slow-client experiments need to choose: a client that sends a request and never reads a byte,
one that takes at most N bytes per read and sleeps between reads, one with a small receive
buffer, or one that leaves by FIN or RST at an exact moment (before the head arrives, after N
tokens, when told to). This client owns its socket and that timing; h11 speaks the HTTP (the
request, the response head, chunked transfer encoding), and the body's bytes go to the same
:class:`~labkit.experiments.records.EventSplitter` as the httpx reader's. It takes the same
:class:`~labkit.experiments.records.ReadOptions` and reports in the same
:class:`~labkit.experiments.records.StreamResult` as
:func:`labkit.experiments.client.timed_stream`, so tables mix both clients freely.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from dataclasses import replace
from typing import Any
from urllib.parse import urlsplit

import h11

from labkit.experiments.client import leave_socket
from labkit.experiments.records import EventSplitter, LeaveBy, ReadOptions, StreamResult, json_or_text

__all__ = ["Leave", "RawConnection", "raw_stream"]

_KEEP_BODY = 64 * 1024  # of a body that is not a stream (a refusal), this much is kept


class Leave:
    """A flag a running reader watches: :meth:`set` it (on the reader's loop) and it leaves now."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    @property
    def now(self) -> bool:
        return self._event.is_set()

    def set(self) -> None:
        self._event.set()

    async def wait(self) -> None:
        await self._event.wait()


class RawConnection:
    """One TCP connection driven with non-blocking socket calls on the running loop; h11 keeps
    the HTTP/1.1 state. ``rcvbuf`` sets ``SO_RCVBUF`` before connecting."""

    def __init__(self, base_url: str, rcvbuf: int | None = None) -> None:
        parts = urlsplit(base_url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            self.sock.setblocking(False)
            if rcvbuf is not None:
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        except OSError:
            self.sock.close()  # never leak the socket of a connection that could not be set up
            raise
        self.http = h11.Connection(h11.CLIENT)
        self.closed = False

    async def connect(self) -> None:
        await asyncio.get_running_loop().sock_connect(self.sock, (self.host, self.port))

    async def send(self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None) -> None:
        """One request, JSON ``body`` if given, ``Connection: close``: this socket serves one response."""
        payload = b"" if body is None else json.dumps(body).encode()
        fields = [("Host", f"{self.host}:{self.port}"), ("Accept", "text/event-stream"), ("Connection", "close")]
        if body is not None:
            fields += [("Content-Type", "application/json"), ("Content-Length", str(len(payload)))]
        fields += list((headers or {}).items())
        wire = self.http.send(h11.Request(method=method, target=path, headers=fields)) or b""
        if payload:
            wire += self.http.send(h11.Data(data=payload)) or b""
        wire += self.http.send(h11.EndOfMessage()) or b""
        await asyncio.get_running_loop().sock_sendall(self.sock, wire)

    async def recv(self, timeout: float | None = None, size: int = 65536) -> bytes:
        """The next bytes off the socket, ``b""`` at the server's close; TimeoutError after ``timeout``."""
        return await asyncio.wait_for(asyncio.get_running_loop().sock_recv(self.sock, size), timeout)

    def leave(self, how: LeaveBy) -> None:
        """FIN (shut our side; the caller may :meth:`drain` then :meth:`close`) or RST (close now)."""
        leave_socket(self.sock, how)
        if how == "rst":
            self.close()

    async def drain(self, seconds: float) -> int:
        """After a FIN: read (raw, unparsed) until the server closes or ``seconds`` pass; the bytes read."""
        total, deadline = 0, time.perf_counter() + seconds
        while not self.closed and (left := deadline - time.perf_counter()) > 0:
            try:
                chunk = await self.recv(left)
            except (asyncio.TimeoutError, OSError):
                break
            if not chunk:
                break
            total += len(chunk)
        return total

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.sock.close()


async def raw_stream(
    url: str,
    body: dict[str, Any],
    options: ReadOptions | None = None,
    *,
    path: str = "/v1/stream",
    headers: dict[str, str] | None = None,
    leave: Leave | None = None,
    result: StreamResult | None = None,
    **fields: Any,
) -> StreamResult:
    """POST ``body`` to ``path`` over a fresh socket and read the response as ``options`` say
    (``fields`` replace single options: ``raw_stream(url, body, leave_by="rst")``).

    Leaves by ``leave_by`` when ``leave_after_tokens`` tokens are in (0: once the head is in),
    at ``leave_after_s`` (or ``timeout``) from sending, or when ``leave`` is set, whichever comes
    first. Pass your own ``result`` to watch it fill while the stream runs. Never raises for
    I/O; the connection is always closed on return.
    """
    opts = replace(options or ReadOptions(), **fields)
    result = result or StreamResult(sent=0.0)
    result.sent = time.perf_counter()
    stop = _Stop(opts, leave or Leave())
    conn: RawConnection | None = None
    try:
        conn = RawConnection(url, opts.rcvbuf)
        # connecting and sending are bounded too: a dropped SYN would otherwise retry for minutes
        await asyncio.wait_for(conn.connect(), opts.bound_s)
        result.sent = time.perf_counter()
        await asyncio.wait_for(conn.send("POST", path, body, headers), opts.bound_s)
        if opts.read:
            await _read(conn, result, opts, stop)
        else:
            await stop.sleep(result)
        if result.ended is None:
            if stop.timed_out(result):
                result.error = f"TimeoutError: no end within {opts.timeout:g} s"
            await _leave(conn, result, opts)
    except (OSError, asyncio.TimeoutError, h11.ProtocolError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    finally:
        stop.close()
        if conn is not None:
            conn.close()
        result.ended = result.ended or time.perf_counter()
    return result


class _Stop:
    """When a reader stops reading: its bound in time, the ``leave`` flag, a number of tokens."""

    def __init__(self, options: ReadOptions, leave: Leave) -> None:
        self.options, self.leave = options, leave
        self._flag: asyncio.Future[None] | None = None

    def now(self, result: StreamResult) -> bool:
        n = self.options.leave_after_tokens
        enough = n is not None and result.headers_at is not None and len(result.tokens) >= n
        return (enough and result.terminal is None) or self.leave.now or self._left(result) <= 0

    def timed_out(self, result: StreamResult) -> bool:
        """Stopped by ``timeout``: no planned leave ended it (the flag, enough tokens, or a
        ``leave_after_s`` within the timeout), whatever leave was planned."""
        o = self.options
        n = o.leave_after_tokens
        enough = n is not None and result.headers_at is not None and len(result.tokens) >= n
        planned_time = o.leave_after_s is not None and o.leave_after_s <= o.timeout
        return not (self.leave.now or enough or planned_time)

    async def recv(self, conn: RawConnection, result: StreamResult) -> bytes | None:
        """The next read (``b""``: the server closed), or None if the bound or the flag came first."""
        if self.leave.now or self._left(result) <= 0:
            return None
        read: asyncio.Future[Any] = asyncio.ensure_future(
            asyncio.get_running_loop().sock_recv(conn.sock, self.options.read_bytes)
        )
        flag: asyncio.Future[Any] = self._flag_future()
        await asyncio.wait({read, flag}, timeout=self._left(result), return_when=asyncio.FIRST_COMPLETED)
        if not read.done():
            read.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await read
        return read.result() if read.done() and not read.cancelled() else None

    async def sleep(self, result: StreamResult) -> None:
        """Until the bound or the flag: a client that never reads."""
        await asyncio.wait({self._flag_future()}, timeout=max(0.0, self._left(result)))

    def _left(self, result: StreamResult) -> float:
        return result.sent + self.options.bound_s - time.perf_counter()

    def _flag_future(self) -> asyncio.Future[None]:
        if self._flag is None:
            self._flag = asyncio.ensure_future(self.leave.wait())
        return self._flag

    def close(self) -> None:
        if self._flag is not None:
            self._flag.cancel()


async def _read(conn: RawConnection, result: StreamResult, opts: ReadOptions, stop: _Stop) -> None:
    """Read the response until it ends, the server closes, or ``stop`` says so (then the caller
    leaves). The body's bytes of each read go to the splitter stamped with the read's time."""
    splitter, kept = EventSplitter(), bytearray()
    while True:
        data = await stop.recv(conn, result)
        if data is None:
            return
        conn.http.receive_data(data)
        try:
            complete = _take(conn.http, result, splitter, kept, time.perf_counter())
        except h11.RemoteProtocolError:
            if data or result.headers_at is None:
                raise
            complete = True  # the server closed in the middle of the body: a cut stream, not an error
        if complete or not data:
            break
        if stop.now(result):
            return
        if opts.sleep:
            await asyncio.sleep(opts.sleep)
            if stop.now(result):
                return
    result.ended = time.perf_counter()
    if not result.content_type.startswith("text/event-stream"):
        result.body = json_or_text(bytes(kept))


def _take(http: h11.Connection, result: StreamResult, splitter: EventSplitter, kept: bytearray, now: float) -> bool:
    """Everything h11 can make of the bytes so far; True once the response is complete."""
    while True:
        event = http.next_event()
        if event is h11.NEED_DATA:
            return False
        if isinstance(event, h11.Response):
            result.headers_at, result.status = now, event.status_code
            result.headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in event.headers}
            result.content_type = result.headers.get("content-type", "")
            result.request_id = result.headers.get("x-request-id")
        elif isinstance(event, h11.Data):
            result.total_bytes += len(event.data)
            if result.content_type.startswith("text/event-stream"):
                result.events += splitter.feed(bytes(event.data), now)
                result.unfinished_bytes, result.last_event_id = splitter.pending, splitter.parser.last_event_id
            elif len(kept) < _KEEP_BODY:
                kept += event.data[: _KEEP_BODY - len(kept)]
        elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
            return True


async def _leave(conn: RawConnection, result: StreamResult, opts: ReadOptions) -> None:
    result.left, result.left_at = opts.leave_by, time.perf_counter()
    conn.leave(opts.leave_by)
    if opts.leave_by == "fin":
        result.drained_bytes = await conn.drain(opts.drain_after_fin_s)
    result.ended = time.perf_counter()
