"""Byte-exact tests of the SSE writer: each event on the wire, and what it refuses."""
from __future__ import annotations

import dataclasses

import pytest

from labkit.sse import ServerSentEvent, sse_comment, sse_event

ENCODINGS = [
    pytest.param({"data": "hello"}, b"data: hello\n\n", id="data"),
    pytest.param({"data": ""}, b"data: \n\n", id="empty-data-is-still-an-event"),
    pytest.param({"data": "a\nb"}, b"data: a\ndata: b\n\n", id="lf-splits-data"),
    pytest.param({"data": "a\rb"}, b"data: a\ndata: b\n\n", id="cr-splits-data"),
    pytest.param({"data": "a\r\nb"}, b"data: a\ndata: b\n\n", id="crlf-splits-data-once"),
    pytest.param({"data": "a\n\nb"}, b"data: a\ndata: \ndata: b\n\n", id="blank-line-in-data"),
    pytest.param({"data": "a\n"}, b"data: a\ndata: \n\n", id="trailing-newline-kept"),
    pytest.param({"data": "\r\n"}, b"data: \ndata: \n\n", id="only-a-newline"),
    pytest.param({"data": " lead"}, b"data:  lead\n\n", id="leading-space-survives"),
    pytest.param({"data": "a\u2028b\x0cc"}, "data: a\u2028b\x0cc\n\n".encode(),
                 id="unicode-line-separators-are-not-line-ends"),
    pytest.param({"data": "café 日本 🙂"}, "data: café 日本 🙂\n\n".encode(), id="utf8"),
    pytest.param({"data": "x", "event": "token"}, b"event: token\ndata: x\n\n", id="event"),
    pytest.param({"data": "x", "id": 7}, b"id: 7\ndata: x\n\n", id="int-id"),
    pytest.param({"data": "x", "id": "abc"}, b"id: abc\ndata: x\n\n", id="str-id"),
    pytest.param({"id": ""}, b"id: \n\n", id="empty-id-resets-client-id"),
    pytest.param({"retry": 2500}, b"retry: 2500\n\n", id="retry-alone"),
    pytest.param({"retry": 0}, b"retry: 0\n\n", id="retry-zero"),
    pytest.param({"comment": "ping"}, b": ping\n\n", id="comment"),
    pytest.param({"comment": ""}, b": \n\n", id="empty-comment"),
    pytest.param({"comment": "a\r\nb\rc"}, b": a\n: b\n: c\n\n", id="multiline-comment"),
    pytest.param(
        {"data": "d1\nd2", "event": "e", "id": 3, "retry": 10, "comment": "c"},
        b": c\nevent: e\nid: 3\nretry: 10\ndata: d1\ndata: d2\n\n",
        id="field-order-comment-event-id-retry-data",
    ),
]


@pytest.mark.parametrize(("fields", "expected"), ENCODINGS)
def test_event_encodes_to_exact_bytes(fields: dict, expected: bytes) -> None:
    assert ServerSentEvent(**fields).encode() == expected


@pytest.mark.parametrize(("fields", "expected"), ENCODINGS)
def test_sse_event_helper_matches_the_dataclass(fields: dict, expected: bytes) -> None:
    assert sse_event(**fields) == expected


@pytest.mark.parametrize(("fields", "expected"), ENCODINGS)
def test_output_uses_lf_only_and_ends_with_one_blank_line(fields: dict, expected: bytes) -> None:
    encoded = ServerSentEvent(**fields).encode()
    assert b"\r" not in encoded
    assert encoded.endswith(b"\n\n") and not encoded.endswith(b"\n\n\n")


def test_sse_comment_is_a_heartbeat() -> None:
    assert sse_comment("ping") == b": ping\n\n"


def test_encode_is_pure() -> None:
    event = ServerSentEvent(data="x", id=1)
    assert event.encode() == event.encode()


def test_event_is_frozen() -> None:
    event = ServerSentEvent(data="x")
    with pytest.raises(dataclasses.FrozenInstanceError):
        event.data = "y"  # type: ignore[misc]


REFUSED_VALUES = [
    pytest.param({"data": "x", "event": "a\nb"}, id="lf-in-event"),
    pytest.param({"data": "x", "event": "a\rb"}, id="cr-in-event"),
    pytest.param({"data": "x", "id": "1\n2"}, id="lf-in-id"),
    pytest.param({"data": "x", "id": "1\r"}, id="cr-in-id"),
    pytest.param({"data": "x", "id": "1\x002"}, id="nul-in-id"),
    pytest.param({"retry": -1}, id="negative-retry"),
    pytest.param({"retry": True}, id="bool-retry"),
    pytest.param({"retry": 1.5}, id="float-retry"),
    pytest.param({"retry": "100"}, id="str-retry"),
    pytest.param({}, id="event-with-no-fields"),
]


@pytest.mark.parametrize("fields", REFUSED_VALUES)
def test_invalid_values_are_refused_with_value_error(fields: dict) -> None:
    with pytest.raises(ValueError):
        ServerSentEvent(**fields)


@pytest.mark.parametrize(
    "fields",
    [{"data": b"bytes"}, {"data": {"a": 1}}, {"event": 3}, {"comment": 1}, {"id": True},
     {"id": 1.0}],
)
def test_values_of_the_wrong_type_are_refused_with_type_error(fields: dict) -> None:
    with pytest.raises(TypeError):
        ServerSentEvent(**fields)


def test_refusal_message_names_the_field_and_value() -> None:
    with pytest.raises(ValueError, match=r"id.*'7\\n'"):
        ServerSentEvent(data="x", id="7\n")
