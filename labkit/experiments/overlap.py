"""Experiment 3, ``overlap``: what a batched engine gives 1 to 32 simultaneous streams.

Four measurements, all from a client's side of HTTP except the second:

* levels: the first N prompts sent at once, each on its own connection; makespan (first request
  sent to last stream ended), aggregate tokens/s, time to first token and gap between tokens
  (median and p99 over every stream of the level), against the back-to-back sum of the same
  prompts' solo runs, which is what serving them one after another would take;
* step cost: the engine's decode step (no prefill in it) against batch size, with a fitted line,
  from :func:`labkit.bench.bench_step` on the served model; it explains the aggregate;
* late joiners: short requests at random moments while long streams run, and on an idle engine;
  a joiner should wait for the step in progress and its own prefill, and no more;
* first-token delivery: N streams at once with each first token delivered as its own prefill
  ends, against delivery at the end of the step (the hub's ``first_token`` setting).
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from labkit.experiments.client import (
    Launch,
    StreamResult,
    async_client,
    launch_in_turn,
    launch_streams,
    percentiles,
    run_sync,
    timed_stream,
)
from labkit.experiments.profiles import Profile
from labkit.experiments.progress import Progress, doing, tick
from labkit.experiments.servers import serving
from labkit.prompts import PROMPTS

NAME = "overlap"


@dataclass(frozen=True)
class Config:
    model: str = "smollm2-135m"
    levels: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    repetitions: int = 3
    max_new_tokens: int = 64
    backgrounds: tuple[int, ...] = (0, 8, 24)  # long streams running while joiners arrive
    joiners: int = 12
    joiner_tokens: int = 8
    long_tokens: int = 96
    joiner_window: tuple[float, float] = (0.5, 2.0)  # seconds after every long stream has begun
    delivery_streams: int = 32
    step_context: int = 64
    step_steps: int = 15
    seed: int = 27

    @classmethod
    def for_profile(cls, profile: Profile) -> Config:
        if profile.full:
            return cls(model=profile.model)
        return cls(
            model=profile.model,
            levels=(1, 2, 4, 8),
            repetitions=2,
            max_new_tokens=24,
            backgrounds=(0, 4, 8),
            joiners=6,
            joiner_tokens=4,
            long_tokens=160,
            joiner_window=(0.05, 0.3),
            delivery_streams=8,
            step_steps=8,
        )

    def __post_init__(self) -> None:
        if not self.levels or min(self.levels) < 1 or max(self.levels) > len(PROMPTS):
            raise ValueError(f"overlap.Config.levels must lie in [1, {len(PROMPTS)}], got {self.levels!r}")
        if not 0 <= self.joiner_window[0] <= self.joiner_window[1]:
            raise ValueError(f"overlap.Config.joiner_window must be (low, high), got {self.joiner_window!r}")


def server_options(config: Config) -> dict[str, Any]:
    batch = max(*config.levels, max(config.backgrounds) + config.joiners, config.delivery_streams)
    return {"model": config.model, "max_batch": batch}


def units(config: Config) -> int:
    return 1 + len(config.levels) * config.repetitions + 1 + len(config.backgrounds) + 2 * config.repetitions


def _body(prompt: str, tokens: int) -> dict[str, Any]:
    return {"prompt": prompt, "max_new_tokens": tokens}


def run(config: Config, *, server: Any = None, progress: Progress | None = None) -> dict[str, pd.DataFrame]:
    with serving(server, **server_options(config)) as srv:
        solo, levels = measure_levels(srv.url, config, progress)
        doing(progress, "decode-step cost by batch size")
        step_cost = measure_step_cost(srv.engine.model, config)
        tick(progress)
        joiners = measure_joiners(srv.url, config, progress)
        delivery = measure_delivery(srv, config, progress)
    return {
        "solo": solo,
        "levels": levels,
        "step_cost": step_cost,
        "step_fit": fit_step_cost(step_cost),
        "joiners": joiners,
        "delivery": delivery,
    }


# --------------------------------------------------------------------------- levels


def measure_levels(url: str, config: Config, progress: Progress | None) -> tuple[pd.DataFrame, pd.DataFrame]:
    bodies = [_body(p, config.max_new_tokens) for p in PROMPTS[: max(config.levels)]]
    doing(progress, f"solo reference runs of {len(bodies)} prompts")
    solo = run_sync(launch_in_turn(url, bodies))
    tick(progress)
    rows = []
    for level in config.levels:
        back_to_back = sum(r.duration or 0.0 for r in solo.results[:level])
        for rep in range(config.repetitions):
            doing(progress, f"{level} streams at once, repetition {rep + 1}/{config.repetitions}")
            rows.append(
                {
                    "level": level,
                    "repetition": rep,
                    **launch_row(run_sync(launch_streams(url, bodies[:level]))),
                    "back_to_back_s": back_to_back,
                }
            )
            tick(progress, levels=rows)
    levels = pd.DataFrame(rows)
    levels["speedup"] = levels.back_to_back_s / levels.makespan_s
    return _solo_table(solo), levels


def launch_row(launch: Launch) -> dict[str, Any]:
    """One launch as a table row: makespan, throughput, TTFT and gap percentiles, errors."""
    ttft = percentiles((r.ttft for r in launch.results), (50, 99))
    gaps = percentiles((g for r in launch.results for g in r.gaps), (50, 99))
    return {
        "makespan_s": launch.makespan,
        "tokens": launch.tokens,
        "tokens_per_s": launch.tokens_per_s,
        "ttft_p50_s": ttft["p50"],
        "ttft_p99_s": ttft["p99"],
        "gap_p50_s": gaps["p50"],
        "gap_p99_s": gaps["p99"],
        "errors": sum(1 for r in launch.results if r.error),
    }


def _solo_table(solo: Launch) -> pd.DataFrame:
    return pd.DataFrame(
        [
            {
                "prompt": i,
                "tokens": len(r.tokens),
                "ttft_s": r.ttft,
                "duration_s": r.duration,
                "gap_p50_s": percentiles(r.gaps, (50,))["p50"],
            }
            for i, r in enumerate(solo.results)
        ]
    )


# --------------------------------------------------------------------------- step cost


def measure_step_cost(loaded: Any, config: Config) -> pd.DataFrame:
    """The decode-step table of :func:`labkit.bench.bench_step` for the served model."""
    from labkit.bench import StepBench, bench_step

    bench = StepBench(
        model=config.model, batches=tuple(config.levels), context=config.step_context, steps=config.step_steps
    )
    return bench_step(bench, loaded=loaded)


def fit_step_cost(step_cost: pd.DataFrame) -> pd.DataFrame:
    """A least-squares line through the engine's step time: fixed cost plus cost per sequence."""
    slope, intercept = np.polyfit(step_cost.batch, step_cost.engine_step_ms, 1)
    largest = step_cost.batch.max()
    ratio = float(
        step_cost.loc[step_cost.batch == largest, "engine_step_ms"].iloc[0]
        / step_cost.loc[step_cost.batch == step_cost.batch.min(), "engine_step_ms"].iloc[0]
    )
    return pd.DataFrame(
        [
            {
                "intercept_ms": intercept,
                "ms_per_sequence": slope,
                "largest_batch": int(largest),
                "largest_over_smallest": ratio,
            }
        ]
    )


# --------------------------------------------------------------------------- late joiners


def measure_joiners(url: str, config: Config, progress: Progress | None) -> pd.DataFrame:
    rng = random.Random(config.seed)
    rows = []
    for background in config.backgrounds:
        offsets = sorted(rng.uniform(*config.joiner_window) for _ in range(config.joiners))
        doing(progress, f"{config.joiners} late joiners beside {background} running streams")
        rows += run_sync(_joiner_round(url, config, background, offsets))
        tick(progress, joiners=rows)
    return pd.DataFrame(rows)


async def _joiner_round(url: str, config: Config, background: int, offsets: list[float]) -> list[dict[str, Any]]:
    async with async_client(url, connections=background + len(offsets)) as client:
        long = [StreamResult(sent=0.0) for _ in range(background)]
        tasks = [
            asyncio.ensure_future(timed_stream(client, _body(PROMPTS[i], config.long_tokens), result=r))
            for i, r in enumerate(long)
        ]
        try:
            await _wait_until(lambda: all(r.tokens or r.ended for r in long), timeout=300.0)
            t0 = time.perf_counter()

            async def join(j: int, offset: float) -> StreamResult:
                await asyncio.sleep(max(0.0, t0 + offset - time.perf_counter()))
                return await timed_stream(client, _body(PROMPTS[-1 - j], config.joiner_tokens))

            joined = await asyncio.gather(*(join(j, o) for j, o in enumerate(offsets)))
        finally:
            await asyncio.gather(*tasks)  # every long stream ends by itself (bounded by its timeout)
    return [_joiner_row(background, j, offsets[j], r, long, joined) for j, r in enumerate(joined)]


def _joiner_row(
    background: int, j: int, offset: float, r: StreamResult, long: list[StreamResult], joined: list[StreamResult]
) -> dict:
    """One joiner, with how many long streams and other joiners were still running when it was sent:
    where steps are slow, joiners live long enough to overlap each other even on an idle engine."""
    first = r.tokens[0].time if r.tokens else r.sent
    return {
        "background": background,
        "joiner": j,
        "offset_s": offset,
        "ttft_s": r.ttft,
        "background_running_at_send": sum(1 for b in long if (b.ended or 0) > r.sent),
        "background_running_at_first_token": sum(1 for b in long if (b.ended or 0) > first),
        "joiners_running_at_send": sum(1 for o in joined if o is not r and o.sent < r.sent < (o.ended or 0)),
        "error": r.error,
    }


async def _wait_until(condition: Any, timeout: float, poll: float = 0.005) -> None:
    deadline = time.perf_counter() + timeout
    while not condition():
        if time.perf_counter() > deadline:
            raise TimeoutError(f"condition not met within {timeout} s")
        await asyncio.sleep(poll)


# --------------------------------------------------------------------------- first-token delivery


def measure_delivery(srv: Any, config: Config, progress: Progress | None) -> pd.DataFrame:
    """N streams at once under each delivery mode; the model is shared, the servers are not."""
    bodies = [_body(p, config.joiner_tokens) for p in PROMPTS[: config.delivery_streams]]
    rows = []
    for mode in ("prefill", "step_end"):
        given = srv if srv.config.hub.first_token == mode else None
        options = {**server_options(config), "model": srv.engine.model, "first_token": mode}
        with serving(given, **options) as server:
            for rep in range(config.repetitions):
                doing(progress, f"first token at {mode}, repetition {rep + 1}/{config.repetitions}")
                launch = run_sync(launch_streams(server.url, bodies))
                rows += [
                    {"mode": mode, "repetition": rep, "stream": i, "ttft_s": r.ttft, "error": r.error}
                    for i, r in enumerate(launch.results)
                ]
                tick(progress, delivery=rows)
    return pd.DataFrame(rows)


# --------------------------------------------------------------------------- summaries and plots


def joiners_table(joiners: pd.DataFrame) -> pd.DataFrame:
    """Per background load: the joiners' time to first token, median and p99."""
    return (
        joiners.groupby("background")
        .ttft_s.agg(joiners="count", ttft_p50_s="median", ttft_p99_s=lambda s: s.quantile(0.99))
        .reset_index()
    )


def delivery_table(delivery: pd.DataFrame) -> pd.DataFrame:
    return (
        delivery.groupby("mode")
        .ttft_s.agg(
            streams="count",
            ttft_min_s="min",
            ttft_p50_s="median",
            ttft_p99_s=lambda s: s.quantile(0.99),
            ttft_max_s="max",
        )
        .reset_index()
    )


def summary(tables: dict[str, pd.DataFrame]) -> dict[str, Any]:
    levels, fit = tables["levels"], tables["step_fit"].iloc[0]
    top = levels[levels.level == levels.level.max()]
    one = levels[levels.level == levels.level.min()]
    return {
        "largest_level": int(top.level.iloc[0]),
        "makespan_s": [float(top.makespan_s.min()), float(top.makespan_s.max())],
        "back_to_back_s": float(top.back_to_back_s.iloc[0]),
        "tokens_per_s_largest": [float(top.tokens_per_s.min()), float(top.tokens_per_s.max())],
        "tokens_per_s_one": [float(one.tokens_per_s.min()), float(one.tokens_per_s.max())],
        "step_intercept_ms": float(fit.intercept_ms),
        "step_ms_per_sequence": float(fit.ms_per_sequence),
        "joiners_ttft_p50_s": joiners_table(tables["joiners"]).set_index("background").ttft_p50_s.to_dict(),
        "delivery_ttft_p50_s": delivery_table(tables["delivery"]).set_index("mode").ttft_p50_s.to_dict(),
    }


def report(tables: dict[str, pd.DataFrame]) -> str:
    """Stable lines for a checked cell: what must hold whatever the timings (greedy decoding makes
    each level's token count the same in every repetition; no stream may fail)."""
    levels = tables["levels"]
    failed = int(levels.errors.sum())
    varying = [int(level) for level, g in levels.groupby("level") if g.tokens.nunique() > 1]
    missing = int(tables["joiners"].ttft_s.isna().sum() + tables["delivery"].ttft_s.isna().sum())
    return "\n".join(
        [
            "streams at every level ended without error: " + ("yes" if failed == 0 else f"NOT: {failed} errors"),
            "each level produced the same tokens in every repetition: "
            + ("yes" if not varying else f"NOT at levels {varying}"),
            "every late joiner and every delivery stream got a first token: "
            + ("yes" if missing == 0 else f"NOT: {missing} did not"),
        ]
    )


def plot(tables: dict[str, pd.DataFrame]) -> list:
    return [
        _plot_throughput(tables["levels"]),
        _plot_latency(tables["levels"]),
        _plot_step_cost(tables["step_cost"], tables["step_fit"]),
        _plot_joiners(tables["joiners"]),
        _plot_delivery(tables["delivery"]),
    ]


def _plot_throughput(levels: pd.DataFrame):
    from labkit.plots import new_figure

    fig, (left, right) = new_figure("overlap_throughput", ncols=2)
    mean = levels.groupby("level").mean(numeric_only=True).reset_index()
    left.plot(mean.level, mean.tokens_per_s, "o-", label="all at once")
    left.scatter(levels.level, levels.tokens_per_s, s=10, color="tab:blue", alpha=0.5)
    left.set(xlabel="concurrent streams", ylabel="tokens/s (all streams)", title="Aggregate throughput")
    right.plot(mean.level, mean.makespan_s, "o-", label="all at once (makespan)")
    right.plot(mean.level, mean.back_to_back_s, "s--", label="one after another (sum of solo runs)")
    right.set(xlabel="concurrent streams", ylabel="seconds", title="Time to serve them all")
    right.legend()
    for ax in (left, right):
        _level_axis(ax, mean.level)
    return fig


def _level_axis(ax: Any, levels: Any) -> None:
    """Concurrency levels double, so a base-2 log axis with the levels themselves as ticks."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(levels), labels=[str(int(v)) for v in levels])
    ax.minorticks_off()


def _plot_latency(levels: pd.DataFrame):
    from labkit.plots import new_figure

    fig, (left, right) = new_figure("overlap_latency", ncols=2)
    mean = levels.groupby("level").mean(numeric_only=True).reset_index()
    for ax, what, title in ((left, "ttft", "Time to first token"), (right, "gap", "Gap between tokens")):
        ax.plot(mean.level, 1000 * mean[f"{what}_p50_s"], "o-", label="median")
        ax.plot(mean.level, 1000 * mean[f"{what}_p99_s"], "s--", label="p99")
        ax.set(xlabel="concurrent streams", ylabel="ms, as the client sees it", title=title)
        _level_axis(ax, mean.level)
        ax.legend()
    return fig


def _plot_step_cost(step_cost: pd.DataFrame, fit: pd.DataFrame):
    from labkit.plots import new_figure

    fig, (ax,) = new_figure("overlap_step_cost")
    line = fit.iloc[0]
    xs = np.linspace(0, step_cost.batch.max(), 50)
    ax.plot(step_cost.batch, step_cost.engine_step_ms, "o", label="engine decode step (median)")
    ax.plot(step_cost.batch, step_cost.bare_forward_ms, "x", color="gray", label="bare transformers forward")
    ax.plot(
        xs,
        line.intercept_ms + line.ms_per_sequence * xs,
        "--",
        label=f"fit: {line.intercept_ms:.2f} ms + {line.ms_per_sequence:.3f} ms per sequence",
    )
    ax.set(xlabel="sequences in the batch", ylabel="ms per step", title="Decode-step cost against batch size")
    ax.legend()
    return fig


def _plot_joiners(joiners: pd.DataFrame):
    from labkit.plots import new_figure

    fig, (ax,) = new_figure("overlap_joiners")
    groups = sorted(joiners.background.unique())
    ax.boxplot(
        [1000 * joiners.loc[joiners.background == g, "ttft_s"].dropna() for g in groups],
        tick_labels=[f"{g} running" if g else "idle" for g in groups],
    )
    ax.set(
        xlabel="long streams running when the short requests arrive",
        ylabel="ms to first token",
        title="Late joiners: time to first token",
    )
    return fig


def _plot_delivery(delivery: pd.DataFrame):
    from labkit.plots import first_token_cdf

    return first_token_cdf(delivery, "overlap_first_token", "First-token delivery: own prefill vs step end")
