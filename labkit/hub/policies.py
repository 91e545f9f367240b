"""What the hub does when a reader falls behind: five answers to "who pays for a slow client?"

* ``naive``: the step loop waits for every reader, so everyone pays (the counter-example).
* ``unbounded``: memory pays; queues grow without limit, bounded only by the token budget.
* ``pause``: the slow request's own cache pays; it leaves the decode batch at the high-water
  mark and keeps its slot and blocks until its reader drains the queue to half the mark, or
  until the hub's ``max_pause`` runs out (see :class:`labkit.hub.HubConfig`).
* ``drop``: the slow request pays; behind by the high-water mark for longer than the stall
  timeout, it is cancelled and its reader gets an ``error`` of type ``slow_client``.
* ``pause_then_drop``: pause first; a stream still paused after the stall timeout is dropped.

A policy only looks: it reads a stream's state and queue length and returns a :class:`Decision`;
the hub carries it out (moves the stream, tells the engine, arms or disarms the stall timer).
Every method runs on the event loop's thread, after an item is put in or taken out of a queue,
or when the stall timer the policy asked for runs out.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from labkit.hub.stream import Stream, StreamState

POLICIES = ("naive", "unbounded", "pause", "drop", "pause_then_drop")


class Flow(Enum):
    PAUSE = "pause"
    RESUME = "resume"


@dataclass(frozen=True)
class Decision:
    """``flow``: pause or resume the request; ``watch``: True arms the stall timer (if it is not
    armed already), False disarms it; ``drop``: end the stream with a ``slow_client`` error."""

    flow: Flow | None = None
    watch: bool | None = None
    drop: bool = False


KEEP = Decision()


class Policy:
    """Base: never act (the ``unbounded`` policy)."""

    name = "unbounded"
    waits_for_reader = False  # True only for naive: the step thread blocks on each hand-over

    def __init__(self, high_water: int, stall_timeout: float) -> None:
        self.high_water = high_water
        self.stall_timeout = stall_timeout

    def after_put(self, stream: Stream) -> Decision:
        return KEEP

    def after_take(self, stream: Stream) -> Decision:
        return KEEP

    def on_stall(self, stream: Stream) -> Decision:
        """The stall timer this policy armed ran out."""
        return KEEP

    def stall_message(self) -> str:
        return (
            f"the client stayed {self.high_water} or more events behind for over "
            f"{self.stall_timeout:g} s; the request was cancelled"
        )


class Naive(Policy):
    name = "naive"
    waits_for_reader = True


class Pause(Policy):
    """Resume at half the mark, not at empty, so the reader does not wait for the next step."""

    name = "pause"

    def after_put(self, stream: Stream) -> Decision:
        if stream.state is StreamState.RUNNING and len(stream) >= self.high_water:
            return Decision(flow=Flow.PAUSE)
        return KEEP

    def after_take(self, stream: Stream) -> Decision:
        if stream.state is StreamState.PAUSED and len(stream) <= self.high_water // 2:
            return Decision(flow=Flow.RESUME)
        return KEEP


class Drop(Policy):
    """The stall timer starts when the queue reaches the mark; falling below it disarms it."""

    name = "drop"

    def after_put(self, stream: Stream) -> Decision:
        return Decision(watch=True) if len(stream) >= self.high_water else KEEP

    def after_take(self, stream: Stream) -> Decision:
        return Decision(watch=False) if len(stream) < self.high_water else KEEP

    def on_stall(self, stream: Stream) -> Decision:
        return Decision(drop=True) if len(stream) >= self.high_water else KEEP


class PauseThenDrop(Pause):
    """The stall timer runs while the stream is paused; a resume disarms it."""

    name = "pause_then_drop"

    def after_put(self, stream: Stream) -> Decision:
        decision = super().after_put(stream)
        return Decision(flow=Flow.PAUSE, watch=True) if decision.flow is Flow.PAUSE else KEEP

    def after_take(self, stream: Stream) -> Decision:
        decision = super().after_take(stream)
        return Decision(flow=Flow.RESUME, watch=False) if decision.flow is Flow.RESUME else KEEP

    def on_stall(self, stream: Stream) -> Decision:
        return Decision(drop=True) if stream.state is StreamState.PAUSED else KEEP


_BY_NAME: dict[str, type[Policy]] = {p.name: p for p in (Naive, Policy, Pause, Drop, PauseThenDrop)}


def make_policy(name: str, high_water: int, stall_timeout: float) -> Policy:
    if name not in _BY_NAME:
        raise ValueError(f"policy must be one of {POLICIES}, got {name!r}")
    return _BY_NAME[name](high_water, stall_timeout)
