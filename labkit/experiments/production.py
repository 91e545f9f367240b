"""Notebook 08, SSE in production: a proxy in front, a browser as the client, a drain, what to watch.

:data:`PROXY` reads one request through nginx in eight settings at once (and directly, for the figure): a
token's *lag* through one setting is how many more tokens had come through the fastest setting by then,
less its start offset (:func:`token_lags`), so a hold-back is counted in tokens and a stall of nginx or
of the client lags every setting alike. :data:`KEEPALIVE` queues a stream behind others so nginx's
``proxy_read_timeout`` sees it quiet; :data:`BROWSER` drives headless Chromium on labkit's demo page;
:data:`DRAIN` sends SIGTERM to a ``labkit serve`` process; :data:`WATCH` scrapes ``/metrics`` in waves.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections import Counter
from typing import Any
from urllib.parse import urlencode

import numpy as np
import pandas as pd

from labkit.experiments.deadline import GATE, GOODPUT, cancel
from labkit.lab import Experiment, NotMeasurable, Process, ReadOptions, Request, Stream, Trial, judge, span, spread
from labkit.lab.client import async_client, read, run_sync
from labkit.lab.components import Chromium, Nginx, Route
from labkit.lab.experiment import Row, Tables
from labkit.lab.verdict import seen
from labkit.lab.witness import until, wait_for
from labkit.prompts import PROMPTS

#: route: proxy_buffering, X-Accel-Buffering honoured, gzip, HTTP version to the upstream (nginx's default: 1.0)
ROUTES = {"buffering-on": (1, 1, 0, "1.0"), "buffering-on-accel-ignored": (1, 0, 0, "1.0"),
          "buffering-off": (0, 1, 0, "1.0"), "buffering-off-accel-ignored": (0, 0, 0, "1.0"),
          "gzip-buffering-on": (1, 1, 1, "1.0"), "gzip-buffering-on-accel-ignored": (1, 0, 1, "1.0"),
          "gzip-buffering-off-accel-ignored": (0, 0, 1, "1.0"),
          "buffering-on-accel-ignored-http11": (1, 0, 0, "1.1")}  # fmt: skip
HELD = ("buffering-on-accel-ignored", "gzip-buffering-on-accel-ignored")  # buffered, header ignored, unchunked


def route(name: str, upstream: str, buffering: int, accel: int, gzip: int, http: str) -> Route:
    return Route(name, upstream, bool(buffering), bool(accel), bool(gzip), http_version=http)


async def gather(*reads: Any) -> list[Any]:
    return list(await asyncio.gather(*reads))


# --------------------------------------------------------------------------- nginx in front


def token_lags(clock: np.ndarray, times: list[float]) -> list[int]:
    """How many more tokens the clock had counted by each token's arrival, less the start offset: the fewest
    ahead before the clock's end (past it the count stops, and a late start would read as a lag)."""
    seen = np.searchsorted(clock, np.asarray(times, dtype=float), side="right")
    ahead = seen - np.arange(1, len(seen) + 1)  # a burst read at once counts every token in it as arrived
    counted = seen < len(clock)
    offset = int(ahead[counted].min()) if counted.any() else 0
    return [max(int(a) - offset, 0) for a in ahead]


def measure_proxy(trial: Trial) -> list[Row]:
    target, s, nginx = trial.target, trial.sizes, trial.state
    request, options = target.request(PROMPTS[0], s.tokens), ReadOptions(timeout=s.timeout)
    reads = [read(nginx.base(r), request, ReadOptions(gzip=bool(v[2]), timeout=s.timeout)) for r, v in ROUTES.items()]
    direct, *proxied = run_sync(gather(target.stream(request, options), *reads))
    n = min(len(st.token_times) for st in proxied)  # the clock: each token's first arrival through any setting
    rows, clock = [], np.min([st.token_times[:n] for st in proxied], axis=0) if n else np.zeros(0)
    for route, st in zip(ROUTES, proxied):
        lags = token_lags(clock, st.token_times[:n]) or [-1]
        burst = max(Counter(st.token_times).values(), default=0)  # tokens that arrived in one read
        rows.append({"route": route, "whole": st.ok and direct.ok and st.tokens == direct.tokens == s.tokens,
                     "encoding": st.headers.get("content-encoding", "identity"), "median_lag": float(np.median(lags)),
                     "max_lag": max(lags), "largest_burst": burst})  # fmt: skip
        trial.keep("arrivals", [{"route": route, "token": i, "proxied_s": t - st.sent, "direct_s": d - direct.sent}
                                for i, (t, d) in enumerate(zip(st.token_times, direct.token_times))])  # fmt: skip
    return rows


def proxy_tables(t: Tables, s: Any) -> Tables:
    rows = t["rows"].assign(held=lambda d: d.median_lag >= s.held_lag)
    held = rows.groupby("route").agg(held=("held", "sum"), runs=("held", "size"), encoding=("encoding", "first"))
    routes = spread(rows, "route", ["median_lag", "max_lag", "largest_burst"]).join(held, on="route")
    settings = pd.DataFrame.from_dict(ROUTES, orient="index", columns=["buffering", "accel_honoured", "gzip", "http"])
    routes = routes.join(settings.astype({"buffering": bool, "accel_honoured": bool, "gzip": bool}), on="route")
    return {"rows": rows, "routes": routes.assign(expected=lambda d: d.route.isin(HELD))}


def proxy_verdicts(t: Tables, s: Any) -> list:
    rows = t["rows"]
    lags = "; ".join(f"{r}: {span(g.median_lag, '{:.0f}')}" for r, g in rows.groupby("route", sort=False))
    return [judge("every stream whole through nginx", "every proxied stream ends whole, as long as the direct one",
                  "any failed, cut or shorter", bool(rows.whole.all()), f"{int((~rows.whole).sum())} of {len(rows)} "
                  "not whole", checked=True),
            judge("nginx holds events back only where it buffers", f"a median lag of {s.held_lag} tokens or more "
                  "exactly with buffering on, the header ignored and an unchunked upstream", "a run of any setting on "
                  "the wrong side", bool((rows.held == rows.route.isin(HELD)).all()), f"median lags: {lags}",
                  checked=True)]  # fmt: skip


def proxy_plots(t: Tables, s: Any) -> list:
    from labkit.plots import new_figure

    a = t["arrivals"][t["arrivals"].repetition == 0]
    fig, (ax,) = new_figure("production_proxy", width=8.0)
    for row, (_, g) in enumerate(a.groupby("route", sort=False)):
        ax.plot(g.direct_s, [row + 0.15] * len(g), "|", color="0.6", markersize=7)
        ax.plot(g.proxied_s, [row - 0.15] * len(g), "|", color="C0", markersize=7)
    ax.set_yticks(range(a.route.nunique()), list(dict.fromkeys(a.route)))
    ax.invert_yaxis()
    ax.set(xlabel="seconds since sent (grey: the same stream read directly; blue: through nginx)",
           title="When each token arrived through nginx")  # fmt: skip
    return [fig]


PROXY = Experiment(
    name="production.proxy", title="nginx in front: when each event reaches the client, per proxy setting",
    sizes={p: {"tokens": n, "held_lag": 8, "repetitions": 3, "timeout": 120.0} for p, n in (("full", 64), ("ci", 256))},
    prepare=lambda target, s: Nginx([route(r, target.url, *v) for r, v in ROUTES.items()]),
    measure=measure_proxy, tables=proxy_tables, verdicts=proxy_verdicts, plots=proxy_plots,
)  # fmt: skip


# --------------------------------------------------------------------------- keep-alive


def pings_server(s: Any, c: Row) -> Row:
    return {"max_batch": 1, "keepalive_interval": s.ping_interval_s if c["pings"] == "on" else 3600.0}


class Quiet(Nginx):
    """nginx with a short read timeout before each server, and how many blockers queued ahead keep a
    stream quiet for ``quiet_factor`` read timeouts (from one blocker timed here, the faster of two)."""

    def __init__(self, routes: list[Route], blockers: int) -> None:
        super().__init__(routes)
        self.blockers = blockers


def prepare_keepalive(target: Any, s: Any) -> Quiet:
    servers = {p: target.variant(**pings_server(s, {"pings": p})) for p in ("on", "off")}
    took = min(servers["on"].read(servers["on"].request(PROMPTS[1], s.blocker_tokens)).duration for _ in range(2))
    routes = [
        Route(p, t.url, buffering=False, read_timeout=s.read_timeout_s, http_version="1.0") for p, t in servers.items()
    ]
    return Quiet(routes, int(np.ceil(s.quiet_factor * s.read_timeout_s / took)))


def measure_keepalive(trial: Trial) -> Row:
    target, s, n = trial.target, trial.sizes, trial.state.blockers

    async def quiet() -> Stream:
        blockers = [Stream(api=target.api) for _ in range(n)]
        tasks = [asyncio.ensure_future(target.stream(target.request(PROMPTS[1], s.blocker_tokens), result=b))
                 for b in blockers]  # fmt: skip
        try:
            await until(lambda: all(b.status or b.ended for b in blockers), timeout=s.timeout, what="the blockers")
            probe = target.request(PROMPTS[2], 8)
            return await read(trial.state.base(trial.pings), probe, ReadOptions(timeout=s.timeout))
        finally:
            await cancel(tasks)

    probe = run_sync(quiet())
    target.wait_idle()
    return {"survived": probe.ok, "quiet_s": probe.ttft, "ended_s": probe.duration, "queued_ahead": n,
            "failure": probe.failure}  # fmt: skip


def keepalive_verdicts(t: Tables, s: Any) -> list:
    on, off = (t["rows"][t["rows"].pings == p] for p in ("on", "off"))
    return [judge("pings keep a quiet stream through the proxy", "quiet past proxy_read_timeout, a stream survives "
                  "with pings and is cut without", "one on the wrong side, or one with pings not quiet that long",
                  bool(len(on) and len(off) and on.survived.all() and not off.survived.any() and (on.quiet_s >
                  s.read_timeout_s).all()), f"pings on: {int(on.survived.sum())} of {len(on)} survived, quiet "
                  f"{span(on.quiet_s, '{:.1f}', ' s')}; off: {int(off.survived.sum())} of {len(off)}",
                  checked=True)]  # fmt: skip


KEEPALIVE = Experiment(
    name="production.keepalive", title="A quiet stream through proxy_read_timeout, with pings and without",
    sizes={p: {"read_timeout_s": 1.0, "ping_interval_s": 0.25, "quiet_factor": 3.0, "blocker_tokens": n,
               "repetitions": 3, "timeout": 120.0} for p, n in (("full", 24), ("ci", 200))},
    conditions=lambda s, target: [{"pings": "on"}, {"pings": "off"}], server=pings_server, prepare=prepare_keepalive,
    measure=measure_keepalive, verdicts=keepalive_verdicts, needs=("settings",),
)  # fmt: skip


# --------------------------------------------------------------------------- the browser


def measure_browser(trial: Trial) -> Row:
    s, browser, cut = trial.sizes, trial.state, trial.cut_after
    query = {"prompt": PROMPTS[3], "max_new_tokens": s.tokens, "mode": "eventsource"}
    query |= {"retry": trial.retry_ms, "drop_after": cut} if cut else {}
    browser.open(f"{trial.target.url}/lab/demo?{urlencode(query)}")

    def finished() -> Any:  # what the page recorded, once it is over
        page = json.loads(browser.value("JSON.stringify((window.labkitDemo || {}).eventsource || {})"))
        return (page.get("finished") or page.get("failure")) and page

    page = wait_for(finished, timeout=s.timeout, what="the demo page to finish", interval=0.05)
    events, conns = page.get("events", []), page.get("connections", [])
    trial.keep("events", [{"id": str(e["id"]), "type": e["type"], "data": "" if e["type"] == "start" else e["data"]}
                          for e in events])  # fmt: skip
    opens, cuts = ([c["t"] for c in conns if c["kind"] == kind] for kind in ("open", "network-error"))
    after, ids = [e for e in events if len(opens) > 1 and e["t"] >= opens[1]], [str(e["id"]) for e in events]
    once = ids == [str(i + 1) for i in range(len(ids))]
    return {"ended_by": page.get("ended_by") or page.get("failure"), "events": len(events), "connections": len(opens),
            "reconnect_ms": opens[1] - cuts[0] if len(opens) > 1 and cuts else None, "first_id_after":
            int(after[0]["id"]) if after else None, "ids_once_in_order": once}  # fmt: skip


def browser_tables(t: Tables, s: Any) -> Tables:
    rows, events = t["rows"].copy(), t["events"].fillna("").astype({"id": str, "data": str})
    got = {key: list(zip(g.id, g.type, g.data)) for key, g in events.groupby(["repetition", "retry_ms"])}
    rows["same_as_uninterrupted"] = [got.get(k) == got.get((k[0], 0)) for k in zip(rows.repetition, rows.retry_ms)]
    return {"rows": rows, "delays": spread(rows[rows.cut_after > 0], "retry_ms", "reconnect_ms")}


def browser_verdicts(t: Tables, s: Any) -> list:
    rows = t["rows"]
    cut, by = rows[rows.cut_after > 0], rows[rows.cut_after > 0].groupby("retry_ms").reconnect_ms
    resumed = bool((cut.connections == 2).all() and (cut.first_id_after == cut.cut_after + 1).all()
                   and rows.same_as_uninterrupted.all() and rows.ids_once_in_order.all()
                   and (rows.ended_by == "done").all())  # fmt: skip
    ordered = (
        None
        if cut.reconnect_ms.isna().all()
        else bool((cut.reconnect_ms >= cut.retry_ms).all() and (by.max().values[:-1] < by.min().values[1:]).all())
    )
    firsts = seen(cut.first_id_after)
    delays = "; ".join(f"retry {r} ms: {span(g, '{:.0f}', ' ms')}" for r, g in by)
    return [judge("the browser resumes exactly", "cut, EventSource reconnects by itself with Last-Event-ID and ends "
                  "with the uninterrupted run's events", "a cut run otherwise", resumed if len(cut) else None,
                  f"{int(cut.same_as_uninterrupted.sum())} of {len(cut)} cut runs equal; first ids after: {firsts}",
                  checked=True),
            judge("retry: sets the reconnect delay", "at least the retry: value, longer for a longer one",
                  "sooner, or overlapping", ordered, delays)]  # fmt: skip


BROWSER = Experiment(
    name="production.browser", title="Headless Chromium's EventSource, cut mid-stream by the server",
    sizes={p: {"tokens": 24, "cut_after": 8, "retries_ms": (250, 1500), "repetitions": 3, "timeout": 60.0}
           for p in ("full", "ci")},
    conditions=lambda s, target: [{"cut_after": 0, "retry_ms": 0}, *({"cut_after": s.cut_after, "retry_ms": r}
                                                                      for r in s.retries_ms)],
    prepare=lambda target, s: Chromium(), measure=measure_browser, tables=browser_tables, verdicts=browser_verdicts, needs=("lab",),
)  # fmt: skip


# --------------------------------------------------------------------------- drain


def drain_server(target: Any, s: Any) -> Process | None:
    """The target where the lab started it; beside labkit in this process, ``labkit serve`` with the
    drain's settings (two slots: the holder's and one more, so some streams wait); else not measurable."""
    if target.caps.restart or not target.caps.settings:
        return None if target.caps.restart else target.need("restart", what="production.drain")
    slower = {k: v for k, v in getattr(target, "settings", {}).items() if k == "step_delay"}
    return Process.labkit(target.model, max_batch=2, policy="pause", pad_bytes=s.pad_bytes, sndbuf=4096,
                          drain_grace=s.drain_grace_s, log_level="warning", **slower)  # fmt: skip


def measure_drain(trial: Trial) -> Row:
    server: Any = trial.state or trial.target
    streams, probes, code, exited_s = run_sync(drain(server, trial.sizes))
    server.stop()
    server.start()  # the same command on the same port: a restart
    told = [st for st in streams if "x-resume-token" in st.headers]
    trial.keep("resumes", [{"status": server.read(Request(f"/v1/streams/{st.request_id}/events?token="
               f"{st.headers['x-resume-token']}", None, method="GET", headers={"Last-Event-ID": st.last_event_id
               or "0"})).status} for st in told])  # fmt: skip
    trial.keep("streams", [{"stream": i, "resumable": st in told, "tokens": st.tokens, "ended_by": "done" if st.ok
                            else st.finish_reason if st.stream_error else "cut"}
                           for i, st in enumerate(streams)])  # fmt: skip
    trial.keep("probes", probes)
    return {"exit_code": code, "exited_s": exited_s, "drain_grace_s": trial.sizes.drain_grace_s}


async def drain(server: Any, s: Any) -> tuple[list[Stream], list[Row], int, float]:
    leave = asyncio.Event()  # a client that never reads holds a slot: its blocked writer keeps the drain open
    hold = ReadOptions(read=False, leave_after_s=s.timeout, rcvbuf=4096)
    holder = asyncio.ensure_future(read(server.url, server.request("I never read", s.tokens), hold, leave=leave))
    # Paused, not merely running: until its writes block, the holder takes its shutdown event at once,
    # the drain ends within milliseconds and the probes meet a closed listener (a fast machine's 38 ms).
    try:
        await asyncio.to_thread(wait_for, lambda: holder.done() or server.stats()["paused"], timeout=s.timeout,
                                what="the holder paused")  # fmt: skip
    except Exception:
        leave.set()
        await holder
        raise
    if holder.done():
        raise NotMeasurable("production.drain", "the stream that never reads ended before its writes blocked, so "
                            "nothing would hold the drain open (events too small or socket buffers too large)")  # fmt: skip
    streams = [Stream(api=server.api) for _ in range(s.streams)]
    tasks = [asyncio.ensure_future(server.stream(server.request(f"Stream {i} before the restart", s.tokens,
             resumable=i % 2 == 1), ReadOptions(timeout=s.timeout), result=st))
             for i, st in enumerate(streams)]  # fmt: skip
    await until(lambda: all(st.status for st in streams) and any(st.tokens >= 3 for st in streams),
                timeout=s.timeout, what="every stream open and one decoding")  # fmt: skip
    proc, signalled = server.proc, time.perf_counter()
    proc.send_signal(signal.SIGTERM)
    exit_wait = asyncio.ensure_future(asyncio.to_thread(lambda: (proc.wait(s.drain_grace_s + 60), time.perf_counter())))
    probes: list[Row] = []
    while time.perf_counter() - signalled < s.drain_grace_s + 60:  # a new request after each answer until refused
        p = await read(server.url, server.request("A request in the drain", 2, stream=False), ReadOptions(timeout=5))
        kind = (p.body.get("error") or {}).get("type") if isinstance(p.body, dict) else None
        probes.append({"sent_s": p.sent - signalled, "status": p.status, "retry_after": p.headers.get("retry-after"),
                       "type": kind or ("refused at the socket" if p.status == 0 else "answered")})  # fmt: skip
        if p.status == 0:
            break
        await asyncio.sleep(s.probe_every_s)
    code, exited = await exit_wait
    leave.set()
    await asyncio.gather(holder, *tasks)
    return streams, probes, code, exited - signalled


def drain_verdicts(t: Tables, s: Any) -> list:
    rows, streams, probes, resumes = t["rows"], t["streams"], t["probes"], t["resumes"].reindex(columns=["status"])
    answered, told, ended = probes[probes.status != 0], streams[streams.resumable], ("done", "shutdown")
    refused = bool(len(answered) and (answered.status == 503).all() and answered.retry_after.notna().all()
                   and answered.type.isin(["draining", "shutdown"]).all()
                   and (answered.type == "draining").any())  # fmt: skip
    counts = ", ".join(f"{n} {k}" for k, n in probes.groupby("type").size().items())
    return [judge("drain ends every open stream", "each with its done or an error event of type shutdown", "one cut "
                  "or ended otherwise", bool(len(streams) and streams.ended_by.isin(ended).all()), f"of {len(streams)}:"
                  f" " + ", ".join(f"{n} {k}" for k, n in streams.groupby("ended_by").size().items()), checked=True),
            judge("drain refuses new work", "503 with Retry-After, type draining (or shutdown, if admitted as the "
                  "drain began)", "any other answer, or no draining one", refused, counts, checked=True),
            judge("exits within its drain grace", "exit 0 within drain_grace (and two seconds to exit)", "otherwise",
                  bool((rows.exit_code == 0).all() and (rows.exited_s <= rows.drain_grace_s + 2).all()), f"exit "
                  f"{sorted(set(rows.exit_code))} after {span(rows.exited_s, '{:.2f}', ' s')} "
                  f"(grace {s.drain_grace_s:g} s)"),
            judge("a restarted process answers the resume with 404", "a resumable stream is told why it ended; its "
                  "resume after the restart gets 404", "otherwise", None if resumes.empty else bool((resumes.status == 404).all()
                  and told.ended_by.isin(ended).all()), f"{len(told)} resumable streams ended "
                  f"{sorted(set(told.ended_by))}; resumes answered {sorted(set(resumes.status))}",
                  checked=True)]  # fmt: skip


DRAIN = Experiment(
    name="production.drain", title="SIGTERM to a labkit serve process with streams open, then a restart",
    sizes={p: {"streams": 4, "tokens": n, "drain_grace_s": 3.0, "pad_bytes": 16384, "probe_every_s": 0.05,
               "repetitions": 1, "timeout": 120.0} for p, n in (("full", 60), ("ci", 400))},
    prepare=drain_server, measure=measure_drain, verdicts=drain_verdicts,
    tables=lambda t, s: {"answers": t["probes"].groupby(["status", "type"]).size().rename("probes").reset_index()},
)  # fmt: skip


# --------------------------------------------------------------------------- what to watch

GAUGES = {"labkit_open_streams": "open", "labkit_queue_depth": "queued", "labkit_running_requests": "running",
          "labkit_kv_blocks_in_use": "kv_blocks",
          "labkit_time_to_first_token_seconds_count": "first_tokens"}  # fmt: skip


def measure_watch(trial: Trial) -> Row:
    target, s, scrapes = trial.target, trial.sizes, []
    before, t0 = target.metrics(), time.perf_counter()
    if not set(GAUGES) <= set(before):
        raise NotMeasurable("production.metrics", f"its /metrics lacks labkit's gauges ({', '.join(GAUGES)})")

    def scrape(mark: str = "") -> None:
        now = target.metrics()
        m = {short: now[name] - (before[name] if short == "first_tokens" else 0) for name, short in GAUGES.items()}
        scrapes.append({"t_s": time.perf_counter() - t0, "mark": mark, **m})

    streams = run_sync(waves(target, s, scrape))
    wait_for(lambda: target.metrics()["labkit_open_streams"] == 0, timeout=s.timeout, what="no open stream")
    scrape("after")
    trial.keep("scrapes", scrapes)
    return {"requests": len(streams), "done": sum(st.ok for st in streams)}


async def waves(target: Any, s: Any, scrape: Any) -> list[Stream]:
    """Waves of ``per_wave`` streams, ``/metrics`` scraped on a timer and once ``max_batch`` of a wave have
    ``mark_tokens`` tokens (the rest queued); the next wave goes once all of it has begun: moments in tokens."""
    streams: list[Stream] = []

    async def every() -> None:
        while True:
            await asyncio.sleep(s.scrape_every_s)
            await asyncio.to_thread(scrape)

    timer = asyncio.ensure_future(every())
    async with async_client(target.url, s.waves * s.per_wave, s.timeout) as client:
        for w in range(s.waves):
            wave = [Stream(api=target.api) for _ in range(s.per_wave)]
            for i, st in enumerate(wave):
                asyncio.ensure_future(target.stream(target.request(PROMPTS[(w * s.per_wave + i) % len(PROMPTS)],
                                                                   s.tokens), client=client, result=st))  # fmt: skip
            await until(lambda w=wave: sum(st.tokens >= s.mark_tokens for st in w) >= s.max_batch,
                        timeout=s.timeout, what="a full batch")  # fmt: skip
            await asyncio.to_thread(scrape, f"wave {w + 1}")
            await until(lambda w=wave: all(st.tokens or st.ended for st in w), timeout=s.timeout, what="its turn")
            streams += wave
        await until(lambda: all(st.ended for st in streams), timeout=s.timeout, what="every stream's end")
    await cancel([timer])
    return streams


def watch_verdicts(t: Tables, s: Any) -> list:
    rows, scrapes = t["rows"], t["scrapes"]
    marked, after = scrapes[scrapes.mark.str.startswith("wave")], scrapes[scrapes.mark == "after"]
    full = marked[(marked.queued > 0) & (marked.running == scrapes.running.max())]
    left = after[["open", "queued", "kv_blocks"]].to_numpy().astype(int).tolist()
    settled = bool((after.first_tokens.to_numpy() == rows.requests.to_numpy()).all() and not np.any(left)
                   and (rows.done == rows.requests).all())  # fmt: skip
    return [judge("a queue shows while the batch is full", "a scrape as a wave fills the batch sees a queue and the "
                  "batch at its fullest", "any without", len(full) == len(marked) > 0, f"{len(full)} of {len(marked)} "
                  f"(queued {span(marked.queued, '{:.0f}')}, running {span(marked.running, '{:.0f}')})", checked=True),
            judge("the metrics account for every stream", "after the load, a first token counted per request, and "
                  "nothing open, queued or holding KV blocks", "otherwise", settled, f"first tokens "
                  f"{list(after.first_tokens.astype(int))} for {list(rows.requests)}; open, queued, KV blocks: {left}",
                  checked=True)]  # fmt: skip


def watch_plots(t: Tables, s: Any) -> list:
    from labkit.plots import new_figure

    sc = t["scrapes"][t["scrapes"].repetition == 0]
    fig, (ax, kv) = new_figure("production_metrics", ncols=2)
    for name in ("open", "queued", "running"):
        ax.step(sc.t_s, sc[name], where="post", label=name)
    marked = sc[sc.mark.str.startswith("wave")]
    ax.plot(marked.t_s, marked.queued, "ko", fillstyle="none", label="queued as a wave fills the batch")
    kv.step(sc.t_s, sc.kv_blocks, where="post", color="C4")
    ax.set(xlabel="seconds", ylabel="requests", title="/metrics during a load in waves")
    kv.set(xlabel="seconds", ylabel="KV blocks in use", title="KV blocks held")
    ax.legend(fontsize="small")
    return [fig]


WATCH = Experiment(
    name="production.metrics", title="/metrics scraped during a load in waves",
    sizes={p: {"max_batch": b, "waves": 3, "per_wave": 2 * b, "tokens": n, "mark_tokens": 2, "scrape_every_s": e,
               "repetitions": 1, "timeout": 120.0} for p, b, n, e in (("full", 8, 24, 0.25), ("ci", 4, 64, 0.1))},
    server=lambda s, c: {"max_batch": s.max_batch}, measure=measure_watch, verdicts=watch_verdicts, plots=watch_plots,
    needs=("metrics",),
)  # fmt: skip

SPECS = (PROXY, KEEPALIVE, BROWSER, DRAIN, WATCH, GATE, GOODPUT)
