"""``labkit run disconnect --target URL``: does a server stop generating when its clients leave?

From the client's side there are two witnesses, and each condition uses what it has:

* the server's CPU time, from ``/proc/PID/stat``, when it runs on this machine (``--target-pid``):
  its rate while long streams are read, after they all leave, and with no streams at all;
* a follow-up request's pace (its median gap between chunks), for any target: a short request
  sent while the streams run, again right after they leave, and on the idle server. A batching
  server still generating for clients that left answers the second one as slowly as the first.

``release`` = (while - after) / (while - idle): 1 when the server went back to idle, 0 when it
carried on as if nobody had left. Where the streams do not change the witness measurably (a big
GPU server barely notices a few streams) the verdict says so instead of guessing. A labkit
target also answers ``GET /stats``: its running count after the leave is the server's own word.
Repetitions are interleaved (FIN, RST, FIN, RST, ...).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np
import pandas as pd

from labkit.experiments.client import (
    ReadOptions,
    StreamResult,
    run_sync,
    timed_stream,
)
from labkit.experiments.profiles import Profile
from labkit.experiments.progress import Progress, doing, tick
from labkit.experiments.records import LeaveBy
from labkit.experiments.target import Target, read
from labkit.experiments.target_probe import cpu_seconds
from labkit.experiments.waiting import WaitTimeout, await_for
from labkit.prompts import PROMPTS

__all__ = ["DisconnectConfig", "release", "run_disconnect"]

UNAVAILABLE = (
    (
        "the step at which each sequence's blocks came back",
        "labkit's own lab routes (GET /lab/streams), which other servers lack; notebook 06 measures it",
    ),
    ("Starlette's response against the write-only one", "a labkit server setting"),
)
#: below this relative change between idle and loaded, a witness cannot tell (the verdict says so)
MIN_EFFECT = 0.2


@dataclass(frozen=True)
class DisconnectConfig:
    streams: int = 8
    max_tokens: int = 1536  # long enough that a server ignoring the leave is still busy afterwards;
    # prompt + max_tokens must fit the served model's context (SmolLM2: 2048, tiny-gpt2: 512)
    hold_s: float = 2.0  # the streams are read this long, then all leave at once
    window_s: float = 2.0  # CPU is sampled this long, idle and after the leave
    follow_up_tokens: int = 24
    repetitions: int = 3
    leave_by: tuple[LeaveBy, ...] = ("fin", "rst")

    @classmethod
    def for_profile(cls, profile: Profile) -> DisconnectConfig:
        if profile.full:
            return cls()
        # 470 tokens read for 0.1 s: tiny-gpt2 made 2-32 of them by the leave, so a 3x faster engine
        # is still generating when the clients leave (400 read for 1 s: 165-353, and 2.5 s: all)
        return cls(streams=4, max_tokens=470, hold_s=0.1, window_s=1.0, follow_up_tokens=16)

    @property
    def units(self) -> int:
        return self.repetitions * len(self.leave_by)

    def __post_init__(self) -> None:
        if min(self.streams, self.max_tokens, self.repetitions) < 1 or self.follow_up_tokens < 3:
            raise ValueError(f"DisconnectConfig counts must be >= 1 (follow_up_tokens >= 3, for gaps), got {self}")
        if self.hold_s <= 0 or self.window_s <= 0:
            raise ValueError(f"DisconnectConfig.hold_s and window_s must be > 0, got {self.hold_s}, {self.window_s}")


def run_disconnect(
    target: Target, config: DisconnectConfig, progress: Progress | None = None
) -> dict[str, pd.DataFrame]:
    rows = []
    for rep in range(config.repetitions):
        for how in config.leave_by:
            doing(progress, f"{config.streams} streams leave by {how.upper()}, round {rep + 1}/{config.repetitions}")
            rows.append({"leave_by": how, "round": rep, **run_sync(measure_leave(target, config, how))})
            tick(progress, runs=rows)
    runs = pd.DataFrame(rows)
    unavailable = pd.DataFrame(
        [{"measurement": what, "status": "not available", "why": why} for what, why in UNAVAILABLE]
    )
    return {"runs": runs, "verdicts": verdict_table(runs, target), "unavailable": unavailable}


async def measure_leave(target: Target, config: DisconnectConfig, how: LeaveBy) -> dict[str, Any]:
    """Idle, while streams run, after they leave: CPU rate (if local) and a follow-up's latency."""
    pid = target.pid
    idle_cpu = await _cpu_rate(pid, config.window_s)
    idle_follow = await _follow_up(target, config)
    options = ReadOptions(
        leave_after_s=config.hold_s, leave_by=how, drain_after_fin_s=0.5, timeout=config.hold_s + target.timeout
    )
    results = [StreamResult(sent=0.0) for _ in range(config.streams)]
    async with target.client(config.streams) as client:
        tasks = [
            asyncio.ensure_future(
                timed_stream(
                    client,
                    target.body(PROMPTS[i % len(PROMPTS)], config.max_tokens),
                    path=target.path,
                    options=options,
                    result=r,
                )
            )
            for i, r in enumerate(results)
        ]
        with contextlib.suppress(WaitTimeout):  # at the bound: measure what has come
            await await_for(
                lambda: all(r.events or r.ended for r in results),
                timeout=config.hold_s + target.timeout,
                what="every stream's first event",
                interval=0.005,
            )
        start, cpu0 = time.perf_counter(), _cpu(pid)
        during_follow = await _follow_up(target, config)
        await asyncio.gather(*tasks)
        during_cpu = _rate(cpu0, _cpu(pid), time.perf_counter() - start)
    after_cpu = await _cpu_rate(pid, config.window_s)
    after_follow = await _follow_up(target, config)
    readings = [read(r) for r in results]
    failed = [r.error for r in readings if not r.ok and not r.result.left]
    return {
        "streams_left": sum(1 for r in results if r.left),
        "tokens_before_leaving": np.mean([r.tokens for r in readings]),
        "errors": len(failed),
        "error": failed[0] if failed else None,
        "idle_cpu": idle_cpu,
        "during_cpu": during_cpu,
        "after_cpu": after_cpu,
        "cpu_release": release(idle_cpu, during_cpu, after_cpu),
        "idle_follow_gap_s": idle_follow,
        "during_follow_gap_s": during_follow,
        "after_follow_gap_s": after_follow,
        "follow_release": release(idle_follow, during_follow, after_follow),
        "running_after": await _running(target),
    }


def release(idle: float, during: float, after: float) -> float:
    """How far ``after`` fell back from ``during`` to ``idle`` (1: all the way); NaN when the
    streams did not move the witness by :data:`MIN_EFFECT` of its idle value (nothing to tell)."""
    if any(np.isnan(v) for v in (idle, during, after)) or during - idle <= MIN_EFFECT * max(idle, 1e-3):
        return float("nan")
    return float((during - after) / (during - idle))


def verdict_table(runs: pd.DataFrame, target: Target) -> pd.DataFrame:
    rows = []
    runs = runs[runs.streams_left > 0]  # a round whose streams were refused witnesses nothing
    for how, group in runs.groupby("leave_by", sort=False):
        cpu, follow = group.cpu_release.median(), group.follow_release.median()
        witness, value = ("server CPU time", cpu) if not np.isnan(cpu) else ("follow-up latency", follow)
        rows.append(
            {
                "leave_by": how,
                "rounds": len(group),
                "cpu_release": cpu,
                "follow_release": follow,
                "witness": witness if not np.isnan(value) else "none",
                "verdict": _verdict(value),
                "running_after (labkit /stats)": _running_text(group.running_after, target),
            }
        )
    return pd.DataFrame(rows)


def _verdict(value: float) -> str:
    if np.isnan(value):
        return "unclear: the streams did not measurably load the server"
    return "stopped generating" if value >= 0.5 else "kept generating after the client left"


def _running_text(values: pd.Series, target: Target) -> str:
    if not target.quirks.labkit_internals:
        return "not available"
    return ", ".join(str(int(v)) for v in values)


# --------------------------------------------------------------------------- witnesses


def _cpu(pid: int | None) -> float:
    return cpu_seconds(pid) if pid is not None else float("nan")


def _rate(before: float, after: float, seconds: float) -> float:
    return (after - before) / seconds if seconds > 0 else float("nan")


async def _cpu_rate(pid: int | None, seconds: float) -> float:
    """CPU seconds per second the server used over the next ``seconds`` (NaN without a pid)."""
    if pid is None:
        return float("nan")
    start, cpu0 = time.perf_counter(), cpu_seconds(pid)
    await asyncio.sleep(seconds)
    return _rate(cpu0, cpu_seconds(pid), time.perf_counter() - start)


async def _follow_up(target: Target, config: DisconnectConfig) -> float:
    """The follow-up request's median gap between chunks: the server's pace, without the noise of
    connecting and prefill that its total duration would carry."""
    async with target.client() as client:
        result = await timed_stream(client, target.body(PROMPTS[-1], config.follow_up_tokens), path=target.path)
    reading = read(result)
    return float(np.median(reading.gaps)) if reading.ok and reading.gaps else float("nan")


async def _running(target: Target) -> float:
    if not target.quirks.labkit_internals:
        return float("nan")
    try:
        async with target.client(timeout=5.0) as client:
            return float((await client.get("/stats")).json()["running"])
    except (httpx.HTTPError, ValueError, KeyError):
        return float("nan")
