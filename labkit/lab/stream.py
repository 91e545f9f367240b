"""What the lab's client is told to do, and what it saw of one request.

One :class:`Stream` serves both dialects a target may speak: labkit's own events (``start``,
``token``, ``done``, ``error``, each with an id; token events carry token ids) and OpenAI's
unnamed chunks (``choices[0].text`` or ``.delta.content``, an optional usage chunk, ``data:
[DONE]``). Events are interpreted as they arrive, so a table reads ``tokens``, ``ttft`` or
``finish_reason`` the same way whichever server answered. Times are ``time.perf_counter()``
values: the engine stamps its records with the same clock, so a client's times and a labkit
server's compare directly.

Every read is bounded, because a target may be hostile: ``ReadOptions.timeout`` bounds the whole
request, ``max_bytes`` a stream's body, ``max_event_bytes`` one event's data and ``max_events`` the
events kept; going past a bound ends the read with an ``error`` naming it. An event is kept as the
text it came as and parsed when read, so what a stream holds is about the size of its wire bytes
(parsed JSON can be 30 times larger: a ``{}`` of 2 bytes is a 64-byte dict). A body that is not a
stream is parsed whole, so it is read within :attr:`Stream.body_cap`: far less for a refusal than
for the JSON asked for. Every stream alive keeps within one cap for them all (:data:`~labkit.lab.kept.KEPT`), so
many streams at their own caps do not add up to gigabytes (:mod:`labkit.lab.kept`). And an answer is read as the one asked
for: one choice a chunk (``n`` is 1), a token count that is a count within ``max_tokens``, nothing
after the stream's end; anything else is a ``stream_error``, never tokens.
"""

from __future__ import annotations

import json
import re
import sys
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import urlsplit

from labkit.lab import kept
from labkit.lab.kept import Kept
from labkit.sse import SSEParser

__all__ = ["API", "LeaveBy", "ReadOptions", "TimedEvent", "Stream", "EventSplitter", "json_or_text"]

API = Literal["labkit", "openai", "openai-chat"]
LeaveBy = Literal["fin", "rst"]
MiB = 1 << 20
BODY_END_GRACE_S = 2.0  # how long a body may go on after its stream's own end (a done event, [DONE])
JSON_CAP = 8 * MiB  # bytes of the JSON a GET asked for (a lab record, /metrics) the client reads at most
ANSWER_CAP = MiB  # bytes of a completion asked for whole (not streamed): a few tokens' worth of JSON
REFUSAL_CAP = 64 * 1024  # bytes of any other body (an error's envelope, JSON where a stream was asked)
ID_CAP, NAME_CAP = 256, 64  # characters of an event's id and name (labkit's ids are numbers; OpenAI sends none)
USAGE_CAP = 64 * 1024  # characters of an event that carries a usage (parsed, it is kept whole)
EVENT_COST = 160  # bytes an event costs beyond its strings: the objects that hold it and what it means


@dataclass(frozen=True)
class ReadOptions:
    """How to read: at once or paced, to the end or leaving early, and within what bounds.

    ``pace`` seconds are slept after every read (a slow reader). ``leave_after_tokens=0`` leaves
    once the head is in; ``leave_after_s`` counts from sending; the first of these, or
    ``timeout``, ends the read and the client leaves by ``leave_by``. After a FIN it reads on,
    uncounted, for at most ``drain_after_fin_s`` so the close stays a FIN (so a read can last
    that long past ``timeout``); after the stream's own end (a done event, ``[DONE]``) it waits
    :data:`BODY_END_GRACE_S` for the body's end, then closes and says so. The raw reader alone
    honours ``read_bytes`` (the most one read takes), ``read=False`` (never read a byte) and
    ``rcvbuf`` (``SO_RCVBUF`` before connecting, which stops Linux from growing it) and
    ``keep_wire`` (keep every byte received, head and chunked framing, in ``Stream.wire``: what
    ``curl --raw`` prints). ``gzip`` accepts a compressed answer, as a browser does, and reads it
    decoded (a proxy that compresses); the caps then count decoded bytes, so a bomb stays bounded.
    """

    pace: float = 0.0
    leave_after_tokens: int | None = None
    leave_after_s: float | None = None
    leave_by: LeaveBy = "fin"
    drain_after_fin_s: float = 2.0
    timeout: float = 300.0
    read_bytes: int = 64 * 1024
    read: bool = True
    rcvbuf: int | None = None
    keep_wire: bool = False
    max_bytes: int = 64 * MiB
    max_event_bytes: int = MiB
    max_events: int = 200_000
    gzip: bool = False

    def __post_init__(self) -> None:
        if self.leave_by not in ("fin", "rst"):
            raise ValueError(f"ReadOptions.leave_by must be 'fin' or 'rst', got {self.leave_by!r}")
        if self.pace < 0 or not 0 < self.timeout <= 24 * 3600 or self.read_bytes < 1:
            raise ValueError("ReadOptions: need pace >= 0, 0 < timeout <= 1 day and read_bytes >= 1")
        if min(self.max_bytes, self.max_event_bytes, self.max_events) < 1:
            raise ValueError("ReadOptions.max_bytes, max_event_bytes and max_events must be >= 1")
        if not self.read and self.leave_after_s is None:
            raise ValueError("ReadOptions: a client that never reads (read=False) needs leave_after_s")

    @property
    def bound_s(self) -> float:
        """Seconds from sending after which the read stops, whatever else happened."""
        return self.timeout if self.leave_after_s is None else min(self.timeout, self.leave_after_s)


@dataclass(frozen=True, slots=True)
class TimedEvent:
    """One event as it reached the client; ``nbytes`` counts the wire bytes since the previous
    complete event, so comments (pings, padding) are charged to the event that follows them.
    ``raw`` is its data field as sent; :attr:`data` parses it on every read."""

    time: float
    nbytes: int
    event: str
    id: str
    raw: str

    @property
    def data(self) -> dict[str, Any]:
        """The data as a JSON object; anything else as ``{"raw": ...}``."""
        try:
            value = json.loads(self.raw)
        except (ValueError, RecursionError):  # not JSON, or nested deeper than Python recurses
            return {"raw": self.raw[:200]}
        return value if isinstance(value, dict) else {"raw": value}


@dataclass
class Stream:
    """Everything a client saw of one request, and what it means in the target's dialect."""

    api: API = "labkit"
    sent: float = 0.0
    status: int = 0
    content_type: str = ""
    request_id: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    headers_at: float | None = None
    ended: float | None = None
    events: list[TimedEvent] = field(default_factory=list)
    total_bytes: int = 0
    reads: int = 0  # socket reads that returned bytes (httpx: chunks): total_bytes / reads per read
    unfinished_bytes: int = 0  # bytes after the last complete event: an event cut off
    last_event_id: str = ""
    left: LeaveBy | None = None
    left_at: float | None = None
    error: str | None = None  # a client-side failure or an HTTP refusal
    body: Any = None  # the body of a response that was not a stream (a refusal)
    wire: bytearray = field(default_factory=bytearray, repr=False)  # every byte received (keep_wire)
    socket: Any = field(default=None, repr=False, compare=False)  # the raw reader's socket while it is open
    # interpreted as the events arrive
    token_times: list[float] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    pieces: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    stream_error: str | None = None  # an error event or error chunk inside the stream
    completed: bool = False  # reached its own end: a done/error event, a finish reason, [DONE]
    max_tokens: int | None = None  # what the request asked for: a usage count above it is no count
    closed: bool = False  # a done/error event or [DONE]: no event may follow
    asked_stream: bool = True  # what the request asked for: a stream, or one JSON answer
    asked_get: bool = False  # a GET (a lab record, /metrics), not a completion
    _account: list[int] | None = field(default=None, init=False, repr=False, compare=False)  # charged to _kept
    _kept: Kept | None = field(default=None, init=False, repr=False, compare=False)  # KEPT when first charged

    def add(self, event: TimedEvent) -> None:
        """Interpret one event; a payload of the wrong shape ends nothing but is said in
        ``stream_error`` (a hostile or broken server must not crash the client)."""
        self.events.append(event)
        try:
            self._interpret(event, event.data)
        except (TypeError, ValueError, AttributeError, KeyError, ArithmeticError) as exc:
            self.stream_error = self.stream_error or f"malformed event {event.id or len(self.events)}: {exc}"[:200]

    def _interpret(self, event: TimedEvent, data: dict[str, Any]) -> None:
        if self.closed:
            raise ValueError("an event after the stream's end")
        if self.api == "labkit":
            if event.event == "token":
                token_id, piece = int(data.get("id", -1)), _text(data.get("text", ""))  # may raise: nothing kept then
                self._token(event.time)
                self.token_ids.append(token_id)
                self.pieces.append(piece)
            elif event.event == "done":
                self.finish_reason, self.usage = _reason(data.get("finish_reason")), _usage(event, data.get("usage"))
                self.completed = self.closed = True
            elif event.event == "error":
                err: dict[str, Any] = data["error"] if isinstance(data.get("error"), dict) else {}
                self.finish_reason, self.completed, self.closed = str(err.get("type", "error"))[:NAME_CAP], True, True
                self.stream_error = str(err.get("message", err))[:200]
            return
        if data.get("raw") == "[DONE]":
            self.completed = self.closed = True
            return
        if set(data) == {"raw"}:  # not a JSON object (or nested past what Python parses)
            raise ValueError(f"a chunk that is not a JSON object: {str(data['raw'])[:40]!r}")
        if isinstance(data.get("usage"), dict):
            self.usage = self._counted(_usage(event, data["usage"]))
        if isinstance(data.get("error"), dict):
            self.stream_error = str(data["error"].get("message", data["error"]))[:200]
        choices = data.get("choices") or []
        if not isinstance(choices, list) or len(choices) > 1:
            raise ValueError(f"{len(choices)} choices in one chunk, where one was asked for")
        for choice in choices:
            delta = choice.get("delta") or {}
            piece = _text(choice.get("text", delta.get("content")) or "")
            if not ("text" in choice or "content" in delta or choice.get("finish_reason") is not None):
                continue  # neither a token nor an end: a role, a tool call, an empty {}
            if self.finish_reason is not None:
                raise ValueError("a chunk after the finish reason")
            finish = _reason(choice.get("finish_reason"))
            if piece or (finish is None and "role" not in delta):  # the last text may come with the end
                self._token(event.time)
            if finish is not None:  # the answer is whole; [DONE] is optional
                self.finish_reason, self.completed = finish, True
            self.pieces.append(piece)

    def _token(self, at: float) -> None:
        """One more token, unless that makes more than the request asked for, or than usage said."""
        most = self.max_tokens if self.usage is None else self._usage_count(self.max_tokens)
        if most is not None and len(self.token_times) >= most:
            raise ValueError(f"more token chunks than the {most} tokens {'usage said' if self.usage else 'asked for'}")
        self.token_times.append(at)

    def _usage_count(self, default: int | None) -> int | None:
        n = (self.usage or {}).get("completion_tokens")
        return n if type(n) is int else default

    def _counted(self, usage: dict[str, Any]) -> dict[str, Any]:
        """``usage`` if its ``completion_tokens`` is a count (an int, not a bool, from the token
        chunks already read to the request's ``max_tokens``); a server's arithmetic must not become
        the lab's tokens/s."""
        n, least = usage.get("completion_tokens"), len(self.token_times)
        if n is not None and (type(n) is not int or n < 0 or (self.max_tokens is not None and n > self.max_tokens)):
            raise ValueError(f"usage.completion_tokens {str(n)[:40]} is not a count of at most {self.max_tokens}")
        if n is not None and n < least:
            raise ValueError(f"usage.completion_tokens {n} is fewer than the {least} token chunks read")
        return usage

    # -- fed by the client's readers: the head, each read, and when to stop ------------------------
    def note_head(self, status: int, headers: dict[str, str], now: float, gzip: bool = False) -> None:
        """The head as read; an encoding other than identity (or one gzip layer, where ``gzip``
        asked for it), or a Content-Type sent twice, is the error, said by name: the body is not read."""
        self.headers_at, self.status, self.headers = now, status, headers
        self.content_type = headers.get("content-type", "").lower()  # media types are case-insensitive
        self.request_id = headers.get("x-request-id")
        coding = headers.get("content-encoding", "").strip().lower()
        if coding not in ("", "identity") and not (gzip and coding == "gzip"):
            asked = "one layer of gzip" if gzip else "identity"
            self.error = f"an answer in Content-Encoding: {coding[:60]}, where the client asked for {asked}"
        elif "," in self.content_type.split(";")[0]:  # a field sent twice (joined): which one is the body?
            self.error = f"an answer with more than one Content-Type: {self.content_type[:80]}"
        if self.error is None and not self.keep(_size(headers)):  # httpx allows 100 KiB: thousands of fields
            self.headers = {}

    def take(self, splitter: EventSplitter, chunk: bytes, now: float, options: ReadOptions) -> bool:
        """Feed one read; False (with the error set) once a bound on the stream is passed."""
        self.total_bytes += len(chunk)
        if self.total_bytes > options.max_bytes:
            self.error = f"the stream passed the client's cap of {options.max_bytes:,} bytes"
            return False
        for event in splitter.feed(chunk, now):
            if len(self.events) >= options.max_events:
                self.error = f"the stream passed the client's cap of {options.max_events:,} events"
                return False
            if len(event.raw) > options.max_event_bytes // 4 and len(event.raw.encode()) > options.max_event_bytes:
                self.error = f"an event passed the client's cap of {options.max_event_bytes:,} bytes of data"
                return False
            if len(event.id) > ID_CAP or len(event.event) > NAME_CAP:
                self.error = f"an event's id or name passed the client's cap of {ID_CAP} or {NAME_CAP} characters"
                return False
            if not self.keep(EVENT_COST + sum(sys.getsizeof(x) for x in (event.raw, event.id, event.event))):
                return False
            pieces = len(self.pieces)
            self.add(event)
            if len(self.pieces) > pieces and not self.keep(sys.getsizeof(self.pieces[-1])):
                return False
        if splitter.pending > options.max_event_bytes:  # the parser holds an event that never ends
            self.error = f"an event passed the client's cap of {options.max_event_bytes:,} bytes of data"
            return False
        # after every read, not only at the end: a stream cut mid-way keeps the id to resume from
        self.unfinished_bytes, self.last_event_id = splitter.pending, splitter.parser.last_event_id
        return True

    def keep(self, n: int) -> bool:
        """Charge ``n`` more bytes kept to the one cap; False (with the error set) past it."""
        if self._account is None or self._kept is None:
            self._account, self._kept = [0], kept.KEPT
            weakref.finalize(self, self._kept.give_back, self._account)
        if self._kept.charge(self._account, n):
            return True
        self.error = f"the lab's streams passed the client's cap of {self._kept.cap:,} bytes kept in all"
        return False

    def take_body(self, body: bytearray, data: bytes) -> bool:
        """Add one read of a body that is not a stream to ``body``; False once reading stops.
        Past :attr:`body_cap` the answer asked for fails, and a refusal is kept to the cap (its
        head and first bytes say what it is) with the rest never read."""
        self.total_bytes += len(data)
        cap = self.body_cap
        if len(body) + len(data) <= cap:
            body += data
            return True
        if cap > REFUSAL_CAP:
            self.error = f"answer larger than the client's cap of {cap >> 20} MiB"
        else:
            body += data[: cap - len(body)]
        return False

    @property
    def body_cap(self) -> int:
        """The most bytes of a body that is not a stream the client reads: parsed, JSON can be 30
        times its size (8 MiB of ``[{},{},...]`` is about 240 MB, and a launch holds 32), so only
        the JSON a GET asked for gets :data:`JSON_CAP`, a completion asked for whole
        :data:`ANSWER_CAP`, and a refusal :data:`REFUSAL_CAP`."""
        if self.status != 200 or self.asked_stream:
            return REFUSAL_CAP
        return JSON_CAP if self.asked_get else ANSWER_CAP

    def body_end_by(self, options: ReadOptions) -> float:
        """When reading stops: the request's bound, or :data:`BODY_END_GRACE_S` after the stream's
        own end (a done or error event, ``[DONE]``) for a body that does not end with it."""
        ends = self.sent + options.bound_s
        return min(ends, self.events[-1].time + BODY_END_GRACE_S) if self.closed and self.events else ends

    def unended(self) -> None:
        self.error = f"the body did not end within {BODY_END_GRACE_S:g} s of the stream's end"
        self.ended = time.perf_counter()

    def should_leave(self, options: ReadOptions) -> bool:
        n = options.leave_after_tokens
        return n is not None and self.headers_at is not None and len(self.token_times) >= n and not self.completed

    def refusal(self) -> str | None:
        """An answer other than the one asked for, as one line: the status and the server's message."""
        streamed = self.content_type.startswith("text/event-stream")
        if self.status == 0 or (self.status == 200 and self.asked_stream == streamed):
            return None
        if 300 <= self.status < 400:
            where = urlsplit(self.headers.get("location", "")).netloc or "no Location"
            return f"HTTP {self.status} redirect to {where}"
        body = self.body
        inner = body.get("error", body) if isinstance(body, dict) else body
        message = inner.get("message") or inner.get("detail") or inner if isinstance(inner, dict) else inner
        text = " ".join(str(message or "").split())[:160] or "(empty body)"
        what = f"HTTP {self.status}" if self.status != 200 else f"answered {self.content_type or 'no content type'}"
        return f"{what}: {text}"

    # -- what a table reads ---------------------------------------------------------------------
    @property
    def tokens(self) -> int:
        """Tokens generated: labkit's token events; for OpenAI, usage when sent, else chunks."""
        counted = (self.usage or {}).get("completion_tokens") if self.api != "labkit" else None
        return counted if type(counted) is int else len(self.token_times)

    @property
    def chunks(self) -> int:
        return len(self.token_times)

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    @property
    def ttft(self) -> float | None:
        """Seconds from sending the request to the first token: what a user waits."""
        return self.token_times[0] - self.sent if self.token_times else None

    @property
    def gaps(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def duration(self) -> float | None:
        return None if self.ended is None else self.ended - self.sent

    @property
    def cut(self) -> bool:
        """Ended without its own end, and not because this client left or failed."""
        return self.status == 200 and not self.completed and self.left is None and self.error is None

    @property
    def ok(self) -> bool:
        """Answered 200 with a stream that reached its own end, with no error anywhere."""
        return self.error is None and self.stream_error is None and self.status == 200 and self.completed

    @property
    def failure(self) -> str | None:
        """What went wrong, in one short phrase; None for an ok stream or one this client left."""
        if self.error:
            return self.error
        if self.stream_error:
            return f"error in the stream: {self.stream_error}"
        if self.cut:
            return "the stream was cut off before its end"
        return None


class EventSplitter:
    """An :class:`SSEParser` that also charges each event its wire bytes and arrival time.

    Bytes go to the parser one line at a time, so the splitter knows the byte at which an event
    completed: that event is charged every byte since the previous one, and the counts do not
    depend on how the stream was cut into reads. (With CRLF line ends an event completes at the CR
    of its blank line; the LF after it is counted with the next event.)
    """

    def __init__(self) -> None:
        self.parser = SSEParser()
        self._pending = 0
        self._completed_at_cr = False
        self._only_that_lf = False

    def feed(self, chunk: bytes, now: float) -> list[TimedEvent]:
        events: list[TimedEvent] = []
        start = 0
        for match in _LINE_END.finditer(chunk):
            events += self._line(chunk[start : match.end()], now)
            start = match.end()
        if start < len(chunk):
            events += self._line(chunk[start:], now)
        return events

    def _line(self, piece: bytes, now: float) -> list[TimedEvent]:
        self._only_that_lf = self._completed_at_cr and self._pending == 0 and piece == b"\n"
        self._pending += len(piece)
        events = []
        for parsed in self.parser.feed(piece):
            events.append(TimedEvent(now, self._pending, parsed.event, parsed.id, parsed.data))
            self._pending = 0
        self._completed_at_cr = bool(events) and piece.endswith(b"\r")
        return events

    @property
    def pending(self) -> int:
        """Bytes since the last complete event; a CRLF blank line's trailing LF alone is not one."""
        return 0 if self._only_that_lf and self._pending == 1 else self._pending


_LINE_END = re.compile(rb"[\r\n]")


def _size(headers: dict[str, str]) -> int:
    return sys.getsizeof(headers) + sum(sys.getsizeof(k) + sys.getsizeof(v) for k, v in headers.items())


def _text(value: Any) -> str:
    """A token's text as sent: a string (anything else, made one, could be many times its size)."""
    if not isinstance(value, str):
        raise ValueError(f"a token's text that is not a string but {type(value).__name__}")
    return value


def _reason(value: Any) -> str | None:
    if value is not None and not (isinstance(value, str) and len(value) <= NAME_CAP):
        raise ValueError(f"a finish reason that is not a string of at most {NAME_CAP} characters")
    return value


def _usage(event: TimedEvent, value: Any) -> Any:
    """A usage as sent, if its event is small: it is kept parsed, whole (the wire contract compares it)."""
    if value is not None and len(event.raw) > USAGE_CAP:
        raise ValueError(f"a usage in an event of {len(event.raw):,} characters, past the client's {USAGE_CAP:,}")
    return value


def json_or_text(raw: bytes) -> Any:
    """A body as JSON if it parses, else as text (the client's caps bound its size)."""
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):  # not JSON (or not UTF-8), or nested too deep to parse
        return raw.decode("utf-8", "replace")
