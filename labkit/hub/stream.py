"""One stream's side of the hub: its state, its queue, and the timestamps experiments read.

A stream's life is one :class:`StreamState` and the table :data:`TRANSITIONS` of the moves it may
make; :meth:`Stream.move` checks every move against the table and raises
:class:`IllegalTransition` for any other, so a bug that would leave a stream half-ended fails at
the move that caused it instead of later, somewhere else::

    queued --> running <--> paused
      |           |            |
      +-----------+------------+--> ending --> closed
      |           |            |                 ^
      +-----------+------------+-----------------+

* ``queued``: submitted to the engine, no token yet (waiting for a batch slot, or in prefill).
* ``running``: tokens are flowing.
* ``paused``: the engine was asked to hold the request for a slow reader; it keeps its slot.
* ``ending``: a terminal item (the engine's finish, or the hub's error) is in the queue; nothing
  more is accepted, and the engine request is finished or has been asked to cancel.
* ``closed``: :meth:`Hub.close` ran; terminal: no move leaves it.

Everything here is touched only on the event loop's thread. The step thread reaches a stream
only through ``loop.call_soon_threadsafe``, which is why no lock appears in this file.

All times are ``time.perf_counter()`` values, the engine's clock; on Linux it is the system-wide
monotonic clock, so a client in another process on the same machine can compare against it.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any

from labkit.engine.events import FinishEvent, TokenEvent


class StreamState(str, Enum):  # noqa: UP042 (a StrEnum formats and prints differently)
    QUEUED = "queued"
    RUNNING = "running"
    PAUSED = "paused"
    ENDING = "ending"
    CLOSED = "closed"

    @property
    def live(self) -> bool:
        """The engine request may still make tokens: a close must cancel it."""
        return self in (StreamState.QUEUED, StreamState.RUNNING, StreamState.PAUSED)


TRANSITIONS: dict[StreamState, frozenset[StreamState]] = {
    StreamState.QUEUED: frozenset({StreamState.RUNNING, StreamState.ENDING, StreamState.CLOSED}),
    StreamState.RUNNING: frozenset({StreamState.PAUSED, StreamState.ENDING, StreamState.CLOSED}),
    StreamState.PAUSED: frozenset({StreamState.RUNNING, StreamState.ENDING, StreamState.CLOSED}),
    StreamState.ENDING: frozenset({StreamState.CLOSED}),
    StreamState.CLOSED: frozenset(),
}


class IllegalTransition(RuntimeError):
    """A move that :data:`TRANSITIONS` does not allow: a bug in the hub, never a client's fault."""


@dataclass(frozen=True)
class StreamError:
    """A terminal item the hub puts in a stream's queue instead of the engine's finish."""

    type: str
    message: str


Item = TokenEvent | FinishEvent | StreamError


class StreamClosed(Exception):
    """The stream was closed while (or before) its reader waited: there is nothing more."""


@dataclass
class StreamRecord:
    """What happened to one stream, kept after it closes so experiments can read it."""

    rid: str
    prompt_tokens: int | None
    max_new_tokens: int
    submitted: float
    first_token_sampled: float | None = None  # the engine sampled token 0
    first_token_queued: float | None = None  # token 0 reached the stream's queue (loop thread)
    first_token_taken: float | None = None  # the writer took token 0 off the queue
    last_token_taken: float | None = None
    closed: float | None = None  # hub.close() ran
    released: float | None = None  # FinishEvent.time: the engine gave the blocks back
    finish_reason: str | None = None  # the engine's reason (length, eos, stop, cancelled)
    end: str | None = None  # what ended the client's stream (see Hub.close)
    tokens_generated: int = 0
    tokens_delivered: int = 0  # taken by the writer (what a client that reads everything gets)
    tokens_at_close: int | None = None  # generated when close() ran: the rest was wasted work
    steps_at_close: int | None = None  # engine steps started once close() had told the engine
    release_step: int | None = None  # the step whose events carried the release
    max_queue: int = 0
    pauses: int = 0
    states: list[str] = field(default_factory=lambda: [StreamState.QUEUED.value])  # every state visited
    moved: list[float] = field(default_factory=list)  # when each state after the first was entered

    def note_event(self, event: TokenEvent | FinishEvent, step: int) -> None:
        """Book an engine event made by step number ``step``, whether or not the stream is
        still open to receive it."""
        if isinstance(event, TokenEvent):
            self.tokens_generated += 1
            if event.index == 0:
                self.first_token_sampled = event.time
        else:
            self.released = event.time
            self.release_step = step
            self.finish_reason = event.reason
            self.prompt_tokens = event.usage.prompt_tokens

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class Stream:
    """A per-stream FIFO between the step thread's deliveries and one writer coroutine.

    Only the hub moves a stream (:meth:`move`); readers only :meth:`get`. ``on_take`` lets the
    hub apply its policy each time the writer takes an item.
    """

    def __init__(self, record: StreamRecord, on_take: Callable[[Stream, Item], None]) -> None:
        self.rid = record.rid
        self.record = record
        self._state = StreamState.QUEUED
        self._on_take = on_take
        self._items: deque[Item] = deque()
        self._ready = asyncio.Event()
        self.taken_terminal: str | None = None  # the end the reader saw, once it took it
        self.timers: dict[str, asyncio.TimerHandle] = {}  # the hub's timers, by what they watch
        self.ack: threading.Event | None = None  # naive policy: the step thread waits on it

    @property
    def state(self) -> StreamState:
        return self._state

    def move(self, to: StreamState) -> None:
        """Enter state ``to``; raise IllegalTransition if the table does not allow it."""
        if to not in TRANSITIONS[self._state]:
            raise IllegalTransition(f"stream {self.rid}: {self._state.value} -> {to.value} is not allowed")
        self._state = to
        self.record.states.append(to.value)
        self.record.moved.append(time.perf_counter())
        if to is StreamState.PAUSED:
            self.record.pauses += 1
        if to is StreamState.CLOSED:
            self._release_waiters()

    @property
    def accepting(self) -> bool:
        """Events from the engine still go into the queue (nothing terminal is there yet)."""
        return self._state.live

    def __len__(self) -> int:
        return len(self._items)

    def put(self, item: Item, now: float) -> None:
        self._items.append(item)
        if isinstance(item, TokenEvent) and item.index == 0:
            self.record.first_token_queued = now
        self.record.max_queue = max(self.record.max_queue, len(self._items))
        self._ready.set()

    async def get(self, timeout: float | None = None) -> Item | None:
        """The next item; ``None`` if ``timeout`` passes first; StreamClosed once closed and empty."""
        while not self._items:
            if self._state is StreamState.CLOSED:
                raise StreamClosed(self.rid)
            self._ready.clear()
            if timeout is None:
                await self._ready.wait()
                continue
            try:
                # asyncio.timeout, not wait_for: wait_for wraps the wait in a new Task on every
                # call, and a writer calls this once per token (about 10 us of loop time each).
                async with asyncio.timeout(timeout):
                    await self._ready.wait()
            except TimeoutError:
                return None
        item = self._items.popleft()
        self._on_take(self, item)
        return item

    def cancel_timer(self, name: str) -> None:
        timer = self.timers.pop(name, None)
        if timer is not None:
            timer.cancel()

    def _release_waiters(self) -> None:
        """Closed: let a blocked step thread go (naive policy), stop every timer, wake the reader."""
        if self.ack is not None:
            self.ack.set()
            self.ack = None
        for name in list(self.timers):
            self.cancel_timer(name)
        self._ready.set()
