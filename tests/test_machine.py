"""labkit.machine: every reading answers on every platform, with None or words where it cannot.

Why: on Windows ``os.getloadavg`` does not exist (the experiments caught only OSError, so every
notebook failed), ``fcntl`` and ``termios`` do not import, and on macOS every ``/proc`` reading
became NaN without a word. The platforms this machine is not are simulated here by what they
lack: no ``/proc`` folder, no ``os.getloadavg``, modules that do not import.
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import pytest
import torch

from labkit import machine

HAS_PROC = Path("/proc/stat").exists()


@pytest.fixture
def no_proc(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A machine without /proc (macOS, Windows)."""
    monkeypatch.setattr(machine, "PROC", tmp_path / "no-proc")


@pytest.fixture
def no_fcntl(monkeypatch: pytest.MonkeyPatch) -> None:
    """A machine where fcntl and termios do not import (Windows)."""
    monkeypatch.setitem(sys.modules, "fcntl", None)
    monkeypatch.setitem(sys.modules, "termios", None)


def test_without_os_getloadavg_the_load_is_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(os, "getloadavg", raising=False)
    assert machine.loadavg() is None


def test_a_load_average_that_cannot_be_read_is_none(monkeypatch: pytest.MonkeyPatch) -> None:
    def unreadable() -> tuple[float, float, float]:
        raise OSError("Load average not obtainable")

    monkeypatch.setattr(os, "getloadavg", unreadable)
    assert machine.loadavg() is None


@pytest.mark.skipif(not hasattr(os, "getloadavg"), reason="this platform keeps no load average")
def test_the_load_average_is_three_non_negative_numbers() -> None:
    load = machine.loadavg()
    assert load is not None and len(load) == 3 and all(x >= 0 for x in load)


def test_busy_seconds_are_read_from_proc_stat(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / "stat").write_text("cpu  100 5 50 1000 20 1 2 3 9 9\ncpu0 1 2 3 4\n")
    monkeypatch.setattr(machine, "PROC", tmp_path)
    # user+nice+system+idle+iowait+irq+softirq+steal, less idle and iowait: 100+5+50+1+2+3 ticks
    assert machine.busy_seconds() == pytest.approx(161 / os.sysconf("SC_CLK_TCK"))


@pytest.mark.parametrize("text", ["", "intr 1 2 3\n", "cpu 1 x 3 4\n", "cpu 1 2\n"])
def test_a_proc_stat_without_the_cpu_total_is_none_not_an_error(
    text: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    (tmp_path / "stat").write_text(text)
    monkeypatch.setattr(machine, "PROC", tmp_path)
    assert machine.busy_seconds() is None


def test_without_proc_the_proc_readings_are_none(no_proc: None) -> None:
    assert machine.busy_seconds() is None
    assert machine.cpu_flags() is None
    assert isinstance(machine.cpu_model(), str) and machine.cpu_model()
    assert machine.own_seconds() >= 0  # not from /proc: psutil or os.times


@pytest.mark.skipif(not HAS_PROC, reason="no /proc on this platform")
def test_on_linux_busy_seconds_grow_and_the_cpu_has_a_name_and_flags() -> None:
    first = machine.busy_seconds()
    sum(i * i for i in range(200_000))  # some CPU work of our own
    second = machine.busy_seconds()
    assert first is not None and second is not None and second >= first > 0
    flags = machine.cpu_flags()
    assert flags and machine.cpu_model() != "unknown"


def test_on_macos_the_cpu_name_comes_from_sysctl(no_proc: None, monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[list[str]] = []
    monkeypatch.setattr(sys, "platform", "darwin")
    monkeypatch.setattr(machine, "_command_output", lambda command: asked.append(command) or "Apple M2")
    assert machine.cpu_model() == "Apple M2"
    assert asked == [["sysctl", "-n", "machdep.cpu.brand_string"]]


def test_elsewhere_the_cpu_name_comes_from_platform(no_proc: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "platform", "win32")
    monkeypatch.setattr(machine.platform, "processor", lambda: "Intel64 Family 6 Model 85")
    assert machine.cpu_model() == "Intel64 Family 6 Model 85"


def test_cpu_flags_are_read_on_x86_and_on_arm(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(machine, "PROC", tmp_path)
    (tmp_path / "cpuinfo").write_text("processor\t: 0\nmodel name\t: X\nflags\t\t: sse2 avx2 fma\n")
    assert machine.cpu_flags() == {"sse2", "avx2", "fma"}
    (tmp_path / "cpuinfo").write_text("processor\t: 0\nFeatures\t: fp asimd\n")
    assert machine.cpu_flags() == {"fp", "asimd"}


# -- sockets ------------------------------------------------------------------------------------
def test_unread_bytes_counts_what_waits_in_the_receive_buffer() -> None:
    a, b = socket.socketpair()
    with a, b:
        assert machine.unread_bytes(b) == 0
        a.sendall(b"x" * 1000)
        assert machine.unread_bytes(b) == 1000


def test_without_fcntl_and_termios_unread_bytes_is_none_and_says_why(no_fcntl: None) -> None:
    features = machine.socket_features()
    assert not features.fionread and not features.fcntl and not features.termios and features.so_linger
    assert [m.split(":")[0] for m in features.missing()] == ["FIONREAD", "fcntl", "termios"]
    assert all(machine.NOT_AVAILABLE in m for m in features.missing())
    a, b = socket.socketpair()
    with a, b:
        a.sendall(b"x")
        assert machine.unread_bytes(b) is None


def test_this_platform_has_every_socket_feature_the_lab_uses() -> None:
    if sys.platform == "win32":
        pytest.skip("Windows has no fcntl, termios or FIONREAD")
    assert machine.socket_features().missing() == []


def test_linger_zero_is_two_ints_on_posix_and_two_shorts_on_windows() -> None:
    assert machine.linger_zero("linux") == (1).to_bytes(4, sys.byteorder) + bytes(4)
    assert machine.linger_zero("win32") == (1).to_bytes(2, sys.byteorder) + bytes(2)


# -- device, threads, words ---------------------------------------------------------------------
def test_default_device_is_cuda_exactly_where_torch_sees_one(monkeypatch: pytest.MonkeyPatch) -> None:
    assert machine.default_device() == ("cuda" if torch.cuda.is_available() else "cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert machine.default_device() == "cuda"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert machine.default_device() == "cpu"


def test_threads_are_pinned_for_the_cpu_and_left_alone_for_a_gpu() -> None:
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        said = machine.pin_threads("cuda")
        assert torch.get_num_threads() == 3 and "left at 3" in said and "cuda" in said
        assert machine.pin_threads("cpu", 1) == "torch pinned to 1 thread (the engine runs on the CPU)"
        assert torch.get_num_threads() == 1
        machine.pin_threads("cpu")
        assert torch.get_num_threads() == max(1, min(2, os.cpu_count() or 1))
        with pytest.raises(ValueError, match="threads must be a positive int"):
            machine.pin_threads("cpu", 0)
    finally:
        torch.set_num_threads(before)


def test_describe_names_what_a_bare_platform_cannot_read(
    no_proc: None, no_fcntl: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delattr(os, "getloadavg", raising=False)
    said = machine.describe()
    assert said["load average"] == "not available on this platform (no os.getloadavg)"
    assert said["CPU busy seconds"] == "not available on this platform (no /proc)"
    assert said["cpu flags"] == "not available on this platform"
    assert "FIONREAD: not available on this platform" in said["sockets"]


@pytest.mark.skipif(not HAS_PROC, reason="no /proc on this platform")
def test_describe_on_this_linux_machine_reads_everything() -> None:
    said = machine.describe()
    assert not any(machine.NOT_AVAILABLE in value for value in said.values()), said


# -- the lab reads through it ------------------------------------------------------------------
def test_the_lab_s_machine_record_is_made_on_a_bare_platform(no_proc: None, monkeypatch: pytest.MonkeyPatch) -> None:
    from labkit.lab.record import MachineState, machine_record, provenance_line

    monkeypatch.delattr(os, "getloadavg", raising=False)
    before = MachineState.now()
    record = machine_record(before, MachineState.now())
    assert before.busy_s is None and before.loadavg is None
    assert record["others_cpu_share"] is None and record["quiet"] is None and record["loadavg_before"] is None
    line = provenance_line({"git_commit": "abc1234", "code_dirty": False}, record)
    assert "not available on this platform" in line and "commit abc1234 (clean tree)" in line


def test_the_buffers_experiment_imports_without_fcntl_and_termios(
    no_fcntl: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib

    from labkit.lab import NotMeasurable

    monkeypatch.delitem(sys.modules, "labkit.experiments.buffers", raising=False)
    buffers = importlib.import_module("labkit.experiments.buffers")
    a, b = socket.socketpair()
    with a, b, pytest.raises(NotMeasurable, match="this platform has no FIONREAD"):
        buffers.unread_bytes(b)
