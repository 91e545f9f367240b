"""The client-side experiments against any OpenAI-compatible target: ``labkit run X --target URL``.

Each function takes a probed :class:`~labkit.experiments.target.Target` and returns named tables,
like the in-process experiments, and measures only what a client can see over HTTP, so it means
the same for labkit, vLLM or a server on another continent. What needs a server's internals
(block counts, step numbers, the engine's step cost) is listed in an ``unavailable`` table
rather than guessed.

* :func:`run_overlap`: 1 to N streams at once, after one untimed warm-up at the largest level,
  repetitions interleaved (every level once per round, so a drift in the server's load spreads
  over all levels): makespan, tokens/s, time to first token and gaps; speedup against the same
  sweep's single-stream runs (``level × median single-stream makespan / makespan``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pandas as pd

from labkit.experiments.client import percentiles
from labkit.experiments.profiles import Profile
from labkit.experiments.progress import Progress, doing, tick
from labkit.experiments.target import Reading, Target
from labkit.prompts import PROMPTS

__all__ = ["RUNS", "OverlapConfig", "run_overlap"]


def _at_least(owner: str, **values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise ValueError(f"{owner}.{name} must be >= 1, got {value!r}")


# --------------------------------------------------------------------------- overlap


@dataclass(frozen=True)
class OverlapConfig:
    levels: tuple[int, ...] = (1, 4, 16, 32)
    repetitions: int = 3
    max_tokens: int = 64

    @classmethod
    def for_profile(cls, profile: Profile) -> OverlapConfig:
        return cls() if profile.full else cls(levels=(1, 2, 4), max_tokens=16)

    @property
    def units(self) -> int:
        return len(self.levels) * self.repetitions

    def __post_init__(self) -> None:
        if not self.levels or 1 not in self.levels or min(self.levels) < 1:
            raise ValueError(f"OverlapConfig.levels must include 1 and be >= 1, got {self.levels!r}")
        if self.repetitions < 3:
            raise ValueError(f"OverlapConfig.repetitions must be >= 3 (ranges need them), got {self.repetitions!r}")
        _at_least("OverlapConfig", max_tokens=self.max_tokens)


OVERLAP_UNAVAILABLE = (
    ("decode-step cost by batch size", "needs the engine in-process (labkit run overlap, no --target)"),
    ("first token at prefill's end vs the step's end", "a labkit hub setting"),
    ("step numbers of each token", "labkit's /v1/stream events only"),
)


def run_overlap(target: Target, config: OverlapConfig, progress: Progress | None = None) -> dict[str, pd.DataFrame]:
    def bodies(level: int) -> list[dict[str, Any]]:
        return [target.body(PROMPTS[i % len(PROMPTS)], config.max_tokens) for i in range(level)]

    doing(progress, f"warming up: {max(config.levels)} streams, not timed")
    target.launch(bodies(max(config.levels)))  # first batches pay for lazy set-up (pools, graphs, caches)
    rows = []
    for rep in range(config.repetitions):
        for level in config.levels:
            doing(progress, f"{level} streams at once, round {rep + 1}/{config.repetitions}")
            readings, makespan = target.launch(bodies(level))
            rows.append({"level": level, "round": rep, **launch_row(readings, makespan, config.max_tokens)})
            tick(progress, runs=rows)
    runs = pd.DataFrame(rows)
    solo = runs.loc[runs.level == 1, "makespan_s"].median()
    runs["speedup"] = runs.level * solo / runs.makespan_s
    return {"runs": runs, "levels": level_table(runs), "unavailable": _unavailable(OVERLAP_UNAVAILABLE)}


def launch_row(readings: list[Reading], makespan: float, max_tokens: int) -> dict[str, Any]:
    ttft = percentiles(r.ttft for r in readings if r.ttft is not None)
    gaps = percentiles(g for r in readings for g in r.gaps)
    tokens = sum(r.tokens for r in readings if r.ok)
    return {
        "makespan_s": makespan,
        "tokens": tokens,
        "tokens_per_s": tokens / makespan if makespan > 0 else float("nan"),
        "ttft_p50_s": ttft["p50"],
        "ttft_p99_s": ttft["p99"],
        "gap_p50_s": gaps["p50"],
        "gap_p99_s": gaps["p99"],
        "errors": sum(1 for r in readings if not r.ok),
        "short_streams": sum(1 for r in readings if r.ok and r.tokens < max_tokens),
    }


def level_table(runs: pd.DataFrame) -> pd.DataFrame:
    """One row per level: the median of its rounds and the range (low–high) of the headline numbers."""

    def span(values: pd.Series, fmt: str) -> str:
        low, high = fmt.format(values.min()), fmt.format(values.max())
        return low if low == high else f"{low}–{high}"

    rows = []
    for level, group in runs.groupby("level"):
        rows.append(
            {
                "streams": level,
                "rounds": len(group),
                "tokens_per_s": group.tokens_per_s.median(),
                "tokens_per_s_range": span(group.tokens_per_s, "{:.1f}"),
                "speedup": group.speedup.median(),
                "speedup_range": span(group.speedup, "{:.2f}"),
                "ttft_p50_ms": 1e3 * group.ttft_p50_s.median(),
                "ttft_p99_ms": 1e3 * group.ttft_p99_s.median(),
                "gap_p50_ms": 1e3 * group.gap_p50_s.median(),
                "gap_p99_ms": 1e3 * group.gap_p99_s.median(),
                "errors": int(group.errors.sum()),
                "short_streams": int(group.short_streams.sum()),
            }
        )
    return pd.DataFrame(rows)


# --------------------------------------------------------------------------- shared


def _unavailable(rows: tuple[tuple[str, str], ...]) -> pd.DataFrame:
    return pd.DataFrame([{"measurement": what, "status": "not available", "why": why} for what, why in rows])


#: experiment name -> (config class, run function) for ``labkit run NAME --target URL``.
RUNS: dict[str, tuple[Any, Callable[..., dict[str, pd.DataFrame]]]] = {
    "overlap": (OverlapConfig, run_overlap),
}
