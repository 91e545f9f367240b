"""The fixed-order matmul: each output element is one chain of fused multiply-adds in k order.

So a row's bits depend on its own values and the weight only: not on how many rows share the
call, where the row sits, how many threads run, or whether the vector or the scalar path runs.
It must agree with the library's product to rounding, refuse what it cannot multiply before any
native code runs, and, where it cannot be built, leave the engine on the library's probed chunks
with the reason said.
"""

from __future__ import annotations

import pytest
import torch
from runner_helpers import make_runner, shuffled_tables

from labkit.engine.config import EngineConfig
from labkit.engine.engine import BatchEngine
from labkit.engine.kernels import KernelUnavailable, fixed_matmul_kernel
from labkit.engine.layers import Tiling, linear
from labkit.engine.matmul import PANEL, FixedOrder, PackedWeight, choose_matmul, fixed_matmul
from labkit.models import LoadedModel

CPU = torch.device("cpu")
# in x out: whole panels, a ragged last panel, narrower than one panel, one column, and widths whose
# last group of panels is short or ragged for the few-row tiles (which take 2 or 4 panels at once)
SHAPES = [(96, 2 * PANEL), (64, 100), (37, 20), (8, 1), (40, 4 * PANEL - 5), (33, 2 * PANEL - 4), (5, 5 * PANEL + 1)]


def _case(k: int, n: int, rows: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, k, generator=gen), torch.randn(k, n, generator=gen) / k**0.5, torch.randn(n, generator=gen)


@pytest.mark.parametrize("k,n", SHAPES)
def test_every_row_has_its_solo_bits_at_every_batch_size(k: int, n: int) -> None:
    """Batch sizes inside one register tile, past it, and past a cache block (128 rows)."""
    x, w, b = _case(k, n, 150)
    packed = PackedWeight.pack(w)
    alone = torch.cat([fixed_matmul(x[i : i + 1], packed, b) for i in range(len(x))])
    for rows in (1, 2, 3, 4, 5, 7, 8, 9, 17, 32, 129, 150):
        assert torch.equal(fixed_matmul(x[:rows], packed, b), alone[:rows]), rows
    shuffled = torch.randperm(len(x), generator=torch.Generator().manual_seed(1))
    assert torch.equal(fixed_matmul(x[shuffled], packed, b), alone[shuffled])
    torch.testing.assert_close(alone, x @ w + b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 40])
def test_the_vector_and_scalar_paths_and_any_thread_count_give_the_same_bits(rows: int) -> None:
    """Where AVX-512 is compiled in, the vector tiles (several panels at once for up to 4 rows)
    against the scalar chains; on any machine, one thread against two."""
    x, w, b = _case(200, 7 * PANEL + 5, rows, seed=2)
    packed = PackedWeight.pack(w)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = fixed_matmul(x, packed, b)
        torch.set_num_threads(2)
        two = fixed_matmul(x, packed, b)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)
    assert torch.equal(fixed_matmul(x, packed, b, vector=False), one)


def test_a_row_is_a_fused_multiply_add_chain_in_k_order() -> None:
    """Values where the order shows: 1e8 + 1 - 1e8 is 0 summed left to right in float32, 1 in
    another order. Column 0 takes the terms in k order; the result says which order ran."""
    x = torch.tensor([[1e8, 1.0, -1e8]])
    w = torch.ones(3, 1)
    assert fixed_matmul(x, PackedWeight.pack(w)).item() == 0.0  # (1e8 + 1) rounds to 1e8, then - 1e8
    x2 = torch.tensor([[1e8, -1e8, 1.0]])
    assert fixed_matmul(x2, PackedWeight.pack(w)).item() == 1.0
    # fused: c + a*b rounded once. With c = -(1 + 2**-11) and a = b = 1 + 2**-12, a*b = 1 + 2**-11 +
    # 2**-24 exactly; rounded first (a separate multiply) it loses the 2**-24 and the sum is 0.
    c, a = -(1 + 2**-11), 1 + 2**-12
    fused = fixed_matmul(torch.tensor([[c, a]]), PackedWeight.pack(torch.tensor([[1.0], [a]])))
    assert fused.item() == 2**-24


def test_linear_takes_the_kernel_without_padding_and_returns_a_new_tensor() -> None:
    x, w, b = _case(64, 100, 3)
    tiling = FixedOrder.of([w])
    assert [tiling.padded(r) for r in (1, 2, 33)] == [1, 2, 33]
    out = linear(x, w, b, tiling)
    assert torch.equal(out, fixed_matmul(x, tiling.packed[id(w)], b))
    assert out.data_ptr() not in (x.data_ptr(), w.data_ptr())
    strided = torch.randn(3, 128)[:, ::2]  # a non-contiguous input is copied, not misread
    torch.testing.assert_close(linear(strided, w, None, tiling), strided @ w, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="not packed"):
        linear(x, w.clone(), None, tiling)


def test_what_it_cannot_multiply_is_refused_before_native_code_runs() -> None:
    w = torch.randn(16, 10)
    packed = PackedWeight.pack(w)
    with pytest.raises(ValueError, match=r"\(rows, 16\) float32"):
        fixed_matmul(torch.randn(2, 15), packed)
    with pytest.raises(ValueError, match="float32"):
        fixed_matmul(torch.randn(2, 16, dtype=torch.float64), packed)
    with pytest.raises(ValueError, match="float32"):
        fixed_matmul(torch.randn(2, 2, 16), packed)
    with pytest.raises(ValueError, match="bias"):
        fixed_matmul(torch.randn(2, 16), packed, torch.randn(11))
    with pytest.raises(ValueError, match="2-D float32"):
        PackedWeight.pack(torch.randn(4, 4, dtype=torch.bfloat16))
    assert fixed_matmul(torch.randn(0, 16), packed).shape == (0, 10)
    with pytest.raises(ValueError, match="panels must be"):  # would read past the panels' end
        PackedWeight(torch.ones(1, 4, PANEL), rows=4, cols=PANEL * 4000)
    with pytest.raises(ValueError, match="non-empty"):
        PackedWeight.pack(torch.randn(0, 4))
    with pytest.raises(ValueError, match="bias"):
        fixed_matmul(torch.randn(2, 16), packed, torch.randn(20)[::2])
    with pytest.raises(ValueError, match="not packed"):
        FixedOrder.of([w]).matmul(torch.randn(2, 16), w[:, :5], None)


# -- choosing, and the runner that uses it ----------------------------------------------------
def test_auto_picks_the_kernel_on_cpu_float32_and_says_why_not_elsewhere() -> None:
    assert choose_matmul("auto", CPU, torch.float32).mode == "kernel"
    assert choose_matmul("library", CPU, torch.float32) == choose_matmul("library", CPU, torch.float32)
    bf16 = choose_matmul("auto", CPU, torch.bfloat16)
    assert bf16.mode == "library" and "float32" in bf16.reason
    cuda = choose_matmul("auto", torch.device("cuda"), torch.float32)
    assert cuda.mode == "library" and "CPU-only" in cuda.reason
    with pytest.raises(ValueError, match="float32-only"):
        choose_matmul("kernel", CPU, torch.float16)
    with pytest.raises(ValueError, match="must be one of"):
        choose_matmul("fast", CPU, torch.float32)
    with pytest.raises(ValueError, match="matmul must be one of"):
        EngineConfig(matmul="fast")


def test_without_a_compiler_the_invariant_mode_falls_back_to_the_library(
    tiny_llama: LoadedModel, monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    monkeypatch.setenv("LABKIT_CXX", "/nonexistent/g++")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with pytest.raises(KernelUnavailable):
        fixed_matmul_kernel()
    with pytest.raises(ValueError, match="unavailable"):
        BatchEngine(tiny_llama, EngineConfig(matmul="kernel", max_batch=2, num_blocks=64))
    runner = BatchEngine(tiny_llama, EngineConfig(max_batch=2, num_blocks=64)).runner
    assert runner.matmul.mode == "library" and "no C++ compiler" in runner.matmul.reason
    assert isinstance(runner._tile, Tiling) and not runner.network.native_ops


@pytest.mark.parametrize("model", ["tiny_llama", "tiny_gpt2"])
def test_a_kernel_runner_gives_each_sequence_its_solo_logits(model: str, request: pytest.FixtureRequest) -> None:
    """Prefilled alone or packed, decoded alone or in a batch: the same bits, and close to the
    library's product (the two round differently, so only closeness is asked of them)."""
    loaded: LoadedModel = request.getfixturevalue(model)
    runner = make_runner(loaded, block_size=4, num_blocks=128, matmul="kernel")
    library = make_runner(loaded, block_size=4, num_blocks=128, matmul="library")
    assert isinstance(runner._tile, FixedOrder) and runner.matmul.mode == "kernel"
    lengths = [3, 9, 17, 30, 5]
    prompts = [[(11 * j + i) % 400 + 3 for j in range(n)] for i, n in enumerate(lengths)]
    tables = shuffled_tables(5, 10, 128, seed=3)
    solo_first = torch.stack([runner.prefill(p, t) for p, t in zip(prompts, tables)])
    solo = [runner.decode([9], [n], [t])[0] for n, t in zip(lengths, tables)]
    packed_first = runner.prefill_many(prompts, tables)
    assert torch.equal(packed_first, solo_first)
    mixed = runner.decode([9] * 5, lengths, tables)
    assert all(torch.equal(mixed[i], solo[i]) for i in range(5))
    reference = torch.stack([library.prefill(p, t) for p, t in zip(prompts, tables)])
    torch.testing.assert_close(solo_first, reference, atol=1e-3, rtol=1e-3)
