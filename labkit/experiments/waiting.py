"""One way to wait for something to become true, for every experiment.

Experiments wait for servers to come up, for streams to be released, for a queue to fill. Each
wait is a poll with a bound: ask, and if the answer is not yet there, sleep a little and ask
again, until a deadline. Written once here, every wait has a bound, says what it waited for when
it gives up, and hands back the answer that ended it (a snapshot, a record), not just ``True``.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, overload

T = TypeVar("T")

__all__ = ["WaitTimeout", "wait_for", "await_for"]


class WaitTimeout(TimeoutError):
    """A bounded wait ran out; ``last`` is the last answer seen (falsy), for the error message."""

    def __init__(self, what: str, timeout: float, last: object) -> None:
        super().__init__(f"gave up after {timeout:g} s waiting for {what} (last answer: {last!r})")
        self.what, self.timeout, self.last = what, timeout, last


def wait_for(check: Callable[[], T], *, timeout: float, what: str, interval: float = 0.02) -> T:
    """Call ``check`` until it returns something truthy and return that; raise
    :class:`WaitTimeout` after ``timeout`` seconds. ``check`` runs at least once."""
    _check_bounds(timeout, interval)
    deadline = time.monotonic() + timeout
    while True:
        answer = check()
        if answer:
            return answer
        if time.monotonic() >= deadline:
            raise WaitTimeout(what, timeout, answer)
        time.sleep(min(interval, max(0.0, deadline - time.monotonic())))


@overload
async def await_for(check: Callable[[], Awaitable[T]], *, timeout: float, what: str, interval: float = ...) -> T: ...


@overload
async def await_for(check: Callable[[], T], *, timeout: float, what: str, interval: float = ...) -> T: ...


async def await_for(check: Callable[[], Any], *, timeout: float, what: str, interval: float = 0.02) -> Any:
    """:func:`wait_for` on an event loop: ``check`` may be a plain function or a coroutine
    function; the loop keeps running between polls."""
    _check_bounds(timeout, interval)
    deadline = time.monotonic() + timeout
    while True:
        answer = check()
        if asyncio.iscoroutine(answer) or isinstance(answer, asyncio.Future):
            try:  # the check itself is bounded too: a hung request must not stretch the wait
                answer = await asyncio.wait_for(answer, max(deadline - time.monotonic(), interval))
            except asyncio.TimeoutError:
                raise WaitTimeout(what, timeout, None) from None
        if answer:
            return answer
        if time.monotonic() >= deadline:
            raise WaitTimeout(what, timeout, answer)
        await asyncio.sleep(min(interval, max(0.0, deadline - time.monotonic())))


def _check_bounds(timeout: float, interval: float) -> None:
    if not (0 < timeout < math.inf) or not (0 < interval < math.inf):
        raise ValueError(f"timeout and interval must be finite and > 0, got {timeout!r} and {interval!r}")
