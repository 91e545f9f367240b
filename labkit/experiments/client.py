"""Clients that measure a stream the way a user's program sees it.

Every experiment reads the service through these, so a number in a table always means the same
thing. Times are ``time.perf_counter()`` values: the engine stamps its events with the same clock
(on Linux the system-wide monotonic clock), so a client's time and the server's records compare
directly, and a server started with ``serve_in_thread`` shares the process anyway.

* :func:`timed_stream` reads one SSE stream over httpx and records, for each event, when the
  chunk that completed it arrived, how many wire bytes it took (comments and padding included)
  and its parsed payload. It can read slowly (a sleep after every chunk) and leave early, after
  N tokens or t seconds, by FIN or by RST, as its :class:`ReadOptions` say.
* :func:`launch_streams` starts many at once and measures the makespan.
* :func:`labkit.experiments.rawhttp.raw_stream` is the raw-socket HTTP/1.1 client (on h11), for
  moments httpx hides; it takes the same :class:`ReadOptions`.
* :mod:`labkit.experiments.records` holds what both take and record (:class:`ReadOptions`,
  :class:`StreamResult`), re-exported here.
* :func:`percentiles` and :func:`run_sync` are the small helpers every experiment needs.

Leaving "by FIN" is ``shutdown(SHUT_WR)``: the server sees an orderly end of input, then the
client drains what is still in flight until the server closes (bounded), and closes. A plain
``close()`` with unread bytes in the receive buffer makes Linux send RST, which is why FIN needs
the shutdown. Leaving "by RST" sets ``SO_LINGER`` to (on, 0) and closes: an abortive close.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Awaitable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
import pandas as pd

from labkit.experiments.records import EventSplitter, LeaveBy, ReadOptions, StreamResult, TimedEvent, json_or_text
from labkit.machine import linger_zero

__all__ = [
    "TimedEvent",
    "StreamResult",
    "ReadOptions",
    "EventSplitter",
    "timed_stream",
    "launch_streams",
    "Launch",
    "launch_in_turn",
    "async_client",
    "percentiles",
    "run_sync",
    "leave_socket",
    "LeaveBy",
]

T = TypeVar("T")


# --------------------------------------------------------------------------- leaving


def leave_socket(sock: socket.socket, how: LeaveBy) -> None:
    """Start leaving: FIN by shutting down our sending side, RST by arming a zero linger.

    For RST the caller closes the socket next (the close is what sends it). For FIN the caller
    may keep reading what is still in flight before closing.
    """
    if how == "rst":
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger_zero())
    else:
        try:
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # already gone: the server closed first


def _response_socket(response: httpx.Response) -> socket.socket | None:
    stream = response.extensions.get("network_stream")
    return None if stream is None else stream.get_extra_info("socket")


# --------------------------------------------------------------------------- httpx reader


async def timed_stream(
    client: httpx.AsyncClient,
    body: dict[str, Any],
    *,
    path: str = "/v1/stream",
    options: ReadOptions | None = None,
    result: StreamResult | None = None,
) -> StreamResult:
    """POST ``body`` to ``path`` and read the response as ``options`` say; never raises for I/O.

    ``client`` must have the server as ``base_url``; give it enough connections for the streams
    you run at once (see :func:`async_client`). Pass your own ``result`` to watch it fill while
    the stream runs (e.g. to wait until background streams have their first token).
    """
    options = options or ReadOptions()
    result = result or StreamResult(sent=0.0)
    result.sent = time.perf_counter()
    try:
        await asyncio.wait_for(_read(client, path, body, options, result), options.timeout)
    except (httpx.HTTPError, OSError, asyncio.TimeoutError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    result.ended = result.ended or time.perf_counter()
    return result


async def _read(
    client: httpx.AsyncClient, path: str, body: dict[str, Any], options: ReadOptions, result: StreamResult
) -> None:
    async with client.stream("POST", path, json=body) as response:
        _note_headers(response, result)
        if not result.content_type.startswith("text/event-stream"):
            raw = await response.aread()
            result.total_bytes, result.body = len(raw), json_or_text(raw)
            return
        splitter = EventSplitter()
        try:
            await _read_events(response, splitter, options, result)
        finally:
            result.unfinished_bytes = splitter.pending
            result.last_event_id = splitter.parser.last_event_id


def _note_headers(response: httpx.Response, result: StreamResult) -> None:
    result.headers_at = time.perf_counter()
    result.status = response.status_code
    result.headers = dict(response.headers)
    result.content_type = response.headers.get("content-type", "")
    result.request_id = response.headers.get("x-request-id")


async def _read_events(
    response: httpx.Response, splitter: EventSplitter, options: ReadOptions, result: StreamResult
) -> None:
    if _should_leave(result, options):
        return await _leave(response, options, result)
    deadline = None if options.leave_after_s is None else result.sent + options.leave_after_s
    chunks = response.aiter_raw()
    while True:
        try:
            if deadline is None:
                chunk = await chunks.__anext__()
            else:
                chunk = await asyncio.wait_for(chunks.__anext__(), max(0.0, deadline - time.perf_counter()))
        except StopAsyncIteration:
            break
        except asyncio.TimeoutError:
            return await _leave(response, options, result)
        now = time.perf_counter()
        result.total_bytes += len(chunk)
        result.events += splitter.feed(chunk, now)
        if _should_leave(result, options):
            return await _leave(response, options, result)
        if options.sleep:
            await asyncio.sleep(options.sleep)
    result.ended = time.perf_counter()


def _should_leave(result: StreamResult, options: ReadOptions) -> bool:
    n = options.leave_after_tokens
    return n is not None and len(result.tokens) >= n and result.terminal is None


async def _leave(response: httpx.Response, options: ReadOptions, result: StreamResult) -> None:
    sock = _response_socket(response)
    result.left, result.left_at = options.leave_by, time.perf_counter()
    if sock is not None:
        leave_socket(sock, options.leave_by)
    if options.leave_by == "fin" and sock is not None:
        await _drain(response, options.drain_after_fin_s, result)
    result.ended = time.perf_counter()


async def _drain(response: httpx.Response, seconds: float, result: StreamResult) -> None:
    """After a FIN, read and count (not parse) what the server still sends, until it closes.

    Reads the connection underneath httpx, whose own iterator may already have been cancelled.
    """
    stream = response.extensions.get("network_stream")

    async def discard() -> None:
        while stream is not None and (chunk := await stream.read(65536)):
            result.drained_bytes += len(chunk)

    try:
        await asyncio.wait_for(discard(), seconds)
    except Exception:  # a timeout, the peer's RST or its close: the drain is over
        pass


# --------------------------------------------------------------------------- many at once


@dataclass(frozen=True)
class Launch:
    """Streams started together. ``makespan``: first request sent to last stream ended."""

    results: list[StreamResult]
    makespan: float

    @property
    def tokens(self) -> int:
        return sum(len(r.tokens) for r in self.results)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.makespan if self.makespan > 0 else float("nan")


def async_client(
    base_url: str, connections: int = 64, timeout: float = 300.0, headers: dict[str, str] | None = None
) -> httpx.AsyncClient:
    """An httpx client with one connection per concurrent stream and no proxy from the environment;
    ``headers`` go with every request (a target's ``Authorization``)."""
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    return httpx.AsyncClient(base_url=base_url, limits=limits, timeout=timeout, trust_env=False, headers=headers)


async def launch_streams(
    base_url: str,
    bodies: Sequence[dict[str, Any]],
    options: ReadOptions | Sequence[ReadOptions] | None = None,
    *,
    path: str = "/v1/stream",
    headers: dict[str, str] | None = None,
) -> Launch:
    """Send every body at once, each on its own connection, and read them all to the end."""
    opts = list(options) if isinstance(options, Sequence) else [options or ReadOptions()] * len(bodies)
    if len(opts) != len(bodies):
        raise ValueError(f"{len(bodies)} bodies but {len(opts)} read options")
    async with async_client(base_url, connections=max(1, len(bodies)), headers=headers) as client:
        results = await asyncio.gather(*(timed_stream(client, b, path=path, options=o) for b, o in zip(bodies, opts)))
    return Launch(list(results), _makespan(results))


async def launch_in_turn(
    base_url: str, bodies: Sequence[dict[str, Any]], options: ReadOptions | None = None, *, path: str = "/v1/stream"
) -> Launch:
    """Send the bodies one after another, each after the previous ended: the back-to-back baseline.

    ``makespan`` is then the sum of the runs, which is what serving them one by one would take.
    """
    results = []
    async with async_client(base_url, connections=1) as client:
        for body in bodies:
            results.append(await timed_stream(client, body, path=path, options=options))
    return Launch(results, _makespan(results))


def _makespan(results: Iterable[StreamResult]) -> float:
    results = list(results)
    if not results:
        return 0.0
    return max(r.ended or r.sent for r in results) - min(r.sent for r in results)


# --------------------------------------------------------------------------- helpers


def percentiles(values: Iterable[float | None], qs: Sequence[float] = (50, 99)) -> dict[str, float]:
    """``{"p50": ..., "p99": ...}``; missing values skipped, NaN for no values.

    Linear interpolation between the two nearest ranks (pandas' ``Series.quantile`` default,
    numpy's ``percentile`` default), not nearest-rank: the p50 of 1, 2, 3, 4 is 2.5.
    """
    data = pd.Series([v for v in values if v is not None], dtype=float)
    return {f"p{q:g}": float(data.quantile(q / 100)) for q in qs}


def run_sync(coro: Awaitable[T]) -> T:
    """Run a coroutine to the end from synchronous code, even inside Jupyter's running loop.

    Where this thread already runs a loop (a notebook cell), the coroutine runs on a fresh loop in
    a helper thread that is joined before returning.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)  # type: ignore[arg-type]
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = asyncio.run(coro)  # type: ignore[arg-type]
        except BaseException as exc:  # re-raised in the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=target, name="labkit-run-sync")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]
