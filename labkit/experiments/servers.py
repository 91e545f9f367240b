"""The server's side of a run: which server to measure, what it holds while readers run, and
whether it let everything go afterwards.

* :func:`serving` and :func:`server_like` reuse a notebook's server (when it already has the
  settings a measurement needs) and otherwise start one on the same loaded model.
* :func:`launch_readers` runs many :func:`~labkit.experiments.rawhttp.raw_stream` readers at
  once while :class:`Sampler` records the engine's running, paused and waiting counts and the
  hub's queued events every few milliseconds.
* :func:`wait_released` waits for the server's own record of each stream to show that its
  sequence left the engine; :func:`server_checks` asks, once it is idle, whether the cache is whole.

Times are ``time.perf_counter()``: the server runs in this process, so its records and the
client's times are on one clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator, Sequence
from typing import Any

import pandas as pd

from labkit.experiments.rawhttp import Leave
from labkit.experiments.rawhttp import raw_stream as read_stream
from labkit.experiments.records import StreamResult

__all__ = [
    "serving",
    "server_like",
    "loaded_model",
    "launch_readers",
    "Sampler",
    "wait_released",
    "server_checks",
]


@contextlib.contextmanager
def serving(server: Any = None, **options: Any) -> Iterator[Any]:
    """``server`` if one was given (left running), else a fresh ``serve_in_thread(**options)``.

    Why: notebooks start the server themselves and pass it in; the CLI and tests let the
    experiment start its own. Either way, whoever started it stops it.
    """
    if server is not None:
        yield server
        return
    from labkit.server import serve_in_thread

    with serve_in_thread(**options) as started:
        yield started


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
