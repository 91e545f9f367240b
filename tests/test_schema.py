"""The lab's stream schema: numbered events that survive the wire, and a reader that checks them."""
from __future__ import annotations

import json

import pytest
from wire_helpers import byte_by_byte, run_parser

from labkit.schema import (
    ERROR_TYPES,
    StreamEncoder,
    decode_event,
    done_payload,
    error_envelope,
    start_payload,
    token_payload,
)
from labkit.sse import ParsedEvent, parse


def full_stream(enc: StreamEncoder) -> bytes:
    return b"".join([
        enc.start("req-1", "gpt2", 5),
        enc.comment("ping"),
        enc.token(0, 15496, "Hello"),
        enc.token(1, 995, " world"),
        enc.comment("ping"),
        enc.done("length", 5, 2),
    ])


def test_every_event_type_round_trips_with_sequential_ids() -> None:
    enc = StreamEncoder()
    stream = full_stream(enc) + enc.error("internal_error", "boom")
    events = parse(stream)
    assert [e.id for e in events] == ["1", "2", "3", "4", "5"]
    assert [decode_event(e) for e in events] == [
        ("start", start_payload("req-1", "gpt2", 5)),
        ("token", token_payload(0, 15496, "Hello")),
        ("token", token_payload(1, 995, " world")),
        ("done", done_payload("length", 5, 2)),
        ("error", error_envelope("internal_error", "boom")),
    ]


def test_comments_carry_no_id_and_do_not_advance_the_counter() -> None:
    enc = StreamEncoder()
    assert enc.comment() == b": ping\n\n"
    assert enc.last_id == 0
    assert b"id: 1\n" in enc.start("r", "m", 1)


def test_last_event_id_at_the_end_equals_the_number_of_events() -> None:
    enc = StreamEncoder()
    events, parser = run_parser(byte_by_byte(full_stream(enc)))
    assert parser.last_event_id == str(len(events)) == str(enc.last_id) == "4"


def test_payloads_are_compact_json_keeping_non_ascii_text() -> None:
    encoded = StreamEncoder().token(0, 1, "café 🙂")
    expected = 'event: token\nid: 1\ndata: {"index":0,"id":1,"text":"café 🙂"}\n\n'
    assert encoded == expected.encode()


@pytest.mark.parametrize(
    "text",
    ["a\n\nb", "\r", "\r\n\r\n", "data: x\n\nid: 9\n\n", "\u2028\u2029\x85", "\x00", ""],
    ids=["blank-line", "cr", "crlf-pair", "injected-frame", "unicode-separators", "nul", "empty"],
)
def test_token_text_with_line_breaks_stays_one_event_and_intact(text: str) -> None:
    encoded = StreamEncoder().token(3, 42, text)
    assert encoded.count(b"\n") == 4  # event, id, data, blank: JSON escaped every CR and LF
    (event,) = parse(encoded)
    assert decode_event(event) == ("token", {"index": 3, "id": 42, "text": text})


def test_error_event_uses_the_json_error_body_envelope() -> None:
    (event,) = parse(StreamEncoder().error("slow_client", "reader fell behind"))
    assert event.event == "error"
    assert json.loads(event.data) == {"error": {"type": "slow_client",
                                                "message": "reader fell behind"}}


@pytest.mark.parametrize("error_type", sorted(ERROR_TYPES))
def test_every_service_error_type_encodes(error_type: str) -> None:
    (event,) = parse(StreamEncoder().error(error_type, "m"))
    assert decode_event(event)[1]["error"]["type"] == error_type


def test_error_envelope_refuses_an_unknown_type() -> None:
    with pytest.raises(ValueError, match="overloaded"):
        error_envelope("overloaded", "busy")


def _event(name: str, payload: object) -> ParsedEvent:
    return ParsedEvent(event=name, data=json.dumps(payload))


SCHEMA_VIOLATIONS = [
    pytest.param(_event("start", {"request_id": "r", "model": "m"}), id="start-missing-key"),
    pytest.param(_event("start", {"request_id": 1, "model": "m", "prompt_tokens": 1}),
                 id="start-id-not-str"),
    pytest.param(_event("token", {"index": 0, "id": 1}), id="token-missing-text"),
    pytest.param(_event("token", {"index": "0", "id": 1, "text": ""}), id="token-index-str"),
    pytest.param(_event("token", {"index": True, "id": 1, "text": ""}), id="token-index-bool"),
    pytest.param(_event("done", {"finish_reason": "stop"}), id="done-missing-usage"),
    pytest.param(_event("done", {"finish_reason": "stop", "usage": [1, 2]}), id="done-usage-list"),
    pytest.param(_event("done", {"finish_reason": "stop", "usage": {"prompt_tokens": 1}}),
                 id="done-usage-missing-completion"),
    pytest.param(_event("error", {"type": "x", "message": "y"}), id="error-without-envelope"),
    pytest.param(_event("error", {"error": {"type": "x"}}), id="error-missing-message"),
    pytest.param(ParsedEvent(event="token", data="not json"), id="not-json"),
    pytest.param(_event("token", [0, 1, "x"]), id="not-an-object"),
]


@pytest.mark.parametrize("event", SCHEMA_VIOLATIONS)
def test_schema_violations_raise_value_error(event: ParsedEvent) -> None:
    with pytest.raises(ValueError):
        decode_event(event)


def test_decode_tolerates_extra_keys() -> None:
    payload = {"index": 0, "id": 1, "text": "x", "logprob": -0.5}
    assert decode_event(_event("token", payload)) == ("token", payload)


def test_decode_passes_unknown_event_types_through_for_tolerant_readers() -> None:
    assert decode_event(_event("usage_update", {"n": 1})) == ("usage_update", {"n": 1})


def test_decode_accepts_error_types_it_does_not_know() -> None:
    payload = {"error": {"type": "overloaded", "message": "busy"}}
    assert decode_event(_event("error", payload)) == ("error", payload)
