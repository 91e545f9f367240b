"""Notebook 06, part one: when the client goes away, how soon does the server let go?

* :data:`MOMENTS`: pairs of clients, one leaving by FIN and one by RST, at five moments (waiting
  for a slot in a full batch, after the head, after ``early_tokens``, half-way, ``end_margin``
  before the end), against Starlette's response class (it listens for the disconnect) and the
  write-only one (it never does): the client's close → the hub's close → the release.
* :data:`FIN_RST`: many such pairs: is a FIN noticed later? Judged against a margin of
  ``margin_steps`` of the server's working step, fixed before measuring.
* :data:`STOP`: any target. Streams read ``hold_tokens``, then all leave: does the server stop
  generating? Witnessed by the best it offers (see :func:`witness_of`).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np
import pandas as pd

from labkit.lab import Experiment, ReadOptions, Sizes, Stream, Target, Trial, interval, judge, run_sync, span, spread
from labkit.lab.client import percentile as pct
from labkit.lab.stream import LeaveBy
from labkit.lab.witness import WaitTimeout, wait_for
from labkit.prompts import cycle as prompts

MOMENTS_ = ("waiting", "before_first", "early", "mid", "near_end")
CLASSES, OWN = ("starlette", "write_only"), "the server's own"
WAYS: tuple[LeaveBy, LeaveBy] = ("fin", "rst")
RUNNING = ("labkit_running_requests", "num_requests_running", "requests_processing", "num_running_reqs")


def leave_after(s: Sizes, moment: str) -> int:
    """Tokens a client reads before it leaves (0: once the head is in)."""
    if not 0 < s.early_tokens < s.tokens // 2 < s.tokens - s.end_margin:
        raise ValueError(f"disconnect: need 0 < early_tokens < tokens/2 < tokens - end_margin, got {s.as_dict()}")
    return {"waiting": 0, "before_first": 0, "early": s.early_tokens, "mid": s.tokens // 2,
            "near_end": s.tokens - s.end_margin}[moment]  # fmt: skip


def server(s: Sizes, c: dict[str, Any]) -> dict[str, Any]:
    kind = c.get("response_class", "starlette")  # FIN_RST's conditions name none
    return {"max_batch": s.max_batch, "policy": "unbounded", "kv_cache_mb": 128, "response_class": kind}


def class_conditions(s: Sizes, target: Target, key: str = "", values: tuple = ("",)) -> list[dict[str, Any]]:
    """Each response class (a target with fixed settings: its own) by each of ``values``."""
    if set(s.classes) - set(CLASSES):
        raise ValueError(f"disconnect: classes must come from {CLASSES}, got {s.classes}")
    kinds = s.classes if target.caps.settings else (OWN,)
    return [{"response_class": k, **({key: v} if key else {})} for k in kinds for v in values]


# --------------------------------------------------------------------------- pairs at a moment


async def wave(trial: Trial) -> tuple[list[dict[str, Any]], pd.DataFrame]:
    """``pairs`` FIN and RST clients (pair i: rows 2i and 2i+1, one prompt) leaving at the trial's
    moment; for ``waiting``, once the batch (its limit read from ``/stats``) is full of blockers,
    which leave after them. A :func:`trial_row` per client, with its pair, and the step log."""
    target, s, moment = trial.target, trial.sizes, trial.moment
    since, n, batch = target.current_step(), leave_after(s, moment), target.stats()["engine"]["max_batch"]
    flag = asyncio.Event()
    blockers = [asyncio.ensure_future(target.stream(target.request(p, s.blocker_tokens), leave=flag))
                for p in prompts(batch if moment == "waiting" else 0)]  # fmt: skip
    try:
        if blockers:
            full = lambda: target.stats()["running"] >= batch or all(b.done() for b in blockers)  # noqa: E731
            await asyncio.to_thread(wait_for, full, timeout=s.timeout, what="a full batch")
        ways = [ReadOptions(leave_after_tokens=n, leave_by=w, drain_after_fin_s=0.5, timeout=s.timeout) for w in WAYS]
        requests = [target.request(p, s.tokens) for p in prompts(batch + s.pairs)[-s.pairs :]]
        clients = await asyncio.gather(*(target.stream(r, o, raw=True) for r in requests for o in ways))
        records = await asyncio.to_thread(target.released, [c.request_id for c in clients], s.timeout)
    finally:
        flag.set()
        await asyncio.gather(*blockers, return_exceptions=True)
    log = target.steps(since).set_index("step")
    return [{"pair": i // 2, **trial_row(c, r, log)} for i, (c, r) in enumerate(zip(clients, records))], log


def trial_row(c: Stream, r: dict[str, Any] | None, log: pd.DataFrame) -> dict[str, Any]:
    """One client's row, off the server's record of it and the step in progress at the hub's close."""
    row: dict[str, Any] = {"leave_by": c.left or "none", "tokens_read": c.tokens, "left": c.left is not None}
    if r is None or c.left_at is None or r["closed"] is None:
        return row
    at, released = r["steps_at_close"], r["released"] or np.nan
    step = log.loc[at] if at in log.index else pd.Series({"seconds": np.nan, "started": np.nan})
    return {**row, "notice_ms": 1e3 * (r["closed"] - c.left_at), "release_ms": 1e3 * (released - c.left_at),
            "release_steps": np.nan if r["release_step"] is None else r["release_step"] - at,
            "step_ms": 1e3 * step.seconds, "rest_of_step_ms": 1e3 * (step.started + step.seconds - r["closed"])
            if r["release_step"] is not None and r["release_step"] > at else np.nan,
            "tokens_generated": r["tokens_generated"], "unread": r["tokens_generated"] - c.tokens,
            "ever_admitted": r["first_token_sampled"] is not None, "engine_finish": r["finish_reason"]}  # fmt: skip


def moment_tables(t: dict[str, pd.DataFrame], s: Sizes) -> dict[str, pd.DataFrame]:
    """The spread per class, moment and way; and the median release taken apart: the notice, the
    rest of the step in progress at the hub's close, and whole steps after it."""
    rows, by = t["rows"], ["response_class", "moment", "leave_by"]
    parts = rows.groupby(by, sort=False)[["notice_ms", "rest_of_step_ms", "release_steps", "step_ms", "release_ms"]]
    parts = parts.median()
    whole = (parts.release_steps - 1).clip(lower=0) * parts.step_ms  # steps after the one in progress
    parts["explained_ms"] = parts.notice_ms + parts.rest_of_step_ms + whole
    cols = [c for c in ("notice_ms", "release_ms", "release_steps", "unread", "tokens_read") if c in rows]
    return {"by_moment": spread(rows, by, cols), "decomposition": parts.reset_index()}  # fmt: skip


def moment_verdicts(t: dict[str, pd.DataFrame], s: Sizes) -> list:
    rows = t["rows"]
    listen, write = rows[rows.response_class != "write_only"], rows[rows.response_class == "write_only"]
    waited, late = listen[listen.moment == "waiting"], listen[listen.release_steps > 2]
    short = write[(write.engine_finish != "length") | (write.tokens_generated < s.tokens)]
    out = [judge("listening releases within two steps", "a response that listens lets the engine release a departed "
                 "client's stream within 2 steps of the hub's close", "any such trial released later",
                 None if listen.release_steps.isna().any() or listen.empty else late.empty,
                 f"{len(late)} of {len(listen)} later; steps {span(listen.release_steps, '{:.0f}')}",
                 checked=True)]  # fmt: skip
    if len(waited):
        out.append(judge("waiting never admitted", "a request whose client left while it waited is never admitted",
                         "any such request gets a slot",
                         None if waited.ever_admitted.isna().any() else not waited.ever_admitted.any(),
                         f"{int(waited.ever_admitted.sum())} of {len(waited)} admitted", checked=True))  # fmt: skip
    if len(write):
        out.append(judge("write-only runs to the limit", "with the write-only class every abandoned stream is "
                         "generated to its limit", "any ends before it",
                         None if write.engine_finish.isna().any() else short.empty,
                         f"{len(short)} of {len(write)} ended early",
                         checked=True))  # fmt: skip
    return out


def moment_plots(t: dict[str, pd.DataFrame], s: Sizes) -> list:
    from labkit.plots import new_figure

    fig, axes = new_figure("disconnect_release", ncols=2)
    for ax, (kind, group) in zip(axes, t["rows"].dropna(subset=["release_ms"]).groupby("response_class", sort=False)):
        for dx, (how, g) in zip((-0.12, 0.12), group.groupby("leave_by", sort=False)):
            ax.scatter(g.moment.map(s.moments.index) + dx, g.release_ms.clip(lower=0.1), s=12, label=how.upper())
        ax.set(yscale="log", title=kind.replace("_", "-"), ylabel="ms from the client's close to the release")
        ax.set_xticks(range(len(s.moments)), [m.replace("_", " ") for m in s.moments], rotation=20)
        ax.legend(fontsize="small")
    return [fig]


_MOMENTS_FULL = {"classes": CLASSES, "moments": MOMENTS_, "tokens": 200, "blocker_tokens": 32, "max_batch": 8,
                 "pairs": 4, "early_tokens": 2, "end_margin": 4, "timeout": 120.0, "repetitions": 1}  # fmt: skip
MOMENTS = Experiment(
    name="disconnect.moments",
    title="FIN and RST at five moments, Starlette's response against a write-only one: close, notice, release",
    sizes={"full": _MOMENTS_FULL, "ci": _MOMENTS_FULL | {"blocker_tokens": 200, "max_batch": 4, "pairs": 2,
                                                          "timeout": 60.0}},
    conditions=lambda s, target: class_conditions(s, target, "moment", s.moments),
    server=server,
    measure=lambda trial: run_sync(wave(trial))[0],
    tables=moment_tables,
    verdicts=moment_verdicts,
    plots=moment_plots,
    needs=("lab",),
    chapter={"max_batch": (4, "four pairs side by side in one wave; the blockers fill whatever the limit is"),
             "pairs": (6, "the chapter's six repetitions of each way at each moment; here four of each way per cell "
                       "(each write-only trial generates its whole limit); FIN against RST has its own measurement, "
                       "with many pairs"),
             "repetitions": ("in pairs", "the chapter's repetitions are the pairs row: one repetition here runs a "
                             "cell's four pairs side by side"),
             "blocker_tokens": (200, "they only need to outlast the waiting clients' leave, and leave after them")},
)  # fmt: skip


# --------------------------------------------------------------------------- FIN against RST


def measure_pairs(trial: Trial) -> list[dict[str, Any]]:
    rows, log = run_sync(wave(trial))
    step_ms = working_step_ms(log)
    return [{"pair": i, "fin_ms": f.get("notice_ms", np.nan), "rst_ms": r.get("notice_ms", np.nan), "step_ms": step_ms,
             "fin_admitted": f.get("ever_admitted"), "rst_admitted": r.get("ever_admitted")}
            for i, (f, r) in enumerate(zip(rows[::2], rows[1::2]))]  # fmt: skip


def working_step_ms(log: pd.DataFrame) -> float:
    """The wave's median step that ran the model (decoded or prefilled), in ms: the margin's unit.
    Steps that only applied cancels take a fraction of a millisecond and would shrink it to nothing;
    NaN where none ran (a wave whose clients all left before admission)."""
    working = log[(log.decoded > 0) | (log.prefilled > 0)]
    return float(1e3 * working.seconds.median()) if len(working) else float("nan")


def pair_tables(t: dict[str, pd.DataFrame], s: Sizes) -> dict[str, pd.DataFrame]:
    """Per moment: FIN minus RST, pair by pair: its median with a 95% interval, Wilcoxon's signed-rank
    p, how many had the FIN later, and the margin: ``margin_steps`` working steps (else every moment's)."""
    from scipy.stats import wilcoxon

    out = []
    rows = t["rows"].assign(diff_ms=lambda r: r.fin_ms - r.rst_ms).dropna(subset=["diff_ms"])
    steps = rows.groupby("moment").step_ms.median().fillna(rows.step_ms.median())
    for moment, g in rows.groupby("moment", sort=False):
        ci, p = interval(g.diff_ms.to_numpy()), float(wilcoxon(g.diff_ms).pvalue) if g.diff_ms.any() else 1.0
        out.append({"moment": moment, "pairs": len(g), "fin_ms": g.fin_ms.median(), "rst_ms": g.rst_ms.median(),
                    "diff_ms": ci.estimate, "ci_low": ci.low, "ci_high": ci.high, "wilcoxon_p": p,
                    "margin_ms": s.margin_steps * steps[moment], "fin_later": int((g.diff_ms > 0).sum()),
                    "fin_admitted": int(g.fin_admitted.sum()), "rst_admitted": int(g.rst_admitted.sum())})  # fmt: skip
    return {"fin_rst": pd.DataFrame(out)}


def pair_verdicts(t: dict[str, pd.DataFrame], s: Sizes) -> list:
    out = []
    for r in t["fin_rst"].itertuples():
        inside = -r.margin_ms < r.ci_low and r.ci_high < r.margin_ms
        outside = r.ci_low > r.margin_ms or r.ci_high < -r.margin_ms
        out.append(judge(f"FIN and RST alike: {r.moment}", "how a client closes changes how soon the server notices "
                         "by less than the margin", "the 95% interval of the median paired difference (FIN minus RST) "
                         "lies outside the margin; unclear while it crosses an edge",
                         True if inside else False if outside else None,
                         f"{r.diff_ms:+.2f} ms (95% CI {r.ci_low:+.2f} to {r.ci_high:+.2f}), margin "
                         f"±{r.margin_ms:.2f} ms, Wilcoxon p={r.wilcoxon_p:.2g}, FIN later in {r.fin_later} "
                         f"of {r.pairs}"))  # fmt: skip
    return out


def pair_plots(t: dict[str, pd.DataFrame], s: Sizes) -> list:
    from labkit.plots import new_figure

    fig, (ax,) = new_figure("disconnect_fin_rst")
    for i, ((_, g), r) in enumerate(zip(t["rows"].groupby("moment", sort=False), t["fin_rst"].itertuples())):
        ax.scatter(i + np.linspace(-0.3, 0.3, len(g)), g.fin_ms - g.rst_ms, s=8, alpha=0.6)
        ax.errorbar(i, r.diff_ms, yerr=[[r.diff_ms - r.ci_low], [r.ci_high - r.diff_ms]], fmt="ks", capsize=4)
        ax.fill_between([i - 0.4, i + 0.4], -r.margin_ms, r.margin_ms, color="gray", alpha=0.2)
    ax.set_xticks(range(len(t["fin_rst"])), list(t["fin_rst"].moment))
    ax.set(ylabel="FIN minus RST, ms to the hub's close", title="Every pair, the median, its 95% interval, the margin")
    return [fig]


_PAIRS_FULL = {"moments": MOMENTS_, "tokens": 48, "blocker_tokens": 64, "max_batch": 16, "pairs": 8,
               "early_tokens": 2, "end_margin": 4, "margin_steps": 0.1, "timeout": 120.0, "repetitions": 7}  # fmt: skip
FIN_RST = Experiment(
    name="disconnect.fin_rst",
    title="FIN against RST, side by side in pairs: the paired difference in when the server noticed",
    sizes={"full": _PAIRS_FULL, "ci": _PAIRS_FULL | {"blocker_tokens": 200, "max_batch": 8, "pairs": 4, "timeout": 60.0,
                                                    "repetitions": 3}},
    conditions=lambda s, target: [{"moment": m} for m in s.moments],
    server=server,
    measure=measure_pairs,
    tables=pair_tables,
    verdicts=pair_verdicts,
    plots=pair_plots,
    needs=("lab",),
    chapter={"tokens": (200, "a pair's moment is where in its stream the client leaves (half-way, 4 before the "
                        "end): 48-token streams put mid and near_end 24 and 44 steps in, so every moment gets its "
                        "fifty pairs within the notebook's time; the moments table runs the chapter's 200"),
             "max_batch": (4, "more pairs a wave: fifty or more per moment within the notebook's time"),
             "blocker_tokens": (200, "they only need to outlast the waiting clients' leave, and leave after them")},
)  # fmt: skip


# --------------------------------------------------------------------------- does it stop? (any target)


def witness_of(target: Target) -> str:
    """The best witness of work in progress this target offers."""
    caps = target.caps
    return next(w for w, ok in (("records", caps.lab), ("stats", caps.stats), ("metrics", caps.metrics and
                running(target) is not None), ("cpu", caps.cpu), ("follow-up", True)) if ok)  # fmt: skip


def running(target: Target) -> float | None:
    """Requests running, from a Prometheus gauge whose name says so (summed over labels)."""
    found = [v for k, v in target.metrics().items() if any(name in k for name in RUNNING)]
    return sum(found) if found else None


def reading(target: Target, witness: str, window_s: float, follow_tokens: int) -> float:
    """Work in progress now: requests running; CPU seconds per second over ``window_s``; or a
    follow-up request's median gap (slower while the server still generates for others)."""
    if witness in ("stats", "metrics"):
        return float(target.stats()["running"] if witness == "stats" else running(target) or 0.0)
    if witness == "cpu":
        start, cpu = time.perf_counter(), target.cpu_seconds()
        time.sleep(window_s)
        return (target.cpu_seconds() - cpu) / (time.perf_counter() - start)
    return pct(target.read(target.request(prompts(1)[0], follow_tokens), ReadOptions(timeout=120.0)).gaps, 50)


async def _stop(target: Target, s: Sizes, how: LeaveBy) -> dict[str, Any]:
    """Idle, while ``streams`` run (once each has ``hold_tokens``), then after they all left: the
    witness's readings, and ``kept_on``: the share of the rest the server still did (0: it stopped)."""
    witness, flag, results = witness_of(target), asyncio.Event(), [Stream() for _ in range(s.streams)]
    read = lambda window: asyncio.to_thread(reading, target, witness, window, s.follow_tokens)  # noqa: E731
    idle = np.nan if witness == "records" else await read(0.5)
    opts = ReadOptions(leave_by=how, drain_after_fin_s=0.5, timeout=s.timeout)
    tasks = [asyncio.ensure_future(target.stream(target.request(p, s.tokens), opts, leave=flag, result=r))
             for p, r in zip(prompts(s.streams), results)]  # fmt: skip
    try:
        held = lambda: all(len(r.token_times) >= s.hold_tokens or r.ended for r in results)  # noqa: E731
        await asyncio.to_thread(wait_for, held, timeout=s.timeout, what="the held tokens")
        gap = pct([g for r in results for g in r.gaps], 50)
        window, during = s.window_gaps * gap, np.nan if witness == "records" else await read(s.window_gaps * gap)
    except WaitTimeout:
        during = window = gap = np.nan
    finally:
        flag.set()
        await asyncio.gather(*tasks)
    tokens = [r.tokens for r in results]
    row = {"witness": witness, "streams_left": sum(r.left is not None for r in results), "tokens_read": np.mean(tokens),
           "failed": sum(r.failure is not None for r in results), "window_s": window,
           "left_before_end_s": (s.tokens - max(tokens)) * gap}  # fmt: skip
    if witness == "records":
        records = await asyncio.to_thread(target.released, [r.request_id for r in results], s.timeout)
        made = [(x["tokens_generated"] - n) / max(1, s.tokens - n) for x, n in zip(records, tokens) if x]
        return {**row, "kept_on": float(np.median(made)) if made else np.nan}
    await asyncio.sleep(window if witness in ("stats", "metrics") else 0.0)  # a few gaps for the server to notice
    after = await read(window)
    kept_on = (after - idle) / (during - idle) if during > idle else np.nan
    return {**row, "idle": idle, "during": during, "after": after, "kept_on": kept_on}


def stop_verdicts(t: dict[str, pd.DataFrame], s: Sizes) -> list:
    """Per class: a listening server stops, a write-only one does not; unclear where the streams did not
    move the witness, or would have ended within twice its window anyway."""
    out = []
    for kind, g in t["rows"].groupby("response_class", sort=False):
        usable = g[(g.left_before_end_s > 2 * g.window_s) | (g.witness == "records")].kept_on.dropna()
        stops = kind != "write_only"
        out.append(judge(f"{kind}: {'stops' if stops else 'keeps generating'}", "when its clients leave, the server "
                         f"{'stops' if stops else 'keeps on'} generating for them", "in any usable round it "
                         f"{'kept on with half the rest or more' if stops else 'did less than half the rest'}",
                         None if usable.empty else bool(((usable < 0.5) == stops).all()),
                         f"{g.witness.iloc[0]}: kept on {span(usable)} of the rest; {len(usable)} of {len(g)} rounds "
                         "usable", checked=bool((g.witness == "records").all())))  # fmt: skip
    return out


_STOP_FULL = {"classes": CLASSES, "streams": 4, "tokens": 96, "hold_tokens": 8, "window_gaps": 10,
              "follow_tokens": 12, "max_batch": 8, "timeout": 120.0, "repetitions": 1}  # fmt: skip
STOP = Experiment(
    name="disconnect.stop",
    title="Streams read a while, then all leave: does the server stop generating? (any target)",
    sizes={"full": _STOP_FULL, "ci": _STOP_FULL | {"tokens": 200, "timeout": 60.0, "repetitions": 2}},
    conditions=lambda s, target: class_conditions(s, target, "leave_by", WAYS),
    server=server,
    measure=lambda trial: run_sync(_stop(trial.target, trial.sizes, trial.leave_by)),
    tables=lambda t, s: {"rounds": spread(t["rows"], ["response_class", "leave_by", "witness"], ["kept_on"])},
    verdicts=stop_verdicts,
    chapter={"tokens": (200, "streams still running when their clients leave are all the probe needs (a round "
                        "whose streams would have ended within twice the witness's window is set aside, unless the "
                        "server's records witness it)")},
)  # fmt: skip

SPECS = (MOMENTS, FIN_RST, STOP)
