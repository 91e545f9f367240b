"""What a client is told to do, and what it saw of one request: its events, with arrival times
and wire bytes.

Shared by both clients (:func:`labkit.experiments.client.timed_stream` over httpx and
:func:`labkit.experiments.rawhttp.raw_stream` over a raw socket): both take a
:class:`ReadOptions` and fill a :class:`StreamResult`, so a table can mix them.
Times are ``time.perf_counter()`` values, the engine's clock.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from labkit.sse import SSEParser

__all__ = ["LeaveBy", "ReadOptions", "TimedEvent", "StreamResult", "EventSplitter", "json_or_text"]

LeaveBy = Literal["fin", "rst"]


# --------------------------------------------------------------------------- options


@dataclass(frozen=True)
class ReadOptions:
    """How a client reads, for both readers: at once or paced, to the end or leaving early.

    ``sleep`` seconds after every read (a slow reader). ``leave_after_tokens=0`` leaves as soon as
    the response's head arrives; ``leave_after_s`` counts from sending the request; the first of
    these (or ``timeout``) ends the read, and the client leaves by ``leave_by``. After a FIN it
    reads on, uncounted, for at most ``drain_after_fin_s`` until the server closes, so the close
    stays a FIN. ``timeout`` bounds the whole read, whatever happens; reaching it with nothing
    else planned is recorded as an error.

    The raw-socket reader alone also honours: ``read_bytes`` (the most one read takes off the
    socket), ``read=False`` (never read a byte; needs ``leave_after_s``) and ``rcvbuf``
    (``SO_RCVBUF`` set before connecting, which also stops Linux from growing it). httpx owns
    those for its reader.
    """

    sleep: float = 0.0
    leave_after_tokens: int | None = None
    leave_after_s: float | None = None
    leave_by: LeaveBy = "fin"
    drain_after_fin_s: float = 2.0
    timeout: float = 300.0
    read_bytes: int = 64 * 1024
    read: bool = True
    rcvbuf: int | None = None

    def __post_init__(self) -> None:
        if self.leave_by not in ("fin", "rst"):
            raise ValueError(f"ReadOptions.leave_by must be 'fin' or 'rst', got {self.leave_by!r}")
        if self.sleep < 0 or self.timeout <= 0 or self.read_bytes < 1:
            raise ValueError("ReadOptions: need sleep >= 0, timeout > 0 and read_bytes >= 1")
        if not self.read and self.leave_after_s is None:
            raise ValueError("ReadOptions: a client that never reads (read=False) needs leave_after_s")

    @property
    def bound_s(self) -> float:
        """Seconds from sending after which the read stops, whatever else happened."""
        return self.timeout if self.leave_after_s is None else min(self.timeout, self.leave_after_s)


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

    Bytes are fed to the parser one line at a time (a piece ends at each CR or LF), so the
    splitter knows the exact byte at which the parser completed an event: that event is charged
    every byte since the previous one up to and including that byte, and stamped with the
    arrival time of the read that brought it. The counts do not depend on how the stream was cut
    into reads: a blank line whose LF starts the next read, or a CRLF cut between two reads,
    charges the same bytes to the same event. (With CRLF line ends the parser completes an event
    at the CR of its blank line; the LF after it is counted with the next event.)
    """

    def __init__(self) -> None:
        self.parser = SSEParser()
        self._pending = 0
        self._completed_at_cr = False  # the last event completed at a CR: a lone LF may follow
        self._only_that_lf = False  # and everything pending since is that LF

    def feed(self, chunk: bytes, now: float) -> list[TimedEvent]:
        events: list[TimedEvent] = []
        start = 0
        for match in _LINE_END.finditer(chunk):
            events += self._line(chunk[start : match.end()], now)
            start = match.end()
        if start < len(chunk):
            events += self._line(chunk[start:], now)  # a line still open: never completes an event
        return events

    def _line(self, piece: bytes, now: float) -> list[TimedEvent]:
        self._only_that_lf = self._completed_at_cr and self._pending == 0 and piece == b"\n"
        self._pending += len(piece)
        events = []
        for parsed in self.parser.feed(piece):
            events.append(TimedEvent(now, self._pending, parsed.event, parsed.id, _payload(parsed.data)))
            self._pending = 0
        self._completed_at_cr = bool(events) and piece.endswith(b"\r")
        return events

    @property
    def pending(self) -> int:
        """Bytes received since the last complete event (an event still open, or comments); the
        LF of a CRLF blank line alone is not an open event, so a complete CRLF stream ends at 0."""
        return 0 if self._only_that_lf and self._pending == 1 else self._pending


_LINE_END = re.compile(rb"[\r\n]")


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
