"""The paged runner computes what transformers computes, and a row never feels its neighbours.

transformers' own forward is the reference for every number here; the runner only borrows its
weights. Block tables are shuffled so that paging mistakes cannot hide.
"""
from __future__ import annotations

import random

import pytest
import torch
from runner_helpers import (
    PROMPTS,
    cut_at_eos,
    encode,
    hf_greedy,
    hf_logits,
    make_runner,
    runner_greedy,
    shuffled_tables,
)

from labkit.engine.attention import attend_width
from labkit.errors import UnknownModel
from labkit.models import LoadedModel

ATOL = 1e-4


# -- prefill and step-by-step decode against the HF forward ----------------------------------
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_prefill_last_logits_match_hf_forward(tiny_model: LoadedModel, block_size: int) -> None:
    runner = make_runner(tiny_model, block_size=block_size, num_blocks=1024)
    prompts = [encode(tiny_model, p) for p in PROMPTS[:5]]
    tables = shuffled_tables(len(prompts), 64 // block_size + 1, 1024, seed=block_size)
    for ids, table in zip(prompts, tables):
        got = runner.prefill(ids, table)
        assert got.dtype == torch.float32 and got.shape == (tiny_model.vocab_size,)
        torch.testing.assert_close(got, hf_logits(tiny_model, ids)[-1], atol=ATOL, rtol=0)


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_decode_step_by_step_through_the_cache_matches_hf_forward(tiny_model: LoadedModel, block_size: int) -> None:
    runner = make_runner(tiny_model, block_size=block_size, num_blocks=256)
    ids = encode(tiny_model, PROMPTS[1])
    forced = encode(tiny_model, " and the lighthouse keeper counted every wave twice")
    table = shuffled_tables(1, 64 // block_size + 1, 256, seed=7)[0]
    runner.prefill(ids, table)
    sequence = list(ids)
    for token in forced:
        got = runner.decode([token], [len(sequence)], [table])[0]
        sequence.append(token)
        torch.testing.assert_close(got, hf_logits(tiny_model, sequence)[-1], atol=ATOL, rtol=0)


def test_one_decode_step_serves_sequences_of_different_lengths(tiny_model: LoadedModel) -> None:
    runner = make_runner(tiny_model, block_size=4, num_blocks=512)
    prompts = [encode(tiny_model, p) for p in PROMPTS]
    tables = shuffled_tables(len(prompts), 40, 512, seed=3)
    for ids, table in zip(prompts, tables):
        runner.prefill(ids, table)
    nexts = [11 + i for i in range(len(prompts))]
    logits = runner.decode(nexts, [len(p) for p in prompts], tables)
    assert logits.shape == (len(prompts), tiny_model.vocab_size)
    for row, (ids, token) in enumerate(zip(prompts, nexts)):
        torch.testing.assert_close(logits[row], hf_logits(tiny_model, ids + [token])[-1], atol=ATOL, rtol=0)


# -- greedy continuations against HF generate ------------------------------------------------
@pytest.mark.parametrize("batch_invariant", [True, False])
def test_greedy_continuations_equal_hf_generate(tiny_model: LoadedModel, batch_invariant: bool) -> None:
    runner = make_runner(tiny_model, block_size=4, num_blocks=512, batch_invariant=batch_invariant)
    prompts = [encode(tiny_model, p) for p in PROMPTS]
    tables = shuffled_tables(len(prompts), 12, 512, seed=5)
    eos = tiny_model.eos_token_id
    got = runner_greedy(runner, prompts, tables, 12, eos)
    want = [hf_greedy(tiny_model, ids, 12) for ids in prompts]
    assert [cut_at_eos(g, eos) for g in got] == want
    assert len({tuple(w) for w in want}) >= len(prompts) - 2, "tiny model should continue prompts differently"


# -- batch invariance ------------------------------------------------------------------------
def _prefilled(loaded: LoadedModel, num_seqs: int, dtype: str = "float32", seed: int = 0):
    """A runner holding ``num_seqs`` random prompts of 1..90 tokens, and each one's next token."""
    rng = random.Random(seed)
    runner = make_runner(loaded, block_size=4, num_blocks=num_seqs * 26, dtype=dtype)
    tables = shuffled_tables(num_seqs, 26, num_seqs * 26, seed=seed)
    lengths = [rng.randint(1, 90) for _ in range(num_seqs)]
    nexts = []
    for n, table in zip(lengths, tables):
        ids = [rng.randrange(50, 40000) for _ in range(n)]
        nexts.append(int(runner.prefill(ids, table).argmax()))
    return runner, tables, lengths, nexts


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_logits_are_bitwise_independent_of_batch_and_neighbours(tiny_model: LoadedModel, dtype: str) -> None:
    runner, tables, lengths, nexts = _prefilled(tiny_model, 40, dtype)
    solo = {i: runner.decode([nexts[i]], [lengths[i]], [tables[i]])[0] for i in range(4)}
    rng = random.Random(1)
    cases = [(b, p) for b in (2, 7, 8, 9, 16, 17, 24, 33) for p in {0, b // 2, b - 1, min(b - 1, 8)}]
    for batch_size, position in cases:
        target = rng.randrange(4)
        rows = rng.sample(range(4, 40), batch_size - 1)
        rows.insert(position, target)
        out = runner.decode([nexts[i] for i in rows], [lengths[i] for i in rows], [tables[i] for i in rows])
        assert torch.equal(out[position], solo[target]), (
            f"row at position {position} (tile {position // 8}) of a batch of {batch_size} differs from its solo run")


def test_invariance_holds_across_the_attention_width_boundaries(tiny_llama: LoadedModel) -> None:
    """Neighbours on both sides of a 64-position width step, target solo vs mixed."""
    runner = make_runner(tiny_llama, block_size=4, num_blocks=600)
    tables = shuffled_tables(12, 40, 600, seed=9)
    lengths = [63, 64, 65, 1, 128, 129, 100, 2, 64, 70, 127, 20]
    for n, table in zip(lengths, tables):
        runner.prefill([(7 * j) % 30000 + 40 for j in range(n)], table)
    solo = [runner.decode([99], [n], [t])[0] for n, t in zip(lengths, tables)]
    mixed = runner.decode([99] * 12, lengths, tables)
    assert all(torch.equal(mixed[i], solo[i]) for i in range(12))


def test_attention_width_depends_only_on_own_length() -> None:
    assert [attend_width(n, 4, 64) for n in (1, 64, 65, 128, 129)] == [64, 64, 128, 128, 192]
    assert attend_width(10, 48, 64) == 96  # whole blocks, at least the span
    assert attend_width(10, 1, 64) == 64


# -- dtype, sizes, refusals ------------------------------------------------------------------
def test_bfloat16_runs_and_stays_close_to_float32(tiny_model: LoadedModel) -> None:
    f32 = make_runner(tiny_model, block_size=4, num_blocks=64)
    bf16 = make_runner(tiny_model, block_size=4, num_blocks=64, dtype="bfloat16")
    assert bf16.pool.k.dtype == torch.bfloat16
    ids = encode(tiny_model, PROMPTS[6])
    table = shuffled_tables(1, 16, 64, seed=2)[0]
    a, b = f32.prefill(ids, table), bf16.prefill(ids, table)
    assert b.dtype == torch.float32
    assert (a - b).abs().max() < 0.25 * a.std()
    agree = 0
    for step, token in enumerate(encode(tiny_model, " over and over again until the end")):
        a = f32.decode([token], [len(ids) + step], [table])[0]
        b = bf16.decode([token], [len(ids) + step], [table])[0]
        assert b.dtype == torch.float32 and (a - b).abs().max() < 0.25 * a.std()
        agree += int(a.argmax() == b.argmax())
    assert agree >= step  # at most one near-tie may flip


def test_kv_bytes_per_block_counts_keys_and_values_of_every_layer(tiny_llama: LoadedModel) -> None:
    runner = make_runner(tiny_llama, block_size=16, num_blocks=8)
    cfg = tiny_llama.model.config
    assert runner.pool.bytes_per_block == 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * 16 * 16 * 4
    half = make_runner(tiny_llama, block_size=16, num_blocks=8, dtype="bfloat16")
    assert half.pool.bytes_per_block == runner.pool.bytes_per_block // 2


def test_rejects_an_unknown_dtype(tiny_gpt2: LoadedModel) -> None:
    with pytest.raises(ValueError, match="dtype"):
        make_runner(tiny_gpt2, dtype="int8")


def _tiny_llama_variant(**overrides) -> LoadedModel:
    from transformers import LlamaConfig, LlamaForCausalLM

    settings = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, max_position_embeddings=256, initializer_range=0.2)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**{**settings, **overrides})).eval()
        for module in model.modules():  # random biases, so that a dropped bias shows
            if getattr(module, "bias", None) is not None:
                torch.nn.init.normal_(module.bias, 0, 0.2)
    return LoadedModel("variant", model, tokenizer=None, arch="llama")


@pytest.mark.parametrize("overrides", [
    {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}},
    {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 64, "rope_theta": 500000.0}},
    {"attention_bias": True, "mlp_bias": True},
    {"tie_word_embeddings": True, "num_key_value_heads": 1},
], ids=["rope-linear", "rope-llama3", "biases", "tied-mqa"])
def test_llama_variants_match_hf_forward(overrides: dict) -> None:
    loaded = _tiny_llama_variant(**overrides)
    runner = make_runner(loaded, block_size=4, num_blocks=64)
    ids = [(31 * j) % 500 + 3 for j in range(70)]
    table = shuffled_tables(1, 20, 64, seed=4)[0]
    torch.testing.assert_close(runner.prefill(ids[:60], table), hf_logits(loaded, ids[:60])[-1], atol=ATOL, rtol=0)
    for p in range(60, 70):
        got = runner.decode([ids[p]], [p], [table])[0]
        torch.testing.assert_close(got, hf_logits(loaded, ids[:p + 1])[-1], atol=ATOL, rtol=0)


def test_refuses_rope_that_changes_with_length() -> None:
    loaded = _tiny_llama_variant(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    with pytest.raises(UnknownModel, match="rope_type='dynamic'"):
        make_runner(loaded)


# -- SmolLM2 (real weights) ------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.smollm2
def test_smollm2_greedy_says_paris_and_matches_hf() -> None:
    from labkit.models import load_model

    loaded = load_model("smollm2-135m")
    runner = make_runner(loaded, block_size=16, num_blocks=64)
    prompts = [encode(loaded, p) for p in PROMPTS[:4]]
    tables = shuffled_tables(len(prompts), 4, 64, seed=11)
    got = runner_greedy(runner, prompts, tables, 8, loaded.eos_token_id)
    assert loaded.tokenizer.decode(got[0]).startswith(" Paris.")
    assert got == [hf_greedy(loaded, ids, 8) for ids in prompts]


@pytest.mark.slow
@pytest.mark.smollm2
def test_smollm2_decode_is_bitwise_independent_of_neighbours() -> None:
    from labkit.models import load_model

    loaded = load_model("smollm2-135m")
    runner, tables, lengths, nexts = _prefilled(loaded, 34, seed=2)
    solo = runner.decode([nexts[0]], [lengths[0]], [tables[0]])[0]
    for batch_size, position in [(2, 1), (9, 8), (17, 3), (33, 32)]:
        rows = list(range(1, batch_size))
        rows.insert(position, 0)
        out = runner.decode([nexts[i] for i in rows], [lengths[i] for i in rows], [tables[i] for i in rows])
        assert torch.equal(out[position], solo), f"batch of {batch_size}, position {position}"
