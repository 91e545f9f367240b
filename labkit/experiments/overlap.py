"""Experiment 3, ``overlap``: what a batched engine gives 1 to 32 simultaneous streams.

Every reading follows the lab's rules (:mod:`labkit.experiments.readings`): conditions are
repeated in the order A B C, A B C, …, a comparison is made only within one run, and effects are
counted in engine steps (read over HTTP from ``GET /lab/steps``) beside seconds.

* levels: the first N prompts sent at once, each on its own connection, ``ignore_eos`` so every
  stream makes exactly ``max_new_tokens``; makespan, aggregate tokens/s, time to first token, gap
  between tokens, and the steps the level took. The back-to-back baseline is N times the median
  makespan of the same sweep's level-1 runs (serving them one after another), so level 1's
  speedup is 1 within its own spread by construction and every other level is read against it;
* step cost: the engine's decode step (no prefill in it) against batch size, in both modes
  (batch-invariant and plain), every (batch, mode) point timed in rounds interleaved with the
  others on engines that stay alive, with a line fitted per mode;
* late joiners: short requests into a genuinely idle engine (each sent after the previous one
  ended, so none overlaps another) and at random moments while long ``ignore_eos`` streams run;
  a joiner should wait for the step in progress and its own prefill, and no more: counted in
  steps from its send to its first token;
* first-token delivery: N streams at once with each first token delivered as its own prefill
  ends, against delivery at the end of the step (the hub's ``first_token`` setting), the two
  servers up side by side and their repetitions interleaved.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import statistics
import time
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np
import pandas as pd

from labkit.experiments.client import (
    Launch,
    StreamResult,
    async_client,
    launch_streams,
    percentiles,
    run_sync,
    timed_stream,
)
from labkit.experiments.profiles import Profile
from labkit.experiments.progress import Progress, doing, tick
from labkit.experiments.readings import Verdict, current_step, fetch_steps, interleaved, span, spread
from labkit.experiments.servers import serving
from labkit.experiments.waiting import await_for
from labkit.prompts import PROMPTS

NAME = "overlap"
MODES = ("invariant", "plain")  # the engine's batch_invariant True / False


@dataclass(frozen=True)
class Config:
    model: str = "smollm2-135m"
    levels: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    repetitions: int = 3  # of every condition, interleaved
    max_new_tokens: int = 64
    backgrounds: tuple[int, ...] = (0, 8, 24)  # long streams running while joiners arrive (0: idle)
    joiners: int = 6  # per condition and repetition
    joiner_tokens: int = 8
    long_tokens: int = 48  # the background streams' length (ignore_eos: exactly this many)
    joiner_window: tuple[float, float] = (0.3, 1.5)  # seconds after every long stream has begun
    idle_pause: tuple[float, float] = (0.05, 0.3)  # idle joiners: pause after the previous one ended
    joiner_steps: int = 2  # hypothesis: a joiner's first token is sampled within this many steps of its submit
    delivery_streams: int = 32
    step_batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    step_context: int = 64
    step_steps: int = 20  # timed decode steps per point and round
    step_rounds: int = 3  # rounds over every (batch, mode), interleaved
    step_warmup: int = 2
    seed: int = 27

    @classmethod
    def for_profile(cls, profile: Profile) -> Config:
        if profile.full:
            return cls(model=profile.model)
        return cls(
            model=profile.model,
            levels=(1, 2, 8, 32),
            max_new_tokens=16,
            backgrounds=(0, 4, 8),
            joiners=4,
            joiner_tokens=4,
            long_tokens=200,
            joiner_window=(0.02, 0.15),
            idle_pause=(0.01, 0.05),
            delivery_streams=8,
            step_batches=(1, 2, 4, 8),
            step_steps=10,
        )

    def __post_init__(self) -> None:
        if not self.levels or min(self.levels) < 1 or max(self.levels) > len(PROMPTS):
            raise ValueError(f"overlap.Config.levels must lie in [1, {len(PROMPTS)}], got {self.levels!r}")
        if 1 not in self.levels:
            raise ValueError(f"overlap.Config.levels must include 1 (the same-run baseline), got {self.levels!r}")
        if self.repetitions < 1 or self.step_rounds < 1 or self.step_steps < 1:
            raise ValueError("overlap.Config: repetitions, step_rounds and step_steps must be >= 1")
        for name in ("joiner_window", "idle_pause"):
            low, high = getattr(self, name)
            if not 0 <= low <= high:
                raise ValueError(f"overlap.Config.{name} must be (low, high), got {(low, high)!r}")


def server_options(config: Config) -> dict[str, Any]:
    batch = max(*config.levels, max(config.backgrounds) + config.joiners, config.delivery_streams)
    return {"model": config.model, "max_batch": batch}


def units(config: Config) -> int:
    reps = config.repetitions
    return len(config.levels) * reps + 1 + len(config.backgrounds) * reps + 2 * reps


@dataclass(frozen=True)
class StepCosts:
    """What the engine's steps cost on a machine, to size a profile before running it: ms per
    decode step at some batch sizes (linear in between), ms per prompt prefilled (prompts are
    prefilled one after another), seconds to load the model, and a factor for the client and HTTP
    work that shares the cores with the engine."""

    decode_ms: tuple[tuple[int, float], ...]
    prefill_ms: float
    load_s: float
    overhead: float = 1.15

    def decode(self, batch: int) -> float:
        sizes, ms = zip(*self.decode_ms)
        return float(np.interp(batch, sizes, ms)) / 1e3


FULL_MACHINE = StepCosts(((1, 50.0), (4, 75.0), (8, 85.0), (16, 90.0), (32, 140.0)), prefill_ms=140.0, load_s=25.0)
"""SmolLM2-135M, float32, 2 threads on the quiet 2-core machine (a 50-token prompt's prefill; the
lab's prompts are shorter; the slowest model load seen)."""

FULL_BUDGET_S = 8 * 60
"""What the ``full`` profile of notebook 03 may take, model load included."""


def estimate_seconds(config: Config, costs: StepCosts = FULL_MACHINE) -> dict[str, float]:
    """A run's length from its steps: each launch is its prompts' prefills plus one step per
    further token at the batch it runs; the plain mode is taken to cost what the invariant one
    does (it costs less), so the step-cost figure is an upper bound."""
    prefill, d, reps = costs.prefill_ms / 1e3, costs.decode, config.repetitions
    levels = reps * sum(n * prefill + (config.max_new_tokens - 1) * d(n) for n in config.levels)
    points = config.step_rounds * (config.step_warmup + config.step_steps)
    step = sum(2 * b * prefill * config.step_context / 50 + 2 * points * d(b) for b in config.step_batches)
    idle = config.joiners * (prefill + (config.joiner_tokens - 1) * d(1) + sum(config.idle_pause) / 2)
    busy = sum(b * prefill + (config.long_tokens - 1) * d(b + config.joiners) for b in config.backgrounds if b)
    joiners = reps * ((idle if 0 in config.backgrounds else 0.0) + busy)
    n = config.delivery_streams
    delivery = 2 * reps * (n * prefill + (config.joiner_tokens - 1) * d(n))
    parts = {"levels": levels, "step_cost": step, "joiners": joiners, "delivery": delivery}
    out = {k: costs.overhead * v for k, v in parts.items()}
    out["model_load"] = costs.load_s
    out["total"] = sum(out.values())
    return out


def _body(prompt: str, tokens: int, ignore_eos: bool = True) -> dict[str, Any]:
    return {"prompt": prompt, "max_new_tokens": tokens, "ignore_eos": ignore_eos}


def run(config: Config, *, server: Any = None, progress: Progress | None = None) -> dict[str, pd.DataFrame]:
    with serving(server, **server_options(config)) as srv:
        levels, streams, level_steps = measure_levels(srv.url, config, progress)
        step_rounds = measure_step_cost(srv.engine.model, config, progress)
        joiners, joiner_steps = measure_joiners(srv.url, config, progress)
        delivery_steps: list[pd.DataFrame] = []
        delivery = measure_delivery(srv, config, progress, step_log=delivery_steps)
    step_cost = step_cost_table(step_rounds)
    return {
        "levels": levels,
        "streams": streams,
        "solo": solo_table(streams),
        "step_rounds": step_rounds,
        "step_cost": step_cost,
        "step_fit": fit_step_cost(step_cost),
        "joiners": joiners,
        "delivery": delivery,
        "steps": pd.concat([level_steps, joiner_steps, *delivery_steps], ignore_index=True),
    }


# --------------------------------------------------------------------------- the step clock


def steps_between(steps: pd.DataFrame, start: float | None, end: float | None) -> int | None:
    """Steps that began after ``start`` and no later than ``end`` (perf_counter seconds on the
    server's clock). For a request the hub took at ``start`` whose first token the engine sampled
    at ``end``, 1 means the very next step admitted it and prefilled it: it waited for the step in
    progress and its own prefill, no more. None when either moment is unknown."""
    if start is None or end is None or pd.isna(start) or pd.isna(end):
        return None
    if steps.empty:
        return 0
    return int(((steps.started > start) & (steps.started <= end)).sum())


def first_token_steps(url: str, results: list[StreamResult], steps: pd.DataFrame) -> list[int | None]:
    """Per stream, the steps from the hub taking the request to the engine sampling its first
    token, read from the server's own records over HTTP (``GET /lab/streams``): the client's
    clock would add the delivery across threads and the socket, which on a fast model spans
    further steps."""
    r = httpx.get(f"{url.rstrip('/')}/lab/streams", timeout=10.0, trust_env=False)
    r.raise_for_status()
    records = {rec["rid"]: rec for rec in r.json()["streams"]}
    out = []
    for result in results:
        rec = records.get(result.request_id or "")
        out.append(None if rec is None else steps_between(steps, rec["submitted"], rec["first_token_sampled"]))
    return out


def step_row(steps: pd.DataFrame, tokens: int) -> dict[str, Any]:
    """What a launch cost in steps: how many, how many decoded without prefilling, tokens per step
    and the median decode-only step."""
    decode = steps[(steps.prefilled == 0) & (steps.decoded > 0)] if not steps.empty else steps
    n = len(steps)
    return {
        "steps": n,
        "decode_steps": len(decode),
        "tokens_per_step": tokens / n if n else float("nan"),
        "decode_step_p50_ms": float(decode.seconds.median() * 1e3) if len(decode) else float("nan"),
    }


# --------------------------------------------------------------------------- levels


def measure_levels(
    url: str, config: Config, progress: Progress | None
) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """Every level ``repetitions`` times, interleaved (1 2 4 …, 1 2 4 …): one row per launch, one
    row per stream, and the engine's steps of each launch."""
    bodies = [_body(p, config.max_new_tokens) for p in PROMPTS[: max(config.levels)]]
    rows, streams, steps = [], [], []
    for rep, level in interleaved(config.levels, config.repetitions):
        doing(progress, f"{level} streams at once, repetition {rep + 1}/{config.repetitions}")
        since = current_step(url)
        launch = run_sync(launch_streams(url, bodies[:level]))
        taken = fetch_steps(url, since)
        in_steps = first_token_steps(url, launch.results, taken)
        rows.append({"level": level, "repetition": rep, **launch_row(launch), **step_row(taken, launch.tokens)})
        streams += [
            {
                "level": level,
                "repetition": rep,
                "stream": i,
                "tokens": len(r.tokens),
                "ttft_s": r.ttft,
                "duration_s": (r.ended or r.sent) - r.sent,
                "gap_p50_s": percentiles(r.gaps, (50,))["p50"],
                "ttft_steps": in_steps[i],
            }
            for i, r in enumerate(launch.results)
        ]
        steps.append(taken.assign(phase="levels", condition=f"{level} streams", repetition=rep))
        tick(progress, levels=rows)
    return add_speedup(pd.DataFrame(rows)), pd.DataFrame(streams), pd.concat(steps, ignore_index=True)


def add_speedup(levels: pd.DataFrame) -> pd.DataFrame:
    """``back_to_back_s``: the level times the median makespan of this sweep's own level-1 runs
    (what serving the streams one after another would take); ``speedup``: that over the makespan.
    Level 1's speedups then scatter around 1 as its runs do: the noise every other level is read
    against. ``tokens_per_s_over_one``: the aggregate over the median of level 1."""
    one = levels[levels.level == 1]
    if one.empty:
        raise ValueError("the level-1 runs are the baseline: the sweep must include level 1")
    out = levels.copy()
    out["back_to_back_s"] = out.level * float(one.makespan_s.median())
    out["speedup"] = out.back_to_back_s / out.makespan_s
    out["tokens_per_s_over_one"] = out.tokens_per_s / float(one.tokens_per_s.median())
    return out


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


def solo_table(streams: pd.DataFrame) -> pd.DataFrame:
    """The level-1 streams of the sweep (one per repetition): what one stream alone gets, measured
    in the same run as the others. There is no separate solo sweep."""
    one = streams[streams.level == 1]
    return one[["repetition", "tokens", "ttft_s", "duration_s", "gap_p50_s", "ttft_steps"]].reset_index(drop=True)


def levels_table(levels: pd.DataFrame) -> pd.DataFrame:
    """Per level: median and min–max over the repetitions of what a reader compares."""
    return spread(
        levels,
        "level",
        ["makespan_s", "speedup", "tokens_per_s", "ttft_p50_s", "gap_p50_s", "gap_p99_s", "steps", "tokens_per_step"],
    )


# --------------------------------------------------------------------------- step cost


def measure_step_cost(loaded: Any, config: Config, progress: Progress | None) -> pd.DataFrame:
    """The decode step (no prefill in it) for every batch size in both modes: one engine per
    (batch, mode), all prefilled first and kept alive, then ``step_rounds`` rounds in which every
    point is timed for ``step_steps`` steps in turn. One row per point and round: the median step.

    The context grows by the steps taken (``context_from``/``context_to``), equally for every
    point of a round."""
    from labkit.bench import _context_ids
    from labkit.engine.config import EngineConfig
    from labkit.engine.engine import BatchEngine

    doing(progress, "decode-step cost by batch size, both modes")
    per_point = config.step_rounds * (config.step_warmup + config.step_steps)
    engines = {}
    for batch in config.step_batches:
        prompts = _context_ids(loaded, batch, config.step_context)
        blocks = batch * (-(-(config.step_context + per_point + 2) // 16))
        for mode in MODES:
            engine = BatchEngine(
                loaded, EngineConfig(max_batch=batch, batch_invariant=mode == "invariant", num_blocks=blocks)
            )
            for p in prompts:
                engine.submit(p, max_new_tokens=per_point + 2, ignore_eos=True)
            engine.step()  # admits and prefills every prompt; the steps timed below only decode
            engines[batch, mode] = engine
    rows = []
    points = [(b, m) for b in config.step_batches for m in MODES]
    try:
        for rnd, (batch, mode) in interleaved(points, config.step_rounds):
            engine = engines[batch, mode]
            context = config.step_context + rnd * (config.step_warmup + config.step_steps)
            times = []
            for _ in range(config.step_warmup + config.step_steps):
                t0 = time.perf_counter()
                engine.step()
                times.append(time.perf_counter() - t0)
            timed = times[config.step_warmup :]
            rows.append(
                {
                    "batch": batch,
                    "mode": mode,
                    "round": rnd,
                    "steps": len(timed),
                    "context_from": context,
                    "context_to": context + config.step_warmup + config.step_steps,
                    "step_ms": 1e3 * statistics.median(timed),
                    "step_min_ms": 1e3 * min(timed),
                    "step_max_ms": 1e3 * max(timed),
                }
            )
    finally:
        engines.clear()
    tick(progress, step_rounds=rows)
    return pd.DataFrame(rows)


def step_cost_table(step_rounds: pd.DataFrame) -> pd.DataFrame:
    """Per batch size and mode: the median step over the rounds with its min–max, and whether the
    point is above the next smaller batch's within noise (ranges overlap) or clearly."""
    table = spread(step_rounds, ["mode", "batch"], "step_ms")
    table["steps_timed"] = step_rounds.groupby(["mode", "batch"]).steps.sum().to_numpy()
    table["vs_smaller_batch"] = ""
    for _mode, group in table.groupby("mode"):
        previous = None
        for i, row in group.iterrows():
            if previous is not None:
                if row.step_ms_min > previous.step_ms_max:
                    table.loc[i, "vs_smaller_batch"] = "higher"
                elif row.step_ms_max < previous.step_ms_min:
                    table.loc[i, "vs_smaller_batch"] = "LOWER"
                else:
                    table.loc[i, "vs_smaller_batch"] = "within noise"
            previous = row
    order = {m: i for i, m in enumerate(MODES)}
    return table.sort_values(["mode", "batch"], key=lambda s: s.map(order) if s.name == "mode" else s).reset_index(
        drop=True
    )


def fit_step_cost(step_cost: pd.DataFrame) -> pd.DataFrame:
    """Per mode, a least-squares line through the median step time: fixed cost plus cost per
    sequence; and the step at the largest batch over the step at the smallest. The
    batch-invariant (the engine's default) row comes first."""
    rows = []
    for mode in MODES:
        g = step_cost[step_cost["mode"] == mode].sort_values("batch")
        if g.empty:
            continue
        slope, intercept = np.polyfit(g.batch, g.step_ms_median, 1) if len(g) > 1 else (0.0, g.step_ms_median.iloc[0])
        rows.append(
            {
                "mode": mode,
                "intercept_ms": float(intercept),
                "ms_per_sequence": float(slope),
                "largest_batch": int(g.batch.iloc[-1]),
                "largest_over_smallest": float(g.step_ms_median.iloc[-1] / g.step_ms_median.iloc[0]),
            }
        )
    return pd.DataFrame(rows)


def step_at(step_cost: pd.DataFrame, mode: str, batch: int) -> float:
    """The median step of one point, NaN when it was not measured."""
    hit = step_cost[(step_cost["mode"] == mode) & (step_cost.batch == batch)]
    return float(hit.step_ms_median.iloc[0]) if len(hit) else float("nan")


# --------------------------------------------------------------------------- late joiners


def measure_joiners(url: str, config: Config, progress: Progress | None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Every background load ``repetitions`` times, interleaved; each joiner's first token counted
    in the steps that began between its send and its arrival."""
    rng = random.Random(config.seed)
    rows, steps = [], []
    for rep, background in interleaved(config.backgrounds, config.repetitions):
        what = "an idle engine" if background == 0 else f"{background} running streams"
        doing(progress, f"{config.joiners} joiners into {what}, repetition {rep + 1}/{config.repetitions}")
        since = current_step(url)
        if background == 0:
            pauses = [rng.uniform(*config.idle_pause) for _ in range(config.joiners)]
            round_rows = run_sync(_idle_round(url, config, pauses))
        else:
            offsets = sorted(rng.uniform(*config.joiner_window) for _ in range(config.joiners))
            round_rows = run_sync(_joiner_round(url, config, background, offsets))
        taken = fetch_steps(url, since)
        in_steps = first_token_steps(url, [row.pop("result") for row in round_rows], taken)
        for row, n in zip(round_rows, in_steps):
            row["repetition"], row["ttft_steps"] = rep, n
        rows += round_rows
        steps.append(taken.assign(phase="joiners", condition=f"background {background}", repetition=rep))
        tick(progress, joiners=rows)
    return pd.DataFrame(rows), pd.concat(steps, ignore_index=True)


async def _idle_round(url: str, config: Config, pauses: list[float]) -> list[dict[str, Any]]:
    """Joiners into an idle engine: each sent a short pause after the previous one ended, so none
    overlaps another (``joiners_running_at_send`` is 0 by construction, and the table shows it)."""
    joined: list[StreamResult] = []
    async with async_client(url, connections=1) as client:
        t0 = time.perf_counter()
        for j, pause in enumerate(pauses):
            await asyncio.sleep(pause)
            joined.append(await timed_stream(client, _body(PROMPTS[-1 - j], config.joiner_tokens)))
    return [joiner_row(0, j, r.sent - t0, r, [], joined) for j, r in enumerate(joined)]


async def _joiner_round(url: str, config: Config, background: int, offsets: list[float]) -> list[dict[str, Any]]:
    async with async_client(url, connections=background + len(offsets)) as client:
        long = [StreamResult(sent=0.0) for _ in range(background)]
        tasks = [
            asyncio.ensure_future(timed_stream(client, _body(PROMPTS[i], config.long_tokens), result=r))
            for i, r in enumerate(long)
        ]
        try:
            await await_for(
                lambda: all(r.tokens or r.ended for r in long),
                timeout=300.0,
                what="every long stream's first token",
                interval=0.005,
            )
            t0 = time.perf_counter()

            async def join(j: int, offset: float) -> StreamResult:
                await asyncio.sleep(max(0.0, t0 + offset - time.perf_counter()))
                return await timed_stream(client, _body(PROMPTS[-1 - j], config.joiner_tokens))

            joined = await asyncio.gather(*(join(j, o) for j, o in enumerate(offsets)))
        finally:
            await asyncio.gather(*tasks)  # every long stream ends by itself (bounded by its timeout)
    return [joiner_row(background, j, r.sent - t0, r, long, joined) for j, r in enumerate(joined)]


def joiner_row(
    background: int, j: int, offset: float, r: StreamResult, long: list[StreamResult], joined: list[StreamResult]
) -> dict[str, Any]:
    """One joiner, with how many long streams and other joiners were running when it was sent
    (measured, not the condition's name: the labels of the plots come from these counts)."""
    first = r.tokens[0].time if r.tokens else None
    return {
        "background": background,
        "joiner": j,
        "offset_s": offset,
        "ttft_s": r.ttft,
        "sent_at": r.sent,
        "first_token_at": first,
        "background_running_at_send": sum(1 for b in long if b.sent < r.sent < (b.ended or float("inf"))),
        "background_running_at_first_token": sum(
            1 for b in long if first is not None and b.sent < first < (b.ended or float("inf"))
        ),
        "joiners_running_at_send": sum(1 for o in joined if o is not r and o.sent < r.sent < (o.ended or float("inf"))),
        "error": r.error,
        "result": r,  # taken off once its steps are counted
    }


def condition_label(joiners: pd.DataFrame, background: int) -> str:
    """A joiner condition named by what was measured: the median count of long streams running
    when its joiners were sent (idle when that is 0 and no joiner overlapped another)."""
    g = joiners[joiners.background == background]
    running = int(g.background_running_at_send.median())
    if running == 0:
        overlaps = int(g.joiners_running_at_send.max())
        return "idle" if overlaps == 0 else f"0 running, {overlaps} joiners overlapping"
    return f"{running} running"


def joiners_table(joiners: pd.DataFrame) -> pd.DataFrame:
    """Per condition: the joiners' time to first token in seconds and in steps (median, min, max
    over every joiner of every repetition), and the measured running counts."""
    table = spread(joiners, "background", ["ttft_s", "ttft_steps"])
    counts = joiners.groupby("background").agg(
        background_running_at_send_min=("background_running_at_send", "min"),
        background_running_at_send_max=("background_running_at_send", "max"),
        background_running_at_first_token_min=("background_running_at_first_token", "min"),
        joiners_running_at_send_max=("joiners_running_at_send", "max"),
    )
    table = table.merge(counts.reset_index(), on="background")
    table.insert(1, "condition", [condition_label(joiners, b) for b in table.background])
    return table


# --------------------------------------------------------------------------- first-token delivery


def measure_delivery(
    srv: Any, config: Config, progress: Progress | None, *, step_log: list[pd.DataFrame] | None = None
) -> pd.DataFrame:
    """N streams at once under each delivery mode, the two servers up side by side (sharing the
    model) and their repetitions interleaved. With ``step_log`` (a list to append to), each
    launch's steps are read from the servers' lab routes and every first token is counted in steps
    too; without, nothing but the streams is asked of the server (07 reuses this)."""
    bodies = [_body(p, config.joiner_tokens) for p in PROMPTS[: config.delivery_streams]]
    rows = []
    with contextlib.ExitStack() as stack:
        servers = {}
        for mode in ("prefill", "step_end"):
            given = srv if srv.config.hub.first_token == mode else None
            options = {**server_options(config), "model": srv.engine.model, "first_token": mode}
            servers[mode] = stack.enter_context(serving(given, **options))
        for rep, mode in interleaved(list(servers), config.repetitions):
            doing(progress, f"first token at {mode}, repetition {rep + 1}/{config.repetitions}")
            url = servers[mode].url
            since = current_step(url) if step_log is not None else 0
            launch = run_sync(launch_streams(url, bodies))
            in_steps: list[int | None] = [None] * len(launch.results)
            if step_log is not None:
                taken = fetch_steps(url, since)
                in_steps = first_token_steps(url, launch.results, taken)
                step_log.append(taken.assign(phase="delivery", condition=mode, repetition=rep))
            rows += [
                {
                    "mode": mode,
                    "repetition": rep,
                    "stream": i,
                    "ttft_s": r.ttft,
                    "ttft_steps": in_steps[i],
                    "error": r.error,
                }
                for i, r in enumerate(launch.results)
            ]
            tick(progress, delivery=rows)
    return pd.DataFrame(rows)


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


# --------------------------------------------------------------------------- verdicts


def _paired_ratio(levels: pd.DataFrame, column: str, level: int) -> pd.Series:
    """``column`` at ``level`` over ``column`` at level 1, repetition by repetition."""
    by_rep = levels.pivot_table(index="repetition", columns="level", values=column)
    return (by_rep[level] / by_rep[1]).dropna()


def verdicts(tables: dict[str, pd.DataFrame], joiner_steps: int = Config.joiner_steps) -> list[Verdict]:
    """The notebook's hypotheses, each judged against its falsification criterion from the data."""
    levels, joiners = tables["levels"], tables["joiners"]
    top = int(levels.level.max())
    throughput = _paired_ratio(levels, "tokens_per_s", top)
    gap = _paired_ratio(levels, "gap_p50_s", top)
    busy = joiners[(joiners.background > 0) & (joiners.background_running_at_send > 0)]  # measured, not named
    idle = joiners[joiners.background == 0]
    busy_steps = busy.ttft_steps.dropna()
    return [
        Verdict(
            "overlap",
            f"{top} streams at once reach at least twice the aggregate tokens/s of one",
            f"the median ratio of aggregate tokens/s, {top} streams over 1 (same repetition), is below 2",
            bool(throughput.median() >= 2),
            f"{span(throughput, '{:.1f}', '×')} over {len(throughput)} repetitions",
        ),
        Verdict(
            "per-stream gap",
            f"each stream's gap between tokens grows much less than the number of streams ({top}×)",
            f"the median gap at {top} streams is at least a quarter of {top}× the gap at 1 (ratio ≥ {top / 4:g})",
            bool(gap.median() < top / 4),
            f"gap ratio {span(gap, '{:.2f}', '×')} against {top}× the streams",
        ),
        Verdict(
            "joiner waits a step",
            "a request that joins a running batch waits for the step in progress and its own prefill, no more",
            f"the median joiner into a running batch has its first token sampled more than {joiner_steps} "
            "steps after the server took it",
            bool(len(busy_steps) > 0 and busy_steps.median() <= joiner_steps),
            f"{span(busy_steps, '{:.0f}', ' steps')} to first token over {len(busy_steps)} joiners; "
            f"{span(busy.ttft_s * 1e3, '{:.0f}', ' ms')} (idle engine: {span(idle.ttft_s * 1e3, '{:.0f}', ' ms')})",
        ),
        Verdict(
            "idle means idle",
            "joiners spaced beyond their own run find the engine idle: none overlaps another or a long stream",
            "any joiner of the idle condition was sent while another request ran",
            bool(
                len(idle) > 0
                and (idle.joiners_running_at_send == 0).all()
                and (idle.background_running_at_send == 0).all()
            ),
            f"{len(idle)} idle joiners, at most {int(idle.joiners_running_at_send.max()) if len(idle) else 0} "
            "running at send",
        ),
    ]


CHECKED = ("overlap", "joiner waits a step", "idle means idle")
"""The verdicts robust under both profiles (tiny random GPT-2 and SmolLM2): the notebook's
checked cell prints these; the rest go in the unchecked table."""


def summary(tables: dict[str, pd.DataFrame]) -> dict[str, Any]:
    levels, fit = tables["levels"], tables["step_fit"].set_index("mode")
    top = levels[levels.level == levels.level.max()]
    one = levels[levels.level == 1]
    return {
        "largest_level": int(top.level.iloc[0]),
        "repetitions": int(levels.repetition.nunique()),
        "makespan_s": [float(top.makespan_s.min()), float(top.makespan_s.max())],
        "back_to_back_s": float(top.back_to_back_s.iloc[0]),
        "speedup": [float(top.speedup.min()), float(top.speedup.max())],
        "speedup_level_one": [float(one.speedup.min()), float(one.speedup.max())],
        "tokens_per_s_largest": [float(top.tokens_per_s.min()), float(top.tokens_per_s.max())],
        "tokens_per_s_one": [float(one.tokens_per_s.min()), float(one.tokens_per_s.max())],
        "steps_largest": [int(top.steps.min()), int(top.steps.max())],
        "step_fit": {
            m: {"intercept_ms": float(r.intercept_ms), "ms_per_sequence": float(r.ms_per_sequence)}
            for m, r in fit.iterrows()
        },
        "joiners_ttft_p50_s": joiners_table(tables["joiners"]).set_index("background").ttft_s_median.to_dict(),
        "delivery_ttft_p50_s": delivery_table(tables["delivery"]).set_index("mode").ttft_p50_s.to_dict(),
        "verdicts": {v.name: v.holds for v in verdicts(tables)},
    }


def report(tables: dict[str, pd.DataFrame]) -> str:
    """Stable lines for a checked cell: what must hold whatever the timings (``ignore_eos`` makes
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


def _alike(cost: pd.DataFrame, mode: str, a: int, b: int) -> str:
    """`` (within noise: the rounds' ranges overlap)`` when two batch sizes' min–max ranges overlap."""
    pa, pb = (cost[(cost["mode"] == mode) & (cost.batch == n)] for n in (a, b))
    if pa.empty or pb.empty:
        return " (not both measured)"
    overlap_ = pa.step_ms_max.iloc[0] >= pb.step_ms_min.iloc[0] and pb.step_ms_max.iloc[0] >= pa.step_ms_min.iloc[0]
    return (
        ", the same within noise (the rounds' ranges overlap)"
        if overlap_
        else ", a difference beyond the rounds' ranges"
    )


def findings(tables: dict[str, pd.DataFrame]) -> dict[str, str]:
    """The sentences the notebook prints about what was found, each rendered from the data."""
    levels, cost, fit = tables["levels"], tables["step_cost"], tables["step_fit"].set_index("mode")
    top = int(levels.level.max())
    one, big = levels[levels.level == 1], levels[levels.level == top]
    inv1, inv8 = step_at(cost, "invariant", 1), step_at(cost, "invariant", 8)
    pl1, pl8 = step_at(cost, "plain", 1), step_at(cost, "plain", 8)
    lower = cost[cost.vs_smaller_batch == "LOWER"]
    joiners = joiners_table(tables["joiners"])
    out = {
        "levels": (
            f"Level 1's speedup over its own median is {span(one.speedup, '{:.2f}', '×')}: that spread is the "
            f"noise every other level is read against. {top} streams at once took {span(big.makespan_s, '{:.1f}', ' s')} "
            f"against {big.back_to_back_s.iloc[0]:.1f} s back to back, a speedup of {span(big.speedup, '{:.1f}', '×')}, in "
            f"{span(big.steps, '{:.0f}')} steps ({span(big.tokens_per_step, '{:.1f}')} tokens per step) where one stream "
            f"took {span(one.steps, '{:.0f}')} steps."
        ),
        "step_cost": (
            f"Batch-invariant mode: B=1 {inv1:.1f} ms, B=8 {inv8:.1f} ms: B=1 costs {inv1 / inv8:.0%} of B=8"
            f"{_alike(cost, 'invariant', 1, 8)}; plain mode: B=1 {pl1:.1f} ms, B=8 {pl8:.1f} ms: "
            f"{pl1 / pl8:.0%}{_alike(cost, 'plain', 1, 8)}. "
            + "".join(
                f"{m}: {r.intercept_ms:.1f} ms fixed + {r.ms_per_sequence:.2f} ms per sequence; "
                for m, r in fit.iterrows()
            )
            + (
                "every point is higher than the smaller batch's or within noise of it."
                if lower.empty
                else "points clearly LOWER than the smaller batch's: "
                + ", ".join(f"{r['mode']} B={int(r.batch)}" for _, r in lower.iterrows())
                + "."
            )
        ),
        "joiners": " ".join(
            f"{r.condition}: first token after {span([r.ttft_s_median * 1e3], '{:.0f}', ' ms')} median "
            f"({r.ttft_s_min * 1e3:.0f}–{r.ttft_s_max * 1e3:.0f} ms), {r.ttft_steps_median:.0f} step(s) "
            f"({r.ttft_steps_min:.0f}–{r.ttft_steps_max:.0f})."
            for _, r in joiners.iterrows()
        ),
    }
    return out


# --------------------------------------------------------------------------- plots


def plot(tables: dict[str, pd.DataFrame]) -> list:
    """Every figure whose tables are there: a run saved before a table existed (the committed data
    until the next ``make lab``) draws the rest."""
    drawers = [
        (("levels",), lambda: _plot_throughput(tables["levels"])),
        (("levels",), lambda: _plot_latency(tables["levels"])),
        (("streams",), lambda: _plot_first_tokens(tables["streams"])),
        (("step_rounds", "step_fit"), lambda: _plot_step_cost(tables["step_rounds"], tables["step_fit"])),
        (("joiners",), lambda: _plot_joiners(tables["joiners"])),
        (("delivery",), lambda: _plot_delivery(tables["delivery"])),
    ]
    has_steps = "ttft_steps" in tables.get("joiners", pd.DataFrame()).columns
    return [
        draw() for needs, draw in drawers if all(t in tables for t in needs) and (needs != ("joiners",) or has_steps)
    ]


def _with_range(ax: Any, x: Any, table: pd.DataFrame, column: str, scale: float = 1.0, **style: Any) -> None:
    """The median as a line with markers, its min–max as error bars."""
    med, lo, hi = (scale * table[f"{column}_{s}"].to_numpy() for s in ("median", "min", "max"))
    ax.errorbar(x, med, yerr=[med - lo, hi - med], capsize=3, **style)


def _plot_throughput(levels: pd.DataFrame):
    from matplotlib.ticker import FuncFormatter

    from labkit.plots import new_figure

    fig, (left, right, third) = new_figure("overlap_throughput", ncols=3)
    s = spread(levels, "level", ["tokens_per_s", "makespan_s", "back_to_back_s", "speedup"])
    _with_range(left, s.level, s, "tokens_per_s", fmt="o-", label="all at once (median, min–max)")
    left.scatter(levels.level, levels.tokens_per_s, s=10, color="tab:blue", alpha=0.5)
    left.set(xlabel="concurrent streams", ylabel="tokens/s (all streams)", title="Aggregate throughput")
    _with_range(right, s.level, s, "makespan_s", fmt="o-", label="all at once (makespan)")
    right.plot(s.level, s.back_to_back_s_median, "s--", label="one after another (level × level-1 makespan)")
    right.set(xlabel="concurrent streams", ylabel="seconds", title="Time to serve them all")
    _with_range(third, s.level, s, "speedup", fmt="o-", label="measured (median, min–max)")
    third.scatter(levels.level, levels.speedup, s=10, color="tab:blue", alpha=0.5)
    third.plot(s.level, s.level, ":", color="gray", label="ideal: level × one")
    third.axhline(1, color="gray", linewidth=0.8)
    third.set(xlabel="concurrent streams", ylabel="× back to back", title="Speedup over the same sweep's level 1")
    third.set_yscale("log", base=2)
    third.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}×"))
    for ax in (left, right, third):
        ax.legend(fontsize="small")
        _level_axis(ax, s.level)
    return fig


def _level_axis(ax: Any, levels: Any) -> None:
    """Concurrency levels double, so a base-2 log axis with the levels themselves as ticks."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(levels), labels=[str(int(v)) for v in levels])
    ax.minorticks_off()


def _plot_latency(levels: pd.DataFrame):
    from labkit.plots import new_figure

    fig, (left, right) = new_figure("overlap_latency", ncols=2)
    s = spread(levels, "level", ["ttft_p50_s", "ttft_p99_s", "gap_p50_s", "gap_p99_s"])
    for ax, what, title in ((left, "ttft", "Time to first token"), (right, "gap", "Gap between tokens")):
        _with_range(ax, s.level, s, f"{what}_p50_s", 1000, fmt="o-", label="median stream")
        _with_range(ax, s.level, s, f"{what}_p99_s", 1000, fmt="s--", label="p99")
        ax.set(xlabel="concurrent streams", ylabel="ms, as the client sees it", title=title)
        _level_axis(ax, s.level)
        ax.legend()
    return fig


def _plot_first_tokens(streams: pd.DataFrame):
    """Every stream's time to first token, sorted: one line per level and repetition."""
    import matplotlib.pyplot as plt

    from labkit.plots import new_figure

    fig, (ax,) = new_figure("overlap_first_token_levels")
    levels = sorted(streams.level.unique())
    colors = plt.get_cmap("viridis")(np.linspace(0, 0.9, len(levels)))
    styles = ["-", "--", ":", "-."]
    for color, level in zip(colors, levels):
        for rep, g in streams[streams.level == level].groupby("repetition"):
            values = np.sort(1000 * g.ttft_s.dropna().to_numpy())
            if not len(values):
                continue
            fraction = np.arange(1, len(values) + 1) / len(values)
            ax.plot(
                values,
                fraction,
                drawstyle="steps-post",
                marker="o",
                markersize=3,
                color=color,
                linestyle=styles[int(rep) % len(styles)],
                label=(f"{level} stream" + ("s" if level > 1 else "")) if rep == 0 else None,
            )
    ax.set(
        xlabel="ms to first token",
        ylabel="fraction of streams",
        title="First token, each level and repetition (line style: repetition)",
    )
    ax.legend(fontsize="small")
    return fig


def _plot_step_cost(step_rounds: pd.DataFrame, fit: pd.DataFrame):
    from labkit.plots import new_figure

    fig, (ax,) = new_figure("overlap_step_cost")
    s = spread(step_rounds, ["mode", "batch"], "step_ms")
    xs = np.linspace(0, s.batch.max(), 50)
    for mode, color in (("invariant", "tab:blue"), ("plain", "tab:orange")):
        g = s[s["mode"] == mode]
        if g.empty:
            continue
        _with_range(ax, g.batch, g, "step_ms", fmt="o", color=color, label=f"{mode}: median step, min–max of rounds")
        r = step_rounds[step_rounds["mode"] == mode]
        ax.scatter(r.batch, r.step_ms, s=8, color=color, alpha=0.4)
        f = fit[fit["mode"] == mode]
        if len(f):
            f = f.iloc[0]
            ax.plot(
                xs,
                f.intercept_ms + f.ms_per_sequence * xs,
                "--",
                color=color,
                label=f"{mode} fit: {f.intercept_ms:.1f} ms + {f.ms_per_sequence:.2f} ms/sequence",
            )
    ax.set(
        xlabel="sequences in the batch",
        ylabel="ms per decode step",
        title="Decode-step cost: batch-invariant and plain, same run",
    )
    ax.set_ylim(bottom=0)
    ax.legend(fontsize="small")
    return fig


def _plot_joiners(joiners: pd.DataFrame):
    """Time to first token of every joiner by when it arrived, one colour per condition."""
    from labkit.plots import new_figure

    fig, (left, right) = new_figure("overlap_joiners", ncols=2)
    for background, g in joiners.groupby("background"):
        label = condition_label(joiners, background)
        left.scatter(g.offset_s, 1000 * g.ttft_s, s=14, label=label)
        right.scatter(g.offset_s, g.ttft_steps, s=14, label=label)
    left.set(
        xlabel="sent at, s after the condition began",
        ylabel="ms to first token",
        title="Joiners: first token by arrival",
    )
    right.set(
        xlabel="sent at, s after the condition began",
        ylabel="steps, request taken to first token",
        title="The same in engine steps",
    )
    left.set_ylim(bottom=0)
    right.set_ylim(bottom=0)
    left.legend(fontsize="small")
    return fig


def _plot_delivery(delivery: pd.DataFrame):
    from labkit.plots import first_token_cdf

    return first_token_cdf(delivery, "overlap_first_token", "First-token delivery: own prefill vs step end")
