"""Experiments 5-7 and the extensions: their plans and configurations, which must hold exactly.

Their end-to-end invariants (caches whole, one release per stream, healthy readers served,
write-only responses generating for clients that left) are each experiment's ``report``, run
once per ``make test`` by nbval in the notebooks (see tests/test_experiments_reports.py).
"""
from __future__ import annotations

import pandas as pd
import pytest

from labkit.experiments import disconnect, leak, names, slowclient
from labkit.experiments.workload import long_prompts



# --------------------------------------------------------------------------- configs and plans


def test_registry_runs_the_three_failure_experiments_after_the_first_four():
    assert names()[4:7] == ["slowclient", "disconnect", "leak"]


def test_leak_plan_has_the_chapter_shares_and_is_the_same_every_time():
    config = leak.Config(model="tiny-gpt2", streams=300)
    clients = leak.plan(config)
    kinds = pd.Series([c.kind for c in clients]).value_counts()
    assert (kinds["full"], kinds["early"], kinds["slow"]) == (105, 150, 45)
    assert all(c.leave_after is None for c in clients if c.kind == "full")
    assert all(0 <= c.leave_after <= 40 for c in clients if c.kind == "early")
    assert {c.leave_after for c in clients if c.kind == "slow"} <= {3, 10}
    assert {c.leave_by for c in clients} == {"fin", "rst"}
    assert clients == leak.plan(config)


def test_disconnect_moments_leave_in_order():
    config = disconnect.Config(model="tiny-gpt2", max_new_tokens=48)
    tokens = [disconnect.leave_after(config, m) for m in disconnect.MOMENTS]
    assert tokens == [0, 0, 2, 24, 44]


def test_a_config_that_cannot_work_is_refused_with_the_field_named():
    with pytest.raises(ValueError, match="slow counts"):
        slowclient.Config(streams=2, slow_counts=(0, 4))
    with pytest.raises(ValueError, match="max_new_tokens"):
        leak.Config(max_new_tokens=20, early_range=(0, 40))


def test_long_prompts_run_to_their_limit(tiny_gpt2):
    chosen = long_prompts(tiny_gpt2, 16)
    assert chosen and all(0 <= i < 32 for i in chosen)
