"""A stream's life, as a specification: the states, the moves between them, and what the hub
does at each move. The table in ``labkit.hub.stream`` is the one place the moves are written;
these tests restate it independently, so a change to it has to be made twice, on purpose.
"""
from __future__ import annotations

import asyncio
import itertools

import pytest
from service_helpers import TIMEOUT, FakeEngine, eventually, read_all, run, running_hub

from labkit.engine.events import FinishEvent
from labkit.hub import TRANSITIONS, IllegalTransition, Stream, StreamClosed, StreamError, StreamRecord, StreamState

Q, R, P, E, C = (StreamState.QUEUED, StreamState.RUNNING, StreamState.PAUSED, StreamState.ENDING,
                 StreamState.CLOSED)
ALLOWED = {
    (Q, R),  # the first token arrived
    (R, P), (P, R),  # a policy paused the request for a slow reader, and resumed it
    (Q, E), (R, E), (P, E),  # a terminal item was queued: the engine's finish or the hub's error
    (Q, C), (R, C), (P, C),  # closed while still live: the request is cancelled
    (E, C),  # closed after its end
}


def new_stream() -> Stream:
    return Stream(StreamRecord("req-1", 3, 10, 0.0), lambda stream, item: None)


def walk(*states: StreamState) -> Stream:
    stream = new_stream()
    for state in states:
        stream.move(state)
    return stream


# -- the table -----------------------------------------------------------------------------------
@pytest.mark.parametrize("before, after", sorted(itertools.product(StreamState, repeat=2)))
def test_only_the_listed_moves_are_allowed(before: StreamState, after: StreamState) -> None:
    assert (after in TRANSITIONS[before]) == ((before, after) in ALLOWED)


@pytest.mark.parametrize("route", [(R, E, C), (R, P, R, P, E, C), (E, C), (C,), (R, C), (R, P, C), (R, P, E, C)],
                         ids=lambda route: "-".join(s.value for s in route))
def test_every_path_to_closed_is_walked_and_recorded(route: tuple[StreamState, ...]) -> None:
    stream = walk(*route)
    assert stream.state is C
    assert stream.record.states == ["queued"] + [s.value for s in route]


@pytest.mark.parametrize("before, after", sorted(set(itertools.product(StreamState, repeat=2)) - ALLOWED))
def test_any_other_move_raises_and_leaves_the_stream_as_it_was(before: StreamState, after: StreamState) -> None:
    route = {Q: (), R: (R,), P: (R, P), E: (E,), C: (C,)}[before]
    stream = walk(*route)
    with pytest.raises(IllegalTransition, match=f"{before.value} -> {after.value}"):
        stream.move(after)
    assert stream.state is before and stream.record.states[-1] == before.value


def test_every_state_can_reach_closed_and_closed_is_final() -> None:
    for state in StreamState:
        seen, todo = {state}, [state]
        while todo:
            for nxt in TRANSITIONS[todo.pop()] - seen:
                seen.add(nxt)
                todo.append(nxt)
        assert C in seen, state
    assert TRANSITIONS[C] == frozenset()


def test_only_live_states_accept_engine_events() -> None:
    assert {s for s in StreamState if s.live} == {Q, R, P}


def test_pauses_are_counted_as_they_happen() -> None:
    assert walk(R, P, R, P, R).record.pauses == 2


# -- the hub's moves -------------------------------------------------------------------------------
def test_a_stream_read_to_its_end_goes_queued_running_ending_closed() -> None:
    async def body() -> None:
        engine = FakeEngine()
        async with running_hub(engine) as hub:
            stream = hub.open("x", max_new_tokens=3)
            assert stream.state is Q
            await read_all(stream)
            assert stream.state is E
            hub.close(stream)
            assert stream.record.states == ["queued", "running", "ending", "closed"]
            assert ("cancel", stream.rid) not in engine.calls  # the engine had finished it
    run(body)


def test_a_stream_closed_before_its_first_token_is_cancelled_once() -> None:
    async def body() -> None:
        engine = FakeEngine()
        async with running_hub(engine) as hub:
            stream = hub.open("x", max_new_tokens=3)
            hub.close(stream)  # on the loop, before any delivery could run
            hub.close(stream)
            assert stream.record.states == ["queued", "closed"]
            assert engine.calls.count(("cancel", stream.rid)) == 1
            await eventually(lambda: stream.record.finish_reason == "cancelled", "the cancel")
            assert hub.stats().late_events >= 1 and stream.state is C
    run(body)


def test_a_paused_stream_is_paused_and_resumed_in_the_engine_at_each_move() -> None:
    async def body() -> None:
        engine = FakeEngine()
        async with running_hub(engine, policy="pause", high_water=4) as hub:
            stream = hub.open("x", max_new_tokens=12)
            await eventually(lambda: stream.state is P, "the pause")
            assert [verb for verb, rid in engine.calls if rid == stream.rid] == ["submit", "pause"]
            await read_all(stream)
            hub.close(stream)
            states = stream.record.states
            assert states[:3] == ["queued", "running", "paused"] and states[-2:] == ["ending", "closed"]
            verbs = [verb for verb, rid in engine.calls if rid == stream.rid]
            assert verbs.count("pause") == states.count("paused")
            assert verbs.count("resume") == sum(1 for pair in itertools.pairwise(states) if pair == ("paused", "running"))
    run(body)


def test_a_dropped_stream_ends_with_its_error_and_later_events_do_not_move_it() -> None:
    async def body() -> None:
        engine = FakeEngine()
        async with running_hub(engine, policy="drop", high_water=2, stall_timeout=0.01) as hub:
            stream = hub.open("x", max_new_tokens=10_000)
            await eventually(lambda: stream.state is E, "the drop")
            await eventually(lambda: stream.record.finish_reason == "cancelled", "the cancelled finish")
            assert stream.state is E  # the cancelled finish arrived late and moved nothing
            items = await read_all(stream)
            assert isinstance(items[-1], StreamError) and not any(isinstance(i, FinishEvent) for i in items)
            hub.close(stream)
            assert stream.record.states == ["queued", "running", "ending", "closed"]
            assert engine.calls.count(("cancel", stream.rid)) == 1
    run(body)


def test_a_reader_waiting_on_a_stream_that_is_closed_is_woken() -> None:
    async def body() -> None:
        async with running_hub(FakeEngine(slots=0)) as hub:  # no slot: the stream stays queued
            stream = hub.open("x")
            reader = asyncio.ensure_future(read_all(stream))
            await asyncio.sleep(0)
            hub.close(stream)
            with pytest.raises(StreamClosed):
                await asyncio.wait_for(reader, TIMEOUT)
    run(body)
