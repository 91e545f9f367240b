"""The hub alone, on an event loop, without HTTP: delivery, close, the five policies, drain, stop.

Most tests drive a :class:`FakeEngine` (the BatchEngine's thread-safe API, one token per step,
no model) so that a test can hold a step open or count pause/cancel calls; the last ones use the
real engine to check that the cache comes back whole.
"""
from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest
import torch
from service_helpers import FakeEngine, eventually, indices, read_all, run, running_hub

from labkit.engine.config import EngineConfig
from labkit.engine.engine import BatchEngine
from labkit.engine.events import FinishEvent, TokenEvent, Usage
from labkit.hub import Draining, Hub, HubConfig
from labkit.hub.stream import StreamClosed, StreamError, StreamState

TIMEOUT = 30.0


# -- delivery and close ------------------------------------------------------------------------
def test_a_stream_gets_its_tokens_then_its_finish() -> None:
    async def body() -> None:
        engine = FakeEngine()
        async with running_hub(engine) as hub:
            stream = hub.open("x", max_new_tokens=5)
            items = await read_all(stream)
            assert indices(items) == [0, 1, 2, 3, 4]
            assert isinstance(items[-1], FinishEvent) and items[-1].reason == "length"
            hub.close(stream)
            record = hub.record(stream.rid)
            assert record is not None and record.end == "length"
            assert record.tokens_generated == record.tokens_delivered == 5
            assert record.submitted <= record.first_token_sampled <= record.first_token_queued <= record.first_token_taken
            assert record.released is not None and record.closed is not None
            assert ("cancel", stream.rid) not in engine.calls
            assert hub.open_streams == 0
    run(body)


class FailingRowEngine(FakeEngine):
    """A FakeEngine whose request ``victim`` ends after its first token with the engine's
    ``error`` finish (its row could not be sampled), as BatchEngine ends such a row alone."""

    victim = ""

    def _token(self, rid: str, req: Any, emit: Any) -> None:
        if rid == self.victim and req.made == 1:
            del self.requests[rid]
            emit(FinishEvent(rid, "error", Usage(3, req.made), time.perf_counter(), error="could not be drawn"))
            return
        super()._token(rid, req, emit)


def test_an_engine_error_finish_ends_that_stream_with_an_error_and_spares_the_neighbour() -> None:
    async def body() -> None:
        engine = FailingRowEngine()
        async with running_hub(engine) as hub:
            victim = hub.open("x", max_new_tokens=5)
            engine.victim = victim.rid
            neighbour = hub.open("y", max_new_tokens=5)
            lost, kept = await read_all(victim), await read_all(neighbour)
            assert indices(lost) == [0] and isinstance(lost[-1], StreamError)
            assert lost[-1].type == "internal_error"
            assert indices(kept) == [0, 1, 2, 3, 4] and isinstance(kept[-1], FinishEvent)
            hub.close(victim)
            hub.close(neighbour)
    run(body)


def test_close_is_idempotent_and_cancels_an_unfinished_request() -> None:
    async def body() -> None:
        engine = FakeEngine()
        async with running_hub(engine) as hub:
            stream = hub.open("x", max_new_tokens=10_000)
            await stream.get(TIMEOUT)
            hub.close(stream)
            hub.close(stream)
            assert engine.calls.count(("cancel", stream.rid)) == 1
            assert hub.stats().ends == {"client_gone": 1}
            record = hub.record(stream.rid)
            await eventually(lambda: record.finish_reason == "cancelled", "the cancel to reach the engine")
            assert hub.stats().late_events >= 1  # at least the cancelled finish
            with pytest.raises(StreamClosed):
                await stream.get(TIMEOUT)
    run(body)


def test_prefill_delivery_hands_over_the_first_token_before_the_step_ends() -> None:
    async def body() -> None:
        engine = FakeEngine()
        engine.hold = threading.Event()
        async with running_hub(engine, first_token="prefill") as hub:
            stream = hub.open("x", max_new_tokens=3)
            first = await stream.get(TIMEOUT)
            assert isinstance(first, TokenEvent) and first.index == 0
            # the step is still running: it reaches its hold after handing the token over, and
            # cannot end before the hold is released below (the check waits for the step thread)
            await eventually(engine.holding.is_set, "the step to hold")
            engine.hold.set()
            await read_all(stream)
            hub.close(stream)
    run(body)


def test_step_end_delivery_holds_the_first_token_until_the_step_returns() -> None:
    async def body() -> None:
        engine = FakeEngine()
        engine.hold = threading.Event()
        async with running_hub(engine, first_token="step_end") as hub:
            stream = hub.open("x", max_new_tokens=3)
            await eventually(engine.holding.is_set, "the step to hold")
            assert await stream.get(0.1) is None
            engine.hold.set()
            first = await stream.get(TIMEOUT)
            assert isinstance(first, TokenEvent) and first.index == 0
            await read_all(stream)
            hub.close(stream)
    run(body)


# -- policies ----------------------------------------------------------------------------------
def test_naive_policy_stalls_every_stream_behind_one_slow_reader() -> None:
    async def body() -> None:
        async with running_hub(FakeEngine(), policy="naive") as hub:
            slow, healthy = hub.open("x", max_new_tokens=50), hub.open("y", max_new_tokens=50)
            got = []
            while (item := await healthy.get(0.3)) is not None:
                got.append(item)
                assert len(got) < 50, "the healthy stream should have stalled behind the slow reader"
            hub.close(slow)  # the slow reader leaves: the step loop is free again
            rest = await read_all(healthy)
            assert indices(got + rest) == list(range(50))
            hub.close(healthy)
    run(body)


def test_unbounded_policy_never_waits_and_never_pauses() -> None:
    async def body() -> None:
        engine = FakeEngine()
        async with running_hub(engine, policy="unbounded", high_water=4) as hub:
            slow, healthy = hub.open("x", max_new_tokens=30), hub.open("y", max_new_tokens=30)
            await read_all(healthy)
            await eventually(lambda: slow.state is StreamState.ENDING, "the unread stream to finish in the engine")
            assert len(slow) == 31 and not any(verb == "pause" for verb, _ in engine.calls)
            assert indices(await read_all(slow)) == list(range(30))
            hub.close(slow)
            hub.close(healthy)
    run(body)


def test_pause_policy_pauses_at_the_high_water_mark_and_resumes_at_half() -> None:
    async def body() -> None:
        engine = FakeEngine()
        async with running_hub(engine, policy="pause", high_water=4) as hub:
            slow = hub.open("x", max_new_tokens=40)
            await eventually(lambda: slow.rid in engine.requests and engine.requests[slow.rid].paused,
                             "the pause to reach the engine")
            made = engine.requests[slow.rid].made  # no more tokens once the engine has paused it
            await eventually(lambda: slow.record.tokens_generated == made, "the tokens in flight to land")
            assert len(slow) == made >= 4 and slow.state is StreamState.PAUSED
            assert hub.stats().paused_streams == 1
            while len(slow) > 2:
                await slow.get(TIMEOUT)
            assert ("resume", slow.rid) in engine.calls and slow.state is StreamState.RUNNING
            assert hub.record(slow.rid).pauses >= 1
            await read_all(slow)
            hub.close(slow)
    run(body)


@pytest.mark.parametrize("policy", ["drop", "pause_then_drop"])
def test_drop_policies_cancel_a_stalled_stream_and_tell_its_reader_last(policy: str) -> None:
    async def body() -> None:
        engine = FakeEngine()
        async with running_hub(engine, policy=policy, high_water=4, stall_timeout=0.05) as hub:
            slow, healthy = hub.open("x", max_new_tokens=1000), hub.open("y", max_new_tokens=40)
            assert indices(await read_all(healthy)) == list(range(40))
            await eventually(lambda: hub.stats().dropped == {"slow_client": 1}, "the drop")
            items = await read_all(slow)
            assert isinstance(items[-1], StreamError) and items[-1].type == "slow_client"
            assert indices(items) == list(range(len(items) - 1))
            verbs = [verb for verb, rid in engine.calls if rid == slow.rid]
            assert "cancel" in verbs and ("pause" in verbs) == (policy == "pause_then_drop")
            hub.close(slow)
            hub.close(healthy)
            assert hub.stats().ends == {"slow_client": 1, "length": 1}
    run(body)


# -- bounds: how long a stream may stay paused, how long a request may wait ------------------------
@pytest.mark.parametrize("policy", ["pause", "pause_then_drop"])
def test_a_stream_paused_longer_than_max_pause_is_dropped_and_its_request_cancelled(policy: str) -> None:
    async def body() -> None:
        engine = FakeEngine()
        async with running_hub(engine, policy=policy, high_water=4, stall_timeout=TIMEOUT, max_pause=0.05) as hub:
            slow = hub.open("x", max_new_tokens=10_000)  # never read until the drop
            await eventually(lambda: slow.state is StreamState.ENDING, "the drop after max_pause")
            assert ("cancel", slow.rid) in engine.calls and hub.stats().dropped == {"slow_client": 1}
            items = await read_all(slow)
            assert isinstance(items[-1], StreamError) and items[-1].type == "slow_client"
            assert "paused" in items[-1].message
            hub.close(slow)
            assert slow.record.states[-4:] == ["running", "paused", "ending", "closed"]
    run(body)


def test_a_resume_before_max_pause_disarms_it() -> None:
    async def body() -> None:
        engine = FakeEngine()
        async with running_hub(engine, policy="pause", high_water=4, max_pause=0.2) as hub:
            stream = hub.open("x", max_new_tokens=200)
            items = await read_all(stream)  # a reader that keeps up: pauses are short, never fatal
            assert isinstance(items[-1], FinishEvent) and hub.stats().dropped == {}
            hub.close(stream)
    run(body)


def test_a_request_that_waits_longer_than_queue_timeout_ends_with_an_error() -> None:
    async def body() -> None:
        engine = FakeEngine(slots=1)
        async with running_hub(engine, policy="unbounded", queue_timeout=0.1) as hub:
            holder = hub.open("x", max_new_tokens=10_000)
            await holder.get(TIMEOUT)  # admitted: it holds the only slot
            waiting = hub.open("y", max_new_tokens=5)
            items = await read_all(waiting)
            assert len(items) == 1 and isinstance(items[0], StreamError) and items[0].type == "queue_timeout"
            assert ("cancel", waiting.rid) in engine.calls
            await eventually(lambda: waiting.rid not in engine.requests, "the engine to forget the request")
            assert waiting.record.states == ["queued", "ending"]
            assert holder.state is StreamState.RUNNING  # the running one is not touched
            hub.close(waiting)
            hub.close(holder)
    run(body)


def test_a_request_admitted_in_time_is_not_touched_by_the_queue_timeout() -> None:
    async def body() -> None:
        async with running_hub(FakeEngine(), queue_timeout=0.5, stall_timeout=TIMEOUT) as hub:  # room for a loaded machine
            stream = hub.open("x", max_new_tokens=30)
            await stream.get(TIMEOUT)
            await asyncio.sleep(0.6)  # past the timeout: it must have been disarmed by the first token
            items = await read_all(stream)
            assert isinstance(items[-1], FinishEvent) and hub.stats().dropped == {}
            hub.close(stream)
    run(body)


# -- integrity checks run on the step thread ------------------------------------------------------
def test_check_integrity_waits_for_the_step_boundary_and_hands_back_the_result() -> None:
    async def body() -> None:
        engine = FakeEngine()
        engine.hold = threading.Event()
        async with running_hub(engine) as hub:
            stream = hub.open("x", max_new_tokens=3)
            await eventually(engine.holding.is_set, "a step to hold")
            check = hub.check_integrity()
            await asyncio.sleep(0.05)  # room for a wrong implementation to run the check now
            assert not check.done(), "the check ran while a step was in progress"
            engine.hold.set()
            await asyncio.wait_for(asyncio.wrap_future(check), TIMEOUT)  # FakeEngine raises if mid-step
            assert engine.checks == 1
            await read_all(stream)
            hub.close(stream)
    run(body)


def test_a_failed_check_raises_from_its_future() -> None:
    async def body() -> None:
        engine = FakeEngine()
        async with running_hub(engine) as hub:
            engine.check_integrity = lambda: (_ for _ in ()).throw(AssertionError("books differ"))  # type: ignore[method-assign]
            with pytest.raises(AssertionError, match="books differ"):
                await asyncio.wait_for(asyncio.wrap_future(hub.check_integrity()), TIMEOUT)
    run(body)


# -- drain, stop, errors -----------------------------------------------------------------------
def test_drain_ends_every_open_stream_with_a_shutdown_error_and_refuses_new_ones() -> None:
    async def body() -> None:
        async with running_hub(FakeEngine()) as hub:
            streams = [hub.open("x", max_new_tokens=10_000) for _ in range(3)]
            for stream in streams:
                await stream.get(TIMEOUT)
            drain = asyncio.ensure_future(hub.drain(grace=TIMEOUT))
            for stream in streams:
                last = (await read_all(stream))[-1]
                assert isinstance(last, StreamError) and last.type == "shutdown"
                hub.close(stream)
            await drain
            with pytest.raises(Draining):
                hub.open("x")
    run(body)


def test_drain_closes_streams_whose_readers_never_come_back() -> None:
    async def body() -> None:
        async with running_hub(FakeEngine()) as hub:
            hub.open("x", max_new_tokens=10_000)
            await hub.drain(grace=0.05)
            assert hub.open_streams == 0 and hub.stats().ends == {"shutdown": 1}
    run(body)


def test_stop_cancels_what_is_live_and_joins_the_step_thread() -> None:
    def step_threads() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name == "labkit-step"}

    async def body() -> None:
        engine = FakeEngine()
        others = step_threads()  # another test's server may still be running in this process
        async with running_hub(engine) as hub:
            stream = hub.open("x", max_new_tokens=10_000)
            await stream.get(TIMEOUT)
            assert len(step_threads() - others) == 1
        assert ("cancel", stream.rid) in engine.calls and not engine.requests
        assert not step_threads() - others
    run(body)


def test_the_parallel_loops_run_on_the_step_thread_and_come_back_after_stop() -> None:
    """The step thread is the process's one OpenMP team (labkit.engine.threads): the thread that
    starts the hub runs one thread while it runs, the step thread the count that thread had."""
    seen: list[int] = []

    class Counting(FakeEngine):
        def step(self, on_event: Any = None) -> list[Any]:
            seen.append(torch.get_num_threads())
            return super().step(on_event)

    async def body() -> None:
        async with running_hub(Counting()) as hub:
            assert torch.get_num_threads() == 1
            stream = hub.open("x", max_new_tokens=3)
            await read_all(stream)

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        run(body)
        assert seen and set(seen) == {2} and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_a_failing_step_ends_open_streams_with_an_internal_error() -> None:
    async def body() -> None:
        engine = FakeEngine()
        async with running_hub(engine) as hub:
            stream = hub.open("x", max_new_tokens=10_000)
            await stream.get(TIMEOUT)
            engine.fail = True
            items = await read_all(stream)
            assert isinstance(items[-1], StreamError) and items[-1].type == "internal_error"
            engine.fail = False
            hub.close(stream)
            assert hub.stats().errors >= 1
    run(body)


@pytest.mark.parametrize("bad", [{"policy": "lifo"}, {"high_water": 0}, {"stall_timeout": 0},
                                 {"first_token": "eventually"}, {"high_water": True}, {"max_pause": 0},
                                 {"queue_timeout": -1}, {"max_pause": "10"}, {"queue_timeout": True}])
def test_hub_config_refuses_bad_values_by_name(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        HubConfig(**bad)


# -- with the real engine ----------------------------------------------------------------------
def test_with_the_real_engine_every_block_comes_back(tiny_gpt2: Any) -> None:
    engine = BatchEngine(tiny_gpt2, EngineConfig(max_batch=2))

    async def body() -> None:
        async with running_hub(engine, policy="unbounded") as hub:
            streams = [hub.open(p, max_new_tokens=40) for p in ("Hello", "The cat", "One two", "Four")]
            await read_all(streams[0])
            await streams[1].get(TIMEOUT)
            for stream in streams:
                hub.close(stream)
            await eventually(lambda: engine.stats()["reserved_blocks"] == 0 and not engine.has_work(), "release")
    run(body)
    hub_free_check = Hub(engine).check_integrity()  # no step thread: the check runs here, now
    assert hub_free_check.result(0) is None
    stats = engine.stats()
    assert stats["running"] == stats["waiting"] == 0 and stats["finished"]["length"] >= 1
