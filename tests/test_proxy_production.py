"""The production experiment, as a specification of what nginx does to a stream.

Real nginx, a real labkit server with tiny-gpt2, loopback only, small sizes. Skipped, saying
why, where nginx is not installed (``make system-deps`` installs it as root, as on CI).
"""
from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from labkit.experiments import production
from labkit.experiments.proxy import nginx_binary
from experiment_helpers import assert_columns, assert_figures_are_labelled

needs_nginx = pytest.mark.skipif(nginx_binary() is None,
                                 reason="nginx is not installed (make system-deps installs it as root)")
slow = pytest.mark.slow

BURST_CONDITIONS = ("direct", "buffering-on", "buffering-on-accel-ignored", "buffering-off-accel-ignored",
                    "gzip-buffering-on-accel-ignored", "gzip-buffering-off-accel-ignored",
                    "buffering-on-accel-ignored-http11")


def lab_nginx_processes() -> list[int]:
    """Live nginx processes started from one of the lab's temporary folders."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
                state = (entry / "stat").read_text().split(") ", 1)[1][0]
            except OSError:
                continue
            if "nginx" in cmdline and "labkit-nginx-" in cmdline and state != "Z":
                pids.append(int(entry.name))
    return pids


@pytest.fixture(scope="module")
def burst(tiny_gpt2):
    """One repetition of the burst probe over the conditions that tell the mechanisms apart."""
    from labkit.server import serve_in_thread

    config = production.Config(tokens=120, repetitions=1, conditions=BURST_CONDITIONS)
    with serve_in_thread(tiny_gpt2) as server:
        events = production.burst_probe(server, config)
    return events, production.holdback_summary(events).set_index("condition")


@pytest.fixture(scope="module")
def keepalive(tiny_gpt2):
    return production.keepalive_probe(tiny_gpt2, production.Config(keepalive_repetitions=1, blocker_tokens=120))


# --------------------------------------------------------------------------- the burst probe


@needs_nginx
@slow
def test_every_event_is_timed_at_both_ends_and_arrives_after_it_was_written(burst):
    events, _ = burst
    assert_columns(events, "condition", "repetition", "index", "written_at", "arrived_at", "delay")
    assert events.groupby("condition").size().to_dict() == {c: 120 for c in BURST_CONDITIONS}
    assert (events.groupby("condition")["index"].apply(list) == [list(range(120))] * len(BURST_CONDITIONS)).all()
    assert (events.delay > 0).all(), "an event arrived before the server wrote it: the clock is wrong"


@needs_nginx
@slow
def test_buffering_on_with_the_header_ignored_holds_events_back_and_releases_them_in_bursts(burst):
    _, summary = burst
    held, direct = summary.loc["buffering-on-accel-ignored"], summary.loc["direct"]
    assert held.holds_back and held.median_delay_ms > 20 * direct.median_delay_ms
    assert held.largest_burst >= 20 and held.reads_per_stream <= 120 / 20  # a 4 KiB buffer holds ~55 events


@needs_nginx
@slow
def test_without_buffering_or_with_the_service_header_honoured_events_pass_at_once(burst):
    _, summary = burst
    for condition in ("buffering-off-accel-ignored", "buffering-on", "buffering-on-accel-ignored-http11"):
        assert not summary.loc[condition, "holds_back"], condition
    assert summary.loc["buffering-off-accel-ignored", "median_delay_ms"] \
        < summary.loc["buffering-on-accel-ignored", "median_delay_ms"] / 20


@needs_nginx
@slow
def test_gzip_holds_the_stream_to_its_end_only_where_nginx_buffers(burst):
    _, summary = burst
    buffered, unbuffered = summary.loc["gzip-buffering-on-accel-ignored"], summary.loc["gzip-buffering-off-accel-ignored"]
    assert buffered.content_encoding == unbuffered.content_encoding == "gzip"
    assert buffered.holds_back and buffered.reads_per_stream == 1  # every event in one read, at the end
    assert not unbuffered.holds_back


# --------------------------------------------------------------------------- keep-alive


@needs_nginx
@slow
def test_pings_carry_a_quiet_stream_through_the_read_timeout_and_without_them_it_is_cut(keepalive):
    rows = keepalive.set_index("pings")
    on, off = rows.loc["on"], rows.loc["off"]
    timeout = on.read_timeout_s
    assert on.survived and on.tokens == 8 and on.wait_for_first_token_s > 1.5 * timeout  # quiet, yet alive
    assert on.pings_received >= 2 and on.longest_silence_s < timeout
    assert not off.survived and off.ended_by == "cut" and off.tokens == 0 and off.pings_received == 0
    assert timeout <= off.ended_s < on.wait_for_first_token_s  # cut by the proxy's timer, not by the end


@needs_nginx
@slow
def test_no_nginx_is_left_running_after_the_probes(burst, keepalive):
    assert lab_nginx_processes() == []


# --------------------------------------------------------------------------- the verdict and report


def _summary(medians: dict[str, float]) -> pd.DataFrame:
    return pd.DataFrame({"condition": list(medians), "median_delay_ms": list(medians.values())})


def test_the_verdict_compares_with_the_direct_baseline_and_a_floor():
    table = _summary({"direct": 0.5, "buffering-on": 4.0, "buffering-on-accel-ignored": 150.0})
    assert production.verdicts(table, floor_s=0.005) == [False, False, True]
    slow_direct = _summary({"direct": 20.0, "buffering-on-accel-ignored": 150.0})
    assert production.verdicts(slow_direct, floor_s=0.005) == [False, False]  # not 10x the baseline


def test_the_report_says_not_when_a_condition_or_a_keepalive_run_goes_the_other_way():
    holdback = pd.DataFrame({"condition": ["direct", "buffering-on-accel-ignored", "buffering-off"],
                             "holds_back": [False, True, False]})
    keep = pd.DataFrame({"pings": ["on", "off"], "read_timeout_s": [1.0, 1.0], "runs": [3, 3], "survived": [3, 0]})
    good = production.report({"holdback": holdback, "keepalive_summary": keep})
    assert "NOT" not in good and "buffering-on-accel-ignored: holds events back" in good
    holdback.loc[2, "holds_back"] = True
    keep.loc[1, "survived"] = 1
    bad = production.report({"holdback": holdback, "keepalive_summary": keep})
    assert "buffering-off: holds events back (NOT as expected: not held)" in bad
    assert "1 of 3 quiet streams survived: NOT every quiet stream was cut" in bad


def test_config_refuses_pings_that_are_not_below_the_read_timeout():
    with pytest.raises(ValueError, match="ping_interval"):
        production.Config(ping_interval=1.0, read_timeout=1.0)
    with pytest.raises(ValueError, match="conditions"):
        production.Config(conditions=("buffering-maybe",))


@needs_nginx
@slow
def test_tables_plot_and_report(burst, keepalive):
    events, summary = burst
    tables = {"events": events, "holdback": summary.reset_index(), "keepalive": keepalive,
              "keepalive_summary": production.keepalive_summary(keepalive)}
    assert "NOT" not in production.report(tables), production.report(tables)
    assert set(production.summary(tables)["keepalive_survived"].values()) == {"1/1", "0/1"}
    assert_figures_are_labelled(production, tables)
