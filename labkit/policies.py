"""What the hub does when a reader falls behind: five answers to "who pays for a slow client?"

* ``naive``: the step loop waits for every reader, so everyone pays (the counter-example).
* ``unbounded``: memory pays; queues grow without limit, bounded only by the token budget.
* ``pause``: the slow request's own cache pays; it leaves the decode batch at the high-water
  mark and keeps its slot and blocks until its reader drains the queue to half the mark.
* ``drop``: the slow request pays; behind by the high-water mark for longer than the stall
  timeout, it is cancelled and its reader gets an ``error`` of type ``slow_client``.
* ``pause_then_drop``: pause first; a stream still paused after the stall timeout is dropped.

A policy only decides; the hub carries out pause, resume and drop. Every method runs on the
event loop's thread, after an item is put in or taken out of a stream's queue.
"""
from __future__ import annotations

from typing import Callable, Protocol

from labkit.streams import Stream

POLICIES = ("naive", "unbounded", "pause", "drop", "pause_then_drop")


class Controls(Protocol):
    """The hub's side of a policy decision."""

    def pause(self, stream: Stream) -> None: ...

    def resume(self, stream: Stream) -> None: ...

    def drop(self, stream: Stream, type: str, message: str) -> None: ...

    def call_later(self, delay: float, callback: Callable[[], None]) -> object: ...


class Policy:
    """Base: do nothing (the ``unbounded`` policy)."""

    name = "unbounded"
    waits_for_reader = False  # True only for naive: the step thread blocks on each hand-over

    def __init__(self, high_water: int, stall_timeout: float) -> None:
        self.high_water = high_water
        self.stall_timeout = stall_timeout

    def after_put(self, stream: Stream, hub: Controls) -> None:
        pass

    def after_take(self, stream: Stream, hub: Controls) -> None:
        pass

    def _stall_message(self) -> str:
        return (f"the client stayed {self.high_water} or more events behind for over "
                f"{self.stall_timeout:g} s; the request was cancelled")


class Naive(Policy):
    name = "naive"
    waits_for_reader = True


class Unbounded(Policy):
    name = "unbounded"


class Pause(Policy):
    """Resume at half the mark, not at empty, so the reader does not wait for the next step."""

    name = "pause"

    def after_put(self, stream: Stream, hub: Controls) -> None:
        if not stream.paused and len(stream) >= self.high_water:
            hub.pause(stream)

    def after_take(self, stream: Stream, hub: Controls) -> None:
        if stream.paused and len(stream) <= self.high_water // 2:
            hub.resume(stream)


class Drop(Policy):
    """A timer starts when the queue reaches the mark; falling below it disarms the timer."""

    name = "drop"

    def after_put(self, stream: Stream, hub: Controls) -> None:
        if stream.timer is None and len(stream) >= self.high_water:
            stream.timer = hub.call_later(self.stall_timeout, lambda: self._expire(stream, hub))

    def after_take(self, stream: Stream, hub: Controls) -> None:
        if len(stream) < self.high_water:
            stream.cancel_timer()

    def _expire(self, stream: Stream, hub: Controls) -> None:
        stream.timer = None
        if not stream.ended and len(stream) >= self.high_water:
            hub.drop(stream, "slow_client", self._stall_message())


class PauseThenDrop(Pause):
    """The timer runs while the stream is paused; a resume disarms it."""

    name = "pause_then_drop"

    def after_put(self, stream: Stream, hub: Controls) -> None:
        super().after_put(stream, hub)
        if stream.paused and stream.timer is None:
            stream.timer = hub.call_later(self.stall_timeout, lambda: self._expire(stream, hub))

    def after_take(self, stream: Stream, hub: Controls) -> None:
        super().after_take(stream, hub)
        if not stream.paused:
            stream.cancel_timer()

    def _expire(self, stream: Stream, hub: Controls) -> None:
        stream.timer = None
        if not stream.ended and stream.paused:
            hub.drop(stream, "slow_client", self._stall_message())


_BY_NAME: dict[str, type[Policy]] = {p.name: p for p in (Naive, Unbounded, Pause, Drop, PauseThenDrop)}


def make_policy(name: str, high_water: int, stall_timeout: float) -> Policy:
    if name not in _BY_NAME:
        raise ValueError(f"policy must be one of {POLICIES}, got {name!r}")
    return _BY_NAME[name](high_water, stall_timeout)
