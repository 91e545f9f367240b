"""One cap on what every stream the lab's client holds keeps, together, for the process.

A stream's own caps (:class:`~labkit.lab.stream.ReadOptions`) bound that stream; this bounds them
all, so many hostile streams at their own caps cannot add up to gigabytes.
"""

from __future__ import annotations

import threading

__all__ = ["Kept", "KEPT"]


class Kept:
    """What every stream the lab's client holds keeps, together, within one cap for the process.

    32 hostile streams, each at its own caps, held 1.4 to 2.6 GB (a review). So every string a
    stream keeps (an event's data, id and name, a token's text, the head's fields, a kept wire) is
    charged here at its size in memory, with :data:`~labkit.lab.stream.EVENT_COST` for the objects
    around an event; what is parsed and kept is bounded where it is read (a usage's event, a short
    finish reason). The charge is given back when the stream is collected, so the cap bounds what
    is alive at once, not what a long run reads. A legitimate trial keeps about a megabyte;
    ``peak`` is the most ever held.
    """

    def __init__(self, cap: int = 512 << 20) -> None:
        self.cap, self.peak, self._held = cap, 0, 0
        self._lock = threading.Lock()  # streams in several threads charge it
        # given back by finalizers, which may run inside charge() (a collection at any allocation):
        # list.append takes no lock, so a finalizer never waits on the lock its own thread holds
        self._returned: list[list[int]] = []

    @property
    def held(self) -> int:
        with self._lock:
            self._settle()
            return self._held

    def charge(self, account: list[int], n: int) -> bool:
        with self._lock:
            self._settle()
            if self._held + n > self.cap:
                return False
            self._held += n
            account[0] += n
            self.peak = self._held if self._held > self.peak else self.peak
            return True

    def give_back(self, account: list[int]) -> None:
        self._returned.append(account)

    def _settle(self) -> None:
        while self._returned:
            account = self._returned.pop()
            self._held -= account[0]
            account[0] = 0


KEPT = Kept()
