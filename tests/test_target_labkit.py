"""The target path against a real ``labkit serve`` in its own process, reached only over loopback HTTP:
the probe sees labkit's OpenAI framing, and overlap runs as it would against vLLM (wire: tests/test_exp_wire.py)."""
from __future__ import annotations

import pytest
from target_helpers import labkit_serve_process

from labkit.cli import main
from labkit.experiments.profiles import Profile
from labkit.experiments.target import TargetError
from labkit.experiments.target_cli import measure_target
from labkit.experiments.target_probe import connect

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def labkit_process():
    with labkit_serve_process("--max-batch", "8") as (url, proc):
        yield url, proc


@pytest.fixture(scope="module")
def labkit_url(labkit_process):
    return labkit_process[0]


@pytest.fixture
def out(tmp_path, monkeypatch):
    monkeypatch.setenv("LABKIT_OUT", str(tmp_path))
    return tmp_path


def test_the_probe_finds_labkit_s_framing(labkit_url) -> None:
    target = connect(labkit_url)
    quirks = target.quirks
    assert target.model == "tiny-gpt2" and quirks.models == ("tiny-gpt2",)
    assert quirks.sends_done and quirks.usage_when_asked and not quirks.usage_unasked
    assert quirks.stream_options == "honoured (usage only when asked)"
    assert quirks.eos_flag == "ignore_eos" and quirks.labkit_internals


def test_overlap_runs_interleaved_rounds_with_speedup_against_one_stream(labkit_url, out) -> None:
    tables = measure_target("overlap", connect(labkit_url), Profile("ci"), levels=(1, 2, 4), max_tokens=6)
    runs, levels = tables["runs"], tables["levels"]
    assert list(runs.level) == [1, 2, 4] * 3
    assert runs.errors.sum() == 0 and (runs.tokens == runs.level * 6).all()
    assert runs.ttft_p50_s.notna().all() and runs.gap_p50_s.notna().all() and runs.speedup.gt(0).all()
    one = levels.set_index("streams").speedup[1]
    assert 0.5 < one < 2  # level 1 against the median of its own rounds


def test_labkit_run_overlap_with_target_from_the_command_line(labkit_url, out, capsys) -> None:
    assert main(["run", "overlap", "--target", labkit_url, "--model", "tiny-gpt2"]) == 0
    printed = capsys.readouterr().out
    assert "overlap: levels" in printed and "speedup" in printed
    assert (out / "data" / "target-overlap" / "levels.csv").exists()


def test_disconnect_by_cpu_time_sees_labkit_stop_after_fin_and_rst(labkit_process, out) -> None:
    """The streams must still be generating when their clients leave (``streams_left``): each asks
    for 470 tokens (the longest prompt has 33; the context holds 512) and is read for 0.15 s, in
    which 25-50 came here; read for 0.5 s, 160-210 of 400 came: within 2x of the end."""
    url, proc = labkit_process
    target = connect(url, pid=proc.pid)
    tables = measure_target("disconnect", target, Profile("ci"), streams=3, max_tokens=470, hold_s=0.15,
                            window_s=0.5, repetitions=3)
    runs, verdicts = tables["runs"], tables["verdicts"].set_index("leave_by")
    assert (runs.streams_left == 3).all() and (runs.errors == 0).all(), runs
    assert (runs.during_cpu > runs.after_cpu).all(), runs  # generating costs CPU; after the leave it stops
    assert (verdicts.witness == "server CPU time").all()
    assert (verdicts.verdict == "stopped generating").all(), verdicts
    assert verdicts["running_after (labkit /stats)"].tolist() == ["0, 0, 0", "0, 0, 0"]


def test_a_pid_that_is_not_running_here_is_refused(labkit_url) -> None:
    with pytest.raises(TargetError, match="is not a process on this machine"):
        connect(labkit_url, pid=2**22 + 12345)
