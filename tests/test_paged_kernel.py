"""The paged decode kernel reads K and V through the block tables and computes what the gather computes.

The gather path (``attention="gather"``) copies each row's blocks into one tensor and runs
batched matmuls; the kernel reads the pool in place. The two must agree to float tolerance on
any tables, lengths and head grouping; the kernel must give a row the same bits alone or in any
batch (it is invariant by construction, whatever the mode); greedy tokens of the real tiny models
must not change; hostile tables must be refused in Python, before any native code runs; and
where the kernel cannot be built the engine must fall back to the gather and say why.
"""

from __future__ import annotations

import random

import pytest
import torch
from runner_helpers import PROMPTS, encode, make_runner, runner_greedy, shuffled_tables

from labkit.engine.attention import PagedTables, choose_attention, decode_attention, paged_decode, plan_decode
from labkit.engine.config import EngineConfig
from labkit.engine.engine import BatchEngine
from labkit.engine.events import TokenEvent
from labkit.engine.kernels import KernelUnavailable, cache_dir, paged_decode_kernel
from labkit.models import LoadedModel

CPU = torch.device("cpu")
LENGTHS = [1, 2, 15, 16, 17, 63, 64, 65, 128, 129, 200]


def _random_case(heads: int, kv_heads: int, dim: int, block_size: int, lengths: list[int], seed: int = 0):
    """A random pool, scattered disjoint tables (one spare block each), random queries."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) + 1 for n in lengths]
    num_blocks = sum(need) + 7
    pool = torch.randn(2, kv_heads, num_blocks, block_size, dim, generator=gen)
    ids = random.Random(seed).sample(range(num_blocks), sum(need))
    tables, at = [], 0
    for k in need:
        tables.append(ids[at : at + k])
        at += k
    q = torch.randn(len(lengths), heads, dim, generator=gen)
    return q, pool, tables


def _gather(q: torch.Tensor, pool: torch.Tensor, tables, lengths, block_size: int) -> torch.Tensor:
    plan = plan_decode(
        [n - 1 for n in lengths], tables, block_size, invariant=True, kv_heads=pool.shape[1], dtype=q.dtype, device=CPU
    )
    return decode_attention(q[plan.order], pool, plan)[plan.inverse]


# -- the same numbers as the gather --------------------------------------------------------
@pytest.mark.parametrize(
    "heads,kv_heads,dim,block_size",
    [
        (4, 4, 16, 4),  # plain multi-head, a head smaller than the kernel's vector lanes
        (9, 3, 64, 16),  # grouped-query (SmolLM2's grouping and head size)
        (8, 2, 20, 16),  # a head size that leaves a scalar tail
        (6, 1, 32, 5),  # one KV head for all, a block size that divides nothing
    ],
)
def test_kernel_matches_the_gather_on_scattered_tables(heads: int, kv_heads: int, dim: int, block_size: int) -> None:
    q, pool, tables = _random_case(heads, kv_heads, dim, block_size, LENGTHS)
    paged = PagedTables.build(tables, LENGTHS, block_size)
    got = paged_decode(q, pool, paged)
    want = _gather(q, pool, tables, LENGTHS, block_size)
    assert got.shape == want.shape == (len(LENGTHS), heads * dim)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_kernel_reads_only_the_row_blocks_its_length_covers() -> None:
    """Garbage (NaN) in a row's spare block past its length, and in every block nobody holds,
    never reaches the output: the kernel stops at the row's length."""
    q, pool, tables = _random_case(4, 2, 16, 4, [5, 9, 1])
    held = {b for t, n in zip(tables, [5, 9, 1]) for b in t[: -(-n // 4)]}
    for b in range(pool.shape[2]):
        if b not in held:
            pool[:, :, b] = float("nan")
    got = paged_decode(q, pool, PagedTables.build(tables, [5, 9, 1], 4))
    assert torch.isfinite(got).all()


def test_kernel_takes_the_query_as_a_strided_view() -> None:
    """The runner hands q as a view of the fused q/k/v projection: strided rows, contiguous heads."""
    q, pool, tables = _random_case(6, 3, 16, 4, [7, 30])
    fused = torch.cat([q, torch.randn_like(q), torch.randn_like(q)], dim=1)  # (rows, 3 * heads, d)
    view = fused[:, :6]
    assert not view.is_contiguous()
    paged = PagedTables.build(tables, [7, 30], 4)
    assert torch.equal(paged_decode(view, pool, paged), paged_decode(q.contiguous(), pool, paged))


# -- a row's bits never depend on its neighbours ---------------------------------------------
def test_kernel_rows_are_bitwise_the_same_alone_in_any_batch_and_thread_count() -> None:
    q, pool, tables = _random_case(9, 3, 64, 16, LENGTHS, seed=3)
    solo = [
        paged_decode(q[i : i + 1], pool, PagedTables.build([tables[i]], [LENGTHS[i]], 16))[0]
        for i in range(len(LENGTHS))
    ]
    threads = torch.get_num_threads()
    rng = random.Random(4)
    try:
        for n_threads in (1, 2):
            torch.set_num_threads(n_threads)
            for _ in range(6):
                rows = rng.sample(range(len(LENGTHS)), rng.randint(2, len(LENGTHS)))
                out = paged_decode(
                    q[rows], pool, PagedTables.build([tables[r] for r in rows], [LENGTHS[r] for r in rows], 16)
                )
                for at, r in enumerate(rows):
                    assert torch.equal(out[at], solo[r]), f"row {r} at {at} of {len(rows)}, {n_threads} threads"
    finally:
        torch.set_num_threads(threads)


def _prefilled(loaded: LoadedModel, attention: str, batch_invariant: bool, num_seqs: int = 20, seed: int = 0):
    rng = random.Random(seed)
    runner = make_runner(
        loaded, block_size=4, num_blocks=num_seqs * 40, attention=attention, batch_invariant=batch_invariant
    )
    tables = shuffled_tables(num_seqs, 40, num_seqs * 40, seed=seed)
    lengths = [rng.choice([1, 4, 63, 64, 65, 128, 129, rng.randint(2, 150)]) for _ in range(num_seqs)]
    nexts = []
    for n, table in zip(lengths, tables):
        nexts.append(int(runner.prefill([rng.randrange(50, 1000) for _ in range(n)], table).argmax()))
    return runner, tables, lengths, nexts


@pytest.mark.parametrize("attention", ["kernel", "gather"])
def test_decode_logits_are_bitwise_the_same_alone_and_batched(tiny_model: LoadedModel, attention: str) -> None:
    """The runner's identity test in each attention mode (batch-invariant matmuls)."""
    runner, tables, lengths, nexts = _prefilled(tiny_model, attention, batch_invariant=True)
    assert runner.attention.mode == attention
    solo = [runner.decode([nexts[i]], [lengths[i]], [tables[i]])[0] for i in range(3)]
    rng = random.Random(1)
    for batch_size in (2, 8, 9, 17):
        rows = rng.sample(range(3, 20), batch_size - 1)
        target, position = rng.randrange(3), rng.randrange(batch_size)
        rows.insert(position, target)
        out = runner.decode([nexts[i] for i in rows], [lengths[i] for i in rows], [tables[i] for i in rows])
        assert torch.equal(out[position], solo[target]), f"{attention}: batch of {batch_size}, position {position}"


def test_kernel_attention_is_invariant_in_the_plain_mode_too(tiny_llama: LoadedModel) -> None:
    """Without batch-invariant matmuls only attention is invariant: the kernel's output for a row is
    the same alone and batched (the plain gather pads every row to the widest, so it is not)."""
    runner, tables, lengths, nexts = _prefilled(tiny_llama, "kernel", batch_invariant=False)
    shape = runner.network.shape
    q = torch.randn(len(lengths), shape.num_heads, shape.head_dim, generator=torch.Generator().manual_seed(0))
    for layer in range(shape.num_layers):
        pool = runner.pool.kv[layer]
        batched = paged_decode(q, pool, PagedTables.build(tables, lengths, 4))
        for i in (0, 5, 19):
            alone = paged_decode(q[i : i + 1], pool, PagedTables.build([tables[i]], [lengths[i]], 4))[0]
            assert torch.equal(batched[i], alone)


# -- the real models' tokens do not change ---------------------------------------------------
def test_greedy_tokens_are_the_same_with_kernel_and_gather(tiny_model: LoadedModel) -> None:
    prompts = [encode(tiny_model, p) for p in PROMPTS]
    tables = shuffled_tables(len(prompts), 12, 512, seed=5)
    eos = tiny_model.eos_token_id
    runs = {
        mode: runner_greedy(
            make_runner(tiny_model, block_size=4, num_blocks=512, attention=mode), prompts, tables, 12, eos
        )
        for mode in ("kernel", "gather")
    }
    assert runs["kernel"] == runs["gather"]
    assert sum(map(len, runs["kernel"])) > len(prompts), "the runs decoded nothing"


# -- hostile tables are refused before native code runs --------------------------------------
@pytest.mark.parametrize(
    "tables,lengths,why",
    [
        ([[0, 1]], [9], "needs 3 blocks"),  # length past the table
        ([[0, -1]], [8], "block ids must lie"),
        ([[3]], [0], "positive"),
        ([[3]], [-4], "positive"),
        ([[0], [1]], [1], "2 block tables for 1 lengths"),
    ],
)
def test_hostile_tables_raise_value_error(tables, lengths, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        PagedTables.build(tables, lengths, 4)


def test_a_block_past_the_pool_and_mismatched_shapes_raise_value_error() -> None:
    q, pool, tables = _random_case(4, 2, 16, 4, [5])
    with pytest.raises(ValueError, match="past the pool"):
        paged_decode(q, pool, PagedTables.build([[0, pool.shape[2]]], [5], 4))
    with pytest.raises(ValueError, match="do not fit"):
        paged_decode(q, pool, PagedTables.build(tables, [5], 8))  # another block size
    with pytest.raises(ValueError, match="do not fit"):
        paged_decode(q[:, :3], pool, PagedTables.build(tables, [5], 4))  # 3 heads over 2 KV heads
    with pytest.raises(ValueError, match="float32"):
        paged_decode(q.double(), pool, PagedTables.build(tables, [5], 4))


def test_tables_made_by_hand_are_checked_too_and_a_pool_without_values_is_refused() -> None:
    q, pool, tables = _random_case(4, 2, 16, 4, [5])
    good = PagedTables.build(tables, [5], 4)
    too_long = dict(tables=good.tables, lengths=torch.tensor([9], dtype=torch.int32), block_size=4, max_length=9)
    with pytest.raises(ValueError, match="needs more than"):
        PagedTables(**too_long, max_block=good.max_block)  # 9 positions need 3 blocks, the table has 2
    with pytest.raises(ValueError, match="max_length"):
        PagedTables(good.tables, good.lengths, 4, 2, good.max_block)  # max_length below a row's length
    with pytest.raises(ValueError, match="int32"):
        PagedTables(good.tables.long(), good.lengths, 4, 5, good.max_block)
    with pytest.raises(ValueError, match="int32"):
        PagedTables(good.tables, good.lengths, 0, 5, good.max_block)  # block size 0
    with pytest.raises(ValueError, match="max_block"):
        PagedTables(good.tables, good.lengths, 4, 5, 0)  # a block id past what the pool check was told
    with pytest.raises(ValueError, match="block ids must lie"):
        PagedTables.build([[0, 2**31]], [5], 4)
    with pytest.raises(ValueError, match=r"pool \(2, kv_heads"):
        paged_decode(q, pool[:1].contiguous(), good)  # keys only: the values would be read past its end


def test_an_unwritable_cache_falls_back_to_the_gather(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """A cache directory that cannot be made is a reason to fall back, not a crash at start-up."""
    from labkit.engine import kernels

    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setattr(kernels, "_loaded", {})
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker / "cache"))
    with pytest.raises(KernelUnavailable, match="could not build"):
        paged_decode_kernel()
    choice = choose_attention("auto", CPU, torch.float32)
    assert choice.mode == "gather" and "could not build" in choice.reason


def test_runner_refuses_a_position_past_its_table(tiny_llama: LoadedModel) -> None:
    runner = make_runner(tiny_llama, block_size=4, num_blocks=16, attention="kernel")
    runner.prefill([5, 6, 7], [2])
    with pytest.raises(ValueError, match="needs 2 blocks"):
        runner.decode([8], [4], [[2]])  # position 4 is in the table's second block, which it lacks


# -- choosing, building, falling back ---------------------------------------------------------
def test_auto_picks_the_kernel_on_cpu_float32_and_says_why_not_elsewhere() -> None:
    assert choose_attention("auto", CPU, torch.float32).mode == "kernel"
    bf16 = choose_attention("auto", CPU, torch.bfloat16)
    assert bf16.mode == "gather" and "float32" in bf16.reason
    cuda = choose_attention("auto", torch.device("cuda"), torch.float32)
    assert cuda.mode == "gather" and "CPU-only" in cuda.reason
    with pytest.raises(ValueError, match="float32-only"):
        choose_attention("kernel", CPU, torch.float16)
    with pytest.raises(ValueError, match="must be one of"):
        choose_attention("fast", CPU, torch.float32)
    with pytest.raises(ValueError, match="attention must be one of"):
        EngineConfig(attention="fast")


def test_the_kernel_is_built_once_into_the_cache_and_reused() -> None:
    first = paged_decode_kernel()
    assert first is paged_decode_kernel()
    assert first.path.parent == cache_dir() and first.path.exists()


def test_a_changed_header_is_a_new_build(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """A header the source includes (cephes_exp.h) is part of the cache key: edit it and the next
    load builds anew instead of reusing a library made from the old text."""
    import shutil

    from labkit.engine import kernels

    src = tmp_path / "src"
    src.mkdir()
    for path in [kernels.SOURCE, *kernels.SOURCE.parent.glob("*.h")]:
        shutil.copy(path, src / path.name)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    options = kernels.BuildOptions.from_env()
    first = kernels._load(src / "paged_decode.cpp", options)
    assert kernels._load(src / "paged_decode.cpp", options).path == first.path
    (src / "cephes_exp.h").write_text((src / "cephes_exp.h").read_text() + "\n// edited\n")
    second = kernels._load(src / "paged_decode.cpp", options)
    assert second.path != first.path and first.path.exists() and second.path.exists()


@pytest.mark.parametrize("compiler", ["/nonexistent/g++", "/bin/false"])
def test_without_a_working_compiler_the_engine_falls_back_to_the_gather(
    tiny_gpt2: LoadedModel, compiler: str, monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    """No compiler, or one that fails: ``auto`` runs the gather and says why, ``kernel`` is refused,
    and the engine's greedy tokens are those of the kernel engine."""
    monkeypatch.setenv("LABKIT_CXX", compiler)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # nothing cached there: it must try to build
    with pytest.raises(KernelUnavailable):
        paged_decode_kernel()
    choice = choose_attention("auto", CPU, torch.float32)
    assert choice.mode == "gather" and ("no C++ compiler" in choice.reason or "failed to compile" in choice.reason)
    with pytest.raises(ValueError, match="unavailable"):
        BatchEngine(tiny_gpt2, EngineConfig(attention="kernel", max_batch=2, num_blocks=64))
    fallback = BatchEngine(tiny_gpt2, EngineConfig(max_batch=2, num_blocks=64))
    assert fallback.runner.attention.mode == "gather"
    fallback_tokens = _engine_tokens(fallback)
    monkeypatch.delenv("LABKIT_CXX")
    monkeypatch.delenv("XDG_CACHE_HOME")
    kernel = BatchEngine(tiny_gpt2, EngineConfig(max_batch=2, num_blocks=64))
    assert kernel.runner.attention.mode == "kernel"
    assert _engine_tokens(kernel) == fallback_tokens


def _engine_tokens(engine: BatchEngine) -> dict[str, list[int]]:
    rids = [engine.submit(p, max_new_tokens=6, ignore_eos=True) for p in PROMPTS[:2]]
    out: dict[str, list[int]] = {rid: [] for rid in rids}
    for _ in range(50):
        if not engine.has_work():
            break
        for event in engine.step():
            if isinstance(event, TokenEvent):
                out[event.rid].append(event.token_id)
    assert all(len(tokens) == 6 for tokens in out.values())
    return {str(i): out[rid] for i, rid in enumerate(rids)}


# -- the bench and the notebook's experiment -------------------------------------------------
def test_bench_measures_both_modes_in_every_cell_and_counts_the_copy(tiny_llama: LoadedModel) -> None:
    from labkit.bench_attention import AttentionBench, measure_attention, printable, summarize

    cfg = AttentionBench(model="tiny-llama", batches=(1, 4), contexts=(16, 100), reps=2, steps=1)
    samples = measure_attention(cfg, tiny_llama)
    assert len(samples) == 2 * 2 * 2 * 2  # reps x contexts x batches x modes
    # interleaved: every repetition visits every cell, and within a cell the modes take turns
    assert list(samples["mode"][:2]) == ["gather", "kernel"] and samples["rep"].is_monotonic_increasing
    gather = samples[samples["mode"] == "gather"]
    assert (samples.loc[samples["mode"] == "kernel", "copied_MiB"] == 0).all() and (gather.copied_MiB > 0).all()
    copied = gather.groupby(["context", "batch"]).copied_MiB.first()
    assert copied[100, 4] > copied[16, 4] and copied[100, 4] > copied[100, 1], "the copy grows with context and batch"
    table = summarize(samples)
    assert list(zip(table.context, table.batch)) == [(16, 1), (16, 4), (100, 1), (100, 4)] and (table.n == 2).all()
    assert (table.step_gather_ms_min <= table.step_gather_ms_median).all()
    assert "(" in printable(table)["step kernel ms"].iloc[0]


def test_the_cli_prints_the_attention_table(capsys: pytest.CaptureFixture[str]) -> None:
    from labkit.cli import main

    main(["bench", "attention", "--model", "tiny-gpt2", "--contexts", "16", "--batches", "1,2", "--rounds", "1"])
    out = capsys.readouterr().out
    assert "step kernel/gather" in out and "attention gather ms" in out
