"""Notebook 08's deadline gate (the chapter's exercise 5): refuse, before the first byte, what cannot
finish by its deadline, so the engine's steps go to requests that still can.

* :data:`GATE`: probes that hold on any machine: a request behind a batch of far longer ones with a
  deadline of one solo latency certainly misses (the gate must refuse it; without the gate it must
  miss); one on an idle server with many solo latencies to spare must be admitted and met.
* :data:`GOODPUT`: ``requests`` Poisson arrivals at multiples of the service rate measured in the
  same run (requests finished per second with the batch kept full), each with a deadline of
  ``deadline_factor`` solo latencies; the gate on and off get the same arrival times, interleaved.
  A client gives up at its deadline. Goodput (met per second of arrivals) and the offered load
  are both in units of the service rate, so neither depends on the engine's speed.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from collections import Counter
from typing import Any

import numpy as np
import pandas as pd

from labkit.lab import Experiment, ReadOptions, Stream, Trial, interval, judge, span, spread, tell
from labkit.lab.client import async_client, run_sync
from labkit.lab.witness import until
from labkit.prompts import PROMPTS

OUTCOMES = ("met", "missed", "refused", "error")
FILL, AMPLE = 4, 10  # fillers ask FILL times the probe's tokens; the ample probe has AMPLE solo latencies


async def cancel(tasks: list[Any]) -> None:
    """Cancel ``tasks`` (their clients leave) and wait until each has ended."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def gate_server(s: Any, c: dict[str, Any]) -> dict[str, Any]:
    return {"max_batch": s.max_batch, "deadline_gate": c["gate"]}


def calibrate(target: Any, s: Any) -> dict[str, float]:
    """On the server without the gate: a request's latency alone (median of three after a warm-up),
    and the service rate, requests finished per second with 3 × max_batch sent at once."""
    server = target.variant(**gate_server(s, {"gate": False}))
    solo = [server.read(server.request(PROMPTS[i], s.tokens)).duration for i in range(4)][1:]
    full = server.launch([server.request(PROMPTS[i % len(PROMPTS)], s.tokens) for i in range(3 * s.max_batch)])
    return {"solo_s": statistics.median(solo), "service_rate": len(full.streams) / full.makespan}


async def ask(target: Any, client: Any, s: Any, i: int, deadline_s: float) -> Stream:
    """One request with ``deadline_s``; its client leaves (closes) at the deadline."""
    request = target.request(PROMPTS[i % len(PROMPTS)], s.tokens, deadline_s=round(deadline_s, 3))
    options = ReadOptions(leave_after_s=deadline_s, drain_after_fin_s=0.0, timeout=deadline_s + 60)
    return await target.stream(request, options, client=client)


def outcome(st: Stream, deadline_s: float) -> str:
    refused = isinstance(st.body, dict) and (st.body.get("error") or {}).get("type") == "deadline_unreachable"
    if st.status == 429 and refused:
        return "refused"
    return "met" if st.ok and (st.duration or 0) <= deadline_s else "missed" if st.left or st.ok else "error"


def measure_gate(trial: Trial) -> dict[str, Any]:
    target, s, solo = trial.target, trial.sizes, trial.state["solo_s"]
    certain = trial.probe == "certain miss"

    async def probe() -> Stream:
        fill = [Stream(api=target.api) for _ in range(s.max_batch if certain else 0)]
        async with async_client(target.url, s.max_batch + 1) as client:
            tasks = [asyncio.ensure_future(target.stream(target.request(PROMPTS[i], FILL * s.tokens), client=client,
                                                         result=f)) for i, f in enumerate(fill)]  # fmt: skip
            try:
                await until(lambda: all(f.tokens or f.ended for f in fill), timeout=120, what="every slot filled")
                return await ask(target, client, s, 0, solo if certain else AMPLE * solo)
            finally:
                await cancel(tasks)

    st = run_sync(probe())
    target.wait_idle()
    return {"outcome": outcome(st, solo if certain else AMPLE * solo), "seconds": st.duration, "solo_s": solo}


def gate_verdicts(t: dict[str, pd.DataFrame], s: Any) -> list:
    rows = t["rows"]
    seen = {(p, g): sorted(set(d.outcome)) for (p, g), d in rows.groupby(["probe", "gate"])}
    want = {("certain miss", True): ["refused"], ("certain miss", False): ["missed"], ("ample room", True): ["met"]}
    return [judge("the gate refuses only what would miss", "a request that cannot finish in time is refused, and "
                  "without the gate it does miss; one with room to spare is admitted and met", "a certain miss "
                  "admitted by the gate or met without it, or an ample-room request refused or missed", seen == want,
                  "; ".join(f"{p}, gate {'on' if g else 'off'}: {', '.join(o)}" for (p, g), o in seen.items()),
                  checked=True)]  # fmt: skip


GATE = Experiment(
    name="production.gate",
    title="The deadline gate on requests that certainly miss, and on ones with room to spare",
    sizes={"full": {"max_batch": 8, "tokens": 16, "repetitions": 3}, "ci": {"max_batch": 4, "tokens": 48, "repetitions": 3}},
    conditions=lambda s, target: [{"probe": "certain miss", "gate": True}, {"probe": "certain miss", "gate": False},
                                  {"probe": "ample room", "gate": True}],
    server=gate_server, prepare=calibrate, measure=measure_gate, verdicts=gate_verdicts, needs=("settings",),
)  # fmt: skip


def measure_goodput(trial: Trial) -> dict[str, Any]:
    target, s, rate = trial.target, trial.sizes, trial.state["service_rate"]
    deadline = s.deadline_factor * trial.state["solo_s"]
    rng = random.Random(s.seed + 1000 * trial.repetition + s.loads.index(trial.load))  # the same for both gates
    offsets = np.cumsum([rng.expovariate(trial.load * rate) for _ in range(s.requests)])
    target.read(target.request(PROMPTS[0], s.tokens))  # the gate then predicts with this moment's steps, not a
    # past run's: a gate that refuses everything runs no step, and so never learns that steps got faster

    async def offer() -> list[Stream]:
        async with async_client(target.url, s.requests) as client:
            t0 = time.perf_counter()

            async def one(i: int, at: float) -> Stream:
                await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
                return await ask(target, client, s, i, deadline)

            return list(await asyncio.gather(*(one(i, at) for i, at in enumerate(offsets))))

    streams = run_sync(offer())
    target.wait_idle()
    sent = sorted(st.sent for st in streams)
    window = (sent[-1] - sent[0]) * len(sent) / (len(sent) - 1)  # the arrivals' span, one gap longer
    counts = Counter(outcome(st, deadline) for st in streams)
    return {"offered": len(sent) / window / rate, "goodput": counts["met"] / window / rate, "deadline_s": deadline,
            "service_rate": rate, **{k: counts[k] for k in OUTCOMES}}  # fmt: skip


def goodput_tables(t: dict[str, pd.DataFrame], s: Any) -> dict[str, pd.DataFrame]:
    """Per load, goodput with the gate over without it, repetition by repetition, with its interval."""
    rows = t["rows"]
    by = rows.pivot_table(index=["load", "repetition"], columns="gate", values="goodput")
    ratios = (by[True] / by[False]).rename("ratio").reset_index()
    cis = {load: interval(g.ratio.to_numpy()) for load, g in ratios.groupby("load")}
    effect = pd.DataFrame([{"load": k, "gate_over_no_gate": c.estimate, "ci_low": c.low, "ci_high": c.high, "n": c.n}
                           for k, c in cis.items()])  # fmt: skip
    return {"goodput": spread(rows, ["load", "gate"], ["offered", "goodput", *OUTCOMES]), "effect": effect,
            "ratios": ratios}  # fmt: skip


def goodput_verdicts(t: dict[str, pd.DataFrame], s: Any) -> list:
    top = t["ratios"][t["ratios"].load == max(s.loads)].ratio
    decided, evidence = tell(interval(top.to_numpy()), 1.0, "above")
    return [judge("the gate raises goodput at the top load", f"at {max(s.loads):g} × the service rate, more requests "
                  "meet their deadline per second with the gate than without", "the 95% interval of the paired ratio "
                  "(gate on over off) lies below 1", decided, f"ratio {evidence}; per run {span(top, '{:.2f}')}")]  # fmt: skip


def goodput_plots(t: dict[str, pd.DataFrame], s: Any) -> list:
    from labkit.plots import new_figure

    rows = t["rows"]
    fig, (ax,) = new_figure("production_goodput")
    for gate, g in rows.groupby("gate"):
        ax.scatter(g.offered, g.goodput, s=18, label=f"gate {'on' if gate else 'off'}: one run each")
    top = float(rows.offered.max())
    ax.plot([0, top], [0, top], color="0.6", linestyle=":", label="every request met")
    ax.set(xlabel="offered (arrivals per second / service rate)", ylabel="goodput (met per second / service rate)",
           title="Goodput against the load each run offered")  # fmt: skip
    ax.legend(fontsize="small")
    return [fig]


GOODPUT = Experiment(
    name="production.goodput",
    title="Goodput against offered load, with the deadline gate and without",
    sizes={"full": {"loads": (1.0, 3.0), "requests": 32, "deadline_factor": 3.0, "max_batch": 8, "tokens": 16,
                    "repetitions": 6, "seed": 5},
           "ci": {"loads": (1.0, 3.0), "requests": 32, "deadline_factor": 3.0, "max_batch": 4, "tokens": 48,
                  "repetitions": 6, "seed": 5}},
    conditions=lambda s, target: [{"load": m, "gate": g} for m in s.loads for g in (True, False)],
    server=gate_server, prepare=calibrate, measure=measure_goodput, tables=goodput_tables,
    verdicts=goodput_verdicts, plots=goodput_plots, needs=("settings",),
)  # fmt: skip
