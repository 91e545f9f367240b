"""How the kernels are built on machines unlike this one, and what ``auto`` then chooses.

Why: Apple's clang has no ``-fopenmp``, so every kernel failed to build there and the engine fell
back without a word; a CPU without FMA ran every ``std::fma`` as a library call, 70 times slower
than torch, and ``auto`` still picked the kernel. The other machines are simulated here: a
compiler that refuses ``-fopenmp`` as clang does (a script in front of g++), one that fails
outright, and ``-march=x86-64-v2`` for a CPU without FMA. Each simulation builds into its own
cache folder.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import shutil
from pathlib import Path

import pytest
import torch
from kernel_helpers import fake_compiler, like_apple_clang

from labkit.engine import kernels, rowwise
from labkit.engine.attention import choose_attention
from labkit.engine.config import EngineConfig
from labkit.engine.engine import BatchEngine
from labkit.engine.kernels import BuildOptions, KernelUnavailable, build_report, build_summary
from labkit.engine.matmul import PackedWeight, choose_matmul, fixed_matmul, speed_check
from labkit.models import LoadedModel

CPU = torch.device("cpu")
X86 = platform.machine() in ("x86_64", "AMD64")
needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to build the kernels")


@pytest.fixture
def fresh_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """An empty kernel cache, and nothing built or probed yet in this process."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(kernels, "_loaded", {})
    monkeypatch.setattr(kernels, "_probed", {})
    monkeypatch.setattr(kernels, "_logged", set())
    return tmp_path / "cache" / "labkit" / "kernels"


# -- the short reason ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("stderr", "said"),
    [
        ("clang: error: unsupported option '-fopenmp'\n", "clang++: unsupported option '-fopenmp'"),
        (
            "x.cpp: In function 'int f()':\n/tmp/x.cpp:12:5: error: expected ';' before 'return'\n   12 | ...\n",
            "clang++: expected ';' before 'return'",
        ),
        (
            "/usr/bin/ld: cannot find -lgomp: No such file or directory\ncollect2: error: ld returned 1 exit status\n",
            "clang++: /usr/bin/ld: cannot find -lgomp: No such file or directory",
        ),
        ("", "clang++ exited with status 1"),
    ],
)
def test_a_compiler_failure_is_said_in_one_short_line(stderr: str, said: str) -> None:
    assert kernels._short("/usr/bin/clang++", stderr, 1) == said


def test_the_march_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LABKIT_KERNEL_MARCH", "x86-64-v3")
    assert BuildOptions.from_env().wanted() == ("-march=x86-64-v3", "-fopenmp")
    monkeypatch.setenv("LABKIT_KERNEL_MARCH", "none")
    assert BuildOptions.from_env().wanted() == ("-fopenmp",)
    monkeypatch.delenv("LABKIT_KERNEL_MARCH")
    assert BuildOptions.from_env().march == "native"


# -- no OpenMP -------------------------------------------------------------------------------------
@needs_gxx
def test_a_compiler_without_openmp_builds_every_kernel_for_one_thread_with_the_same_bits(
    fresh_cache: Path, tmp_path: Path
) -> None:
    native = kernels.fixed_matmul_kernel()  # built into the fresh cache with g++ and OpenMP
    clang = BuildOptions(like_apple_clang(tmp_path / "bin"), "native")
    report = build_report(clang)
    assert [b.built for b in report] == [True, True, True]
    assert all("openmp" not in b.features and "-fopenmp" not in b.flags for b in report)
    note = "without -fopenmp (clang++: unsupported option '-fopenmp'): one thread"
    assert all(b.notes == (note,) for b in report)
    assert build_summary(clang).startswith("kernels: built (clang++ -march=native; one thread;")
    assert build_summary(clang).endswith(note)
    single = kernels._kernel(kernels.MATMUL_SOURCE, clang)
    assert single.path != native.path and "openmp" in native.features
    gen = torch.Generator().manual_seed(1)
    weight, x = torch.randn(256, 400, generator=gen), torch.randn(64, 256, generator=gen)
    packed = PackedWeight.pack(weight)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)  # the OpenMP build splits this product between two threads
        assert torch.equal(fixed_matmul(x, packed, kernel=single), fixed_matmul(x, packed, kernel=native))
    finally:
        torch.set_num_threads(threads)


# -- a compiler that fails -------------------------------------------------------------------------
@needs_gxx
def test_a_failing_compiler_is_reported_once_and_the_runner_says_why(
    fresh_cache: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    tiny_llama: LoadedModel,
) -> None:
    broken = fake_compiler(
        tmp_path / "bin", "g++", "echo 'g++: fatal error: cannot execute cc1plus: No such file' >&2; exit 1"
    )
    monkeypatch.setenv("LABKIT_CXX", broken)
    reason = "g++ failed to compile a test library: g++: cannot execute cc1plus: No such file"
    with caplog.at_level(logging.WARNING, logger="labkit.engine.kernels"):
        assert build_summary() == f"kernels: not built — {reason}; using the library path"
        assert [b.reason for b in build_report()] == [reason] * 3
        runner = BatchEngine(tiny_llama, EngineConfig(max_batch=2, num_blocks=64)).runner
    assert [r.getMessage() for r in caplog.records] == [
        f"kernels: paged_decode not built — {reason}; the engine uses torch's ops instead"
    ]
    assert runner.attention.mode == "gather" and runner.attention.reason == f"auto: {reason}; using the gather"
    assert runner.matmul.mode == "library" and runner.matmul.reason == f"auto: {reason}; using the library's matmuls"
    assert not runner.network.native_ops
    with pytest.raises(KernelUnavailable) as caught:
        kernels.fixed_matmul_kernel()
    assert "\n" not in str(caught.value)


# -- no FMA ----------------------------------------------------------------------------------------
@needs_gxx
@pytest.mark.skipif(not X86, reason="x86-64-v2 names an x86 CPU without FMA")
def test_without_hardware_fma_auto_takes_torchs_ops_and_kernel_still_runs(
    fresh_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LABKIT_KERNEL_MARCH", "x86-64-v2")
    assert all(b.built and "fma" not in b.features for b in build_report())
    matmul = choose_matmul("auto", CPU, torch.float32)
    assert matmul.mode == "library" and "(-march=x86-64-v2) has no hardware FMA" in matmul.reason
    attention = choose_attention("auto", CPU, torch.float32)
    assert attention.mode == "gather" and "no hardware FMA" in attention.reason
    assert "no hardware FMA" in (rowwise.available(CPU, torch.float32, fast_only=True) or "")
    assert rowwise.available(CPU, torch.float32) is None
    asked = choose_matmul("kernel", CPU, torch.float32)
    assert asked.mode == "kernel" and "slow here" in asked.reason
    assert build_summary().startswith("kernels: built (g++ -march=x86-64-v2; OpenMP; no FMA)")


@needs_gxx
@pytest.mark.skipif(not X86, reason="x86-64-v3 names an x86 CPU")
def test_the_build_options_are_part_of_the_cache_key(fresh_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    native = kernels.paged_decode_kernel()
    monkeypatch.setenv("LABKIT_KERNEL_MARCH", "x86-64-v3")
    v3 = kernels.paged_decode_kernel()
    assert v3.path != native.path and v3.path.parent == native.path.parent == fresh_cache
    assert "-march=x86-64-v3" in v3.flags and {"fma", "avx2"} <= v3.features and "avx512f" not in v3.features


# -- measured once ---------------------------------------------------------------------------------
@needs_gxx
def test_auto_weighs_the_kernel_against_the_library_once_and_keeps_the_numbers_beside_the_build(
    fresh_cache: Path,
) -> None:
    kernel = kernels.fixed_matmul_kernel()
    if "fma" not in kernel.features:
        pytest.skip("this CPU has no FMA: auto never measures")
    check = speed_check(kernel)  # measured here, on this machine
    assert check.rows == (1, 32) and min(check.kernel_ms + check.library_ms) > 0
    record = kernel.path.with_name(f"{kernel.path.stem}.speed-t{torch.get_num_threads()}.json")
    assert json.loads(record.read_text())["kernel_ms"] == list(check.kernel_ms)
    record.write_text(json.dumps({"rows": [1, 32], "kernel_ms": [0.05, 30.0], "library_ms": [0.04, 1.0]}))
    slow = choose_matmul("auto", CPU, torch.float32)
    assert slow.mode == "library" and "kernel 0.05/30 ms, library 0.04/1 ms at 1/32 rows" in slow.reason
    assert choose_matmul("kernel", CPU, torch.float32).mode == "kernel"  # asked for, it is used anyway
    record.write_text(json.dumps({"rows": [1, 32], "kernel_ms": [0.05, 0.9], "library_ms": [0.04, 1.0]}))
    fast = choose_matmul("auto", CPU, torch.float32)
    assert fast.mode == "kernel" and fast.reason.startswith("auto: kernel available; measured once: kernel 0.05/0.9")


def test_a_gpu_engine_is_told_the_kernels_are_cpu_only() -> None:
    cuda = torch.device("cuda")
    assert "CPU-only; device is cuda" in choose_matmul("auto", cuda, torch.float32).reason
    assert "CPU-only; device is cuda" in choose_attention("auto", cuda, torch.float32).reason
    assert "CPU-only" in (rowwise.available(cuda, torch.float32, fast_only=True) or "")
    if os.environ.get("LABKIT_CXX") is None:
        assert choose_matmul("library", cuda, torch.float32).reason == "asked for"
