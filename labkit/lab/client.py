"""The lab's one client: httpx for ordinary streams, a raw h11 socket where the socket matters.

Both readers take a :class:`Request` and :class:`~labkit.lab.stream.ReadOptions` and fill one
:class:`~labkit.lab.stream.Stream`, so a table mixes them freely. The raw reader
(:mod:`labkit.lab.raw`) owns its socket, for the clients that httpx cannot be: one that never
reads, reads N bytes at a time, or leaves by FIN or RST at an exact moment.

Bounded against a hostile server: every request has an overall deadline (``timeout``; a trickle
of one byte a second cannot reset it), every body a size cap, and compression is declined
(``Accept-Encoding: identity``) unless ``ReadOptions.gzip`` asks for it. Then one gzip layer is
inflated here, a megabyte at a time, and the caps count the inflated bytes, so a small gzip bomb
cannot become gigabytes; an encoding not asked for (or stacked) is refused by name. Proxies from
the environment are not used: the lab measures a direct route.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import socket
import threading
import time
import zlib
from collections.abc import AsyncIterator, Awaitable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import h11
import httpx
import numpy as np

from labkit.lab.raw import BASE_HEADERS, MIB, hang_up, read_raw
from labkit.lab.stream import API, JSON_CAP, EventSplitter, ReadOptions, Stream, json_or_text

# When the run in progress must end (perf_counter), if it has a budget: every read ends by then.
RUN_ENDS: contextvars.ContextVar[float | None] = contextvars.ContextVar("labkit_run_ends", default=None)
BUDGET_SPENT = "the run's time budget (max_seconds) ran out"

__all__ = [
    "Request",
    "Launch",
    "read",
    "makespan",
    "percentile",
    "async_client",
    "get_json",
    "run_sync",
]

T = TypeVar("T")


@dataclass(frozen=True)
class Request:
    """One request as a target builds it: where, what, and in which dialect to read the answer."""

    path: str
    body: dict[str, Any] | None
    api: API = "labkit"
    method: str = "POST"
    headers: dict[str, str] = field(default_factory=dict)
    stream: bool = True  # False: a JSON answer is expected (a non-streamed completion, a GET)


# --------------------------------------------------------------------------- httpx


async def read(
    url: str,
    request: Request,
    options: ReadOptions | None = None,
    *,
    client: httpx.AsyncClient | None = None,
    result: Stream | None = None,
    raw: bool = False,
    leave: asyncio.Event | None = None,
    hold: asyncio.Event | None = None,
) -> Stream:
    """Send ``request`` to ``url`` and read the answer as ``options`` say; never raises for I/O.

    ``raw`` (or options only the raw reader honours, or a ``leave`` event to set) reads over a
    socket of its own. Pass your own ``result`` to watch it fill while the stream runs (the raw
    reader's socket is ``result.socket`` while it is open). With a ``hold`` event the raw reader
    sends the request and reads nothing until the event is set: a reader that stops, then resumes.
    """
    options = options or ReadOptions()
    result = result if result is not None else Stream(api=request.api)
    result.api, result.sent = request.api, time.perf_counter()
    result.asked_stream, result.asked_get = request.stream, request.method == "GET"
    body = request.body or {}
    asked = body.get("max_tokens", body.get("max_new_tokens"))  # OpenAI's name, or labkit's
    result.max_tokens = asked if type(asked) is int else None
    raw = raw or leave is not None or hold is not None or not options.read or options.rcvbuf is not None
    raw = raw or options.keep_wire  # only the raw reader owns its socket and sees every byte
    # a planned leave in time is kept to the moment by the raw reader (httpx waits for the head first)
    raw = raw or (options.leave_after_s is not None and url.startswith("http:"))
    limit, ends = options.bound_s + options.drain_after_fin_s + 0.5, RUN_ENDS.get()
    cut = ends is not None and ends - time.perf_counter() < limit  # the run's budget comes first
    limit = max(0.0, ends - time.perf_counter()) if cut and ends is not None else limit
    try:
        async with contextlib.AsyncExitStack() as stack:
            if raw:
                work = read_raw(url, request, options, result, leave or asyncio.Event(), hold)
            else:
                if client is None:
                    client = await stack.enter_async_context(async_client(url, 1, options.timeout))
                work = _httpx(client, request, options, result)
            await asyncio.wait_for(work, limit)
    except TimeoutError:
        if cut:
            result.error = BUDGET_SPENT
        elif result.left is None and options.bound_s < options.timeout:
            result.left, result.left_at = options.leave_by, time.perf_counter()  # the planned leave came first
        elif result.left is None:
            result.error = f"no end within the {options.timeout:g} s bound of one request"
    except httpx.TimeoutException:  # httpx's own timeout is the request's bound
        result.error = f"no end within the {options.timeout:g} s bound of one request"
    except (httpx.ConnectError, ConnectionRefusedError) as exc:
        result.error = f"cannot connect ({'connection refused' if _refused(exc) else exc})"
    except (httpx.HTTPError, OSError, h11.ProtocolError) as exc:
        said = str(exc) or str(exc.__cause__ or exc.__context__ or "")  # httpx's are often empty
        said = (
            said or f"the server closed the connection {'mid-answer' if result.headers_at else 'before a whole head'}"
        )
        result.error = f"{type(exc).__name__}: {said}"[:300]
    except (ValueError, RecursionError, UnicodeError) as exc:  # an answer no parser could read
        result.error = f"an unreadable answer: {type(exc).__name__}: {exc}"[:300]
    result.ended = result.ended or time.perf_counter()
    if result.error is None:
        result.error = result.refusal()
    return result


def _refused(exc: BaseException | None) -> bool:
    while exc is not None:
        if isinstance(exc, ConnectionRefusedError):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def async_client(url: str, connections: int = 64, timeout: float = 300.0) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    return httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout, trust_env=False, headers=BASE_HEADERS)


async def _httpx(client: httpx.AsyncClient, request: Request, options: ReadOptions, result: Stream) -> None:
    result.sent = time.perf_counter()  # once the client is made: building one is not the server's time
    body = None if request.body is None else json.dumps(request.body).encode()
    headers = {**request.headers, **({"Content-Type": "application/json"} if body is not None else {})}
    if options.gzip:
        headers["Accept-Encoding"] = "gzip"
    answer: list[httpx.Response] = []

    async def trace(event: str, info: dict[str, Any]) -> None:  # httpcore's "trace" extension
        if event == "http11.response_closed.started" and answer:  # before the pool may lend it again
            _refuse_unasked(answer[0], result)

    async with client.stream(
        request.method, request.path, content=body, headers=headers, extensions={"trace": trace}
    ) as response:
        answer.append(response)
        await _read_httpx(response, result, options)


async def _read_httpx(response: httpx.Response, result: Stream, options: ReadOptions) -> None:
    result.note_head(response.status_code, dict(response.headers), time.perf_counter(), options.gzip)
    if result.error:  # a head refused by name (an encoding not asked for, a field sent twice)
        return
    sock = _socket(response)
    chunks = _decoded(response.aiter_raw(), result.headers.get("content-encoding", "").strip().lower() == "gzip")
    if not result.content_type.startswith("text/event-stream"):
        body = bytearray()
        async for chunk in chunks:
            if not result.take_body(body, chunk):
                break
        result.body = None if result.error else json_or_text(bytes(body))
        result.ended = time.perf_counter()
        return
    splitter = EventSplitter()
    deadline = None if options.leave_after_s is None else result.sent + options.leave_after_s
    while not result.should_leave(options):
        ends = result.body_end_by(options) if result.closed else deadline
        left = None if ends is None else max(0.0, ends - time.perf_counter())
        try:
            chunk = await asyncio.wait_for(chunks.__anext__(), left)
        except StopAsyncIteration:
            result.ended = time.perf_counter()
            break
        except TimeoutError:
            if result.closed:  # the stream ended, its body did not: the connection is closed on the way out
                result.unended()
                return
            break
        result.reads += 1
        if not result.take(splitter, chunk, time.perf_counter(), options):
            return
        if options.pace:
            await asyncio.sleep(options.pace)
    if result.ended is None and sock is not None:
        await hang_up(result, options, sock, _drain_stream(response))


def _refuse_unasked(response: httpx.Response, result: Stream) -> None:
    """Bytes the server sent past its answer's end would be read as the next answer on this
    kept-alive connection (a review: a short ``Content-Length`` smuggled a 50-token answer into
    the next request, which never reached the server). The stream fails, and the connection is
    marked broken as the response closes, so that httpcore closes it rather than pool it. The
    bytes wait in the connection's h11 state, reached through httpcore 1.0's private chain (a
    test fails if it moves)."""
    state: Any = response.stream
    for name in ("_stream", "_httpcore_stream", "_stream", "_connection", "_h11_state"):
        state = getattr(state, name, None)
    if isinstance(state, h11.Connection) and state.their_state is h11.DONE and state.trailing_data[0]:
        if extra := len(state.trailing_data[0].lstrip(b"\r\n")):  # blank lines: RFC 9112 2.2 says ignore them
            result.error = result.error or f"the server sent {extra:,} bytes past its answer's end, unasked for"
        if state.our_state is h11.DONE:
            state.send_failed()  # ours in ERROR: httpcore closes the connection instead of pooling it


def _socket(response: httpx.Response) -> socket.socket | None:
    stream = response.extensions.get("network_stream")
    return None if stream is None else stream.get_extra_info("socket")


def _drain_stream(response: httpx.Response) -> Any:
    stream = response.extensions.get("network_stream")
    return None if stream is None else (lambda: stream.read(65536))


async def _decoded(chunks: AsyncIterator[bytes], gzip: bool) -> AsyncIterator[bytes]:
    """The body's bytes as sent, or with its one gzip layer inflated a megabyte at a time, so that
    the caps downstream see every inflated byte before more is made (any other encoding was
    refused with the head: :meth:`Stream.note_head`)."""
    inflate = zlib.decompressobj(wbits=31) if gzip else None
    async for chunk in chunks:
        while inflate is not None and chunk:
            out, chunk = inflate.decompress(chunk, MIB), inflate.unconsumed_tail
            if out:
                yield out
        if inflate is None:
            yield chunk


# --------------------------------------------------------------------------- many at once


@dataclass(frozen=True)
class Launch:
    """Streams started together; ``makespan``: first request sent to last stream ended."""

    streams: list[Stream]
    makespan: float

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.streams)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.makespan if self.makespan > 0 else float("nan")

    def row(self) -> dict[str, Any]:
        """The launch as a table row: makespan, tokens/s, first-token and gap percentiles, failures."""
        ttfts, gaps = [s.ttft for s in self.streams], [g for s in self.streams for g in s.gaps]
        return {
            "makespan_s": self.makespan, "tokens": self.tokens, "tokens_per_s": self.tokens_per_s,
            "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99),
            "gap_p50_s": percentile(gaps, 50), "gap_p99_s": percentile(gaps, 99),
            "failed": sum(1 for s in self.streams if s.failure),
        }  # fmt: skip


def percentile(values: Sequence[float | None], q: float) -> float:
    """The ``q``-th percentile (linear between ranks, as pandas and numpy do); NaN for no values."""
    data = [v for v in values if v is not None]
    return float(np.percentile(data, q)) if data else float("nan")


def makespan(streams: Sequence[Stream]) -> float:
    if not streams:
        return 0.0
    return max(s.ended or s.sent for s in streams) - min(s.sent for s in streams)


def get_json(url: str, path: str, *, timeout: float = 10.0, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    """``GET url+path``: the status and the JSON (or text) body, read within ``timeout`` seconds
    and :data:`JSON_CAP` bytes in all; raises ``OSError`` when either is passed."""
    request = Request(path, None, method="GET", headers=headers or {}, stream=False)
    answer = run_sync(read(url, request, ReadOptions(timeout=timeout, max_bytes=JSON_CAP)))
    if answer.status == 0 or (answer.error and not answer.error.startswith("HTTP")):
        raise OSError(answer.error or "no answer")
    return answer.status, answer.body


def run_sync(coro: Awaitable[T]) -> T:
    """Run a coroutine to the end from synchronous code, even inside Jupyter's running loop (then
    on a fresh loop in a helper thread, joined before returning)."""
    box: dict[str, Any] = {}

    async def kept() -> None:  # the value goes in the box, never out as the task's result: asyncio.run
        box["value"] = await coro  # ends by building the main task's repr, and so the result's, whole

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        asyncio.run(kept())
        return box["value"]
    context = contextvars.copy_context()  # the run's budget (RUN_ENDS) holds in the helper thread too

    def target() -> None:
        try:
            context.run(asyncio.run, kept())
        except BaseException as exc:  # re-raised in the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=target, name="labkit-run-sync")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]
