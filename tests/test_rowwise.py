"""The row-wise ops between the matmuls, native (``rowwise.py``): RMSNorm after the residual add,
rotary positions, the K/V write, the MLP gate and the greedy argmax.

Each must agree with the torch ops it replaces (bitwise where the arithmetic is the same: the
rotation, the write, the argmax; to rounding where the order of a sum differs: the norm, the
gate's exp), give a row the same bits whatever rows share the call and however many threads run,
and refuse what it cannot take with a ValueError before native code sees a pointer.
"""

from __future__ import annotations

import pytest
import torch
from runner_helpers import make_runner, shuffled_tables

from labkit.engine.config import EngineConfig
from labkit.engine.engine import BatchEngine
from labkit.engine.layers import RopeTable, rotate
from labkit.engine.layers import rms_norm as torch_rms_norm
from labkit.engine.rowwise import argmax_rows, kv_write, rms_norm, rope, silu_mul
from labkit.models import LoadedModel


def _threads(n: int):
    class _Set:
        def __enter__(self) -> None:
            self.before = torch.get_num_threads()
            torch.set_num_threads(n)

        def __exit__(self, *exc: object) -> None:
            torch.set_num_threads(self.before)

    return _Set()


# -- RMSNorm ------------------------------------------------------------------------------------
@pytest.mark.parametrize("width", [576, 64, 37, 1])
def test_the_norm_is_torchs_to_rounding_and_a_rows_bits_are_its_own(width: int) -> None:
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(300, width, generator=gen) * 3, torch.randn(width, generator=gen)
    out = rms_norm(x, w, 1e-5)
    torch.testing.assert_close(out, torch_rms_norm(x, w, 1e-5), atol=2e-6, rtol=2e-6)
    assert torch.equal(torch.cat([rms_norm(x[i : i + 1], w, 1e-5) for i in range(len(x))]), out)
    with _threads(1):
        assert torch.equal(rms_norm(x, w, 1e-5), out)  # 300 x 576 rows run on two threads otherwise


def test_the_norm_adds_the_residual_in_place_first() -> None:
    """The layer's ``x = o + x`` and the norm of the sum in one pass: ``o`` becomes the sum,
    bitwise what ``add_`` gives, and a residual at a row stride (a view) is read as such."""
    gen = torch.Generator().manual_seed(2)
    o, wide, w = torch.randn(9, 64, generator=gen), torch.randn(9, 100, generator=gen), torch.randn(64, generator=gen)
    x = wide[:, 10:74]  # rows at stride 100
    expected_sum = o + x
    out = rms_norm(o, w, 1e-6, residual=x)
    assert torch.equal(o, expected_sum)
    assert torch.equal(out, rms_norm(expected_sum, w, 1e-6))
    # row by row, and on one thread, the same bits (300 x 576 is past the two-thread threshold)
    big, res, w576 = torch.randn(300, 576, generator=gen), torch.randn(300, 576, generator=gen), torch.randn(576)
    together = rms_norm(big.clone(), w576, 1e-6, residual=res)
    alone = torch.cat([rms_norm(big[i : i + 1].clone(), w576, 1e-6, residual=res[i : i + 1]) for i in range(300)])
    with _threads(1):
        single = rms_norm(big.clone(), w576, 1e-6, residual=res)
    assert torch.equal(together, alone) and torch.equal(together, single)
    torch.testing.assert_close(out, torch_rms_norm(expected_sum, w, 1e-6), atol=2e-6, rtol=2e-6)


def test_the_norm_refuses_what_it_cannot_take() -> None:
    x, w = torch.randn(4, 8), torch.randn(8)
    with pytest.raises(ValueError, match="float32"):
        rms_norm(x.double(), w, 1e-5)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, torch.randn(7), 1e-5)
    with pytest.raises(ValueError, match="contiguous rows"):
        rms_norm(torch.randn(4, 16)[:, ::2], w, 1e-5)
    with pytest.raises(ValueError, match="rows"):
        rms_norm(x, w, 1e-5, residual=torch.randn(3, 8))
    with pytest.raises(ValueError, match="itself"):
        rms_norm(x, w, 1e-5, residual=x)
    assert rms_norm(torch.empty(0, 8), w, 1e-5).shape == (0, 8)


# -- rotary positions ---------------------------------------------------------------------------
def _table(d: int) -> RopeTable:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    return RopeTable(inv_freq, 1.0, 2048, torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("rows,d", [(1, 64), (3, 64), (200, 64), (17, 2), (17, 6), (5, 128)])
def test_the_rotation_is_bitwise_layers_rotate_in_place(rows: int, d: int) -> None:
    """On the q and k heads of a fused q/k/v row (a view, rows at a wider stride), leaving the v
    heads alone, at any row count, head size and thread count."""
    gen = torch.Generator().manual_seed(3)
    fused = torch.randn(rows, 9 + 2 * 3, d, generator=gen)
    cos, sin = _table(d).lookup(torch.randint(0, 2048, (rows,), generator=gen))
    expected = rotate(fused[:, :12].clone(), cos, sin)
    values = fused[:, 12:].clone()
    with _threads(1):
        single = rope(fused[:, :12].clone(), cos, sin)
    out = rope(fused[:, :12], cos, sin)
    assert out.data_ptr() == fused.data_ptr()
    assert torch.equal(fused[:, :12], expected) and torch.equal(single, expected)
    assert torch.equal(fused[:, 12:], values)


def test_the_rotation_refuses_what_it_cannot_take() -> None:
    cos, sin = _table(8).lookup(torch.arange(2))
    with pytest.raises(ValueError, match="contiguous heads"):
        rope(torch.randn(2, 8, 3).transpose(1, 2), cos, sin)
    with pytest.raises(ValueError, match="cos"):
        rope(torch.randn(2, 3, 16), cos, sin)  # a table for d = 8
    with pytest.raises(ValueError, match="even"):
        rope(torch.randn(2, 1, 7), torch.randn(2, 7), torch.randn(2, 7))
    with pytest.raises(ValueError, match="cos must be"):  # as many numbers as (2, 8), not its shape
        rope(torch.randn(2, 3, 8), cos.reshape(1, 16), sin)
    assert rope(torch.empty(0, 3, 8), cos[:0], sin[:0]).shape == (0, 3, 8)


# -- the K/V write ------------------------------------------------------------------------------
def test_the_write_puts_each_row_at_its_slot_in_every_head() -> None:
    gen = torch.Generator().manual_seed(5)
    pool = torch.zeros(2, 3, 40, 16)
    fused = torch.randn(5, 9 + 6, 16, generator=gen)
    k, v = fused[:, 9:12], fused[:, 12:]  # views into the fused row, as the runner passes them
    slots = torch.tensor([0, 39, 7, 8, 21])
    kv_write(pool, slots, k, v)
    assert torch.equal(pool[0][:, slots], k.transpose(0, 1)) and torch.equal(pool[1][:, slots], v.transpose(0, 1))
    untouched = torch.ones(40, dtype=torch.bool)
    untouched[slots] = False
    assert not pool[:, :, untouched].any()


def test_a_slot_outside_the_pool_is_refused_and_nothing_is_written() -> None:
    pool = torch.zeros(2, 1, 8, 4)
    k = v = torch.ones(2, 1, 4)
    for bad in ([0, 8], [-1, 0]):
        with pytest.raises(ValueError, match="outside the pool"):
            kv_write(pool, torch.tensor(bad), k, v)
        assert not pool.any()
    with pytest.raises(ValueError, match="slots"):
        kv_write(pool, torch.tensor([0, 1], dtype=torch.int32), k, v)
    with pytest.raises(ValueError, match="k must be"):
        kv_write(pool, torch.tensor([0, 1]), torch.ones(2, 2, 4), v)
    keys_only = torch.zeros(2, 1, 8, 4)[:1]  # one half of a pool: the values would land past its end
    with pytest.raises(ValueError, match="pool must be"):
        kv_write(keys_only, torch.tensor([0, 1]), k, v)


# -- the runner ---------------------------------------------------------------------------------
def test_a_runner_with_native_ops_matches_one_without_to_rounding_and_stays_invariant(tiny_llama: LoadedModel) -> None:
    """The native ops change rounding (the norm's sum), not the model: logits close to the torch
    ops' path; and a row's logits are still bitwise its solo ones beside any neighbours."""
    native = make_runner(tiny_llama, num_blocks=64)
    torch_ops = make_runner(tiny_llama, num_blocks=64, matmul="library")
    assert native.network.native_ops and native.pool.native and not torch_ops.network.native_ops
    prompts = [[5, 9, 11, 3], [7] * 13, [2, 4]]
    tables = shuffled_tables(len(prompts), 4, 64, seed=3)
    first = native.prefill_many(prompts, tables)
    torch.testing.assert_close(first, torch_ops.prefill_many(prompts, tables), atol=1e-4, rtol=1e-4)
    lengths = [len(p) for p in prompts]
    together = native.decode([9, 9, 9], lengths, tables)
    for i in range(3):
        assert torch.equal(native.decode([9], [lengths[i]], [tables[i]])[0], together[i])
    torch.testing.assert_close(together, torch_ops.decode([9, 9, 9], lengths, tables), atol=1e-4, rtol=1e-4)


# -- the fused MLP gate -----------------------------------------------------------------------
def test_the_fused_gate_is_silu_times_up_and_places_nothing_by_position() -> None:
    """Close to torch's silu * up; each element's bits the same at any row count, any offset in
    its row (a ragged end goes through the same code as the rest), and on any thread count."""
    gen = torch.Generator().manual_seed(4)
    width = 3 * 16 + 5
    gu = torch.randn(300, 2 * width, generator=gen) * 6
    gu[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # past exp's range both ways, and zeros
    out = silu_mul(gu)
    gate, up = gu.chunk(2, dim=-1)
    torch.testing.assert_close(out, torch.nn.functional.silu(gate) * up, atol=1e-5, rtol=1e-5)
    assert torch.equal(torch.cat([silu_mul(gu[i : i + 1]) for i in range(len(gu))]), out)
    assert torch.isfinite(out).all()
    # the same values at another place in a row: the same bits
    moved = torch.cat([gate[:, 7:], gate[:, :7], up[:, 7:], up[:, :7]], dim=1)
    assert torch.equal(silu_mul(moved), torch.cat([out[:, 7:], out[:, :7]], dim=1))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(silu_mul(gu), out)
    finally:
        torch.set_num_threads(before)
    with pytest.raises(ValueError, match="2 \\* width"):
        silu_mul(torch.randn(2, 5))


def test_a_runner_calls_the_native_ops_where_the_kernels_build(
    tiny_llama: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In both modes, every layer's norms, rotation, K/V write and gate go through rowwise; with
    ``matmul="library"`` none does."""
    import labkit.engine.rowwise as rw

    calls: dict[str, int] = {}

    def counted(name: str, real):
        def call(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return real(*args, **kwargs)

        return call

    for name in ("rms_norm", "rope", "kv_write", "silu_mul"):
        monkeypatch.setattr(rw, name, counted(name, getattr(rw, name)))
    layers = tiny_llama.model.config.num_hidden_layers
    for kwargs in ({}, {"batch_invariant": False}):
        calls.clear()
        runner = make_runner(tiny_llama, num_blocks=16, **kwargs)
        assert runner.network.native_ops
        runner.decode([5, 6], [0, 0], [[0], [1]])
        assert calls == {"rms_norm": 2 * layers + 1, "rope": layers, "kv_write": layers, "silu_mul": layers}
    plain = make_runner(tiny_llama, num_blocks=16, batch_invariant=False)
    assert plain.matmul.mode == "library" and plain._tile is None
    calls.clear()
    library = make_runner(tiny_llama, num_blocks=16, matmul="library")
    assert not library.network.native_ops
    library.decode([5, 6], [0, 0], [[0], [1]])
    assert calls == {}


# -- the greedy choice ------------------------------------------------------------------------
def test_the_native_argmax_picks_what_torch_argmax_picks() -> None:
    """The first maximum; ties, NaN (torch counts it the largest), all -inf, a ragged width."""
    gen = torch.Generator().manual_seed(6)
    for width in (49152, 37, 16, 1):
        x = torch.randn(12, width, generator=gen)
        if width == 37:  # the special values in the scalar tail (past the last 16 lanes)
            x[1, 35] = float("nan")
            x[2, 33] = float("inf")
            x[3, 34] = x[3, 36] = x[3].max() + 1
            x[4] = float("-inf")
        if width > 40:
            x[1, 100] = x[1, 50] = float("nan")
            x[2] = float("-inf")
            x[3, 7] = x[3, 9] = x[3].max() + 1  # a tie: the first wins
            x[4] = 1.0
            x[5, -1] = 1e30
            x[6, -3] = float("nan")
            x[7, 20:] = float("inf")
        assert torch.equal(argmax_rows(x), torch.argmax(x, dim=-1)), width
    strided = torch.randn(4, 64)[:, ::2]
    assert torch.equal(argmax_rows(strided), torch.argmax(strided, dim=-1))
    expanded = torch.randn(1, 40).expand(3, 40)  # rows at stride 0
    assert torch.equal(argmax_rows(expanded), torch.argmax(expanded, dim=-1))
    with pytest.raises(ValueError, match="float32"):
        argmax_rows(torch.randn(2, 5, dtype=torch.float64))


def test_the_sampler_takes_the_native_argmax_for_greedy_rows(
    tiny_llama: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    import labkit.engine.sampling as sampling
    from labkit.engine.sampling import Sampler
    from labkit.engine.sequence import SamplingParams, Sequence

    calls: list[int] = []

    def counting(logits: torch.Tensor) -> torch.Tensor:
        calls.append(len(logits))
        return argmax_rows(logits)

    logits = torch.randn(5, 300)
    seqs = [Sequence(f"r{i}", [1, 2], SamplingParams(max_new_tokens=4), None) for i in range(5)]
    monkeypatch.setattr(sampling, "argmax_rows", counting)
    assert Sampler("cpu", native=True).sample(logits, seqs) == torch.argmax(logits, dim=-1).tolist()
    assert calls == [5]
    assert Sampler("cpu").sample(logits, seqs) == torch.argmax(logits, dim=-1).tolist() and calls == [5]
    assert BatchEngine(tiny_llama, EngineConfig(max_batch=2, num_blocks=64)).sampler.native
