"""Notebook 07, extensions: the chapter's reader exercises, measured.

* :data:`FULL_BATCH` (2): a batch filled by clients that stopped reading while others wait; ``pause``
  against ``pause_then_drop`` at stall timeouts counted in steps: slots held while requests waited.
* :data:`RESUME` (4): leave by RST after N tokens, resume with ``Last-Event-ID``; after the grace, 404.
* :data:`EAGER` (6): the events held for four stalled readers, formatted eagerly (padded or not) and lazily.
* :data:`SAMPLING` (7): seeded sampled streams at once, again, alone, and against greedy ones.
* :data:`PAGED` (8): the paged kernel against the gather (:mod:`labkit.bench_attention` times them).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
import tracemalloc
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import pandas as pd

from labkit.experiments.isolation import first_difference
from labkit.lab import Experiment, NotMeasurable, ReadOptions, Request, Sizes, Target, Trial, run_sync
from labkit.lab.verdict import every, interval, judge, spread, tell
from labkit.lab.witness import WaitTimeout, wait_for
from labkit.prompts import PROMPTS

#: a client that stopped reading: takes no byte (small receive buffer) until told to leave, then RST
HOLD = ReadOptions(read=False, rcvbuf=4096, leave_after_s=300.0, leave_by="rst")
CONNECTION = {"sndbuf": 4096, "kv_cache_mb": 64}  # the servers' side of it, and a small cache each


async def holding(target: Target, requests: list[Request], meanwhile: Callable[[], Awaitable[Any]]) -> Any:
    """Clients that never read hold ``requests`` open while ``meanwhile`` runs; then they leave."""
    leave = asyncio.Event()
    held = [asyncio.ensure_future(target.stream(r, HOLD, leave=leave)) for r in requests]
    try:
        return await meanwhile()
    finally:
        leave.set()
        await asyncio.gather(*held)


# --------------------------------------------------------------------------- a full batch


def prepare_full_batch(target: Target, s: Sizes) -> dict[str, Any]:
    """A server per condition. The stall timeouts are counted in steps (the others' work is), and
    the hub's timer takes seconds: a full batch's step is timed here first, on ``pause``'s server."""
    same = {"max_batch": s.batch, "high_water": s.high_water, "pad_bytes": s.pad_bytes, "max_pause": None, **CONNECTION}
    held = target.variant(policy="pause", stall_timeout=60.0, **same)
    held.launch([held.request(p, s.fast_tokens) for p in PROMPTS[: s.batch]])  # a server's first run is slower
    since = held.current_step()
    held.launch([held.request(p, s.fast_tokens) for p in PROMPTS[: s.batch]])
    step_s = float(np.median(np.diff(held.steps(since).started)))
    servers = {n: target.variant(policy="pause_then_drop", stall_timeout=min(n * step_s, 60.0), **same)
               for n in s.stall_steps}  # fmt: skip
    return {"servers": {math.inf: held, **servers}, "step_s": step_s}


def measure_full_batch(trial: Trial) -> dict[str, Any]:
    """The stalled clients' requests first, the others once the engine has taken them: some wait."""
    target, s = trial.state["servers"][trial.stall_steps], trial.sizes
    clock, since, base = target.clock(), target.current_step(), target.stats()["releases"]
    slow = [target.request(p, s.slow_tokens) for p in PROMPTS[: s.slow]]
    fast = [target.request(p, s.fast_tokens) for p in PROMPTS[s.slow : s.slow + s.fast]]

    def taken() -> bool:
        return sum(map(target.stats().get, ("running", "paused", "releases"))) - base >= s.slow

    async def then() -> Any:
        with contextlib.suppress(WaitTimeout):  # at the bound the others go anyway: the verdicts will say
            await asyncio.to_thread(wait_for, taken, timeout=120.0, what="the stalled requests in the batch")
        return await target.launch_async(fast)

    streams = run_sync(holding(target, slow, then)).streams
    fast_ids = {st.request_id for st in streams}
    slow_records = target.released([r["rid"] for r in target.records_since(clock) if r["rid"] not in fast_ids])
    waits = [(r["submitted"], r["first_token_sampled"] or math.inf) for r in target.records(list(fast_ids)) if r]
    start, end = min(st.sent for st in streams), max(st.ended or st.sent for st in streams)
    held = [r["released"] if r and r["released"] else end for r in slow_records]
    steps = target.steps(since).started.to_numpy()
    steps = steps[(steps >= start) & (steps <= end)]
    return {"stall_timeout_s": trial.stall_steps * trial.state["step_s"],
            "stalled_slot_s": held_while_waiting(np.arange(start, end, 1e-3), waits, held) * 1e-3,
            "stalled_slot_steps": held_while_waiting(steps, waits, held), "others_done_s": end - start,
            "others_steps": len(steps), "stalled_paused": sum(bool(r and r["pauses"]) for r in slow_records),
            "stalled_dropped": sum(h < end for h in held), "others_failed": sum(bool(st.failure) for st in streams)}  # fmt: skip


def held_while_waiting(times: np.ndarray, waits: list[tuple[float, float]], held: list[float]) -> int:
    """Over ``times``, slots held by the stalled streams (each until its release) while some request waited."""
    start, end = np.asarray(waits, float).reshape(-1, 2).T
    waiting = ((times[:, None] >= start) & (times[:, None] < end)).any(axis=1)
    return int(((times < np.asarray(held, float)[:, None]) & waiting).sum())


def full_batch_verdicts(tables: dict[str, pd.DataFrame], s: Sizes) -> list:
    rows = tables["rows"]
    pause, ptd = rows[rows.policy == "pause"], rows[rows.policy == "pause_then_drop"]
    ok = bool((rows.stalled_paused == s.slow).all()) and int(rows.others_failed.sum()) == 0
    setup = f"{int(rows.stalled_paused.sum())} of {s.slow * len(rows)} paused; {int(rows.others_failed.sum())} others failed"
    out = [
        judge("pause keeps the slots", "under pause the stalled streams keep their slots until their clients "
              "leave, after the other requests are done", "any stalled stream released before the others were done",
              ok and int(pause.stalled_dropped.sum()) == 0,
              f"{int(pause.stalled_dropped.sum())} released early; {setup}", checked=True),
        judge("pause_then_drop gives them back", "at every stall timeout, every stalled stream is dropped and its "
              "slot freed while the others still run", "any stalled stream held until its client left",
              None if ptd.empty else ok and bool((ptd.stalled_dropped == s.slow).all()),
              f"{int(ptd.stalled_dropped.sum())} of {s.slow * len(ptd)} dropped; {setup}", checked=True),
    ]  # fmt: skip
    for stall, g in ptd.groupby("stall_steps"):
        decided, evidence = tell(interval(g.stalled_slot_steps.to_numpy(), others=pause.stalled_slot_steps.to_numpy()),
                                 1.0, "below")  # fmt: skip
        out.append(judge(f"dropping after {stall:g} steps frees slot-steps", "pause_then_drop holds fewer slot-steps "
                         "for stalled streams while requests wait than pause", "the 95% interval of the ratio "
                         "(pause_then_drop over pause) lies above 1", decided, f"ratio {evidence}"))  # fmt: skip
    return out


BATCH_SIZES = {"batch": 4, "slow": 2, "fast": 4, "slow_tokens": 64, "fast_tokens": 96, "high_water": 16,
               "stall_steps": (8, 32), "pad_bytes": 4096, "repetitions": 6}  # fmt: skip
FULL_BATCH = Experiment(
    name="extensions.full_batch",
    title="A batch full of clients that stopped reading: pause against pause_then_drop",
    # the stalled streams pause some 36 steps in (their buffers full, in bytes: a machine's, not an
    # engine's); the first others hold their slots for fast_tokens steps, so a drop 8 or 32 steps
    # after the pause comes while the rest still wait: at 64 tokens and one second (37 steps here)
    # it came after, and the design could not show the effect
    sizes={"full": BATCH_SIZES, "ci": {**BATCH_SIZES, "fast_tokens": 300, "repetitions": 2}},
    conditions=lambda s, target: [{"policy": "pause", "stall_steps": math.inf}]
    + [{"policy": "pause_then_drop", "stall_steps": n} for n in s.stall_steps],
    prepare=prepare_full_batch,
    measure=measure_full_batch,
    tables=lambda t, s: {"policies": spread(t["rows"], ["policy", "stall_steps"], ["stall_timeout_s",
                         "stalled_slot_steps", "stalled_slot_s", "others_steps", "others_done_s"])},
    verdicts=full_batch_verdicts,
    needs=("lab", "settings"),
    chapter={"batch": (32, "not filled in the chapter; a batch of 4 is full with 6 streams, a paused one holds 1 slot"),
             "stall_steps": ("0.25 s", "counted in steps of the measured step, so that a drop falls at the same point "
                             "of the others' work on any engine")},
)  # fmt: skip


# --------------------------------------------------------------------------- resuming


def measure_resume(trial: Trial) -> dict[str, Any]:
    target, s = trial.target, trial.sizes
    if trial.come_back == "after the grace":
        target.need("settings", what="coming back after the grace")
    whole = target.read(target.request(PROMPTS[0], s.tokens))
    left = target.read(target.request(PROMPTS[0], s.tokens, resumable=True),
                       ReadOptions(leave_after_tokens=trial.leave_after, leave_by="rst"))  # fmt: skip
    if trial.come_back == "after the grace":
        # The grace runs from the last follower's leave, and again from the run's end if it ends within
        # it (a finished log is kept a grace after it finished): so wait for the engine to let the
        # request go, then the grace. Seconds, for the server's timer is in seconds: no engine in it.
        if target.caps.lab:
            target.released([left.request_id], timeout=300.0)
        run_sync(asyncio.sleep(1.5 * s.grace_s + 0.5))
    back = target.read(target.resume_request(left))
    ids, last = [int(e.id) for e in back.events if e.id], int(left.last_event_id or 0)
    return {"status": back.status, "tokens_before": len(left.token_ids), "last_id": last, "events_after": len(ids),
            "in_order": ids == list(range(last + 1, last + 1 + len(ids))),
            "exact": left.token_ids + back.token_ids == whole.token_ids and back.completed}  # fmt: skip


def resume_verdicts(tables: dict[str, pd.DataFrame], s: Sizes) -> list:
    rows = tables["rows"]
    back, late = rows[rows.come_back == "at once"], rows[rows.come_back == "after the grace"]
    good = back[(back.status == 200) & back.in_order & back.exact]
    out = [judge("resumed exactly", "a client that left by RST and came back with Last-Event-ID gets exactly the "
                 "events it missed, in order, and with them the whole answer", "any resumed stream missed, repeated "
                 "or reordered an event, or its tokens differ from an uninterrupted stream's", bool(len(back))
                 and len(good) == len(back), f"{len(good)} of {len(back)} exact", checked=True)]  # fmt: skip
    if len(late):
        out.append(judge("forgotten after the grace", "after the grace period the stream is unknown (404)",
                         "any other answer", bool((late.status == 404).all()),
                         f"statuses {sorted(set(late.status))}", checked=True))  # fmt: skip
    return out


RESUME = Experiment(
    name="extensions.resume",
    title="Leaving by RST after N tokens, then resuming with Last-Event-ID",
    sizes={"full": {"tokens": 64, "leave_after": (1, 16, 48), "grace_s": 2.0, "repetitions": 1},
           "ci": {"tokens": 24, "leave_after": (1, 8), "grace_s": 1.0, "repetitions": 1}},
    conditions=lambda s, target: [{"leave_after": n, "come_back": "at once"} for n in s.leave_after]
    + [{"leave_after": s.leave_after[0], "come_back": "after the grace"}],
    server=lambda s, c: {"resume_grace": s.grace_s},
    measure=measure_resume,
    verdicts=resume_verdicts,
    needs=("native",),
)  # fmt: skip


# --------------------------------------------------------------------------- eager formatting


def measure_eager(trial: Trial) -> list[dict[str, Any]]:
    target, s = trial.target, trial.sizes
    requests = [target.request(p, s.tokens) for p in PROMPTS[: s.readers]]
    clock = target.clock()

    def all_released() -> list[dict[str, Any]] | None:
        records = target.records_since(clock)
        return records if len(records) == s.readers and all(r["released"] for r in records) else None

    records = run_sync(holding(target, requests, lambda: asyncio.to_thread(wait_for, all_released, timeout=300.0,
                                                                          what="the streams' release")))  # fmt: skip
    pool = [token for st in target.launch(requests).streams for token in zip(st.token_ids, st.pieces)]
    return [{"reader": i, "tokens": r["tokens_generated"], "queued": r["max_queue"],
             **held_bytes(pool, r["max_queue"], s.pad_bytes)} for i, r in enumerate(records)]  # fmt: skip


def held_bytes(tokens: list[tuple[int, str]], count: int, pad_bytes: int) -> dict[str, int]:
    """Bytes (``tracemalloc``) that ``count`` events cycling through ``tokens`` hold, eager and lazy."""
    from labkit.engine import TokenEvent
    from labkit.schema import StreamEncoder
    from labkit.service.frames import encode_item, wire_bytes

    tokens = tokens or [(0, " ")]

    def events() -> list[TokenEvent]:
        return [TokenEvent("held", i, tokens[i % len(tokens)][0] + 0, tokens[i % len(tokens)][1].encode().decode(),
                           0.0, i) for i in range(count)]  # fmt: skip

    def held(make: Callable[[], Any]) -> int:  # bytes still held by this thread's allocations, not a server thread's
        tracemalloc.start(256)
        try:
            _held, others = make(), tracemalloc.Filter(False, threading.__file__, all_frames=True)
            return sum(st.size for st in tracemalloc.take_snapshot().filter_traces([others]).statistics("filename"))
        finally:
            tracemalloc.stop()

    out = {"lazy_bytes": held(events)}
    for name, pad in (("eager_bytes", pad_bytes), ("eager_unpadded_bytes", 0)):
        ready, encoder = events(), StreamEncoder()
        out[name] = held(lambda: [wire_bytes(encode_item(encoder, e), pad) for e in ready])  # noqa: B023
    return out


def eager_tables(tables: dict[str, pd.DataFrame], s: Sizes) -> dict[str, pd.DataFrame]:
    rows = tables["rows"]
    per = rows.assign(**{f"{c}_per_event": rows[c] / rows.queued.clip(lower=1)
                         for c in ("eager_bytes", "eager_unpadded_bytes", "lazy_bytes")})  # fmt: skip
    per["padding_share"] = 1 - rows.eager_unpadded_bytes / rows.eager_bytes
    per["eager_MiB"], per["chapter_arithmetic_MiB"] = rows.eager_bytes / 2**20, rows.tokens * s.pad_bytes / 2**20
    return {"per_reader": per}


def eager_verdicts(tables: dict[str, pd.DataFrame], s: Sizes) -> list:
    t = tables["per_reader"]
    t = t[t.queued > 0]  # a reader that held nothing says nothing about what eager holds
    return [
        judge("the padding is what eager holds", "formatted eagerly, a queued event's bytes are almost all the lab's "
              "padding", "the padding is under 99% of the eager bytes for any reader",
              every(t.padding_share >= 0.99), f"padding share {t.padding_share.min():.4f} at least; "
              f"{int(t.queued.sum())} events held in all", checked=True),
        judge("unpadded, eager is no heavier", "without the padding, an eagerly formatted event holds no more than "
              "the hub's unformatted one", "any reader's eager bytes per event (unpadded) exceed its lazy bytes per "
              "event", every(t.eager_unpadded_bytes_per_event <= t.lazy_bytes_per_event),
              f"{t.eager_unpadded_bytes_per_event.median():.0f} against {t.lazy_bytes_per_event.median():.0f} bytes "
              "per event (median reader)", checked=True),
    ]  # fmt: skip


EAGER = Experiment(
    name="extensions.eager",
    title="Four clients that stopped reading: what an eager server would hold, measured",
    sizes=dict.fromkeys(("full", "ci"), {"readers": 4, "tokens": 64, "pad_bytes": 65536}),
    server=lambda s, c: {"policy": "unbounded", "pad_bytes": s.pad_bytes, "max_batch": s.readers, **CONNECTION},
    measure=measure_eager,
    tables=eager_tables,
    verdicts=eager_verdicts,
    needs=("lab", "settings"),
)  # fmt: skip


# --------------------------------------------------------------------------- seeded sampling


def measure_sampling(trial: Trial) -> list[dict[str, Any]]:
    target, s = trial.target, trial.sizes
    prompts = PROMPTS[: s.streams]
    sampled = [target.request(p, s.tokens, temperature=s.temperature, top_p=s.top_p, seed=s.seed + i)
               for i, p in enumerate(prompts)]  # fmt: skip
    runs = {"greedy": target.launch([target.request(p, s.tokens) for p in prompts]).streams,
            "sampled": target.launch(sampled).streams, "again": target.launch(sampled).streams,
            "alone": [target.read(r) for r in sampled]}  # fmt: skip
    pairs = {"all at once vs alone": ("sampled", "alone"), "all at once, twice": ("sampled", "again"),
             "sampled vs greedy": ("sampled", "greedy")}  # fmt: skip
    return [{"comparison": what, "prompt": i, "first_diff": first_difference(x.token_ids, y.token_ids),
             "failed": x.failure is not None or y.failure is not None}
            for what, (a, b) in pairs.items() for i, (x, y) in enumerate(zip(runs[a], runs[b]))]  # fmt: skip


def sampling_verdicts(tables: dict[str, pd.DataFrame], s: Sizes) -> list:
    rows = tables["rows"].assign(identical=lambda t: t.first_diff.isna() & ~t.failed.astype(bool))
    must, greedy = rows[rows.comparison != "sampled vs greedy"], rows[rows.comparison == "sampled vs greedy"]
    greedy = greedy[~greedy.failed.astype(bool)]  # a failed pair differs for no reason of sampling's
    return [
        judge("seeded sampling repeats", "a seeded sampled stream repeats exactly, run again or run alone",
              "any pair differs", bool(len(must)) and bool(must.identical.all()),
              f"{int(must.identical.sum())} of {len(must)} pairs identical", checked=True),
        judge("sampling takes effect", "most sampled streams differ from the greedy ones (ignored sampling would "
              "pass the check above)", "fewer than half differ",
              None if greedy.empty else bool((~greedy.identical).mean() >= 0.5),
              f"{int((~greedy.identical).sum())} of {len(greedy)} differ", checked=True),
    ]  # fmt: skip


SAMPLING = Experiment(
    name="extensions.sampling",
    title="Seeded sampling: all at once, again, alone, and against greedy",
    sizes={"full": {"streams": 8, "tokens": 32, "temperature": 0.8, "top_p": 0.95, "seed": 1000},
           "ci": {"streams": 4, "tokens": 16, "temperature": 0.8, "top_p": 0.95, "seed": 1000}},
    measure=measure_sampling,
    tables=lambda t, s: {"comparisons": t["rows"].groupby("comparison", sort=False).agg(
        streams=("prompt", "size"), differ=("first_diff", "count"), earliest=("first_diff", "min")).reset_index()},
    verdicts=sampling_verdicts,
    needs=("native",),
)  # fmt: skip


# --------------------------------------------------------------------------- exercise 8


def prepare_bench(target: Target, s: Sizes) -> dict[str, Any]:
    from labkit.bench_attention import AttentionBench, bench_runner, kernel_status

    status = kernel_status()
    if status.mode != "kernel":
        raise NotMeasurable("the paged kernel against the gather", f"the kernel cannot run here: {status.reason}")
    bench = AttentionBench(batches=s.batches, contexts=s.contexts, reps=1, steps=s.steps)
    return {"bench": bench, "runner": bench_runner(bench, target.loaded)}  # type: ignore[attr-defined]


def measure_paged(trial: Trial) -> list[dict[str, Any]]:
    from labkit.bench_attention import measure_attention

    rows = measure_attention(trial.state["bench"], runner=trial.state["runner"])
    return rows.assign(rep=trial.repetition).to_dict("records")


def paged_tables(tables: dict[str, pd.DataFrame], s: Sizes) -> dict[str, pd.DataFrame]:
    from labkit.bench_attention import summarize

    return {"summary": summarize(tables["rows"])}


def paged_verdicts(tables: dict[str, pd.DataFrame], s: Sizes) -> list:
    rows, big = tables["rows"], max(s.batches)
    out = []
    for what in ("step", "attention"):
        by = rows[rows.batch == big].pivot_table(index=["context", "repetition"], columns="mode", values=f"{what}_ms")
        for context, g in (by["kernel"] / by["gather"]).groupby("context"):
            decided, evidence = tell(interval(g.to_numpy()), 1.0, "below")
            out.append(judge(f"kernel {what} cheaper at context {context}", f"at {big} sequences the {what} costs "
                             "less with the kernel than with the gather", "the 95% interval of kernel over gather "
                             "(paired by repetition) lies above 1", decided, f"ratio {evidence}"))  # fmt: skip
    return out


def paged_plots(tables: dict[str, pd.DataFrame], s: Sizes) -> list:
    from labkit.plots import new_figure, with_range

    fig, axes = new_figure("extensions_paged", ncols=2)
    cells = spread(tables["rows"], ["mode", "batch", "context"], ["attention_ms", "step_ms"])
    for ax, what in zip(axes, ("attention", "step")):
        for (mode, batch), g in cells.groupby(["mode", "batch"]):
            with_range(ax, g.context, g, f"{what}_ms", fmt="o-" if mode == "kernel" else "s--", label=f"{mode}, {batch} seq")  # fmt: skip
        ax.set(xlabel="context (tokens cached per sequence)", ylabel="ms (median, min–max of repetitions)",
               title=f"decode {what}" if what == "attention" else "whole decode step")  # fmt: skip
        ax.legend(fontsize="small")
    return [fig]


PAGED = Experiment(
    name="extensions.paged",
    title="Decode attention through the block tables (kernel) against the gather",
    sizes={"full": {"batches": (1, 32), "contexts": (64, 256, 512), "steps": 2, "repetitions": 6},
           "ci": {"batches": (1, 32), "contexts": (64, 256, 448), "steps": 3, "repetitions": 6}},
    prepare=prepare_bench,
    measure=measure_paged,
    tables=paged_tables,
    verdicts=paged_verdicts,
    plots=paged_plots,
    needs=("engine",),
)  # fmt: skip

SPECS = (FULL_BATCH, RESUME, EAGER, SAMPLING, PAGED)
