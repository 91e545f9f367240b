"""Notebook 01's awkward input (:data:`AWKWARD`): bytes cut into reads, the WHATWG rule and the events
it prescribes, read read by read by our parser and by httpx-sse (its public API: ``EventSource`` over an
``httpx.Response``), each event tagged with the read it came out after (``end``: at the close).
httpx-sse reports ``retry`` only on the event whose block set it (ours keeps it): compared apart.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pandas as pd

from labkit.lab import Experiment, Sizes, judge
from labkit.sse import SSEParser

Ev = tuple[str, str, str, int | None]  # (event, data, id, retry), as a client receives it


m = lambda data, id="", retry=None: ("message", data, id, retry)  # noqa: E731 - a message event, as a client gets it
CASES: tuple[tuple[str, tuple[bytes, ...], str, tuple[Ev, ...]], ...] = (  # name, reads, rule, prescribed events
    ("CRLF line ends", (b"data: a\r\n\r\ndata: b\r\n\r\n",), "CRLF, CR and LF each end a line", (m("a"), m("b"))),
    ("CR-only line ends", (b"data: a\r\r", b"data: b\r\r"), "a lone CR ends a line", (m("a"), m("b"))),
    ("CRLF cut across reads", (b"data: a\r", b"\n\r", b"\n"), "CR then LF is one line end, even split", (m("a"),)),
    ("comments", (b": ping\n\n: another\ndata: x\n\n",), "a line starting with ':' is ignored", (m("x"),)),
    ("multi-line data", (b"data: one\ndata: two\n\n",), "data lines join with LF", (m("one\ntwo"),)),
    ("BOM at the start", ("\ufeffdata: x\n\n".encode(),), "one leading U+FEFF is dropped", (m("x"),)),
    ("field with no colon", (b"data\n\ndata: y\n\n",), "a line without ':' is a field, value empty", (m(""), m("y"))),
    ("blank line inside a payload", (b'data: {"text": "a\n\nb"}\n\n',), "a blank line ends it", (m('{"text": "a'),)),
    ("id with a NUL", (b"id: 1\ndata: a\n\nid: \x00\ndata: b\n\n",), "an id with NUL is ignored", (m("a", "1"),
                                                                                      m("b", "1"))),
    ("retry not a number", (b"retry: soon\ndata: a\n\nretry: 1500\ndata: b\n\n",), "retry takes ASCII digits only",
     (m("a"), m("b", retry=1500))),
    ("blank line cut across reads", (b"data: a\n", b"\ndata: b\r\n\r", b"\n"), "it ends the event", (m("a"), m("b"))),
    ("character cut across reads", (b"data: \xc3", b"\xa9\n\n"), "bytes are UTF-8, decoded across reads", (m("é"),)),
)  # fmt: skip


def ours(reads: tuple[bytes, ...]) -> list[tuple[Ev, int | str]]:
    """Our :class:`~labkit.sse.SSEParser`: each event and the read it came out after."""
    parser, out = SSEParser(), []
    for i, chunk in enumerate(reads):
        out += [((e.event, e.data, e.id, e.retry), i) for e in parser.feed(chunk)]
    return out + [((e.event, e.data, e.id, e.retry), "end") for e in parser.close()]


def httpx_sse(reads: tuple[bytes, ...]) -> list[tuple[Ev, int | str]]:
    """httpx-sse reading a real ``httpx.Response`` whose body arrives as ``reads``."""
    import httpx
    from httpx_sse import EventSource

    given: list[int | str] = [0]

    def body() -> Iterator[bytes]:
        for i, chunk in enumerate(reads):
            given[0] = i
            yield chunk
        given[0] = "end"

    response = httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body())
    return [((e.event, e.data, e.id, e.retry), given[0]) for e in EventSource(response).iter_sse()]


def escaped(data: bytes) -> str:
    """Bytes as text with CR, LF, the BOM and other control bytes written out (``\\r``, ``\\x00``)."""
    text = data.decode("utf-8", errors="backslashreplace").replace("\ufeff", "\\ufeff")
    text = re.sub(r"[\x00-\x09\x0b\x0c\x0e-\x1f]", lambda c: f"\\x{ord(c.group()):02x}", text)
    return text.replace("\r", "\\r").replace("\n", "\\n")


def shown(found: list[tuple[Ev, int | str]]) -> str:
    return "; ".join(f"{e} {d!r}" + (f" id={i!r}" if i else "") + (f" retry={r}" if r is not None else "") + f" @{at}"
                     for (e, d, i, r), at in found) or "(none)"  # fmt: skip


def case_row(name: str, reads: tuple[bytes, ...], rule: str, expected: tuple[Ev, ...]) -> dict[str, Any]:
    a, b = ours(reads), httpx_sse(reads)
    return {"case": name, "reads": " | ".join(escaped(r) for r in reads), "rule": rule, "ours": shown(a),
            "httpx-sse": shown(b), "ours follows": [e for e, _ in a] == list(expected),
            "httpx-sse follows": [e[:3] for e, _ in b] == [e[:3] for e in expected],
            "same events": [e[:3] for e, _ in a] == [e[:3] for e, _ in b],
            "same reads": [r for _, r in a] == [r for _, r in b]}  # fmt: skip


def awkward_verdicts(tables: dict[str, pd.DataFrame], s: Sizes) -> list:
    rows = tables["rows"]
    ok = {c: rows[c].astype(bool) for c in ("ours follows", "httpx-sse follows", "same events", "same reads")}
    wrong, theirs = (list(rows.case[~ok[c]]) for c in ("ours follows", "httpx-sse follows"))
    later = list(rows.case[ok["same events"] & ~ok["same reads"]])
    disagree = list(rows.case[ok["ours follows"] & ok["httpx-sse follows"] & ~ok["same events"]])
    return [
        judge("our parser follows the WHATWG rules on every awkward case", "the events our parser dispatches are the "
              "ones the rules prescribe", "any case gives other events", not wrong,
              f"departs on: {', '.join(wrong)}" if wrong else f"all {len(rows)} cases as the rules say", checked=True),
        judge("where both follow the rules, the two parsers dispatch the same events", "httpx-sse is an independent "
              "implementation of the same rules", "a case both handle by the rules gives different events",
              not disagree and bool((ok["ours follows"] & ok["httpx-sse follows"]).any()),
              f"differ: {', '.join(disagree) or 'none'}; httpx-sse departs on: {', '.join(theirs) or 'none'}; an "
              f"event comes out after another read on: {', '.join(later) or 'none'}", checked=True),
    ]  # fmt: skip


AWKWARD = Experiment(
    name="wire.awkward", title="Awkward input through our parser and httpx-sse", sizes={"full": {}, "ci": {}},
    measure=lambda trial: [case_row(*case) for case in CASES], verdicts=awkward_verdicts,
)  # fmt: skip
