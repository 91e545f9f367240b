"""Each experiment's invariants live in one place: its ``report(tables)``.

``make test`` runs every notebook under nbval on the ``ci`` profile, and each notebook prints its
experiments' reports in a ``# NBVAL_CHECK_OUTPUT`` cell, whose text nbval compares with the
committed (full-profile) output: that run is where each experiment's end-to-end checks happen,
once. What is tested here, without running anything, is that the checker can fail: the report of
the committed data is the committed notebook's checked output, and breaking one invariant in
those tables changes the report into a line that says NOT, FAILED or the like.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import pandas as pd
import pytest

from labkit.experiments import load
from experiment_helpers import assert_figures_are_labelled

ROOT = Path(__file__).resolve().parent.parent
Tables = dict[str, pd.DataFrame]


def _set(table: str, column: str, value, where: Callable[[pd.DataFrame], pd.Series] | None = None):
    def breaker(tables: Tables) -> None:
        frame = tables[table]
        rows = frame.index[where(frame)] if where else frame.index[:1]
        frame.loc[rows[:1], column] = value
    return breaker


def _lower(table: str, column: str):
    def breaker(tables: Tables) -> None:
        tables[table].loc[tables[table].index[:1], column] -= 1
    return breaker


#: experiment -> (its notebook, one invariant broken)
CASES: dict[str, tuple[str, Callable[[Tables], None]]] = {
    "wire": ("01_wire_format", _lower("checks", "passed")),
    "overlap": ("03_overlap", _set("levels", "errors", 1)),
    "buffers": ("04_buffers", _set("floods", "blocked", False)),
    "slowclient": ("05_slow_clients", _set("checks", "cache_whole", False)),
    "disconnect": ("06_disconnect_and_leaks",
                   _set("trials", "engine_finish", "cancelled", lambda t: t.response_class == "write_only")),
    "leak": ("06_disconnect_and_leaks", _set("outcome", "held_blocks", 3)),
    "production": ("08_production", _set("holdback", "holds_back", False,
                                         lambda t: t.condition == "buffering-on-accel-ignored")),
}
ALARMS = ("NOT", "FAILED", "DIFFERENT", "UNEXPECTED", "differed", "!=")


def committed_tables(name: str) -> Tables:
    folder = ROOT / "data" / name
    tables = {path.stem: pd.read_csv(path) for path in sorted(folder.glob("*.csv"))}
    if not tables:
        pytest.skip(f"no committed tables under data/{name}/ (run make lab)")
    return tables


def checked_output(notebook: str, name: str) -> str:
    """The committed output of the checked cell that prints ``name``'s report."""
    cells = json.loads((ROOT / "notebooks" / f"{notebook}.ipynb").read_text())["cells"]
    for cell in cells:
        text = "".join(cell["source"])
        if cell["cell_type"] == "code" and text.startswith("# NBVAL_CHECK_OUTPUT") and f"{name}.report(" in text:
            return "".join("".join(o.get("text", "")) for o in cell["outputs"] if o["output_type"] == "stream")
    raise AssertionError(f"{notebook} has no checked cell printing {name}.report")


def test_every_experiment_has_a_report_and_a_case_here():
    from labkit.experiments import names

    assert set(names()) == set(CASES)
    assert all(callable(getattr(load(name), "report", None)) for name in names())


@pytest.mark.parametrize("name", CASES)
def test_the_report_of_the_committed_data_is_the_committed_checked_output(name):
    notebook, _ = CASES[name]
    report = load(name).report(committed_tables(name))
    assert not any(alarm in report for alarm in ALARMS), report
    # The report comes first in its cell; a cell may print the notebook's verdict lines after it (08).
    assert checked_output(notebook, name).startswith(report + "\n")


@pytest.mark.parametrize("name", CASES)
def test_breaking_one_invariant_changes_the_report_into_an_alarm(name):
    module = load(name)
    tables = committed_tables(name)
    good = module.report(tables)
    CASES[name][1](tables)
    broken = module.report(tables)
    assert broken != good
    assert any(alarm in broken for alarm in ALARMS), broken


@pytest.mark.parametrize("name", CASES)
def test_every_figure_is_labelled_with_its_experiment_name(name):
    import matplotlib

    matplotlib.use("Agg")
    assert_figures_are_labelled(load(name), committed_tables(name))
