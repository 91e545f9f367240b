"""Notebook 06, part two: after many clients come and go, is everything given back exactly once?

:data:`PLAN` sends ``streams`` requests, ``concurrency`` at most at once, on a seeded plan:
``share_full`` read to the end, ``share_early`` leave after ``early_range`` tokens by FIN or RST,
the rest read slowly and leave after one of ``slow_leave_after``. Then the server's books, not the
responses, as the best witness it offers reads them (:func:`books`); and what leaving cost: tokens
made per token read, and time.
"""

from __future__ import annotations

import asyncio
import random
import time
from contextlib import suppress
from typing import Any

import numpy as np
import pandas as pd

from labkit.experiments import published
from labkit.experiments.disconnect import CLASSES, WAYS, class_conditions, reading, server, witness_of
from labkit.lab import Experiment, ReadOptions, Sizes, Target, Trial, interval, judge, run_sync, spread, tell
from labkit.lab.stream import LeaveBy
from labkit.lab.witness import WaitTimeout, wait_for
from labkit.prompts import cycle as prompts

SLACK = 1.25  # a CPU or pace witness is back when within this factor of its idle reading


def plan(s: Sizes) -> list[tuple[str, int | None, LeaveBy]]:
    """(kind, tokens read before leaving or None, FIN or RST) per client, seeded."""
    shares = 0 <= s.share_full and 0 <= s.share_early and s.share_full + s.share_early <= 1
    if not shares or max(s.early_range[1], *s.slow_leave_after) >= s.tokens:
        raise ValueError(
            f"leak: shares in [0, 1] summing to at most 1, leaving before tokens={s.tokens}: {s.as_dict()}"
        )
    rng = random.Random(s.seed)
    full, early = round(s.streams * s.share_full), round(s.streams * s.share_early)
    kinds = ["full"] * full + ["early"] * early + ["slow"] * (s.streams - full - early)
    rng.shuffle(kinds)
    after = {"full": lambda: None, "early": lambda: rng.randint(*s.early_range),
             "slow": lambda: rng.choice(s.slow_leave_after)}  # fmt: skip
    return [(kind, after[kind](), rng.choice(WAYS)) for kind in kinds]


async def clients(target: Target, s: Sizes) -> list[Any]:
    gate = asyncio.Semaphore(s.concurrency)

    async def one(text: str, kind: str, after: int | None, how: LeaveBy) -> Any:
        opts = ReadOptions(pace=s.slow_pace_s if kind == "slow" else 0.0, leave_after_tokens=after, leave_by=how,
                           drain_after_fin_s=0.5, timeout=s.timeout)  # fmt: skip
        async with gate:
            return await target.stream(target.request(text, s.tokens), opts, raw=True)

    return await asyncio.gather(*(one(text, *c) for text, c in zip(prompts(s.streams), plan(s))))


def measure(trial: Trial) -> dict[str, Any]:
    target, s = trial.target, trial.sizes
    witness = "books" if target.caps.lab else witness_of(target)
    before = target.stats() if target.caps.stats else {}
    idle = reading(target, witness, s.window_s, s.follow_tokens) if witness in ("cpu", "follow-up") else np.nan
    clock, t0 = target.clock() if target.caps.lab else None, time.perf_counter()
    streams = run_sync(clients(target, s))
    left = [x.left is not None for x in streams]
    read = np.array([x.tokens for x in streams])
    row = {"streams": len(streams), "left_early": sum(left), "tokens_read": int(read.sum()),
           "client_errors": sum(1 for x in streams if x.failure), "witness": witness,
           "total_s": max(x.ended or np.nan for x in streams) - t0}  # fmt: skip
    if clock is not None:
        records = target.released([x.request_id for x in streams], timeout=s.timeout)
        made = np.array([(r or {}).get("tokens_generated", 0) for r in records])
        row["total_s"] = max(row["total_s"], max((r or {}).get("released") or t0 for r in records) - t0)  # zombies too
        row.update(tokens_generated=int(made.sum()), generated_per_read=made.sum() / max(1, read.sum()),
                   generated_per_read_leavers=made[left].sum() / max(1, read[left].sum()))  # fmt: skip
    return {**row, **books(target, witness, before, idle, clock, s)}


def books(target: Target, witness: str, before: dict, idle: float, clock: float | None, s: Sizes) -> dict[str, Any]:
    """What the server's own books say once it is idle, as checks that pass or name what failed."""
    extra: dict[str, Any] = {}
    if witness == "books":
        b, now, runs = target.idle_books(), target.stats(), target.records_since(clock or 0.0)
        delta = {k: now[k] - before[k] for k in ("releases", "late_events", "errors")}
        finished = sum(now["finishes"].values()) - sum(before["finishes"].values())
        admitted = sum(r["first_token_sampled"] is not None for r in runs)
        extra = {"late_events": delta["late_events"], "admitted": admitted}
        checks = {"cache whole": b["cache_whole"], "nothing held": b["held_blocks"] == 0, "nothing running or waiting":
                  b["running"] == b["waiting"] == 0, "no stream registered": b["open_streams"] == 0,
                  "each stream finished once": finished == len(runs), "one release per admitted stream":
                  delta["releases"] == admitted, "no hub error": delta["errors"] == 0}  # fmt: skip
    elif witness == "stats":
        target.wait_idle(s.timeout)  # bounded: what the books then say is the finding
        st = target.stats()
        checks = {"nothing running or waiting": st["running"] == st["waiting"] == 0,
                  "no stream registered": st["open_streams"] == 0, "nothing held": st["held_blocks"] == 0}  # fmt: skip
    else:
        if witness == "metrics":
            with suppress(WaitTimeout):
                wait_for(lambda: reading(target, witness, 0, 0) == 0, timeout=s.timeout, what="an idle server")
        else:
            time.sleep(s.window_s)  # the last closes land
        after = reading(target, witness, s.window_s, s.follow_tokens)
        back = after == 0 if witness == "metrics" else after <= SLACK * idle + (0.05 if witness == "cpu" else 0.0)
        checks, extra = {f"{witness} back to idle": bool(back)}, {"idle": idle, "after": after}
    failed = [name for name, ok in checks.items() if not ok]
    return {"books_ok": not failed, "books": "; ".join(failed) or f"{len(checks)} checks passed", **extra}


def tables(t: dict[str, pd.DataFrame], s: Sizes) -> dict[str, pd.DataFrame]:
    cols = ["total_s", "generated_per_read_leavers", "generated_per_read", "left_early", "tokens_read", "late_events"]
    return {"outcome": spread(t["rows"], "response_class", [c for c in cols if c in t["rows"]])}


def verdicts(t: dict[str, pd.DataFrame], s: Sizes) -> list:
    rows = t["rows"]
    bad = rows[~rows.books_ok | (rows.client_errors > 0)]
    out = [judge("nothing leaks", "after every client has come and gone the server's books are back where they "
                 "started: every block, reservation and stream given back exactly once", "any check fails in any run, "
                 "or any client saw an error", bad.empty, "; ".join(f"{r.response_class} run {r.repetition}: {r.books}"
                 for r in bad.itertuples()) or f"{len(rows)} runs, witness: {', '.join(rows.witness.unique())}",
                 checked=True)]  # fmt: skip
    if set(rows.response_class) >= {"starlette", "write_only"}:
        by = rows.pivot_table(index="repetition", columns="response_class", values="generated_per_read_leavers")
        out.append(judge("listening saves work", "a response that listens makes fewer tokens per token its leaving "
                         "clients read than one that only writes", "in any run, as many or more",
                         bool((by.starlette < by.write_only).all()), "; ".join(f"run {i}: {r.starlette:.2f} vs "
                         f"{r.write_only:.2f}" for i, r in by.iterrows()), checked=True))  # fmt: skip
        times = rows.pivot_table(index="repetition", columns="response_class", values="total_s")
        decided, text = tell(interval(times.write_only.to_numpy(), others=times.starlette.to_numpy()), 1.0, "above")
        out.append(judge("not listening costs time", "the write-only class takes longer for the same plan",
                         "the 95% interval of write-only over Starlette's time lies below 1", decided,
                         f"ratio {text}"))  # fmt: skip
    return out


_FULL = {"classes": CLASSES, "streams": 60, "concurrency": 48, "max_batch": 8, "tokens": 44, "share_full": 0.35,
         "share_early": 0.5, "early_range": (0, 40), "slow_leave_after": (3, 10), "slow_pace_s": 0.25, "window_s": 1.0,
         "follow_tokens": 12, "seed": 7, "timeout": 300.0, "repetitions": 6}  # fmt: skip
PLAN = Experiment(
    name="leak.plan",
    title="Many clients leaving every way a client can, then the server's books",
    sizes={"full": _FULL, "ci": _FULL | {"streams": 40, "concurrency": 12, "max_batch": 4, "tokens": 48,
           "slow_pace_s": 0.05, "window_s": 0.5, "follow_tokens": 8, "timeout": 120.0, "repetitions": 3}},
    conditions=class_conditions,
    server=lambda s, c: {**server(s, c), "max_waiting": None},
    measure=measure,
    tables=tables,
    verdicts=verdicts,
    chapter={"streams": (int(published("leak")["streams"]), "six runs of each class (an interval for the time) "
                         "within the notebook's time"),
             "tokens": ("not stated", "each stream's limit; the early leavers leave within it"),
             "repetitions": (1, "interleaved runs give the time comparison an interval")},
)  # fmt: skip

SPECS = (PLAN,)
