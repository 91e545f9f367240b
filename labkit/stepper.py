"""The step thread: the only thread that calls ``engine.step()``.

It sleeps in ``engine.wait_for_work`` when there is nothing to do, holds no lock while the
model runs, and hands events to the event loop with ``loop.call_soon_threadsafe``. Under the
``naive`` policy (``waits_for_reader``) it hands events over one at a time and waits until each
is taken: the behaviour the chapter measured and that no real server should have.

First-token delivery: with ``first_token="prefill"`` a request's first token goes to the loop the
moment the engine reports it through ``on_event`` (right after that request's own prefill), and
everything else follows in one batch when the step returns, in the engine's order. With
``"step_end"`` all of a step's events go together when it returns.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any, Callable

from labkit.engine.events import Event, FinishEvent, TokenEvent

log = logging.getLogger("labkit.hub")

Deliver = Callable[[list[Event], int], None]  # events, and the number of the step that made them
DeliverWaiting = Callable[[Event, threading.Event, int], None]
OnError = Callable[[str], None]


class StepThread:
    def __init__(self, engine: Any, loop: asyncio.AbstractEventLoop, *, deliver: Deliver,
                 deliver_waiting: DeliverWaiting | None, on_error: OnError, first_token: str,
                 idle_wait: float) -> None:
        self.engine, self.loop = engine, loop
        self._deliver, self._deliver_waiting, self._on_error = deliver, deliver_waiting, on_error
        self._prefill_first = first_token == "prefill"
        self._idle_wait = idle_wait
        self._live: set[str] = set()  # submitted and not yet finished
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self.errors = 0
        self.steps = 0  # steps started; read from the loop to date a close against a release
        self._thread = threading.Thread(target=self._run, name="labkit-step", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def request_stop(self) -> None:
        self._stopping.set()

    def join(self, timeout: float) -> None:
        self._stopping.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise RuntimeError(f"the step thread did not stop within {timeout} s")

    def submit(self, prompt: Any, **kwargs: Any) -> str:
        """``engine.submit`` (raises its refusals), remembering the id to cancel at stop."""
        with self._lock:
            rid = self.engine.submit(prompt, **kwargs)
            self._live.add(rid)
            return rid

    # -- the thread -------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopping.is_set():
            if self.engine.wait_for_work(self._idle_wait):
                self._step()
        self._finish_live()

    def _finish_live(self, budget: float = 5.0) -> None:
        """On stop: cancel whatever is still live and step until the engine has released it."""
        with self._lock:
            live = list(self._live)
        for rid in live:
            self.engine.cancel(rid)
        deadline = time.monotonic() + budget
        while time.monotonic() < deadline and self.engine.wait_for_work(self._idle_wait):
            self._step()

    def _step(self) -> None:
        self.steps += 1
        handed: set[int] = set()

        def on_event(event: Event) -> None:
            if isinstance(event, TokenEvent) and event.index == 0:  # a first token: now
                handed.add(id(event))
                self._dispatch([event])

        try:
            events = self.engine.step(on_event if self._prefill_first else None)
        except Exception as exc:  # a broken step must not kill the thread silently
            log.exception("engine step failed")
            self.errors += 1
            self._post(self._on_error, f"engine step failed: {type(exc).__name__}: {exc}")
            time.sleep(self._idle_wait)
            return
        finished = [e.rid for e in events if isinstance(e, FinishEvent)]
        if finished:
            with self._lock:
                self._live.difference_update(finished)
        rest = [e for e in events if id(e) not in handed]
        if rest:
            self._dispatch(rest)

    def _dispatch(self, events: list[Event]) -> None:
        if self._deliver_waiting is None:
            self._post(self._deliver, events, self.steps)
            return
        for event in events:  # naive: hand over one event, then wait until it is taken
            ack = threading.Event()
            if not self._post(self._deliver_waiting, event, ack, self.steps):
                return
            while not ack.wait(0.05) and not self._stopping.is_set():
                pass

    def _post(self, callback: Callable[..., None], *args: Any) -> bool:
        try:
            self.loop.call_soon_threadsafe(callback, *args)
            return True
        except RuntimeError:  # the loop is closed: nobody is left to deliver to
            return False
