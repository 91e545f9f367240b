"""Notebook 05 reads what it claims: a slow reader that is slow, policies compared with their own
baselines, and verdicts that can come out false.

Issue 9 found the slow reader reading at 78% of the write rate (so ``pause_then_drop`` never
fired) and baselines from other policies' runs. (Notebook 07's eager memory and sampled identity,
also from issue 9, are tested in test_exp_extensions.py.)
"""

from __future__ import annotations

from dataclasses import replace

import pandas as pd
import pytest

from labkit.experiments import slowclient
from labkit.experiments.profiles import Profile
from labkit.experiments.servers import server_like

# --------------------------------------------------------------------------- tables by hand


def _runs(done: dict[tuple[str, int], list[float]], ratio: float = 0.2, acted: int = 1) -> pd.DataFrame:
    rows = []
    for (policy, k), seconds in done.items():
        for rep, s in enumerate(seconds):
            rows.append(
                {
                    "policy": policy,
                    "slow_readers": k,
                    "repetition": rep,
                    "healthy_done_s": s,
                    "healthy_done_step": 49,
                    "healthy_kib_per_s": 100.0,
                    "step_ms": 10.0,
                    "slow_kib_per_s": 100.0 * ratio if k else float("nan"),
                    "slow_paused": acted if k else 0,
                    "dropped": acted if k else 0,
                }
            )
    return slowclient.with_ratios(pd.DataFrame(rows))


def _tables(runs: pd.DataFrame) -> dict[str, pd.DataFrame]:
    return {"runs": runs, "compare": slowclient.compare_table(runs)}


def _verdict(tables: dict[str, pd.DataFrame], name: str, module=slowclient) -> bool:
    return next(v for v in module.verdicts(tables) if v.name == name).holds


GOOD = {
    ("naive", 0): [1.0, 1.1, 0.9],
    ("naive", 1): [3.0, 3.2, 2.9],
    ("pause_then_drop", 0): [1.0, 1.2, 1.1],
    ("pause_then_drop", 1): [1.0, 1.1, 1.2],
}


def test_each_policy_is_set_beside_its_own_k0_runs():
    compare = slowclient.compare_table(_runs(GOOD)).set_index(["policy", "slow_readers"])
    assert compare.loc[("naive", 1), "done_vs_k0"] == pytest.approx(3.0)
    assert compare.loc[("pause_then_drop", 1), "done_vs_k0"] == pytest.approx(1.0)
    assert compare.loc[("naive", 1), "n"] == 3


def test_the_verdicts_hold_on_readings_that_support_them():
    tables = _tables(_runs(GOOD))
    assert all(v.holds for v in slowclient.verdicts(tables)), slowclient.verdicts(tables)


def test_naive_without_a_delay_is_falsified():
    flat = {**GOOD, ("naive", 1): [1.0, 1.05, 1.1]}
    assert not _verdict(_tables(_runs(flat)), "naive_delays_healthy")


def test_a_delayed_queue_policy_is_falsified():
    slow = {**GOOD, ("pause_then_drop", 1): [2.0, 2.1, 1.9]}
    assert not _verdict(_tables(_runs(slow)), "queues_isolate_healthy")


def test_a_reader_above_half_the_write_rate_is_not_slow():
    assert not _verdict(_tables(_runs(GOOD, ratio=0.78)), "slow_is_slow")


def test_a_policy_that_never_acted_is_falsified():
    assert not _verdict(_tables(_runs(GOOD, acted=0)), "policies_act")


def test_full_profile_repeats_every_timing_comparison_at_least_three_times():
    full = Profile("full")
    assert slowclient.Config.for_profile(full).repetitions >= 3


def test_a_slow_fraction_above_half_is_refused():
    with pytest.raises(ValueError, match="slow_fraction"):
        slowclient.Config(slow_fraction=0.8)


# --------------------------------------------------------------------------- a real slow reader


@pytest.mark.slow
def test_a_slow_reader_reads_under_half_the_write_rate_and_pause_then_drop_drops_it(tiny_gpt2):
    """The drop needs one pause to outlast the stall timeout (0.25 s), and a pause lasts while the
    slow reader takes about high_water / 2 events off the queue. At the ci profile's tenth of the
    write rate that took about 0.25 s here (some runs paused twice), less on a faster engine; at
    a ten-thousandth the calibrated read is the 256-byte floor, every 20 ms: seconds a pause."""
    config = replace(slowclient.Config.for_profile(Profile("ci")), slow_fraction=1e-4)
    with server_like(None, tiny_gpt2, **slowclient.server_settings(config, "pause_then_drop")) as srv:
        pace = slowclient.calibrate(srv, config)
        rows, run, steps = slowclient.measure_run(srv, config, pace, "pause_then_drop", 1, 0)
    slow = [r for r in rows if r["role"] == "slow"]
    healthy = [r for r in rows if r["role"] == "healthy"]
    assert run["slow_kib_per_s"] <= slowclient.MAX_RATIO * pace["writer_kib_per_s"]
    assert run["dropped"] == 1 and run["slow_paused"] == 1
    assert slow[0]["engine_finish"] == "cancelled" and slow[0]["tokens_generated"] < config.max_new_tokens
    assert all(r["end"] == "length" and r["tokens_received"] == config.max_new_tokens for r in healthy)
    assert run["healthy_done_step"] >= config.max_new_tokens and len(steps) == run["steps"]
