"""A raw-socket HTTP/1.1 client: for the moments a library client hides.

httpx decides when bytes are read and how a connection ends. The buffers and disconnect
experiments need to choose: a client that sends a request and never reads a byte, or one that
leaves by FIN or RST at an exact moment (before the headers arrive, after N tokens). This client
owns its socket, speaks just enough HTTP/1.1 (one POST, ``Connection: close``), undoes chunked
transfer encoding to recover the SSE bytes, and reports in the same :class:`StreamResult` as
:func:`labkit.experiments.client.timed_stream`, so tables mix both clients freely.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

from labkit.experiments.client import leave_socket
from labkit.experiments.records import EventSplitter, LeaveBy, StreamResult, json_or_text

__all__ = ["ChunkedDecoder", "RawConnection", "raw_stream"]

_MAX_HEAD = 64 * 1024


class ChunkedDecoder:
    """Incremental decoder for ``Transfer-Encoding: chunked``: feed wire bytes, get body bytes."""

    def __init__(self) -> None:
        self._buffer = b""
        self._left = 0  # body bytes still to come in the current chunk
        self._need_crlf = False  # a chunk's data ended; its CRLF comes next
        self.done = False

    def feed(self, data: bytes) -> bytes:
        self._buffer += data
        out: list[bytes] = []
        while not self.done and self._advance(out):
            pass
        return b"".join(out)

    def _advance(self, out: list[bytes]) -> bool:
        """Consume one piece (data, CRLF or size line) if it is all there; False to wait."""
        if self._left:
            piece, self._buffer = self._buffer[: self._left], self._buffer[self._left :]
            self._left -= len(piece)
            out.append(piece)
            self._need_crlf = self._left == 0
            return bool(piece) and self._left == 0
        if self._need_crlf:
            if len(self._buffer) < 2:
                return False
            self._buffer, self._need_crlf = self._buffer[2:], False
            return True
        line_end = self._buffer.find(b"\r\n")
        if line_end < 0:
            return False
        size = int(self._buffer[:line_end].split(b";")[0].strip() or b"0", 16)
        self._buffer = self._buffer[line_end + 2 :]
        self._left, self.done = size, size == 0
        return True


class RawConnection:
    """One TCP connection driven by hand with non-blocking socket calls on the running loop.

    ``rcvbuf`` sets ``SO_RCVBUF`` before connecting (which also stops Linux from growing it).
    """

    def __init__(self, base_url: str, rcvbuf: int | None = None) -> None:
        parts = urlsplit(base_url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setblocking(False)
        if rcvbuf is not None:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self.closed = False

    async def connect(self) -> None:
        await asyncio.get_running_loop().sock_connect(self.sock, (self.host, self.port))

    async def send_post(self, path: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> None:
        payload = json.dumps(body).encode()
        lines = [
            f"POST {path} HTTP/1.1",
            f"Host: {self.host}:{self.port}",
            "Content-Type: application/json",
            f"Content-Length: {len(payload)}",
            "Accept: text/event-stream",
            "Connection: close",
        ]
        lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
        request = ("\r\n".join(lines) + "\r\n\r\n").encode() + payload
        await asyncio.get_running_loop().sock_sendall(self.sock, request)

    async def recv(self, timeout: float | None = None, size: int = 65536) -> bytes:
        """The next bytes, ``b""`` at the server's close; TimeoutError after ``timeout``."""
        loop = asyncio.get_running_loop()
        return await asyncio.wait_for(loop.sock_recv(self.sock, size), timeout)

    async def read_head(self, timeout: float | None = None) -> tuple[int, dict[str, str], bytes]:
        """Status, lower-cased headers, and whatever body bytes came with them."""
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = await self.recv(timeout)
            if not chunk or len(data) > _MAX_HEAD:
                raise ConnectionError(f"no complete response head in {len(data)} bytes")
            data += chunk
        head, rest = data.split(b"\r\n\r\n", 1)
        status_line, *header_lines = head.decode("latin-1").split("\r\n")
        headers = {}
        for line in header_lines:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        return int(status_line.split()[1]), headers, rest

    def leave(self, how: LeaveBy) -> None:
        """FIN (shut our side; the caller may drain then :meth:`close`) or RST (close now)."""
        leave_socket(self.sock, how)
        if how == "rst":
            self.close()

    async def drain(self, seconds: float) -> int:
        """After a FIN: read until the server closes or ``seconds`` pass; the bytes read."""
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


@contextlib.contextmanager
def recorded(conn: RawConnection, result: StreamResult) -> Iterator[None]:
    """Write a network failure into ``result.error`` instead of raising; always close ``conn``
    and stamp ``result.ended``, so a client's record is complete however its stream went."""
    try:
        yield
    except (OSError, ConnectionError, asyncio.TimeoutError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    finally:
        conn.close()
        result.ended = result.ended or time.perf_counter()


async def raw_stream(
    base_url: str,
    body: dict[str, Any],
    *,
    path: str = "/v1/stream",
    read: bool = True,
    leave_after_tokens: int | None = None,
    leave_after_s: float | None = None,
    leave_by: LeaveBy = "fin",
    rcvbuf: int | None = None,
    drain_after_fin_s: float = 2.0,
    timeout: float = 300.0,
) -> StreamResult:
    """POST ``body`` over a fresh socket; read the SSE body, or (``read=False``) never read.

    Leaves by ``leave_by`` after ``leave_after_tokens`` token events (0: once the headers are in)
    or ``leave_after_s`` seconds from sending, whichever comes first; a client that never reads
    must say when to leave. Never raises for I/O; the connection is always closed on return.
    """
    if not read and leave_after_s is None:
        raise ValueError("a client that never reads needs leave_after_s")
    conn = RawConnection(base_url, rcvbuf)
    result = StreamResult(sent=time.perf_counter())
    with recorded(conn, result):
        await conn.connect()
        result.sent = time.perf_counter()
        await conn.send_post(path, body)
        deadline = result.sent + min(timeout, leave_after_s if leave_after_s is not None else timeout)
        if read:
            await _read(conn, result, leave_after_tokens, deadline)
        else:
            await asyncio.sleep(max(0.0, deadline - time.perf_counter()))
        if result.ended is None and leave_after_tokens is None and leave_after_s is None:
            result.error = f"TimeoutError: no end within {timeout} s"
        if result.ended is None:
            await _leave(conn, result, leave_by, drain_after_fin_s)
    return result


async def _read(conn: RawConnection, result: StreamResult, leave_after_tokens: int | None, deadline: float) -> None:
    """Read head and body until the server ends, the token count is reached, or the deadline."""
    try:
        status, headers, rest = await conn.read_head(max(0.0, deadline - time.perf_counter()))
    except asyncio.TimeoutError:
        return
    result.headers_at, result.status, result.headers = time.perf_counter(), status, headers
    result.content_type, result.request_id = headers.get("content-type", ""), headers.get("x-request-id")
    body = _Body(headers)
    splitter = EventSplitter()
    data = rest
    while True:
        _take(body.feed(data), splitter, result)
        if leave_after_tokens is not None and len(result.tokens) >= leave_after_tokens and result.terminal is None:
            return
        if body.complete:
            break
        try:
            data = await conn.recv(max(0.0, deadline - time.perf_counter()))
        except asyncio.TimeoutError:
            return
        if not data:
            break
    result.ended = time.perf_counter()
    if not result.content_type.startswith("text/event-stream"):
        result.body = json_or_text(body.collected)


def _take(data: bytes, splitter: EventSplitter, result: StreamResult) -> None:
    if not data:
        return
    result.total_bytes += len(data)
    if result.content_type.startswith("text/event-stream"):
        result.events += splitter.feed(data, time.perf_counter())
        result.unfinished_bytes, result.last_event_id = splitter.pending, splitter.parser.last_event_id


async def _leave(conn: RawConnection, result: StreamResult, how: LeaveBy, drain_s: float) -> None:
    result.left, result.left_at = how, time.perf_counter()
    conn.leave(how)
    if how == "fin":
        result.drained_bytes = await conn.drain(drain_s)
    result.ended = time.perf_counter()


class _Body:
    """The response body after the head: chunked, fixed length, or until the server closes."""

    def __init__(self, headers: dict[str, str]) -> None:
        self.chunked = "chunked" in headers.get("transfer-encoding", "").lower()
        self.decoder = ChunkedDecoder()
        length = headers.get("content-length")
        self.remaining = int(length) if length is not None and not self.chunked else None
        self.collected = b""

    def feed(self, data: bytes) -> bytes:
        out = self.decoder.feed(data) if self.chunked else data
        if self.remaining is not None:
            out = out[: self.remaining]
            self.remaining -= len(out)
        if len(self.collected) < _MAX_HEAD:
            self.collected += out[: _MAX_HEAD - len(self.collected)]
        return out

    @property
    def complete(self) -> bool:
        return self.decoder.done if self.chunked else self.remaining == 0
