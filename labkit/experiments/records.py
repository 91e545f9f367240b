"""What a client saw of one request: its events, with arrival times and wire bytes.

Shared by both clients (:func:`labkit.experiments.client.timed_stream` over httpx and
:func:`labkit.experiments.rawhttp.raw_stream` over a raw socket), so a table can mix them.
Times are ``time.perf_counter()`` values, the engine's clock.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from labkit.sse import SSEParser

__all__ = ["LeaveBy", "TimedEvent", "StreamResult", "EventSplitter", "json_or_text"]

LeaveBy = Literal["fin", "rst"]


# --------------------------------------------------------------------------- records


@dataclass(frozen=True)
class TimedEvent:
    """One event as it reached the client.

    ``nbytes`` counts the wire bytes (of the SSE body) since the previous event was complete, so
    comments such as pings or padding are charged to the event that follows them.
    """

    time: float
    nbytes: int
    event: str
    id: str
    data: dict[str, Any]


@dataclass
class StreamResult:
    """Everything a client saw of one request. ``error`` is a client-side failure, if any."""

    sent: float
    status: int = 0
    content_type: str = ""
    request_id: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    headers_at: float | None = None
    ended: float | None = None
    events: list[TimedEvent] = field(default_factory=list)
    total_bytes: int = 0
    unfinished_bytes: int = 0  # bytes after the last complete event: an event cut off
    last_event_id: str = ""
    left: LeaveBy | None = None  # how the client left early, if it did
    left_at: float | None = None
    drained_bytes: int = 0  # raw bytes still read after leaving by FIN, until the server closed
    error: str | None = None
    body: Any = None  # the JSON body of a response that was not a stream (a refusal)

    @property
    def tokens(self) -> list[TimedEvent]:
        return [e for e in self.events if e.event == "token"]

    @property
    def token_ids(self) -> list[int]:
        return [e.data["id"] for e in self.tokens]

    @property
    def text(self) -> str:
        return "".join(e.data["text"] for e in self.tokens)

    @property
    def ttft(self) -> float | None:
        """Seconds from sending the request to the first token event: what a user waits."""
        tokens = self.tokens
        return tokens[0].time - self.sent if tokens else None

    @property
    def gaps(self) -> list[float]:
        """Seconds between consecutive token events as they arrived."""
        times = [e.time for e in self.tokens]
        return [b - a for a, b in zip(times, times[1:])]

    @property
    def duration(self) -> float | None:
        return None if self.ended is None else self.ended - self.sent

    @property
    def terminal(self) -> TimedEvent | None:
        """The closing ``done`` or ``error`` event; None for a stream that was cut or left."""
        last = self.events[-1] if self.events else None
        return last if last is not None and last.event in ("done", "error") else None

    @property
    def finish_reason(self) -> str | None:
        end = self.terminal
        if end is None:
            return None
        return end.data.get("finish_reason") if end.event == "done" else end.data["error"]["type"]

    @property
    def usage(self) -> dict[str, int] | None:
        end = self.terminal
        return end.data.get("usage") if end is not None and end.event == "done" else None


# --------------------------------------------------------------------------- parsing


class EventSplitter:
    """An :class:`SSEParser` that also charges each event its wire bytes and arrival time.

    A chunk is fed up to each blank line separately, so events that share a chunk still get
    their own byte counts; the byte count of an event is everything since the previous one.
    """

    def __init__(self) -> None:
        self.parser = SSEParser()
        self._pending = 0

    def feed(self, chunk: bytes, now: float) -> list[TimedEvent]:
        events: list[TimedEvent] = []
        start = 0
        while start < len(chunk):
            cut = chunk.find(b"\n\n", start)
            end = len(chunk) if cut < 0 else cut + 2
            self._pending += end - start
            for parsed in self.parser.feed(chunk[start:end]):
                events.append(TimedEvent(now, self._pending, parsed.event, parsed.id, _payload(parsed.data)))
                self._pending = 0
            start = end
        return events

    @property
    def pending(self) -> int:
        """Bytes received since the last complete event (an event still open, or comments)."""
        return self._pending


def _payload(data: str) -> dict[str, Any]:
    try:
        value = json.loads(data)
    except json.JSONDecodeError:
        return {"raw": data}
    return value if isinstance(value, dict) else {"raw": value}


def json_or_text(raw: bytes) -> Any:
    """A response body as JSON if it parses, else as text (a refusal should always be JSON)."""
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return raw.decode("utf-8", "replace")
