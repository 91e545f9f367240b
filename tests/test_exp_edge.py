"""Notebook 10's measurements as a specification: each verdict read from synthetic rows, once where
it holds and once where the data falsify it, so none can only ever say "holds". The measurements
themselves (Chromium, nginx, redis-server, processes) run in the notebook under nbval, and the
components they start are tested in test_lab_components.py."""
from __future__ import annotations

from typing import Any

import pandas as pd
import pytest

from labkit.experiments import edge, specs
from labkit.experiments.edge_browser import CUT, GATEWAY, H1, H2, JSON, RETRY


def outcomes(spec: Any, rows: list[dict[str, Any]], profile: str = "ci", **kept: pd.DataFrame) -> dict[str, str]:
    sizes = spec.sizes_for(profile)
    tables = {"rows": pd.DataFrame(rows), **kept}
    tables.update(spec.tables(tables, sizes))
    return {v.name: v.outcome for v in spec.verdicts(tables, sizes)}


def reps(n: int, **row: Any) -> list[dict[str, Any]]:
    return [{**row, "repetition": r} for r in range(n)]


def test_the_edge_group_holds_eight_measurements_with_the_same_sizes_in_both_profiles():
    assert [s.name for s in specs("edge")] == [s.name for s in edge.SPECS] and len(edge.SPECS) == 8
    for spec in edge.SPECS:
        assert spec.group == "edge" and set(spec.sizes["ci"]) == set(spec.sizes["full"]), spec.name
    assert edge.STORM.sizes["ci"]["clients"] >= 200  # the storm is a herd in both profiles
    assert edge.STORM.scale(edge.STORM.sizes_for("full")).loc["model", "why it differs"]  # the tiny model, said


# --------------------------------------------------------------------------- browser


def six_rows(h1_started: int = 6, h1_fetch_first: bool = False, h2_protocol: str = "h2") -> list[dict[str, Any]]:
    return (reps(3, via=H1, protocol="http/1.1", started_before_first_end=h1_started, fetch_before_first_end=h1_fetch_first,
                 failed=0, fetch_ms=1500.0)
            + reps(3, via=H2, protocol=h2_protocol, started_before_first_end=10, fetch_before_first_end=True, failed=0,
                   fetch_ms=5.0))  # fmt: skip


def streams_table() -> pd.DataFrame:
    return pd.DataFrame([{"via": via, "repetition": 0, "stream": i, "first_ms": 5.0} for via in (H1, H2)
                         for i in range(1, 11)])  # fmt: skip


def test_six_per_origin_holds_for_six_streams_and_a_waiting_fetch_and_fails_otherwise():
    assert set(outcomes(edge.SIX, six_rows(), streams=streams_table()).values()) == {"holds"}
    assert outcomes(edge.SIX, six_rows(h1_started=7), streams=streams_table())["six per origin over HTTP/1.1"] == "falsified"
    assert outcomes(edge.SIX, six_rows(h1_fetch_first=True), streams=streams_table())[
        "six per origin over HTTP/1.1"] == "falsified"
    assert outcomes(edge.SIX, six_rows(h2_protocol="http/1.1"), streams=streams_table())["HTTP/2 multiplexes"] == "falsified"


def rules_rows(cut_requests: int = 3, gateway_requests: int = 1, delay: float = 3010.0) -> list[dict[str, Any]]:
    session = {"opens": 2, "events": 10, "in_order_once": True, "closed": True, "resume_status": 204, "resume_type": "",
               "resume_body": 0, "requests": cut_requests, "statuses": "200 200 204"}  # fmt: skip
    closed = {"opens": 0, "events": 0, "in_order_once": True, "closed": True, "cut_delay_ms": None, "end_delay_ms": None}
    n = edge.RULES.sizes_for("ci").repetitions  # the closes check counts every repetition's rows
    return (reps(n, case=CUT, cut_delay_ms=delay, end_delay_ms=delay, **session)
            + reps(n, case=RETRY, cut_delay_ms=310.0, end_delay_ms=309.0, **session)
            + reps(n, case=GATEWAY, requests=gateway_requests, statuses=" ".join(["502"] * gateway_requests), **closed)
            + reps(n, case=JSON, requests=1, statuses="200", **closed))  # fmt: skip


def test_eventsource_rules_hold_on_their_counts_and_each_fails_on_its_own():
    assert set(outcomes(edge.RULES, rules_rows()).values()) == {"holds"}
    assert outcomes(edge.RULES, rules_rows(cut_requests=4))["a 204 stops it for good"] == "falsified"
    assert outcomes(edge.RULES, rules_rows(gateway_requests=2))["a 502 or a wrong type closes it"] == "falsified"
    assert outcomes(edge.RULES, rules_rows(delay=5000.0))["Chromium's default delay"] == "falsified"


def auth_rows(stale_resume: int = 401, fresh_tokens: int = 32) -> list[dict[str, Any]]:
    stale = {"post": 200, "resume": stale_resume, "challenge": 'Bearer realm="labkit", error="invalid_token"',
             "ended": f"http {stale_resume}", "tokens": 4, "done": False, "in_order_once": True}
    fresh = {"post": 200, "resume": 200, "challenge": "", "ended": "end", "tokens": fresh_tokens, "done": True,
             "in_order_once": True}
    return reps(2, refresh=False, **stale) + reps(2, refresh=True, **fresh)


def test_an_expired_token_ends_the_reader_and_a_refreshed_one_completes_it():
    assert set(outcomes(edge.AUTH, auth_rows()).values()) == {"holds"}
    assert outcomes(edge.AUTH, auth_rows(stale_resume=200))["without a refresh, a 401 ends it silently"] == "falsified"
    assert outcomes(edge.AUTH, auth_rows(fresh_tokens=31))["with a refresh, nothing lost"] == "falsified"


def close_rows(queued_on_tokens: int = 3, queued_off_tokens: int = 0, streaming_tokens: int = 60) -> list[dict]:
    def cell(moment: str, abort: str, tokens: int) -> list[dict[str, Any]]:
        return reps(2, moment=moment, abort=abort, tokens=tokens, tokens_at_close=8 if moment == "streaming" else 0,
                    finish_reason="cancelled", closed_after_ms=50.0, released_after_ms=60.0)  # fmt: skip

    return (cell("streaming", "off", streaming_tokens) + cell("streaming", "on", streaming_tokens)
            + cell("queued", "off", queued_off_tokens) + cell("queued", "on", queued_on_tokens))  # fmt: skip


def test_a_closed_tab_stops_the_work_except_a_queued_request_behind_ignore_client_abort():
    assert set(outcomes(edge.CLOSE, close_rows()).values()) == {"holds"}
    assert outcomes(edge.CLOSE, close_rows(streaming_tokens=edge.CLOSE.sizes_for("ci").tokens))["streaming: stopped, off or on"] == "falsified"
    assert outcomes(edge.CLOSE, close_rows(queued_off_tokens=2))["queued, off: never admitted"] == "falsified"
    assert outcomes(edge.CLOSE, close_rows(queued_on_tokens=0))["queued, on: admitted for no one"] == "falsified"


def test_a_queued_run_that_was_admitted_before_the_close_is_not_counted_as_queued():
    rows = close_rows()
    for row in rows:
        if row["moment"] == "queued" and row["abort"] == "off" and row["repetition"] == 1:
            row.update(tokens_at_close=5, tokens=9)  # the blocker had ended: not what the condition means
    assert outcomes(edge.CLOSE, rows)["queued, off: never admitted"] == "holds"


# --------------------------------------------------------------------------- no browser


def storm_rows(jitter_peak: int = 12, jitter_503: int = 0, whole: int = 200, fixed_503: int = 150) -> list[dict[str, Any]]:
    common = {"attempts": 2000, "no_server": 1500, "up_s": 10.0, "last_served_s": 3.0, "whole": whole, "replayed": 0}
    return (reps(1, policy="fixed", peak_per_100ms=140, refused_503=fixed_503, **common)
            + reps(1, policy="jitter", peak_per_100ms=jitter_peak, refused_503=jitter_503, **common))


def test_the_storm_verdicts_compare_the_policies_and_count_whole_clients():
    assert set(outcomes(edge.STORM, storm_rows()).values()) == {"holds"}
    assert outcomes(edge.STORM, storm_rows(jitter_peak=90))["jitter flattens the herd"] == "falsified"
    assert outcomes(edge.STORM, storm_rows(jitter_503=150))["jitter meets fewer refusals"] == "falsified"
    assert outcomes(edge.STORM, storm_rows(whole=199))["every client whole"] == "falsified"
    # a fixed delay the cap never refused leaves nothing for jitter to reduce: no power, not a falsification
    assert outcomes(edge.STORM, storm_rows(fixed_503=0))["jitter meets fewer refusals"] == "unclear"


@pytest.mark.parametrize(("redis", "memory", "broken"), [
    ({"resume": 200, "in_order_once": False, "ended_with": "error"}, {"resume": 404}, "Redis: resumed with nothing lost"),
    ({"resume": 200, "in_order_once": True, "ended_with": "error"}, {"resume": 200}, "memory: forgotten"),
])  # fmt: skip
def test_a_restart_verdict_fails_when_its_store_does_not_do_what_it_claims(redis, memory, broken):
    good = {"resume": 200, "in_order_once": True, "ended_with": "error"}
    assert set(outcomes(edge.RESTART, [{"store": "redis", **good}, {"store": "memory", "resume": 404}]).values()) == {"holds"}
    assert outcomes(edge.RESTART, [{"store": "redis", **redis}, {"store": "memory", **memory}])[broken] == "falsified"


def thread_rows(waiting_at_40: int = 1, waiting_at_39: int = 0, slow_ms: float = 400.0) -> list[dict[str, Any]]:
    rows = []
    for kind in ("sync", "async"):
        for n in (0, 20, 39, 40):
            sync_at_40 = kind == "sync" and n == 40
            rows += reps(6, kind=kind, open=n, borrowed=n if kind == "sync" else 0, async_health_ms=40.0,
                         sync_health_ms=slow_ms if sync_at_40 else 30.0,
                         waiting=waiting_at_40 if sync_at_40 else waiting_at_39 if kind == "sync" and n == 39 else 0)  # fmt: skip
    return rows


def test_forty_sync_streams_queue_the_sync_route_and_nothing_else_waits():
    assert set(outcomes(edge.THREADS, thread_rows()).values()) == {"holds"}
    assert outcomes(edge.THREADS, thread_rows(waiting_at_40=0))["forty sync streams queue a sync route"] == "falsified"
    assert outcomes(edge.THREADS, thread_rows(waiting_at_39=1))["otherwise nothing waits"] == "falsified"
    assert outcomes(edge.THREADS, thread_rows(slow_ms=60.0))["the sync route pays"] == "falsified"


def gzip_rows(default_stream: str = "identity", bunched: int = 0) -> list[dict[str, Any]]:
    common = {"events": 10, "wire_bytes_per_event": 37.0, "max_gap_ms": 205.0}
    return (reps(2, gzip="off", stream_coding="identity", plain_coding="identity", bunched=0, **common)
            + reps(2, gzip="default", stream_coding=default_stream, plain_coding="gzip", bunched=0, **common)
            + reps(2, gzip="events", stream_coding="gzip", plain_coding="gzip", bunched=bunched, **common))


def test_gzip_verdicts_see_the_stream_exclusion_and_any_event_held_back():
    assert set(outcomes(edge.GZIP, gzip_rows()).values()) == {"holds"}
    assert outcomes(edge.GZIP, gzip_rows(default_stream="gzip"))["default leaves streams alone"] == "falsified"
    assert outcomes(edge.GZIP, gzip_rows(bunched=9))["gzip per event holds nothing back"] == "falsified"
