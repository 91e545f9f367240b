"""Slow and healthy readers launched together, and the server watched over HTTP.

Used by ``slowclient``, ``saturation`` and ``extensions``. Why a launcher of its own: a slow reader
must keep reading while the healthy ones run, and leave (RST) once they have all ended plus a short
``linger``, so that a run lasts as long as the healthy streams need (under ``naive`` that is the
slow reader's pace, which is the point) and not as long as a slow reader takes to read a whole
stream. The server is observed only through its routes (``GET /stats``, ``GET /lab/streams/{id}``,
``GET /lab/steps``), never by reading the engine or the hub from another thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import pandas as pd

from labkit.experiments.rawhttp import Leave, raw_stream
from labkit.experiments.records import ReadOptions, StreamResult
from labkit.experiments.waiting import WaitTimeout, await_for

__all__ = [
    "Pace",
    "Launch",
    "launch",
    "records",
    "stats",
    "StatsSampler",
    "read_rate",
]


@dataclass(frozen=True)
class Pace:
    """How one reader reads: at most ``read_bytes`` per read, then ``sleep`` seconds."""

    sleep: float = 0.0
    read_bytes: int = 64 * 1024
    leave_after_s: float = 120.0

    @property
    def slow(self) -> bool:
        return self.sleep > 0

    @property
    def options(self) -> ReadOptions:
        """The raw reader's options: this pace; at ``leave_after_s`` or when told, leave by RST."""
        return ReadOptions(
            sleep=self.sleep,
            read_bytes=self.read_bytes,
            leave_after_s=self.leave_after_s,
            leave_by="rst",
            drain_after_fin_s=0.5,
            timeout=max(300.0, self.leave_after_s),
        )


@dataclass
class Launch:
    results: list[StreamResult]
    samples: pd.DataFrame  # GET /stats every ``sample_every`` s (empty when not sampled)
    t0: float  # perf_counter at launch


async def launch(
    url: str,
    requests: Sequence[dict[str, Any]],
    paces: Sequence[Pace],
    *,
    first: int = 0,
    linger: float = 0.0,
    sample_every: float | None = None,
    until: Callable[[list[StreamResult]], Awaitable[None]] | None = None,
    rest_after: Callable[[list[StreamResult]], Awaitable[None]] | None = None,
) -> Launch:
    """Start every reader (the first ``first`` alone, the rest once each of those has a token, or
    once ``rest_after(results)`` has returned);
    once every healthy reader (``sleep == 0``) has ended, and ``until(results)`` (if given) has
    returned, the slow ones read ``linger`` s more and leave by RST. Every reader has left and
    been awaited when it returns."""
    results, flags = [StreamResult(sent=0.0) for _ in requests], [Leave() for _ in requests]
    sampler = StatsSampler(url, sample_every) if sample_every else None
    sampling = asyncio.ensure_future(sampler.run()) if sampler else None

    def start(index: range) -> list[asyncio.Future]:
        return [
            asyncio.ensure_future(raw_stream(url, requests[i], paces[i].options, leave=flags[i], result=results[i]))
            for i in index
        ]

    t0 = time.perf_counter()
    early, rest = start(range(first)), []
    try:
        await _until(lambda: all(r.tokens or r.ended for r in results[:first]), 120.0, "the first readers' tokens")
        if rest_after is not None:
            await rest_after(results)
        rest = start(range(first, len(requests)))
        readers = early + rest
        healthy = [f for f, p in zip(readers, paces) if not p.slow]
        if healthy:
            await asyncio.gather(*healthy)
        if until is not None:
            await until(results)
        await asyncio.sleep(linger)
        for flag, pace in zip(flags, paces):
            if pace.slow:
                flag.set()
        await asyncio.gather(*readers)
    finally:
        for flag in flags:
            flag.set()
        await asyncio.gather(*early, *rest, return_exceptions=True)
        if sampler and sampling:
            sampler.stop()
            await sampling
    return Launch(results, sampler.table(t0) if sampler else pd.DataFrame(), t0)


async def _until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    """Until ``condition()``; at ``timeout`` the launch goes on with what it has (no error)."""
    with contextlib.suppress(WaitTimeout):
        await await_for(condition, timeout=timeout, what=what, interval=0.005)


def read_rate(result: StreamResult) -> float:
    """Bytes per second a reader took off its socket, from its response head to its end (or its
    leaving): what it actually read, whatever pace it was asked for."""
    end = result.ended or result.left_at
    if result.headers_at is None or end is None or end <= result.headers_at:
        return float("nan")
    return result.total_bytes / (end - result.headers_at)


# --------------------------------------------------------------------------- the server, over HTTP


async def records(url: str, rids: Sequence[str | None], timeout: float = 60.0) -> list[dict[str, Any] | None]:
    """The hub's records of ``rids`` (``GET /lab/streams/{id}``) once each shows its sequence left
    the engine (``released``), or whatever they show at ``timeout``."""
    seen: list[list[dict[str, Any] | None]] = []
    async with httpx.AsyncClient(base_url=url, timeout=10.0) as client:

        async def all_released() -> bool:
            seen.append([await _record(client, rid) for rid in rids])
            return all(r is None or r.get("released") is not None for r in seen[-1])

        with contextlib.suppress(WaitTimeout):  # at the bound: whatever the records show
            await await_for(all_released, timeout=timeout, what="every record released")
    return seen[-1]


async def _record(client: httpx.AsyncClient, rid: str | None) -> dict[str, Any] | None:
    if not rid:
        return None
    response = await client.get(f"/lab/streams/{rid}")
    return response.json() if response.status_code == 200 else None


def stats(url: str) -> dict[str, Any]:
    """``GET /stats``: the engine's and the hub's books, read on the server's loop."""
    response = httpx.get(f"{url}/stats", timeout=10.0)
    response.raise_for_status()
    return response.json()


class StatsSampler:
    """``GET /stats`` every ``every`` seconds: running, paused, waiting, queued events."""

    COLUMNS = ["t", "running", "paused", "waiting", "queued_events"]

    def __init__(self, url: str, every: float = 0.05) -> None:
        self.url, self.every = url, every
        self.rows: list[dict[str, float]] = []
        self._stop = asyncio.Event()

    async def run(self) -> None:
        async with httpx.AsyncClient(base_url=self.url, timeout=10.0) as client:
            while not self._stop.is_set():
                s = (await client.get("/stats")).json()
                self.rows.append(
                    {
                        "t": time.perf_counter(),
                        "running": s["running"],
                        "paused": s["paused"],
                        "waiting": s["waiting"],
                        "queued_events": s["hub"]["queued_events"],
                    }
                )
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), self.every)

    def stop(self) -> None:
        self._stop.set()

    def table(self, t0: float) -> pd.DataFrame:
        table = pd.DataFrame(self.rows, columns=self.COLUMNS)
        return table.assign(t=table.t - t0)
