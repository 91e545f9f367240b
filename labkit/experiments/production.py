"""Experiment ``production``: a stream through a real proxy, and a quiet stream through its timeout.

Two measurements with nginx (:mod:`labkit.experiments.proxy`) between the client and the service.

**The burst probe.** One stream at a time, each condition in turn, repetitions interleaved. For
every token event we know when the server wrote it (the hub's observer is called as the writer
takes the token off its queue, just before it is sent: :class:`WriteClock`) and when it reached
the client through the proxy; the difference is the proxy's hold-back. Conditions are nginx's
``proxy_buffering`` on or off, the service's ``X-Accel-Buffering: no`` honoured or ignored
(``proxy_ignore_headers``), and ``gzip`` on or off for ``text/event-stream``, plus the server
read directly as the baseline. Events that arrive in one read were held and released together:
a burst. The verdict is computed: a condition holds events back when its median hold-back is
at least ``hold_floor_s`` and ten times the direct baseline's.

**Keep-alive through an idle timeout.** The server decodes one sequence at a time
(``max_batch=1``); a few long requests go in first, straight to the server, and the probe
request is queued behind them, through the proxy, whose ``proxy_read_timeout`` is shorter than
that wait. How many go first is measured, not guessed: one of them is timed on its own, and
enough are queued to last ``quiet_factor`` read timeouts on this machine. Its ``start`` event goes out at once, then nothing until its first token. With the
service's ``: ping`` comments every ``ping_interval`` seconds the proxy keeps reading and the
stream survives; with the pings pushed out of reach (an interval of an hour) nginx gives up on
the upstream and cuts the stream, which the client sees as a stream without its ``done``.

Times are ``time.perf_counter()`` seconds: the server runs in this process, so its clock and
the client's are one.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np
import pandas as pd

from labkit.experiments.client import async_client, run_sync, timed_stream
from labkit.experiments.profiles import Profile
from labkit.experiments.progress import Progress, doing, tick
from labkit.experiments.proxy import Route, running_nginx
from labkit.experiments.readings import current_step, fetch_steps
from labkit.experiments.records import EventSplitter, StreamResult
from labkit.experiments.servers import loaded_model, server_like, serving
from labkit.experiments.waiting import WaitTimeout, await_for, wait_for
from labkit.experiments.workload import stream_body

NAME = "production"

DIRECT = "direct"
#: condition -> (proxy_buffering, X-Accel-Buffering honoured, gzip, HTTP version to the upstream).
#: nginx 1.22 (Debian's) speaks HTTP/1.0 to the upstream unless told otherwise, so the service's
#: response reaches it unchunked; the last condition is the one change to HTTP/1.1 (chunked).
PROXY_CONDITIONS: dict[str, tuple[bool, bool, bool, str]] = {
    "buffering-on": (True, True, False, "1.0"),
    "buffering-on-accel-ignored": (True, False, False, "1.0"),
    "buffering-off": (False, True, False, "1.0"),
    "buffering-off-accel-ignored": (False, False, False, "1.0"),
    "gzip-buffering-on": (True, True, True, "1.0"),
    "gzip-buffering-on-accel-ignored": (True, False, True, "1.0"),
    "gzip-buffering-off": (False, True, True, "1.0"),
    "gzip-buffering-off-accel-ignored": (False, False, True, "1.0"),
    "buffering-on-accel-ignored-http11": (True, False, False, "1.1"),
}
CONDITIONS = (DIRECT, *PROXY_CONDITIONS)
#: Where the proxy should hold events back, and why: nginx buffers a response only with
#: ``proxy_buffering on`` and the service's ``X-Accel-Buffering: no`` ignored; then it passes on
#: what fills a buffer (4 KiB here) when the upstream body is unchunked (HTTP/1.0), and gzip
#: holds the compressed stream until the end. Unbuffered, nginx forwards (and gzip flushes)
#: every read from the upstream; a chunked upstream (HTTP/1.1) is forwarded chunk by chunk.
EXPECTED_HOLD = {c: c in ("buffering-on-accel-ignored", "gzip-buffering-on-accel-ignored") for c in CONDITIONS}
PINGS = ("on", "off")
NO_PINGS_INTERVAL = 3600.0  # "pings off": an interval no measured stream stays quiet for


@dataclass(frozen=True)
class Config:
    model: str = "tiny-gpt2"
    tokens: int = 160  # per probe stream (ignore_eos: always this many); ~11 KiB of events
    repetitions: int = 3
    conditions: tuple[str, ...] = CONDITIONS
    hold_floor_s: float = 0.005  # a median hold-back below this is no hold-back, whatever the ratio
    # nginx's proxy_read_timeout for the keep-alive routes. nginx moves a timer only when the new
    # deadline differs from the old by 300 ms or more (NGX_TIMER_LAZY_DELAY), so a read resets
    # this timeout only once 300 ms have passed since the last reset: keep it well above that.
    read_timeout: float = 1.0
    ping_interval: float = 0.25  # the service's keepalive_interval with pings on
    quiet_factor: float = 3.0  # the queue ahead of the quiet probe lasts this many read timeouts
    blocker_tokens: int = 200  # per request in that queue (how many: measured, see quiet_queue)
    keepalive_repetitions: int = 3
    timeout: float = 120.0  # bounds every stream read

    @classmethod
    def for_profile(cls, profile: Profile) -> Config:
        if profile.full:  # SmolLM2 writes a token every ~50 ms: a short answer already spans seconds
            return cls(model=profile.model, tokens=64, blocker_tokens=30)
        return cls(model=profile.model)

    def __post_init__(self) -> None:
        unknown = [c for c in self.conditions if c not in CONDITIONS]
        if unknown or not self.conditions:
            raise ValueError(f"production.Config.conditions must be among {CONDITIONS}, got {self.conditions!r}")
        if min(self.tokens, self.repetitions, self.blocker_tokens, self.keepalive_repetitions) < 1:
            raise ValueError("production.Config: tokens, repetitions and blocker_tokens must be >= 1")
        if self.quiet_factor <= 1:
            raise ValueError(f"production.Config.quiet_factor must be > 1, got {self.quiet_factor!r}")
        if not 0 < self.ping_interval < self.read_timeout:
            raise ValueError(
                "production.Config.ping_interval must be > 0 and below read_timeout, "
                f"got {self.ping_interval!r} and {self.read_timeout!r}"
            )


def server_options(config: Config) -> dict[str, Any]:
    return {"model": config.model}


def units(config: Config) -> int:
    return len(config.conditions) * config.repetitions + len(PINGS) * config.keepalive_repetitions


def run(config: Config, *, server: Any = None, progress: Progress | None = None) -> dict[str, pd.DataFrame]:
    with serving(server, **server_options(config)) as srv:
        first_step = current_step(srv.url)
        events = burst_probe(srv, config, progress)
        keepalive = keepalive_probe(loaded_model(srv, config.model), config, progress)
        steps = fetch_steps(srv.url, since=first_step)  # the burst probe's server (keep-alive runs its own)
    holdback = holdback_summary(events, config.hold_floor_s)
    return {
        "events": events,
        "holdback": holdback,
        "keepalive": keepalive,
        "keepalive_summary": keepalive_summary(keepalive),
        "steps": steps,
    }


# --------------------------------------------------------------------------- the server's clock


class WriteClock:
    """The hub's observer, plus the time the writer took each token of the current stream.

    The hub calls its observer as the stream's writer takes a token, which the writer then
    sends at once: that moment is when the server wrote the event. The observer is not told
    which stream a token belongs to, so a clock serves one stream at a time.
    """

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.times: list[float] = []

    def first_token(self, seconds: float) -> None:
        self.times = [time.perf_counter()]
        if self.inner is not None:
            self.inner.first_token(seconds)

    def token_gap(self, seconds: float) -> None:
        self.times.append(time.perf_counter())
        if self.inner is not None:
            self.inner.token_gap(seconds)


@contextlib.contextmanager
def write_clock(server: Any) -> Iterator[WriteClock]:
    """A :class:`WriteClock` on ``server``'s hub for the block; the previous observer after."""
    hub = server.hub
    clock = WriteClock(hub.observer)
    hub.observer = clock
    try:
        yield clock
    finally:
        hub.observer = clock.inner


# --------------------------------------------------------------------------- the client


@dataclass
class Probe:
    """A stream read with content decoding (gzip), every read's arrival time and size kept."""

    result: StreamResult
    reads: list[tuple[float, int]] = field(default_factory=list)
    body: bytearray = field(default_factory=bytearray)

    @property
    def pings(self) -> int:
        return self.body.count(b": ping\n")


async def probe(client: httpx.AsyncClient, url: str, body: dict[str, Any], timeout: float) -> Probe:
    """POST ``body`` to ``url`` accepting gzip, and read to the end; never raises for I/O.

    :func:`~labkit.experiments.client.timed_stream` reads raw bytes, which a proxy that
    compresses turns into gzip; this reads the decoded bytes, as a browser would.
    """
    seen = Probe(StreamResult(sent=time.perf_counter()))
    result = seen.result

    async def read() -> None:
        async with client.stream("POST", url, json=body, headers={"accept-encoding": "gzip"}) as response:
            result.headers_at, result.status = time.perf_counter(), response.status_code
            result.headers, result.content_type = dict(response.headers), response.headers.get("content-type", "")
            splitter = EventSplitter()
            async for chunk in response.aiter_bytes():
                now = time.perf_counter()
                seen.reads.append((now, len(chunk)))
                seen.body += chunk
                result.total_bytes += len(chunk)
                result.events += splitter.feed(chunk, now)
            result.unfinished_bytes = splitter.pending
            result.ended = time.perf_counter()

    try:
        await asyncio.wait_for(read(), timeout)
    except (httpx.HTTPError, OSError, asyncio.TimeoutError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    result.ended = result.ended or time.perf_counter()
    return seen


# --------------------------------------------------------------------------- the burst probe


def proxy_routes(upstream: str, conditions: Sequence[str]) -> list[Route]:
    return [
        Route(name, upstream, buffering=b, honour_accel=h, gzip=g, http_version=v)
        for name, (b, h, g, v) in PROXY_CONDITIONS.items()
        if name in conditions
    ]


def burst_probe(server: Any, config: Config, progress: Progress | None = None) -> pd.DataFrame:
    """One row per token event: condition, repetition, index, written_at, arrived_at, delay (s)."""
    body = stream_body(0, config.tokens, ignore_eos=True)
    rows: list[dict[str, Any]] = []
    with running_nginx(proxy_routes(server.url, config.conditions)) as nginx, write_clock(server) as clock:
        for rep in range(config.repetitions):
            order = (
                config.conditions[rep % len(config.conditions) :] + config.conditions[: rep % len(config.conditions)]
            )
            for condition in order:  # interleaved, and each repetition starts elsewhere
                doing(progress, f"{condition}, repetition {rep + 1}/{config.repetitions}")
                base = server.url if condition == DIRECT else nginx.base(condition)
                seen = run_sync(_one_probe(f"{base}/v1/stream", body, config.timeout))
                rows += event_rows(condition, rep, seen, clock.times)
                tick(progress, events=rows)
    return pd.DataFrame(
        rows,
        columns=["condition", "repetition", "index", "written_at", "arrived_at", "delay", "read", "content_encoding"],
    )


async def _one_probe(url: str, body: dict[str, Any], timeout: float) -> Probe:
    async with async_client("http://unused", connections=1, timeout=timeout) as client:
        return await probe(client, url, body, timeout)


def event_rows(condition: str, rep: int, seen: Probe, written: list[float]) -> list[dict[str, Any]]:
    result = seen.result
    if result.error or result.terminal is None:
        raise RuntimeError(f"{condition}: the probe stream did not finish ({result.error or 'no done event'})")
    tokens = result.tokens
    if len(written) != len(tokens):
        raise RuntimeError(
            f"{condition}: the server wrote {len(written)} tokens, the client read {len(tokens)}; "
            "was another stream running on this server?"
        )
    read_of = {t: i for i, (t, _) in enumerate(seen.reads)}
    encoding = result.headers.get("content-encoding", "identity")
    return [
        {
            "condition": condition,
            "repetition": rep,
            "index": e.data["index"],
            "written_at": written[e.data["index"]] - result.sent,
            "arrived_at": e.time - result.sent,
            "delay": e.time - written[e.data["index"]],
            "read": read_of[e.time],
            "content_encoding": encoding,
        }
        for e in tokens
    ]


def holdback_summary(events: pd.DataFrame, floor_s: float = Config.hold_floor_s) -> pd.DataFrame:
    """Per condition: hold-back (median, p90, max), bursts, and the verdict against the direct run."""
    rows = []
    for condition, group in events.groupby("condition", sort=False):
        per_read = group.groupby(["repetition", "read"]).size()
        in_bursts = int(per_read[per_read >= 2].sum())
        buffering, honoured, gzip, http = PROXY_CONDITIONS.get(str(condition), (None, None, None, None))
        rows.append(
            {
                "condition": condition,
                "proxy": condition != DIRECT,
                "proxy_buffering": buffering,
                "accel_header": None if honoured is None else ("honoured" if honoured else "ignored"),
                "gzip": gzip,
                "upstream_http": http,
                "content_encoding": group.content_encoding.iloc[0],
                "repetitions": group.repetition.nunique(),
                "events": len(group),
                "median_delay_ms": 1000 * group.delay.median(),
                "p90_delay_ms": 1000 * group.delay.quantile(0.9),
                "max_delay_ms": 1000 * group.delay.max(),
                "reads_per_stream": per_read.groupby(level=0).size().median(),
                "largest_burst": int(per_read.max()),
                "events_in_bursts": in_bursts,
                "share_in_bursts": in_bursts / len(group),
            }
        )
    table = pd.DataFrame(rows)
    return table.assign(holds_back=verdicts(table, floor_s))


def verdicts(table: pd.DataFrame, floor_s: float = Config.hold_floor_s) -> list[bool]:
    """A condition holds events back when its median hold-back is at least ``floor_s`` and ten
    times the direct baseline's (the baseline's own median when there is one)."""
    direct = table.loc[table.condition == DIRECT, "median_delay_ms"]
    base = float(direct.iloc[0]) if len(direct) else 0.0
    threshold = max(1000 * floor_s, 10 * base)
    return [bool(c != DIRECT and d >= threshold) for c, d in zip(table.condition, table.median_delay_ms)]


# --------------------------------------------------------------------------- keep-alive


def keepalive_probe(model: Any, config: Config, progress: Progress | None = None) -> pd.DataFrame:
    """One row per quiet probe: pings on or off, whether it survived the proxy's read timeout."""
    rows: list[dict[str, Any]] = []
    intervals = {"on": config.ping_interval, "off": NO_PINGS_INTERVAL}
    with contextlib.ExitStack() as stack:
        servers = {
            p: stack.enter_context(server_like(None, model, max_batch=1, keepalive_interval=intervals[p]))
            for p in PINGS
        }
        routes = [Route(f"pings-{p}", servers[p].url, buffering=False, read_timeout=config.read_timeout) for p in PINGS]
        nginx = stack.enter_context(running_nginx(routes))
        blockers, blocker_s = quiet_queue(servers["on"], config)
        for rep in range(config.keepalive_repetitions):
            for pings in PINGS if rep % 2 == 0 else PINGS[::-1]:
                doing(progress, f"pings {pings}, repetition {rep + 1}/{config.keepalive_repetitions}")
                seen = run_sync(_quiet_probe(servers[pings], nginx.base(f"pings-{pings}"), blockers, config))
                rows.append(
                    keepalive_row(pings, intervals[pings], rep, config, seen)
                    | {"queued_ahead": blockers, "expected_wait_s": blockers * blocker_s}
                )
                _wait_idle(servers[pings], config.timeout)
                tick(progress, keepalive=rows)
    return pd.DataFrame(rows)


def quiet_queue(server: Any, config: Config) -> tuple[int, float]:
    """How many blocker requests make a queue that lasts ``quiet_factor`` read timeouts, and
    how long one took here: the faster of two timed alone, straight to the server (the first
    may pay for warming up)."""

    async def two() -> list[StreamResult]:
        async with async_client(server.url, connections=1, timeout=config.timeout) as client:
            return [
                await timed_stream(client, stream_body(1, config.blocker_tokens, ignore_eos=True)) for _ in range(2)
            ]

    results = run_sync(two())
    if any(r.terminal is None or r.duration is None for r in results):
        raise RuntimeError(f"a timing request did not finish: {[r.error for r in results]}")
    seconds = min(r.duration for r in results if r.duration is not None)
    blockers = max(1, int(np.ceil(config.quiet_factor * config.read_timeout / seconds)))
    if blockers > 256:
        raise RuntimeError(
            f"one {config.blocker_tokens}-token request took {seconds:.4f} s: "
            "raise blocker_tokens so that a queue of them outlasts the read timeout"
        )
    return blockers, seconds


async def _quiet_probe(server: Any, base: str, count: int, config: Config) -> Probe:
    """``count`` blockers straight to the server first; then the probe, through the proxy, queued behind them."""
    blockers = [StreamResult(sent=0.0) for _ in range(count)]
    body = stream_body(1, config.blocker_tokens, ignore_eos=True)
    async with async_client(server.url, connections=count + 1, timeout=config.timeout) as client:
        tasks = [asyncio.ensure_future(timed_stream(client, body, result=r)) for r in blockers]
        try:
            with contextlib.suppress(WaitTimeout):  # at the bound the probe goes anyway
                await await_for(  # every blocker submitted (its headers came back) first
                    lambda: all(r.status for r in blockers),
                    timeout=config.timeout,
                    what="blockers' heads",
                    interval=0.005,
                )
            return await probe(client, f"{base}/v1/stream", stream_body(2, 8, ignore_eos=True), config.timeout)
        finally:
            for task in tasks:
                task.cancel()  # the blockers' work is done: leaving cancels their generation
            await asyncio.gather(*tasks, return_exceptions=True)


def keepalive_row(pings: str, interval: float, rep: int, config: Config, seen: Probe) -> dict[str, Any]:
    result = seen.result
    times = [result.headers_at or result.sent] + [t for t, _ in seen.reads] + [result.ended or time.perf_counter()]
    first = result.tokens[0].time if result.tokens else None
    return {
        "pings": pings,
        "ping_interval_s": interval,
        "read_timeout_s": config.read_timeout,
        "repetition": rep,
        "status": result.status,
        "survived": result.terminal is not None and result.terminal.event == "done",
        "ended_by": result.terminal.event if result.terminal else "cut",
        "tokens": len(result.tokens),
        "pings_received": seen.pings,
        "wait_for_first_token_s": None if first is None else first - result.sent,
        "longest_silence_s": float(np.max(np.diff(times))) if len(times) > 1 else None,
        "ended_s": result.ended - result.sent if result.ended else None,
        "client_error": result.error,
    }


def _wait_idle(server: Any, timeout: float) -> None:
    """Until ``GET /stats`` says nothing runs, waits or is paused (read on the server's loop, not
    from the engine in this thread)."""

    def idle() -> bool:
        stats = httpx.get(f"{server.url}/stats", timeout=10.0).json()
        return stats["running"] == 0 and stats["waiting"] == 0 and stats.get("paused", 0) == 0

    wait_for(idle, timeout=timeout, what="the server's engine to go idle after a keep-alive probe", interval=0.01)


def keepalive_summary(keepalive: pd.DataFrame) -> pd.DataFrame:
    """Per pings setting: how many quiet streams survived, how long they waited, when the cut ones ended."""
    rows = []
    for pings, group in keepalive.groupby("pings", sort=False):
        rows.append(
            {
                "pings": pings,
                "ping_interval_s": group.ping_interval_s.iloc[0],
                "read_timeout_s": group.read_timeout_s.iloc[0],
                "runs": len(group),
                "survived": int(group.survived.sum()),
                "median_wait_for_first_token_s": group.wait_for_first_token_s.median(),
                "median_longest_silence_s": group.longest_silence_s.median(),
                "median_ended_s": group.ended_s.median(),
                "median_pings_received": group.pings_received.median(),
            }
        )
    return pd.DataFrame(rows)


# --------------------------------------------------------------------------- report


def summary(tables: dict[str, pd.DataFrame]) -> dict[str, Any]:
    hold = tables["holdback"].set_index("condition")
    keep = tables["keepalive_summary"].set_index("pings")
    return {
        "holds_back": {c: bool(v) for c, v in hold.holds_back.items()},
        "median_delay_ms": {c: round(float(v), 2) for c, v in hold.median_delay_ms.items()},
        "max_delay_ms": {c: round(float(v), 2) for c, v in hold.max_delay_ms.items()},
        "keepalive_survived": {p: f"{int(r.survived)}/{int(r.runs)}" for p, r in keep.iterrows()},
    }


def report(tables: dict[str, pd.DataFrame]) -> str:
    """Stable text for any profile: did each condition hold events back where nginx should (and
    only there), and did pings (only) carry a quiet stream through the read timeout."""
    lines = []
    for row in tables["holdback"].itertuples():
        expected = EXPECTED_HOLD.get(row.condition)
        said = "holds events back" if row.holds_back else "passes events on at once"
        lines.append(
            f"{row.condition}: {said}"
            + ("" if bool(row.holds_back) == expected else f" (NOT as expected: {'held' if expected else 'not held'})")
        )
    for row in tables["keepalive_summary"].itertuples():
        want = "every quiet stream survived" if row.pings == "on" else "every quiet stream was cut"
        ok = row.survived == row.runs if row.pings == "on" else row.survived == 0
        got = want if ok else f"{int(row.survived)} of {int(row.runs)} quiet streams survived: NOT {want}"
        lines.append(f"pings {row.pings}, proxy_read_timeout {row.read_timeout_s:g} s: {got}")
    return "\n".join(lines)


def plot(tables: dict[str, pd.DataFrame]) -> list:
    from labkit.plots import new_figure

    events = tables["events"]
    first = events[events.repetition == events.repetition.min()]
    conditions = list(dict.fromkeys(events.condition))
    fig, (ax,) = new_figure("production_arrivals", width=8.0)
    for row, condition in enumerate(conditions):
        group = first[first.condition == condition]
        ax.plot(group.written_at, [row + 0.15] * len(group), "|", color="0.6", markersize=7)
        ax.plot(group.arrived_at, [row - 0.15] * len(group), "|", color="C0", markersize=7)
    ax.set_yticks(range(len(conditions)), conditions)
    ax.invert_yaxis()
    ax.set(
        xlabel="seconds since the request (grey: written by the server; blue: arrived at the client)",
        title="When each event arrived, through nginx and without it (first repetition)",
    )

    keep = tables["keepalive"]
    fig2, (ax2,) = new_figure("production_keepalive")
    for i, (_, group) in enumerate(keep.groupby("pings", sort=False)):
        colors = ["C2" if s else "C3" for s in group.survived]
        ax2.scatter([i] * len(group), group.ended_s, c=colors, zorder=3)
    ax2.axhline(keep.read_timeout_s.iloc[0], color="0.5", linestyle="--", label="proxy_read_timeout")
    ax2.set_xticks(range(keep.pings.nunique()), [f"pings {p}" for p in keep.pings.unique()])
    ax2.set_xlim(-0.5, keep.pings.nunique() - 0.5)
    ax2.set_ylim(bottom=0)
    ax2.set(ylabel="seconds until the stream ended", title="A quiet stream through nginx (green: done; red: cut)")
    ax2.legend()
    return [fig, fig2]


# --------------------------------------------------------------------------- readings


def readings(tables: dict[str, pd.DataFrame]) -> list[Any]:
    """The verdicts of notebook 08's proxy section, computed from the hold-back and keep-alive tables."""
    from labkit.experiments.readings import Verdict, span

    hold = tables["holdback"].set_index("condition")
    events = tables["events"]

    def held(c: str) -> bool | None:
        return bool(hold.loc[c, "holds_back"]) if c in hold.index else None

    def delays(c: str) -> str:
        per_rep = events[events.condition == c].groupby("repetition").delay.median() * 1000
        return span(per_rep, "{:.1f}", " ms")

    buffering = held("buffering-on-accel-ignored") is True and all(
        held(c) is False for c in ("buffering-off", "buffering-off-accel-ignored", "buffering-on") if c in hold.index
    )
    gzip = held("gzip-buffering-on-accel-ignored") is True and held("gzip-buffering-off") is False
    keep = tables["keepalive_summary"].set_index("pings")
    pings = (
        bool(keep.loc["on", "survived"] == keep.loc["on", "runs"] and keep.loc["off", "survived"] == 0)
        if {"on", "off"} <= set(keep.index)
        else False
    )
    return [
        Verdict(
            "nginx holds events back when it buffers",
            "With proxy_buffering on and X-Accel-Buffering ignored, nginx holds events back; with "
            "buffering off, or the service's X-Accel-Buffering: no honoured, it passes each on at once",
            "the buffered condition passes events on like the direct baseline, or an unbuffered one holds them",
            buffering,
            "median hold-back per repetition: "
            + "; ".join(
                f"{c} {delays(c)}"
                for c in (DIRECT, "buffering-on-accel-ignored", "buffering-off", "buffering-on")
                if c in hold.index
            ),
        ),
        Verdict(
            "gzip holds a buffered stream",
            "gzip on a buffered proxy holds events back; unbuffered, nginx flushes gzip on every read",
            "the buffered gzip condition is not held, or the unbuffered one is",
            gzip,
            "; ".join(
                f"{c} {delays(c)}" for c in ("gzip-buffering-on-accel-ignored", "gzip-buffering-off") if c in hold.index
            ),
        ),
        Verdict(
            "pings keep a quiet stream through the proxy",
            "A stream quieter than proxy_read_timeout survives with the service's pings and is cut without",
            "a quiet stream with pings is cut, or one without pings survives",
            pings,
            "; ".join(f"pings {p}: {int(r.survived)}/{int(r.runs)} survived" for p, r in keep.iterrows()),
        ),
    ]
