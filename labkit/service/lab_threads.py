"""Lab routes that show a sync generator exhausting the thread pool (mounted only with the lab routes).

The rest of the service is ``async def`` throughout (see :mod:`labkit.service.app`); these routes
break that rule on purpose, to measure what it costs:

* ``GET /lab/slow/sync?n=&interval=``: ``n`` events, a plain ``def`` generator that blocks in
  ``time.sleep(interval)`` before each event after the first (a slow sync source: a blocking
  client, a database cursor);
* ``GET /lab/slow/async?n=&interval=``: its twin, ``await asyncio.sleep(interval)`` instead;
* ``GET /lab/healthz/sync``: a ``def`` health route (``/healthz`` is the ``async def`` one);
* ``GET /lab/threads``: the default thread limiter's books (tokens in use, total, requests waiting).

Why a sync stream costs a thread (starlette 1.10, fastapi 0.165, anyio 4.16, read from
site-packages): ``StreamingResponse`` wraps a sync iterator in ``iterate_in_threadpool``, which
runs every ``next()`` through ``anyio.to_thread.run_sync``; a ``def`` route runs through
``run_in_threadpool``, the same call. Both take a token from AnyIO's default limiter,
``current_default_thread_limiter()``, a ``CapacityLimiter(40)`` per event loop. So a sync stream
holds one of 40 tokens for as long as each ``next()`` blocks, and with 40 of them blocked every
sync route and sync dependency of the app queues, health checks included, until one of them
returns an event (the limiter is first come, first served). A cancelled ``next()`` still waits
for its thread, so a client that leaves frees the token only when the sleep ends. The async twin
holds no thread: a socket and a coroutine. (The sync sleep looks up every 0.1 s to see whether
the server is draining, and then ends the stream: otherwise shutdown would wait for it, up to a
minute, past ``--drain-grace``.)
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import anyio.to_thread
from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse

from labkit.service.responses import SSE_HEADERS, SSE_MEDIA_TYPE
from labkit.sse import ServerSentEvent

router = APIRouter()
MAX_EVENTS = 10_000
MAX_INTERVAL_S = 60.0


def tick(index: int) -> bytes:
    return ServerSentEvent(event="tick", data=f'{{"index":{index}}}', id=index + 1).encode()


def sync_ticks(n: int, interval: float, draining: Callable[[], bool] = lambda: False) -> Iterator[bytes]:
    for index in range(n):
        if index:
            wake = time.monotonic() + interval
            while (left := wake - time.monotonic()) > 0 and not draining():
                time.sleep(min(left, 0.1))  # blocks the worker thread that runs this next()
            if draining():
                return
        yield tick(index)


async def async_ticks(n: int, interval: float) -> AsyncIterator[bytes]:
    for index in range(n):
        if index:
            await asyncio.sleep(interval)
        yield tick(index)


Count = Query(default=10, ge=1, le=MAX_EVENTS)
Interval = Query(default=1.0, ge=0, le=MAX_INTERVAL_S)


@router.get("/lab/slow/sync")
def slow_sync(request: Request, n: int = Count, interval: float = Interval) -> StreamingResponse:
    hub = request.app.state.service.hub
    return StreamingResponse(
        sync_ticks(n, interval, lambda: hub.draining), media_type=SSE_MEDIA_TYPE, headers=SSE_HEADERS
    )


@router.get("/lab/slow/async")
async def slow_async(n: int = Count, interval: float = Interval) -> StreamingResponse:
    return StreamingResponse(async_ticks(n, interval), media_type=SSE_MEDIA_TYPE, headers=SSE_HEADERS)


@router.get("/lab/healthz/sync")
def healthz_sync() -> dict[str, Any]:
    """Answered in a worker thread: it waits for a free token like any sync route."""
    return {"status": "ok", "thread": threading.current_thread().name}


@router.get("/lab/threads")
async def threads() -> dict[str, Any]:
    """The default limiter's books, read on the loop (this route needs no token)."""
    stats = anyio.to_thread.current_default_thread_limiter().statistics()
    return {
        "total_tokens": stats.total_tokens,
        "borrowed_tokens": stats.borrowed_tokens,
        "tasks_waiting": stats.tasks_waiting,
    }
