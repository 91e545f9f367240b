"""Notebook 08's deadline gate (the chapter's exercise 5): what cannot finish by its deadline is refused
before the first byte, so the engine's steps go to requests that still can.

:data:`GATE` probes what holds on any machine: behind a batch of far longer requests, one with a
deadline of one solo latency must be refused (and, without the gate, miss); on an idle server, one
with ample time must be met. :data:`GOODPUT` offers ``requests`` Poisson arrivals above the service
rate measured in the same run (requests finished per second with the batch kept full), each with a
deadline of ``deadline_factor`` solo latencies, to the servers with and without the gate on the same
arrival times; offered load and goodput are both in units of that rate.
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

from labkit.lab import Experiment, ReadOptions, Stream, Trial, interval, judge, side, tell
from labkit.lab.client import async_client, run_sync
from labkit.lab.witness import until
from labkit.prompts import PROMPTS

OUTCOMES = ("met", "missed", "refused", "error")
#: a certain miss waits behind a full batch of requests this many times as long as itself, so that
#: the gate's prediction is about (FILL + 1)x its deadline: a step-time estimate off by less than
#: that cannot admit it (with 4, i.e. 5x, a loaded CI run once saw a gate-on probe missed)
FILL = 8


async def cancel(tasks: list[Any]) -> None:
    """Cancel ``tasks`` (their clients leave) and wait until each has ended."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def gate_server(s: Any, c: dict[str, Any]) -> dict[str, Any]:
    return {"max_batch": s.max_batch, "deadline_gate": c["gate"]}


def calibrate(target: Any, s: Any, rate: bool = False) -> dict[str, float]:
    """On the server without the gate: a request's latency alone (median of three after a warm-up),
    and with ``rate`` the service rate, requests finished per second of 3 × max_batch sent at once."""
    server = target.variant(**gate_server(s, {"gate": False}))
    solo = statistics.median([server.read(server.request(PROMPTS[i], s.tokens)).duration for i in range(4)][1:])
    if not rate:
        return {"solo_s": solo}
    full = server.launch([server.request(PROMPTS[i % len(PROMPTS)], s.tokens) for i in range(3 * s.max_batch)])
    return {"solo_s": solo, "service_rate": len(full.streams) / full.makespan}


async def ask(target: Any, client: Any, s: Any, i: int, deadline_s: float) -> Stream:
    """One request with ``deadline_s``; its client leaves (closes) at the deadline."""
    request = target.request(PROMPTS[i % len(PROMPTS)], s.tokens, deadline_s=round(deadline_s, 3))
    return await target.stream(request, ReadOptions(leave_after_s=deadline_s, drain_after_fin_s=0.0), client=client)


def outcome(st: Stream, deadline_s: float) -> str:
    error = st.body.get("error") if isinstance(st.body, dict) else None
    if st.status == 429 and isinstance(error, dict) and error.get("type") == "deadline_unreachable":
        return "refused"
    return "met" if st.ok and (st.duration or 0) <= deadline_s else "missed" if st.left or st.ok else "error"


def measure_gate(trial: Trial) -> dict[str, Any]:
    target, s, solo, certain = trial.target, trial.sizes, trial.state["solo_s"], trial.probe == "certain miss"
    deadline_s = solo * (1 if certain else s.ample_factor)

    async def probe() -> Stream:  # a certain miss waits behind a full batch of requests FILL times as long
        fill = [Stream(api=target.api) for _ in range(s.max_batch if certain else 0)]
        async with async_client(target.url, s.max_batch + 1) as client:
            tasks = [asyncio.ensure_future(target.stream(target.request(PROMPTS[i], FILL * s.tokens), client=client,
                                                         result=f)) for i, f in enumerate(fill)]  # fmt: skip
            try:
                await until(lambda: all(f.tokens or f.ended for f in fill), timeout=120, what="every slot filled")
                return await ask(target, client, s, 0, deadline_s)
            finally:
                await cancel(tasks)

    before = {tuple(r.items()) for r in target.deadline_readings()}
    st = run_sync(probe())
    target.wait_idle()
    new = [r for r in target.deadline_readings() if tuple(r.items()) not in before]  # the fill carries no deadline
    reading = new[0] if len(new) == 1 else {"predicted_s": None, "refused": None}  # none: it never reached the gate
    return {"outcome": outcome(st, deadline_s), "seconds": st.duration, "solo_s": solo,
            "predicted_s": reading["predicted_s"], "gate_refused": reading["refused"]}  # fmt: skip


def gate_verdicts(t: dict[str, pd.DataFrame], s: Any) -> list:
    seen = {(p, g): sorted(set(d.outcome)) for (p, g), d in t["rows"].groupby(["probe", "gate"])}
    want = {("certain miss", True): ["refused"], ("certain miss", False): ["missed"], ("ample room", True): ["met"]}
    return [judge("the gate refuses only what would miss", "a request that cannot finish in time is refused, and "
                  "without the gate it does miss; one with room to spare is admitted and met", "a certain miss "
                  "admitted by the gate or met without it, or an ample-room request refused or missed", seen == want,
                  "; ".join(f"{p}, gate {'on' if g else 'off'}: {', '.join(o)}" for (p, g), o in seen.items()),
                  checked=True)]  # fmt: skip


GATE = Experiment(
    name="production.gate", title="The deadline gate on requests that certainly miss, and on ones with room to spare",
    sizes={p: {"max_batch": b, "tokens": n, "ample_factor": 10.0, "repetitions": 3}
           for p, b, n in (("full", 8, 16), ("ci", 4, 48))},
    conditions=lambda s, target: [{"probe": "certain miss", "gate": True}, {"probe": "certain miss", "gate": False},
                                  {"probe": "ample room", "gate": True}],
    server=gate_server, prepare=calibrate, measure=measure_gate, verdicts=gate_verdicts, needs=("settings", "lab"),
)  # fmt: skip


def measure_goodput(trial: Trial) -> dict[str, Any]:
    """One run at this repetition's load (``loads`` taken in turn); both gates get the same arrivals."""
    target, s, rate = trial.target, trial.sizes, trial.state["service_rate"]
    load = float(s.loads[trial.repetition % len(s.loads)])
    deadline, rng = s.deadline_factor * trial.state["solo_s"], random.Random(s.seed + trial.repetition)
    offsets = np.cumsum([rng.expovariate(load * rate) for _ in range(s.requests)])
    if trial.gate:  # the gate predicts from the last deadline_window steps: this moment's, not the last run's
        target.read(target.request(PROMPTS[0], s.prime_tokens))

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
    window = (sent[-1] - sent[0]) * len(sent) / (len(sent) - 1)  # the arrivals' span, one mean gap longer
    counts = Counter(outcome(st, deadline) for st in streams)
    return {"load": load, "offered": len(sent) / window / rate, "goodput": counts["met"] / window / rate,
            "deadline_s": deadline, "service_rate": rate, **{k: counts[k] for k in OUTCOMES}}  # fmt: skip


def goodput_tables(t: dict[str, pd.DataFrame], s: Any) -> dict[str, pd.DataFrame]:
    """Each repetition's pair on the same arrivals: goodput with the gate and without, and their ratio,
    (met + ½) over (met + ½), which stays finite where one side met none."""
    by = t["rows"].pivot_table(index=["repetition", "load"], columns="gate", values=["goodput", "met"])
    ratio = (side(by, ("met", True)) + 0.5) / (side(by, ("met", False)) + 0.5)
    pairs = pd.DataFrame(
        {"gate_on": side(by, ("goodput", True)), "gate_off": side(by, ("goodput", False)), "ratio": ratio}
    )
    return {"pairs": pairs.reset_index()}


def goodput_verdicts(t: dict[str, pd.DataFrame], s: Any) -> list:
    ratios = t["pairs"].ratio
    decided, evidence = tell(interval(ratios.to_numpy()), 1.0, "above")
    return [judge("the gate raises goodput above the service rate", f"offered a nominal {min(s.loads):g} to {max(s.loads):g} "
                  "times the service rate, more requests meet their deadline per second with the gate than without",
                  "the 95% interval of the paired ratio (gate on over off) lies below 1", decided,
                  f"ratio {evidence}; per pair {', '.join(f'{r:.2f}' for r in ratios)}")]  # fmt: skip


def goodput_plots(t: dict[str, pd.DataFrame], s: Any) -> list:
    from labkit.plots import new_figure

    rows = t["rows"]
    fig, (ax,) = new_figure("production_goodput")
    for rep, pair in rows.groupby("repetition"):
        ax.plot(pair.offered, pair.goodput, color="0.8", zorder=1, label="one repetition's pair" if rep == 0 else None)
    for gate, g in rows.groupby("gate"):
        ax.scatter(g.offered, g.goodput, s=20, zorder=2, label=f"gate {'on' if gate else 'off'}: one run each")
    top = float(rows.offered.max())
    ax.plot([0, top], [0, top], color="0.6", linestyle=":", label="every offered request met")
    ax.set(xlabel="offered (arrivals per second / service rate)", ylabel="goodput (met per second / service rate)",
           title="Goodput against the load each run offered")  # fmt: skip
    ax.legend(fontsize="small")
    return [fig]


GOODPUT = Experiment(
    name="production.goodput", title="Goodput above the service rate, with the deadline gate and without",
    sizes={p: {"loads": (1.5, 2.0, 3.0), "requests": 24, "deadline_factor": 3.0, "max_batch": b, "tokens": n,
               "prime_tokens": 40, "repetitions": 6, "seed": 5} for p, b, n in (("full", 8, 16), ("ci", 4, 48))},
    conditions=lambda s, target: [{"gate": True}, {"gate": False}], server=gate_server,
    prepare=lambda target, s: calibrate(target, s, rate=True), measure=measure_goodput, tables=goodput_tables,
    verdicts=goodput_verdicts, plots=goodput_plots, needs=("settings",),
)  # fmt: skip
