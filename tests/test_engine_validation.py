"""Bad input raises a named error with a clear message and leaves nothing allocated."""
import threading

import pytest
from engine_helpers import PROMPTS, collect, drain, make_engine

from labkit.engine.config import EngineConfig
from labkit.errors import EmptyPrompt, InvalidRequest, PromptTooLong, QueueFull


@pytest.mark.parametrize("prompt", ["", []])
def test_empty_prompt_is_refused(tiny_gpt2, prompt):
    engine = make_engine(tiny_gpt2)
    with pytest.raises(EmptyPrompt):
        engine.submit(prompt)
    assert not engine.has_work()


@pytest.mark.parametrize("bad", [0, -1, 2.5, True])
def test_max_new_tokens_below_one_or_not_an_int_is_refused(tiny_gpt2, bad):
    with pytest.raises(InvalidRequest, match="max_new_tokens"):
        make_engine(tiny_gpt2).submit(PROMPTS[0], max_new_tokens=bad)


def test_prompt_plus_new_tokens_beyond_the_context_is_refused(tiny_gpt2):
    engine = make_engine(tiny_gpt2)
    with pytest.raises(PromptTooLong, match="context"):
        engine.submit(PROMPTS[0], max_new_tokens=tiny_gpt2.max_context)


def test_request_larger_than_the_whole_cache_is_refused(tiny_gpt2):
    engine = make_engine(tiny_gpt2, num_blocks=4, block_size=4)
    with pytest.raises(PromptTooLong, match="whole cache"):
        engine.submit(PROMPTS[0], max_new_tokens=16)
    assert engine.stats()["reserved_blocks"] == 0


@pytest.mark.parametrize("kwargs", [{"temperature": -1.0}, {"top_p": 0.0}, {"top_p": 1.5}, {"stop": [""]},
                                    {"seed": "x"}, {"seed": 2**64}, {"seed": -(2**63) - 1}, {"ignore_eos": 1},
                                    {"temperature": 10**400}, {"top_p": float("nan")}, {"temperature": True}])
def test_bad_sampling_parameters_are_refused(tiny_gpt2, kwargs):
    with pytest.raises(InvalidRequest):
        make_engine(tiny_gpt2).submit(PROMPTS[0], **kwargs)


@pytest.mark.parametrize("kwargs", [{"stop": [""] * 250_000}, {"temperature": -(10**5000)}, {"seed": 10**5000}])
def test_a_refusal_does_not_echo_a_huge_value_back(tiny_gpt2, kwargs):
    with pytest.raises(InvalidRequest) as refused:
        make_engine(tiny_gpt2).submit(PROMPTS[0], **kwargs)
    assert len(str(refused.value)) < 200


def test_token_ids_outside_the_vocabulary_are_refused(tiny_gpt2):
    with pytest.raises(InvalidRequest, match="vocabulary"):
        make_engine(tiny_gpt2).submit([1, 2, tiny_gpt2.vocab_size])


def test_waiting_limit_refuses_with_queue_full_and_frees_up_after_admission(tiny_gpt2):
    engine = make_engine(tiny_gpt2, max_batch=1, max_waiting=2)
    engine.submit(PROMPTS[0], max_new_tokens=3)
    engine.submit(PROMPTS[1], max_new_tokens=3)
    with pytest.raises(QueueFull):
        engine.submit(PROMPTS[2], max_new_tokens=3)
    outcomes = {}
    collect(engine.step(), outcomes)  # one is admitted, so one place in the queue opens
    engine.submit(PROMPTS[2], max_new_tokens=3)
    assert all(o.reason == "length" for o in drain(engine, outcomes).values())


def test_a_request_id_cannot_be_reused(tiny_gpt2):
    engine = make_engine(tiny_gpt2)
    engine.submit(PROMPTS[0], max_new_tokens=2, request_id="abc")
    with pytest.raises(InvalidRequest, match="already in use"):
        engine.submit(PROMPTS[0], max_new_tokens=2, request_id="abc")
    drain(engine)


def test_a_request_id_is_free_again_once_its_request_is_over(tiny_gpt2):
    engine = make_engine(tiny_gpt2)
    engine.submit(PROMPTS[0], max_new_tokens=2, request_id="abc")
    drain(engine)
    engine.submit(PROMPTS[1], max_new_tokens=2, request_id="abc")
    assert drain(engine)["abc"].reason == "length"
    assert not engine._known  # finished ids are forgotten: a long-lived server does not grow


def test_the_waiting_limit_holds_under_concurrent_submits_while_steps_run(tiny_gpt2):
    engine = make_engine(tiny_gpt2, max_batch=1, max_waiting=3)
    first = engine.submit(PROMPTS[0], max_new_tokens=200)
    engine.step()  # first runs and holds the only slot for the rest of the test
    accepted, refused, barrier = [], [], threading.Barrier(8)

    def submitter(i: int) -> None:
        barrier.wait()
        for j in range(10):
            try:
                accepted.append(engine.submit(PROMPTS[(i + j) % len(PROMPTS)], max_new_tokens=2))
            except QueueFull:
                refused.append(i)

    threads = [threading.Thread(target=submitter, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for _ in range(20):  # steps move the queue from inbox to waiting list meanwhile
        engine.step()
        assert engine.stats()["waiting"] <= 3
    for t in threads:
        t.join()
    assert len(accepted) == 3 and len(refused) == 77
    engine.cancel(first)
    drain(engine)


@pytest.mark.parametrize("field,value", [("block_size", 0), ("max_batch", -3), ("num_blocks", 0),
                                         ("dtype", "int8"), ("max_waiting", -1), ("tile_rows", 0),
                                         ("step_delay", -0.1), ("step_delay", 11.0), ("step_delay", True)])
def test_engine_config_names_the_bad_field(field, value):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**{field: value})


def test_step_delay_lengthens_every_working_step_and_changes_no_token(tiny_gpt2):
    """The lab's slower engine: each step that did work takes at least the delay; the tokens and
    the number of steps are those of the undelayed engine."""
    import time

    runs = {}
    for delay in (0.0, 0.03):
        engine = make_engine(tiny_gpt2, step_delay=delay)
        rids = [engine.submit(p, max_new_tokens=5, ignore_eos=True) for p in PROMPTS[:3]]
        started = time.perf_counter()
        outcomes = drain(engine)
        runs[delay] = ([outcomes[r].tokens for r in rids], engine.current_step, time.perf_counter() - started)
    assert runs[0.03][0] == runs[0.0][0] and runs[0.03][1] == runs[0.0][1]
    assert all(record.seconds >= 0.03 for record in engine.step_log)
    assert runs[0.03][2] >= 0.03 * runs[0.03][1]
