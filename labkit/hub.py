"""The hub: one step thread that owns the engine, and one queue per stream on the asyncio side.

The two sides meet in two places only: the engine's thread-safe inbox (submit, cancel, pause,
resume, called from the loop) and ``loop.call_soon_threadsafe`` (events, from the step thread).
No lock is held while the model runs, and except under the ``naive`` policy the step thread
never waits for a reader.

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
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

from labkit.engine.events import Event, FinishEvent, TokenEvent
from labkit.errors import LabkitError
from labkit.policies import POLICIES, make_policy
from labkit.stepper import StepThread
from labkit.streams import Item, Stream, StreamError, StreamRecord

DELIVERY_MODES = ("prefill", "step_end")


class Draining(LabkitError):
    """The hub is shutting down and admits nothing new (HTTP 503)."""


@dataclass(frozen=True)
class HubConfig:
    """``first_token="prefill"`` hands each first token to its stream as soon as its own prefill
    ends; ``"step_end"`` holds a step's events until the whole step returns (the older way,
    kept so the two can be measured against each other)."""

    policy: str = "pause_then_drop"
    high_water: int = 8
    stall_timeout: float = 0.25
    first_token: str = "prefill"
    idle_wait: float = 0.05  # how long the idle step thread sleeps between checks for a stop
    history: int = 10_000  # closed streams' records kept for experiments

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"HubConfig.policy must be one of {POLICIES}, got {self.policy!r}")
        if self.first_token not in DELIVERY_MODES:
            raise ValueError(f"HubConfig.first_token must be one of {DELIVERY_MODES}, got {self.first_token!r}")
        if not isinstance(self.high_water, int) or isinstance(self.high_water, bool) or self.high_water < 1:
            raise ValueError(f"HubConfig.high_water must be an int >= 1, got {self.high_water!r}")
        for name in ("stall_timeout", "idle_wait"):
            if not isinstance(getattr(self, name), (int, float)) or getattr(self, name) <= 0:
                raise ValueError(f"HubConfig.{name} must be a number > 0, got {getattr(self, name)!r}")
        if not isinstance(self.history, int) or self.history < 0:
            raise ValueError(f"HubConfig.history must be an int >= 0, got {self.history!r}")


class Observer(Protocol):
    """Hooks for metrics; called on the loop thread."""

    def first_token(self, seconds: float) -> None: ...

    def token_gap(self, seconds: float) -> None: ...


class Hub:
    """Streams on the loop side, the engine on the step thread's side, and a policy between.

    ``open``, ``close``, ``drain`` and the policy controls run on the event loop's thread;
    ``start``/``stop`` may be called from anywhere.
    """

    def __init__(self, engine: Any, config: HubConfig | None = None, observer: Observer | None = None) -> None:
        self.engine = engine
        self.config = config = config or HubConfig()
        self.policy = make_policy(config.policy, config.high_water, config.stall_timeout)
        self.observer = observer
        self.draining = False
        self._streams: dict[str, Stream] = {}
        self._records: OrderedDict[str, StreamRecord] = OrderedDict()
        self._counts: Counter[str] = Counter()
        self._finishes: Counter[str] = Counter()
        self._ends: Counter[str] = Counter()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: StepThread | None = None

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        if self._thread is not None:
            raise RuntimeError("the hub is already running")
        self._loop = loop or asyncio.get_running_loop()
        waiting = self._deliver_waiting if self.policy.waits_for_reader else None
        self._thread = StepThread(self.engine, self._loop, deliver=self._deliver, deliver_waiting=waiting,
                                  on_error=self._fail_open, first_token=self.config.first_token,
                                  idle_wait=self.config.idle_wait)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel what is live, let the step thread apply it, and join it. Safe to repeat."""
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout)
            self._counts["errors"] += thread.errors

    async def aclose(self, timeout: float = 10.0) -> None:
        """:meth:`stop` from the loop, without blocking it (late deliveries still run)."""
        thread = self._thread
        if thread is None:
            return
        thread.request_stop()
        deadline = time.monotonic() + timeout
        while thread.is_alive() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        self.stop(timeout=max(0.0, deadline - time.monotonic()))

    async def drain(self, grace: float) -> None:
        """Refuse new streams, end every open one with ``error: shutdown``, wait up to ``grace``."""
        self.draining = True
        for stream in list(self._streams.values()):
            if not stream.ended:
                self.drop(stream, "shutdown", "the server is shutting down")
        deadline = time.monotonic() + grace
        while self._streams and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        for stream in list(self._streams.values()):
            self.close(stream, "shutdown")

    # -- streams (loop thread) -------------------------------------------------------------
    def open(self, prompt: str | Sequence[int], *, max_new_tokens: int = 64, stop: str | Sequence[str] = (),
             temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None,
             ignore_eos: bool = False, request_id: str | None = None) -> Stream:
        """Submit a request and register its stream. Raises Draining or the engine's errors."""
        if self.draining:
            raise Draining("the server is draining and accepts no new requests")
        rid = request_id or f"req-{uuid.uuid4().hex[:16]}"
        if self._thread is None:
            raise RuntimeError("the hub is not running: call start() first")
        submitted = time.perf_counter()
        self._thread.submit(prompt, max_new_tokens=max_new_tokens, stop=stop, temperature=temperature,
                            top_p=top_p, seed=seed, ignore_eos=ignore_eos, request_id=rid)
        prompt_tokens = None if isinstance(prompt, str) else len(prompt)
        record = StreamRecord(rid, prompt_tokens, max_new_tokens, submitted)
        stream = Stream(record, self._taken)
        self._streams[rid] = stream
        self._remember(record)
        return stream

    def close(self, stream: Stream, why: str = "client_gone") -> None:
        """End ``stream`` for good. ``why`` names the end unless its reader took a terminal item."""
        if stream.closed:
            return
        stream.closed = True
        record = stream.record
        record.closed = time.perf_counter()
        record.tokens_at_close = record.tokens_generated
        record.steps_at_close = self._thread.steps if self._thread is not None else None
        record.end = stream.taken_terminal or why
        self._ends[record.end] += 1
        self._streams.pop(stream.rid, None)
        if not stream.finished:
            self.engine.cancel(stream.rid)
        stream.release_waiters()
        stream.wake()

    # -- what a policy may do (loop thread) ---------------------------------------------------
    def pause(self, stream: Stream) -> None:
        self.engine.pause(stream.rid)
        stream.paused = True
        stream.record.pauses += 1

    def resume(self, stream: Stream) -> None:
        self.engine.resume(stream.rid)
        stream.paused = False

    def drop(self, stream: Stream, type: str, message: str) -> None:
        """Cancel in the engine and queue a terminal error after what the reader has not read."""
        if stream.ended:
            return
        self.engine.cancel(stream.rid)
        stream.paused = False
        stream.cancel_timer()
        stream.ended = True
        stream.put(StreamError(type, message), time.perf_counter())
        self._counts[f"dropped_{type}"] += 1

    def call_later(self, delay: float, callback: Callable[[], None]) -> asyncio.TimerHandle:
        assert self._loop is not None
        return self._loop.call_later(delay, callback)

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

    def stats(self) -> dict[str, Any]:
        streams = list(self._streams.values())
        return {
            "policy": self.config.policy,
            "first_token": self.config.first_token,
            "open_streams": len(streams),
            "queued_events": sum(len(s) for s in streams),
            "paused_streams": sum(1 for s in streams if s.paused),
            "late_events": self._counts["late_events"],
            "errors": self._counts["errors"] + (self._thread.errors if self._thread else 0),
            "dropped_slow_client": self._counts["dropped_slow_client"],
            "finishes": dict(self._finishes),
            "ends": dict(self._ends),
            "draining": self.draining,
            "step_thread_alive": self._thread is not None and self._thread.is_alive(),
        }

    # -- loop side of delivery ------------------------------------------------------------------
    def _accept(self, event: Event, step: int) -> Stream | None:
        """Book ``event`` and queue it on its stream; None if nobody is there to take it."""
        record = self._records.get(event.rid)
        if record is not None:
            record.note_event(event, step)
        if isinstance(event, FinishEvent):
            self._finishes[event.reason] += 1
        stream = self._streams.get(event.rid)
        if stream is None or stream.ended:
            self._counts["late_events"] += 1
            return None
        stream.put(event, time.perf_counter())
        if isinstance(event, FinishEvent):
            stream.finished = stream.ended = True
            stream.cancel_timer()
        else:
            self.policy.after_put(stream, self)
        return stream

    def _deliver(self, events: list[Event], step: int) -> None:
        for event in events:
            self._accept(event, step)

    def _deliver_waiting(self, event: Event, ack: threading.Event, step: int) -> None:
        stream = self._accept(event, step)
        if stream is None:
            ack.set()
        else:
            stream.ack = ack

    def _taken(self, stream: Stream, item: Item) -> None:
        now = time.perf_counter()
        if stream.ack is not None:
            stream.ack.set()
            stream.ack = None
        if isinstance(item, TokenEvent):
            self._note_token_taken(stream.record, now)
            self.policy.after_take(stream, self)
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
            self.drop(stream, "internal_error", message)

    def _remember(self, record: StreamRecord) -> None:
        self._records[record.rid] = record
        while len(self._records) > self.config.history:
            self._records.popitem(last=False)
