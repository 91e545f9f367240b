"""Overlap's readings: the speedup's baseline is the same sweep's level 1, idle joiners overlap
nothing, effects are counted in steps, and each verdict turns on its falsification criterion."""
from __future__ import annotations

import pandas as pd
import pytest

import labkit
from labkit.experiments import overlap
from labkit.experiments.client import launch_streams, run_sync
from labkit.experiments.profiles import Profile
from labkit.experiments.readings import current_step
from labkit.experiments.readings import fetch_steps


def _levels(makespans: dict[int, list[float]], tokens: int = 10) -> pd.DataFrame:
    rows = [
        {"level": level, "repetition": rep, "makespan_s": m, "tokens": level * tokens,
         "tokens_per_s": level * tokens / m, "gap_p50_s": 0.01 * (1 + level / 8), "errors": 0}
        for level, ms in makespans.items()
        for rep, m in enumerate(ms)
    ]
    return overlap.add_speedup(pd.DataFrame(rows))


def test_the_baseline_is_the_same_sweeps_level_one_and_its_speedup_is_one_within_its_spread():
    levels = _levels({1: [1.0, 1.2, 0.9], 4: [1.5, 1.6, 1.4]})
    four = levels[levels.level == 4]
    assert (four.back_to_back_s == 4 * 1.0).all()  # 4 × the median level-1 makespan, no other sweep
    one = levels[levels.level == 1].speedup
    assert one.median() == pytest.approx(1.0) and one.min() < 1 < one.max()


def test_a_sweep_without_level_one_has_no_baseline():
    with pytest.raises(ValueError, match="must include 1"):
        overlap.Config(levels=(2, 4))
    with pytest.raises(ValueError, match="level-1"):
        overlap.add_speedup(pd.DataFrame([{"level": 2, "makespan_s": 1.0, "tokens_per_s": 1.0}]))


def test_steps_between_counts_the_steps_begun_after_the_submit_up_to_the_first_token():
    steps = pd.DataFrame({"step": [1, 2, 3], "started": [0.0, 1.0, 2.0], "seconds": [1, 1, 1],
                          "decoded": [1, 1, 1], "prefilled": [0, 1, 0]})
    assert overlap.steps_between(steps, 0.5, 1.5) == 1  # waited for step 1, admitted by step 2
    assert overlap.steps_between(steps, 0.5, 2.0) == 2
    assert overlap.steps_between(steps, 0.5, None) is None


def _joiners(idle_overlaps: int = 0, busy_steps: int = 1) -> pd.DataFrame:
    rows = [{"background": 0, "repetition": 0, "joiner": j, "offset_s": j, "ttft_s": 0.1, "ttft_steps": 1,
             "background_running_at_send": 0, "background_running_at_first_token": 0,
             "joiners_running_at_send": idle_overlaps if j == 1 else 0} for j in range(3)]
    rows += [{"background": 8, "repetition": 0, "joiner": j, "offset_s": j, "ttft_s": 0.2, "ttft_steps": busy_steps,
              "background_running_at_send": 8, "background_running_at_first_token": 8,
              "joiners_running_at_send": 0} for j in range(3)]
    return pd.DataFrame(rows)


def _tables(throughput_at_top: float, busy_steps: int = 1, idle_overlaps: int = 0) -> dict[str, pd.DataFrame]:
    levels = _levels({1: [1.0, 1.0, 1.0], 8: [8 / throughput_at_top] * 3})
    return {"levels": levels, "joiners": _joiners(idle_overlaps, busy_steps)}


def test_each_verdict_turns_on_its_criterion():
    good = {v.name: v.holds for v in overlap.verdicts(_tables(3.0))}
    assert good == {"overlap": True, "per-stream gap": True, "joiner waits a step": True, "idle means idle": True}
    assert not {v.name: v.holds for v in overlap.verdicts(_tables(1.5))}["overlap"]
    assert not {v.name: v.holds for v in overlap.verdicts(_tables(3.0, busy_steps=3), joiner_steps=2)}[
        "joiner waits a step"]
    assert not {v.name: v.holds for v in overlap.verdicts(_tables(3.0, idle_overlaps=1))}["idle means idle"]


def test_the_idle_label_is_measured_not_assumed():
    assert overlap.condition_label(_joiners(), 0) == "idle"
    assert overlap.condition_label(_joiners(idle_overlaps=2), 0) == "0 running, 2 joiners overlapping"
    assert overlap.condition_label(_joiners(), 8) == "8 running"


def test_step_cost_marks_a_point_lower_than_the_smaller_batch_beyond_noise():
    rounds = pd.DataFrame(
        [{"batch": b, "mode": m, "round": r, "steps": 5, "step_ms": ms + r}
         for m in overlap.MODES for b, ms in ((1, 10.0), (2, 20.0), (4, 5.0)) for r in range(3)]
    )
    table = overlap.step_cost_table(rounds)
    marks = table.set_index(["mode", "batch"]).vs_smaller_batch
    assert marks["invariant", 2] == "higher" and marks["plain", 4] == "LOWER"
    fit = overlap.fit_step_cost(table)
    assert list(fit["mode"]) == ["invariant", "plain"]  # the engine's default first (chapter.overlap_beside)


def test_joiners_into_an_idle_engine_never_overlap_and_are_counted_in_steps():
    """Real server, real sockets: idle joiners are sent one after another (none running at send)
    and each first token is sampled by the step after the server took the request."""
    config = overlap.Config.for_profile(Profile("ci"))
    with labkit.serve_in_thread(**overlap.server_options(config)) as server:
        since = current_step(server.url)
        rows = run_sync(overlap._idle_round(server.url, config, [0.0, 0.0, 0.0]))
        steps = fetch_steps(server.url, since)
        counted = overlap.first_token_steps(server.url, [r.pop("result") for r in rows], steps)
    assert [r["joiners_running_at_send"] for r in rows] == [0, 0, 0]
    assert counted == [1, 1, 1]


def test_every_level_makes_the_same_tokens_with_ignore_eos():
    """The tiny model may sample eos early; ``ignore_eos`` (what the sweep sends) runs every
    stream to its length, so every level makes level × max_new_tokens."""
    body = overlap._body("Once upon a time", 12)
    assert body["ignore_eos"] is True
    with labkit.serve_in_thread(model="tiny-gpt2", max_batch=4) as server:
        launch = run_sync(launch_streams(server.url, [body] * 4))
    assert [len(r.tokens) for r in launch.results] == [12] * 4


def test_the_full_profile_fits_its_budget_with_margin_by_its_step_count():
    """Estimated from steps × the step costs of the quiet machine (no wall clock here): the full
    run of notebook 03 must leave at least 15% of its budget."""
    full = overlap.Config.for_profile(Profile("full"))
    estimate = overlap.estimate_seconds(full)
    assert estimate["total"] <= 0.85 * overlap.FULL_BUDGET_S, estimate
    assert full.repetitions >= 3 and full.step_rounds >= 3 and full.step_rounds * full.step_steps > 15
    bigger = overlap.estimate_seconds(overlap.Config(repetitions=6))
    assert bigger["levels"] == pytest.approx(2 * estimate["levels"])


def test_delivery_modes_are_interleaved_and_the_plain_call_07_makes_still_gets_its_table():
    config = overlap.Config(
        model="tiny-gpt2", levels=(1,), repetitions=2, backgrounds=(0,), joiners=1, joiner_tokens=2, delivery_streams=2
    )
    log: list[pd.DataFrame] = []
    with labkit.serve_in_thread(**overlap.server_options(config)) as server:
        plain = overlap.measure_delivery(server, config, None)
        counted = overlap.measure_delivery(server, config, None, step_log=log)
    order = list(dict.fromkeys(zip(plain.repetition, plain["mode"])))
    assert order == [(0, "prefill"), (0, "step_end"), (1, "prefill"), (1, "step_end")]
    assert plain.ttft_s.notna().all() and plain.ttft_steps.isna().all()
    assert counted.ttft_steps.notna().all() and len(log) == 4 and set(pd.concat(log).phase) == {"delivery"}
