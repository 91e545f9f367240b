"""Where a resumable stream's log lives beyond its process: nowhere (``memory``), or Redis Streams.

A resumable run is always logged in its own process first (:class:`~labkit.service.event_log.EventLog`,
the copy its live followers read, with no round trip). A store is the second copy, for a client
that comes back to a server that does not hold the run: the same server after a restart, or
another one sharing the store. ``ServiceConfig.resume_store`` picks it:

* ``memory`` (:class:`MemoryStore`, the default): no second copy. A restarted server knows no
  stream and answers 404, as before.
* ``redis://host:port/db`` (:class:`~labkit.service.resume_redis.RedisStore`): each event is
  ``XADD``-ed to a Redis stream per request id *before* any client is sent it (write-ahead), so a
  client never holds an event id the store lacks, and a restarted server replays everything after
  the client's id with nothing lost or repeated, then follows the log live (``XREAD BLOCK``).

What a restart does to the run itself: the draining server ends every stream with an ``error``
event of type ``shutdown``, and that event is logged like any other, so a client that resumes on
the new server gets what it missed up to that event, and then the stream ends, clearly. The new
server does not continue the run: that would mean resubmitting the prompt plus the tokens
logged so far and re-deriving, at the cut, the detokenizer's pending bytes, the stop strings'
partial matches, the token indices and the usage counts, and it would hold only for greedy
decoding; a clear end the client can act on is the smaller promise, kept. A server that dies
without draining logs no last event; its *lease* (a key it refreshes while the run is alive)
expires, and the server the client came back to then ends the log with that ``shutdown`` error
itself (written only if no other event took its id first), so no resume waits forever.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Protocol

from labkit.errors import LabkitError
from labkit.schema import error_envelope
from labkit.service.frames import TERMINAL, Frame
from labkit.sse import ServerSentEvent

LOST_MESSAGE = "the server running this stream stopped before it ended"
GONE_MESSAGE = "this stream's log is gone before its end: cancelled, with no follower within the grace, or expired"


class StoreUnavailable(LabkitError):
    """The resume store did not answer (or refused a write); the message names the store, not the cause."""


@dataclass(frozen=True)
class StoredLog:
    """What a store holds of one stream: its first and last event ids and how its log ends."""

    rid: str
    first_id: int
    last_id: int
    ended: bool  # the last event is terminal (done or error)
    running: bool  # a server holds the run's lease: more events may come

    @property
    def finished(self) -> bool:  # the name check_cursor reads on a local log
        return self.ended


class ResumeStore(Protocol):
    """A second copy of every resumable log; every method may raise :class:`StoreUnavailable`."""

    refresh_s: float | None  # how often a live run must call :meth:`alive`; None: never
    readers: int  # followers of stored logs at once, over all of them (each may hold a connection)

    async def ping(self) -> None: ...

    async def create(self, rid: str, token: str) -> None: ...

    async def append(self, rid: str, frame: Frame) -> None: ...

    async def alive(self, rid: str) -> None: ...

    async def watched(self, rid: str) -> bool: ...  # a follower on any server reads it now

    async def release(self, rid: str) -> None: ...

    async def forget(self, rid: str) -> None: ...

    async def find(self, rid: str, token: str) -> StoredLog | None: ...

    def follow(self, log: StoredLog, cursor: int, keepalive: float) -> AsyncGenerator[Frame | None, None]: ...

    async def aclose(self) -> None: ...


class MemoryStore:
    """No second copy: a log lives and dies with its process (``resume_store = "memory"``)."""

    refresh_s: float | None = None
    readers = 0  # it keeps no log to follow

    async def ping(self) -> None:
        return None

    async def create(self, rid: str, token: str) -> None:
        return None

    async def append(self, rid: str, frame: Frame) -> None:
        return None

    async def alive(self, rid: str) -> None:
        return None

    async def watched(self, rid: str) -> bool:
        return False

    async def release(self, rid: str) -> None:
        return None

    async def forget(self, rid: str) -> None:
        return None

    async def find(self, rid: str, token: str) -> StoredLog | None:
        return None

    async def follow(self, log: StoredLog, cursor: int, keepalive: float) -> AsyncGenerator[Frame | None, None]:
        raise StoreUnavailable("the memory store keeps no log to follow")
        yield  # pragma: no cover - makes this an async generator

    async def aclose(self) -> None:
        return None


def open_store(url: str, *, capacity: int, ttl: float) -> ResumeStore:
    """The store ``ServiceConfig.resume_store`` names (nothing connects until it is first used)."""
    if url == "memory":
        return MemoryStore()
    from labkit.service.resume_redis import RedisStore

    return RedisStore(url, capacity=capacity, ttl=ttl)


def token_digest(token: str) -> str:
    """What a store keeps of a resume token: its SHA-256, so reading the store does not grant resumes."""
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


def same_digest(token: str, digest: str) -> bool:
    return hmac.compare_digest(token_digest(token).encode("ascii"), digest.encode("ascii", "replace"))


def lost_frame(event_id: int) -> Frame:
    """The ``shutdown`` error that ends a log whose server died without ending it."""
    payload = json.dumps(error_envelope("shutdown", LOST_MESSAGE), ensure_ascii=False, separators=(",", ":"))
    return Frame("error", ServerSentEvent(data=payload, event="error", id=event_id).encode(), event_id)


def gone_frame(event_id: int) -> Frame:
    """The ``cancelled`` error a reader ends with when the log vanished under it (not stored)."""
    payload = json.dumps(error_envelope("cancelled", GONE_MESSAGE), ensure_ascii=False, separators=(",", ":"))
    return Frame("error", ServerSentEvent(data=payload, event="error", id=event_id).encode(), event_id)


def is_terminal(kind: str) -> bool:
    return kind in TERMINAL
