"""Prompts admitted together share the step's pass, within its token budget, and nothing about a
prompt's numbers depends on who it was packed with: logits, cached K/V and every token after them."""
from __future__ import annotations

import random

import pytest
import torch
from engine_helpers import PROMPTS, drain, make_engine
from runner_helpers import make_runner, shuffled_tables

from labkit.models import LoadedModel


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


def test_a_steps_decodes_and_prompt_chunks_share_one_pass_within_the_token_budget(tiny_gpt2: LoadedModel,
                                                                                   monkeypatch) -> None:
    engine = make_engine(tiny_gpt2, step_tokens=50, surge_tokens=None)
    calls = []
    original = engine.runner.network.qkv
    monkeypatch.setattr(engine.runner.network, "qkv",
                        lambda layer, x, *a: calls.append(x.shape[0]) or original(layer, x, *a))
    for i in range(6):
        engine.submit([7 + i] * 20, max_new_tokens=4, ignore_eos=True)  # six prompts of 20 tokens
    layers = engine.runner.network.shape.num_layers
    engine.step()  # prompts 0 and 1 whole, 10 tokens of prompt 2
    assert calls == [50] * layers
    calls.clear()
    engine.step()  # 2 decodes, the other 10 of prompt 2, prompt 3 whole, 18 tokens of prompt 4
    assert calls == [50] * layers
    assert [r.decoded for r in engine.step_log] == [0, 2] and [r.prefill_tokens for r in engine.step_log] == [50, 48]


def test_prefill_many_refuses_mismatched_or_empty_input(tiny_gpt2: LoadedModel) -> None:
    runner = make_runner(tiny_gpt2, num_blocks=16)
    with pytest.raises(ValueError, match="block tables"):
        runner.prefill_many([[1, 2]], [])
    with pytest.raises(ValueError, match="at least one token"):
        runner.prefill_many([[1], []], [[0], [1]])


def test_unchunked_engine_prefills_every_prompt_it_admits_whole_in_one_pass(tiny_gpt2: LoadedModel,
                                                                             monkeypatch) -> None:
    engine = make_engine(tiny_gpt2, step_tokens=None)
    calls = []
    original = engine.runner.forward
    monkeypatch.setattr(engine.runner, "forward", lambda chunks, sample: calls.append(
        [(len(c.token_ids), c.start, s) for c, s in zip(chunks, sample)]) or original(chunks, sample))
    prompts = PROMPTS[:5]
    for p in prompts:
        engine.submit(p, max_new_tokens=3)
    drain(engine)
    assert calls[0] == [(len(engine.encode(p)), 0, True) for p in prompts]
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


def test_a_prompts_first_token_comes_from_the_step_that_runs_its_last_chunk(tiny_gpt2: LoadedModel) -> None:
    engine = make_engine(tiny_gpt2, step_tokens=12, surge_tokens=None)
    rids = [engine.submit([5 + i] * 5, max_new_tokens=2) for i in range(6)]  # 5 tokens each
    first = [e.rid for e in engine.step()]  # prompts 0 and 1 whole, 2 tokens of prompt 2
    second = [e.rid for e in engine.step()]  # decodes of 0 and 1, then the rest of 2, all of 3, 2 tokens of 4
    assert first == [rids[0], rids[1]]
    assert second == [rids[0], rids[0], rids[1], rids[1], rids[2], rids[3]]  # a token, then each one's finish


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
