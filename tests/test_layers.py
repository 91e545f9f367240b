"""The invariant matmul: a row's bits never depend on how many rows share the call, or where it sits."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from runner_helpers import make_runner, shuffled_tables

import labkit.engine.runner as runner_module
from labkit.engine.layers import Tiling, linear, probe_chunk_rows
from labkit.models import LoadedModel


def _solo(x: torch.Tensor, weight: torch.Tensor, tiling: Tiling) -> torch.Tensor:
    """Each row multiplied alone, padded as the runner pads a batch of one."""
    out = []
    for row in x:
        padded = torch.cat([row[None], torch.zeros(tiling.padded(1) - 1, x.shape[1])])
        out.append(linear(padded, weight, None, tiling)[0])
    return torch.stack(out)


@pytest.mark.parametrize("tiling", [Tiling(4), Tiling(8, exact=True)], ids=["chunks", "exact-tiles"])
def test_every_row_of_every_batch_size_has_its_solo_bits(tiling: Tiling) -> None:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 80, generator=gen)  # (in, out)
    if not tiling.exact and probe_chunk_rows(weight, 4) < 4:
        pytest.skip("this machine's kernels round 2..4-row calls differently: the runner would use exact tiles")
    x = torch.randn(19, 96, generator=gen)
    alone = _solo(x, weight, tiling)
    for rows in (1, 2, 3, 4, 5, 9, 13, 19):  # inside one chunk, whole chunks, a lone last row
        got = linear(torch.cat([x[:rows], torch.zeros(tiling.padded(rows) - rows, 96)]), weight, None, tiling)
        assert torch.equal(got[:rows], alone[:rows]), rows
    torch.testing.assert_close(alone, x @ weight, atol=1e-4, rtol=0)


def test_chunks_need_two_rows_and_exact_tiles_whole_tiles() -> None:
    assert [Tiling(16).padded(n) for n in (1, 2, 17)] == [2, 2, 17]
    assert [Tiling(8, exact=True).padded(n) for n in (1, 8, 9)] == [8, 8, 16]
    with pytest.raises(AssertionError, match="pad it"):
        linear(torch.ones(1, 4), torch.ones(4, 3), None, Tiling(8))


def test_plain_linear_is_the_ordinary_product_with_bias() -> None:
    x, w, b = torch.randn(5, 6), torch.randn(6, 3), torch.randn(3)
    torch.testing.assert_close(linear(x, w, b, None), F.linear(x, w.t(), b))


def test_a_runner_whose_kernels_fail_the_probe_falls_back_to_exact_tiles(tiny_llama: LoadedModel, monkeypatch) -> None:
    monkeypatch.setattr(runner_module, "probe_chunk_rows", lambda weight, most: 0)
    runner = make_runner(tiny_llama, block_size=4, num_blocks=64, tile_rows=8, matmul="library")
    assert runner._tile == Tiling(8, exact=True)
    tables = shuffled_tables(5, 10, 64, seed=1)
    lengths = [3, 9, 17, 30, 5]
    for n, table in zip(lengths, tables):
        runner.prefill([(11 * j) % 400 + 3 for j in range(n)], table)
    solo = [runner.decode([9], [n], [t])[0] for n, t in zip(lengths, tables)]
    mixed = runner.decode([9] * 5, lengths, tables)
    assert all(torch.equal(mixed[i], solo[i]) for i in range(5))


def test_a_change_of_thread_count_re_probes_before_the_next_forward(tiny_llama: LoadedModel, monkeypatch) -> None:
    """The probe's chunk sizes hold for the thread count they were found under; a runner whose
    process changes torch's thread count probes again instead of trusting the old sizes."""
    probed: list[int] = []
    real = runner_module.probe_chunk_rows

    def counting(weight: torch.Tensor, most: int) -> int:
        probed.append(torch.get_num_threads())
        return real(weight, most)

    monkeypatch.setattr(runner_module, "probe_chunk_rows", counting)
    before = torch.get_num_threads()
    runner = make_runner(tiny_llama, block_size=4, num_blocks=64, matmul="library")
    assert set(probed) == {before}
    other = 2 if before == 1 else 1
    table = shuffled_tables(1, 4, 64)[0]
    try:
        torch.set_num_threads(other)
        runner.prefill([5, 6, 7], table)
        assert other in probed
        count = len(probed)
        runner.decode([8], [3], [table])
        assert len(probed) == count, "the same thread count probes once"
    finally:
        torch.set_num_threads(before)
