"""Every experiment that serves labkit returns the engine's step log of its run (``steps``).

Issue 9: ``make lab``'s results.json had a step-time spread only for the experiments that
returned a ``steps`` table (isolation, overlap, buffers, ...); wire, watch, extensions,
production, drain and peers (for its labkit server) returned none, so their runs had no step
clock beside their seconds. Each now reads ``GET /lab/steps`` at the end of its run.
"""
from __future__ import annotations

from typing import Any

import pandas as pd
import pytest

from labkit.experiments import drain, peers, production, watch, wire
from labkit.experiments.profiles import Profile
from labkit.experiments.readings import step_spread, step_table
from labkit.experiments.target_disconnect import DisconnectConfig
from labkit.experiments.target_runs import OverlapConfig
from labkit.experiments.target_slow import SlowConfig

COLUMNS = list(step_table([]).columns)  # step, started, seconds, decoded, prefilled: what the others return


def assert_a_step_log(tables: dict[str, pd.DataFrame], at_least: int = 1) -> None:
    assert "steps" in tables, f"no steps table among {sorted(tables)}"
    steps = tables["steps"]
    assert list(steps.columns[: len(COLUMNS)]) == COLUMNS
    assert len(steps) >= at_least and steps.step.is_monotonic_increasing and (steps.seconds > 0).all()
    assert step_spread(steps)["all"]["n"] == len(steps)


def test_wire_returns_its_steps(server: Any) -> None:
    config = wire.Config(model="tiny-gpt2", prompts=2, max_new_tokens=8, concurrency=2)
    tables = wire.run(config, server=server)
    assert_a_step_log(tables, at_least=8)  # two streams of 8 tokens each, after the raw capture


def test_watch_returns_its_steps(server: Any) -> None:
    config = watch.Config(max_batch=2, waves=1, per_wave=3, wave_gap_s=0.1, tokens=10, scrape_every=0.1)
    assert_a_step_log(watch.run(config, server=server), at_least=10)  # its own server, on the loaded model


@pytest.mark.slow
def test_production_returns_the_steps_of_its_burst_server() -> None:
    config = production.Config(tokens=16, repetitions=1, blocker_tokens=10, keepalive_repetitions=1,
                               conditions=(production.DIRECT,))
    assert_a_step_log(production.run(config), at_least=16)


@pytest.mark.slow
def test_drain_returns_the_steps_of_its_load() -> None:
    config = drain.Config(model="tiny-gpt2", streams=2, tokens=200, drain_grace=2.0)
    assert_a_step_log(drain.run(config))


@pytest.mark.slow
def test_peers_return_labkits_steps(tmp_path) -> None:
    config = peers.Config(
        "tiny-llama",
        OverlapConfig(levels=(1,), repetitions=3, max_tokens=4),
        DisconnectConfig(streams=1, max_tokens=40, hold_s=0.3, window_s=0.3, follow_up_tokens=3, repetitions=1,
                         leave_by=("fin",)),
        SlowConfig(healthy=1, slow=(0, 1), max_tokens=8, repetitions=3),
        threads=1,
    )
    with peers.serve(peers.LABKIT, config, tmp_path) as server:
        tables = peers.run(config, server)
    assert_a_step_log(tables, at_least=4)
    assert set(tables["steps"].server) == {peers.LABKIT}


def test_the_labkit_peer_is_started_with_the_lab_routes_that_serve_its_steps() -> None:
    labkit = peers.command(peers.LABKIT, peers.Config("tiny-llama"), 8000)
    assert "--lab-routes" in labkit
