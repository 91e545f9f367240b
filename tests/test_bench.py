"""The benchmarks run end to end on a tiny model and report what they promise (no timing asserted)."""

import torch
from engine_helpers import solo, with_eos

from labkit.bench import GenerateBench, StepBench, bench_generate, bench_step
from labkit.prompts import PROMPTS


def test_step_bench_reports_bare_invariant_plain_and_floor_times_per_batch(tiny_gpt2):
    table = bench_step(StepBench(model="tiny-gpt2", batches=(1, 3), context=16, steps=3, warmup=1), tiny_gpt2)
    assert list(table.batch) == [1, 3]
    for column in (
        "bare_forward_ms",
        "engine_step_ms",
        "engine_plain_ms",
        "matmul_floor_ms",
        "invariant_matmuls_ms",
        "engine/bare",
        "plain/bare",
        "engine/floor",
        "plain/floor",
        "invariant/plain",
    ):
        assert (table[column] > 0).all(), column
    row = table.iloc[-1]
    assert row["engine/floor"] == row.engine_step_ms / row.matmul_floor_ms
    assert row["plain/bare"] == row.engine_plain_ms / row.bare_forward_ms


def test_step_bench_takes_the_median_of_interleaved_rounds(tiny_gpt2, monkeypatch):
    import labkit.bench as bench

    calls = []
    times = iter([10.0, 30.0, 20.0, 1.0, 2.0, 3.0])

    def fake_row(loaded, batch, cfg):
        calls.append(batch)
        t = next(times)
        return {
            "bare_forward_ms": t,
            "engine_step_ms": t,
            "engine_plain_ms": t,
            "matmul_floor_ms": t,
            "invariant_matmuls_ms": t,
        }

    monkeypatch.setattr(bench, "_step_row", fake_row)
    table = bench_step(StepBench(model="tiny-gpt2", batches=(1, 2), rounds=3), tiny_gpt2)
    assert calls == [1, 2, 1, 2, 1, 2]  # interleaved, not one batch size after the other
    assert list(table.engine_step_ms) == [10.0, 3.0]  # medians of (10, 20, 2) and (30, 1, 3)


def test_generate_bench_runs_every_request_to_its_length_three_ways(tiny_gpt2):
    cfg = GenerateBench(model="tiny-gpt2", requests=4, new_tokens=6, with_self_sized=False)
    table = bench_generate(cfg, tiny_gpt2).set_index("run")
    assert list(table.index) == [
        "engine, all at once",
        "engine, one after another",
        "transformers generate_batch, cache sized to the work",
    ]
    assert (table.tokens == 4 * 6).all()
    assert table.loc["engine, one after another", "same_tokens_as_engine"] == "4/4"
    assert table.loc["engine, all at once", "engine_all_at_once/this"] == 1.0


def test_generate_bench_can_let_requests_end_on_eos(tiny_gpt2):
    free_run = solo(tiny_gpt2, PROMPTS[0], max_new_tokens=6).tokens  # the bench's first request, alone
    cfg = GenerateBench(model="tiny-gpt2", requests=1, new_tokens=6, with_generate_batch=False, ignore_eos=False)
    table = bench_generate(cfg, with_eos(tiny_gpt2, free_run[1]))
    assert (table.tokens == free_run.index(free_run[1]) + 1).all()


def test_benches_in_bfloat16_leave_the_loaded_float32_weights_untouched(tiny_gpt2):
    before = {name: p.clone() for name, p in tiny_gpt2.model.named_parameters()}
    bench_step(StepBench(model="tiny-gpt2", batches=(2,), context=16, steps=2, warmup=1, dtype="bfloat16"), tiny_gpt2)
    cfg = GenerateBench(model="tiny-gpt2", requests=2, new_tokens=3, dtype="bfloat16", with_self_sized=False)
    assert (bench_generate(cfg, tiny_gpt2).tokens == 2 * 3).all()
    after = dict(tiny_gpt2.model.named_parameters())
    assert all(p.dtype == torch.float32 and torch.equal(p, after[name]) for name, p in before.items())
