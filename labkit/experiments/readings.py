"""The lab's rules for a reading, in code: interleaved repetitions, the spread, a verdict per
hypothesis, and the state of the machine while it was measured.

Why one module: every experiment follows the same rules (``DEVELOPERS.md``, "How to measure"),
so they are written once. A comparison is made only between conditions measured in the same run,
repeated in the order A B C, A B C, … (a drift in the machine's load then spreads over every
condition instead of landing on one), and shown as the median with its min–max. A notebook states
its hypotheses before it measures and prints a :class:`Verdict` for each after: whether the
criterion that would falsify it was met, and the numbers that decided it.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import pandas as pd

from labkit.experiments.profiles import repo_root
from labkit.machine import busy_seconds, loadavg, own_seconds

__all__ = [
    "interleaved",
    "spread",
    "span",
    "Verdict",
    "verdict_lines",
    "verdict_table",
    "MachineState",
    "machine_record",
    "quiet_line",
    "step_table",
    "step_spread",
    "fetch_steps",
    "current_step",
    "code_dirty",
    "QUIET_OTHERS_SHARE",
]

T = TypeVar("T")

QUIET_OTHERS_SHARE = 0.10
"""A run is quiet when other processes used less than this share of the machine's CPUs while it
ran. (The load average alone cannot say: the run's own client and server raise it.)"""


# -- repetitions ---------------------------------------------------------------------------------
def interleaved(conditions: Sequence[T], repetitions: int) -> Iterator[tuple[int, T]]:
    """``(repetition, condition)`` in the order A B C, A B C, …; ``repetitions`` ≥ 1."""
    if repetitions < 1:
        raise ValueError(f"repetitions must be >= 1, got {repetitions!r}")
    for rep in range(repetitions):
        for condition in conditions:
            yield rep, condition


def spread(table: pd.DataFrame, by: str | list[str], values: str | list[str]) -> pd.DataFrame:
    """Median, min and max of each of ``values`` per group of ``by``, with the number of
    repetitions ``n``: columns ``<value>_median``, ``<value>_min``, ``<value>_max``."""
    values = [values] if isinstance(values, str) else list(values)
    grouped = table.groupby(by, sort=True)[values]
    out = grouped.agg(["median", "min", "max"])
    out.columns = [f"{v}_{stat}" for v, stat in out.columns]
    out.insert(0, "n", grouped.size())
    return out.reset_index()


def span(values: Iterable[float], fmt: str = "{:.2f}", unit: str = "") -> str:
    """``median (min–max)`` of ``values`` as text: how a reading is quoted in prose."""
    s = pd.Series(list(values), dtype=float).dropna()
    if s.empty:
        return "n/a"
    med, lo, hi = (fmt.format(x) for x in (s.median(), s.min(), s.max()))
    return f"{med}{unit} ({lo}–{hi}{unit})" if lo != hi else f"{med}{unit}"


# -- verdicts ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Verdict:
    """A hypothesis, the criterion that would falsify it, and what the data said.

    ``hypothesis`` and ``criterion`` are static text written before the measurement; ``evidence``
    is rendered from the data. :func:`verdict_lines` prints the name and the verdict only, so
    the line reads the same under every profile while the effect holds (an nbval-checked cell).
    """

    name: str
    hypothesis: str
    criterion: str  # what would falsify the hypothesis
    holds: bool
    evidence: str

    @property
    def word(self) -> str:
        return "holds" if self.holds else "FALSIFIED"


def verdict_lines(verdicts: Iterable[Verdict]) -> str:
    """``<name>: holds`` (or ``FALSIFIED``), one line each; no numbers, so nbval can check it."""
    return "\n".join(f"{v.name}: {v.word}" for v in verdicts)


def verdict_table(verdicts: Iterable[Verdict]) -> pd.DataFrame:
    """The verdicts with their hypotheses, falsification criteria and evidence, one row each."""
    rows = [
        {
            "hypothesis": v.name,
            "claim": v.hypothesis,
            "falsified if": v.criterion,
            "verdict": v.word,
            "evidence": v.evidence,
        }
        for v in verdicts
    ]
    return pd.DataFrame(rows).set_index("hypothesis")


# -- the machine -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class MachineState:
    """What the machine was doing at one moment: wall clock, load averages, CPU jiffies used by
    everyone (``/proc/stat``) and by this process and its children."""

    wall: float
    loadavg: tuple[float, float, float]
    busy_s: float | None  # every process's CPU seconds since boot (None off Linux)
    own_s: float  # this process's and its children's CPU seconds

    @classmethod
    def now(cls) -> MachineState:
        return cls(time.monotonic(), _loadavg(), _busy_seconds(), _own_seconds())


def machine_record(before: MachineState, after: MachineState) -> dict[str, Any]:
    """The ``machine`` section of ``results.json``: load averages before and after, this run's
    CPU seconds, the share of the CPUs other processes used meanwhile, and whether that was quiet."""
    wall = max(after.wall - before.wall, 1e-9)
    cpus = os.cpu_count() or 1
    own = after.own_s - before.own_s
    others = None
    if before.busy_s is not None and after.busy_s is not None:
        others = max(0.0, (after.busy_s - before.busy_s) - own) / (wall * cpus)
    return {
        "loadavg_before": list(before.loadavg),
        "loadavg_after": list(after.loadavg),
        "cpu_count": cpus,
        "wall_s": round(wall, 3),
        "cpu_s": round(own, 3),
        "others_cpu_share": None if others is None else round(others, 4),
        "quiet": None if others is None else others < QUIET_OTHERS_SHARE,
        "code_dirty": code_dirty(),
    }


def quiet_line(machine: dict[str, Any] | None) -> str:
    """One sentence on whether the run was quiet, computed from its ``machine`` record."""
    if not machine:
        return "No record of the machine's state for this run."
    share = machine.get("others_cpu_share")
    before = machine.get("loadavg_before", [None])[0]
    cpus = machine.get("cpu_count")
    if share is None:
        return f"Load average before the run {before} on {cpus} CPUs; other processes' share is unknown here."
    verdict = "quiet" if machine.get("quiet") else "NOT quiet: compare its seconds with care (steps still hold)"
    dirty = " The code had uncommitted changes." if machine.get("code_dirty") else ""
    return (
        f"The run was {verdict}: other processes used {share:.0%} of the {cpus} CPUs while it ran "
        f"(load average {before:.2f} before, {machine['loadavg_after'][0]:.2f} after; the run's own "
        f"client and server count in the latter).{dirty}"
    )


def _loadavg() -> tuple[float, float, float]:
    return loadavg() or (float("nan"), float("nan"), float("nan"))  # no load average (Windows)


_busy_seconds = busy_seconds
_own_seconds = own_seconds


def code_dirty() -> bool | None:
    """Are there uncommitted changes to the code (labkit/, tests/, pyproject.toml, Makefile)?
    The run's own outputs (notebooks, data/, figures/) do not count. None without git."""
    try:
        out = subprocess.run(
            ["git", "status", "--porcelain", "--", "labkit", "tests", "pyproject.toml", "Makefile"],
            cwd=repo_root(),
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return None if out.returncode != 0 else bool(out.stdout.strip())


# -- the step clock -------------------------------------------------------------------------------
def fetch_steps(base_url: str, since: int = 0, timeout: float = 10.0) -> pd.DataFrame:
    """The server's step log after step ``since``, over HTTP (``GET /lab/steps``; the lab routes
    must be on, as ``serve_in_thread`` has them)."""
    import httpx

    r = httpx.get(f"{base_url.rstrip('/')}/lab/steps", params={"since": since}, timeout=timeout, trust_env=False)
    r.raise_for_status()
    return step_table(r.json()["steps"])


def current_step(base_url: str, timeout: float = 10.0) -> int:
    """The number of the server's latest engine step, over HTTP (``GET /lab/steps``, asking for
    no records)."""
    import httpx

    r = httpx.get(f"{base_url.rstrip('/')}/lab/steps", params={"since": 2**62}, timeout=timeout, trust_env=False)
    r.raise_for_status()
    return int(r.json()["step"])


def step_table(records: Iterable[Any]) -> pd.DataFrame:
    """Step records (dicts or ``StepRecord``) as a table: step, started, seconds, decoded, prefilled."""
    from dataclasses import asdict, is_dataclass

    rows = [asdict(r) if is_dataclass(r) and not isinstance(r, type) else dict(r) for r in records]
    return pd.DataFrame(rows, columns=["step", "started", "seconds", "decoded", "prefilled"])


def step_spread(steps: pd.DataFrame) -> dict[str, Any]:
    """How steady the steps were: count and the 10th, 50th, 90th percentiles and max of their
    duration in ms, for decode-only steps (no prefill in them) and for all."""

    def quantiles(s: pd.Series) -> dict[str, Any]:
        if s.empty:
            return {"n": 0}
        ms = s * 1e3
        return {
            "n": int(len(ms)),
            "p10_ms": round(float(ms.quantile(0.1)), 3),
            "p50_ms": round(float(ms.median()), 3),
            "p90_ms": round(float(ms.quantile(0.9)), 3),
            "max_ms": round(float(ms.max()), 3),
        }

    if steps.empty:
        return {"all": {"n": 0}, "decode_only": {"n": 0}}
    decode_only = steps[(steps["prefilled"] == 0) & (steps["decoded"] > 0)]["seconds"]
    return {"all": quantiles(steps["seconds"]), "decode_only": quantiles(decode_only)}
