"""The step thread: the only thread that calls ``engine.step()`` (and ``check_integrity()``).

It sleeps in ``engine.wait_for_work`` when there is nothing to do, holds no lock while the
model runs, and hands events to the event loop through one channel, ``deliver(events, step,
ack)`` posted with ``loop.call_soon_threadsafe``. Under the ``naive`` policy
(``waits_for_reader``) it hands events over one at a time and waits on ``ack`` until each is
taken: the behaviour the chapter measured and that no real server should have.

First-token delivery: events are collected as the engine reports them through ``on_event``.
With ``first_token="prefill"`` a first token flushes what has been collected so far (it
included), so it reaches the loop right after its own prefill, in the engine's order; the rest
follows when the step returns. With ``"step_end"`` all of a step's events go together when it
returns. Every event goes through the channel exactly once.

Integrity checks: :meth:`check_integrity` queues a check and returns a Future; the thread runs
it between two steps (or while idle), so a check never races the step it checks.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from labkit.engine.events import Event, TokenEvent
from labkit.engine.threads import take_parallel_loops

log = logging.getLogger("labkit.hub")

Deliver = Callable[[list[Event], int, "threading.Event | None"], None]  # events, their step, naive's ack
OnError = Callable[[str], None]


class StepThread:
    def __init__(
        self,
        engine: Any,
        loop: asyncio.AbstractEventLoop,
        *,
        deliver: Deliver,
        waits_for_reader: bool,
        on_error: OnError,
        first_token: str,
        idle_wait: float,
        threads: int,
    ) -> None:
        self.engine, self.loop = engine, loop
        self._deliver, self._waits, self._on_error = deliver, waits_for_reader, on_error
        self._prefill_first = first_token == "prefill"
        self._idle_wait = idle_wait
        self.threads = threads  # the parallel loops' threads, all on this thread (labkit.engine.threads)
        self._checks: list[Future[None]] = []
        self._checks_lock = threading.Lock()
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

    def check_integrity(self) -> Future[None]:
        """A Future for ``engine.check_integrity()``, run on this thread between two steps."""
        future: Future[None] = Future()
        with self._checks_lock:
            self._checks.append(future)
        return future

    # -- the thread -------------------------------------------------------------------------
    def _run(self) -> None:
        take_parallel_loops(self.threads)
        while not self._stopping.is_set():
            if self.engine.wait_for_work(self._idle_wait):
                self._step()
            self._run_checks()
        self._finish(budget=5.0)

    def _finish(self, budget: float) -> None:
        """On stop: step until the engine has applied the hub's cancels and released everything."""
        deadline = time.monotonic() + budget
        while time.monotonic() < deadline and self.engine.wait_for_work(self._idle_wait):
            self._step()
        self._run_checks()

    def _run_checks(self) -> None:
        with self._checks_lock:
            checks, self._checks = self._checks, []
        for future in checks:
            if future.set_running_or_notify_cancel():
                run_check(self.engine, future)

    def _step(self) -> None:
        self.steps += 1
        pending: list[Event] = []

        def on_event(event: Event) -> None:
            pending.append(event)
            if self._prefill_first and isinstance(event, TokenEvent) and event.index == 0:
                self._flush(pending)

        try:
            self.engine.step(on_event)
        except Exception:  # a broken step must not kill the thread silently
            log.exception("engine step failed")
            self.errors += 1
            self._flush(pending)
            self._post(self._on_error, "the engine failed in a step; every open request was ended")
            time.sleep(self._idle_wait)
            return
        self._flush(pending)

    def _flush(self, pending: list[Event]) -> None:
        events = pending[:]
        pending.clear()
        if not events:
            return
        if not self._waits:
            self._post(self._deliver, events, self.steps, None)
            return
        for event in events:  # naive: hand over one event, then wait until it is taken
            ack = threading.Event()
            if not self._post(self._deliver, [event], self.steps, ack):
                return
            while not ack.wait(0.05) and not self._stopping.is_set():
                pass

    def _post(self, callback: Callable[..., None], *args: Any) -> bool:
        try:
            self.loop.call_soon_threadsafe(callback, *args)
            return True
        except RuntimeError:  # the loop is closed: nobody is left to deliver to
            return False


def run_check(engine: Any, future: Future[None]) -> None:
    """``engine.check_integrity()`` with its outcome in ``future`` (an AssertionError is the
    expected failure), on whichever thread may touch the engine now."""
    try:
        engine.check_integrity()
    except Exception as exc:
        future.set_exception(exc)
    else:
        future.set_result(None)
