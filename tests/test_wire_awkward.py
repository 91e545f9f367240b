"""The wire, visible (notebook 01): raw bytes from a real server, and the article's awkward cases
read by our parser and by httpx-sse.

The expectations below are the WHATWG "event stream interpretation" rules applied by hand to
each case's bytes; they are written here a second time, apart from the cases' own, so that a
wrong expectation in the lab's table cannot make its own check pass.
"""
from __future__ import annotations

import re
from typing import Any

import pytest

from labkit.experiments import wire_cases
from labkit.experiments.wire_cases import CASES, END, chunk_table, compare, httpx_sse, ours, split_head
from labkit.sse import parse
from wire_helpers import httpx_sse_events

M = "message"
SPEC: dict[str, list[tuple[str, str, str, int | None]]] = {
    # CRLF, CR and LF each end a line; a blank line dispatches
    "CRLF line ends": [(M, "a", "", None), (M, "b", "", None)],
    "CR-only line ends": [(M, "a", "", None), (M, "b", "", None)],
    # a line beginning with a colon is ignored; a block without data dispatches nothing
    "comments": [(M, "x", "", None)],
    # data lines are joined with a single LF
    "multi-line data": [(M, "line one\nline two", "", None)],
    # the decoder drops one leading BOM, so the first field is "data"
    "BOM at the start": [(M, "x", "", None)],
    # a line without a colon is a field named by the whole line, with an empty value
    "field with no colon": [(M, "", "", None), (M, "y", "", None)],
    # a blank line inside a payload ends the event there; 'b"}' is then an unknown field
    "blank line inside a payload": [(M, '{"text": "a', "", None)],
    # an id field containing NUL is ignored: the last event id stays "1"
    "id with a NUL": [(M, "a", "1", None), (M, "b", "1", None)],
    # retry must be ASCII digits; "soon" is ignored, 1500 kept (ours reports it from then on)
    "retry not a number": [(M, "a", "", None), (M, "b", "", 1500)],
    # the blank line that ends an event may arrive in the next read, even half a CRLF at a time
    "blank line split across reads": [(M, "a", "", None), (M, "b", "", None)],
}
DEPARTS = {"BOM at the start"}  # httpx-sse 0.4 keeps the BOM (tests/test_sse_httpx_cross.py)


def test_every_case_has_a_spec_expectation_and_the_lab_table_states_the_same() -> None:
    assert {c.name for c in CASES} == set(SPEC)
    for case in CASES:
        assert list(case.expected) == SPEC[case.name], case.name


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_our_parser_follows_the_spec_on_every_awkward_case(case: Any) -> None:
    assert [e for e, _ in ours(case.reads)] == SPEC[case.name]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_our_parser_gives_the_same_events_however_the_bytes_are_cut(case: Any) -> None:
    whole = b"".join(case.reads)
    byte_by_byte = tuple(whole[i:i + 1] for i in range(len(whole)))
    assert [e for e, _ in ours(byte_by_byte)] == [e for e in SPEC[case.name]] == [
        (e.event, e.data, e.id, e.retry) for e in parse(whole)]


@pytest.mark.parametrize("case", [c for c in CASES if c.name not in DEPARTS], ids=lambda c: c.name)
def test_where_both_follow_the_spec_the_two_parsers_agree(case: Any) -> None:
    mine = wire_cases.comparable([e for e, _ in ours(case.reads)])
    theirs = wire_cases.comparable([e for e, _ in httpx_sse(case.reads)])
    assert mine == theirs


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_httpx_sse_driven_read_by_read_reads_what_a_real_httpx_response_gives(case: Any) -> None:
    assert [e for e, _ in httpx_sse(case.reads)] == httpx_sse_events(list(case.reads))


def test_the_table_computes_who_departs_and_where() -> None:
    table = compare().set_index("case")
    assert table["ours follows the rule"].all()
    assert not table.loc["BOM at the start", "httpx-sse follows the rule"]
    assert "httpx-sse departs" in table.loc["BOM at the start", "where and why"]
    # the CR at the end of a read: same events, but httpx-sse hands the event out one read later
    assert table.loc["CR-only line ends", "differ"] and "read" in table.loc["CR-only line ends", "where and why"]
    assert f"@{END}" in table.loc["CR-only line ends", "httpx-sse"]
    agree = [n for n in SPEC if n not in DEPARTS | {"CR-only line ends", "blank line split across reads"}]
    assert not table.loc[agree, "differ"].any()


def test_a_case_where_our_parser_is_wrong_would_be_flagged() -> None:
    wrong = wire_cases.Case("wrong", (b"data: a\n\n",), "made up", ((M, "b", "", None),))
    row = compare((wrong,)).iloc[0]
    assert not row["ours follows the rule"] and not row["differ"]


# -- the raw bytes of a real stream ---------------------------------------------------------------
def test_the_raw_capture_is_a_chunked_http_response_with_the_sse_frames_inside(server: Any) -> None:
    raw = wire_cases.capture_raw(server.url, "/v1/stream", b'{"prompt": "Hi", "max_new_tokens": 3}')
    head, body = split_head(raw)
    assert head.startswith(b"HTTP/1.1 200 OK\r\n") and head.endswith(b"\r\n\r\n")
    assert re.search(rb"(?i)\r\ntransfer-encoding: chunked\r\n", head)
    assert re.search(rb"(?i)\r\ncontent-type: text/event-stream; charset=utf-8\r\n", head)
    chunks = chunk_table(body)
    assert chunks.bytes.iloc[-1] == 0 and all(int(h, 16) == n for h, n in zip(chunks["size line"], chunks.bytes))
    sse = _dechunk(body)
    assert len(sse) == chunks.bytes.sum()
    assert [e.event for e in parse(sse)] == ["start", "token", "token", "token", "done"]
    shown = "\n".join(wire_cases.raw_lines(raw).line)
    assert "\\r\\n" in shown and "event: start\\n" in shown and "\r" not in shown


def _dechunk(body: bytes) -> bytes:
    out, pos = bytearray(), 0
    while True:
        end = body.index(b"\r\n", pos)
        size = int(body[pos:end], 16)
        if size == 0:
            return bytes(out)
        out += body[end + 2:end + 2 + size]
        assert body[end + 2 + size:end + 4 + size] == b"\r\n"
        pos = end + 4 + size


def test_escaped_shows_line_ends_and_control_bytes() -> None:
    assert wire_cases.escaped(b"a\r\nb\x00") == "a\\r\\nb\\x00"
    assert wire_cases.escaped(b"x\ny\n", newline=True) == "x\\n\ny\\n"
    assert wire_cases.escaped("\ufeffz".encode()) == "\\ufeffz"
