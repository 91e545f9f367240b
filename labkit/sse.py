"""Server-sent events: the bytes on the wire, written and read back.

``text/event-stream`` is UTF-8 text cut into lines. A line is ``name: value``; the names that
mean something are ``data``, ``event``, ``id`` and ``retry``; a line that starts with ``:`` is a
comment (a heartbeat, to keep idle proxies from closing the connection); a blank line ends the
event and hands it to the client. Nothing here knows about models or tokens: the lab's event
schema sits on top, in :mod:`labkit.schema`.

Writing (:class:`ServerSentEvent`, :func:`sse_event`, :func:`sse_comment`). Choices made on
purpose, so that every route produces the same bytes:

* Lines end in LF only and every event ends with one blank line.
* Fields come out in a fixed order: comment lines, ``event``, ``id``, ``retry``, then ``data``
  lines. Data goes last so a reader of a raw capture sees the metadata first.
* Every field is written as ``name: value`` with one space. The parser strips exactly one
  leading space, so a value that itself starts with a space survives the round trip.
* Multi-line ``data`` (and ``comment``) becomes one line per line, split on CRLF, CR and LF,
  the three endings the parser honours. ``str.splitlines`` is not used: it also splits on
  U+2028, form feed and others that the parser keeps inside a line. Data read back therefore
  has its line endings normalised to LF.
* ``event`` or ``id`` containing CR or LF, and ``id`` containing NUL, are refused with
  ``ValueError``. sse-starlette silently strips newlines from these; refusing is the departure,
  because a stripped id is a different id and a caller resuming from it would be misled.
* An event with no field at all is refused (``ValueError``): its encoding would be a lone blank
  line, which every parser ignores, so writing one is always a caller's mistake.
* ``retry`` must be a non-negative ``int`` (``bool`` refused): the parser ignores anything that
  is not all ASCII digits, so a bad value would be dropped without a trace.

Reading (:class:`SSEParser`, :func:`parse`) follows the WHATWG HTML "event stream
interpretation" rules, incrementally, in time linear in the input. The parser keeps what a
browser's ``EventSource`` keeps between events: ``last_event_id`` and the reconnection time
``retry``. Details the rules leave to an implementation:

* Bytes are decoded with an incremental ``utf-8-sig`` decoder, ``errors="replace"``: it drops
  one byte order mark at the very start of the stream (even if split across chunks), turns
  invalid bytes into U+FFFD, and never corrupts a character split between two chunks.
* A CR at the end of one chunk ends the line at once; an LF at the start of the next decoded
  text is then swallowed, so CRLF split across chunks is one line end, not two.
* ``retry:`` with an empty value is ignored (it is not a number), and so is one of more than 18
  digits (past any delay; Python refuses to convert more than 4,300 digits at all).
* ``close()`` discards an unfinished event, as the end of a stream does in a browser, and the
  parser refuses further input.
"""

from __future__ import annotations

import codecs
import re
from dataclasses import dataclass

__all__ = ["ServerSentEvent", "sse_event", "sse_comment", "ParsedEvent", "SSEParser", "parse"]

_LINE_END = re.compile(r"\r\n|\r|\n")
MAX_RETRY_DIGITS = 18  # a longer retry: is ignored (over 31 million years in ms)


def _split_lines(text: str) -> list[str]:
    """Split on exactly the three line endings the event-stream grammar recognises."""
    return _LINE_END.split(text)


# --------------------------------------------------------------------------- writing


@dataclass(frozen=True)
class ServerSentEvent:
    """One event to send. Validation happens here so a bad event fails where it is built."""

    data: str | None = None
    event: str | None = None
    id: str | int | None = None
    retry: int | None = None
    comment: str | None = None

    def __post_init__(self) -> None:
        for name in ("data", "event", "comment"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise TypeError(f"{name} must be str or None, got {type(value).__name__}")
        if self.event is not None and _has_newline(self.event):
            raise ValueError(f"event must not contain CR or LF: {self.event!r}")
        self._check_id()
        self._check_retry()
        if all(getattr(self, n) is None for n in ("data", "event", "id", "retry", "comment")):
            raise ValueError("an event needs at least one field; a lone blank line sends nothing")

    def _check_id(self) -> None:
        if self.id is None:
            return
        if isinstance(self.id, bool) or not isinstance(self.id, (str, int)):
            raise TypeError(f"id must be str or int, got {type(self.id).__name__}")
        text = str(self.id)
        if _has_newline(text) or "\0" in text:
            raise ValueError(f"id must not contain CR, LF or NUL: {text!r}")

    def _check_retry(self) -> None:
        if self.retry is None:
            return
        if isinstance(self.retry, bool) or not isinstance(self.retry, int) or self.retry < 0:
            raise ValueError(f"retry must be a non-negative int (milliseconds): {self.retry!r}")

    def encode(self) -> bytes:
        """The event as UTF-8 bytes, LF line ends, terminated by a blank line."""
        lines: list[str] = []
        if self.comment is not None:
            lines += [f": {line}" for line in _split_lines(self.comment)]
        if self.event is not None:
            lines.append(f"event: {self.event}")
        if self.id is not None:
            lines.append(f"id: {self.id}")
        if self.retry is not None:
            lines.append(f"retry: {self.retry}")
        if self.data is not None:
            lines += [f"data: {line}" for line in _split_lines(self.data)]
        return ("\n".join(lines) + "\n\n").encode("utf-8")


def _has_newline(text: str) -> bool:
    return "\r" in text or "\n" in text


def sse_event(
    data: str | None = None,
    event: str | None = None,
    id: str | int | None = None,
    retry: int | None = None,
    comment: str | None = None,
) -> bytes:
    """Shorthand for ``ServerSentEvent(...).encode()``."""
    return ServerSentEvent(data=data, event=event, id=id, retry=retry, comment=comment).encode()


def sse_comment(text: str) -> bytes:
    """A comment-only event, e.g. ``sse_comment("ping") == b": ping\\n\\n"``: a heartbeat."""
    return ServerSentEvent(comment=text).encode()


# --------------------------------------------------------------------------- reading


@dataclass(frozen=True)
class ParsedEvent:
    """An event as a client receives it.

    ``id`` is the stream's last event id when the event was dispatched (an event without an
    ``id:`` line inherits the previous one, as ``MessageEvent.lastEventId`` does), and ``retry``
    is the parser's reconnection time at that moment.
    """

    event: str = "message"
    data: str = ""
    id: str = ""
    retry: int | None = None


class SSEParser:
    """Incremental WHATWG event-stream parser: feed bytes as they arrive, collect events.

    Work per chunk is proportional to the chunk: the unfinished line is kept as a list of
    pieces joined once when its end arrives, never re-scanned.
    """

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8-sig")(errors="replace")
        self._partial: list[str] = []  # pieces of the line not yet ended
        self._skip_lf = False  # the last line ended in CR; an LF next is part of it
        self._data: list[str] = []  # data buffer, one entry per data line
        self._event_type = ""
        self._id_buffer = ""  # the spec's "last event ID buffer"
        self._closed = False
        self.last_event_id: str = ""
        self.retry: int | None = None

    def feed(self, chunk: bytes) -> list[ParsedEvent]:
        """Consume ``chunk``; return the events it completed, in order."""
        if self._closed:
            raise RuntimeError("feed() after close()")
        return self._feed_text(self._decoder.decode(chunk))

    def close(self) -> list[ParsedEvent]:
        """End of stream: an event without its closing blank line is discarded."""
        self._decoder.decode(b"", final=True)  # anything left is an unended line: dropped
        self._partial.clear()
        self._data.clear()
        self._event_type = ""
        self._closed = True
        return []

    def _feed_text(self, text: str) -> list[ParsedEvent]:
        if not text:
            return []
        if self._skip_lf and text[0] == "\n":
            text = text[1:]
        events: list[ParsedEvent] = []
        start = 0
        for match in _LINE_END.finditer(text):
            self._partial.append(text[start : match.start()])
            line = "".join(self._partial)
            self._partial.clear()
            event = self._process_line(line)
            if event is not None:
                events.append(event)
            start = match.end()
        if start < len(text):
            self._partial.append(text[start:])
        self._skip_lf = text.endswith("\r")
        return events

    def _process_line(self, line: str) -> ParsedEvent | None:
        if line == "":
            return self._dispatch()
        if line.startswith(":"):
            return None
        name, colon, value = line.partition(":")
        if colon and value.startswith(" "):
            value = value[1:]
        self._process_field(name, value)
        return None

    def _process_field(self, name: str, value: str) -> None:
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event_type = value
        elif name == "id":
            if "\0" not in value:
                self._id_buffer = value
        elif name == "retry":
            if value.isascii() and value.isdigit() and len(value) <= MAX_RETRY_DIGITS:
                self.retry = int(value)
        # any other name is ignored, as the standard requires

    def _dispatch(self) -> ParsedEvent | None:
        self.last_event_id = self._id_buffer
        if not self._data:
            self._event_type = ""
            return None
        event = ParsedEvent(
            event=self._event_type or "message",
            data="\n".join(self._data),
            id=self.last_event_id,
            retry=self.retry,
        )
        self._data.clear()
        self._event_type = ""
        return event


def parse(data: bytes) -> list[ParsedEvent]:
    """Parse a complete stream in one go (``feed`` then ``close``)."""
    parser = SSEParser()
    return parser.feed(data) + parser.close()
