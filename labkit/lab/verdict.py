"""The lab's rules for a reading, in code: the spread, an interval for an effect, and a verdict.

A comparison is made only between conditions measured in the same run, repeated in the order
A B C, A B C, …, and shown as the median with its min–max. Where conditions are compared, the
effect gets a 95% interval (a bootstrap over repetitions, or an exact test where counts are
small), and a hypothesis "holds" only when the interval excludes no effect; where n is too small
to decide, the verdict is "unclear" and says how many repetitions would. The words of a verdict
(its claim and criterion) are fixed before measuring; its evidence is computed from the data.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import pandas as pd

__all__ = [
    "Verdict", "verdict_table", "checked_lines", "spread", "span", "interval", "Interval", "judge", "tell", "every", "seen",
]  # fmt: skip

Outcome = Literal["holds", "falsified", "unclear"]


@dataclass(frozen=True)
class Interval:
    """An estimate with its 95% interval and the n behind it."""

    estimate: float
    low: float
    high: float
    n: int

    def __str__(self) -> str:
        if not np.isfinite(self.low):
            return f"{self.estimate:.3g} (n={self.n}: too few for a 95% interval)"
        return f"{self.estimate:.3g} (95% CI {self.low:.3g}–{self.high:.3g}, n={self.n})"


@dataclass(frozen=True)
class Verdict:
    """A hypothesis, what would falsify it, and what this run's data said.

    ``checked`` marks a verdict that must come out the same under every profile (the tiny ci model
    and SmolLM2): :func:`checked_lines` prints those for nbval, without numbers.
    """

    name: str
    claim: str
    criterion: str
    outcome: Outcome
    evidence: str
    checked: bool = False


def judge(
    name: str, claim: str, criterion: str, holds: bool | None, evidence: str, *, checked: bool = False
) -> Verdict:
    """A verdict from a decision: True holds, False falsified, None unclear."""
    outcome: Outcome = "unclear" if holds is None else "holds" if holds else "falsified"
    return Verdict(name, claim, criterion, outcome, evidence, checked)


def side(table: pd.DataFrame, key: object) -> pd.Series:
    """``table[key]``, or all missing where no row had it (a run without that condition, as a
    size override or a target can give): a verdict over it is then unclear, not an error."""
    return table[key] if key in table.columns else pd.Series(np.nan, index=table.index, dtype=float)


def every(values: pd.Series | Sequence[bool]) -> bool | None:
    """All true, over the values there are: a condition with no rows (skipped, filtered away, or
    all missing) proves nothing either way, and gives None (unclear)."""
    values = pd.Series(values, dtype=object).dropna()
    return bool(values.astype(bool).all()) if len(values) else None


def worst(decisions: Iterable[bool | None]) -> bool | None:
    """Several decisions as one: falsified (False) if any is, else unclear (None) if any is or there are
    none (nothing proves nothing, as with :func:`every`), else holds."""
    decisions = list(decisions)
    return False if False in decisions else None if None in decisions or not decisions else True


def seen(values: pd.Series) -> list:
    """The distinct values, sorted, as an evidence string quotes them (``[6]``, ``[200, 204]``): a
    column that pandas made float for a missing value still quotes its whole numbers as ints."""
    return sorted({int(v) if isinstance(v, float) and v.is_integer() else v for v in pd.Series(values).dropna()})


def verdict_table(verdicts: Iterable[Verdict]) -> pd.DataFrame:
    rows = [
        {
            "hypothesis": v.name,
            "claim": v.claim,
            "falsified if": v.criterion,
            "verdict": v.outcome,
            "evidence": v.evidence,
        }
        for v in verdicts
    ]
    return pd.DataFrame(rows, columns=["hypothesis", "claim", "falsified if", "verdict", "evidence"]).set_index(
        "hypothesis"
    )


def checked_lines(verdicts: Iterable[Verdict]) -> str:
    """``name: holds`` for each checked verdict: no numbers, so the line reads the same under
    every profile while the effect holds."""
    return "\n".join(f"{v.name}: {v.outcome}" for v in verdicts if v.checked)


def spread(table: pd.DataFrame, by: str | list[str], values: str | list[str]) -> pd.DataFrame:
    """Median, min and max of each of ``values`` per group of ``by``, with the count ``n``."""
    values = [values] if isinstance(values, str) else list(values)
    grouped = table.groupby(by, sort=True)[values]
    out = grouped.agg(["median", "min", "max"])
    out.columns = [f"{v}_{stat}" for v, stat in out.columns]
    out.insert(0, "n", grouped.size())
    return out.reset_index()


def span(values: Iterable[float], fmt: str = "{:.2f}", unit: str = "") -> str:
    """``median (min–max)`` of ``values``: how a reading is quoted in a table's evidence."""
    s = pd.Series(list(values), dtype=float).dropna()
    if s.empty:
        return "n/a"
    med, lo, hi = (fmt.format(x) for x in (s.median(), s.min(), s.max()))
    return f"{med}{unit} ({lo}–{hi}{unit})" if lo != hi else f"{med}{unit}"


def interval(values: Sequence[float] | np.ndarray, *, others: Sequence[float] | np.ndarray | None = None) -> Interval:
    """A 95% interval for the median of ``values`` or, with ``others``, for the ratio of the two.

    The interval is distribution-free: the order statistics whose binomial coverage of the median
    is at least 95% (6 values at least; with fewer the interval is the whole line, and
    :func:`tell` says how many would do). ``others`` are measured in the same repetitions (the
    lab's interleaved design: element i of each from repetition i), and the interval is that of
    the ratios repetition by repetition.
    """
    if others is None:
        return _median_interval(_clean(values))
    if len(values) != len(others):
        raise ValueError(f"paired samples need one value each per repetition, got {len(values)} and {len(others)}")
    ratios = np.asarray(values, dtype=float) / np.asarray(others, dtype=float)
    return _median_interval(ratios[np.isfinite(ratios)])


def _clean(values: Sequence[float] | np.ndarray) -> np.ndarray:
    a = np.asarray(values, dtype=float)
    return a[~np.isnan(a)]


def _median_interval(a: np.ndarray) -> Interval:
    """[x(k+1), x(n-k)] covers the median with probability 1 - 2 P(Binomial(n, 1/2) <= k); the
    narrowest with at least 95% (k = -1: none has, too few values)."""
    n = len(a)
    point = float(np.median(a)) if n else float("nan")
    cdf = np.cumsum([math.comb(n, i) for i in range(n + 1)]) / 2**n
    k = max((k for k in range(n // 2) if 1 - 2 * cdf[k] >= 0.95), default=-1)
    if k < 0:
        return Interval(point, -np.inf, np.inf, n)
    ordered = np.sort(a)
    return Interval(point, float(ordered[k]), float(ordered[n - 1 - k]), n)


MIN_FOR_MEDIAN = 6  # the fewest values whose extremes bound the median with 95% coverage


PRACTICAL_REPEATS = 10  # times the run's n: beyond it, no run this lab would make decides it


def unclear_needs(n: int, estimate: float, low: float, high: float, null: float) -> int | None:
    """Roughly how many repetitions would make an interval this wide exclude ``null`` (widths
    shrink as 1/sqrt(n)); None where that is over ``PRACTICAL_REPEATS`` times ``n``: an estimate
    at or near the null, where more of the same would not decide it and only a larger effect
    or a quieter measurement would."""
    half, distance = max(abs(high - low) / 2, 1e-12), abs(estimate - null)
    if not np.isfinite(half):  # an unbounded end: say twice as many
        return 2 * n
    if distance == 0 or half / distance > np.sqrt(PRACTICAL_REPEATS):
        return None
    return int(np.ceil(n * (half / distance) ** 2))


def tell(ci: Interval, null: float, better: Literal["above", "below"]) -> tuple[bool | None, str]:
    """Holds (True) when the interval lies wholly on the ``better`` side of ``null``, falsified
    (False) when wholly on the other side, unclear (None) otherwise; and the evidence text."""
    if better == "above":
        decided = True if ci.low > null else False if ci.high < null else None
    else:
        decided = True if ci.high < null else False if ci.low > null else None
    text = str(ci)
    if decided is None:
        need = MIN_FOR_MEDIAN if not np.isfinite(ci.low) else unclear_needs(ci.n, ci.estimate, ci.low, ci.high, null)
        if need is None:
            text += f"; the estimate lies too near {null:g} for more repetitions to decide it (over {PRACTICAL_REPEATS}x these)"
        else:
            text += f"; about {max(need, ci.n + 1)} repetitions would decide it"
    return decided, text
