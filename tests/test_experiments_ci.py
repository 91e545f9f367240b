"""Experiments 1-4 at toy sizes: each returns the tables it promises, with sane invariants.

What is asserted is what must hold on any machine (counts, identities, that a write blocked);
how long anything took is only recorded.
"""
from __future__ import annotations

import argparse
import json

import matplotlib
import pandas as pd
import pytest

from labkit.experiments import buffers, isolation, names, overlap, wire
from labkit.experiments.common import Profile
from experiment_helpers import assert_columns, assert_figures_are_labelled

matplotlib.use("Agg")
slow = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tiny_gpt2):
    from labkit.server import serve_in_thread

    with serve_in_thread(tiny_gpt2, max_batch=8) as srv:
        yield srv
    srv.engine.check_integrity()


def test_every_profile_builds_a_valid_config():
    for module in (wire, isolation, overlap, buffers):
        for name in ("ci", "full"):
            config = module.Config.for_profile(Profile(name))
            assert module.server_options(config)["model"] == config.model


def test_registry_lists_these_four_first():
    assert names()[:4] == ["wire", "isolation", "overlap", "buffers"]


@slow
def test_wire_every_stream_passes_every_check(server):
    tables = wire.run(wire.Config(model="tiny-gpt2", prompts=4, max_new_tokens=8, concurrency=2), server=server)
    streams, checks = tables["streams"], tables["checks"]
    assert_columns(streams, *(col for col, _ in wire.CHECKS), "bytes_per_token", "empty_deltas", "ttft_s")
    assert len(streams) == 4 and (streams.tokens == 8).all()
    assert (checks.passed[: len(wire.CHECKS)] == 4).all(), checks
    assert set(tables["events"].event) == {"start", "token", "done"}
    assert "FAILED" not in wire.report(tables)
    assert_figures_are_labelled(wire, tables)


@slow
def test_isolation_concurrent_streams_equal_their_solo_runs(server):
    config = isolation.Config(model="tiny-gpt2", levels=(1, 2, 4), repetitions=1, max_new_tokens=8)
    tables = isolation.run(config, server=server)
    streams = tables["streams"]
    assert_columns(streams, "level", "identical", "first_diff", "margin", "top2_margin")
    assert len(streams) == 1 + 2 + 4 and streams.identical.all()
    assert tables["levels"].identical.tolist() == [1, 2, 4]
    assert_figures_are_labelled(isolation, tables)


def test_isolation_margin_is_measured_on_the_reference_model(tiny_gpt2):
    prompt = isolation.PROMPTS[0]
    logits = isolation.reference_logits(tiny_gpt2, prompt, [])
    best, second = logits.topk(2).indices.tolist()
    row = isolation._compare(2, 0, 0, [second], [best], None)
    assert row["first_diff"] == 0 and not row["identical"]
    table = isolation.add_margins(pd.DataFrame([row]), tiny_gpt2, [[best]])
    assert table.margin.iloc[0] == pytest.approx(table.top2_margin.iloc[0]) and table.margin.iloc[0] >= 0


def test_first_difference_counts_a_length_difference():
    assert isolation.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert isolation.first_difference([1, 5, 3], [1, 2, 3]) == 1
    assert isolation.first_difference([1, 2], [1, 2, 3]) == 2


@slow
def test_overlap_returns_levels_step_cost_joiners_and_delivery(server):
    config = overlap.Config(model="tiny-gpt2", levels=(1, 2), repetitions=1, max_new_tokens=6, backgrounds=(0, 2),
                            joiners=2, joiner_tokens=3, long_tokens=80, joiner_window=(0.01, 0.03),
                            delivery_streams=2, step_steps=3)
    tables = overlap.run(config, server=server)
    levels = tables["levels"]
    assert_columns(levels, "makespan_s", "tokens_per_s", "ttft_p50_s", "ttft_p99_s", "gap_p50_s", "gap_p99_s",
             "back_to_back_s", "speedup")
    assert levels.tokens.tolist() == [6, 12] and (levels.errors == 0).all()
    assert tables["step_cost"].batch.tolist() == [1, 2] and len(tables["step_fit"]) == 1
    joiners = tables["joiners"]
    assert len(joiners) == 4 and joiners.ttft_s.notna().all()
    assert set(tables["delivery"]["mode"]) == {"prefill", "step_end"} and tables["delivery"].ttft_s.notna().all()
    assert set(overlap.summary(tables)) >= {"makespan_s", "step_ms_per_sequence"}
    assert_figures_are_labelled(overlap, tables)


@slow
def test_buffers_a_client_that_never_reads_blocks_the_writer(server):
    tables = buffers.run(buffers.Config(event_sizes=(1024, 65536), repetitions=1), server=server)
    floods = tables["floods"]
    assert_columns(floods, "bytes_accepted", "events_accepted", "client_unread_bytes", "client_rcvbuf")
    assert floods.blocked.all() and floods.server_finished.all()
    assert (floods.bytes_accepted > 0).all() and (floods.client_unread_bytes > 0).all()
    assert_figures_are_labelled(buffers, tables)


@slow
def test_run_experiment_writes_tables_results_and_figures(tmp_path, monkeypatch):
    from labkit.experiments.cli import add_run_arguments, run_experiment

    monkeypatch.setenv("LABKIT_OUT", str(tmp_path))
    outcome = run_experiment("wire", Profile("ci"), prompts=2, max_new_tokens=4, concurrency=1)
    assert {p.name for p in outcome.csvs} == {"streams.csv", "checks.csv", "events.csv"}
    assert all(p.exists() for p in outcome.csvs + outcome.figures)
    record = json.loads(outcome.results.read_text())
    assert record["environment"]["profile"] == "ci" and record["config"]["prompts"] == 2
    assert record["figures"] == ["figures/wire_bytes.png"]
    parser = argparse.ArgumentParser()
    add_run_arguments(parser)
    args = parser.parse_args(["all", "--profile", "full", "--model", "tiny-gpt2"])
    assert (args.name, args.profile, args.model) == ("all", "full", "tiny-gpt2")
