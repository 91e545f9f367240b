"""The engine under misuse: reused ids, odd sampling values, several eos ids, a row that fails.

A failure caused by one request ends that request only; nothing done to a finished request
reaches a newer one that took its id.
"""
import copy
import math

import pytest
import torch
from engine_helpers import PROMPTS, Outcome, assert_all_released, collect, drain, make_engine, solo, with_eos

from labkit.engine.config import EngineConfig
from labkit.engine.events import FinishEvent, TokenEvent
from labkit.errors import DoubleFree


# -- ids that come back -------------------------------------------------------------------------
def test_a_stale_finish_raises_and_never_frees_a_newer_request_with_the_same_id(tiny_gpt2):
    engine = make_engine(tiny_gpt2)
    engine.submit(PROMPTS[0], max_new_tokens=3, request_id="abc")
    first: dict[str, Outcome] = {}
    collect(engine.step(), first)
    old = engine.scheduler.live["abc"]
    assert drain(engine, first)["abc"].reason == "length"
    engine.submit(PROMPTS[1], max_new_tokens=8, request_id="abc")
    out: dict[str, Outcome] = {}
    collect(engine.step(), out)
    held = engine.stats()["reserved_blocks"]
    assert held > 0
    with pytest.raises(DoubleFree):
        engine.scheduler.finish(old, "cancelled")  # a stale release of the finished request
    assert engine.stats()["reserved_blocks"] == held, "the newer request still holds its blocks"
    assert engine.scheduler.live["abc"] is not old
    drain(engine, out)
    assert out["abc"].reason == "length" and len(out["abc"].tokens) == 8
    assert_all_released(engine)


@pytest.mark.parametrize("verb", ["cancel", "pause"])
def test_a_late_wish_for_a_finished_request_never_reaches_a_newer_one_with_its_id(tiny_gpt2, verb):
    engine = make_engine(tiny_gpt2)
    first = engine.submit(PROMPTS[0], max_new_tokens=2, request_id="abc")
    assert drain(engine)["abc"].reason == "length"
    second = engine.submit(PROMPTS[1], max_new_tokens=6, request_id="abc")
    out: dict[str, Outcome] = {}
    collect(engine.step(), out)
    getattr(engine, verb)(first)  # late: the request this id named is over
    drain(engine, out)
    assert out["abc"].reason == "length" and len(out["abc"].tokens) == 6
    assert first == second == "abc" and engine.finished["cancelled"] == 0
    assert_all_released(engine)


def test_a_plain_string_id_names_whichever_request_holds_it_now(tiny_gpt2):
    engine = make_engine(tiny_gpt2)
    engine.submit(PROMPTS[0], max_new_tokens=2, request_id="abc")
    drain(engine)
    engine.submit(PROMPTS[1], max_new_tokens=6, request_id="abc")
    engine.step()
    engine.cancel("abc")
    assert drain(engine)["abc"].reason == "cancelled"


# -- the device -------------------------------------------------------------------------------
@pytest.mark.parametrize("device", ["tpu0", "meta", ""] + ([] if torch.cuda.is_available() else ["cuda", "cuda:0"]))
def test_an_unknown_or_absent_device_is_refused_when_the_config_is_made(device):
    with pytest.raises(ValueError, match="EngineConfig.device"):
        EngineConfig(device=device)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_seeded_sampling_runs_on_the_gpu_and_does_not_depend_on_neighbours(tiny_model):
    engine = make_engine(tiny_model, device="cuda")
    alone = drain_one(engine, PROMPTS[0], temperature=0.9, top_p=0.9, seed=5)
    crowd = make_engine(tiny_model, device="cuda")
    for i, p in enumerate(PROMPTS[1:6]):
        crowd.submit(p, max_new_tokens=10, temperature=1.0, seed=i)
    rid = crowd.submit(PROMPTS[0], max_new_tokens=10, temperature=0.9, top_p=0.9, seed=5)
    assert drain(crowd)[rid].tokens == alone.tokens


def drain_one(engine, prompt, **kwargs):
    rid = engine.submit(prompt, max_new_tokens=10, **kwargs)
    return drain(engine)[rid]


def test_sampling_generators_live_on_the_engine_device(tiny_gpt2):
    engine = make_engine(tiny_gpt2)
    rid = engine.submit(PROMPTS[0], max_new_tokens=4, temperature=0.8, seed=1)
    out: dict[str, Outcome] = {}
    collect(engine.step(), out)
    assert engine.scheduler.live[rid].generator.device == torch.device(engine.config.device)
    assert drain(engine, out)[rid].reason == "length"


# -- several end ids --------------------------------------------------------------------------
def _with_generation_eos(loaded, eos):
    model = with_eos(loaded, loaded.model.config.eos_token_id)
    model.model.generation_config = copy.deepcopy(loaded.model.generation_config)
    model.model.generation_config.eos_token_id = eos
    return model


@pytest.mark.parametrize("where", ["config", "generation_config"])
def test_every_listed_eos_id_ends_the_sequence_not_only_the_first(tiny_model, where):
    free_run = solo(tiny_model, PROMPTS[3], max_new_tokens=10).tokens
    late, early = free_run[7], free_run[2]
    assume_distinct = late not in free_run[:7] and early not in free_run[:2]
    if not assume_distinct:
        pytest.skip(f"this free run repeats tokens: {free_run}")
    eos = [late, early]  # the id that ends it early is listed second
    model = with_eos(tiny_model, eos) if where == "config" else _with_generation_eos(tiny_model, eos)
    out = solo(model, PROMPTS[3], max_new_tokens=10)
    assert out.reason == "eos" and out.tokens == free_run[:3]


# -- sampling values that underflow ------------------------------------------------------------
@pytest.mark.parametrize("kwargs", [{"temperature": 5e-324}, {"temperature": 1e-46},
                                    {"temperature": 0.8, "top_p": 5e-324}, {"temperature": 1.0, "top_p": 1e-46}])
def test_values_that_underflow_in_float32_give_the_greedy_tokens_and_spare_the_neighbours(tiny_model, kwargs):
    greedy = solo(tiny_model, PROMPTS[2], max_new_tokens=6).tokens
    neighbour_alone = solo(tiny_model, PROMPTS[5], max_new_tokens=6, temperature=0.9, seed=11).tokens
    engine = make_engine(tiny_model)
    neighbour = engine.submit(PROMPTS[5], max_new_tokens=6, temperature=0.9, seed=11)
    odd = engine.submit(PROMPTS[2], max_new_tokens=6, seed=3, **kwargs)
    out = drain(engine)
    assert out[odd].tokens == greedy and out[odd].reason == "length"
    assert out[neighbour].tokens == neighbour_alone and out[neighbour].reason == "length"
    assert_all_released(engine)


# -- a row that fails anyway ends its own request only ------------------------------------------
def _corrupt_temperature(seq, value=math.nan):
    bad = copy.copy(seq.params)
    object.__setattr__(bad, "temperature", value)  # slipped past validation somehow
    seq.params = bad


def _overflow_temperature(seq):
    _corrupt_temperature(seq, 10**400)  # no float holds it: building the batch's tensors raises


def _corrupt_generator(seq):
    seq.generator = object()  # multinomial raises for this row


@pytest.mark.parametrize("corrupt", [_corrupt_temperature, _corrupt_generator, _overflow_temperature],
                         ids=["nan-row", "raising-row", "raising-batch"])
def test_a_request_whose_sampling_fails_in_a_step_ends_alone_with_an_error(tiny_model, corrupt):
    neighbour_alone = solo(tiny_model, PROMPTS[5], max_new_tokens=8, temperature=0.9, seed=11).tokens
    greedy_alone = solo(tiny_model, PROMPTS[6], max_new_tokens=8).tokens
    engine = make_engine(tiny_model)
    neighbour = engine.submit(PROMPTS[5], max_new_tokens=8, temperature=0.9, seed=11)
    greedy = engine.submit(PROMPTS[6], max_new_tokens=8)
    victim = engine.submit(PROMPTS[2], max_new_tokens=8, temperature=0.7, seed=3)
    out: dict[str, Outcome] = {}
    events = []
    for _ in range(2):
        events += engine.step()
    corrupt(engine.scheduler.live[victim])
    events += engine.step()
    collect(events, out)
    drain(engine, out)
    finish = [e for e in events if isinstance(e, FinishEvent) and e.rid == victim]
    assert [f.reason for f in finish] == ["error"] and finish[0].error and "Error" not in finish[0].error
    assert len(out[victim].tokens) == 2, "no token for the failed draw"
    assert out[neighbour].tokens == neighbour_alone and out[greedy].tokens == greedy_alone
    assert engine.stats()["sampling_errors"] == 1 and engine.finished["error"] == 1
    assert_all_released(engine)


# -- the step clock ---------------------------------------------------------------------------
def test_steps_are_numbered_one_by_one_and_every_event_carries_its_step(tiny_gpt2):
    engine = make_engine(tiny_gpt2)
    assert engine.stats()["step"] == 0
    rid = engine.submit(PROMPTS[0], max_new_tokens=4)
    late = None
    seen: list[tuple[int, object]] = []
    for n in range(1, 8):
        if n == 3:
            late = engine.submit(PROMPTS[1], max_new_tokens=5)
        if n == 5:
            engine.cancel(late)
        seen += [(n, e) for e in engine.step()]
        assert engine.stats()["step"] == n
    assert seen and all(event.step == n for n, event in seen)
    mine = [e for _, e in seen if e.rid == rid]
    assert [e.step for e in mine if isinstance(e, TokenEvent)] == [1, 2, 3, 4]
    assert [(e.step, e.reason) for e in mine if isinstance(e, FinishEvent)] == [(4, "length")]
    theirs = [e for _, e in seen if e.rid == late]
    assert [e.step for e in theirs if isinstance(e, TokenEvent)] == [3, 4]
    assert [(e.step, e.reason) for e in theirs if isinstance(e, FinishEvent)] == [(5, "cancelled")]


def test_on_event_sees_the_step_of_each_event_as_it_is_made(tiny_gpt2):
    engine = make_engine(tiny_gpt2)
    engine.submit(PROMPTS[0], max_new_tokens=3)
    live: list[tuple[int, int]] = []
    while engine.has_work():
        engine.step(lambda e: live.append((e.step, engine.stats()["step"])))
    assert live and all(a == b for a, b in live)


# -- slow work stays outside the id lock ----------------------------------------------------------
class _LockProbe:
    """The engine's tokenizer, noting whether the engine's id lock was held at each decode."""

    def __init__(self, tokenizer, engine):
        self._tokenizer, self._engine, self.held = tokenizer, engine, []

    def decode(self, ids, **kwargs):
        self.held.append(self._engine._ids_lock.locked())
        return self._tokenizer.decode(ids, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


def test_no_tokenizer_decode_runs_under_the_id_lock_that_submit_and_stats_take(tiny_gpt2):
    engine = make_engine(tiny_gpt2)
    probe = engine.tokenizer = _LockProbe(engine.tokenizer, engine)
    rids = [engine.submit(p, max_new_tokens=3, stop=["zz"]) for p in PROMPTS[:3]]
    out = drain(engine)
    assert all(out[r].reason == "length" for r in rids)
    assert probe.held and not any(probe.held), "a decode ran while the id lock was held"
