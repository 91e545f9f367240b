"""Notebook 09's parts: the slow-reader probe against any target, and labkit and transformers serve
started as processes of this interpreter on loopback, probed and measured by the same client."""
from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd
import pytest

from labkit.experiments import peers
from labkit.experiments.profiles import Profile
from labkit.experiments.target import TargetError
from labkit.experiments.target_cli import measure_target
from labkit.experiments.target_probe import connect
from labkit.experiments.target_runs import OverlapConfig, run_overlap


@pytest.fixture
def out(tmp_path, monkeypatch):
    monkeypatch.setenv("LABKIT_OUT", str(tmp_path))
    return tmp_path


# --------------------------------------------------------------------------- sizes and commands


def test_the_full_profile_runs_the_issue_s_sweep_with_interleaved_repetitions() -> None:
    config = peers.Config.for_profile(Profile("full"))
    assert config.model == "smollm2-135m"
    assert config.overlap.levels == (1, 4, 16, 32) and config.overlap.max_tokens == 64
    assert min(config.overlap.repetitions, config.disconnect.repetitions, config.slow.repetitions) >= 3
    assert 0 in config.slow.slow and config.slow.read_ratio <= 0.5


def test_both_servers_run_in_this_interpreter_with_the_same_cache_and_weights() -> None:
    config = peers.Config.for_profile(Profile("ci", "tiny-llama"))
    ours, theirs = peers.command(peers.LABKIT, config, 1234), peers.command(peers.TRANSFORMERS, config, 1235)
    assert ours[0] == theirs[0] == sys.executable
    assert ours[ours.index("--num-blocks") + 1] == theirs[theirs.index("--cb-num-blocks") + 1] == str(config.num_blocks)
    assert ours[ours.index("--block-size") + 1] == theirs[theirs.index("--cb-block-size") + 1]
    assert {"--continuous-batching", "float32", "cpu", "127.0.0.1"} <= set(theirs)
    assert Path(theirs[theirs.index("serve") + 1]) == peers.model_folder(config.model)


def test_a_model_the_peer_cannot_serve_from_a_saved_folder_is_refused() -> None:
    with pytest.raises(ValueError, match="saved Llama folder"):
        peers.Config.for_profile(Profile("ci"))  # tiny-gpt2


# --------------------------------------------------------------------------- the servers as processes


@pytest.mark.slow
def test_labkit_started_as_a_process_is_measured_and_stopped(tmp_path) -> None:
    config = peers.Config.for_profile(Profile("ci", "tiny-llama"))
    with peers.serve(peers.LABKIT, config, tmp_path) as server:
        tables = run_overlap(connect(server.url, pid=server.pid), OverlapConfig(levels=(1, 2), max_tokens=4))
    assert (tables["runs"].tokens == tables["runs"].level * 4).all()
    assert not Path(f"/proc/{server.pid}").exists()  # stopped and reaped


@pytest.mark.slow
def test_a_server_that_exits_at_start_is_refused_in_one_line(tmp_path) -> None:
    config = peers.Config("no-such-model", start_timeout_s=60)
    with pytest.raises(TargetError, match=r"labkit exited with status \d+"):
        with peers.serve(peers.LABKIT, config, tmp_path):
            pass


@pytest.mark.slow
@pytest.mark.skipif(peers.peer_missing() is not None, reason=str(peers.peer_missing()))
def test_transformers_serve_is_probed_not_named_and_runs_overlap_to_max_tokens(tmp_path, out) -> None:
    """transformers serve refuses ignore_eos and min_tokens (422), sends no [DONE] and usage always;
    a per-request generation_config with no eos id makes its streams run to max_tokens."""
    config = peers.Config.for_profile(Profile("ci", "tiny-llama"))
    with peers.serve(peers.TRANSFORMERS, config, tmp_path) as server:
        target = connect(server.url, pid=server.pid)
        assert target.quirks.eos_flag == "generation_config"
        assert target.quirks.eos_flags["ignore_eos"].startswith("refused (HTTP 422")
        assert not target.quirks.sends_done
        tables = measure_target("overlap", target, Profile("ci"), levels=(1, 2), max_tokens=6)
    assert not Path(f"/proc/{server.pid}").exists()  # stopped and reaped, no thread left spinning
    runs = tables["runs"]
    assert runs.errors.sum() == 0 and runs.short_streams.sum() == 0
    assert (runs.tokens == runs.level * 6).all()


# --------------------------------------------------------------------------- verdicts


def test_a_disconnect_round_whose_streams_ended_before_the_leave_gives_no_stop_verdict() -> None:
    """Streams that finished before their clients left say nothing about stopping: a server all of
    whose rounds were like that gets no verdict (it printed "holds" before), one with a round in
    which streams were still running is judged on those rounds alone."""
    from labkit.experiments.peers import LABKIT, TRANSFORMERS, verdicts

    overlap = pd.DataFrame(
        [{"server": s, "level": n, "tokens_per_s": t} for s in (LABKIT, TRANSFORMERS) for n, t in ((1, 10.0), (4, 30.0))]
    )
    disconnect = pd.DataFrame(
        [
            {"server": LABKIT, "leave_by": "fin", "cpu_release": 0.9, "streams_left": 4},
            {"server": LABKIT, "leave_by": "fin", "cpu_release": 0.1, "streams_left": 0},
            {"server": TRANSFORMERS, "leave_by": "fin", "cpu_release": 0.95, "streams_left": 0},
        ]
    )
    found = {v.name: v for v in verdicts({"overlap_runs": overlap, "disconnect_runs": disconnect})}
    assert found["stops_after_leave_labkit"].holds and "over 1 rounds" in found["stops_after_leave_labkit"].evidence
    assert not any(name.startswith("stops_after_leave_transformers") for name in found)
