"""Notebook 06's second half (``labkit.experiments.leak``) as a specification.

The seeded plan has the chapter's shares and is the same every run; the verdicts on rows made by
hand, each both ways (the books, the work, the time with its interval); and one run of ``labkit
run leak`` against labkit in a process of its own without lab routes, where ``/stats`` is the
witness and says so.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter

import pandas as pd
import pytest
from target_helpers import REPO, labkit_serve_process

from labkit.experiments import leak

SIZES = leak.PLAN.sizes_for("full")


def test_the_plan_has_the_chapters_shares_and_is_the_same_every_time():
    plan = leak.plan(SIZES.changed(streams=300))
    kinds = Counter(kind for kind, _, _ in plan)
    assert kinds == {"full": 105, "early": 150, "slow": 45} and plan == leak.plan(SIZES.changed(streams=300))
    assert all(after is None for kind, after, _ in plan if kind == "full")
    assert {after for kind, after, _ in plan if kind == "slow"} == set(SIZES.slow_leave_after)
    assert all(0 <= after <= 40 for kind, after, _ in plan if kind == "early") and {h for *_, h in plan} == {
        "fin",
        "rst",
    }


@pytest.mark.parametrize("change", [{"share_full": 0.7}, {"early_range": (0, 48)}, {"slow_leave_after": (3, 60)}])
def test_a_plan_that_cannot_work_is_refused(change):
    with pytest.raises(ValueError, match="leak"):
        leak.plan(SIZES.changed(**change))


def _runs(**broken) -> dict[str, pd.DataFrame]:
    rows = [{"response_class": kind, "repetition": r, "books_ok": not (broken.get("leaks") and kind == "write_only"),
             "books": "nothing held" if broken.get("leaks") else "7 checks passed", "client_errors": 0,
             "witness": "books", "total_s": 20.0 + r if kind == "starlette" else broken.get("write_times", [30.0 + i for i in range(6)])[r],
             "generated_per_read_leavers": 1.3 if kind == "starlette" else broken.get("write_ratio", 5.0)}
            for r in range(6) for kind in leak.CLASSES]  # fmt: skip
    return {"rows": pd.DataFrame(rows)}


def _said(tables: dict) -> dict[str, str]:
    return {v.name: v.outcome for v in leak.verdicts({**tables, **leak.tables(tables, SIZES)}, SIZES)}


def test_verdicts_hold_on_rows_that_support_them():
    assert set(_said(_runs()).values()) == {"holds"}


def test_a_book_left_unbalanced_in_one_run_is_a_leak():
    assert _said(_runs(leaks=True))["nothing leaks"] == "falsified"


def test_a_listening_response_that_saved_no_work_is_falsified():
    assert _said(_runs(write_ratio=1.2))["listening saves work"] == "falsified"


def test_the_time_comparison_has_an_interval_and_can_fail():
    assert _said(_runs(write_times=[12.0 + i for i in range(6)]))["not listening costs time"] == "falsified"
    straddling = [19.0, 22.0, 21.0, 24.0, 23.0, 26.0]  # each repetition's ratio about 1, some above and some below
    assert _said(_runs(write_times=straddling))["not listening costs time"] == "unclear"


@pytest.mark.slow
def test_labkit_run_against_labkit_in_its_own_process_reads_its_stats(tmp_path):
    with labkit_serve_process("--max-batch", "4") as (url, proc):
        argv = [
            sys.executable,
            "-m",
            "labkit.cli",
            "run",
            "leak",
            "--target",
            url,
            "--profile",
            "ci",
            "--target-pid",
            str(proc.pid),
            "--set",
            "streams=16",
            "--set",
            "concurrency=8",
            "--set",
            "repetitions=1",
            "--no-figures",
        ]
        done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=300,
                              env={**os.environ, "PYTHONPATH": str(REPO), "LABKIT_OUT": str(tmp_path)})  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    data = tmp_path / "data" / "target-leak" / "plan"
    row = pd.read_csv(data / "rows.csv").iloc[0]
    assert row.witness == "stats" and row.books_ok and row.streams == 16 and row.client_errors == 0
    verdicts = json.loads((data / "results.json").read_text())["verdicts"]
    assert [v["outcome"] for v in verdicts] == ["holds"]
