"""Experiments 5-7 and the extensions at toy sizes: the tables they promise, and the invariants.

What is asserted must hold on any machine: counts, who was released and how often, that the
cache came back whole, that a write-only response keeps generating for a client that left.
Times are only checked against generous liveness bounds.
"""
from __future__ import annotations

import matplotlib
import pandas as pd
import pytest

from labkit.experiments import disconnect, extensions, leak, names, slowclient
from labkit.experiments.common import Profile
from labkit.experiments.harness import long_prompts
from experiment_helpers import assert_columns, assert_figures_are_labelled

matplotlib.use("Agg")
slow = pytest.mark.slow
MODULES = (slowclient, disconnect, leak, extensions)


@pytest.fixture(scope="module")
def server(tiny_gpt2):
    """A notebook-like server; experiments reuse it where its settings fit and start others beside."""
    from labkit.server import serve_in_thread

    with serve_in_thread(tiny_gpt2, max_batch=4, policy="unbounded") as srv:
        yield srv
    srv.engine.check_integrity()


def _every_server_clean(checks: pd.DataFrame) -> None:
    assert checks.cache_whole.all(), checks
    assert (checks.open_streams == 0).all() and (checks.held_blocks == 0).all(), checks
    assert (checks.running == 0).all() and (checks.waiting == 0).all(), checks


# --------------------------------------------------------------------------- configs and plans


def test_every_profile_builds_a_valid_config():
    for module in MODULES:
        for name in ("ci", "full"):
            config = module.Config.for_profile(Profile(name))
            assert module.server_options(config)["model"] == config.model


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


# --------------------------------------------------------------------------- experiments


@slow
def test_slowclient_healthy_streams_finish_and_every_server_ends_clean(server):
    config = slowclient.Config(model="tiny-gpt2", streams=3, max_new_tokens=16, pad_bytes=8192, slow_counts=(0, 1),
                               policies=("naive", "pause_then_drop"), slow_sleep=0.02, read_bytes=8192,
                               server_sndbuf=16384, saturation_policies=("pause",), saturation_fast=3,
                               saturation_tokens=8, uncapped_policy=None, read_timeout=60.0)
    tables = slowclient.run(config, server=server)
    streams, grid = tables["streams"], tables["grid"]
    assert_columns(streams, "policy", "slow_readers", "role", "tokens_received", "end", "left_engine_s", "max_queue")
    assert_columns(grid, "healthy_done_s", "healthy_gap_p99_s", "slow_left_engine_max_s", "slow_ends")
    assert len(streams) == 2 * (3 + 3) and len(grid) == 4
    healthy = streams[streams.role == "healthy"]
    assert (healthy.tokens_received == 16).all() and (healthy.end == "length").all()
    assert set(streams[streams.role == "slow"].end) <= {"length", "slow_client"}
    assert streams.left_engine_s.notna().all() and (streams.error.isna()).all()
    assert len(tables["saturation"]) == 1 and tables["saturation"].fast_errors.iloc[0] == 0
    _every_server_clean(tables["checks"])
    assert "NOT" not in slowclient.report(tables)
    assert_figures_are_labelled(slowclient, tables)


@slow
def test_disconnect_starlette_releases_at_once_and_write_only_keeps_generating(server):
    config = disconnect.Config(model="tiny-gpt2", repetitions=1, at_once=1, max_new_tokens=24, blocker_tokens=12,
                               moments=("waiting", "early", "mid"))
    tables = disconnect.run(config, server=server)
    trials = tables["trials"]
    assert_columns(trials, "response_class", "moment", "leave_by", "tokens_read", "tokens_unread", "close_to_release_ms")
    assert len(trials) == 2 * 3 * 2 and trials.left.all()
    listening = trials[trials.response_class == "starlette"]
    assert (listening.tokens_unread <= 2).all(), listening
    assert not listening[listening.moment == "waiting"].ever_admitted.any()
    assert (listening.close_to_release_ms < 10_000).all()  # liveness only: it did not wait for the end
    writing = trials[trials.response_class == "write_only"]
    assert (writing.tokens_generated == 24).all() and (writing.engine_finish == "length").all()
    assert (writing.tokens_unread == 24 - writing.tokens_read).all()
    checks = tables["checks"]
    _every_server_clean(checks)
    assert (checks.finished == checks.submitted).all() and (checks.releases == checks.admitted).all(), checks
    assert_figures_are_labelled(disconnect, tables)


@slow
def test_leak_nothing_is_left_and_each_stream_is_released_once(server):
    config = leak.Config(model="tiny-gpt2", streams=24, concurrency=8, max_batch=4, max_new_tokens=16,
                         early_range=(0, 10), slow_leave_after=(3, 5), slow_sleep=0.02)
    tables = leak.run(config, server=server)
    outcome = tables["outcome"].set_index("response_class")
    assert_columns(tables["streams"], "kind", "leave_after", "tokens_read", "tokens_generated", "engine_finish")
    assert outcome.cache_whole.all() and (outcome.held_blocks == 0).all()
    assert (outcome.open_streams == 0).all() and (outcome.running == 0).all() and (outcome.waiting == 0).all()
    assert (outcome.finished == 24).all() and (outcome.releases == outcome.admitted).all()
    assert (outcome.hub_errors == 0).all() and (outcome.cut == 0).all() and (outcome.client_errors == 0).all()
    assert outcome.loc["write_only", "generated_per_read_leavers"] > outcome.loc["starlette", "generated_per_read_leavers"]
    assert "FAILED" not in leak.report(tables)
    assert_figures_are_labelled(leak, tables)


@slow
def test_extensions_resume_is_exact_and_seeded_sampling_is_reproducible(server):
    config = extensions.Config.for_profile(Profile("ci"))
    tables = extensions.run(config, server=server)
    assert_columns(tables["delivery"], "mode", "ttft_p50_s", "ttft_p99_s")
    assert_columns(tables["resume"], "status", "in_order_no_gap", "same_tokens_as_generate")
    assert_columns(tables["identity"], "comparison", "identical", "first_diff", "margin")
    assert set(tables["delivery"]["mode"]) == {"prefill", "step_end"}
    assert len(tables["saturation"]) == 1 + len(config.stall_timeouts)
    report = extensions.report(tables)
    assert "NOT" not in report and "UNEXPECTED" not in report and "DIFFERENT" not in report, report
    assert_figures_are_labelled(extensions, tables)
