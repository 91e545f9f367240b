"""A request's life in the engine: admission, the batch limit, cancel, pause, resume, release."""
import threading

import pytest
from engine_helpers import PROMPTS, Outcome, assert_all_released, collect, drain, make_engine, solo, with_eos

from labkit.errors import DoubleFree


def test_single_token_request_finishes_in_its_prefill_step(tiny_gpt2):
    engine = make_engine(tiny_gpt2)
    rid = engine.submit(PROMPTS[0], max_new_tokens=1)
    events = engine.step()
    out = drain(engine, {})
    collect(events, out)
    assert len(out[rid].tokens) == 1 and out[rid].reason == "length"
    assert out[rid].usage.completion_tokens == 1
    assert_all_released(engine)


def test_length_limit_gives_exactly_max_new_tokens(tiny_model):
    out = solo(tiny_model, PROMPTS[2], max_new_tokens=7)
    assert len(out.tokens) == 7 and out.reason == "length"


def test_eos_ends_the_sequence_with_reason_eos(tiny_gpt2):
    free_run = solo(tiny_gpt2, PROMPTS[3], max_new_tokens=8).tokens
    model = with_eos(tiny_gpt2, free_run[3])  # this run's 4th token ends it
    out = solo(model, PROMPTS[3], max_new_tokens=8)
    first = free_run.index(free_run[3])
    assert out.reason == "eos" and out.tokens == free_run[: first + 1]


def test_ignore_eos_runs_past_eos_to_the_length_limit(tiny_gpt2):
    free_run = solo(tiny_gpt2, PROMPTS[3], max_new_tokens=8).tokens
    out = solo(with_eos(tiny_gpt2, free_run[3]), PROMPTS[3], max_new_tokens=8, ignore_eos=True)
    assert out.reason == "length" and out.tokens == free_run


def test_cancelling_a_waiting_request_never_admits_it(tiny_gpt2):
    engine = make_engine(tiny_gpt2, max_batch=1)
    first = engine.submit(PROMPTS[0], max_new_tokens=5)
    waiting = engine.submit(PROMPTS[1], max_new_tokens=5)
    out = {}
    collect(engine.step(), out)
    engine.cancel(waiting)
    drain(engine, out)
    assert out[waiting].tokens == [] and out[waiting].reason == "cancelled"
    assert out[first].reason == "length"
    assert engine.stats()["prefills"] == 1
    assert_all_released(engine)


def test_cancelling_a_running_request_returns_its_blocks_at_the_next_step(tiny_gpt2):
    engine = make_engine(tiny_gpt2)
    rid = engine.submit(PROMPTS[0], max_new_tokens=50)
    engine.step()
    engine.step()
    held = engine.stats()["reserved_blocks"]
    assert held > 0
    engine.cancel(rid)
    assert engine.stats()["reserved_blocks"] == held, "a cancel is only a wish until the next step"
    events = engine.step()
    assert [e.reason for e in events if hasattr(e, "reason")] == ["cancelled"]
    assert_all_released(engine)


def test_double_and_late_cancels_are_harmless(tiny_gpt2):
    engine = make_engine(tiny_gpt2)
    rid = engine.submit(PROMPTS[0], max_new_tokens=3)
    engine.cancel(rid)
    engine.cancel(rid)
    out = drain(engine)
    assert out[rid].reason == "cancelled"
    engine.cancel(rid)  # late: already finished
    engine.cancel("never-existed")
    drain(engine, out)
    assert engine.stats()["releases"] == 0  # never admitted, so nothing to release
    assert engine.finished["cancelled"] == 1


def test_pause_leaves_the_sequence_out_of_decode_and_resume_continues_identically(tiny_model):
    reference = solo(tiny_model, PROMPTS[4], max_new_tokens=12).tokens
    engine = make_engine(tiny_model)
    rid = engine.submit(PROMPTS[4], max_new_tokens=12)
    other = engine.submit(PROMPTS[5], max_new_tokens=12)
    out: dict[str, Outcome] = {}
    for _ in range(3):
        collect(engine.step(), out)
    engine.pause(rid)
    for _ in range(4):
        collect(engine.step(), out)
    stalled = len(out[rid].tokens)
    assert stalled == 3, "a paused sequence makes no tokens"
    assert len(out[other].tokens) == 7
    assert engine.stats()["paused"] == 1 and engine.stats()["reserved_blocks"] > 0
    engine.resume(rid)
    drain(engine, out)
    assert out[rid].tokens == reference
    assert_all_released(engine)


def test_admission_is_limited_by_blocks_and_keeps_arrival_order(tiny_gpt2):
    # each request reserves 4 blocks (prompt + 11 new tokens <= 16 slots of 4); 9 blocks fit two
    engine = make_engine(tiny_gpt2, num_blocks=9, block_size=4)
    prompt = tiny_gpt2.tokenizer.encode("one two three four five")[:5]
    rids = [engine.submit(prompt, max_new_tokens=11) for _ in range(5)]
    admitted_order = []
    for _ in range(200):
        if not engine.has_work():
            break
        before = {s.rid for s in engine.scheduler.running}
        engine.step()
        admitted_order += [s.rid for s in engine.scheduler.running if s.rid not in before]
        assert engine.stats()["running"] <= 2
    assert admitted_order == rids
    assert_all_released(engine)


def test_batch_limit_caps_the_running_set(tiny_gpt2):
    engine = make_engine(tiny_gpt2, max_batch=3)
    rids = [engine.submit(p, max_new_tokens=4) for p in PROMPTS[:7]]
    peak, out = 0, {}
    while engine.has_work():
        collect(engine.step(), out)
        peak = max(peak, engine.stats()["running"])
    assert peak == 3
    assert all(out[r].reason == "length" for r in rids)


def test_submit_and_cancel_from_many_threads_at_once(tiny_gpt2):
    engine = make_engine(tiny_gpt2, max_batch=8)
    rids: list[str] = []
    lock = threading.Lock()

    def client(i: int) -> None:
        for j in range(5):
            rid = engine.submit(PROMPTS[(i + j) % len(PROMPTS)], max_new_tokens=6)
            with lock:
                rids.append(rid)
            if j % 2:
                engine.cancel(rid)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    out: dict[str, Outcome] = {}
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads) or engine.has_work():
        collect(engine.step(), out)
    for t in threads:
        t.join()
    drain(engine, out)
    assert len(rids) == 40 == len(set(rids))
    assert set(out) == set(rids), "every request finishes exactly once"
    assert engine.finished["cancelled"] >= 1
    assert_all_released(engine)


def test_finishing_a_sequence_twice_raises_double_free(tiny_gpt2):
    engine = make_engine(tiny_gpt2)
    rid = engine.submit(PROMPTS[0], max_new_tokens=20)
    engine.step()
    seq = engine.scheduler.live[rid]
    engine.scheduler.finish(seq, "cancelled")
    with pytest.raises(DoubleFree):
        engine.scheduler.finish(seq, "cancelled")
    assert engine.stats()["releases"] == 1


def test_step_from_two_threads_at_once_is_refused(tiny_gpt2):
    engine = make_engine(tiny_gpt2)
    engine._step_lock.acquire()
    try:
        with pytest.raises(RuntimeError, match="two threads"):
            engine.step()
    finally:
        engine._step_lock.release()


def test_wait_for_work_wakes_on_submit(tiny_gpt2):
    engine = make_engine(tiny_gpt2)
    assert engine.wait_for_work(0.01) is False
    timer = threading.Timer(0.05, lambda: engine.submit(PROMPTS[0], max_new_tokens=2))
    timer.start()
    assert engine.wait_for_work(10.0) is True
    timer.join()
    drain(engine)
