"""``labkit run leak --target URL``: after many streams that end every way a client can end them,
is the server back where it started?

The leak test at the HTTP level, for any OpenAI-compatible server. ``streams`` requests run in
waves of ``concurrency``; each ends one of four ways, in turn: read to the end, left by FIN after
a few tokens, left by RST after a few tokens, left by RST before the first token. Then the
server is compared with itself before the run, by what a client can see: its CPU time (from
``/proc/PID/stat``, when it runs here) and a follow-up request's pace. A labkit target also
answers ``GET /stats``, whose free blocks and running count are the server's own word; for
others that row says "not available".
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np
import pandas as pd

from labkit.experiments.client import ReadOptions, run_sync, timed_stream
from labkit.experiments.profiles import Profile
from labkit.experiments.progress import Progress, doing, tick
from labkit.experiments.target import Target, read
from labkit.experiments.target_disconnect import _cpu_rate, _follow_up
from labkit.prompts import PROMPTS

__all__ = ["LeakConfig", "run_leak", "ENDINGS"]

#: how the i-th stream ends: (name, read options)
ENDINGS: tuple[tuple[str, ReadOptions], ...] = (
    ("read to the end", ReadOptions()),
    ("FIN after 3 tokens", ReadOptions(leave_after_tokens=3, leave_by="fin", drain_after_fin_s=0.5)),
    ("RST after 3 tokens", ReadOptions(leave_after_tokens=3, leave_by="rst")),
    ("RST before the first token", ReadOptions(leave_after_tokens=0, leave_by="rst")),
)
#: after the run, the witnesses may exceed their idle value by this share (and the CPU by 0.05 s/s)
SLACK = 0.25


@dataclass(frozen=True)
class LeakConfig:
    streams: int = 300
    concurrency: int = 16
    max_tokens: int = 32
    window_s: float = 1.5
    follow_up_tokens: int = 16

    @classmethod
    def for_profile(cls, profile: Profile) -> LeakConfig:
        return (
            cls() if profile.full else cls(streams=24, concurrency=8, max_tokens=12, window_s=0.5, follow_up_tokens=8)
        )

    @property
    def units(self) -> int:
        return -(-self.streams // self.concurrency)

    def __post_init__(self) -> None:
        if min(self.streams, self.concurrency, self.max_tokens) < 1 or self.follow_up_tokens < 3:
            raise ValueError(f"LeakConfig counts must be >= 1 (follow_up_tokens >= 3), got {self}")
        if self.window_s <= 0:
            raise ValueError(f"LeakConfig.window_s must be > 0, got {self.window_s!r}")


def run_leak(target: Target, config: LeakConfig, progress: Progress | None = None) -> dict[str, pd.DataFrame]:
    doing(progress, "the server at rest: CPU time, a follow-up request, /stats")
    before = run_sync(_witness(target, config))
    rows: list[dict[str, Any]] = []
    for start in range(0, config.streams, config.concurrency):
        count = min(config.concurrency, config.streams - start)
        doing(progress, f"streams {start + 1}–{start + count} of {config.streams}")
        rows += run_sync(_wave(target, config, start, count))
        tick(progress, streams=rows)
    after = run_sync(_witness(target, config))
    streams = pd.DataFrame(rows)
    endings = (
        streams.groupby("ending", sort=False)
        .agg(streams=("index", "size"), left=("left", "sum"), errors=("error", lambda e: int(e.notna().sum())))
        .reset_index()
    )
    return {"streams": streams, "endings": endings, "state": state_table(before, after, target)}


async def _wave(target: Target, config: LeakConfig, start: int, count: int) -> list[dict[str, Any]]:
    async with target.client(count) as client:

        async def one(i: int) -> dict[str, Any]:
            name, options = ENDINGS[i % len(ENDINGS)]
            body = target.body(PROMPTS[i % len(PROMPTS)], config.max_tokens)
            result = await timed_stream(client, body, path=target.path, options=options)
            reading = read(result)
            failed = reading.error if not reading.ok and not result.left else None
            return {"index": i, "ending": name, "left": bool(result.left), "tokens": reading.tokens, "error": failed}

        return list(await asyncio.gather(*(one(start + j) for j in range(count))))


async def _witness(target: Target, config: LeakConfig) -> dict[str, float]:
    from labkit.experiments.target_disconnect import DisconnectConfig

    follow = DisconnectConfig(follow_up_tokens=config.follow_up_tokens)
    await asyncio.sleep(config.window_s / 2)  # let the last closes land
    return {
        "cpu_s_per_s": await _cpu_rate(target.pid, config.window_s),
        "follow_up_gap_ms": 1e3 * await _follow_up(target, follow),
        **await _stats(target),
    }


async def _stats(target: Target) -> dict[str, float]:
    if not target.quirks.labkit_internals:
        return {}
    try:
        async with target.client(timeout=5.0) as client:
            stats = (await client.get("/stats")).json()
        return {k: float(stats[k]) for k in ("free_blocks", "running", "waiting", "open_streams")}
    except (httpx.HTTPError, ValueError, KeyError):
        return {}


def state_table(before: dict[str, float], after: dict[str, float], target: Target) -> pd.DataFrame:
    """Each witness before and after the run, and whether it came back (within :data:`SLACK`)."""
    rows = []
    for key in ("cpu_s_per_s", "follow_up_gap_ms", "free_blocks", "running", "waiting", "open_streams"):
        b, a = before.get(key, float("nan")), after.get(key, float("nan"))
        if np.isnan(b) or np.isnan(a):
            why = "no pid given" if key == "cpu_s_per_s" else "labkit's /stats only"
            rows.append({"witness": key, "before": b, "after": a, "back": f"not available ({why})"})
            continue
        if key == "cpu_s_per_s":
            back = a <= b * (1 + SLACK) + 0.05
        elif key == "follow_up_gap_ms":
            back = a <= b * (1 + SLACK)
        else:
            back = a == b
        rows.append({"witness": key, "before": b, "after": a, "back": "yes" if back else "NO"})
    return pd.DataFrame(rows)
