"""Experiment ``deadline``: goodput against offered load, with the deadline gate and without.

The machine sets the scale, so the run measures it first (a calibration): the median latency of
a request served alone, ``solo_s``. The deadline is ``deadline_factor`` times that, and the
offered rates are ``loads`` times the capacity it suggests (``max_batch / solo_s`` requests per
second; a full batch steps more slowly than one request, so the real capacity is lower and the
top load is well past it). Every request carries the same ``deadline_s`` and asks for ``max_new_tokens`` tokens with
``ignore_eos`` (so every request costs the same number of steps, and the gate's assumption that
a request runs to its limit is exact). Requests arrive as a Poisson process at each of a few
rates for ``window_s`` seconds; a client gives up at its deadline and closes the connection, as
a client with a deadline does. Goodput is the requests that finished within their deadline per
second of offered load.

Two servers share one loaded model and differ only in ``deadline_gate``: on, a request predicted
to miss is refused (429) before the first byte; off, the gate still predicts (a shadow gate, read
back from ``GET /lab/deadline``) but admits everything. Each repetition offers the very same
arrival times to both, and repetitions are interleaved (rate by rate, gate on then off, then the
next repetition), so the two are compared on one run of the machine.

The gate's promise is tested twice. Probes, which hold on any machine: a request behind a batch
full of much longer requests, with a deadline of one solo latency, certainly misses; the gate
must refuse it, and without the gate it must indeed miss; a request on an idle server with ten
solo latencies to spare must be admitted and finish in time. And under load, statistically: of
the requests the shadow gate would have refused, how many did in fact miss their deadline?
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from dataclasses import dataclass
from typing import Any

import httpx
import pandas as pd

from labkit.experiments.client import async_client, run_sync
from labkit.experiments.profiles import Profile
from labkit.experiments.progress import Progress, doing, tick
from labkit.experiments.readings import Verdict, fetch_steps, interleaved, span, spread
from labkit.experiments.servers import loaded_model, server_like
from labkit.experiments.waiting import WaitTimeout, wait_for
from labkit.prompts import PROMPTS
from labkit.sse import SSEParser

NAME = "deadline"
GATES = (True, False)
OUTCOMES = ("met", "missed", "refused", "error")
PRECISION_FLOOR = 0.9  # share of would-be refusals that must have missed for the gate to be right


@dataclass(frozen=True)
class Config:
    model: str = "smollm2-135m"
    loads: tuple[float, ...] = (0.25, 0.75, 2.0)  # offered rate / (max_batch / solo_s): under, near, over
    window_s: float = 2.0  # seconds of arrivals per run
    deadline_factor: float = 3.0  # deadline = this many times a request's latency served alone
    max_new_tokens: int = 16
    max_batch: int = 8
    repetitions: int = 3
    seed: int = 5

    @classmethod
    def for_profile(cls, profile: Profile) -> Config:
        if profile.full:
            return cls(model=profile.model)
        return cls(
            model=profile.model,
            window_s=0.5,
            max_new_tokens=16,
            max_batch=4,
        )

    def __post_init__(self) -> None:
        if not self.loads or min(self.loads) <= 0:
            raise ValueError(f"deadline.Config.loads must be positive, got {self.loads!r}")
        for name in ("window_s", "deadline_factor"):
            if not getattr(self, name) > 0:
                raise ValueError(f"deadline.Config.{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("max_new_tokens", "max_batch", "repetitions"):
            if getattr(self, name) < 1:
                raise ValueError(f"deadline.Config.{name} must be >= 1, got {getattr(self, name)!r}")


def server_options(config: Config) -> dict[str, Any]:
    return {"model": config.model, "max_batch": config.max_batch}


def units(config: Config) -> int:
    return 2 + len(config.loads) * len(GATES) * config.repetitions


def arrivals(rate: float, window_s: float, seed: int) -> list[float]:
    """Poisson arrival offsets (seconds) in ``[0, window_s)``: exponential gaps of mean ``1/rate``."""
    rng, t = random.Random(seed), 0.0
    out: list[float] = []
    while True:
        t += rng.expovariate(rate)
        if t >= window_s:
            return out
        out.append(t)


def run(config: Config, *, server: Any = None, progress: Progress | None = None) -> dict[str, pd.DataFrame]:
    model = loaded_model(server, config.model)
    settings = {"max_batch": config.max_batch}
    with (
        server_like(server, model, deadline_gate=True, **settings) as gated,
        server_like(None, model, deadline_gate=False, **settings) as open_,
    ):
        servers = {True: gated, False: open_}
        doing(progress, "calibration: a request served alone, on each server")
        solo = {gate: _solo(srv.url, config) for gate, srv in servers.items()}
        marks = {gate: _step(srv.url) for gate, srv in servers.items()}
        calibration = calibration_table(config, solo)
        deadline_s = float(calibration.deadline_s.iloc[0])
        rates = dict(zip(calibration.load, calibration.rate))
        tick(progress)
        probes: list[dict[str, Any]] = []
        for rep, (probe, gate) in interleaved(PROBES, config.repetitions):
            doing(progress, f"probe: {probe}, gate {'on' if gate else 'off'}, repetition {rep + 1}")
            result = run_sync(_probe(servers[gate].url, config, probe, float(calibration.solo_s.iloc[0])))
            probes.append({"probe": probe, "gate": gate, "repetition": rep, **result})
            _wait_idle(servers[gate].url)
        tick(progress)
        rows: list[dict[str, Any]] = []
        plan = [(load, gate) for load in config.loads for gate in GATES]
        for rep, (load, gate) in interleaved(plan, config.repetitions):
            rate = rates[load]
            doing(progress, f"{rate:.1f} req/s, gate {'on' if gate else 'off'}, repetition {rep + 1}")
            offsets = arrivals(rate, config.window_s, config.seed + 1000 * rep + config.loads.index(load))
            found = run_sync(_offer(servers[gate].url, config, deadline_s, offsets))
            rows += [{"gate": gate, "load": load, "rate": rate, "repetition": rep, **r} for r in found]
            _wait_idle(servers[gate].url)
            tick(progress, requests=rows)
        readings = {gate: _readings(srv.url) for gate, srv in servers.items()}
        steps = pd.concat(
            [fetch_steps(srv.url, marks[gate]).assign(gate=gate) for gate, srv in servers.items()], ignore_index=True
        )
    requests = pd.DataFrame(rows)
    runs = runs_table(requests, config)
    return {
        "calibration": calibration,
        "probes": pd.DataFrame(probes),
        "requests": requests,
        "runs": runs,
        "goodput": spread(runs, ["load", "rate", "gate"], ["goodput", "met", "missed", "refused"]),
        "shadow": shadow_table(requests, readings[False]),
        "steps": steps,
    }


# --------------------------------------------------------------------------- probes

#: (probe, gate): a request that certainly misses, with the gate and without (the counterfactual),
#: and one with ample room, with the gate.
PROBES = (("certain miss", True), ("certain miss", False), ("ample room", True))
FILLER_FACTOR = 4  # filler requests ask for this many times the probe's tokens
AMPLE_FACTOR = 10  # the ample probe's deadline, in solo latencies


async def _probe(url: str, config: Config, probe: str, solo_s: float) -> dict[str, Any]:
    """One probe request. ``certain miss``: every batch slot is first taken by a filler with
    ``FILLER_FACTOR`` times the probe's tokens, and the probe's deadline is one solo latency, so it
    must wait many times its own run for a slot. ``ample room``: an idle server and a deadline of
    ``AMPLE_FACTOR`` solo latencies. The fillers' clients leave once the probe is settled."""
    certain = probe == "certain miss"
    deadline_s = solo_s if certain else AMPLE_FACTOR * solo_s
    async with async_client(url, connections=config.max_batch + 2) as client:
        fillers: list[asyncio.Future] = []
        if certain:
            started = [asyncio.Event() for _ in range(config.max_batch)]
            body = {**_body(config, 0), "max_new_tokens": FILLER_FACTOR * config.max_new_tokens}
            fillers = [asyncio.ensure_future(_fill(client, body, e)) for e in started]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), timeout=120)
        try:
            row = await _arrive(client, config, deadline_s, 0, time.perf_counter(), 0.0)
        finally:
            for filler in fillers:
                filler.cancel()
            await asyncio.gather(*fillers, return_exceptions=True)
    return {
        "deadline_s": deadline_s,
        "outcome": row["outcome"],
        "latency_s": row["latency_s"],
        "retry_after": row.get("retry_after"),
    }


async def _fill(client: httpx.AsyncClient, body: dict[str, Any], started: asyncio.Event) -> None:
    """A long stream that holds a batch slot; ``started`` is set at its first token."""
    async with client.stream("POST", "/v1/stream", json=body) as response:
        parser = SSEParser()
        async for chunk in response.aiter_raw():
            if any(e.event == "token" for e in parser.feed(chunk)):
                started.set()


# --------------------------------------------------------------------------- one run


def _body(config: Config, i: int, deadline_s: float | None = None) -> dict[str, Any]:
    body = {"prompt": PROMPTS[i % len(PROMPTS)], "max_new_tokens": config.max_new_tokens, "ignore_eos": True}
    return body if deadline_s is None else {**body, "deadline_s": deadline_s}


async def _offer(url: str, config: Config, deadline_s: float, offsets: list[float]) -> list[dict[str, Any]]:
    async with async_client(url, connections=max(8, len(offsets))) as client:
        t0 = time.perf_counter()
        tasks = [asyncio.ensure_future(_arrive(client, config, deadline_s, i, t0, t)) for i, t in enumerate(offsets)]
        return list(await asyncio.gather(*tasks))


async def _arrive(
    client: httpx.AsyncClient, config: Config, deadline_s: float, i: int, t0: float, offset: float
) -> dict[str, Any]:
    await asyncio.sleep(max(0.0, t0 + offset - time.perf_counter()))
    sent = time.perf_counter()
    row: dict[str, Any] = {
        "request": i,
        "offset_s": offset,
        "sent_s": sent - t0,
        "status": None,
        "request_id": None,
        "tokens": 0,
    }
    try:
        async with asyncio.timeout(deadline_s):  # the client gives up at its deadline
            await _read(client, _body(config, i, deadline_s), row)
    except TimeoutError:
        row["outcome"] = "missed"
    except httpx.HTTPError as exc:
        row["outcome"], row["error"] = "error", type(exc).__name__
    row["latency_s"] = time.perf_counter() - sent if row.get("outcome") == "met" else None
    return row


async def _read(client: httpx.AsyncClient, body: dict[str, Any], row: dict[str, Any]) -> None:
    async with client.stream("POST", "/v1/stream", json=body) as response:
        row["status"] = response.status_code
        if response.status_code != 200:
            kind = _error_type(await response.aread())
            row["outcome"] = "refused" if kind == "deadline_unreachable" else "error"
            row["retry_after"] = response.headers.get("retry-after")
            return
        row["request_id"] = response.headers.get("x-request-id")
        parser = SSEParser()
        async for chunk in response.aiter_raw():
            for event in parser.feed(chunk):
                if event.event == "token":
                    row["tokens"] += 1
                elif event.event in ("done", "error"):
                    row["outcome"] = "met" if event.event == "done" else "error"
                    return
    row["outcome"] = "error"  # the stream ended without its done


def _error_type(body: bytes) -> str | None:
    with contextlib.suppress(ValueError, KeyError, TypeError):
        return json.loads(body)["error"]["type"]
    return None


SOLO_RUNS = 3


def _solo(url: str, config: Config) -> float:
    """Median latency of a request served alone (no deadline); it also gives the gate its first
    steps to predict with. The first request (a warm-up) is not counted."""
    times = []
    with httpx.Client(base_url=url, timeout=120, trust_env=False) as client:
        for i in range(SOLO_RUNS + 1):
            sent = time.perf_counter()
            client.post("/v1/generate", json=_body(config, i)).raise_for_status()
            times.append(time.perf_counter() - sent)
    return float(pd.Series(times[1:]).median())


def _step(url: str) -> int:
    """The server's current engine step: the run's steps are those after it."""
    r = httpx.get(f"{url}/lab/steps", params={"since": 10**12}, timeout=10, trust_env=False)
    return int(r.json()["step"])


def calibration_table(config: Config, solo: dict[bool, float]) -> pd.DataFrame:
    """The run's scale: solo latency (the slower of the two servers'), the deadline and each load's rate."""
    solo_s = max(solo.values())
    capacity = config.max_batch / solo_s
    return pd.DataFrame(
        [
            {
                "load": load,
                "rate": load * capacity,
                "solo_s": solo_s,
                "deadline_s": config.deadline_factor * solo_s,
                "max_batch": config.max_batch,
                "max_new_tokens": config.max_new_tokens,
            }
            for load in config.loads
        ]
    )


def _wait_idle(url: str, timeout: float = 30.0) -> None:
    """Until the server holds no stream and no request (over HTTP, bounded)."""
    with httpx.Client(base_url=url, timeout=10, trust_env=False) as client:

        def idle() -> bool:
            s = client.get("/stats").json()
            return s["open_streams"] == 0 and s["waiting"] == 0 and s["running"] == 0

        with contextlib.suppress(WaitTimeout):  # at the bound the next load starts anyway
            wait_for(idle, timeout=timeout, what="an idle server")


def _readings(url: str) -> pd.DataFrame:
    r = httpx.get(f"{url}/lab/deadline", timeout=10, trust_env=False)
    r.raise_for_status()
    cols = ["request_id", "deadline_s", "predicted_s", "steps", "step_s", "refused"]
    return pd.DataFrame(r.json()["readings"], columns=cols)


# --------------------------------------------------------------------------- tables


def runs_table(requests: pd.DataFrame, config: Config) -> pd.DataFrame:
    """One row per run: offered requests, each outcome's count, and goodput (met per second)."""
    counts = requests.groupby(["load", "rate", "gate", "repetition"])["outcome"].value_counts().unstack(fill_value=0)
    for outcome in OUTCOMES:
        if outcome not in counts:
            counts[outcome] = 0
    runs = counts[list(OUTCOMES)].reset_index()
    runs.columns.name = None
    runs["offered"] = runs[list(OUTCOMES)].sum(axis=1)
    runs["goodput"] = runs.met / config.window_s
    return runs


def shadow_table(requests: pd.DataFrame, readings: pd.DataFrame) -> pd.DataFrame:
    """The ungated server's predictions beside what happened: ``would_refuse`` (predicted past
    the deadline) against ``outcome``."""
    admitted = requests[(~requests.gate) & requests.request_id.notna()]
    joined = admitted.merge(readings.dropna(subset=["request_id"]), on="request_id", how="inner")
    joined["would_refuse"] = joined.predicted_s > joined.deadline_s
    return joined[
        [
            "load",
            "rate",
            "repetition",
            "request",
            "predicted_s",
            "deadline_s",
            "steps",
            "step_s",
            "would_refuse",
            "outcome",
            "latency_s",
        ]
    ]


def _at(goodput: pd.DataFrame, rate: float, gate: bool, col: str) -> float:
    row = goodput[(goodput.rate == rate) & (goodput.gate == gate)]
    return float(row[col].iloc[0]) if len(row) else float("nan")


def summary(tables: dict[str, pd.DataFrame]) -> dict[str, Any]:
    goodput, shadow, runs = tables["goodput"], tables["shadow"], tables["runs"]
    top = float(goodput.rate.max())
    would = shadow[shadow.would_refuse]
    gated = runs[runs.gate]
    admitted = int(gated.met.sum() + gated.missed.sum())
    return {
        "overload_rate": top,
        "goodput_gate_median": _at(goodput, top, True, "goodput_median"),
        "goodput_no_gate_median": _at(goodput, top, False, "goodput_median"),
        "would_refuse": int(len(would)),
        "would_refuse_missed": int((would.outcome != "met").sum()),
        "admitted_with_gate": admitted,
        "admitted_with_gate_met": int(gated.met.sum()),
        "refused": int(gated.refused.sum()),
        "errors": int(runs.error.sum()),
    }


def verdicts(tables: dict[str, pd.DataFrame]) -> list[Verdict]:
    goodput, shadow, runs = tables["goodput"], tables["shadow"], tables["runs"]
    top = float(goodput.rate.max())
    would = shadow[shadow.would_refuse]
    missed = int((would.outcome != "met").sum())
    share = missed / len(would) if len(would) else float("nan")
    gated = runs[runs.gate]
    admitted = int(gated.met.sum() + gated.missed.sum())
    on = runs[(runs.rate == top) & runs.gate].goodput
    off = runs[(runs.rate == top) & ~runs.gate].goodput
    probes = tables["probes"]

    def outcomes(probe: str, gate: bool) -> list[str]:
        return list(probes[(probes.probe == probe) & (probes.gate == gate)].outcome)

    on_miss, off_miss, ample = (
        outcomes("certain miss", True),
        outcomes("certain miss", False),
        outcomes("ample room", True),
    )
    return [
        Verdict(
            "the gate refuses only what would miss its deadline",
            "a request that cannot finish in time is refused, and without the gate it does miss; "
            "one with room to spare is admitted and finishes in time",
            "a certain-miss probe is admitted by the gate or meets its deadline without it, "
            "or an ample-room probe is refused or misses",
            bool(on_miss and off_miss and ample)
            and set(on_miss) == {"refused"}
            and set(off_miss) == {"missed"}
            and set(ample) == {"met"},
            f"certain miss with the gate: {', '.join(on_miss)}; without: {', '.join(off_miss)}; "
            f"ample room with the gate: {', '.join(ample)}",
        ),
        Verdict(
            "under load, what the gate would refuse does miss",
            "a request the gate predicts to finish after its deadline does miss it when admitted",
            f"fewer than {PRECISION_FLOOR:.0%} of the requests the (shadow) gate would have refused "
            "missed their deadline on the server without the gate, or it would have refused none",
            bool(len(would)) and share >= PRECISION_FLOOR,
            f"{missed} of {len(would)} would-be refusals missed their deadline; with the gate on, "
            f"{int(gated.met.sum())} of {admitted} admitted requests met it and "
            f"{int(gated.refused.sum())} were refused",
        ),
        Verdict(
            "goodput with the gate ≥ without at overload",
            "refusing what cannot make it frees steps for what can",
            "at the highest offered load the median goodput with the gate is below the median without it",
            bool(len(on) and len(off)) and on.median() >= off.median(),
            f"at {top:.1f} req/s offered: {span(on, '{:.2f}', ' req/s')} with the gate, "
            f"{span(off, '{:.2f}', ' req/s')} without ({len(on)} repetitions each)",
        ),
    ]


def report(tables: dict[str, pd.DataFrame]) -> str:
    """The verdict lines (no numbers)."""
    from labkit.experiments.readings import verdict_lines

    return verdict_lines(verdicts(tables))


# --------------------------------------------------------------------------- plots


def plot(tables: dict[str, pd.DataFrame]) -> list:
    from labkit.plots import new_figure

    goodput, runs, shadow = tables["goodput"], tables["runs"], tables["shadow"]
    fig, (left, middle, right) = new_figure("deadline_goodput", ncols=3)
    for gate, color in ((True, "tab:blue"), (False, "tab:orange")):
        g = goodput[goodput.gate == gate].sort_values("rate")
        err = [g.goodput_median - g.goodput_min, g.goodput_max - g.goodput_median]
        left.errorbar(
            g.rate,
            g.goodput_median,
            yerr=err,
            marker="o",
            capsize=3,
            color=color,
            label=f"gate {'on' if gate else 'off'}",
        )
    top = goodput.rate.max()
    left.plot([0, top], [0, top], color="lightgray", linestyle=":", label="every request met")
    left.set(xlabel="offered load (requests/s)", ylabel="goodput (met deadline /s)", title="Goodput (median, min–max)")
    left.legend(loc="upper left")
    _plot_outcomes(middle, runs)
    _plot_shadow(right, shadow)
    return [fig]


def _plot_outcomes(ax: Any, runs: pd.DataFrame) -> None:
    colors = {"met": "tab:green", "missed": "tab:red", "refused": "tab:gray", "error": "black"}
    by = runs.groupby(["rate", "gate"])[list(OUTCOMES)].median().reset_index()
    labels = [f"{r:.1f}\n{'on' if g else 'off'}" for r, g in zip(by.rate, by.gate)]
    bottom = pd.Series(0.0, index=by.index)
    for outcome in OUTCOMES:
        ax.bar(labels, by[outcome], bottom=bottom, color=colors[outcome], label=outcome)
        bottom += by[outcome]
    ax.set(xlabel="req/s, gate", ylabel="requests per run (median)", title="What became of the requests")
    ax.legend(loc="upper left")


def _plot_shadow(ax: Any, shadow: pd.DataFrame) -> None:
    if shadow.empty:
        ax.set(title="No shadow predictions")
        return
    deadline = float(shadow.deadline_s.iloc[0])
    met = shadow[shadow.outcome == "met"]
    late = shadow[shadow.outcome != "met"]
    ax.scatter(met.predicted_s, met.latency_s, s=12, color="tab:green", label="met (actual finish)")
    ax.scatter(
        late.predicted_s,
        [deadline] * len(late),
        s=12,
        marker="x",
        color="tab:red",
        label="missed (client gave up at the deadline)",
    )
    ax.axvline(deadline, color="gray", linestyle="--", label="deadline: the gate refuses right of it")
    ax.axhline(deadline, color="gray", linestyle=":")
    ax.set(
        xlabel="predicted finish (s from arrival)",
        ylabel="finish seen by the client (s)",
        title="Without the gate: prediction vs outcome",
    )
    ax.legend(loc="lower right", fontsize="small")
