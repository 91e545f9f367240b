"""The deadline experiment's pieces: Poisson arrivals, the tables, and verdicts that can fail."""
from __future__ import annotations

import statistics
from dataclasses import replace

import matplotlib
import pandas as pd
import pytest

from labkit.experiments import deadline
from labkit.experiments.profiles import Profile

matplotlib.use("Agg")
CONFIG = replace(deadline.Config.for_profile(Profile("ci")), loads=(1.0, 2.0), window_s=1.0)


def test_arrivals_are_a_poisson_process_of_the_asked_rate_inside_the_window() -> None:
    runs = [deadline.arrivals(20.0, 1.0, seed) for seed in range(300)]
    assert all(all(0 <= t < 1.0 for t in run) and run == sorted(run) for run in runs)
    counts = [len(run) for run in runs]
    assert 18.5 < statistics.mean(counts) < 21.5  # Poisson: mean 20, and the variance is the mean
    assert 12 < statistics.variance(counts) < 30
    assert deadline.arrivals(20.0, 1.0, 7) == deadline.arrivals(20.0, 1.0, 7)  # both gates see the same schedule


def _requests(outcomes: dict[tuple[float, bool], list[str]]) -> pd.DataFrame:
    rows = []
    for (load, gate), per_run in outcomes.items():
        for rep in range(3):
            for i, outcome in enumerate(per_run):
                rows.append({"gate": gate, "load": load, "rate": 10 * load, "repetition": rep, "request": i,
                             "outcome": outcome, "request_id": None if outcome == "refused" else f"r{load}{gate}{rep}{i}",
                             "latency_s": 0.1 if outcome == "met" else None})
    return pd.DataFrame(rows)


GOOD_PROBES = {("certain miss", True): "refused", ("certain miss", False): "missed", ("ample room", True): "met"}


def _probes(outcomes: dict[tuple[str, bool], str]) -> pd.DataFrame:
    return pd.DataFrame([{"probe": p, "gate": g, "repetition": rep, "outcome": o}
                         for rep in range(3) for (p, g), o in outcomes.items()])


def _tables(requests: pd.DataFrame, predicted: dict[str, float],
            probes: dict[tuple[str, bool], str] = GOOD_PROBES) -> dict[str, pd.DataFrame]:
    readings = pd.DataFrame(
        [{"request_id": rid, "deadline_s": 1.0, "predicted_s": p, "steps": 10, "step_s": 0.01, "refused": False}
         for rid, p in predicted.items()]
    )
    runs = deadline.runs_table(requests, CONFIG)
    return {
        "runs": runs,
        "goodput": deadline.spread(runs, ["load", "rate", "gate"], ["goodput", "met", "missed", "refused"]),
        "shadow": deadline.shadow_table(requests, readings),
        "requests": requests,
        "probes": _probes(probes),
    }


def test_runs_count_every_outcome_and_goodput_is_met_per_second() -> None:
    requests = _requests({(1.0, True): ["met", "refused", "missed"], (1.0, False): ["met", "met", "missed"]})
    runs = deadline.runs_table(requests, CONFIG).set_index(["gate", "repetition"])
    assert runs.loc[(True, 0), ["met", "missed", "refused", "error", "offered"]].tolist() == [1, 1, 1, 0, 3]
    assert runs.loc[(False, 0), "goodput"] == 2 / CONFIG.window_s


def _case(gate_wins: bool, prediction_right: bool) -> dict[str, pd.DataFrame]:
    on = ["met", "met", "refused"] if gate_wins else ["met", "refused", "refused"]
    off = ["met", "missed", "missed"] if gate_wins else ["met", "met", "missed"]
    requests = _requests({(1.0, True): ["met"], (1.0, False): ["met"], (2.0, True): on, (2.0, False): off})
    shadow = requests[~requests.gate & requests.request_id.notna()]
    # the shadow gate predicts a miss for request 2 (which misses, in both cases) and, when it is
    # wrong, also for request 0 (which meets its deadline)
    predicted = {
        rid: (2.0 if (i == 2 or (i == 0 and not prediction_right)) else 0.5)
        for rid, i in zip(shadow.request_id, shadow.request)
    }
    return _tables(requests, predicted)


def test_every_verdict_holds_when_the_gate_wins_and_predicts_right() -> None:
    verdicts = deadline.verdicts(_case(gate_wins=True, prediction_right=True))
    assert [v.holds for v in verdicts] == [True, True, True]


@pytest.mark.parametrize("probe, outcome", [(("certain miss", True), "met"), (("certain miss", False), "met"),
                                            (("ample room", True), "refused"), (("ample room", True), "missed")])
def test_a_probe_that_goes_the_wrong_way_falsifies_the_gate(probe: tuple[str, bool], outcome: str) -> None:
    tables = _case(gate_wins=True, prediction_right=True)
    tables["probes"] = _probes({**GOOD_PROBES, probe: outcome})
    tables["probes"].loc[tables["probes"].index[3:], "outcome"] = [GOOD_PROBES[(p, g)] for p, g in
                                                                   zip(tables["probes"].probe[3:], tables["probes"].gate[3:])]
    first = deadline.verdicts(tables)[0]
    assert not first.holds, first.evidence


def test_a_gate_that_would_refuse_requests_that_met_their_deadline_is_falsified() -> None:
    _, shadow, _ = deadline.verdicts(_case(gate_wins=True, prediction_right=False))
    assert not shadow.holds and shadow.evidence.startswith("3 of 9 would-be refusals missed their deadline")


def test_less_goodput_with_the_gate_at_overload_is_falsified() -> None:
    *_, goodput = deadline.verdicts(_case(gate_wins=False, prediction_right=True))
    assert not goodput.holds


@pytest.mark.slow
def test_a_short_run_measures_both_gates_with_no_errors_and_plots() -> None:
    config = replace(CONFIG, loads=(2.0,), window_s=0.3)
    tables = deadline.run(config)
    runs = tables["runs"]
    assert sorted(runs.gate.unique()) == [False, True] and len(runs) == 2 * config.repetitions
    assert runs.error.sum() == 0 and runs[~runs.gate].refused.sum() == 0  # the open server refuses nothing
    assert (tables["calibration"].deadline_s > 0).all() and not tables["steps"].empty
    assert deadline.summary(tables)["errors"] == 0
    probes = tables["probes"]
    assert len(probes) == len(deadline.PROBES) * config.repetitions
    assert deadline.verdicts(tables)[0].holds, deadline.verdicts(tables)[0].evidence
    assert len(deadline.plot(tables)) == 1
