"""A reader of ``/v1/stream`` whose pace we set, on a raw socket.

:func:`read_stream` takes at most ``read_bytes`` per read and sleeps after each, so a slow
reader's pace does not depend on what httpx chooses. It can be told to leave (by RST or FIN) from
outside, through a :class:`Leave` flag. Times are ``time.perf_counter()``.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from labkit.experiments.rawhttp import ChunkedDecoder, RawConnection, recorded
from labkit.experiments.records import EventSplitter, LeaveBy, StreamResult

__all__ = ["Leave", "read_stream"]

_POLL = 0.1  # a reader with nothing to read checks its Leave flag this often


class Leave:
    """A flag a running reader checks between reads: set it and the reader leaves."""

    def __init__(self) -> None:
        self.now = False

    def set(self) -> None:
        self.now = True


async def read_stream(
    url: str,
    body: dict[str, Any],
    *,
    sleep: float = 0.0,
    read_bytes: int = 64 * 1024,
    leave_after_tokens: int | None = None,
    leave_after_s: float = 120.0,
    leave_by: LeaveBy = "rst",
    drain_after_fin_s: float = 0.5,
    leave: Leave | None = None,
    result: StreamResult | None = None,
    path: str = "/v1/stream",
    headers: dict[str, str] | None = None,
) -> StreamResult:
    """POST ``body`` to ``path`` (an OpenAI target's ``/v1/completions`` too); read at most ``read_bytes`` per read, sleep ``sleep`` s after each; leave by
    ``leave_by`` after ``leave_after_tokens`` tokens, after ``leave_after_s`` s, or when ``leave``
    is set. After a FIN it reads on (uncounted) until the server closes, so the close stays a FIN
    and not an RST. Never raises for I/O."""
    conn = RawConnection(url)
    result = result or StreamResult(sent=0.0)
    result.sent = time.perf_counter()
    with recorded(conn, result):
        await conn.connect()
        result.sent = time.perf_counter()
        await conn.send_post(path, body, headers)
        stop = _Stop(result.sent + leave_after_s, leave or Leave(), leave_after_tokens)
        await _read_body(conn, result, sleep, read_bytes, stop)
        if result.ended is None:
            result.left, result.left_at = leave_by, time.perf_counter()
            conn.leave(leave_by)
            if leave_by == "fin":
                result.drained_bytes = await conn.drain(drain_after_fin_s)
    return result


@dataclass(frozen=True)
class _Stop:
    """When a reader stops reading: a deadline, a flag, a number of tokens."""

    deadline: float
    leave: Leave
    tokens: int | None

    def now(self, result: StreamResult) -> bool:
        enough = self.tokens is not None and len(result.tokens) >= self.tokens and result.terminal is None
        return enough or self.leave.now or time.perf_counter() >= self.deadline


async def _read_body(conn: RawConnection, result: StreamResult, sleep: float, read_bytes: int, stop: _Stop) -> None:
    deadline = stop.deadline
    status, headers, data = await conn.read_head(max(0.0, deadline - time.perf_counter()))
    result.headers_at, result.status, result.headers = time.perf_counter(), status, headers
    result.content_type, result.request_id = headers.get("content-type", ""), headers.get("x-request-id")
    decoder, splitter = ChunkedDecoder(), EventSplitter()
    while True:
        body = decoder.feed(data)
        result.total_bytes += len(body)
        result.events += splitter.feed(body, time.perf_counter())
        result.last_event_id = splitter.parser.last_event_id
        if decoder.done:
            break
        if stop.now(result):
            return
        if sleep and data:
            await asyncio.sleep(sleep)
        if stop.now(result):
            return
        try:
            data = await conn.recv(min(_POLL, max(0.0, deadline - time.perf_counter())), read_bytes)
        except asyncio.TimeoutError:
            data = b""
            continue
        if not data:
            break
    result.ended = time.perf_counter()
