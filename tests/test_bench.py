"""The benchmarks run end to end on a tiny model and report what they promise (no timing asserted)."""
from labkit.bench import GenerateBench, StepBench, bench_generate, bench_step


def test_step_bench_reports_bare_invariant_and_plain_times_per_batch(tiny_gpt2):
    table = bench_step(StepBench(model="tiny-gpt2", batches=(1, 3), context=16, steps=3, warmup=1), tiny_gpt2)
    assert list(table.batch) == [1, 3]
    for column in ("bare_forward_ms", "engine_step_ms", "engine_plain_ms", "engine/bare", "invariant/plain"):
        assert (table[column] > 0).all(), column


def test_generate_bench_counts_the_same_tokens_all_at_once_and_one_by_one(tiny_gpt2):
    cfg = GenerateBench(model="tiny-gpt2", requests=4, new_tokens=6, with_generate_batch=False)
    table = bench_generate(cfg, tiny_gpt2).set_index("run")
    assert table.loc["engine, all at once", "tokens"] == table.loc["engine, one after another", "tokens"]
    assert table.loc["engine, all at once", "engine_all_at_once/this"] == 1.0
