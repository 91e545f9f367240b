"""Properties: what the writer writes the parser reads back, however the bytes are cut."""
from __future__ import annotations

import re

from hypothesis import given, settings
from hypothesis import strategies as st
from wire_helpers import byte_by_byte, parser_outcome, split_at

from labkit.sse import ParsedEvent, ServerSentEvent

PROPERTY_SETTINGS = settings(max_examples=200, deadline=None)

# Text for data and comments: any code point except surrogates, with line endings made common.
any_text = st.lists(
    st.one_of(st.text(st.characters(codec="utf-8"), max_size=6),
              st.sampled_from(["\r", "\n", "\r\n", "\ufeff", ":", " "])),
    max_size=8,
).map("".join)
single_line = st.text(st.characters(codec="utf-8", exclude_characters="\r\n"), max_size=12)
event_ids = st.one_of(
    st.none(),
    st.integers(min_value=0, max_value=10**12),
    st.text(st.characters(codec="utf-8", exclude_characters="\r\n\x00"), max_size=8),
)
retries = st.one_of(st.none(), st.integers(min_value=0, max_value=10**9))


@st.composite
def sse_events(draw: st.DrawFn) -> ServerSentEvent:
    fields = {
        "data": draw(st.one_of(st.none(), any_text)),
        "event": draw(st.one_of(st.none(), single_line)),
        "id": draw(event_ids),
        "retry": draw(retries),
        "comment": draw(st.one_of(st.none(), any_text)),
    }
    if all(v is None for v in fields.values()):
        fields["data"] = ""
    return ServerSentEvent(**fields)


def expected_reading(events: list[ServerSentEvent]) -> tuple[list[ParsedEvent], str, int | None]:
    """What a standard client observes, worked out from the events rather than their bytes."""
    out, last_id, retry = [], "", None
    for ev in events:
        if ev.id is not None:
            last_id = str(ev.id)
        if ev.retry is not None:
            retry = ev.retry
        if ev.data is not None:
            data = re.sub(r"\r\n|\r", "\n", ev.data)
            out.append(ParsedEvent(ev.event or "message", data, last_id, retry))
    return out, last_id, retry


def encode_all(events: list[ServerSentEvent]) -> bytes:
    return b"".join(ev.encode() for ev in events)


@PROPERTY_SETTINGS
@given(st.lists(sse_events(), max_size=6), st.lists(st.integers(0, 400), max_size=20))
def test_encoded_events_parse_back_under_every_chunking(
    events: list[ServerSentEvent], points: list[int]
) -> None:
    """One chunk, one byte at a time, and random cuts all read back what was written."""
    stream, expected = encode_all(events), expected_reading(events)
    assert parser_outcome([stream]) == expected
    assert parser_outcome(byte_by_byte(stream)) == expected
    assert parser_outcome(split_at(stream, points)) == expected


# Arbitrary bytes, biased towards the pieces the grammar cares about.
wire_pieces = st.sampled_from([
    b"data", b"data:", b"data: ", b"event:", b"event: x", b"id:", b"id: 1", b"retry:", b"retry: 9",
    b":", b" ", b"\r", b"\n", b"\r\n", b"\x00", b"\xef\xbb\xbf", b"\xef\xbb", b"\xff", b"\xc3",
    b"\xe6\x97\xa5", b"\xf0\x9f", b"\x99\x82", b"7", b"x",
])
wire_bytes = st.one_of(
    st.binary(max_size=80),
    st.lists(wire_pieces, max_size=40).map(b"".join),
)


@PROPERTY_SETTINGS
@given(wire_bytes)
def test_any_bytes_read_the_same_in_one_chunk_and_byte_by_byte(data: bytes) -> None:
    assert parser_outcome(byte_by_byte(data)) == parser_outcome([data])


@PROPERTY_SETTINGS
@given(wire_bytes, st.lists(st.integers(0, 200), max_size=12))
def test_any_bytes_read_the_same_under_random_splits(data: bytes, points: list[int]) -> None:
    assert parser_outcome(split_at(data, points)) == parser_outcome([data])
