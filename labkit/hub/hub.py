"""The hub: one step thread that owns the engine, and one queue per stream on the asyncio side.

The two sides meet in two places only: the engine's thread-safe inbox (submit, cancel, pause,
resume, all sent by :meth:`Hub._tell` from the loop) and one delivery channel from the step
thread (``loop.call_soon_threadsafe(hub._deliver, ...)``). No lock is held while the model runs,
and except under the ``naive`` policy the step thread never waits for a reader.

Every change of a stream's state goes through :meth:`Hub._move`, which checks it against the
table in :mod:`labkit.hub.stream` and sends the engine the command that goes with it
(running -> paused: pause; paused -> running: resume; a live stream ended by the hub: cancel).
Policies only return decisions (:mod:`labkit.hub.policies`); the hub carries them out. The hub's
``_streams`` is the one registry of live requests: a stream is in it from :meth:`open` until
:meth:`close`.

Every stream ends through :meth:`Hub.close`, from every exit path (finished, error, client gone,
shutdown). It is idempotent and never awaits, because a generator's ``finally`` may run inside
a cancelled task where any ``await`` raises again. It cancels the engine request if it is still
live; the engine releases the blocks at its next step boundary. Events that arrive afterwards
(the cancelled finish, tokens already in flight) are dropped and counted as ``late_events``.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

from labkit.engine.events import Event, FinishEvent, TokenEvent
from labkit.engine.scheduler import Verb
from labkit.engine.threads import leave_parallel_loops, take_parallel_loops
from labkit.errors import LabkitError
from labkit.hub.config import HubConfig
from labkit.hub.policies import Decision, Flow, make_policy
from labkit.hub.stepper import StepThread, run_check
from labkit.hub.stream import Item, Stream, StreamError, StreamRecord, StreamState


class Draining(LabkitError):
    """The hub is shutting down and admits nothing new (HTTP 503)."""


class Engine(Protocol):
    """What the hub needs of an engine (``BatchEngine``, or a fake in tests). ``submit``,
    ``cancel``, ``pause`` and ``resume`` are thread-safe; the rest run on the step thread."""

    def submit(
        self,
        prompt: str | Sequence[int],
        *,
        max_new_tokens: int = ...,
        stop: str | Sequence[str] = ...,
        temperature: float = ...,
        top_p: float = ...,
        seed: int | None = ...,
        ignore_eos: bool = ...,
        request_id: str | None = ...,
    ) -> str: ...

    def cancel(self, rid: str) -> None: ...

    def pause(self, rid: str) -> None: ...

    def resume(self, rid: str) -> None: ...

    def wait_for_work(self, timeout: float) -> bool: ...

    def step(self, on_event: Callable[[Event], None] | None = None) -> list[Event]: ...

    def check_integrity(self) -> None: ...


@dataclass(frozen=True)
class HubStats:
    """The hub's books at one moment (read on the loop thread)."""

    policy: str
    first_token: str
    open_streams: int
    queued_events: int  # events waiting in all open streams' queues
    paused_streams: int
    late_events: int  # engine events that arrived for a stream already ending or closed
    errors: int  # engine steps that raised
    draining: bool
    step_thread_alive: bool
    states: dict[str, int] = field(default_factory=dict)  # open streams by state
    dropped: dict[str, int] = field(default_factory=dict)  # streams the hub ended, by error type
    finishes: dict[str, int] = field(default_factory=dict)  # engine finishes seen, by reason
    ends: dict[str, int] = field(default_factory=dict)  # closed streams, by how they ended


class Observer(Protocol):
    """Hooks for metrics; called on the loop thread."""

    def first_token(self, seconds: float) -> None: ...

    def token_gap(self, seconds: float) -> None: ...


class Hub:
    """Streams on the loop side, the engine on the step thread's side, and a policy between.

    ``open``, ``close``, ``drain`` and ``stats`` run on the event loop's thread;
    ``start``/``stop``/``check_integrity`` may be called from anywhere.
    """

    def __init__(self, engine: Engine, config: HubConfig | None = None, observer: Observer | None = None) -> None:
        self.engine = engine
        self.config = config = config or HubConfig()
        self.policy = make_policy(config.policy, config.high_water, config.stall_timeout)
        self.observer = observer
        self.draining = False
        self._streams: dict[str, Stream] = {}  # the registry of live requests: open() until close()
        self._records: OrderedDict[str, StreamRecord] = OrderedDict()
        self._late = 0
        self._dropped: Counter[str] = Counter()
        self._finishes: Counter[str] = Counter()
        self._ends: Counter[str] = Counter()
        self._errors = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: StepThread | None = None

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        if self._thread is not None:
            raise RuntimeError("the hub is already running")
        self._loop = loop or asyncio.get_running_loop()
        self._thread = StepThread(
            self.engine,
            self._loop,
            threads=leave_parallel_loops(),  # the step thread is the process's one OpenMP team
            deliver=self._deliver,
            waits_for_reader=self.policy.waits_for_reader,
            on_error=self._fail_open,
            first_token=self.config.first_token,
            idle_wait=self.config.idle_wait,
        )
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Close what is open, let the step thread apply the cancels, and join it. Safe to repeat.

        Call it from the loop's thread, or once the loop no longer runs (:meth:`aclose` is the
        form for a running loop)."""
        for stream in list(self._streams.values()):
            self.close(stream, "shutdown")
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout)
            self._errors += thread.errors
            take_parallel_loops(thread.threads)  # the loops come back to the thread that started the hub

    async def aclose(self, timeout: float = 10.0) -> None:
        """:meth:`stop` from the loop, without blocking it (late deliveries still run)."""
        thread = self._thread
        if thread is None:
            return
        for stream in list(self._streams.values()):
            self.close(stream, "shutdown")
        thread.request_stop()
        deadline = time.monotonic() + timeout
        while thread.is_alive() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        self.stop(timeout=max(0.0, deadline - time.monotonic()))

    async def drain(self, grace: float) -> None:
        """Refuse new streams, end every open one with ``error: shutdown``, wait up to ``grace``."""
        self.draining = True
        for stream in list(self._streams.values()):
            self._drop(stream, "shutdown", "the server is shutting down")
        deadline = time.monotonic() + grace
        while self._streams and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        for stream in list(self._streams.values()):
            self.close(stream, "shutdown")

    def check_integrity(self) -> Future[None]:
        """Run ``engine.check_integrity()`` where it cannot race a step, and hand back the result.

        With the step thread running, the check runs on it between two steps (or while idle);
        otherwise nothing else steps the engine and it runs here. ``.result(timeout)`` raises the
        check's AssertionError; ``asyncio.wrap_future`` awaits it on a loop.
        """
        thread = self._thread
        if thread is not None and thread.is_alive():
            return thread.check_integrity()
        future: Future[None] = Future()
        run_check(self.engine, future)
        return future

    # -- streams (loop thread) -------------------------------------------------------------
    def open(
        self,
        prompt: str | Sequence[int],
        *,
        max_new_tokens: int = 64,
        stop: str | Sequence[str] = (),
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        ignore_eos: bool = False,
        request_id: str | None = None,
    ) -> Stream:
        """Submit a request and register its stream. Raises Draining or the engine's refusals."""
        if self.draining:
            raise Draining("the server is draining and accepts no new requests")
        if self._thread is None:
            raise RuntimeError("the hub is not running: call start() first")
        rid = request_id or f"req-{uuid.uuid4().hex[:16]}"
        prompt_tokens = None if isinstance(prompt, str) else len(prompt)
        stream = Stream(StreamRecord(rid, prompt_tokens, max_new_tokens, time.perf_counter()), self._taken)
        self._tell(
            "submit",
            stream,
            {
                "prompt": prompt,
                "max_new_tokens": max_new_tokens,
                "stop": stop,
                "temperature": temperature,
                "top_p": top_p,
                "seed": seed,
                "ignore_eos": ignore_eos,
            },
        )
        record = stream.record
        self._streams[rid] = stream
        self._remember(record)
        if self.config.queue_timeout is not None:
            self._arm(stream, "queue", self.config.queue_timeout, self._queue_expired)
        return stream

    def close(self, stream: Stream, why: str = "client_gone") -> None:
        """End ``stream`` for good. ``why`` names the end unless its reader took a terminal item."""
        if stream.state is StreamState.CLOSED:
            return
        record = stream.record
        record.closed = time.perf_counter()
        record.tokens_at_close = record.tokens_generated
        record.end = stream.taken_terminal or why
        self._ends[record.end] += 1
        self._streams.pop(stream.rid, None)
        self._move(stream, StreamState.CLOSED)
        # read once the cancel is in the engine's inbox: a step the loop thread spent waiting for the
        # GIL in between (a few of the tiny model's millisecond steps) is not the engine's delay
        record.steps_at_close = self._thread.steps if self._thread is not None else None

    # -- the one path for state changes and engine commands -----------------------------------
    def _move(self, stream: Stream, to: StreamState) -> None:
        """Move ``stream`` (checked) and tell the engine what the move means for its request."""
        before = stream.state
        stream.move(to)
        if to is StreamState.PAUSED:
            self._tell("pause", stream)
            if self.config.max_pause is not None:
                self._arm(stream, "pause", self.config.max_pause, self._pause_expired)
        elif before is StreamState.PAUSED:
            stream.cancel_timer("pause")
            if to is StreamState.RUNNING:
                self._tell("resume", stream)
        if before is StreamState.QUEUED:
            stream.cancel_timer("queue")
        if before.live and not to.live:
            stream.cancel_timer("stall")
            if stream.record.released is None:  # the engine still holds it: let it go
                self._tell("cancel", stream)

    def _tell(self, verb: Verb, stream: Stream, request: dict[str, Any] | None = None) -> None:
        """The one path to the engine's inbox: ``open`` submits, ``_move`` pauses, resumes, cancels.
        A submit raises the engine's refusals (the stream is then never registered)."""
        if verb == "submit":
            handle = self.engine.submit(request_id=stream.rid, **(request or {}))
            if isinstance(handle, str):  # the engine's RequestId: later wishes reach this request only
                stream.rid = handle
        else:
            getattr(self.engine, verb)(stream.rid)

    def _drop(self, stream: Stream, type: str, message: str) -> None:
        """Queue a terminal error after what the reader has not read, and cancel the request."""
        if not stream.accepting:
            return
        stream.put(StreamError(type, message), time.perf_counter())
        self._dropped[type] += 1
        self._move(stream, StreamState.ENDING)

    def _apply(self, stream: Stream, decision: Decision) -> None:
        """Carry out a policy's decision on a stream that is still live."""
        if not stream.accepting:
            return
        if decision.drop:
            self._drop(stream, "slow_client", self.policy.stall_message())
            return
        if decision.flow is Flow.PAUSE:
            self._move(stream, StreamState.PAUSED)
        elif decision.flow is Flow.RESUME:
            self._move(stream, StreamState.RUNNING)
        if decision.watch is True:
            self._arm(stream, "stall", self.config.stall_timeout, self._stalled)
        elif decision.watch is False:
            stream.cancel_timer("stall")

    # -- timers (loop thread) -----------------------------------------------------------------
    def _arm(self, stream: Stream, name: str, delay: float, expired: Callable[[Stream], None]) -> None:
        if name in stream.timers:
            return
        assert self._loop is not None
        stream.timers[name] = self._loop.call_later(delay, self._expire, stream, name, expired)

    def _expire(self, stream: Stream, name: str, expired: Callable[[Stream], None]) -> None:
        stream.timers.pop(name, None)
        expired(stream)

    def _stalled(self, stream: Stream) -> None:
        self._apply(stream, self.policy.on_stall(stream))

    def _pause_expired(self, stream: Stream) -> None:
        if stream.state is StreamState.PAUSED:
            self._drop(
                stream,
                "slow_client",
                f"the client read nothing for over {self.config.max_pause:g} s "
                "while its request was paused; the request was cancelled",
            )

    def _queue_expired(self, stream: Stream) -> None:
        if stream.state is StreamState.QUEUED:
            self._drop(
                stream,
                "queue_timeout",
                f"the request waited over {self.config.queue_timeout:g} s "
                "for its first token and was cancelled; try again later",
            )

    # -- reading state --------------------------------------------------------------------------
    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop the hub delivers to (set by :meth:`start`)."""
        return self._loop

    @property
    def open_streams(self) -> int:
        return len(self._streams)

    def streams(self) -> list[Stream]:
        return list(self._streams.values())

    def record(self, rid: str) -> StreamRecord | None:
        return self._records.get(rid)

    def records(self) -> list[StreamRecord]:
        return list(self._records.values())

    def stats(self) -> HubStats:
        streams = list(self._streams.values())
        thread = self._thread
        return HubStats(
            policy=self.config.policy,
            first_token=self.config.first_token,
            open_streams=len(streams),
            queued_events=sum(len(s) for s in streams),
            paused_streams=sum(1 for s in streams if s.state is StreamState.PAUSED),
            late_events=self._late,
            errors=self._errors + (thread.errors if thread else 0),
            draining=self.draining,
            step_thread_alive=thread is not None and thread.is_alive(),
            states=dict(Counter(s.state.value for s in streams)),
            dropped=dict(self._dropped),
            finishes=dict(self._finishes),
            ends=dict(self._ends),
        )

    # -- the loop's end of the delivery channel ---------------------------------------------------
    def _deliver(self, events: list[Event], step: int, ack: threading.Event | None) -> None:
        """Events from the step thread, in the engine's order. ``ack`` (naive only, one event):
        set once the event is taken, or at once if nobody is there to take it."""
        for event in events:
            stream = self._accept(event, step)
            if ack is not None:
                if stream is None:
                    ack.set()
                else:
                    stream.ack = ack

    def _accept(self, event: Event, step: int) -> Stream | None:
        """Book ``event`` and queue it on its stream; None if nobody is there to take it."""
        record = self._records.get(event.rid)
        if record is not None:
            record.note_event(event, step)
        if isinstance(event, FinishEvent):
            self._finishes[event.reason] += 1
        stream = self._streams.get(event.rid)
        if stream is None or not stream.accepting:
            self._late += 1
            return None
        if isinstance(event, FinishEvent) and event.reason == "error":
            # The engine ended this request alone (its row could not be sampled): its reader gets
            # an error, its neighbours carry on.
            stream.put(
                StreamError("internal_error", event.error or "the request failed in the engine"), time.perf_counter()
            )
        else:
            stream.put(event, time.perf_counter())
        if isinstance(event, FinishEvent):
            self._move(stream, StreamState.ENDING)
            return stream
        if stream.state is StreamState.QUEUED:
            self._move(stream, StreamState.RUNNING)
        self._apply(stream, self.policy.after_put(stream))
        return stream

    def _taken(self, stream: Stream, item: Item) -> None:
        now = time.perf_counter()
        if stream.ack is not None:
            stream.ack.set()
            stream.ack = None
        if isinstance(item, TokenEvent):
            self._note_token_taken(stream.record, now)
            self._apply(stream, self.policy.after_take(stream))
        else:
            stream.taken_terminal = item.reason if isinstance(item, FinishEvent) else item.type

    def _note_token_taken(self, record: StreamRecord, now: float) -> None:
        if record.first_token_taken is None:
            record.first_token_taken = now
            if self.observer is not None:
                self.observer.first_token(now - record.submitted)
        elif self.observer is not None and record.last_token_taken is not None:
            self.observer.token_gap(now - record.last_token_taken)
        record.last_token_taken = now
        record.tokens_delivered += 1

    def _fail_open(self, message: str) -> None:
        """The engine's step raised: end every open stream with an ``internal_error``."""
        for stream in list(self._streams.values()):
            self._drop(stream, "internal_error", message)

    def _remember(self, record: StreamRecord) -> None:
        self._records[record.rid] = record
        while len(self._records) > self.config.history:
            self._records.popitem(last=False)
