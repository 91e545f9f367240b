"""The five policies as pure decisions: given a stream's state and queue length, what each one
asks the hub to do. No thread, no loop, no engine: a policy only looks and decides."""
from __future__ import annotations

import pytest

from labkit.engine.events import TokenEvent
from labkit.hub import POLICIES, Decision, Flow, Stream, StreamRecord, StreamState
from labkit.hub.policies import KEEP, make_policy

HIGH = 4


def stream_with(queued: int, *states: StreamState) -> Stream:
    stream = Stream(StreamRecord("req-1", 3, 100, 0.0), lambda s, item: None)
    for state in states:
        stream.move(state)
    for index in range(queued):
        stream.put(TokenEvent("req-1", index, 100 + index, "t", 0.0), 0.0)
    return stream


RUNNING, PAUSED = (StreamState.RUNNING,), (StreamState.RUNNING, StreamState.PAUSED)


@pytest.mark.parametrize("name", ["naive", "unbounded"])
def test_naive_and_unbounded_never_act(name: str) -> None:
    policy = make_policy(name, HIGH, 0.25)
    for queued in (0, HIGH, 100):
        stream = stream_with(queued, *RUNNING)
        assert policy.after_put(stream) == policy.after_take(stream) == policy.on_stall(stream) == KEEP
    assert policy.waits_for_reader == (name == "naive")


@pytest.mark.parametrize("name", ["pause", "pause_then_drop"])
def test_pausing_policies_pause_at_the_mark_and_resume_at_half(name: str) -> None:
    policy = make_policy(name, HIGH, 0.25)
    watch = True if name == "pause_then_drop" else None
    assert policy.after_put(stream_with(HIGH - 1, *RUNNING)) == KEEP
    assert policy.after_put(stream_with(HIGH, *RUNNING)) == Decision(flow=Flow.PAUSE, watch=watch)
    assert policy.after_put(stream_with(HIGH + 1, *PAUSED)) == KEEP  # already paused
    assert policy.after_take(stream_with(HIGH // 2 + 1, *PAUSED)) == KEEP
    unwatch = False if name == "pause_then_drop" else None
    assert policy.after_take(stream_with(HIGH // 2, *PAUSED)) == Decision(flow=Flow.RESUME, watch=unwatch)
    assert policy.after_take(stream_with(0, *RUNNING)) == KEEP  # not paused: nothing to resume


def test_pause_then_drop_drops_only_a_stream_still_paused_when_its_timer_runs_out() -> None:
    policy = make_policy("pause_then_drop", HIGH, 0.25)
    assert policy.on_stall(stream_with(HIGH, *PAUSED)) == Decision(drop=True)
    assert policy.on_stall(stream_with(HIGH, *RUNNING)) == KEEP


def test_drop_watches_a_stream_at_the_mark_and_drops_it_if_still_behind() -> None:
    policy = make_policy("drop", HIGH, 0.25)
    assert policy.after_put(stream_with(HIGH - 1, *RUNNING)) == KEEP
    assert policy.after_put(stream_with(HIGH, *RUNNING)) == Decision(watch=True)
    assert policy.after_take(stream_with(HIGH - 1, *RUNNING)) == Decision(watch=False)
    assert policy.on_stall(stream_with(HIGH, *RUNNING)) == Decision(drop=True)
    assert policy.on_stall(stream_with(HIGH - 1, *RUNNING)) == KEEP


def test_no_policy_changes_the_stream_it_looks_at() -> None:
    for name in POLICIES:
        policy = make_policy(name, HIGH, 0.25)
        for states in (RUNNING, PAUSED):
            stream = stream_with(HIGH, *states)
            before = (stream.state, len(stream), dict(stream.timers), list(stream.record.states))
            policy.after_put(stream), policy.after_take(stream), policy.on_stall(stream)
            assert (stream.state, len(stream), dict(stream.timers), list(stream.record.states)) == before


def test_an_unknown_policy_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="lifo"):
        make_policy("lifo", HIGH, 0.25)
