"""One resumable stream's frames, kept in its own process: ids 1, 2, 3, ... in a bounded deque.

The pump appends; followers take :meth:`EventLog.waiter` before reading and wait on it, so an
event that lands between a read and the wait is never missed. The rest of the resume machinery
(the grace, the caps, the store) is :mod:`labkit.service.resume`'s.
"""

from __future__ import annotations

import asyncio
import secrets
from collections import deque

from labkit.service.frames import Frame


class EventLog:
    """The frames of one stream, ids 1, 2, 3, ...; at most ``capacity`` of the newest kept."""

    def __init__(self, rid: str, capacity: int, client: str) -> None:
        self.rid, self.client = rid, client
        self.token = secrets.token_urlsafe(24)  # only the creator is told; resuming requires it
        self._frames: deque[Frame] = deque(maxlen=capacity)
        self._changed = asyncio.Event()
        self.finished = False
        self.followers = 0
        self.timer: asyncio.TimerHandle | None = None
        self.pump: asyncio.Task[None] | None = None
        self.check: asyncio.Task[None] | None = None  # asking the store whether another server's follower reads it
        self.expired = False  # nobody came back in time: the run is cancelled and its stored copy deleted

    @property
    def last_id(self) -> int:
        return (self._frames[-1].id or 0) if self._frames else 0

    @property
    def first_id(self) -> int:
        return (self._frames[0].id or 1) if self._frames else 1

    def append(self, frame: Frame) -> None:
        self._frames.append(frame)
        self._notify()

    def finish(self) -> None:
        self.finished = True
        self._notify()

    def after(self, cursor: int) -> list[Frame]:
        return [f for f in self._frames if f.id is not None and f.id > cursor]

    def waiter(self) -> asyncio.Event:
        """The event the next change will set; take it before reading, then wait on it."""
        return self._changed

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()
