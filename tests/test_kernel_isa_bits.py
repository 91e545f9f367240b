"""The kernels give the same bits on every instruction set they build for.

Why: a fused multiply-add rounds once whether an AVX-512 unit, an AVX2 unit or the C library
computes it, and the kernels are built with ``-ffp-contract=off`` so the compiler adds none of its
own; if that holds, a model's logits are the same bits on a laptop without AVX-512, on an old CPU
without FMA (slowly) and on this machine. Each build runs in its own process (a process loads one
build of each kernel) with its own cache folder: ``-march=native`` with OpenMP, ``x86-64-v3``
(AVX2 + FMA), and ``x86-64-v2`` (no FMA) through a compiler that refuses ``-fopenmp``.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from kernel_helpers import like_apple_clang

ROOT = Path(__file__).resolve().parent.parent

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="the -march names are x86's"),
    pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to build the kernels"),
]

# Prefill two prompts of a tiny model and decode three steps of both together, every product, the
# attention and the row-wise ops through the kernels; save every logit and what the build used.
SCRIPT = """
import sys, torch
from labkit.engine import kernels
from labkit.engine.runner import ModelRunner
from labkit.models import load_model

torch.set_num_threads(2)
out = {"features": sorted(kernels.fixed_matmul_kernel().features)}
for name in ("tiny-llama", "tiny-gpt2"):
    runner = ModelRunner(load_model(name), num_blocks=64, block_size=4, attention="kernel", matmul="kernel")
    assert runner.network.native_ops and runner.attention.mode == runner.matmul.mode == "kernel"
    prompts, tables = [[5, 9, 13, 2, 7], [3, 4, 8]], [[10, 3, 7, 21], [1, 30, 12, 6]]
    logits = [runner.prefill_many(prompts, tables)]
    tokens, positions = [int(t) for t in logits[0].argmax(-1)], [len(p) for p in prompts]
    for _ in range(3):
        step = runner.decode(tokens, positions, tables)
        logits.append(step)
        tokens, positions = [int(t) for t in step.argmax(-1)], [p + 1 for p in positions]
    out[name] = torch.cat(logits)
torch.save(out, sys.argv[1])
"""


def run_build(tmp_path: Path, label: str, env: dict[str, str]) -> dict[str, object]:
    result = tmp_path / f"{label}.pt"
    environ = {k: v for k, v in os.environ.items() if k not in ("LABKIT_KERNEL_MARCH", "LABKIT_CXX", "CXX")}
    environ |= {"XDG_CACHE_HOME": str(tmp_path / label), "PYTHONPATH": str(ROOT), **env}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(result)], env=environ, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, f"{label}: {done.stderr[-2000:]}"
    return torch.load(result)


def test_logits_are_the_same_bits_with_avx512_avx2_and_without_fma_or_openmp(tmp_path: Path) -> None:
    native = run_build(tmp_path, "native", {})
    v3 = run_build(tmp_path, "v3", {"LABKIT_KERNEL_MARCH": "x86-64-v3"})
    portable = run_build(
        tmp_path, "v2", {"LABKIT_KERNEL_MARCH": "x86-64-v2", "LABKIT_CXX": like_apple_clang(tmp_path / "bin")}
    )
    assert v3["features"] == ["avx2", "fma", "openmp"] and portable["features"] == []
    for name in ("tiny-llama", "tiny-gpt2"):
        assert isinstance(native[name], torch.Tensor) and native[name].shape[0] == 2 * 4
        assert torch.equal(native[name], v3[name]), f"{name}: native and x86-64-v3 differ"
        assert torch.equal(native[name], portable[name]), f"{name}: native and x86-64-v2 without OpenMP differ"
