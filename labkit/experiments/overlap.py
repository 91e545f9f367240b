"""Notebook 03, overlapping streams: what batching buys, and what one stream pays for it.

* :data:`LEVELS`: the first N prompts at once, each on its own connection, every stream exactly
  ``tokens`` long; makespan, aggregate tokens/s, first token, gaps, and (where the target has a
  step log) the engine steps each level took. The back-to-back baseline is N times the median
  makespan of the same sweep's level-1 runs.
* :data:`~labkit.experiments.step_cost.STEP_COST`: the engine's decode step against batch size,
  in both modes (its own module: an in-process engine measurement).
* :data:`JOINERS`: short requests into an idle engine and into running batches, sent when the
  running streams have made a drawn number of tokens (never at a time in seconds).
* :data:`DELIVERY`: N streams at once with each first token delivered as its own prefill ends or
  at the end of the step (two servers, taking turns).
* :data:`CLIENT_SHARE`: the top level served from a thread of this process and from a process of
  its own, to show what sharing the interpreter with the client costs the absolute numbers.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pandas as pd

from labkit.experiments.crosscheck import GUIDELLM
from labkit.experiments.step_cost import STEP_COST
from labkit.lab import Experiment, Process, Sizes, Stream, Target, Trial, every, interval, judge, side, spread, tell
from labkit.lab.client import percentile, run_sync
from labkit.prompts import PROMPTS, cycle

QUANTILES = ("min", "p10", "p50", "p90", "max")


# --------------------------------------------------------------------------- levels


def measure_level(trial: Trial) -> dict[str, Any]:
    target, s = trial.target, trial.sizes
    since = target.current_step() if target.caps.lab else None
    started = target.launch([target.request(p, s.tokens) for p in cycle(trial.level)])
    row = started.row()
    trial.keep("streams", [{"stream": i, "tokens": st.tokens, "ttft_s": st.ttft, "gap_p50_s": percentile(st.gaps, 50),
                            "duration_s": st.duration} for i, st in enumerate(started.streams)])  # fmt: skip
    if since is not None:
        steps = target.steps(since)
        row.update(steps=len(steps), tokens_per_step=row["tokens"] / max(1, len(steps)))
    return row


def level_tables(tables: dict[str, pd.DataFrame], s: Sizes) -> dict[str, pd.DataFrame]:
    rows = tables["rows"].copy()
    one = rows[rows.level == 1]
    rows["speedup"] = rows.level * float(one.makespan_s.median()) / rows.makespan_s
    columns = ["makespan_s", "speedup", "tokens_per_s", "ttft_p50_s", "ttft_p99_s", "gap_p50_s", "gap_p99_s"]
    columns += [c for c in ("steps", "tokens_per_step") if c in rows]
    return {"rows": rows, "levels": spread(rows, "level", columns)}


def paired(rows: pd.DataFrame, column: str, level: int) -> pd.Series:
    """``column`` at ``level`` over ``column`` at level 1, repetition by repetition."""
    by_rep = rows.pivot(index="repetition", columns="level", values=column)
    return (side(by_rep, level) / side(by_rep, 1)).dropna()


def level_verdicts(tables: dict[str, pd.DataFrame], s: Sizes) -> list:
    rows, top = tables["rows"], max(s.levels)
    throughput, gap = paired(rows, "tokens_per_s", top), paired(rows, "gap_p50_s", top)
    overlap, evidence = tell(interval(throughput.to_numpy()), 2.0, "above")
    varying = [int(n) for n, g in rows.groupby("level") if g.tokens.nunique() > 1]
    out = [
        judge("every stream whole", "every stream of every level ends whole, at the same length each repetition",
              "any stream failed, or a level's token count varied", rows.failed.sum() == 0 and not varying,
              f"{int(rows.failed.sum())} failed; varying levels: {varying or 'none'}", checked=True),
        judge("overlap", f"{top} streams at once reach at least twice the aggregate tokens/s of one",
              f"the 95% interval of the paired ratio ({top} over 1) lies below 2", overlap, f"ratio {evidence}"),
        judge("per-stream gap", f"a stream's median gap grows much less than the streams do ({top}×)",
              f"the median gap ratio ({top} over 1) is at least {top / 4:g} (a quarter of {top}×)",
              None if gap.dropna().empty else bool(gap.median() < top / 4),
              f"gap ratio median {gap.median():.2f} over {len(gap.dropna())} repetitions"),
    ]  # fmt: skip
    if "tokens_per_step" in rows:
        per_step = rows[rows.level == top].tokens_per_step.dropna()
        out.insert(1, judge(
            "overlap in steps", f"a step of the {top}-stream level makes at least {top / 2:g} tokens",
            f"the median tokens per step at {top} streams is below {top / 2:g}",
            None if per_step.empty else bool(per_step.median() >= top / 2),
            f"{per_step.median():.1f} tokens per step (repetitions {per_step.min():.1f}–{per_step.max():.1f})",
            checked=True))  # fmt: skip
    return out


def level_plots(tables: dict[str, pd.DataFrame], s: Sizes) -> list:
    from labkit.plots import new_figure, with_range

    t = tables["levels"]
    fig, (left, mid, right) = new_figure("overlap_levels", ncols=3)
    with_range(left, t.level, t, "tokens_per_s", fmt="o-", label="all at once")
    left.set(xlabel="concurrent streams", ylabel="tokens/s (all streams)", title="Aggregate throughput")
    for ax, what, title in ((mid, "ttft", "Time to first token"), (right, "gap", "Gap between tokens")):
        with_range(ax, t.level, t, f"{what}_p50_s", 1000, fmt="o-", label="median stream")
        with_range(ax, t.level, t, f"{what}_p99_s", 1000, fmt="s--", label="p99")
        ax.set(xlabel="concurrent streams", ylabel="ms", title=title)
    for ax in (left, mid, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(t.level), labels=[str(int(v)) for v in t.level])
        ax.minorticks_off()
        ax.legend(fontsize="small")
    return [fig]


LEVELS = Experiment(
    name="overlap.levels", title="N streams at once: makespan, tokens/s, first token, gaps, steps",
    sizes={"full": {"levels": (1, 2, 4, 8, 16, 32), "tokens": 64, "repetitions": 6},
           "ci": {"levels": (1, 2, 8, 32), "tokens": 16, "repetitions": 3}},
    conditions=lambda s, target: [{"level": n} for n in s.levels], server=lambda s, c: {"max_batch": max(s.levels)},
    measure=measure_level, tables=level_tables, verdicts=level_verdicts, plots=level_plots,
)  # fmt: skip


# --------------------------------------------------------------------------- joiners


def measure_joiners(trial: Trial) -> list[dict[str, Any]]:
    target, s = trial.target, trial.sizes
    if target.caps.lab:
        trial.state[target.url] = target.current_step()
    rng = random.Random(s.seed * 1000 + trial.repetition * 10 + trial.background)
    if trial.background == 0:
        joined = run_sync(_idle(target, s, [rng.uniform(*s.idle_pause_s) for _ in range(s.joiners)]))
        running: list[int] = [0] * len(joined)
    else:
        offsets = sorted(rng.randint(*s.join_after_tokens) for _ in range(s.joiners))
        joined, running = run_sync(_busy(target, s, trial.background, offsets))
    records = target.records([j.request_id for j in joined]) if target.caps.lab else [None] * len(joined)
    steps = target.steps(trial.state.get(target.url, 0)) if target.caps.lab else None
    return [joiner_row(j, n, rec, steps) for j, n, rec in zip(joined, running, records)]


async def _idle(target: Target, s: Sizes, pauses: list[float]) -> list[Stream]:
    joined = []
    for i, pause in enumerate(pauses):
        await asyncio.sleep(pause)
        joined.append(await target.stream(target.request(PROMPTS[-1 - i], s.joiner_tokens)))
    return joined


async def _busy(target: Target, s: Sizes, background: int, offsets: list[int]) -> tuple[list[Stream], list[int]]:
    """Long streams run; joiner j is sent once the first long stream has made ``offsets[j]``
    tokens: the moment is counted in tokens, so it falls at the same point of the runs however
    fast the engine is. Returns the joiners and how many long streams ran when each was sent."""
    long = [Stream(api=target.api) for _ in range(background)]
    tasks = [asyncio.ensure_future(target.stream(target.request(p, s.long_tokens), result=r))
             for p, r in zip(cycle(background), long)]  # fmt: skip
    joiners, running = [], []
    try:
        for i, offset in enumerate(offsets):
            while len(long[0].token_times) < offset and not long[0].ended:
                await asyncio.sleep(0.005)
            running.append(sum(1 for r in long if r.token_times and r.ended is None))
            joiners.append(asyncio.ensure_future(target.stream(target.request(PROMPTS[-1 - i], s.joiner_tokens))))
        return list(await asyncio.gather(*joiners)), running
    finally:
        await asyncio.gather(*tasks)


def joiner_row(joiner: Stream, running: int, record: dict[str, Any] | None, steps: pd.DataFrame | None) -> dict:
    row = {"ttft_s": joiner.ttft, "running_at_send": running, "failed": joiner.failure is not None}
    if record is None or steps is None or record["first_token_sampled"] is None:
        return row
    start, end = record["submitted"], record["first_token_sampled"]
    waited = steps[(steps.started > start) & (steps.started <= end)]
    busy = steps[(steps.started + steps.seconds >= start) & (steps.started <= end)]  # in progress or begun meanwhile
    step_s = float(busy.seconds.median()) if len(busy) else float("nan")
    row.update(server_ttft_s=end - start, waited_steps=len(waited), step_s=step_s,
               ttft_in_steps=(end - start) / step_s if step_s > 0 else float("nan"))  # fmt: skip
    return row


def joiner_tables(tables: dict[str, pd.DataFrame], s: Sizes) -> dict[str, pd.DataFrame]:
    rows = tables["rows"]
    values = [c for c in ("ttft_s", "server_ttft_s", "waited_steps", "ttft_in_steps", "running_at_send") if c in rows]
    return {"joiners": spread(rows, "background", values)}


def joiner_verdicts(tables: dict[str, pd.DataFrame], s: Sizes) -> list:
    rows = tables["rows"]
    busy = rows[rows.background > 0]
    out = [
        judge(
            "every joiner answered",
            "every joiner got its first token",
            "any joiner failed",
            not bool(rows.failed.any()),
            f"{int(rows.failed.sum())} of {len(rows)} failed",
            checked=True,
        )
    ]
    if "ttft_in_steps" in rows:
        out.append(judge(
            "a joiner waits about a step", "at each running batch, the median joiner's first token is sampled within two "
            "of the engine's current step durations of its arrival (the step in progress, then the step that prefills it)",
            "at any running batch, the median joiner waits more than 2 step durations",
            every(busy.groupby("background").ttft_in_steps.median().dropna() <= 2), "median " + ", ".join(
                f"{b} running: {g.ttft_in_steps.median():.2f} steps ({g.server_ttft_s.median() * 1e3:.0f} ms)"
                for b, g in rows.groupby("background")), checked=True))  # fmt: skip
    return out


def joiner_plots(tables: dict[str, pd.DataFrame], s: Sizes) -> list:
    from labkit.plots import new_figure

    rows = tables["rows"]
    fig, (ax,) = new_figure("overlap_joiners")
    for background, g in rows.groupby("background"):
        ax.scatter(g.running_at_send + 0.1 * g.repetition, 1000 * g.ttft_s, s=14, label=f"{background} started")
    ax.set(xlabel="long streams running when the joiner was sent", ylabel="ms to first token",
           title="Late joiners: first token by the batch they join")  # fmt: skip
    ax.set_ylim(bottom=0)
    ax.legend(fontsize="small")
    return [fig]


JOINERS = Experiment(
    name="overlap.joiners",
    title="Short requests into an idle engine and into running batches",
    sizes={"full": {"backgrounds": (0, 8, 24), "joiners": 6, "joiner_tokens": 8, "long_tokens": 64,
                    "join_after_tokens": (4, 40), "idle_pause_s": (0.02, 0.1), "repetitions": 3, "seed": 27},
           "ci": {"backgrounds": (0, 4, 8), "joiners": 4, "joiner_tokens": 4, "long_tokens": 120,
                  "join_after_tokens": (4, 40), "idle_pause_s": (0.01, 0.05), "repetitions": 3, "seed": 27}},
    conditions=lambda s, target: [{"background": b} for b in s.backgrounds],
    server=lambda s, c: {"max_batch": max(s.backgrounds) + s.joiners},
    prepare=lambda target, s: {},
    measure=measure_joiners,
    tables=joiner_tables,
    verdicts=joiner_verdicts,
    plots=joiner_plots,
)  # fmt: skip


# --------------------------------------------------------------------------- first-token delivery


def measure_delivery(trial: Trial) -> dict[str, Any]:
    target, s = trial.target, trial.sizes
    done = target.launch([target.request(p, s.tokens) for p in cycle(s.streams)])
    ttfts = [st.ttft for st in done.streams]
    trial.keep("streams", [{"stream": i, "ttft_s": t} for i, t in enumerate(ttfts)])
    row = {f"ttft_{q}_s": percentile(ttfts, p) for q, p in zip(QUANTILES, (0, 10, 50, 90, 100))}
    return {**row, "failed": sum(1 for st in done.streams if st.failure)}


def delivery_tables(tables: dict[str, pd.DataFrame], s: Sizes) -> dict[str, pd.DataFrame]:
    """Per quantile of the first tokens: step-end over prefill, repetition by repetition, with a
    95% interval: which part of the distribution prefill delivery moves."""
    rows = tables["rows"]
    out = []
    for q in QUANTILES:
        by = rows.pivot_table(index="repetition", columns="first_token", values=f"ttft_{q}_s")
        step_end, prefill = side(by, "step_end"), side(by, "prefill")
        ci = interval(step_end.to_numpy(), others=prefill.to_numpy())
        out.append({"quantile": q, "prefill_ms": 1e3 * prefill.median(), "step_end_ms": 1e3 * step_end.median(),
                    "step_end_over_prefill": ci.estimate, "ci_low": ci.low, "ci_high": ci.high, "n": ci.n})  # fmt: skip
    return {"by_quantile": pd.DataFrame(out)}


SAME = (0.8, 1.25)  # step-end over prefill delivery, read as no difference (fixed before measuring)


def delivery_verdicts(tables: dict[str, pd.DataFrame], s: Sizes) -> list:
    """The engine prefills a step's prompts in one pass, so their first tokens exist together and
    prefill delivery can only hand them over sooner by the rest of the step's bookkeeping: the
    claim is no difference, within :data:`SAME`, at the median and at the last first token."""
    t = tables["by_quantile"].set_index("quantile")
    rows = tables["rows"]

    def same(q: str) -> tuple[bool | None, str]:
        low, high = t.loc[q, "ci_low"], t.loc[q, "ci_high"]
        decided = True if SAME[0] <= low and high <= SAME[1] else False if high < SAME[0] or low > SAME[1] else None
        return (
            decided,
            f"ratio {t.loc[q, 'step_end_over_prefill']:.2f} (95% CI {low:.2f}–{high:.2f}, n={t.loc[q, 'n']})",
        )

    band = f"{SAME[0]:g}–{SAME[1]:g}"
    return [
        judge("every delivery stream answered", "every stream got its first token", "any stream failed",
              not bool(rows.failed.any()), f"{int(rows.failed.sum())} failed", checked=True),
        judge("one pass, one moment: the median", "a step's first tokens exist together, so the median first token "
              f"comes no sooner with prefill delivery: step-end over prefill within {band}", "the 95% interval of "
              f"step-end over prefill at the median lies wholly outside {band}", *same("p50")),
        judge("one pass, one moment: the last", "the same for the last first token", "the 95% interval at the "
              f"maximum lies wholly outside {band}", *same("max")),
    ]  # fmt: skip


def delivery_plots(tables: dict[str, pd.DataFrame], s: Sizes) -> list:
    from labkit.plots import cdf, new_figure

    fig, (ax,) = new_figure("overlap_delivery")
    for mode, g in tables["streams"].groupby("first_token"):
        cdf(ax, g.ttft_s, 1000, label=f"at {mode}")
    ax.set(xlabel="ms to first token", ylabel="fraction of streams", title="First-token delivery, every repetition")
    ax.legend()
    return [fig]


DELIVERY = Experiment(
    name="overlap.delivery",
    title="First tokens delivered as each prefill ends, or at the end of the step",
    sizes={"full": {"streams": 32, "tokens": 8, "repetitions": 6}, "ci": {"streams": 8, "tokens": 4, "repetitions": 3}},
    conditions=lambda s, target: [{"first_token": m} for m in ("prefill", "step_end")] if target.caps.settings else [],
    server=lambda s, c: {"max_batch": s.streams, "first_token": c["first_token"]},
    measure=measure_delivery,
    tables=delivery_tables,
    verdicts=delivery_verdicts,
    plots=delivery_plots,
    needs=("settings",),
)


# --------------------------------------------------------------------------- the client's share


class Servers(dict[str, Target]):
    def close(self) -> None:
        for target in self.values():
            if target is not self.get("thread"):
                target.close()


def prepare_servers(target: Target, s: Sizes) -> Servers:
    return Servers(thread=target.variant(max_batch=s.streams),
                   process=Process.labkit(target.model or "", max_batch=s.streams))  # fmt: skip


def measure_share(trial: Trial) -> dict[str, Any]:
    target, s = trial.state[trial.server], trial.sizes
    started = target.launch([target.request(p, s.tokens) for p in cycle(s.streams)])
    return started.row()


def share_verdicts(tables: dict[str, pd.DataFrame], s: Sizes) -> list:
    by = tables["rows"].pivot_table(index="repetition", columns="server", values="tokens_per_s")
    ci = interval(side(by, "process").to_numpy(), others=side(by, "thread").to_numpy())
    decided, evidence = tell(ci, 1.0, "above")
    return [judge("the client costs the in-thread server", "serving from a process of its own gives more tokens/s "
                  "than serving from a thread beside the client", "the 95% interval of process over thread lies below 1",
                  decided, f"process/thread tokens/s {evidence}")]  # fmt: skip


CLIENT_SHARE = Experiment(
    name="overlap.client_share",
    title="The same streams served from a thread of this process and from a process of its own",
    sizes={
        # nine: the paired interval then drops one round at each end; at six it is min-max, and
        # one slow round left the effect of a rerun (1.12) unclear
        "full": {"streams": 32, "tokens": 64, "repetitions": 9},
        "ci": {"streams": 8, "tokens": 16, "repetitions": 2},
    },
    conditions=lambda s, target: [{"server": "thread"}, {"server": "process"}],
    prepare=prepare_servers,
    measure=measure_share,
    tables=lambda t, s: {"servers": spread(t["rows"], "server", ["tokens_per_s", "ttft_p50_s", "gap_p50_s"])},
    verdicts=share_verdicts,
    needs=("settings", "engine"),
)

SPECS = (LEVELS, STEP_COST, JOINERS, DELIVERY, CLIENT_SHARE, GUIDELLM)
