"""The wire, visible: one stream's raw bytes as ``curl --raw`` shows them, and the article's
awkward cases read by our parser and by httpx-sse side by side.

Raw bytes: :func:`capture_raw` sends one request over a plain socket and keeps every byte of the
answer, the HTTP head and the chunked body (chunk sizes in hex, CRLFs, the SSE frames inside);
:func:`escaped` prints them with ``\\r`` and ``\\n`` made visible; :func:`chunk_table` takes the
chunked framing apart.

Awkward cases: each :class:`Case` holds bytes cut into reads (as a socket might deliver them),
the WHATWG rule it exercises and the events that rule says a client dispatches. Both parsers are
fed read by read and every event is tagged with the read after which it came out, so a parser that
holds an event back shows it. :func:`compare` computes, per case, whether each parser followed
the rule and where the two differ; nothing in the table is typed in but the rules themselves.

httpx-sse is driven through its own decoders (``httpx_sse._decoders``: the line decoder and the
event decoder its ``EventSource`` uses), one read at a time, so the read an event comes out at is
its own; tests/test_wire_awkward.py checks that this gives the same events as a real httpx response.
"""

from __future__ import annotations

import codecs
import re
import socket
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import pandas as pd

from labkit.sse import SSEParser

Ev = tuple[str, str, str, int | None]  # (event, data, id, retry), as a client receives it
END = "end"  # an event that came out only when the stream ended


@dataclass(frozen=True)
class Case:
    name: str
    reads: tuple[bytes, ...]
    rule: str  # the WHATWG rule, in a few words
    expected: tuple[Ev, ...]  # what the rule says a client dispatches


def _m(data: str, id: str = "", event: str = "message", retry: int | None = None) -> Ev:
    return (event, data, id, retry)


CASES: tuple[Case, ...] = (
    Case("CRLF line ends", (b"data: a\r\n\r\ndata: b\r\n\r\n",), "CRLF, CR and LF each end a line", (_m("a"), _m("b"))),
    Case("CR-only line ends", (b"data: a\r\r", b"data: b\r\r"), "a lone CR ends a line", (_m("a"), _m("b"))),
    Case("comments", (b": ping\n\n: another\ndata: x\n\n",), "a line starting with ':' is ignored", (_m("x"),)),
    Case(
        "multi-line data",
        (b"data: line one\ndata: line two\n\n",),
        "data lines join with LF",
        (_m("line one\nline two"),),
    ),
    Case("BOM at the start", ("\ufeffdata: x\n\n".encode(),), "one leading U+FEFF is dropped", (_m("x"),)),
    Case(
        "field with no colon",
        (b"data\n\ndata: y\n\n",),
        "a line without ':' is a field with an empty value",
        (_m(""), _m("y")),
    ),
    Case(
        "blank line inside a payload",
        (b'data: {"text": "a\n\nb"}\n\n',),
        "a blank line ends the event wherever it falls; the rest is a line of its own (a field named 'b\"}', ignored)",
        (_m('{"text": "a'),),
    ),
    Case(
        "id with a NUL",
        (b"id: 1\ndata: a\n\nid: 2\x00x\ndata: b\n\n",),
        "an id containing NUL is ignored",
        (_m("a", "1"), _m("b", "1")),
    ),
    Case(
        "retry not a number",
        (b"retry: soon\ndata: a\n\nretry: 1500\ndata: b\n\n",),
        "retry takes ASCII digits only",
        (_m("a"), _m("b", retry=1500)),
    ),
    Case(
        "blank line split across reads",
        (b"data: a\n", b"\ndata: b\r\n\r", b"\n"),
        "an event ends at its blank line, whichever read brings it",
        (_m("a"), _m("b")),
    ),
)


# -- the parsers, read by read -------------------------------------------------------------------
def ours(reads: tuple[bytes, ...]) -> list[tuple[Ev, int | str]]:
    """Our :class:`SSEParser`: ``(event, read index it came out after)``; ``END`` at close."""
    parser = SSEParser()
    out: list[tuple[Ev, int | str]] = []
    for i, chunk in enumerate(reads):
        out += [(_tuple(e), i) for e in parser.feed(chunk)]
    out += [(_tuple(e), END) for e in parser.close()]
    return out


def httpx_sse(reads: tuple[bytes, ...]) -> list[tuple[Ev, int | str]]:
    """httpx-sse's decoders fed the same reads (text decoded as httpx does, UTF-8, replacing)."""
    from httpx_sse._decoders import SSEDecoder, SSELineDecoder

    text, lines, events = codecs.getincrementaldecoder("utf-8")(errors="replace"), SSELineDecoder(), SSEDecoder()
    out: list[tuple[Ev, int | str]] = []

    def take(found: list[str], at: int | str) -> None:
        for line in found:
            sse = events.decode(line)
            if sse is not None:
                out.append(((sse.event, sse.data, sse.id, sse.retry), at))

    for i, chunk in enumerate(reads):
        take(lines.decode(text.decode(chunk)) if chunk else [], i)
    take(lines.flush(), END)
    return out


def _tuple(e: Any) -> Ev:
    return (e.event, e.data, e.id, e.retry)


# -- the comparison ------------------------------------------------------------------------------
def _events(found: list[tuple[Ev, int | str]]) -> list[Ev]:
    return [e for e, _ in found]


def comparable(events: list[Ev]) -> list[Ev]:
    """Events as both parsers can report them: httpx-sse gives ``retry`` only on the event whose
    block set it (ours keeps it, as the reconnection time), and dispatches empty ``message``
    events for blocks with no data once an id is set; neither is a difference in the events."""
    return [(e, d, i, None) for e, d, i, _ in events]


def show(found: list[tuple[Ev, int | str]]) -> str:
    """``event "data" id=.. retry=.. @read`` per event, ``; `` between; ``(none)`` if empty."""
    parts = []
    for (event, data, id_, retry), at in found:
        text = f"{event} {data!r}" + (f" id={id_!r}" if id_ else "") + (f" retry={retry}" if retry is not None else "")
        parts.append(f"{text} @{at}")
    return "; ".join(parts) or "(none)"


def difference(a: list[tuple[Ev, int | str]], b: list[tuple[Ev, int | str]]) -> str:
    """Where two parsers' results differ: the count, the first differing event, or the read."""
    ea, eb = _events(a), _events(b)
    if len(ea) != len(eb):
        return f"ours {len(ea)} events, httpx-sse {len(eb)}"
    for k, (x, y) in enumerate(zip(ea, eb)):
        fields = [n for n, u, v in zip(("event", "data", "id", "retry"), x, y) if u != v]
        if fields:
            return f"event {k + 1}: " + ", ".join(
                f"{n} {u!r} vs {v!r}" for n, u, v in zip(("event", "data", "id", "retry"), x, y) if n in fields
            )
    for k, ((_, ra), (_, rb)) in enumerate(zip(a, b)):
        if ra != rb:
            return f"event {k + 1} comes out after read {ra} (ours) vs {rb} (httpx-sse)"
    return ""


def compare(cases: tuple[Case, ...] = CASES) -> pd.DataFrame:
    """One row per case: the reads, the rule, each parser's events (``@`` the read they came out
    after), whether each followed the rule, and where and why they differ."""
    rows = []
    for case in cases:
        a, b = ours(case.reads), httpx_sse(case.reads)
        ours_ok = _events(a) == list(case.expected)
        theirs_ok = comparable(_events(b)) == comparable(list(case.expected))
        diff = difference(a, b)
        rows.append(
            {
                "case": case.name,
                "reads": " | ".join(escaped(r) for r in case.reads),
                "rule": case.rule,
                "ours": show(a),
                "httpx-sse": show(b),
                "ours follows the rule": ours_ok,
                "httpx-sse follows the rule": theirs_ok,
                "differ": bool(diff),
                "same events": comparable(_events(a)) == comparable(_events(b)),
                "where and why": _why(diff, ours_ok, theirs_ok, case.rule),
            }
        )
    return pd.DataFrame(rows)


def _why(diff: str, ours_ok: bool, theirs_ok: bool, rule: str) -> str:
    if not diff:
        return ""
    if ours_ok and not theirs_ok:
        return f"{diff}: httpx-sse departs from the rule ({rule})"
    if theirs_ok and not ours_ok:
        return f"{diff}: ours departs from the rule ({rule})"
    if ours_ok and theirs_ok:
        return f"{diff}: same events by the rule; " + (
            "httpx-sse holds a CR at the end of a read until the next (half of a CRLF?), so the event waits"
            if "read" in diff
            else "they report retry differently (ours: lasting; httpx-sse: on the event that set it)"
        )
    return f"{diff}: both depart from the rule ({rule})"


# -- raw bytes -----------------------------------------------------------------------------------
def capture_raw(url: str, path: str, body: bytes, timeout: float = 30.0) -> bytes:
    """Every byte the server sends for one POST on a plain socket, head and body, until it closes
    (``Connection: close``): what ``curl --raw`` prints."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    received = bytearray()
    with socket.create_connection((host, port), timeout=timeout) as sock:
        sock.sendall(head + body)
        while chunk := sock.recv(65536):
            received += chunk
    return bytes(received)


def escaped(data: bytes, newline: bool = False) -> str:
    """Bytes as text with CR and LF shown as ``\\r`` and ``\\n`` (with ``newline``, each LF also
    ends the printed line), other control bytes as ``\\xNN``, UTF-8 text as itself."""
    text = data.decode("utf-8", errors="backslashreplace")
    text = re.sub(
        r"[\x00-\x09\x0b\x0c\x0e-\x1f\ufeff]",
        lambda m: f"\\x{ord(m.group()):02x}" if ord(m.group()) < 256 else "\\ufeff",
        text,
    )
    shown = text.replace("\r", "\\r").replace("\n", "\\n\n" if newline else "\\n")
    return shown.rstrip("\n")


def raw_lines(raw: bytes) -> pd.DataFrame:
    """A capture as a table of its lines (one per LF, escaped as :func:`escaped` prints them),
    with each line's byte offset: ``"\\n".join`` of ``line`` is the printed capture."""
    rows, pos = [], 0
    for piece in re.findall(rb"[^\n]*\n|[^\n]+$", raw):
        rows.append({"offset": pos, "line": escaped(piece)})
        pos += len(piece)
    return pd.DataFrame(rows, columns=["offset", "line"])


def split_head(raw: bytes) -> tuple[bytes, bytes]:
    head, sep, body = raw.partition(b"\r\n\r\n")
    return head + sep, body


def chunk_table(body: bytes) -> pd.DataFrame:
    """The chunked body taken apart: each chunk's size line (hex), its size, its bytes escaped."""
    rows, pos = [], 0
    while pos < len(body):
        end = body.index(b"\r\n", pos)
        size_hex = body[pos:end].decode("ascii")
        size = int(size_hex.split(";")[0], 16)
        payload = body[end + 2 : end + 2 + size]
        rows.append({"size line": size_hex, "bytes": size, "payload": escaped(payload)})
        pos = end + 2 + size + 2  # the payload, then its CRLF
        if size == 0:
            break
    return pd.DataFrame(rows)
