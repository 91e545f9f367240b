"""A browser as the client: headless Chromium streams from the service's demo page.

The page (``GET /lab/demo``, :mod:`labkit.service.lab_demo`) follows a resumable stream with
``EventSource`` and records every event's id and arrival time in ``window.labkitDemo``; Selenium
drives the system's Chromium through the system's chromedriver (nothing is downloaded).

Three conditions, repetitions interleaved: ``uninterrupted`` (the reference, with the ``fetch``
panel streaming the POST route beside it), and the server cutting the connection after event
``drop_after`` with ``retry:`` set to each of ``retries_ms``. The browser must reconnect by
itself (``Last-Event-ID``: the first event on the new connection is ``drop_after + 1``) and end
with exactly the events of the uninterrupted run; the delay between the cut (the page's network
error) and the new connection's ``open`` is the reconnect delay, which ``retry:`` should set.
Times are the page's ``performance.now()`` milliseconds.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import pandas as pd

from labkit.experiments.profiles import Profile
from labkit.experiments.progress import Progress, doing, tick
from labkit.experiments.readings import Verdict, current_step, fetch_steps, interleaved, span
from labkit.experiments.servers import serving
from labkit.experiments.waiting import WaitTimeout, wait_for

NAME = "browser"
CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
UNINTERRUPTED = "uninterrupted"


@dataclass(frozen=True)
class Config:
    model: str = "tiny-gpt2"
    tokens: int = 24  # per stream (ignore_eos)
    drop_after: int = 8  # the server cuts the first connection after this event id
    retries_ms: tuple[int, ...] = (250, 1500)  # the server's retry: values compared
    repetitions: int = 3
    prompt: str = "The stream reached the browser"
    timeout: float = 60.0  # bounds one page's run

    @classmethod
    def for_profile(cls, profile: Profile) -> Config:
        return cls(model=profile.model)

    def __post_init__(self) -> None:
        if not 1 <= self.drop_after < self.tokens + 1:
            raise ValueError(f"browser.Config.drop_after must be within the stream, got {self.drop_after!r}")
        if min(self.repetitions, self.tokens) < 1 or not self.retries_ms:
            raise ValueError("browser.Config: repetitions, tokens and retries_ms must be set")

    @property
    def conditions(self) -> tuple[str, ...]:
        return (UNINTERRUPTED, *(f"drop, retry {ms} ms" for ms in self.retries_ms))


def missing() -> str | None:
    """Why the browser experiment cannot run here, or None."""
    absent = [p for p in (CHROMIUM, CHROMEDRIVER) if not Path(p).exists()]
    try:
        import selenium  # noqa: F401
    except ImportError:
        absent.append("the Python package selenium (pip install selenium)")
    if absent:
        return "missing: " + ", ".join(absent) + " (make system-deps installs chromium and chromium-driver as root)"
    return None


@contextlib.contextmanager
def headless_chromium(width: int = 1000, height: int = 900) -> Iterator[Any]:
    """A Selenium driver on the system's Chromium and chromedriver; quit (both processes) after."""
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = CHROMIUM
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--disable-gpu",
        f"--window-size={width},{height}",
        "--no-first-run",
        "--disable-extensions",
    ):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def units(config: Config) -> int:
    return len(config.conditions) * config.repetitions


def run(
    config: Config, *, server: Any = None, progress: Progress | None = None, screenshot: Path | None = None
) -> dict[str, pd.DataFrame]:
    reason = missing()
    if reason:
        raise RuntimeError(f"the browser experiment cannot run: {reason}")
    events, connections, runs = [], [], []
    shot_taken = False
    with serving(server, model=config.model) as srv, headless_chromium() as driver:
        first_step = current_step(srv.url)
        for rep, condition in interleaved(config.conditions, config.repetitions):
            doing(progress, f"{condition}, repetition {rep + 1}/{config.repetitions}")
            retry = None if condition == UNINTERRUPTED else config.retries_ms[config.conditions.index(condition) - 1]
            page = open_page(driver, srv.url, config, retry)
            for e in page["eventsource"]["events"]:
                events.append({"condition": condition, "repetition": rep, "client": "eventsource", **e})
            if page.get("fetch"):
                for e in page["fetch"]["events"]:
                    events.append({"condition": condition, "repetition": rep, "client": "fetch", **e})
            for c in page["eventsource"]["connections"]:
                connections.append({"condition": condition, "repetition": rep, **c})
            runs.append(run_row(condition, rep, retry, page["eventsource"], config))
            if screenshot is not None and not shot_taken and condition != UNINTERRUPTED:
                screenshot.parent.mkdir(parents=True, exist_ok=True)
                driver.save_screenshot(str(screenshot))
                shot_taken = True
            tick(progress, runs=runs)
        steps = fetch_steps(srv.url, since=first_step)  # the engine's steps of this run
    events_t = pd.DataFrame(events)
    runs_t = pd.DataFrame(runs)
    runs_t["same_as_uninterrupted"] = same_as_reference(events_t, runs_t)
    return {"events": events_t, "connections": pd.DataFrame(connections), "runs": runs_t, "steps": steps}


def open_page(driver: Any, base: str, config: Config, retry: int | None) -> dict[str, Any]:
    query: dict[str, Any] = {"prompt": config.prompt, "max_new_tokens": config.tokens}
    if retry is None:
        query["mode"] = "both"
    else:
        query |= {"mode": "eventsource", "retry": retry, "drop_after": config.drop_after}
    driver.get(f"{base}/lab/demo?{urlencode(query)}")
    wanted = ["eventsource"] + (["fetch"] if retry is None else [])
    script = (
        "const d = window.labkitDemo; return JSON.stringify(d ? {eventsource: d.eventsource, fetch: d.fetch} : {});"
    )
    pages: list[dict[str, Any]] = []

    def finished() -> dict[str, Any]:
        pages.append(json.loads(driver.execute_script(script)))
        page = pages[-1]
        done = all(page.get(w) and (page[w].get("finished") or page[w].get("failure")) for w in wanted)
        return page if done else {}

    try:
        return wait_for(finished, timeout=config.timeout, what="the demo page to finish", interval=0.05)
    except WaitTimeout as exc:
        raise RuntimeError(f"the page did not finish within {config.timeout} s: {pages[-1]}") from exc


def _content(events: list[dict[str, Any]]) -> list[tuple[str, str, str]]:
    """What must match between runs: id, type and data, less the per-request start payload."""
    return [(str(e["id"]), e["type"], "" if e["type"] == "start" else e["data"]) for e in events]


def run_row(condition: str, rep: int, retry: int | None, page: dict[str, Any], config: Config) -> dict[str, Any]:
    conns = page["connections"]
    opens = [c["t"] for c in conns if c["kind"] == "open"]
    cuts = [c["t"] for c in conns if c["kind"] == "network-error"]
    events = page["events"]
    delay = opens[1] - cuts[0] if len(opens) >= 2 and cuts else None
    after_reopen = [e for e in events if len(opens) >= 2 and e["t"] >= opens[1]]
    ids = [int(e["id"]) for e in events if str(e["id"]).isdigit()]
    return {
        "condition": condition,
        "repetition": rep,
        "retry_ms": retry,
        "ended_by": page.get("ended_by"),
        "events": len(events),
        "tokens": sum(e["type"] == "token" for e in events),
        "connections": len(opens),
        "reconnect_delay_ms": delay,
        "first_id_after_reconnect": int(after_reopen[0]["id"]) if after_reopen else None,
        "ids_in_order_once": ids == list(range(1, len(ids) + 1)),
        "stream_ms": events[-1]["t"] - events[0]["t"] if events else None,
    }


def same_as_reference(events: pd.DataFrame, runs: pd.DataFrame) -> list[bool]:
    es = events[events.client == "eventsource"]
    ref_rows = es[es.condition == UNINTERRUPTED]
    ref = _content(ref_rows[ref_rows.repetition == ref_rows.repetition.min()].to_dict("records"))
    out = []
    for row in runs.itertuples():
        mine = es[(es.condition == row.condition) & (es.repetition == row.repetition)]
        out.append(_content(mine.to_dict("records")) == ref)
    return out


# --------------------------------------------------------------------------- readings


def verdicts(tables: dict[str, pd.DataFrame], config: Config) -> list[Verdict]:
    runs = tables["runs"]
    drops = runs[runs.condition != UNINTERRUPTED]
    resumed = bool(
        len(drops)
        and (drops.connections == 2).all()
        and (drops.first_id_after_reconnect == config.drop_after + 1).all()
        and drops.same_as_uninterrupted.all()
        and runs.ids_in_order_once.all()
    )
    fetch = tables["events"][tables["events"].client == "fetch"]
    ref = tables["events"][(tables["events"].client == "eventsource") & (tables["events"].condition == UNINTERRUPTED)]
    same_fetch = all(
        _content(fetch[fetch.repetition == r].to_dict("records"))
        == _content(ref[ref.repetition == r].to_dict("records"))
        for r in ref.repetition.unique()
    )
    med = drops.groupby("retry_ms").reconnect_delay_ms.median()
    lo, hi = (min(config.retries_ms), max(config.retries_ms))
    delays_follow = bool(
        len(med) == len(config.retries_ms)
        and all(med[r] >= r for r in config.retries_ms)
        and med[hi] - med[lo] >= 0.5 * (hi - lo)
    )
    spans = "; ".join(
        f"retry {int(r)} ms: reconnect after {span(g.reconnect_delay_ms, '{:.0f}', ' ms')}"
        for r, g in drops.groupby("retry_ms")
    )
    return [
        Verdict(
            "browser resumes exactly",
            "Cut mid-stream, the browser's EventSource reconnects by itself with Last-Event-ID and ends "
            "with exactly the events of the uninterrupted run",
            "any cut run ends with other events, a repeat or a gap, or without a second connection that "
            "starts right after the cut",
            resumed,
            f"{int(drops.same_as_uninterrupted.sum())} of {len(drops)} cut runs equal the uninterrupted one; "
            f"first id after the reconnect: {sorted(set(drops.first_id_after_reconnect.dropna().astype(int)))}",
        ),
        Verdict(
            "fetch and EventSource agree",
            "The POST route read with fetch gives the same events as the GET route read with EventSource",
            "any difference in ids, types or data",
            bool(same_fetch and len(fetch)),
            f"{len(fetch)} fetch events over {ref.repetition.nunique()} runs",
        ),
        Verdict(
            "retry sets the reconnect delay",
            "The server's retry: value sets how long the browser waits before it reconnects",
            "a median delay below its retry value, or the two medians closer than half the retry difference",
            delays_follow,
            spans,
        ),
    ]


def summary(tables: dict[str, pd.DataFrame]) -> dict[str, Any]:
    runs = tables["runs"]
    drops = runs[runs.condition != UNINTERRUPTED]
    return {
        "cut_runs_equal_uninterrupted": f"{int(drops.same_as_uninterrupted.sum())}/{len(drops)}",
        "reconnect_delay_ms": {
            int(r): [round(float(x), 1) for x in g.reconnect_delay_ms] for r, g in drops.groupby("retry_ms")
        },
    }


def plot(tables: dict[str, pd.DataFrame]) -> list:
    from labkit.plots import new_figure

    events, runs, conns = tables["events"], tables["runs"], tables["connections"]
    es = events[events.client == "eventsource"]
    fig, (ax,) = new_figure("browser_reconnect", width=8.0)
    rows = list(runs[["condition", "repetition"]].itertuples(index=False))
    for i, (condition, rep) in enumerate(rows):
        mine = es[(es.condition == condition) & (es.repetition == rep)]
        t0 = mine.t.min()
        ax.plot(mine.t - t0, [i] * len(mine), "|", color="C0", markersize=8)
        for c in conns[(conns.condition == condition) & (conns.repetition == rep)].itertuples():
            ax.plot(
                c.t - t0,
                i,
                "x" if c.kind == "network-error" else "o",
                color="C3" if c.kind != "open" else "C2",
                markersize=6,
                fillstyle="none",
            )
    ax.set_yticks(range(len(rows)), [f"{c} #{r + 1}" for c, r in rows])
    ax.invert_yaxis()
    ax.set(
        xlabel="ms since the first event (| event, o connection opened, x connection cut)",
        title="EventSource in headless Chromium: cut mid-stream, reconnected by itself",
    )
    return [fig]


def screenshot_path(profile: Profile) -> Path:
    return profile.figures_dir / "browser_demo.png"


def chromium_version() -> str | None:
    exe = shutil.which("chromium") or (CHROMIUM if Path(CHROMIUM).exists() else None)
    if not exe:
        return None
    import subprocess

    try:
        return subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=20).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def report(tables: dict[str, pd.DataFrame], config: Config) -> str:
    """Numbers-free lines for an nbval-checked cell: the verdicts that hold on any profile
    (the reconnect delay is a timing, and stays in the unchecked table)."""
    from labkit.experiments.readings import verdict_lines

    return verdict_lines(v for v in verdicts(tables, config) if v.name != "retry sets the reconnect delay")
