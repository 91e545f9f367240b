"""Notebook 05's measurement (``labkit.experiments.slowclient``) as a specification.

Its verdicts on rows made by hand, each one both ways; the time a stream spent paused read from
the hub's record of its moves; the sizes it refuses; the two small additions it reads (the hub
dates every move of a stream, the client counts its reads); and one run of ``labkit run
slowclient`` against labkit in a process of its own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pandas as pd
import pytest
from target_helpers import REPO, labkit_serve_process

from labkit.experiments import slowclient
from labkit.hub.stream import Stream as HubStream
from labkit.hub.stream import StreamRecord, StreamState
from labkit.lab import Caps, ReadOptions, Request, Target, run_sync
from labkit.lab.client import read

SIZES = slowclient.POLICIES.sizes_for("ci")


def rows(done: dict[str, dict[int, float]], reps: int = 3, steps: dict[tuple[str, int], int] | None = None) -> dict:
    """Measured rows: healthy completion per policy and k (k = 0 is 1 s), every repetition alike."""
    out = [{"policy": p, "slow": k, "repetition": r, "healthy_done_s": s * (1 + 0.01 * r), "healthy_not_whole": 0,
            "healthy_steps": (steps or {}).get((p, k), 95), "healthy_Bps": 1e6, "healthy_gap_p99_ms": 5.0,
            "healthy_gap_p50_ms": 2.0} for p, by_k in done.items() for k, s in by_k.items() for r in range(reps)]  # fmt: skip
    return {"rows": pd.DataFrame(out)}


def slow(policy: str, n: int = 3, **changes) -> list[dict]:
    """Slow readers that did what their policy should make them do."""
    acted = {"naive": {"max_queue": 1}, "unbounded": {"max_queue": 40}, "pause": {"pauses": 2, "max_queue": 9},
             "drop": {"server_end": "slow_client", "end": "slow_client"},
             "pause_then_drop": {"server_end": "slow_client", "end": "slow_client", "pauses": 1}}[policy]  # fmt: skip
    base = {"policy": policy, "slow": 1, "ratio": 0.25, "server_end": "length", "end": "length", "pauses": 0,
            "max_queue": 9, "read_bytes_per_read": 800.0, "read_Bps": 4e4}  # fmt: skip
    return [{**base, **acted, **changes, "repetition": r} for r in range(n)]


def outcome(tables: dict, **slow_rows: list[dict]) -> dict[str, str]:
    if slow_rows:
        tables["slow"] = pd.DataFrame([row for more in slow_rows.values() for row in more])
    tables.update(slowclient.tables(tables, SIZES))
    return {v.name: v.outcome for v in slowclient.verdicts(tables, SIZES)}


GOOD = {"naive": {0: 1.0, 1: 5.0, 2: 5.5}, "pause": {0: 1.0, 1: 1.02, 2: 0.98}}


def test_verdicts_hold_on_rows_that_support_them():
    said = outcome(rows(GOOD), a=slow("naive"), b=slow("pause"), c=slow("drop"), d=slow("unbounded"))
    assert set(said.values()) == {"holds"}, said


def test_naive_that_does_not_delay_its_healthy_streams_is_falsified():
    said = outcome(rows({**GOOD, "naive": {0: 1.0, 1: 1.1, 2: 1.2}}))
    assert said["naive delays the healthy"] == "falsified"


def test_a_queue_policy_that_delays_its_healthy_streams_is_falsified():
    assert outcome(rows({**GOOD, "pause": {0: 1.0, 1: 2.0, 2: 2.1}}))["queues isolate the healthy"] == "falsified"


def test_three_repetitions_of_one_slow_count_are_too_few_to_decide():
    assert outcome(rows({"naive": {0: 1.0, 1: 5.0}}))["naive delays the healthy"] == "unclear"


def test_healthy_streams_that_needed_more_steps_falsify_same_steps():
    assert outcome(rows(GOOD, steps={("pause", 2): 99}))["same steps"] == "falsified"


def test_a_cut_healthy_stream_falsifies_whole():
    tables = rows(GOOD)
    tables["rows"].loc[3, "healthy_not_whole"] = 1
    assert outcome(tables)["healthy streams whole"] == "falsified"


@pytest.mark.parametrize("policy, not_acting", [("pause", {"pauses": 0}), ("drop", {"server_end": "length"}),
                                                ("naive", {"max_queue": 9}), ("unbounded", {"max_queue": 3})])  # fmt: skip
def test_a_policy_that_did_not_act_in_one_run_is_falsified(policy, not_acting):
    said = outcome(rows(GOOD), a=slow(policy, 2), b=slow(policy, 1, **not_acting))
    assert said["policies act"] == "falsified"


def test_a_dropped_reader_that_never_saw_the_error_event_was_not_told():
    said = outcome(rows(GOOD), a=slow("drop", 2), b=slow("drop", 1, end="timeout"))
    assert said["the dropped reader is told"] == "falsified" and said["policies act"] == "holds"


def test_a_slow_reader_above_half_the_write_rate_is_not_slow():
    assert outcome(rows(GOOD), a=slow("pause", 2), b=slow("pause", 1, ratio=0.6))["slow is slow"] == "falsified"


def test_pauses_are_timed_and_counted_in_steps_from_the_records_moves():
    record = {"submitted": 0.0, "states": ["queued", "running", "paused", "running", "paused", "ending", "closed"],
              "moved": [0.1, 0.2, 0.5, 0.6, 1.4, 1.5], "released": 1.45, "end": "slow_client", "finish_reason":
              "cancelled", "tokens_generated": 20, "max_queue": 9, "pauses": 2}  # fmt: skip
    log = pd.DataFrame({"step": range(1, 21), "started": [i / 10 for i in range(20)]})
    stream = type("S", (), {"events": [], "tokens": 12, "finish_reason": "slow_client", "error": None, "ended": 3.0,
                            "left_at": None, "headers_at": 0.05, "total_bytes": 2950, "reads": 10})()  # fmt: skip
    row = slowclient.slow_row(stream, record, 0.0, log, writer=1000.0)
    assert row["paused_s"] == pytest.approx(0.3 + 0.8) and row["longest_pause_s"] == pytest.approx(0.8)
    assert row["paused_steps"] == 3 + 8  # steps begun while paused: 0.3, 0.4, 0.5 and 0.7 ... 1.4
    assert row["read_bytes_per_read"] == 295 and row["released_s"] == pytest.approx(1.45)


@pytest.mark.parametrize("change", [{"slow_counts": (1, 2)}, {"slow_counts": (0, 4)}, {"slow_fraction": 0.6},
                                    {"policies": ("naive", "lifo")}])  # fmt: skip
def test_sizes_that_cannot_work_are_refused(change):
    with pytest.raises(ValueError, match="slowclient"):
        slowclient.conditions(SIZES.changed(**change), Target("http://127.0.0.1:9", caps=Caps(settings=True)))


def test_a_target_with_fixed_settings_is_measured_under_its_own_policy_only():
    conditions = slowclient.conditions(SIZES, Target("http://127.0.0.1:9"))
    assert {c["policy"] for c in conditions} == {slowclient.OWN} and [c["slow"] for c in conditions] == sorted(SIZES.slow_counts)


def test_the_hub_dates_every_move_of_a_stream():
    stream = HubStream(StreamRecord("r", 4, 8, submitted=0.0), on_take=lambda *_: None)
    for state in (StreamState.RUNNING, StreamState.PAUSED, StreamState.RUNNING, StreamState.CLOSED):
        stream.move(state)
    moved = stream.record.moved
    assert len(moved) == len(stream.record.states) - 1 and moved == sorted(moved)


def test_the_raw_reader_counts_its_reads(server):
    request = Request("/v1/stream", {"prompt": "Hello", "max_new_tokens": 8, "ignore_eos": True})
    stream = run_sync(read(server.url, request, ReadOptions(read_bytes=64), raw=True))
    assert stream.ok and stream.reads >= stream.total_bytes / 64


@pytest.mark.slow
def test_labkit_run_against_labkit_in_its_own_process(tmp_path):
    """No settings to set: the one condition is the server's own policy; no lab routes, so no
    steps or records: the healthy streams and the slow readers as a client sees them."""
    with labkit_serve_process("--max-batch", "4") as (url, proc):
        argv = [sys.executable, "-m", "labkit.cli", "run", "slowclient", "--target", url, "--profile", "ci",
                "--target-pid", str(proc.pid), "--set", "slow_counts=0,1", "--set", "tokens=32", "--no-figures"]
        done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=300,
                              env={**os.environ, "PYTHONPATH": str(REPO), "LABKIT_OUT": str(tmp_path)})  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    rows = pd.read_csv(tmp_path / "data" / "target-slowclient" / "policies" / "rows.csv")
    assert set(rows.policy) == {slowclient.OWN} and (rows.healthy_not_whole == 0).all()
    verdicts = json.loads((tmp_path / "data" / "target-slowclient" / "policies" / "results.json").read_text())["verdicts"]
    assert all(v["outcome"] == "holds" for v in verdicts if v["checked"]), verdicts
