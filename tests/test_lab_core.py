"""The runner as a specification: conditions interleaved, every row tagged and kept on disk as it
comes, what a target cannot witness said in a row, verdicts decided by intervals, results that
read back the same. No server is needed: these specs measure nothing but their own trials."""
from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from labkit.lab import Experiment, NotMeasurable, Sizes, Target, every, interval, judge, load, run, seen, tell
from labkit.lab.profiles import Profile
from labkit.lab.verdict import checked_lines, worst

PROFILE = Profile("ci")


@pytest.fixture(autouse=True)
def out(tmp_path, monkeypatch):
    monkeypatch.setenv("LABKIT_OUT", str(tmp_path))
    return tmp_path


def spec(measure, **fields) -> Experiment:
    base = dict(name="toy.trials", title="a toy", sizes={"ci": {"values": (1, 2, 3), "repetitions": 2}},
                conditions=lambda s, t: [{"value": v} for v in s.values], measure=measure)  # fmt: skip
    return Experiment(**{**base, **fields})


def target() -> Target:
    return Target("http://127.0.0.1:1", api="labkit")


def test_conditions_run_interleaved_and_every_row_is_tagged_with_its_condition_and_repetition():
    seen = []

    def measure(trial):
        seen.append((trial.repetition, trial.value))
        trial.keep("detail", [{"part": i} for i in range(trial.value)])
        return {"double": 2 * trial.value}

    result = run(spec(measure), target(), profile=PROFILE, show=False)
    assert seen == [(0, 1), (0, 2), (0, 3), (1, 1), (1, 2), (1, 3)]
    rows = result.table()
    assert list(rows.columns) == ["value", "repetition", "double"] and (rows.double == 2 * rows.value).all()
    assert len(result.table("detail")) == 12 and set(result.table("detail").columns) == {"value", "repetition", "part"}


def test_an_alternating_spec_runs_its_conditions_backwards_every_other_repetition(out):
    seen = []
    run(spec(lambda t: seen.append(t.value) or {}, alternate=True), target(), profile=PROFILE, show=False)
    assert seen == [1, 2, 3, 3, 2, 1]
    assert (out / "data" / "target-toy").is_dir() and not (out / "data" / "toy").exists()  # not a server the lab started


def test_no_garbage_collection_runs_while_a_trial_measures_and_it_is_back_after_even_a_crash():
    import gc

    during = []

    def measure(trial):
        during.append(gc.isenabled())
        if trial.repetition == 1 and trial.value == 3:
            raise RuntimeError("the last trial breaks")
        return {}

    assert gc.isenabled()
    with pytest.raises(RuntimeError, match="breaks"):
        run(spec(measure), target(), profile=PROFILE, show=False)
    assert during == [False] * 6 and gc.isenabled()


def test_overrides_change_sizes_by_name_and_refuse_unknown_names():
    result = run(spec(lambda t: {"v": t.value}), target(), profile=PROFILE, show=False, values=[5], repetitions=1)
    assert list(result.table().value) == [5] and result.sizes["values"] == (5,)
    with pytest.raises(ValueError, match="no size named 'valus' .did you mean values"):
        run(spec(lambda t: {}), target(), profile=PROFILE, show=False, valus=(1,))
    with pytest.raises(ValueError, match="size 'repetitions' is a int"):
        Sizes({"repetitions": 3}).changed(repetitions="many")


def test_a_capability_the_target_lacks_becomes_a_not_measurable_row():
    result = run(spec(lambda t: {}, needs=("lab",)), target(), profile=PROFILE, show=False)
    assert result.table().empty and result.verdicts == []
    row = result.table("not_measurable").iloc[0]
    assert row.measurement == "toy.trials" and row.because.startswith("it has no lab routes")


def test_a_condition_that_cannot_be_measured_is_said_once_and_the_rest_goes_on():
    def measure(trial):
        if trial.value == 2:
            raise NotMeasurable("value 2", "the toy cannot")
        return {"v": trial.value}

    result = run(spec(measure), target(), profile=PROFILE, show=False)
    assert sorted(result.table().value) == [1, 1, 3, 3]
    assert list(result.table("not_measurable").because) == ["the toy cannot"]


def test_a_crash_keeps_the_finished_trials_on_disk_and_closes_what_prepare_started(out):
    closed = []

    class State:
        def close(self):
            closed.append(True)

    def measure(trial):
        if trial.repetition == 1 and trial.value == 2:
            raise RuntimeError("the machine caught fire")
        return {"v": trial.value}

    with pytest.raises(RuntimeError, match="caught fire"):
        run(spec(measure, prepare=lambda t, s: State()), target(), profile=PROFILE, show=False)
    partial = pd.read_csv(out / "data" / "target-toy" / "trials" / "partial" / "rows.csv")
    assert list(partial.value) == [1, 2, 3, 1] and closed == [True]


def test_an_unsaved_run_leaves_nothing_on_disk(out):
    result = run(spec(lambda t: {"v": t.value}), target(), profile=PROFILE, save=False, show=False)
    assert sorted(result.table().value) == [1, 1, 2, 2, 3, 3]
    assert not result.folder.exists() or not any(result.folder.iterdir())


def test_a_saved_result_reads_back_with_the_same_tables_and_verdicts(out):
    def tables(t, s):
        return {"by_value": t["rows"].groupby("value", as_index=False).v.sum()}

    def verdicts(t, s):
        return [judge("sums", "the sums are even", "an odd sum", bool((t["by_value"].v % 2 == 0).all()), "", checked=True)]

    toy = spec(lambda t: {"v": t.value}, tables=tables, verdicts=verdicts)
    result = run(toy, target(), profile=PROFILE, show=False)
    record = json.loads((result.folder / "results.json").read_text())
    assert record["measured"] == ["rows", "trial_seconds"] and record["environment"]["profile"] == "ci"
    # what each trial cost, so that a run's minutes can be traced to the sizes that spend them
    timed = result.table("trial_seconds")
    assert len(timed) == len(result.table()) and (timed.seconds >= 0).all() and set(timed.value) == {1, 2, 3}
    assert "git_commit" in record["environment"] and "others_cpu_share" in record["machine"]
    assert record["verdicts"][0]["outcome"] == "holds" and record["sizes"]["values"] == [1, 2, 3]
    back = load(toy, PROFILE, lab=False)  # a target the lab did not start: under data/target-toy/
    pd.testing.assert_frame_equal(back.table("by_value"), result.table("by_value"))
    assert checked_lines(back.verdicts) == checked_lines(result.verdicts) == "sums: holds"


def test_a_median_interval_needs_six_values_and_then_covers_at_95_percent():
    assert not np.isfinite(interval([1, 2, 3, 4, 5]).low)
    ci = interval([1, 2, 3, 4, 5, 6])
    assert (ci.low, ci.high, ci.estimate) == (1, 6, 3.5)
    rng = np.random.default_rng(1)
    covered = sum(interval(rng.normal(0, 1, 20)).low <= 0 <= interval(rng.normal(0, 1, 20)).high for _ in range(200))
    assert covered >= 180  # at least 95% nominal, with room for this test's own noise


@pytest.mark.parametrize("values, decided", [([2.5] * 8, True), ([1.5] * 8, False), ([1, 3] * 4, None), ([3.0] * 3, None)])
def test_tell_holds_only_when_the_interval_excludes_the_null(values, decided):
    verdict, text = tell(interval(values), 2.0, "above")
    assert verdict is decided
    if decided is None:
        assert "repetitions would decide it" in text or "too near 2" in text


def test_an_unclear_verdict_at_the_null_says_no_practical_number_of_repetitions_decides_it():
    """An estimate at the null (0.1% above it, with a spread of a tenth) would need millions of
    repetitions by the 1/sqrt(n) rule: the text says more of the same cannot decide it, not a count."""
    from labkit.lab import Interval

    decided, text = tell(Interval(1.001, 0.885, 1.06, 9), 1.0, "above")
    assert decided is None and "too near 1 for more repetitions to decide it" in text
    assert "about" not in text
    decided, text = tell(Interval(1.05, 0.98, 1.12, 9), 1.0, "above")  # an effect under the spread: a count
    assert decided is None and "about 18 repetitions would decide it" in text


def test_a_paired_ratio_is_judged_repetition_by_repetition_and_needs_six():
    a, b = [10, 11, 12, 13, 9, 10], [5, 5.5, 6, 6.5, 4.5, 5]
    ci = interval(a, others=b)
    assert (ci.estimate, ci.low, ci.high, ci.n) == (2.0, 2.0, 2.0, 6)  # every repetition's ratio is 2
    assert not np.isfinite(interval(a[:3], others=b[:3]).low)  # three pairs cannot decide anything
    with pytest.raises(ValueError, match="one value each per repetition"):
        interval(a, others=b[:5])


def test_every_holds_only_for_rows_that_exist_and_seen_quotes_distinct_values():
    assert every(pd.Series([True, True])) is True and every([1, 1]) is True
    assert every(pd.Series([True, False])) is False
    assert every(pd.Series([], dtype=bool)) is None and every(pd.Series([float("nan")])) is None  # nothing proves nothing
    assert seen(pd.Series(["b", "a"])) == ["a", "b"] and seen(pd.Series([1.5, 2.0])) == [1.5, 2]
    # a missing value makes pandas' column float; the evidence still quotes the statuses as ints
    assert str(seen(pd.Series([204, None, 200, 204]))) == "[200, 204]"


def test_several_decisions_are_as_bad_as_the_worst_falsified_before_unclear():
    assert worst([True, True]) is True and worst(d for d in (True, None)) is None
    assert worst([None, False, True]) is False and worst([]) is None  # nothing proves nothing


def test_a_run_with_a_budget_keeps_no_trial_that_ended_after_it_and_says_which_it_left():
    import time

    def measure(trial):
        time.sleep(0.3)
        return {"v": trial.value}

    result = run(spec(measure), target(), profile=PROFILE, show=False, max_seconds=0.5)
    left = result.table("not_measurable").iloc[0]
    assert len(result.table()) <= 1 and left.condition == f"the last {6 - len(result.table())} trials"
    assert left.because == "max_seconds was spent"


def test_a_trial_whose_reads_the_budget_cut_is_not_kept():
    """A read cut by the budget returns a stream that failed: the trial would read as the
    server's failure, so it is dropped (a review)."""
    import time

    from hostile_helpers import hostile, trickle_stream

    from labkit.lab import ReadOptions

    def measure(trial):
        stream = Target(url, api="openai").read(Target(url, api="openai").request("hi", 8), ReadOptions(timeout=60))
        return {"failure": stream.failure}

    with hostile(trickle_stream) as url:
        start = time.perf_counter()
        result = run(spec(measure), target(), profile=PROFILE, show=False, max_seconds=0.5)
    assert result.table().empty and time.perf_counter() - start < 10
    assert result.table("not_measurable").condition.tolist() == ["the last 6 trials"]


def test_a_trial_that_fails_once_the_budget_is_spent_ends_the_run_with_what_it_had():
    import time

    def measure(trial):
        if trial.repetition == 1:
            time.sleep(0.4)
            raise OSError("a read the budget cut")
        return {"v": trial.value}

    result = run(spec(measure), target(), profile=PROFILE, show=False, max_seconds=0.3)
    assert len(result.table()) == 3 and result.table("not_measurable").condition.tolist() == ["the last 3 trials"]
    with pytest.raises(OSError):  # without a budget the same failure is the run's
        run(spec(measure), target(), profile=PROFILE, show=False)
