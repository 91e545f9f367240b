"""Notebook 08's measurements as a specification: every verdict on small synthetic rows, both ways;
nginx and Chromium started and stopped for real (skipped, naming what is missing, where they are
not installed: ``make system-deps``); the drain on a process the lab started, and the proxy from
``labkit run --target`` (slow)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
from target_helpers import REPO, labkit_serve_process

from labkit.experiments import deadline, production, specs
from labkit.lab import NotMeasurable, Process, Stream, Target, run
from labkit.lab.profiles import Profile

needs_nginx = pytest.mark.skipif(shutil.which("nginx", path="/usr/sbin:/usr/bin") is None, reason="nginx not installed")
CI = Profile("ci")


def verdicts(spec: Any, tables: dict[str, pd.DataFrame], **sizes: Any) -> dict[str, str]:
    s = spec.sizes_for("ci", **sizes)
    return {v.name: v.outcome for v in spec.verdicts({**tables, **spec.tables(tables, s)}, s)}


def test_every_measurement_is_registered_and_sized_alike_for_both_profiles() -> None:
    assert [s.name for s in specs("production")] == [s.name for s in production.SPECS]
    for spec in production.SPECS:
        assert spec.group == "production" and set(spec.sizes["full"]) == set(spec.sizes["ci"]), spec.name


# --------------------------------------------------------------------------- nginx


def test_each_proxy_setting_is_a_route_with_exactly_its_settings() -> None:
    held = production.route("held", "http://127.0.0.1:9", *production.ROUTES["buffering-on-accel-ignored"]).location()
    for part in ("proxy_pass http://127.0.0.1:9/;", "proxy_buffering on;", "proxy_ignore_headers X-Accel-Buffering;",
                 "gzip off;", "proxy_http_version 1.0;"):  # fmt: skip
        assert part in held
    gzip = production.route(
        "z", "http://127.0.0.1:9", *production.ROUTES["gzip-buffering-off-accel-ignored"]
    ).location()
    assert "proxy_buffering off;" in gzip and "gzip on;" in gzip and "gzip_types text/event-stream" in gzip
    assert "proxy_http_version 1.1;" in production.route("h", "http://127.0.0.1:9", 1, 0, 0, "1.1").location()
    assert {production.ROUTES[r][:2] for r in production.HELD} == {(1, 0)}  # held: buffered, the header ignored


def proxy_rows(lag: dict[str, float], whole: bool = True) -> dict[str, pd.DataFrame]:
    rows = [{"repetition": r, "route": route, "whole": whole, "encoding": "identity", "median_lag": lag.get(route, 1.0),
             "max_lag": 2, "largest_burst": 1} for r in range(2) for route in production.ROUTES]  # fmt: skip
    return {"rows": pd.DataFrame(rows)}


def test_the_proxy_holds_where_it_buffers_and_not_elsewhere() -> None:
    held = {route: 30.0 for route in production.HELD}
    assert set(verdicts(production.PROXY, proxy_rows(held)).values()) == {"holds"}
    chunked = verdicts(production.PROXY, proxy_rows({**held, "buffering-on-accel-ignored-http11": 30.0}))
    assert chunked["nginx holds events back only where it buffers"] == "falsified"
    assert verdicts(production.PROXY, proxy_rows({}))["nginx holds events back only where it buffers"] == "falsified"
    assert verdicts(production.PROXY, proxy_rows(held, whole=False))["every stream whole through nginx"] == "falsified"


def test_a_tokens_lag_counts_a_hold_back_not_a_late_start_and_a_stall_lags_every_setting_alike() -> None:
    n, fast = 256, [float(i) for i in range(256)]
    late = [i + 16.0 for i in range(n)]  # admitted 16 steps later: its last 16 tokens come after the clock's end
    held = [float((i // 32 + 1) * 32) for i in range(n)]  # buffered: 32 tokens at a time
    stalled = [max(float(i), 100.0) if i < 120 else float(i) for i in range(n)]  # everything waits at 100
    clock = np.min([fast, late, held], axis=0)
    assert production.token_lags(clock, fast) == production.token_lags(clock, late) == [0] * n
    assert np.median(production.token_lags(clock, held)) >= 8 and max(production.token_lags(clock, held)) == 31
    alike = np.min([stalled, [t + 16.0 for t in stalled]], axis=0)
    assert production.token_lags(alike, [t + 16.0 for t in stalled]) == production.token_lags(alike, stalled)
    assert np.median(production.token_lags(alike, stalled)) == 0
    everything_at_the_end = [float(n)] * n
    assert np.median(production.token_lags(np.min([fast, everything_at_the_end], axis=0), everything_at_the_end)) >= 8


def keepalive(on: list[tuple[bool, float | None]], off: list[bool]) -> str:
    rows = [{"pings": "on", "survived": s, "quiet_s": q, "ended_s": q} for s, q in on]
    rows += [{"pings": "off", "survived": s, "quiet_s": None, "ended_s": 1.0} for s in off]
    return verdicts(production.KEEPALIVE, {"rows": pd.DataFrame(rows)})["pings keep a quiet stream through the proxy"]


def test_pings_keep_a_quiet_stream_only_when_it_was_quiet_longer_than_the_timeout() -> None:
    assert keepalive([(True, 3.0), (True, 2.5)], [False, False]) == "holds"
    assert keepalive([(True, 3.0), (False, None)], [False, False]) == "falsified"
    assert keepalive([(True, 3.0)], [True]) == "falsified"
    assert keepalive([(True, 0.5)], [False]) == "falsified"  # never quiet long enough to test anything


# --------------------------------------------------------------------------- the browser


def browser(delays: dict[int, float], lose: int | None = None) -> dict[str, str]:
    rows, events = [], []
    for retry in (0, 250, 1500):
        ids = [i for i in range(1, 27) if not (retry and i == lose)]
        rows.append({"repetition": 0, "cut_after": 8 if retry else 0, "retry_ms": retry, "ended_by": "done",
                     "connections": 2 if retry else 1, "reconnect_ms": delays.get(retry), "first_id_after":
                     9 if retry else None, "ids_once_in_order": ids == list(range(1, len(ids) + 1))})  # fmt: skip
        events += [{"repetition": 0, "retry_ms": retry, "id": str(i), "type": "token", "data": f"t{i}"} for i in ids]
    return verdicts(production.BROWSER, {"rows": pd.DataFrame(rows), "events": pd.DataFrame(events)})


def test_the_browser_resumes_exactly_unless_an_event_is_lost_and_retry_orders_the_delays() -> None:
    assert browser({250: 260, 1500: 1510}) == {"the browser resumes exactly": "holds",
                                               "retry: sets the reconnect delay": "holds"}  # fmt: skip
    assert browser({250: 260, 1500: 1510}, lose=12)["the browser resumes exactly"] == "falsified"
    assert browser({250: 240, 1500: 1510})["retry: sets the reconnect delay"] == "falsified"


# --------------------------------------------------------------------------- drain and metrics


def drain(types: list[str], ended: list[str], resumes: list[int], exit_code: int = 0) -> dict[str, str]:
    probes = [
        {"repetition": 0, "status": 503 if t in ("draining", "shutdown") else 200, "type": t, "retry_after": "1"}
        for t in types
    ] + [{"repetition": 0, "status": 0, "type": "refused at the socket", "retry_after": None}]
    streams = [{"repetition": 0, "stream": i, "resumable": i % 2 == 1, "ended_by": e} for i, e in enumerate(ended)]
    return verdicts(production.DRAIN, {"rows": pd.DataFrame([{"exit_code": exit_code, "exited_s": 3.1,
                    "drain_grace_s": 3.0}]), "probes": pd.DataFrame(probes), "streams": pd.DataFrame(streams),
                    "resumes": pd.DataFrame({"status": resumes})})  # fmt: skip


def test_a_drain_holds_with_draining_and_shutdown_answers_and_fails_on_anything_else() -> None:
    good = drain(["draining"] * 36 + ["shutdown"], ["done", "shutdown", "shutdown", "shutdown"], [404, 404])
    assert set(good.values()) == {"holds"}
    assert drain(["draining", "answered"], ["shutdown"] * 2, [404])["drain refuses new work"] == "falsified"
    assert drain(["shutdown"], ["shutdown"] * 2, [404])["drain refuses new work"] == "falsified"
    assert drain(["draining"], ["shutdown", "cut"], [404])["drain ends every open stream"] == "falsified"
    assert (
        drain(["draining"], ["shutdown"] * 2, [200])["a restarted process answers the resume with 404"] == "falsified"
    )
    assert drain(["draining"], ["shutdown"] * 2, [404], exit_code=1)["exits within its drain grace"] == "falsified"


def test_the_answers_table_counts_each_refusal_type_from_the_data() -> None:
    probes = pd.DataFrame(
        {"status": [503] * 37 + [0], "type": ["draining"] * 36 + ["shutdown", "refused at the socket"]}
    )
    counts = production.DRAIN.tables({"probes": probes}, production.DRAIN.sizes_for("ci"))["answers"]
    assert dict(zip(counts.type, counts.probes)) == {"draining": 36, "shutdown": 1, "refused at the socket": 1}


def watch(queued: list[int], after: dict[str, int], done: int = 24) -> dict[str, str]:
    marks = [{"mark": f"wave {i + 1}", "queued": q, "running": 4} for i, q in enumerate(queued)]
    scrapes = [{"mark": "", "queued": 0, "running": 4}, *marks, {"mark": "after", "queued": 0, "running": 0, **after}]
    base = {"repetition": 0, "t_s": 0.0, "open": 0, "kv_blocks": 0, "first_tokens": 24}
    rows = pd.DataFrame([{"repetition": 0, "requests": 24, "done": done}])
    return verdicts(production.WATCH, {"rows": rows, "scrapes": pd.DataFrame([{**base, **r} for r in scrapes])})


def test_the_metrics_show_a_queue_as_each_wave_fills_the_batch_and_account_for_every_stream() -> None:
    assert set(watch([4, 4, 4], {}).values()) == {"holds"}
    assert watch([4, 0, 4], {})["a queue shows while the batch is full"] == "falsified"
    assert watch([4, 4, 4], {"kv_blocks": 1})["the metrics account for every stream"] == "falsified"
    assert watch([4, 4, 4], {"first_tokens": 23})["the metrics account for every stream"] == "falsified"


# --------------------------------------------------------------------------- the deadline gate


def test_an_outcome_is_refused_met_or_missed_by_what_the_client_saw() -> None:
    refused = Stream(status=429, body={"error": {"type": "deadline_unreachable"}}, error="HTTP 429: late")
    met = Stream(status=200, completed=True, sent=0.0, ended=0.5)
    late = Stream(status=200, completed=True, sent=0.0, ended=1.5)
    left = Stream(status=200, sent=0.0, ended=1.0, left="fin")
    outcomes = [deadline.outcome(st, 1.0) for st in (refused, met, late, left, Stream(status=500, error="HTTP 500"))]
    assert outcomes == ["refused", "met", "missed", "missed", "error"]


def test_the_gate_verdict_needs_every_probe_to_go_its_way() -> None:
    good = {("certain miss", True): "refused", ("certain miss", False): "missed", ("ample room", True): "met"}
    for wrong in [{("certain miss", True): "met"}, {("certain miss", False): "met"}, {("ample room", True): "refused"}]:
        rows = pd.DataFrame([{"probe": p, "gate": g, "outcome": o} for (p, g), o in {**good, **wrong}.items()])
        assert verdicts(deadline.GATE, {"rows": rows}) == {"the gate refuses only what would miss": "falsified"}
    rows = pd.DataFrame([{"probe": p, "gate": g, "outcome": o} for (p, g), o in good.items()])
    assert verdicts(deadline.GATE, {"rows": rows}) == {"the gate refuses only what would miss": "holds"}


@pytest.mark.slow
def test_each_gate_probe_keeps_the_gates_own_reading_and_a_certain_miss_is_predicted_far_past_its_deadline(
        tmp_path, monkeypatch, tiny_gpt2) -> None:  # fmt: skip
    """The row says what the gate predicted and did, so a probe that goes the wrong way names its cause;
    behind a batch FILL times as long, the prediction is several deadlines away, gate on or off."""
    from labkit.lab import LocalLab

    monkeypatch.setenv("LABKIT_OUT", str(tmp_path))
    with LocalLab(tiny_gpt2) as lab:
        rows = run(deadline.GATE, lab, profile=CI, show=False, repetitions=1).tables["rows"]
    assert len(rows) == 3 and rows.gate_refused.tolist() == (rows.outcome == "refused").tolist()
    certain = rows[rows.probe == "certain miss"]
    assert (certain.predicted_s > deadline.FILL / 2 * certain.solo_s).all(), certain.to_string()


def goodput(on: list[float], off: list[float]) -> str:
    rows = [{"gate": gate, "repetition": r, "load": 2.0, "offered": 2.0, "goodput": g / 10, "met": g}
            for gate, gs in ((True, on), (False, off)) for r, g in enumerate(gs)]  # fmt: skip
    return verdicts(deadline.GOODPUT, {"rows": pd.DataFrame(rows)})["the gate raises goodput above the service rate"]


def test_goodput_is_judged_on_the_interval_of_paired_ratios() -> None:
    assert goodput([9, 8, 9, 9, 8, 9], [5, 4, 6, 5, 4, 5]) == "holds"
    assert goodput([5, 4, 6, 5, 4, 5], [9, 8, 9, 9, 8, 9]) == "falsified"
    assert goodput([9, 8, 9], [5, 4, 6]) == "unclear"  # three pairs cannot bound a median
    assert goodput([5, 3, 6, 5, 4, 5], [0, 1, 2, 1, 1, 1]) == "holds"  # none met without the gate: still finite
    assert goodput([5, 0, 6, 5, 4, 5], [0, 0, 2, 1, 1, 1]) == "unclear"  # none met on either side: a ratio of 1


# --------------------------------------------------------------------------- real runs


@pytest.mark.slow
def test_the_drain_on_a_process_the_lab_started_holds_its_checked_verdicts() -> None:
    server = Process.labkit("tiny-gpt2", max_batch=2, policy="pause", pad_bytes=16384, sndbuf=4096, drain_grace=3.0,
                            log_level="warning")  # fmt: skip
    try:
        result = run(production.DRAIN, server, profile=CI, save=False, show=False, repetitions=1)
    finally:
        server.close()
    assert result.checked().splitlines() == [
        f"{name}: holds"
        for name in (
            "drain ends every open stream",
            "drain refuses new work",
            "a restarted process answers the resume with 404",
        )
    ]


@pytest.mark.slow
def test_labkit_run_measures_the_proxy_in_front_of_labkit_in_its_own_process(tmp_path: Path) -> None:
    if shutil.which("nginx", path="/usr/sbin:/usr/bin") is None:
        pytest.skip("nginx not installed")
    with labkit_serve_process("--lab-routes") as (url, _):
        done = subprocess.run([sys.executable, "-m", "labkit.cli", "run", "production.proxy", "--target", url,
                               "--api", "labkit", "--profile", "ci", "--set", "repetitions=1", "--no-figures"],
                              cwd=REPO, env={**__import__("os").environ, "LABKIT_OUT": str(tmp_path)},
                              capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    verdict_rows = done.stdout.rsplit("hypothesis", 1)[-1]  # the verdict table's rows, below its header
    assert "every stream whole through nginx" in verdict_rows and "falsified" not in verdict_rows


def test_a_target_the_lab_cannot_restart_makes_the_drain_not_measurable() -> None:
    with pytest.raises(NotMeasurable, match="the lab did not start it"):
        production.drain_server(Target("http://127.0.0.1:9"), production.DRAIN.sizes_for("ci"))
