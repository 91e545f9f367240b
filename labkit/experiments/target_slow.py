"""``labkit run slowclient --target URL``: do slow readers make a server's healthy streams wait?

Measured at the client, so it means the same for any OpenAI-compatible server. Each round sends
``healthy`` streams read at once, plus ``k`` slow readers on raw sockets with a small receive
buffer that take at most ``read_bytes`` per read and sleep between reads. The slow readers' pace
is a fraction (``read_ratio``) of the same server's write rate, measured first by one untimed
launch of the healthy streams alone (bytes per second of one stream), and the ratio they
achieved is shown beside the result (it must stay at or below one half: a "slow" reader that
keeps up tells nothing). Rounds are interleaved (k = 0, 1, 2, 0, 1, 2, ...), so every k has its
own same-run baseline: ``effect`` is a round's healthy makespan over the median k = 0 makespan.
The slow readers leave (by FIN) once the healthy streams are done.

What a client cannot see: where the slow stream's backlog waits (the server's queue, its socket
buffer, the kernel's) and what policy the server applied; labkit shows those in notebook 05.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from labkit.experiments.client import ReadOptions, StreamResult, run_sync, timed_stream
from labkit.experiments.profiles import Profile
from labkit.experiments.progress import Progress, doing, tick
from labkit.experiments.rawhttp import Leave, raw_stream
from labkit.experiments.readings import interleaved
from labkit.experiments.target import Target, read
from labkit.prompts import PROMPTS

__all__ = ["SlowConfig", "run_slow"]

UNAVAILABLE = (
    (
        "where the slow stream's backlog waits (queue, socket buffer)",
        "labkit's /stats and lab routes, which other servers lack; notebooks 04 and 05 measure it",
    ),
    (
        "which policy acted (pause, drop) and at which step",
        "labkit's lab routes, which other servers lack; notebook 05 measures it",
    ),
)


@dataclass(frozen=True)
class SlowConfig:
    healthy: int = 4
    slow: tuple[int, ...] = (0, 1, 2)  # slow readers per round; 0 is the same-run baseline
    max_tokens: int = 64
    read_ratio: float = 0.25  # a slow reader's pace as a fraction of the server's write rate
    read_bytes: int = 256  # at most this much per read
    rcvbuf: int = 4096  # the slow readers' SO_RCVBUF
    repetitions: int = 3

    @classmethod
    def for_profile(cls, profile: Profile) -> SlowConfig:
        return cls() if profile.full else cls(healthy=3, slow=(0, 2), max_tokens=16)

    @property
    def units(self) -> int:
        return len(self.slow) * self.repetitions

    def __post_init__(self) -> None:
        if 0 not in self.slow or min(self.slow) < 0:
            raise ValueError(f"SlowConfig.slow must include 0 (the baseline) and be >= 0, got {self.slow!r}")
        if self.repetitions < 3:
            raise ValueError(f"SlowConfig.repetitions must be >= 3, got {self.repetitions!r}")
        if not 0 < self.read_ratio <= 0.5:
            raise ValueError(f"SlowConfig.read_ratio must be in (0, 0.5], got {self.read_ratio!r}")
        if min(self.healthy, self.max_tokens, self.read_bytes, self.rcvbuf) < 1:
            raise ValueError(f"SlowConfig counts must be >= 1, got {self}")


def run_slow(target: Target, config: SlowConfig, progress: Progress | None = None) -> dict[str, pd.DataFrame]:
    doing(progress, f"measuring the write rate: {config.healthy} streams, not timed")
    write_rate = run_sync(_write_rate(target, config))
    sleep = config.read_bytes / (config.read_ratio * write_rate) if write_rate > 0 else 0.1
    rows = []
    for rep, k in interleaved(config.slow, config.repetitions):
        doing(progress, f"{config.healthy} healthy streams beside {k} slow, round {rep + 1}/{config.repetitions}")
        rows.append({"slow_readers": k, "round": rep, **run_sync(_round(target, config, k, sleep, write_rate))})
        tick(progress, runs=rows)
    runs = pd.DataFrame(rows)
    base = runs.loc[runs.slow_readers == 0, "healthy_makespan_s"].median()
    runs["effect"] = runs.healthy_makespan_s / base
    unavailable = pd.DataFrame([{"measurement": m, "status": "not available", "why": w} for m, w in UNAVAILABLE])
    return {"runs": runs, "effects": effect_table(runs), "unavailable": unavailable}


def _body(target: Target, i: int, config: SlowConfig) -> dict[str, Any]:
    return target.body(PROMPTS[i % len(PROMPTS)], config.max_tokens)


async def _write_rate(target: Target, config: SlowConfig) -> float:
    """Bytes per second one stream receives when every stream is read at once (median)."""
    async with target.client(config.healthy) as client:
        results = await asyncio.gather(
            *(timed_stream(client, _body(target, i, config), path=target.path) for i in range(config.healthy))
        )
    rates = [r.total_bytes / (r.ended - r.sent) for r in results if r.ended and r.ended > r.sent and r.total_bytes]
    return float(np.median(rates)) if rates else float("nan")


async def _round(target: Target, config: SlowConfig, k: int, sleep: float, write_rate: float) -> dict[str, Any]:
    leave = Leave()
    bound = target.timeout + 600
    slow_options = ReadOptions(
        sleep=sleep,
        read_bytes=config.read_bytes,
        leave_after_s=bound,
        leave_by="fin",
        drain_after_fin_s=0.5,
        timeout=bound,
    )
    slow = [
        asyncio.ensure_future(
            raw_stream(
                target.url,
                _body(target, config.healthy + i, config),
                slow_options,
                leave=leave,
                path=target.path,
                headers=target.headers,
            )
        )
        for i in range(k)
    ]
    options = ReadOptions(timeout=max(300.0, target.timeout))
    async with target.client(config.healthy) as client:
        healthy = await asyncio.gather(
            *(
                timed_stream(client, _body(target, i, config), path=target.path, options=options)
                for i in range(config.healthy)
            )
        )
    leave.set()
    slow_results: list[StreamResult] = list(await asyncio.gather(*slow))
    return round_row(healthy, slow_results, write_rate, time.perf_counter())


def round_row(healthy: list[StreamResult], slow: list[StreamResult], write_rate: float, now: float) -> dict[str, Any]:
    """One round: the healthy streams' makespan and pace, and what the slow readers achieved."""
    readings = [read(r) for r in healthy]
    start = min(r.sent for r in healthy)
    makespan = max((r.ended or now) for r in healthy) - start
    tokens = sum(r.tokens for r in readings if r.ok)
    slow_rates = [r.total_bytes / (_stopped(r, now) - r.sent) for r in slow if _stopped(r, now) > r.sent]
    ttft = [r.ttft for r in readings if r.ttft is not None]
    return {
        "healthy_makespan_s": makespan,
        "healthy_tokens": tokens,
        "healthy_tokens_per_s": tokens / makespan if makespan > 0 else float("nan"),
        "healthy_ttft_p50_s": float(np.median(ttft)) if ttft else float("nan"),
        "healthy_errors": sum(1 for r in readings if not r.ok),
        "slow_bytes_read": sum(r.total_bytes for r in slow),
        "slow_errors": sum(1 for r in slow if r.error and not r.left),
        "achieved_ratio": float(np.median(slow_rates)) / write_rate if slow_rates and write_rate > 0 else float("nan"),
    }


def _stopped(result: StreamResult, now: float) -> float:
    """When a reader stopped reading: when it left, else when its stream ended."""
    return result.left_at or result.ended or now


def effect_table(runs: pd.DataFrame) -> pd.DataFrame:
    """Per k: rounds, the healthy makespan and effect (median, min–max), the achieved read ratio."""
    rows = []
    for k, group in runs.groupby("slow_readers"):
        rows.append(
            {
                "slow_readers": int(k),
                "rounds": len(group),
                "healthy_makespan_s": group.healthy_makespan_s.median(),
                "effect": group.effect.median(),
                "effect_min": group.effect.min(),
                "effect_max": group.effect.max(),
                "achieved_ratio_max": group.achieved_ratio.max() if k else float("nan"),
                "healthy_errors": int(group.healthy_errors.sum()),
            }
        )
    return pd.DataFrame(rows)
