"""Notebook 10, the browser's half (page-side clients: ``lab/static/edge.js``): :data:`SIX`, ten EventSources
and a fetch from one origin, HTTP/1.1 and HTTP/2; :data:`RULES`, EventSource's reconnects and what stops them;
:data:`AUTH`, a fetch reader whose token expires while it is away; :data:`CLOSE`, a tab closed behind nginx."""

from __future__ import annotations

import contextlib
import json
import secrets
import socket
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pandas as pd

import labkit.lab
from labkit.lab import Experiment, Request, Sizes, Trial, every, judge, seen, span, spread
from labkit.lab.components import Chromium, Components, Nginx, Route
from labkit.lab.target import free_port
from labkit.lab.witness import WaitTimeout, wait_for

SCRIPT = Path(labkit.lab.__file__).with_name("static") / "edge.js"
PROMPT = "The edge of the network is where"
SECRET = secrets.token_urlsafe(24)  # this run's lab servers sign their tokens with it
H1, H2 = "http/1.1", "h2 (nginx, TLS)"


def measure_six(trial: Trial) -> dict[str, Any]:
    kit, s = trial.state, trial.sizes
    kit.browser.open(f"{trial.target.url if trial.via == H1 else kit.nginx.base('app')}/healthz")
    bound = 4 * s.ticks * s.interval_s + 10
    page = kit.browser.call("edge.six", {"streamPath": f"lab/slow/async?n={s.ticks}&interval={s.interval_s}",
                                         "ticks": s.ticks, "count": s.streams, "fetchPath": "healthz",
                                         "timeoutMs": 1000 * bound}, bound + 5)  # fmt: skip
    trial.keep("streams", page["streams"])
    return dict(page["row"])


def six_verdicts(t: dict[str, pd.DataFrame], s: Sizes) -> list:
    rows = t["rows"][t["rows"].failed == 0]
    h1, h2 = rows[rows.via == H1], rows[rows.via == H2]
    return [
        judge("six per origin over HTTP/1.1", "six streams start before the first ends; the fetch waits", "another "
              "count, or the fetch first", every((h1.started_before_first_end == 6) & ~h1.fetch_before_first_end)
              and len(h1) == s.repetitions, f"started first {seen(h1.started_before_first_end)}", checked=True),
        judge("HTTP/2 multiplexes", "every stream and the fetch start before the first ends", "any one after it, or no "
              "h2", every((h2.started_before_first_end == s.streams) & h2.fetch_before_first_end & (h2.protocol == "h2"))
              and len(h2) == s.repetitions, f"started first {seen(h2.started_before_first_end)}", checked=True),
    ]  # fmt: skip


def six_plots(t: dict[str, pd.DataFrame], s: Sizes) -> list:
    from labkit.plots import new_figure, with_range

    fig, (ax,) = new_figure("edge_six")
    for via, g in t["first_event"].groupby("via"):
        with_range(ax, g.stream, g, "first_ms", fmt="o-", label=via)
    ax.set(xlabel="EventSource, in the order made", ylabel="ms to its first event", title="Ten streams, one origin")
    ax.legend(fontsize="small")
    return [fig]


SIX = Experiment(
    name="edge.six", title="Ten EventSources and a fetch from one origin: HTTP/1.1 against HTTP/2",
    sizes={p: {"streams": 10, "ticks": 4, "interval_s": 0.5, "repetitions": n} for p, n in (("full", 5), ("ci", 3))},
    conditions=lambda s, target: [{"via": H1}, {"via": H2}], measure=measure_six, needs=("lab",),
    prepare=lambda target, s: Components.start(browser=lambda: Chromium(insecure_tls=True, script=SCRIPT),
                                               nginx=lambda: Nginx([Route("app", target.url, buffering=False)], tls=True)),
    tables=lambda t, s: {"first_event": spread(t["streams"], ["via", "stream"], "first_ms")},
    verdicts=six_verdicts, plots=six_plots,
)  # fmt: skip


CUT, RETRY, GATEWAY, JSON = "cut, default retry", "cut, retry: set", "502 from the proxy", "200 application/json"


def measure_rules(trial: Trial) -> dict[str, Any]:
    kit, s, target = trial.state, trial.sizes, trial.target
    tag, row = uuid.uuid4().hex, {}
    if trial.case in (CUT, RETRY):  # a finished stream, replayed by the demo route with a cut after a few events
        done = target.read(Request("/v1/stream", {"prompt": PROMPT, "max_new_tokens": s.tokens, "ignore_eos": True, "resumable": True}))  # fmt: skip
        tag, token = str(done.request_id), done.events[0].data.get("resume_token")
        raw = target.read(target.resume_request(done), raw=True)
        row = {"resume_status": raw.status, "resume_type": raw.content_type, "resume_body": len(raw.body or "")}
        url = f"lab/demo/events/{tag}?token={token}&drop_after={s.drop_after}" + f"&retry={s.retry_ms}" * (trial.case == RETRY)  # fmt: skip
    else:
        url = f"{kit.nginx.base('gone')}/events?trial={tag}" if trial.case == GATEWAY else f"healthz?trial={tag}"
    kit.browser.open(f"{kit.nginx.base('app')}/healthz")
    page = kit.browser.call("edge.rules", {"url": url, "watchMs": 1000 * s.watch_s, "timeoutMs": 30_000}, 40)
    hits = [status for _, status, uri in kit.nginx.access_log() if tag in uri]
    return {**page["row"], **row, "requests": len(hits), "statuses": " ".join(map(str, hits))}


def rules_verdicts(t: dict[str, pd.DataFrame], s: Sizes) -> list:
    rows = t["rows"]
    cut = rows[rows.case.isin([CUT, RETRY])]

    def delays(case: str, low: float) -> tuple[bool | None, str]:
        g = rows[rows.case == case]
        both = pd.concat([g.cut_delay_ms, g.end_delay_ms]).dropna()
        spans = [span(g[f"{k}_delay_ms"], "{:.0f}", " ms") for k in ("cut", "end")]
        said = "after a cut {}, after the end {}".format(*spans)
        return None if both.empty else bool(low <= both.median() <= low + 500), said

    def closes(status: dict[str, str]) -> tuple[bool | None, str]:
        g = rows[rows.case.isin(list(status))]
        ok = (g.requests == 1) & (g.statuses == g.case.map(status)) & g.closed
        said = f"requests {seen(g.requests)}, {seen(g.statuses)}, closed {seen(g.closed)}"
        return every(ok) and len(g) == len(status) * s.repetitions, said

    return [
        judge("it reconnects and resumes", "after a cut and after the end, each event once, in order", "other than "
              "two opens", every((cut.opens == 2) & cut.in_order_once & (cut.events == s.tokens + 2)),
              f"opens {seen(cut.opens)}, events {seen(cut.events)}", checked=True),
        judge("a 204 stops it for good", "the reconnect after the end gets 204; no request follows", "a request "
              "after it", every((cut.requests == 3) & cut.statuses.str.endswith("204") & cut.closed),
              f"requests {seen(cut.requests)}", checked=True),
        judge("Chromium's default delay", "about three seconds", "a median outside 3000–3500 ms", *delays(CUT, 3000)),
        judge("retry: sets the delay", f"retry: {s.retry_ms}", f"a median outside {s.retry_ms}–{s.retry_ms + 500} ms",
              *delays(RETRY, s.retry_ms)),
        judge("a 502 or a wrong type closes it", "closed, no retry", "a second request",
              *closes({GATEWAY: "502", JSON: "200"}), checked=True),
        judge("the resume route's 204 comes first", "a bare 204 for a finished stream's last id", "another status, a "
              "body or a media type", every((cut.resume_status == 204) & (cut.resume_body == 0)
              & (cut.resume_type.fillna("") == "")), f"statuses {seen(cut.resume_status)}", checked=True),
    ]  # fmt: skip


RULES = Experiment(
    name="edge.rules", title="EventSource in Chromium: reconnect delays, and what stops it",
    sizes={p: {"tokens": 8, "drop_after": 4, "retry_ms": 300, "watch_s": 3.5, "repetitions": n}
           for p, n in (("full", 3), ("ci", 1))},
    conditions=lambda s, target: [{"case": c} for c in (CUT, RETRY, GATEWAY, JSON)], measure=measure_rules,
    prepare=lambda target, s: Components.start(browser=lambda: Chromium(script=SCRIPT), nginx=lambda: Nginx(
        [Route("app", target.url, buffering=False), Route("gone", f"http://127.0.0.1:{free_port()}")])),
    tables=lambda t, s: {"cases": spread(t["rows"], "case", ["opens", "requests", "cut_delay_ms", "end_delay_ms"])},
    verdicts=rules_verdicts, needs=("native", "lab"),
)  # fmt: skip


def measure_auth(trial: Trial) -> dict[str, Any]:
    kit, s = trial.state, trial.sizes
    kit.browser.open(f"{trial.target.url}/healthz")
    body = {"prompt": PROMPT, "max_new_tokens": s.tokens, "ignore_eos": True, "resumable": True}
    page = kit.browser.call("edge.auth", {"body": body, "ttl": s.ttl_s, "cutAfter": s.cut_after, "refresh": trial.refresh,
                                          "marginMs": 200, "timeoutMs": 30_000}, 60)  # fmt: skip
    return dict(page["row"])


def auth_verdicts(t: dict[str, pd.DataFrame], s: Sizes) -> list:
    rows = t["rows"]
    stale, fresh = rows[~rows.refresh.astype(bool)], rows[rows.refresh.astype(bool)]
    return [
        judge("without a refresh, a 401 ends it silently", "401 invalid_token; the reader ends short", "another "
              "answer, or a whole stream", every((stale.resume == 401) & stale.challenge.str.contains("invalid_token")
              & ~stale.done & (stale.tokens < s.tokens)), f"tokens {seen(stale.tokens)} of {s.tokens}", checked=True),
        judge("with a refresh, nothing lost", "every event once, in order, then done", "a lost or repeated event",
              every((fresh.resume == 200) & fresh.done & fresh.in_order_once & (fresh.tokens == s.tokens)),
              f"tokens {seen(fresh.tokens)} of {s.tokens}", checked=True),
    ]  # fmt: skip


AUTH = Experiment(
    name="edge.auth", title="A fetch reader with a bearer token that expires while it is away",
    sizes={p: {"tokens": 32, "cut_after": 5, "ttl_s": 1.0, "repetitions": n} for p, n in (("full", 3), ("ci", 2))},
    conditions=lambda s, target: [{"refresh": False}, {"refresh": True}], server=lambda s, c: {"auth_secret": SECRET},
    prepare=lambda target, s: Components.start(browser=lambda: Chromium(script=SCRIPT)), measure=measure_auth, verdicts=auth_verdicts,
    needs=("settings", "native"),
)  # fmt: skip


def measure_close(trial: Trial) -> dict[str, Any]:
    kit, s, target = trial.state, trial.sizes, trial.target
    blocker = hold_the_batch(target, s.block_tokens) if trial.moment == "queued" else None
    kit.browser.new_tab(f"{kit.nginx.base(trial.abort)}/healthz")
    body = {"prompt": PROMPT, "max_new_tokens": s.tokens, "ignore_eos": True}
    kit.browser.call("edge.stream", {"path": "v1/stream", "body": body}, 10)
    rid = wait_for(lambda: kit.browser.value("edge.state.request_id"), timeout=60, what="the tab's stream")
    record = lambda: target.records([rid])[0] or {}  # noqa: E731
    if blocker is None:  # leave by the server's count of tokens, not the page's
        wait_for(lambda: record().get("tokens_generated", 0) >= s.leave_after, timeout=60, what="a few tokens")
    at_close, closed = record().get("tokens_generated", 0), kit.browser.close_tab()
    if blocker is not None:  # hold the slot until labkit hears of the close (3 s at most)
        with contextlib.suppress(WaitTimeout):
            wait_for(lambda: record().get("closed"), timeout=3.0, what="the close to reach labkit")
        blocker.close()
    done = target.released([rid], timeout=60)[0] or {}
    since = {k: None if done.get(k) is None else 1e3 * (done[k] - closed) for k in ("closed", "released")}
    return {"tokens": done.get("tokens_generated"), "tokens_at_close": at_close, "finish_reason": done.get("finish_reason"),
            "closed_after_ms": since["closed"], "released_after_ms": since["released"]}  # fmt: skip


def hold_the_batch(target: Any, tokens: int) -> socket.socket:
    """A raw POST that holds the server's one batch slot until its socket is closed."""
    body = json.dumps({"prompt": PROMPT, "max_new_tokens": tokens, "ignore_eos": True}).encode()
    where = urlsplit(target.url)
    sock = socket.create_connection((where.hostname, where.port), timeout=10)
    sock.sendall(f"POST /v1/stream HTTP/1.1\r\nHost: {where.netloc}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(body)}\r\n\r\n".encode() + body)  # fmt: skip
    wait_for(lambda: target.stats()["running"] == 1, timeout=60, what="the blocker to run")
    return sock


def close_verdicts(t: dict[str, pd.DataFrame], s: Sizes) -> list:
    rows = t["rows"]

    def cell(moment: str, abort: str, ok: Any) -> tuple[bool | None, str]:
        g = rows[(rows.moment == moment) & rows.abort.isin(abort.split())]
        g = g[g.tokens_at_close == 0] if moment == "queued" else g  # queued when closed, as meant
        g = g.dropna(subset=["tokens"])  # a run whose record never came says nothing
        return every(ok(g)), f"tokens {seen(g.tokens)} of {s.tokens} in {len(g)} runs"

    return [
        judge("streaming: stopped, off or on", "nginx's next write fails, either way", "every token made",
              *cell("streaming", "off on", lambda g: g.tokens < s.tokens), checked=True),
        judge("queued, off: never admitted", "cancelled before its first token", "a token made",
              *cell("queued", "off", lambda g: g.tokens == 0), checked=True),
        judge("queued, on: admitted for no one", "tokens made after the tab is gone", "none, or all",
              *cell("queued", "on", lambda g: (g.tokens > 0) & (g.tokens < s.tokens)), checked=True),
    ]  # fmt: skip


CLOSE = Experiment(
    name="edge.close", title="A tab closed behind nginx, mid-stream or while queued: proxy_ignore_client_abort",
    # tokens: what follows the close must far outlast the 16 KB of a cancelled body that Chromium may still read
    # to reuse the socket (net/http/http_response_body_drainer.h): at 256 (~16 KB of events) CI once saw all made
    sizes={p: {"tokens": t, "leave_after": 8, "block_tokens": 480, "repetitions": n}
           for p, t, n in (("full", 1024, 3), ("ci", 480, 2))},
    conditions=lambda s, target: [{"moment": m, "abort": a} for m in ("streaming", "queued") for a in ("off", "on")],
    server=lambda s, c: {"max_batch": 1}, measure=measure_close, verdicts=close_verdicts, needs=("lab", "native", "settings"),
    prepare=lambda target, s: Components.start(browser=lambda: Chromium(script=SCRIPT), nginx=lambda: Nginx(
        [Route(a, target.variant(max_batch=1).url, ignore_client_abort=a == "on") for a in ("off", "on")])),
    tables=lambda t, s: {"close": spread(t["rows"], ["moment", "abort"], ["tokens", "closed_after_ms", "released_after_ms"])},
)  # fmt: skip
