"""Notebook 03's step cost: the engine's decode step against batch size, in both modes.

Every (batch, mode) point is timed in rounds interleaved with the others, on engines prefilled
once and kept alive in this process (the engine's public API; a target without its engine here
cannot be measured this way). The table gives, per mode, the measured step at the smallest batch
and the marginal cost of one more sequence up to the largest: measured quantities, not a fit.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import pandas as pd

from labkit.experiments.isolation import MODES
from labkit.lab import Experiment, Sizes, Target, Trial, interval, judge, spread, tell
from labkit.lab.verdict import worst
from labkit.prompts import context_ids

BAR = 1.15  # the invariant step over the plain one, at most, at every batch


class Engines(dict[tuple[int, str], Any]):
    """One engine per (batch, mode), prefilled once and kept alive across the rounds."""

    close = dict.clear


def prepare_engines(target: Target, s: Sizes) -> Engines:
    from labkit import BatchEngine, EngineConfig

    loaded = target.loaded  # type: ignore[attr-defined]
    per_point = s.repetitions * (s.warmup + s.steps) + 2
    engines = Engines()
    for batch in s.batches:
        blocks = batch * -(-(s.context + per_point) // 16)
        for mode in MODES:
            config = EngineConfig(max_batch=batch, batch_invariant=mode == "invariant", num_blocks=blocks)
            engine = engines[batch, mode] = BatchEngine(loaded, config)
            for ids in context_ids(loaded.tokenizer, batch, s.context):
                engine.submit(ids, max_new_tokens=per_point, ignore_eos=True)
            while engine.stats()["running"] < batch or engine.stats()["waiting"]:
                engine.step()  # admission and prefill; the steps timed below only decode
    return engines


def measure_step(trial: Trial) -> dict[str, Any]:
    engine, s = trial.state[trial.batch, trial.mode], trial.sizes
    times = []
    for _ in range(s.warmup + s.steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    timed = times[s.warmup :]
    return {"step_ms": 1e3 * statistics.median(timed), "step_min_ms": 1e3 * min(timed),
            "context": s.context + trial.repetition * (s.warmup + s.steps)}  # fmt: skip


def step_tables(tables: dict[str, pd.DataFrame], s: Sizes) -> dict[str, pd.DataFrame]:
    """Per mode: the measured B=1 step (the fixed cost, not a fit) and the marginal cost of a
    sequence between the smallest and the largest batch, each with the rounds' range."""
    rows = tables["rows"]
    cost = spread(rows, ["mode", "batch"], "step_ms")
    marginal = []
    for mode, g in rows.groupby("mode"):
        small, big = min(s.batches), max(s.batches)
        by_round = g.pivot_table(index="repetition", columns="batch", values="step_ms")
        per_seq = (by_round[big] - by_round[small]) / (big - small)
        marginal.append({"mode": mode, "step_at_smallest_ms": by_round[small].median(), "largest_batch": big,
                         "ms_per_added_sequence": per_seq.median(), "ms_per_added_sequence_min": per_seq.min(),
                         "ms_per_added_sequence_max": per_seq.max(),
                         "largest_over_smallest": (by_round[big] / by_round[small]).median()})  # fmt: skip
    return {"step_cost": cost, "marginal": pd.DataFrame(marginal)}


def step_plots(tables: dict[str, pd.DataFrame], s: Sizes) -> list:
    from labkit.plots import new_figure, with_range

    cost, rows = tables["step_cost"], tables["rows"]
    fig, (ax,) = new_figure("overlap_step_cost")
    for mode, color in zip(MODES, ("tab:blue", "tab:orange")):
        g = cost[cost["mode"] == mode]
        with_range(ax, g.batch, g, "step_ms", fmt="o-", color=color, label=f"{mode}: median, min–max of rounds")
        r = rows[rows["mode"] == mode]
        ax.scatter(r.batch, r.step_ms, s=8, color=color, alpha=0.4)
    ax.set(xlabel="sequences in the batch", ylabel="ms per decode step", title="Decode-step cost, both modes, one run")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize="small")
    return [fig]


def step_verdicts(tables: dict[str, pd.DataFrame], s: Sizes) -> list:
    """Both are paired ratios, round by round, judged by their interval against the bar: a median
    over three rounds once read 1.12 against 1.15, which a fourth round could have turned."""
    rows = tables["rows"]
    by = rows.pivot_table(index=["batch", "repetition"], columns="mode", values="step_ms").dropna()
    told = {b: tell(interval(g["invariant"].to_numpy(), others=g["plain"].to_numpy()), BAR, "below")
            for b, g in by.groupby(level="batch")}  # fmt: skip
    big, small = max(s.batches), min(s.batches)
    g = rows[rows["mode"] == "invariant"].pivot_table(index="repetition", columns="batch", values="step_ms").dropna()
    cheap, evidence = tell(interval(g[big].to_numpy(), others=g[small].to_numpy()), big / 2, "below")
    return [
        judge("invariant costs no more", f"the batch-invariant step costs at most {BAR:g}× the plain one at every batch",
              f"at any batch the 95% interval of the invariant/plain ratio, round by round, lies above {BAR:g}",
              worst(d for d, _ in told.values()),
              "; ".join(f"batch {b}: {text}" for b, (_, text) in told.items())),
        judge("a step for many is cheap", f"a step of {big} costs less than {big / 2:g}× a step of one (invariant)",
              f"the 95% interval of the ratio, round by round, lies above {big / 2:g}", cheap,
              f"{big} over {small}: {evidence}"),
    ]  # fmt: skip


STEP_COST = Experiment(
    name="overlap.step_cost",
    title="The decode step against batch size, batch-invariant and plain",
    sizes={
        "full": {"batches": (1, 2, 4, 8, 16, 32), "context": 64, "steps": 10, "warmup": 2, "repetitions": 6},
        "ci": {"batches": (1, 2, 4, 8), "context": 64, "steps": 10, "warmup": 2, "repetitions": 6},
    },  # fmt: skip
    conditions=lambda s, target: [{"batch": b, "mode": m} for b in s.batches for m in MODES],
    prepare=prepare_engines,
    measure=measure_step,
    tables=step_tables,
    verdicts=step_verdicts,
    plots=step_plots,
    needs=("engine",),
)
