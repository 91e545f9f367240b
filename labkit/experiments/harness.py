"""What experiments 5 to 7 share: a reader whose pace we set, and the server's side of a run.

* :func:`read_stream` reads ``/v1/stream`` on a raw socket, taking at most ``read_bytes`` per read
  and sleeping after each, so a slow reader's pace does not depend on what httpx chooses. It can
  be told to leave (by RST or FIN) from outside, through a :class:`Leave` flag.
* :func:`launch_readers` runs many at once while :class:`Sampler` records the engine's running,
  paused and waiting counts and the hub's queued events every few milliseconds.
* :func:`server_like` reuses a notebook's server when it already has the settings a measurement
  needs, and otherwise starts one on the same loaded model; :func:`wait_released` waits for the
  server's own record of each stream to show that its sequence left the engine.

Times are ``time.perf_counter()``: the server runs in this process, so its records and the
client's times are on one clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd

from labkit.experiments.common import serving
from labkit.experiments.rawhttp import ChunkedDecoder, RawConnection, recorded
from labkit.experiments.records import EventSplitter, LeaveBy, StreamResult
from labkit.prompts import PROMPTS

__all__ = [
    "Leave",
    "read_stream",
    "stream_body",
    "bodies",
    "long_prompts",
    "launch_readers",
    "Sampler",
    "server_like",
    "loaded_model",
    "wait_released",
    "server_checks",
    "beside",
    "span",
]

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
) -> StreamResult:
    """POST ``body``; read at most ``read_bytes`` per read, sleep ``sleep`` s after each; leave by
    ``leave_by`` after ``leave_after_tokens`` tokens, after ``leave_after_s`` s, or when ``leave``
    is set. After a FIN it reads on (uncounted) until the server closes, so the close stays a FIN
    and not an RST. Never raises for I/O."""
    conn = RawConnection(url)
    result = result or StreamResult(sent=0.0)
    result.sent = time.perf_counter()
    with recorded(conn, result):
        await conn.connect()
        result.sent = time.perf_counter()
        await conn.send_post("/v1/stream", body)
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


def stream_body(index: int, tokens: int, **extra: Any) -> dict[str, Any]:
    """The request for fixed prompt ``index`` (the lab's 32 prompts, in turn)."""
    return {"prompt": PROMPTS[index % len(PROMPTS)], "max_new_tokens": tokens, **extra}


def bodies(prompts: Sequence[int], count: int, tokens: int, **extra: Any) -> list[dict[str, Any]]:
    """``count`` requests cycling through the prompt indices ``prompts``."""
    return [stream_body(prompts[i % len(prompts)], tokens, **extra) for i in range(count)]


_SCREENED: dict[str, dict[int, tuple[int, int]]] = {}  # model -> prompt -> (tokens asked, answer length)


def long_prompts(model: Any, tokens: int, want: int = 8) -> list[int]:
    """Indices of ``want`` prompts (or all there are) whose greedy answer runs ``tokens`` tokens.

    Why: an instruction-tuned model answers some bare prompts with an end-of-sequence token at
    once, and a stream that ends after one token cannot be read slowly or left half-way. The
    engine itself decodes the prompts in order, ``want`` at a time, until enough are found;
    results are kept for the process (the engine is batch-invariant, so the server agrees).
    """
    known = _SCREENED.setdefault(model.name, {})

    def long_enough() -> list[int]:
        return [i for i, (_, n) in sorted(known.items()) if n >= tokens]

    for start in range(0, len(PROMPTS), want):
        if len(long_enough()) >= want:
            break
        todo = [
            i
            for i in range(start, min(start + want, len(PROMPTS)))
            if i not in known or known[i][1] == known[i][0] < tokens
        ]  # unknown, or ran out of tokens
        lengths = _answer_lengths(model, [PROMPTS[i] for i in todo], tokens) if todo else []
        known.update((i, (tokens, n)) for i, n in zip(todo, lengths))
    if not long_enough():
        raise RuntimeError(f"no prompt makes {model.name} write {tokens} tokens before it ends")
    return long_enough()[:want]


def _answer_lengths(model: Any, prompts: list[str], tokens: int) -> list[int]:
    from labkit.engine.config import EngineConfig
    from labkit.engine.engine import BatchEngine
    from labkit.engine.events import FinishEvent

    longest = max(len(model.tokenizer.encode(p)) for p in prompts) + tokens
    blocks = len(prompts) * -(-longest // 16)  # just what they need, not the default half gigabyte
    engine = BatchEngine(model, EngineConfig(max_batch=len(prompts), num_blocks=blocks, block_size=16))
    rids = [engine.submit(prompt, max_new_tokens=tokens) for prompt in prompts]
    lengths: dict[str, int] = {}
    for _ in range(tokens + 2):
        lengths.update((e.rid, e.usage.completion_tokens) for e in engine.step() if isinstance(e, FinishEvent))
        if not engine.has_work():
            break
    return [lengths.get(rid, 0) for rid in rids]


# --------------------------------------------------------------------------- many at once


class Sampler:
    """Samples the engine's running/paused/waiting counts and the hub's queued events."""

    def __init__(self, server: Any, every: float = 0.01) -> None:
        self.server, self.every = server, every
        self.rows: list[dict[str, float]] = []
        self._stop = asyncio.Event()

    async def run(self) -> None:
        while not self._stop.is_set():
            stats = self.server.engine.stats()
            queued = sum(len(s) for s in self.server.hub.streams())
            self.rows.append(
                {
                    "t": time.perf_counter(),
                    "running": stats["running"],
                    "paused": stats["paused"],
                    "waiting": stats["waiting"],
                    "queued_events": queued,
                }
            )
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stop.wait(), self.every)

    def stop(self) -> None:
        self._stop.set()

    def table(self, t0: float) -> pd.DataFrame:
        table = pd.DataFrame(self.rows, columns=["t", "running", "paused", "waiting", "queued_events"])
        return table.assign(t=table.t - t0)


async def launch_readers(
    server: Any,
    requests: Sequence[dict[str, Any]],
    reads: Sequence[dict[str, Any]],
    *,
    first: int = 0,
    leave_first_after_rest: bool = False,
    every: float = 0.01,
) -> tuple[list[StreamResult], pd.DataFrame, float]:
    """Start ``requests`` with per-reader options ``reads`` (for :func:`read_stream`); returns the
    results, the samples (``t`` from launch) and the launch time.

    ``first`` readers start alone and the rest only once each of them has a token; with
    ``leave_first_after_rest`` those first readers leave as soon as the rest have ended. However
    this ends, every reader has left and been awaited when it returns.
    """
    sampler = Sampler(server, every)
    sampling = asyncio.ensure_future(sampler.run())
    results, flags = [StreamResult(sent=0.0) for _ in requests], [Leave() for _ in requests]
    readers = list(zip(requests, reads, flags, results))

    def start(part: list[tuple[Any, ...]]) -> list[asyncio.Future]:
        return [asyncio.ensure_future(read_stream(server.url, b, leave=f, result=r, **o)) for b, o, f, r in part]

    t0 = time.perf_counter()
    early, rest = start(readers[:first]), []
    try:
        await _until(lambda: all(r.tokens or r.ended for r in results[:first]), timeout=120.0)
        rest = start(readers[first:])
        await asyncio.gather(*rest)
        if leave_first_after_rest:
            for flag in flags[:first]:
                flag.set()
        await asyncio.gather(*early)
    finally:
        for flag in flags:
            flag.set()
        await asyncio.gather(*early, *rest, return_exceptions=True)
        sampler.stop()
        await sampling
    return results, sampler.table(t0), t0


async def _until(condition: Any, timeout: float, poll: float = 0.005) -> None:
    deadline = time.perf_counter() + timeout
    while not condition() and time.perf_counter() < deadline:
        await asyncio.sleep(poll)


# --------------------------------------------------------------------------- servers and records


@contextlib.contextmanager
def server_like(given: Any, model: Any, **settings: Any) -> Iterator[Any]:
    """``given`` if it already runs with ``settings``, else a fresh server on the same ``model``.

    Why: a measurement compares settings that a server fixes when it starts (policy, response
    class, send buffer), while a notebook starts one server itself; the model is loaded once and
    shared, and only one of these servers runs at a time.
    """
    if given is not None and all(given.config.flat().get(k) == v for k, v in settings.items()):
        yield given
        return
    with serving(None, model=model, **settings) as server:
        yield server


def loaded_model(server: Any, name: str) -> Any:
    """The model ``server`` serves, if given; else ``name`` loaded once for every server to share."""
    if server is not None:
        return server.engine.model
    from labkit.models import load_model

    return load_model(name)


async def wait_released(hub: Any, rids: Sequence[str | None], timeout: float = 60.0) -> list[Any]:
    """The hub's records of ``rids``, once each shows its sequence left the engine (or at timeout)."""
    deadline = time.perf_counter() + timeout
    while True:
        records = [hub.record(rid) if rid else None for rid in rids]
        if all(r is None or r.released is not None for r in records) or time.perf_counter() > deadline:
            return records
        await asyncio.sleep(0.01)


def beside(rows: list[tuple[str, str, str, str]]) -> pd.DataFrame:
    """The chapter's figure beside ours, one quantity a row (the columns of ``chapter.py``'s tables)."""
    return pd.DataFrame(rows, columns=["quantity", "chapter (GPU)", "this run", "unit"])


def span(values: Any, fmt: str = "{:.2f}") -> str:
    """``low–high`` of the values (one number when they agree; ``n/a`` when there are none)."""
    values = pd.Series(values, dtype=float).dropna()
    if values.empty:
        return "n/a"
    low, high = fmt.format(values.min()), fmt.format(values.max())
    return low if low == high else f"{low}–{high}"


def server_checks(server: Any, timeout: float = 30.0) -> dict[str, Any]:
    """Once the server is idle: is the cache whole, is any stream still registered or held?

    Waits (bounded) for the engine and hub to empty, then has the step thread check the block
    books between two steps (``hub.check_integrity()``), so the check never races a step.
    """
    deadline = time.perf_counter() + timeout
    while time.perf_counter() < deadline:
        stats = server.engine.stats()
        if stats["running"] == 0 and stats["waiting"] == 0 and server.hub.open_streams == 0:
            break
        time.sleep(0.02)
    stats = server.engine.stats()
    try:
        server.hub.check_integrity().result(timeout)
        what = ""
    except AssertionError as exc:
        what = str(exc) or "check_integrity failed"
    whole = not what and stats["free_blocks"] == stats["total_blocks"]
    return {
        "cache_whole": whole,
        "held_blocks": stats["reserved_blocks"],
        "running": stats["running"],
        "waiting": stats["waiting"],
        "open_streams": server.hub.open_streams,
        "what": what,
    }
