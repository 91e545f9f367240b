"""Notebook 03's levels verdicts, on rows made by hand: each can hold, fail, or stay unclear."""
from __future__ import annotations

import pandas as pd

from labkit.experiments import overlap, step_cost

SIZES = overlap.LEVELS.sizes_for("ci")
TOP = max(SIZES.levels)


def _rows(gap_growth: float, gap_at_one: float | None = 0.01) -> pd.DataFrame:
    """Six repetitions; tokens/s grows with the level; the top level's gap is ``gap_growth`` times level 1's."""
    rows = []
    for rep in range(6):
        for level in SIZES.levels:
            gap = None if gap_at_one is None else gap_at_one * (gap_growth if level == TOP else 1.0)
            rows.append({"level": level, "repetition": rep, "tokens": level * SIZES.tokens, "failed": 0,
                         "tokens_per_s": 10.0 * level + rep, "gap_p50_s": gap})  # fmt: skip
    return pd.DataFrame(rows)


def _said(rows: pd.DataFrame) -> dict[str, str]:
    return {v.name: v.outcome for v in overlap.LEVELS.verdicts({"rows": rows}, SIZES)}


def test_a_gap_that_grows_little_holds_and_one_that_grows_with_the_streams_is_falsified():
    assert _said(_rows(gap_growth=1.5))["per-stream gap"] == "holds"
    assert _said(_rows(gap_growth=float(TOP)))["per-stream gap"] == "falsified"


def test_with_no_gap_measured_the_gap_verdict_is_unclear_not_falsified():
    """Streams of one token have no gap: NaN compared with a bar is no evidence either way."""
    assert _said(_rows(gap_growth=1.0, gap_at_one=None))["per-stream gap"] == "unclear"


def test_overlap_in_steps_holds_when_a_step_serves_the_level_and_is_unclear_without_a_step_log():
    rows = _rows(gap_growth=1.5).assign(tokens_per_step=lambda r: r.level * 0.9)
    assert _said(rows)["overlap in steps"] == "holds"
    assert _said(rows.assign(tokens_per_step=1.0))["overlap in steps"] == "falsified"
    assert _said(rows.assign(tokens_per_step=float("nan")))["overlap in steps"] == "unclear"


def _joiners_waiting(steps_by_background: dict[int, list[float]]) -> str:
    rows = pd.DataFrame([{"background": b, "repetition": 0, "failed": False, "ttft_in_steps": x, "server_ttft_s": 0.05}
                         for b, waits in steps_by_background.items() for x in waits])  # fmt: skip
    return {v.name: v.outcome for v in overlap.joiner_verdicts({"rows": rows}, None)}["a joiner waits about a step"]


def test_each_running_batch_is_judged_by_its_own_median_joiner_not_the_pool():
    assert _joiners_waiting({0: [1.0] * 3, 8: [1.4, 1.5, 1.6], 24: [1.5, 1.6, 1.9]}) == "holds"
    # pooled, the median joiner waits 1.55 steps; at 24 running it waits 3: falsified
    assert _joiners_waiting({0: [1.0] * 3, 8: [1.4, 1.5, 1.6, 1.5, 1.5], 24: [3.0, 3.1, 2.9]}) == "falsified"
    assert _joiners_waiting({0: [1.0] * 3}) == "unclear"  # no joiner into a running batch: no evidence


def _delivery(step_end_over_prefill: list[float]) -> dict[str, str]:
    """Six repetitions of both delivery modes; every quantile of step-end's first tokens is the
    repetition's ratio times prefill's."""
    rows = []
    for rep, ratio in enumerate(step_end_over_prefill):
        for mode, scale in (("prefill", 1.0), ("step_end", ratio)):
            rows.append({"first_token": mode, "repetition": rep, "failed": 0}
                        | {f"ttft_{q}_s": 0.5 * scale for q in overlap.QUANTILES})  # fmt: skip
    t = {"rows": pd.DataFrame(rows)}
    t.update(overlap.delivery_tables(t, None))
    return {v.name: v.outcome for v in overlap.delivery_verdicts(t, None)}


def test_first_tokens_of_one_pass_are_the_same_either_way_and_a_real_difference_falsifies_it():
    """Within the band fixed before measuring holds; a step-end delivery twice as late (what
    per-prompt prefills would give the median) is falsified; a spread across the band's edge is unclear."""
    names = ("one pass, one moment: the median", "one pass, one moment: the last")
    assert [_delivery([1.0, 1.05, 0.97, 1.02, 1.1, 0.95])[n] for n in names] == ["holds", "holds"]
    assert [_delivery([2.0, 1.9, 2.2, 2.1, 1.8, 2.05])[n] for n in names] == ["falsified", "falsified"]
    assert [_delivery([1.0, 1.5, 0.9, 1.4, 1.1, 1.3])[n] for n in names] == ["unclear", "unclear"]


def _step_cost(invariant_over_plain: list[float], largest_over_one: float = 4.0) -> dict[str, str]:
    """One row per round, batch and mode: the plain step 10 ms at batch 1, growing with the batch
    so that the largest batch's step is ``largest_over_one`` times batch 1's; the invariant step is
    the round's ratio times the plain one."""
    s = overlap.STEP_COST.sizes_for("ci")
    big = max(s.batches)
    rows = []
    for rep, ratio in enumerate(invariant_over_plain):
        for b in s.batches:
            plain = 10.0 * (1 + (largest_over_one - 1) * (b - 1) / (big - 1))
            rows += [{"repetition": rep, "batch": b, "mode": "plain", "step_ms": plain},
                     {"repetition": rep, "batch": b, "mode": "invariant", "step_ms": plain * ratio}]  # fmt: skip
    return {v.name: v.outcome for v in overlap.STEP_COST.verdicts({"rows": pd.DataFrame(rows)}, s)}


def test_the_step_costs_are_judged_by_the_interval_of_their_round_by_round_ratios():
    """Every round under the bar holds; every round over it is falsified; rounds on both sides, or
    too few rounds for an interval, are unclear, however the median falls."""
    bar = step_cost.BAR
    assert _step_cost([1.05] * 6)["invariant costs no more"] == "holds"
    assert _step_cost([bar + 0.1] * 6)["invariant costs no more"] == "falsified"
    assert _step_cost([1.05, 1.10, 1.12, 1.12, 1.2, 1.3])["invariant costs no more"] == "unclear"
    assert _step_cost([1.05] * 3)["invariant costs no more"] == "unclear"
    big = max(overlap.STEP_COST.sizes_for("ci").batches)
    assert _step_cost([1.0] * 6, largest_over_one=big / 4)["a step for many is cheap"] == "holds"
    assert _step_cost([1.0] * 6, largest_over_one=big)["a step for many is cheap"] == "falsified"
