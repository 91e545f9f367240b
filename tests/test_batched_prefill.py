"""Prompts admitted together are prefilled in one packed pass, and nothing about a prompt's
numbers depends on who it was packed with: logits, cached K/V and every token after them."""
from __future__ import annotations

import random

import pytest
import torch

from engine_helpers import PROMPTS, drain, make_engine
from labkit.models import LoadedModel
from runner_helpers import make_runner, shuffled_tables


def _random_prompts(count: int, seed: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(1, 40))] for _ in range(count)]


def test_packed_prefill_is_bitwise_the_solo_prefill_in_logits_and_cache(tiny_model: LoadedModel) -> None:
    prompts = _random_prompts(9, seed=1, vocab=tiny_model.vocab_size)
    tables = shuffled_tables(len(prompts), 11, 128, seed=1)
    packed, alone = make_runner(tiny_model, num_blocks=128), make_runner(tiny_model, num_blocks=128)
    together = packed.prefill_many(prompts, tables)
    assert together.shape == (len(prompts), tiny_model.vocab_size) and together.dtype == torch.float32
    for i, (ids, table) in enumerate(zip(prompts, tables)):
        assert torch.equal(together[i], alone.prefill(ids, table)), f"prompt {i} differs from its solo prefill"
    assert torch.equal(packed.pool.k, alone.pool.k) and torch.equal(packed.pool.v, alone.pool.v)


def test_a_prompt_gets_the_same_logits_whatever_it_is_packed_with(tiny_llama: LoadedModel) -> None:
    runner = make_runner(tiny_llama, num_blocks=256)
    prompts = _random_prompts(12, seed=2, vocab=tiny_llama.vocab_size)
    tables = shuffled_tables(len(prompts), 11, 256, seed=2)
    target = runner.prefill(prompts[0], tables[0])
    for others in ([1], [5, 3], list(range(1, 12))):
        for where in (0, len(others)):
            group = others[:where] + [0] + others[where:]
            out = runner.prefill_many([prompts[i] for i in group], [tables[i] for i in group])
            assert torch.equal(out[where], target), f"packed with {others} at {where}"


def test_packed_prefill_is_one_pass_per_layer_within_the_token_budget(tiny_gpt2: LoadedModel, monkeypatch) -> None:
    runner = make_runner(tiny_gpt2, num_blocks=128, max_prefill_tokens=50)
    prompts = _random_prompts(6, seed=3, vocab=tiny_gpt2.vocab_size)
    prompts = [p[:20] + [7] * max(0, 20 - len(p)) for p in prompts]  # six prompts of 20 tokens
    tables = shuffled_tables(6, 6, 128, seed=3)
    calls = []
    original = runner.network.qkv
    monkeypatch.setattr(runner.network, "qkv", lambda layer, x, *a: calls.append(x.shape[0]) or original(layer, x, *a))
    out = runner.prefill_many(prompts, tables)
    layers = runner.network.shape.num_layers
    assert calls == [40] * layers * 3, "two prompts of 20 per pass under a budget of 50 tokens"
    assert torch.equal(out, torch.stack([make_runner(tiny_gpt2, num_blocks=128).prefill(p, t)
                                         for p, t in zip(prompts, tables)]))


def test_prefill_many_refuses_mismatched_or_empty_input(tiny_gpt2: LoadedModel) -> None:
    runner = make_runner(tiny_gpt2, num_blocks=16)
    with pytest.raises(ValueError, match="block tables"):
        runner.prefill_many([[1, 2]], [])
    with pytest.raises(ValueError, match="at least one token"):
        runner.prefill_many([[1], []], [[0], [1]])


def test_engine_prefills_the_prompts_it_admits_together_in_one_call(tiny_gpt2: LoadedModel, monkeypatch) -> None:
    engine = make_engine(tiny_gpt2)
    calls = []
    original = engine.runner.prefill_packs
    monkeypatch.setattr(engine.runner, "prefill_packs", lambda prompts, tables: calls.append(len(prompts))
                        or original(prompts, tables))
    for p in PROMPTS[:5]:
        engine.submit(p, max_new_tokens=3)
    drain(engine)
    assert calls == [5]
    assert engine.stats()["prefills"] == 5


@pytest.mark.parametrize("count", [2, 8, 13])
def test_prompts_admitted_together_generate_what_each_generates_alone(tiny_model: LoadedModel, count: int) -> None:
    """Greedy: the first token comes from the packed prefill, the rest from batched decodes."""
    prompts = (PROMPTS * 2)[:count]
    together = make_engine(tiny_model)
    rids = [together.submit(p, max_new_tokens=10, ignore_eos=True) for p in prompts]
    outcomes = drain(together)
    for prompt, rid in zip(prompts, rids):
        alone = make_engine(tiny_model)
        solo_rid = alone.submit(prompt, max_new_tokens=10, ignore_eos=True)
        assert outcomes[rid].tokens == drain(alone)[solo_rid].tokens, prompt


def test_each_pass_hands_out_its_first_tokens_before_the_next_pass_runs(tiny_gpt2: LoadedModel, monkeypatch) -> None:
    engine = make_engine(tiny_gpt2)
    engine.runner.max_prefill_tokens = 12
    log = []
    original = engine.runner._prefill_packed
    monkeypatch.setattr(engine.runner, "_prefill_packed",
                        lambda prompts, tables: log.append(("pass", len(prompts))) or original(prompts, tables))
    rids = [engine.submit([5 + i] * 5, max_new_tokens=2) for i in range(6)]  # 5 tokens each: two per pass
    engine.step(lambda event: log.append(("token", event.rid)))
    assert log == [("pass", 2), ("token", rids[0]), ("token", rids[1]),
                   ("pass", 2), ("token", rids[2]), ("token", rids[3]),
                   ("pass", 2), ("token", rids[4]), ("token", rids[5])]


@pytest.mark.slow
@pytest.mark.smollm2
def test_smollm2_prompts_admitted_together_generate_what_each_generates_alone() -> None:
    from labkit.models import load_model

    loaded = load_model("smollm2-135m")
    prompts = PROMPTS[:6]
    together = make_engine(loaded, block_size=16)
    rids = [together.submit(p, max_new_tokens=6, ignore_eos=True) for p in prompts]
    outcomes = drain(together)
    for prompt, rid in zip(prompts, rids):
        alone = make_engine(loaded, block_size=16)
        solo_rid = alone.submit(prompt, max_new_tokens=6, ignore_eos=True)
        assert outcomes[rid].tokens == drain(alone)[solo_rid].tokens, prompt
    assert outcomes[rids[0]].text.startswith(" Paris")
