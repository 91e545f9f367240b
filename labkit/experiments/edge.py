"""Notebook 10 without a browser (that half: :mod:`.edge_browser`): :data:`STORM`, a reconnect storm after a
restart; :data:`RESTART`, a resume log that survives one (memory against Redis) and its cost; :data:`THREADS`,
sync generators and AnyIO's thread pool; :data:`GZIP`, GZipMiddleware in front of a stream."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
import zlib
from typing import Any

import httpx
import pandas as pd

from labkit.experiments.edge_browser import AUTH, CLOSE, RULES, SIX
from labkit.lab import Experiment, Process, ReadOptions, Request, Sizes, Stream, Trial
from labkit.lab.client import async_client, read, run_sync
from labkit.lab.components import Components, Redis
from labkit.lab.verdict import every, interval, judge, seen, side, spread, tell
from labkit.service.resume_redis import store_cost

PROMPT = "A restart is a promise that"
TINY = {"model": ("the profile's model", "no model's work is measured here: the tiny one starts fastest")}


def ids(*streams: Stream) -> list[int]:
    return [int(e.id) for s in streams for e in s.events if e.id]


def whole(*streams: Stream) -> bool:
    return ids(*streams) == list(range(1, len(ids(*streams)) + 1))


async def storm(old: Process, s: Sizes, policy: str, restart: Any) -> tuple[list[dict], list[dict], float]:
    """Every client opens its stream, ``restart`` runs, and each resumes until answered from the store.

    Each client has a connection of its own, kept alive after its answer until the storm ends, as a
    browser's is: an answered client holds its slot of the cap for the server's ``idle_timeout``, a
    server setting, so what the cap refuses does not depend on how fast the answers come. (One shared
    pool let a later client reuse an earlier one's connection: a faster server met no cap at all.)"""
    rng, attempts, first, clock = random.Random(s.seed), [], [Stream() for _ in range(s.clients)], dict[str, float]()

    async def client(i: int, http: httpx.AsyncClient) -> dict[str, Any]:
        got = [await read(old.url, old.request(PROMPT, s.tokens, resumable=True), client=http, result=first[i])]
        wait, answer, last = 0.0, got[0], got[0].last_event_id
        for k in range(s.attempts):
            backoff = s.delay_s if policy == "fixed" else rng.uniform(0, min(s.backoff_cap_s, s.delay_s * 2**k))
            await asyncio.sleep(wait + backoff)  # a refusal's Retry-After first, then the policy's delay
            sent = time.perf_counter()
            answer = await read(old.url, old.resume_request(first[i], last), ReadOptions(timeout=30), client=http)
            last = answer.last_event_id or last
            attempts.append({"client": i, "attempt": k, "t": sent - clock["stop"], "status": answer.status})
            got.append(answer)
            if answer.status in (204, 404, 410) or (answer.status == 200 and answer.completed):
                break
            wait = float(answer.headers.get("retry-after", 0)) if answer.status in (429, 503) else 0.0
        ending = [e.event for g in got for e in g.events][-1:]
        return {"whole": whole(*got) and ending == ["error"] and answer.status in (200, 204), "final": answer.status}

    async with contextlib.AsyncExitStack() as stack:
        https = [await stack.enter_async_context(async_client(old.url, 1, 120.0)) for _ in range(s.clients)]
        tasks = [asyncio.ensure_future(client(i, http)) for i, http in enumerate(https)]
        while not all(f.events or f.ended for f in first):  # every stream open (or failed) before the restart
            await asyncio.sleep(0.01)
        clock["stop"] = time.perf_counter()
        await asyncio.to_thread(restart)
        return list(await asyncio.gather(*tasks)), attempts, clock["stop"]


def measure_storm(trial: Trial) -> dict[str, Any]:
    s, common = trial.sizes, {"resume_store": trial.state.redis.url, "max_resumable": trial.sizes.clients, "resumable_share": 1.0}  # fmt: skip
    old = Process.labkit(s.model, max_batch=8, max_waiting=s.clients, max_connections=s.clients + 32, step_delay=0.05,
                         **common)  # fmt: skip
    new, stopped = list[Process](), list[float]()

    def restart() -> None:  # drain, then the same port, the same store, a connection cap below N
        old.stop()
        stopped.append(time.perf_counter())
        new.append(Process.labkit(s.model, port=int(old.url.rsplit(":", 1)[1]), max_connections=s.cap, **common))

    try:
        clients, attempts, start = run_sync(storm(old, s, trial.policy, restart))
    finally:
        for server in (old, *new):
            server.close()
    trial.keep("attempts", attempts)
    a, c = pd.DataFrame(attempts), pd.DataFrame(clients)
    up = a[(a.t >= stopped[0] - start) & (a.status > 0)].t.min()  # the new server's first answer (the old one is gone)
    return {"attempts": len(a), "refused_503": int((a.status == 503).sum()), "no_server": int((a.status == 0).sum()),
            "peak_per_100ms": (a[a.t >= up].t * 10).astype(int).value_counts().max(), "up_s": up,  # NaN: never up
            "last_served_s": a[a.status.isin([200, 204])].t.max() - up, "whole": int(c.whole.sum()),
            "replayed": int((c.final == 200).sum())}  # fmt: skip


def storm_plots(t: dict[str, pd.DataFrame], s: Sizes) -> list:
    from labkit.plots import new_figure

    fig, (ax,) = new_figure("edge_storm", width=8.0)
    for policy, g in t["attempts"][t["attempts"].repetition == 0].groupby("policy"):
        counts = (g.t * 10).astype(int).value_counts().reindex(range(int(g.t.max() * 10) + 1), fill_value=0)
        ax.step(counts.index / 10, counts.to_numpy(), where="post", label=f"{policy}: reconnects")
        ax.axvline(t["rows"].set_index(["policy", "repetition"]).up_s[(policy, 0)], linestyle=":", color="grey")
    ax.set(xlabel="s since the old server was told to stop (dotted: the new one answers)", ylabel="per 100 ms",
           title="A reconnect storm")  # fmt: skip
    ax.legend(fontsize="small")
    return [fig]


def storm_verdicts(t: dict[str, pd.DataFrame], s: Sizes) -> list:
    rows = t["rows"]
    by = rows.pivot_table(index="repetition", columns="policy", values=["peak_per_100ms", "refused_503"])
    fixed, jitter = rows[rows.policy == "fixed"], rows[rows.policy == "jitter"]
    peak, refused = (pd.DataFrame({p: side(by, (what, p)) for p in ("fixed", "jitter")}).dropna()  # both read
                     for what in ("peak_per_100ms", "refused_503"))  # fmt: skip
    return [
        judge("every client whole", "each event once, in order, shutdown last, then Redis's answer", "any client "
              "short of it", every(rows.whole == s.clients), f"whole {seen(rows.whole)} of {s.clients}", checked=True),
        judge("jitter flattens the herd", "its peak per 100 ms after the restart is at most half the fixed one's",
              "above half", every(peak.jitter <= peak.fixed / 2),
              f"fixed {seen(fixed.peak_per_100ms)}, jitter {seen(jitter.peak_per_100ms)}", checked=True),
        judge("jitter meets fewer refusals", f"fewer 503s from the cap of {s.cap}", "as many or more (unclear where "
              "the fixed delay met no refusal: nothing to have fewer of)",
              None if (refused.fixed == 0).any() else every(refused.jitter < refused.fixed),
              f"fixed {seen(fixed.refused_503)}, jitter {seen(jitter.refused_503)}"),
    ]  # fmt: skip


STORM = Experiment(
    name="edge.storm", title="N clients resuming after a restart: a fixed delay against backoff with full jitter",
    sizes={p: {"clients": 200, "cap": 50, "tokens": 400, "delay_s": 0.5, "backoff_cap_s": 8.0, "attempts": 200,
               "model": "tiny-gpt2", "seed": 10, "repetitions": n} for p, n in (("full", 2), ("ci", 1))},
    conditions=lambda s, target: [{"policy": "fixed"}, {"policy": "jitter"}], measure=measure_storm,
    prepare=lambda target, s: Components.start(redis=Redis), verdicts=storm_verdicts, plots=storm_plots, chapter=TINY,
    tables=lambda t, s: {"storm": spread(t["rows"], "policy", ["attempts", "peak_per_100ms", "refused_503", "no_server",
                                                                  "up_s", "last_served_s", "replayed"])},
)  # fmt: skip


class Servers(Components):  # a labkit serve process per resume store, started on first use
    def server(self, store: str, s: Sizes) -> Process:
        if not hasattr(self, store + "_store"):
            url = vars(self)["redis"].url if store == "redis" else "memory"
            setattr(self, store + "_store", Process.labkit(s.model, resume_store=url))
        return getattr(self, store + "_store")


def measure_restart(trial: Trial) -> dict[str, Any]:
    s, server = trial.sizes, trial.state.server(trial.store, trial.sizes)
    away = server.read(server.request(PROMPT, s.tokens, resumable=True), ReadOptions(leave_after_tokens=s.leave_after, leave_by="rst"))  # fmt: skip
    server.restart()  # a run still going is ended by the drain's shutdown error, logged like every event
    back = server.read(server.resume_request(away))
    if trial.store == "redis":
        trial.keep("cost", run_sync(store_cost(trial.state.redis.url, s.cost_events)))
    return {"resume": back.status, "left_at": int(away.last_event_id), "events_after": len(back.events),
            "in_order_once": whole(away, back), "ended_with": back.events[-1].event if back.events else ""}  # fmt: skip


def restart_verdicts(t: dict[str, pd.DataFrame], s: Sizes) -> list:
    rows = t["rows"]
    redis, memory = rows[rows.store == "redis"], rows[rows.store == "memory"]
    return [
        judge("Redis: resumed with nothing lost", "each event once, in order, to its end (done, or the drain's error)",
              "another status, a lost or repeated event", every((redis.resume == 200) & redis.in_order_once
              & redis.ended_with.isin(["done", "error"])), f"ended with {seen(redis.ended_with)}", checked=True),
        judge("memory: forgotten", "the restarted process answers 404", "anything else", every(memory.resume == 404),
              f"statuses {seen(memory.resume)}", checked=True),
    ]  # fmt: skip


RESTART = Experiment(
    name="edge.restart", title="A client away while the server restarts: memory against Redis; the log's cost",
    sizes={p: {"tokens": 64, "leave_after": 8, "cost_events": e, "model": "tiny-gpt2", "repetitions": n}
           for p, e, n in (("full", 2000, 2), ("ci", 500, 1))},
    conditions=lambda s, target: [{"store": "memory"}, {"store": "redis"}], measure=measure_restart,
    prepare=lambda target, s: Servers.start(redis=Redis), verdicts=restart_verdicts, chapter=TINY,
)  # fmt: skip


async def pool(url: str, kind: str, count: int, s: Sizes) -> dict[str, Any]:
    """``count`` slow streams open; then each health route timed while the limiter's books are read."""
    leave, opened, books, took = asyncio.Event(), [Stream() for _ in range(count)], [], {}
    slow = Request(f"/lab/slow/{kind}?n=10000&interval={s.interval_s}", None, method="GET")
    tasks = [asyncio.ensure_future(read(url, slow, ReadOptions(timeout=120), result=r, leave=leave)) for r in opened]
    async with async_client(url, 4, 60.0) as http:
        try:
            while not all(r.events or r.ended for r in opened):
                await asyncio.sleep(0.01)
            before = (await http.get("/lab/threads")).json()
            for route in ("/lab/healthz/sync", "/healthz"):
                sent, health = time.perf_counter(), asyncio.ensure_future(http.get(route))
                while not health.done():
                    books.append((await http.get("/lab/threads")).json()["tasks_waiting"])
                took[route] = 1e3 * (time.perf_counter() - sent)
        finally:
            leave.set()
            await asyncio.gather(*tasks)
            await asyncio.sleep(s.interval_s + 0.25)  # a sync stream's thread comes back when its sleep ends
    return {"sync_health_ms": took["/lab/healthz/sync"], "async_health_ms": took["/healthz"],
            "borrowed": before["borrowed_tokens"], "waiting": max(books, default=0)}  # fmt: skip


def threads_verdicts(t: dict[str, pd.DataFrame], s: Sizes) -> list:
    rows = t["rows"]
    sync, spare = rows[(rows.kind == "sync") & (rows.open >= 40)], rows[(rows.kind == "async") | (rows.open < 40)]
    asynchronous = rows[rows.kind == "async"]
    slower, evidence = tell(interval(sync.sync_health_ms, others=sync.async_health_ms), 5.0, "above")
    return [
        judge("forty sync streams queue a sync route", "all 40 threads borrowed; the sync route waits", "a free "
              "thread, or waits in half or fewer", every(sync.borrowed == 40) and (sync.waiting > 0).mean() > 0.5,
              f"waited in {int((sync.waiting > 0).sum())} of {len(sync)}", checked=True),
        judge("otherwise nothing waits", "fewer sync streams, or async ones: no wait; async streams borrow no token",
              "any wait or token", every(spare.waiting == 0) and every(asynchronous.borrowed == 0),
              f"waits {int((spare.waiting > 0).sum())}; tokens borrowed by async streams {seen(asynchronous.borrowed)}",
              checked=True),
        judge("the sync route pays", "at 40 sync streams, over 5x the async route", "the 95% interval of the ratio "
              "of medians below 5", slower, f"sync/async {evidence}"),
    ]  # fmt: skip


def threads_plots(t: dict[str, pd.DataFrame], s: Sizes) -> list:
    from labkit.plots import new_figure, with_range

    fig, (ax,) = new_figure("edge_threads")
    for kind, g in t["latency"].groupby("kind"):
        with_range(ax, g.open, g, "sync_health_ms", fmt="o-", label=f"sync health route, {kind} streams")
    with_range(ax, g.open, g, "async_health_ms", fmt="s:", label="async health route, sync streams")  # g: sync
    ax.set(xlabel="slow streams open", ylabel="ms to answer", yscale="log", title="A sync generator holds a thread")
    ax.legend(fontsize="small")
    return [fig]


THREADS = Experiment(
    name="edge.threads", title="Sync generators and AnyIO's 40 threads: health routes beside slow streams",
    sizes={p: {"open": (0, 20, 39, 40), "interval_s": 0.5, "repetitions": n} for p, n in (("full", 6), ("ci", 3))},
    conditions=lambda s, target: [{"kind": k, "open": n} for k in ("sync", "async") for n in s.open],
    measure=lambda trial: run_sync(pool(trial.target.url, trial.kind, trial.open, trial.sizes)),
    tables=lambda t, s: {"latency": spread(t["rows"], ["kind", "open"], ["sync_health_ms", "async_health_ms", "waiting"])},
    verdicts=threads_verdicts, plots=threads_plots, needs=("lab",),
)  # fmt: skip


async def probe(url: str, s: Sizes) -> dict[str, Any]:
    """A paced stream read raw with ``Accept-Encoding: gzip``, inflated as it comes (when did each
    whole event arrive?); and whether a plain answer (``/metrics``, a few KiB of text) came compressed."""
    arrived: list[float] = []
    async with httpx.AsyncClient(base_url=url, trust_env=False, timeout=60, headers={"Accept-Encoding": "gzip"}) as http:  # fmt: skip
        plain_coding = (await http.get("/metrics")).headers.get("content-encoding", "identity")
        async with http.stream("GET", f"/lab/slow/async?n={s.events}&interval={s.interval_s}") as r:
            coding, inflate, text, wire = r.headers.get("content-encoding", "identity"), zlib.decompressobj(31), b"", 0
            async for chunk in r.aiter_raw():
                wire, text = wire + len(chunk), text + (inflate.decompress(chunk) if coding == "gzip" else chunk)
                arrived += [time.perf_counter()] * (text.count(b"\n\n") - len(arrived))
    gaps = [b - a for a, b in zip(arrived, arrived[1:])]
    return {"stream_coding": coding, "plain_coding": plain_coding, "events": len(arrived), "max_gap_ms": 1e3 * max(gaps, default=0),
            "wire_bytes_per_event": wire / max(1, len(arrived)), "bunched": sum(g < s.interval_s / 4 for g in gaps)}  # fmt: skip


def gzip_verdicts(t: dict[str, pd.DataFrame], s: Sizes) -> list:
    rows = t["rows"]
    default, events = rows[rows.gzip == "default"], rows[rows.gzip == "events"]
    return [
        judge("default leaves streams alone", "a plain answer compressed, text/event-stream not", "either otherwise",
              every((default.stream_coding == "identity") & (default.plain_coding == "gzip")),
              f"streams {seen(default.stream_coding)}, plain answers {seen(default.plain_coding)}", checked=True),
        judge("gzip per event holds nothing back", "every event arrives as written; events compresses", "a bunched "
              "or missing event", every((rows.bunched == 0) & (rows.events == s.events))
              and every(events.stream_coding == "gzip"), f"bunched {seen(rows.bunched)}, events {seen(rows.events)}, "
              f"events' streams {seen(events.stream_coding)}", checked=True),
    ]  # fmt: skip


GZIP = Experiment(
    name="edge.gzip", title="Starlette's GZipMiddleware in front of a paced stream: off, default, and on for events",
    sizes={p: {"events": 10, "interval_s": 0.2, "repetitions": n} for p, n in (("full", 3), ("ci", 2))},
    conditions=lambda s, target: [{"gzip": m} for m in ("off", "default", "events")],
    server=lambda s, c: {"gzip": c["gzip"]}, measure=lambda trial: run_sync(probe(trial.target.url, trial.sizes)),
    tables=lambda t, s: {"gzip": spread(t["rows"], "gzip", ["wire_bytes_per_event", "bunched", "max_gap_ms"])},
    verdicts=gzip_verdicts, needs=("settings", "lab"),
)  # fmt: skip

SPECS = (SIX, RULES, AUTH, STORM, RESTART, THREADS, GZIP, CLOSE)
