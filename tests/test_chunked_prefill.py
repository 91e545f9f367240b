"""Chunked prefill: a prompt may be cut into chunks of any size and run beside any streams, and
its numbers stay its own, bit for bit; the step budget, decode first, governs who runs.

Every engine here checks its books after every step (``CheckedEngine``).
"""
from __future__ import annotations

import random

import pytest
import torch
from engine_helpers import assert_all_released, collect, drain, make_engine
from runner_helpers import make_runner, shuffled_tables

from labkit.engine.config import DEFAULT_STEP_TOKENS, EngineConfig
from labkit.engine.events import TokenEvent
from labkit.engine.runner import Chunk
from labkit.models import LoadedModel

CHUNK_SIZES = [1, 7, 64, DEFAULT_STEP_TOKENS]
BUDGETS = [1, 7, 64, DEFAULT_STEP_TOKENS, None]


def _prompt(length: int, seed: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(length)]


def _prefill_in_chunks(runner, ids: list[int], table: list[int], size: int) -> torch.Tensor:
    """The prompt fed ``size`` tokens per pass; the logits of its last position."""
    for start in range(0, len(ids), size):
        part = ids[start:start + size]
        logits = runner.forward([Chunk(part, start, table)], [start + size >= len(ids)])
    return logits[0]


def _blocks(runner, table: list[int]) -> torch.Tensor:
    return runner.pool.kv[:, :, :, table]


# -- the runner: one prompt, any chunking ------------------------------------------------------
@pytest.mark.parametrize("size", CHUNK_SIZES)
def test_a_prompt_gets_the_same_logits_and_cache_whole_or_in_chunks(tiny_model: LoadedModel, size: int) -> None:
    ids = _prompt(150, seed=size, vocab=tiny_model.vocab_size)
    table = shuffled_tables(1, 40, 128, seed=size)[0]
    whole, chunked = make_runner(tiny_model, num_blocks=128), make_runner(tiny_model, num_blocks=128)
    expected = whole.prefill(ids, table)
    assert torch.equal(_prefill_in_chunks(chunked, ids, table, size), expected)
    assert torch.equal(_blocks(chunked, table), _blocks(whole, table))


def test_prefilling_a_prompt_whole_equals_decoding_it_token_by_token(tiny_model: LoadedModel) -> None:
    ids = _prompt(40, seed=3, vocab=tiny_model.vocab_size)
    table = shuffled_tables(1, 12, 64, seed=3)[0]
    whole, stepped = make_runner(tiny_model, num_blocks=64), make_runner(tiny_model, num_blocks=64)
    expected = whole.prefill(ids, table)
    for position, token in enumerate(ids):
        last = stepped.decode([token], [position], [table])[0]
    assert torch.equal(last, expected)


def test_the_plain_mode_prefills_in_chunks_to_the_same_numbers_within_rounding(tiny_model: LoadedModel) -> None:
    """batch_invariant=False promises no bits, only the same model."""
    ids = _prompt(90, seed=4, vocab=tiny_model.vocab_size)
    table = shuffled_tables(1, 30, 64, seed=4)[0]
    whole = make_runner(tiny_model, num_blocks=64, batch_invariant=False)
    chunked = make_runner(tiny_model, num_blocks=64, batch_invariant=False)
    torch.testing.assert_close(_prefill_in_chunks(chunked, ids, table, 7), whole.prefill(ids, table),
                               atol=1e-4, rtol=0)


def test_a_forward_pass_samples_only_the_chunks_it_is_asked_for(tiny_gpt2: LoadedModel) -> None:
    runner = make_runner(tiny_gpt2, num_blocks=64)
    tables = shuffled_tables(3, 8, 64, seed=5)
    chunks = [Chunk([5, 6, 7], 0, tables[0]), Chunk([8, 9], 0, tables[1]), Chunk([10], 0, tables[2])]
    out = runner.forward(chunks, [False, True, False])
    assert out.shape == (1, tiny_gpt2.vocab_size)
    assert torch.equal(out[0], make_runner(tiny_gpt2, num_blocks=64).prefill([8, 9], tables[1]))
    assert runner.forward(chunks, [False, False, False]).shape == (0, tiny_gpt2.vocab_size)
    with pytest.raises(ValueError, match="sample flags"):
        runner.forward(chunks, [True])


# -- the engine: the same prompt beside 31 running streams ---------------------------------------
def _record_logits(engine, rid_of_interest: list[str]) -> list[torch.Tensor]:
    """Every logits row the engine samples for the request named in ``rid_of_interest``."""
    seen: list[torch.Tensor] = []
    original = engine.sampler.sample

    def sample(logits, seqs):
        seen.extend(logits[row].clone() for row, seq in enumerate(seqs) if seq.rid in rid_of_interest)
        return original(logits, seqs)

    engine.sampler.sample = sample
    return seen


def _solo(model: LoadedModel, ids: list[int], batch_invariant: bool = True) -> tuple[list[int], list[torch.Tensor]]:
    engine = make_engine(model, step_tokens=None, batch_invariant=batch_invariant)
    rid = engine.submit(ids, max_new_tokens=8, ignore_eos=True, request_id="target")
    seen = _record_logits(engine, ["target"])
    return drain(engine)[rid].tokens, seen


@pytest.mark.parametrize("budget", BUDGETS)
def test_a_prompt_beside_31_running_streams_gets_its_solo_logits_and_tokens(tiny_model: LoadedModel,
                                                                            budget: int | None) -> None:
    ids = _prompt(100, seed=6, vocab=tiny_model.vocab_size)
    solo_tokens, solo_logits = _solo(tiny_model, ids)
    engine = make_engine(tiny_model, step_tokens=budget)
    others = [engine.submit(_prompt(2 + i % 3, seed=100 + i, vocab=tiny_model.vocab_size), max_new_tokens=250,
                            ignore_eos=True) for i in range(31)]
    outcomes: dict = {}
    for _ in range(200):  # until all 31 decode (a surge at an idle engine starts them at once)
        if sum(1 for s in engine.scheduler.running if s.decoding) == 31:
            break
        collect(engine.step(), outcomes)
    rid = engine.submit(ids, max_new_tokens=8, ignore_eos=True, request_id="target")
    seen = _record_logits(engine, ["target"])
    while outcomes.get(rid) is None or outcomes[rid].reason is None:
        assert sum(1 for s in engine.scheduler.running if s.decoding) >= 30, "the 31 streams ran beside it"
        collect(engine.step(), outcomes)
    for other in others:
        engine.cancel(other)
    drain(engine, outcomes)
    assert outcomes[rid].tokens == solo_tokens
    assert len(seen) == len(solo_logits) == 8
    assert all(torch.equal(a, b) for a, b in zip(seen, solo_logits)), "a logits row differs from the solo run's"
    assert_all_released(engine)


# -- the budget: decode first, prompts in arrival order ------------------------------------------
def test_a_prompt_longer_than_the_budget_is_prefilled_over_several_steps(tiny_gpt2: LoadedModel) -> None:
    engine = make_engine(tiny_gpt2, step_tokens=8, surge_tokens=None)
    rid = engine.submit(list(range(10, 60)), max_new_tokens=3, ignore_eos=True)  # 50 tokens: 7 chunks
    outcomes: dict = {}
    for _ in range(7):
        assert rid not in outcomes, "no token before the last chunk"
        collect(engine.step(), outcomes)
    assert len(outcomes[rid].tokens) == 1
    assert [r.prefill_tokens for r in engine.step_log] == [8] * 6 + [2]
    assert drain(engine, outcomes)[rid].reason == "length"


def test_decode_rows_over_the_budget_still_leave_one_prompt_token_a_step(tiny_gpt2: LoadedModel) -> None:
    engine = make_engine(tiny_gpt2, step_tokens=4)
    for i in range(8):
        engine.submit([20 + i], max_new_tokens=40, ignore_eos=True)
    drain_steps = 0
    while sum(1 for s in engine.scheduler.running if s.decoding) < 8:
        engine.step()
        drain_steps += 1
    engine.step()  # settled: a prompt right after the surge would count as part of its burst
    rid = engine.submit(list(range(30, 40)), max_new_tokens=2)
    steps = [engine.step() for _ in range(10)]
    assert [(r.decoded, r.prefill_tokens) for r in engine.step_log][-10:] == [(8, 1)] * 10
    assert [e.rid for e in steps[-1]].count(rid) == 1, "its first token comes with its tenth prompt token"
    assert not any(e.rid == rid for events in steps[:-1] for e in events)


def test_a_surge_of_prompts_at_an_idle_engine_starts_under_the_surge_budget(tiny_llama: LoadedModel) -> None:
    prompts = [_prompt(8, seed=30 + i, vocab=tiny_llama.vocab_size) for i in range(14)]
    engine = make_engine(tiny_llama, step_tokens=8, surge_tokens=100)
    rids = [engine.submit(p, max_new_tokens=4, ignore_eos=True) for p in prompts]
    outcomes: dict = {}
    first = engine.step()
    assert {e.rid for e in first} == set(rids[:12]), "twelve prompts of 8 tokens (and 4 of the next) fill 100"
    collect(first, outcomes)
    collect(engine.step(), outcomes)  # the surge's twelve streams decode, the burst's last two prompts start
    collect(engine.step(), outcomes)  # fourteen streams, nothing waiting: no surge
    assert [(r.decoded, r.prefill_tokens, r.surge) for r in engine.step_log] == [(0, 100, True), (12, 12, True),
                                                                                 (14, 0, False)]  # fmt: skip
    drain(engine, outcomes)
    for prompt, rid in zip(prompts, rids):
        alone = make_engine(tiny_llama, step_tokens=None)
        solo = alone.submit(prompt, max_new_tokens=4, ignore_eos=True)
        assert outcomes[rid].tokens == drain(alone)[solo].tokens
    assert_all_released(engine)


def test_in_a_surge_no_prompt_takes_more_than_the_small_budget(tiny_gpt2: LoadedModel) -> None:
    engine = make_engine(tiny_gpt2, step_tokens=8, surge_tokens=1000)
    for i in range(2):
        engine.submit([20 + i], max_new_tokens=40, ignore_eos=True)
    engine.step()  # two one-token prompts at an idle engine: both start
    engine.step()  # two settled streams
    long = [engine.submit(list(range(30, 230)), max_new_tokens=1) for _ in range(3)]  # 3 long prompts, 2 streams
    engine.step()
    assert [(r.decoded, r.prefill_tokens, r.surge) for r in engine.step_log][-1] == (2, 24, True), (
        "a surge moves each prompt by one small budget: three prompts, 3 x 8 tokens, never 998")
    assert [engine.scheduler.live[rid].num_prefilled for rid in long] == [8, 8, 8]


def test_a_long_prompt_among_running_streams_is_chunked_by_the_small_budget(tiny_gpt2: LoadedModel) -> None:
    engine = make_engine(tiny_gpt2, step_tokens=8, surge_tokens=1000)
    for i in range(4):
        engine.submit([20 + i], max_new_tokens=40, ignore_eos=True)
    engine.step()  # four one-token prompts: a surge at an idle engine, all start
    engine.step()  # their second tokens: four settled streams
    rid = engine.submit(list(range(30, 80)), max_new_tokens=2)  # one prompt starting, four streams it would stall
    for _ in range(3):
        engine.step()
    assert [(r.decoded, r.prefill_tokens, r.surge) for r in engine.step_log] == [(0, 4, True), (4, 0, False)] + [
        (4, 4, False)] * 3  # fmt: skip
    assert engine.scheduler.live[rid].num_prefilled == 12


def test_a_burst_split_by_a_step_boundary_starts_as_one_surge(tiny_gpt2: LoadedModel) -> None:
    """Twenty of 32 clients reach the first step, twelve arrive while it runs: the twelve are fewer
    than the twenty streams decoding, but those are their own burst, one token old, so the surge
    goes on and the twelve start in the next step instead of one small budget at a time."""
    engine = make_engine(tiny_gpt2, step_tokens=64, surge_tokens=2048, max_batch=33)
    for i in range(20):
        engine.submit(list(range(30 + i, 70 + i)), max_new_tokens=8, ignore_eos=True)
    engine.step()
    late = [engine.submit(list(range(130 + i, 170 + i)), max_new_tokens=8, ignore_eos=True) for i in range(12)]
    engine.step()
    assert [engine.scheduler.live[rid].num_output for rid in late] == [1] * 12, "all twelve have their first token"
    engine.submit(list(range(230, 270)), max_new_tokens=8, ignore_eos=True)
    engine.step()  # that surge needed the credit, so none now: one prompt against 32 streams, the surge is over
    assert [(r.decoded, r.prefill_tokens, r.surge) for r in engine.step_log] == [(0, 800, True), (20, 480, True),
                                                                                 (32, 32, False)]  # fmt: skip


@pytest.mark.parametrize(("arriving", "surge"), [(8, False), (9, True)])
def test_after_a_surge_that_needed_the_credit_the_prompts_alone_must_outnumber_every_stream(
    tiny_gpt2: LoadedModel, arriving: int, surge: bool
) -> None:
    engine = make_engine(tiny_gpt2, step_tokens=8, surge_tokens=1000)
    for i in range(6):
        engine.submit([20 + i], max_new_tokens=40, ignore_eos=True)
    engine.step()  # a surge at an idle engine: six streams
    for i in range(2):
        engine.submit([30 + i], max_new_tokens=40, ignore_eos=True)
    engine.step()  # two more while the six are one token old: still the surge, on the credit
    for i in range(arriving):
        engine.submit([40 + i], max_new_tokens=40, ignore_eos=True)
    engine.step()  # no second credit: the prompts need n > 8 streams
    expected = (8, arriving, True) if surge else (8, 1, False)
    assert [(r.decoded, r.prefill_tokens, r.surge) for r in engine.step_log] == [(0, 6, True), (6, 2, True), expected]


def test_a_client_sending_short_prompts_every_step_cannot_chain_surges(tiny_gpt2: LoadedModel) -> None:
    """The credit is once a burst. Five two-token requests a step beside eight streams: with a
    credit after every surge, each step counted the last step's five as their own burst (5 + 5 > 8 settled)
    and every step was a surge step. Now a surge on the credit is followed by the small budget
    (one prompt token a step) until the waiting prompts outnumber every stream by themselves."""
    engine = make_engine(tiny_gpt2, step_tokens=8, surge_tokens=1000, max_batch=64)
    for i in range(8):
        engine.submit([20 + i], max_new_tokens=60, ignore_eos=True)
    engine.step()  # a surge at an idle engine: eight streams
    for _ in range(12):
        for i in range(5):
            engine.submit([40 + i], max_new_tokens=2, ignore_eos=True)
        engine.step()
    assert "".join("S" if r.surge else "." for r in engine.step_log) == "SS..SS..SS..S"


def test_streams_one_token_old_from_an_ordinary_step_do_not_make_a_surge(tiny_gpt2: LoadedModel) -> None:
    engine = make_engine(tiny_gpt2, step_tokens=8, surge_tokens=1000)
    for i in range(4):
        engine.submit([20 + i], max_new_tokens=40, ignore_eos=True)
    engine.step()  # a surge: four streams
    engine.step()  # settled
    for i in range(2):
        engine.submit([40 + i, 50 + i], max_new_tokens=40, ignore_eos=True)
    engine.step()  # two prompts among four streams: the small budget, 8 - 4 = 4 tokens, both start
    for i in range(3):
        engine.submit(list(range(60 + 10 * i, 70 + 10 * i)), max_new_tokens=2)
    engine.step()  # three prompts, six streams (two one token old, not from a surge): 8 - 6 = 2 tokens
    assert [(r.decoded, r.prefill_tokens, r.surge) for r in engine.step_log] == [
        (0, 4, True), (4, 0, False), (4, 4, False), (6, 2, False)]  # fmt: skip


def test_prompts_that_could_not_be_admitted_now_do_not_make_a_surge(tiny_gpt2: LoadedModel) -> None:
    engine = make_engine(tiny_gpt2, step_tokens=8, surge_tokens=1000, num_blocks=60)  # blocks of 4 tokens
    for i in range(4):
        engine.submit([20 + i], max_new_tokens=40, ignore_eos=True)  # 11 blocks each
    engine.step()
    engine.step()  # settled streams
    engine.submit(list(range(30, 80)), max_new_tokens=2)  # 13 blocks: 3 left
    engine.step()
    held = [engine.submit(list(range(90, 100)), max_new_tokens=30) for _ in range(5)]  # 10 blocks each: no room
    engine.pause(held[0])  # and a paused one is stepped over, as admission does
    engine.step()
    assert [(r.decoded, r.prefill_tokens, r.surge) for r in engine.step_log][-2:] == [(4, 4, False)] * 2
    assert all(engine.scheduler.live[rid].status.value == "waiting" for rid in held)


def test_paused_prompts_do_not_make_a_surge(tiny_gpt2: LoadedModel) -> None:
    engine = make_engine(tiny_gpt2, step_tokens=8, surge_tokens=1000)
    engine.submit([20], max_new_tokens=40, ignore_eos=True)
    engine.step()
    engine.step()  # a settled stream
    held = [engine.submit(list(range(30, 60)), max_new_tokens=2) for _ in range(3)]
    for rid in held[1:]:
        engine.pause(rid)
    engine.step()  # one decoding stream, one prompt that may start: 8 - 1 = 7 tokens of it
    assert [(r.decoded, r.prefill_tokens, r.surge) for r in engine.step_log][-1] == (1, 7, False)


def test_prompts_are_prefilled_in_arrival_order_a_chunk_after_another(tiny_gpt2: LoadedModel) -> None:
    engine = make_engine(tiny_gpt2, step_tokens=6, surge_tokens=None)
    older = engine.submit(list(range(10, 20)), max_new_tokens=1)
    newer = engine.submit(list(range(20, 25)), max_new_tokens=1)
    assert engine.step() == [] and engine.scheduler.live[newer].status.value == "waiting"
    firsts = [e.rid for e in engine.step() if isinstance(e, TokenEvent)]
    assert firsts == [older]  # the rest of the older prompt (4), then 2 tokens of the newer one
    assert engine.scheduler.live[newer].num_prefilled == 2


def test_cancelling_a_prompt_in_mid_prefill_releases_its_blocks_once(tiny_gpt2: LoadedModel) -> None:
    engine = make_engine(tiny_gpt2, step_tokens=4, surge_tokens=None)
    rid = engine.submit(list(range(10, 40)), max_new_tokens=5)
    engine.step()
    assert engine.scheduler.live[rid].num_prefilled == 4
    engine.cancel(rid)
    events = engine.step()
    assert [(e.rid, getattr(e, "reason", None)) for e in events] == [(rid, "cancelled")]
    engine.cancel(rid)
    assert drain(engine) == {}
    assert engine.stats()["releases"] == 1
    assert_all_released(engine)


def test_a_paused_prompt_keeps_its_slot_and_prefill_and_resumes_to_its_solo_tokens(tiny_llama: LoadedModel) -> None:
    ids = _prompt(30, seed=8, vocab=tiny_llama.vocab_size)
    solo_tokens, _ = _solo(tiny_llama, ids)
    engine = make_engine(tiny_llama, step_tokens=4, surge_tokens=None)
    other = engine.submit([9, 8, 7], max_new_tokens=12, ignore_eos=True)
    rid = engine.submit(ids, max_new_tokens=8, ignore_eos=True, request_id="target")
    outcomes: dict = {}
    collect(engine.step(), outcomes)  # the 3-token prompt, then one token of the target
    engine.pause(rid)
    for _ in range(5):
        collect(engine.step(), outcomes)
    seq = engine.scheduler.live[rid]
    assert seq.num_prefilled == 1 and seq in engine.scheduler.running
    assert len(outcomes[other].tokens) == 6, "the other stream went on while the prompt was paused"
    engine.resume(rid)
    drain(engine, outcomes)
    assert outcomes[rid].tokens == solo_tokens
    assert engine.stats()["releases"] == 2
    assert_all_released(engine)


def test_cancelling_a_paused_prompt_in_mid_prefill_releases_it_once(tiny_gpt2: LoadedModel) -> None:
    engine = make_engine(tiny_gpt2, step_tokens=3, surge_tokens=None)
    rid = engine.submit(list(range(10, 30)), max_new_tokens=5)
    engine.step()
    engine.pause(rid)
    engine.step()
    engine.cancel(rid)
    assert [getattr(e, "reason", None) for e in engine.step()] == ["cancelled"]
    assert engine.stats()["releases"] == 1
    assert_all_released(engine)


@pytest.mark.parametrize("name", ["step_tokens", "surge_tokens"])
@pytest.mark.parametrize("bad", [0, -4, 2.5, True, "64"])
def test_the_budgets_must_be_positive_ints_or_none(name: str, bad: object) -> None:
    with pytest.raises(ValueError, match=name):
        EngineConfig(**{name: bad})


def test_a_surge_budget_below_the_step_budget_is_refused() -> None:
    with pytest.raises(ValueError, match="surge_tokens .8. must be at least step_tokens .64."):
        EngineConfig(step_tokens=64, surge_tokens=8)
    assert EngineConfig(step_tokens=None, surge_tokens=8).surge_tokens == 8  # unchunked: no budget to widen
