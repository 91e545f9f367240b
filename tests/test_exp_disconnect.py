"""Notebook 06's first half (``labkit.experiments.disconnect``) as a specification.

A client's close, the hub's close and the release read off the server's record and step log; the
release taken apart into the notice, the rest of the step in progress and whole steps; the
verdicts on rows made by hand, each both ways, FIN against RST judged by where its interval lies
against the margin; the stop probe telling a server that stops from one that does not by a
follow-up request's pace alone; and one run of ``labkit run disconnect`` against labkit in a
process of its own, with its lab routes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
from target_helpers import REPO, BatchingStub, labkit_serve_process, uvicorn_in_thread

from labkit.experiments import disconnect
from labkit.lab import Caps, Target, connect, run

SIZES = disconnect.MOMENTS.sizes_for("ci")


def test_clients_leave_at_five_moments_in_order():
    tokens = [disconnect.leave_after(SIZES, m) for m in disconnect.MOMENTS_]
    assert tokens == [0, 0, 2, SIZES.tokens // 2, SIZES.tokens - SIZES.end_margin]
    with pytest.raises(ValueError, match="early_tokens"):
        disconnect.leave_after(SIZES.changed(early_tokens=150), "early")


def test_a_trial_is_read_off_the_record_and_the_step_in_progress_at_the_close():
    log = pd.DataFrame({"step": [7, 8, 9], "started": [1.000, 1.030, 1.060], "seconds": [0.028, 0.029, 0.028]})
    record = {"closed": 1.012, "released": 1.0301, "steps_at_close": 7, "release_step": 8, "tokens_generated": 3,
              "first_token_sampled": 0.9, "finish_reason": "cancelled"}  # fmt: skip
    client = type("C", (), {"left": "fin", "left_at": 1.010, "tokens": 2})()
    row = disconnect.trial_row(client, record, log.set_index("step"))
    assert row["notice_ms"] == pytest.approx(2.0) and row["release_ms"] == pytest.approx(20.1)
    assert row["release_steps"] == 1 and row["unread"] == 1 and row["ever_admitted"]
    assert row["rest_of_step_ms"] == pytest.approx(16.0) and row["step_ms"] == pytest.approx(28.0)


def _trials(**broken) -> dict[str, pd.DataFrame]:
    rows = [{"response_class": kind, "moment": m, "leave_by": how, "left": True, "tokens_read": 2, "notice_ms": 2.0,
             "rest_of_step_ms": 10.0, "step_ms": 30.0, "release_ms": 12.0,
             "release_steps": broken.get("steps", 1) if kind == "starlette" else -150,
             "ever_admitted": m != "waiting" or (kind == "starlette" and broken.get("admitted", False)) or kind != "starlette",
             "engine_finish": broken.get("finish", "length") if kind == "write_only" else "cancelled",
             "tokens_generated": SIZES.tokens if kind == "write_only" else 3, "unread": 1}
            for kind in disconnect.CLASSES for m in disconnect.MOMENTS_ for how in disconnect.WAYS]  # fmt: skip
    tables = {"rows": pd.DataFrame(rows)}
    return {**tables, **disconnect.moment_tables(tables, SIZES)}


def _said(tables: dict) -> dict[str, str]:
    return {v.name: v.outcome for v in disconnect.moment_verdicts(tables, SIZES)}


def test_moment_verdicts_hold_on_rows_that_support_them_and_fail_on_what_they_claim():
    assert set(_said(_trials()).values()) == {"holds"}
    assert _said(_trials(steps=3))["listening releases within two steps"] == "falsified"
    assert _said(_trials(admitted=True))["waiting never admitted"] == "falsified"
    assert _said(_trials(finish="cancelled"))["write-only runs to the limit"] == "falsified"


def test_the_release_is_taken_apart_into_notice_rest_of_step_and_whole_steps():
    parts = _trials(steps=3)["decomposition"].set_index(["response_class", "moment", "leave_by"])
    one = parts.loc[("starlette", "mid", "fin")]
    assert one.explained_ms == pytest.approx(2.0 + 10.0 + 2 * 30.0)


def _pairs(diff_ms: list[float], step_ms: float = 30.0) -> dict[str, pd.DataFrame]:
    rows = pd.DataFrame({"moment": "early", "pair": range(len(diff_ms)), "rst_ms": 2.0,
                         "fin_ms": [2.0 + d for d in diff_ms], "step_ms": step_ms, "fin_admitted": True,
                         "rst_admitted": True})  # fmt: skip
    tables = {"rows": rows}
    return {**tables, **disconnect.pair_tables(tables, disconnect.FIN_RST.sizes_for("ci"))}


@pytest.mark.parametrize("diff_ms, outcome", [
    (list(np.linspace(-0.5, 0.5, 50)), "holds"),  # inside a margin of a tenth of a 30 ms step
    (list(np.linspace(3.5, 4.5, 50)), "falsified"),  # FIN noticed later than the whole margin
    (list(np.linspace(-6.0, 8.0, 50)), "unclear"),  # an interval across an edge of the margin
])  # fmt: skip
def test_fin_against_rst_is_judged_by_where_its_interval_lies_against_the_margin(diff_ms, outcome):
    tables = _pairs(diff_ms)
    (verdict,) = disconnect.pair_verdicts(tables, disconnect.FIN_RST.sizes_for("ci"))
    assert verdict.outcome == outcome and "Wilcoxon p=" in verdict.evidence
    row = tables["fin_rst"].iloc[0]
    assert row.pairs == 50 and row.margin_ms == pytest.approx(3.0) and row.ci_low <= row.diff_ms <= row.ci_high


def test_fin_noticed_later_in_every_pair_has_a_tiny_rank_test_p():
    row = _pairs([1.0 + 0.01 * i for i in range(50)])["fin_rst"].iloc[0]
    assert row.wilcoxon_p < 1e-6 and row.fin_later == 50


@pytest.mark.parametrize("kind, kept_on, outcome", [("starlette", 0.01, "holds"), ("starlette", 0.9, "falsified"),
                                                    ("write_only", 1.0, "holds"), ("write_only", 0.02, "falsified")])  # fmt: skip
def test_the_stop_probe_says_which_servers_stop(kind, kept_on, outcome):
    rows = pd.DataFrame([{"response_class": kind, "witness": "records", "kept_on": kept_on, "left_before_end_s": 1.0,
                          "window_s": 0.1}] * 2)  # fmt: skip
    (verdict,) = disconnect.stop_verdicts({"rows": rows}, disconnect.STOP.sizes_for("ci"))
    assert verdict.outcome == outcome and verdict.checked


def test_a_stop_round_whose_streams_would_have_ended_within_the_window_decides_nothing():
    rows = pd.DataFrame([{"response_class": disconnect.OWN, "witness": "cpu", "kept_on": 0.0, "left_before_end_s": 0.3,
                          "window_s": 0.2}])  # fmt: skip
    (verdict,) = disconnect.stop_verdicts({"rows": rows}, disconnect.STOP.sizes_for("ci"))
    assert verdict.outcome == "unclear" and not verdict.checked


def test_a_target_with_fixed_settings_is_measured_with_its_own_response_class():
    conditions = disconnect.class_conditions(SIZES, Target("http://127.0.0.1:9"), "moment", ("early",))
    assert conditions == [{"response_class": disconnect.OWN, "moment": "early"}]
    assert len(disconnect.class_conditions(SIZES, Target("http://127.0.0.1:9", caps=Caps(settings=True)))) == 2


@pytest.mark.slow
@pytest.mark.parametrize("stops", [True, False])
def test_the_stop_probe_reads_a_follow_up_requests_pace_where_nothing_else_is_offered(stops, tmp_path, monkeypatch):
    monkeypatch.setenv("LABKIT_OUT", str(tmp_path))
    with uvicorn_in_thread(BatchingStub(stops_on_disconnect=stops).app()) as url:
        result = run(disconnect.STOP, connect(url), show=False, repetitions=1, hold_tokens=4, tokens=120)
    assert set(result.table().witness) == {"follow-up"}
    (verdict,) = result.verdicts
    assert verdict.outcome == ("holds" if stops else "falsified"), verdict


@pytest.mark.slow
def test_labkit_run_against_labkit_in_its_own_process_with_lab_routes(tmp_path):
    """Its settings are fixed: its own response class; the waiting moment fills its batch limit, read
    from ``/stats``."""
    with labkit_serve_process("--lab-routes", "--max-batch", "4") as (url, proc):
        argv = [sys.executable, "-m", "labkit.cli", "run", "disconnect", "--target", url, "--profile", "ci",
                "--target-pid", str(proc.pid), "--set", "tokens=48", "--set", "pairs=2", "--set", "repetitions=1",
                "--no-figures"]  # fmt: skip
        done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=300,
                              env={**os.environ, "PYTHONPATH": str(REPO), "LABKIT_OUT": str(tmp_path)})  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    data = tmp_path / "data" / "target-disconnect"
    moments = pd.read_csv(data / "moments" / "rows.csv")
    assert set(moments.response_class) == {disconnect.OWN} and moments.notice_ms.notna().all()
    assert not moments[moments.moment == "waiting"].ever_admitted.any()
    assert pd.read_csv(data / "stop" / "rows.csv").witness.eq("records").all()
    columns = ["moment", "leave_by", "notice_ms", "release_steps", "rest_of_step_ms", "step_ms", "ever_admitted"]
    for part in ("moments", "stop"):
        verdicts = json.loads((data / part / "results.json").read_text())["verdicts"]
        failed = [(v["name"], v["outcome"], v["evidence"]) for v in verdicts if v["checked"] and v["outcome"] != "holds"]
        assert not failed, f"{failed}\n{moments[[c for c in columns if c in moments]].to_string()}"


def test_the_margin_is_counted_in_steps_that_ran_the_model_not_in_idle_ones():
    """A wave that leaves before its first token logs many steps that ran nothing (a cancel
    applied, a turn with nothing to do): a fraction of a millisecond each. The margin's unit is a
    step that decoded or prefilled, so those cannot shrink it to nothing; a wave with none has no
    unit of its own (NaN), and its moment takes every moment's."""
    columns = ["step", "started", "seconds", "decoded", "prefilled", "prefill_tokens"]
    idle = [(i, 0.0, 0.0002, 0, 0, 0) for i in range(1, 30)]
    decoding = [(i, 0.0, 0.030, 4, 0, 0) for i in range(30, 36)]
    prefilling = [(i, 0.0, 0.040, 0, 2, 80) for i in range(36, 40)]
    log = pd.DataFrame(idle + decoding + prefilling, columns=columns)
    assert disconnect.working_step_ms(log) == pytest.approx(30.0)
    assert disconnect.working_step_ms(log[log.step >= 36]) == pytest.approx(40.0)
    assert np.isnan(disconnect.working_step_ms(log[log.decoded + log.prefilled == 0]))
    rows = pd.DataFrame({"moment": ["before_first"] * 6 + ["mid"] * 6, "fin_ms": [2.0] * 12, "rst_ms": [1.0] * 12,
                         "step_ms": [np.nan] * 6 + [60.0] * 6, "fin_admitted": False, "rst_admitted": False})
    table = disconnect.pair_tables({"rows": rows}, disconnect.FIN_RST.sizes_for("ci"))["fin_rst"].set_index("moment")
    assert table.margin_ms.to_dict() == pytest.approx({"before_first": 6.0, "mid": 6.0})
