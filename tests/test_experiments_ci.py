"""The experiments' configurations and pieces, and the command-line path that saves a run.

Each experiment's end-to-end invariants are checked in one place: its ``report(tables)``, which
its notebook prints in a checked cell that nbval runs under the ``ci`` profile in ``make test``
(tests/test_experiments_reports.py shows that those checks can fail). Running the experiments
here as well would measure the same things twice.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import replace

import matplotlib
import pandas as pd
import pytest

from labkit.experiments import load, names
from labkit.experiments.profiles import Profile

matplotlib.use("Agg")
slow = pytest.mark.slow


@pytest.mark.parametrize("name", names())
def test_each_profile_serves_its_model_and_full_is_the_larger_run(name):
    """One test for every experiment (it was copied into two files, asserting only that
    ``server_options`` repeats the config's model)."""
    module = load(name)
    ci, full = (module.Config.for_profile(Profile(p)) for p in ("ci", "full"))
    assert (ci.model, full.model) == ("tiny-gpt2", "smollm2-135m")
    assert module.units(full) >= module.units(ci) and full != replace(ci, model=full.model)  # sizes differ too
    assert module.Config.for_profile(Profile("ci", model="tiny-llama")).model == "tiny-llama"


def test_registry_lists_these_four_first():
    assert names()[:4] == ["wire", "isolation", "overlap", "buffers"]


@slow
def test_run_experiment_writes_tables_results_and_figures(tmp_path, monkeypatch):
    from labkit.experiments.cli import add_run_arguments, run_experiment

    monkeypatch.setenv("LABKIT_OUT", str(tmp_path))
    outcome = run_experiment("wire", Profile("ci"), prompts=2, max_new_tokens=4, concurrency=1)
    assert {p.name for p in outcome.csvs} == {
        "streams.csv", "checks.csv", "events.csv", "raw.csv", "raw_chunks.csv", "awkward.csv", "steps.csv"
    }
    assert all(p.exists() for p in outcome.csvs + outcome.figures)
    assert not (tmp_path / "data" / "wire" / "partial").exists()  # the finished run replaced it
    record = json.loads(outcome.results.read_text())
    assert record["environment"]["profile"] == "ci" and record["config"]["prompts"] == 2
    assert record["machine"]["cpu_s"] > 0 and "quiet" in record["machine"]  # the run's machine record
    assert record["figures"] == ["figures/wire_bytes.png"]
    assert record["step_spread"]["all"]["n"] > 0  # the run's steps, from its steps table
    parser = argparse.ArgumentParser()
    add_run_arguments(parser)
    args = parser.parse_args(["all", "--profile", "full", "--model", "tiny-gpt2"])
    assert (args.name, args.profile, args.model) == ("all", "full", "tiny-gpt2")
