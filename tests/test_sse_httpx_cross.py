"""Our parser against httpx-sse, an independent implementation read through a real httpx response.

Where both follow the WHATWG rules they must agree, and a generated stream checks that. Where
httpx-sse 0.4 departs from the rules (read from its source), a test pins down
what each side does, so an upgrade that changes either is noticed:

* it keeps a leading byte order mark, so the first line's field name is ``"\\ufeffdata"``;
* it parses ``retry`` with ``int()``, accepting ``+5``, `` 5``, ``-1``, ``1_000``, ``５``;
* it dispatches a block with no data if an event type, id or retry was set, and, once any id
  has been seen, every blank line after a comment-only block (a ping) or another blank line,
  yielding empty ``message`` events;
* it reports ``retry`` only on the event whose block set it, not as a lasting reconnection time;
* its line decoder holds a CR at the end of a chunk until the next chunk, so an event ended by
  ``\\r\\r`` reaches the client one chunk late.

For the service this means: a client on httpx-sse must skip events whose data is empty, or the
pings in our streams turn into empty messages.
"""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from wire_helpers import as_tuples, byte_by_byte, httpx_sse_events, run_parser, split_at

from labkit.experiments.wire_cases import httpx_sse
from labkit.sse import ParsedEvent, ServerSentEvent, SSEParser, parse

# --------------------------------------------------------------------------- agreement

data_text = st.lists(
    st.one_of(st.text(st.characters(codec="utf-8"), max_size=6),
              st.sampled_from(["\r", "\n", "\r\n", ":", " "])),
    max_size=6,
).map("".join)
line_text = st.text(st.characters(codec="utf-8", exclude_characters="\r\n\x00"), max_size=8)


@st.composite
def agreeing_streams(draw: st.DrawFn) -> bytes:
    """Events that all carry data, written by our encoder with random line endings."""
    events = draw(st.lists(st.builds(
        ServerSentEvent,
        data=data_text,
        event=st.one_of(st.none(), line_text),
        id=st.one_of(st.none(), line_text),
        comment=st.one_of(st.none(), data_text),
    ), max_size=5))
    lines = b"".join(ev.encode() for ev in events).split(b"\n")[:-1]
    endings = draw(st.lists(st.sampled_from([b"\n", b"\r", b"\r\n"]),
                            min_size=len(lines), max_size=len(lines)))
    return b"".join(line + end for line, end in zip(lines, endings))


def ours(chunks: list[bytes]) -> list[tuple[str, str, str, int | None]]:
    return as_tuples(run_parser(chunks)[0])


@settings(max_examples=100, deadline=None)
@given(agreeing_streams(), st.lists(st.integers(0, 300), max_size=10))
def test_both_parsers_agree_on_streams_we_write(stream: bytes, points: list[int]) -> None:
    chunks = split_at(stream, points)
    assert ours(chunks) == httpx_sse_events(chunks)


@pytest.mark.parametrize(
    "stream",
    [
        b"data: a\xffb\xc3\n\n",                         # invalid UTF-8
        "data: 日🙂\n\n".encode(),                       # multi-byte, split byte by byte below
        b"data: a\r\ndata: b\rdata: c\n\n",             # mixed line ends
        b"id: 7\ndata: x\n\nid: 8\x00\ndata: y\n\n",    # NUL in id ignored
        b"data:  two\ndata\n\n",                        # one space stripped; no colon
        b"data: x\n\ndata: cut off\n",                  # unfinished event dropped
        b"retry: 250\ndata: x\n\n",                     # digits-only retry, on its own event
    ],
    ids=["invalid-utf8", "multibyte", "line-ends", "nul-id", "spaces", "unfinished", "retry"],
)
def test_both_parsers_agree_on_standard_cases_byte_by_byte(stream: bytes) -> None:
    assert ours(byte_by_byte(stream)) == httpx_sse_events(byte_by_byte(stream))


# --------------------------------------------------------------------------- departures


def test_leading_bom_is_stripped_by_us_and_kept_by_httpx_sse() -> None:
    stream = b"\xef\xbb\xbfdata: first\n\ndata: second\n\n"
    assert [e.data for e in parse(stream)] == ["first", "second"]
    assert [data for _, data, _, _ in httpx_sse_events([stream])] == ["second"]


@pytest.mark.parametrize(("value", "httpx_reads"),
                         [("+5", 5), ("  5", 5), ("-1", -1), ("1_000", 1000), ("\uff15", 5)])
def test_retry_not_all_ascii_digits_is_ignored_by_us_and_accepted_by_httpx_sse(
    value: str, httpx_reads: int
) -> None:
    stream = f"retry: {value}\ndata: x\n\n".encode()
    events, parser = run_parser([stream])
    assert parser.retry is None and events[0].retry is None
    assert httpx_sse_events([stream]) == [("message", "x", "", httpx_reads)]


@pytest.mark.parametrize("block", [b"id: 5\n\n", b"event: e\n\n", b"retry: 9\n\n"],
                         ids=["id", "event", "retry"])
def test_block_without_data_dispatches_nothing_for_us_and_an_empty_event_for_httpx_sse(
    block: bytes,
) -> None:
    assert parse(block) == []
    assert len(httpx_sse_events([block])) == 1
    assert httpx_sse_events([block])[0][1] == ""


def test_id_in_block_without_data_sets_the_last_event_id_on_both_sides() -> None:
    stream = b"id: 5\n\ndata: x\n\n"
    assert [e.id for e in parse(stream)] == ["5"]
    assert httpx_sse_events([stream])[-1] == ("message", "x", "5", None)


def test_ping_after_an_id_is_nothing_for_us_and_an_empty_message_for_httpx_sse() -> None:
    stream = b"id: 1\ndata: a\n\n: ping\n\n\n"
    assert parse(stream) == [ParsedEvent(data="a", id="1")]
    assert httpx_sse_events([stream]) == [
        ("message", "a", "1", None), ("message", "", "1", None), ("message", "", "1", None)]


def test_ping_before_any_id_is_nothing_on_both_sides() -> None:
    stream = b": ping\n\ndata: a\n\n"
    assert [e.data for e in parse(stream)] == ["a"]
    assert httpx_sse_events([stream]) == [("message", "a", "", None)]


def test_retry_lasts_for_us_and_is_reported_once_by_httpx_sse() -> None:
    stream = b"retry: 10\ndata: a\n\ndata: b\n\n"
    assert [e.retry for e in parse(stream)] == [10, 10]
    assert [retry for *_, retry in httpx_sse_events([stream])] == [10, None]


def test_event_ended_by_cr_cr_is_ours_at_once_and_httpx_sse_one_chunk_later() -> None:
    parser = SSEParser()
    assert parser.feed(b"data: a\r\r") == [ParsedEvent(data="a")]
    # httpx-sse through its public API, an EventSource over a response whose body comes in two reads:
    # the final CR of the first read is held back (half of a CRLF?), so "a" comes out after the second
    assert httpx_sse((b"data: a\r\r", b"data: b\n")) == [(("message", "a", "", None), 1)]
