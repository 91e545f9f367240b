"""The parser, one WHATWG event-stream rule per test, then the rules all at once."""
from __future__ import annotations

import random
import time

import pytest
from wire_helpers import byte_by_byte, parser_outcome, run_parser, split_at

from labkit.sse import ParsedEvent, SSEParser, parse


def datas(stream: bytes) -> list[str]:
    return [e.data for e in parse(stream)]


# --------------------------------------------------------------------------- dispatch


def test_blank_line_dispatches_the_event() -> None:
    assert parse(b"data: hi\n\n") == [ParsedEvent(event="message", data="hi", id="", retry=None)]


def test_event_without_closing_blank_line_is_discarded_at_close() -> None:
    parser = SSEParser()
    assert parser.feed(b"data: one\n\ndata: cut off\n") == [ParsedEvent(data="one")]
    assert parser.close() == []


def test_unfinished_event_does_not_set_the_last_event_id() -> None:
    events, parser = run_parser([b"id: 1\ndata: a\n\nid: 2\ndata: b\n"])
    assert [e.id for e in events] == ["1"]
    assert parser.last_event_id == "1"


def test_feed_after_close_is_refused() -> None:
    parser = SSEParser()
    parser.close()
    with pytest.raises(RuntimeError):
        parser.feed(b"data: x\n\n")


def test_events_come_back_in_order_from_one_chunk() -> None:
    assert datas(b"data: 1\n\ndata: 2\n\ndata: 3\n\n") == ["1", "2", "3"]


# --------------------------------------------------------------------------- bytes and text


def test_leading_bom_is_stripped() -> None:
    assert datas(b"\xef\xbb\xbfdata: x\n\n") == ["x"]


def test_leading_bom_split_across_chunks_is_stripped() -> None:
    events, _ = run_parser([b"\xef", b"\xbb", b"\xbfdata: x\n\n"])
    assert [e.data for e in events] == ["x"]


def test_only_one_leading_bom_is_stripped() -> None:
    # The second BOM becomes part of the field name "\ufeffdata", an unknown field.
    assert datas(b"\xef\xbb\xbf\xef\xbb\xbfdata: x\n\ndata: y\n\n") == ["y"]


def test_bom_later_in_the_stream_is_not_stripped() -> None:
    assert datas(b"data: x\n\n\xef\xbb\xbfdata: y\n\n") == ["x"]


def test_invalid_utf8_becomes_replacement_character() -> None:
    assert datas(b"data: a\xffb\xc3\n\n") == ["a\ufffdb\ufffd"]


def test_multibyte_character_split_across_chunks_is_not_corrupted() -> None:
    encoded = "data: 日🙂\n\n".encode()
    events, _ = run_parser(byte_by_byte(encoded))
    assert [e.data for e in events] == ["日🙂"]


# --------------------------------------------------------------------------- lines


@pytest.mark.parametrize("end", [b"\r\n", b"\n", b"\r"], ids=["crlf", "lf", "cr"])
def test_crlf_lf_and_cr_each_end_a_line(end: bytes) -> None:
    assert datas(b"data: a" + end + b"data: b" + end + end) == ["a\nb"]


def test_mixed_line_endings_in_one_stream() -> None:
    assert datas(b"data: a\r\ndata: b\rdata: c\n\r\n") == ["a\nb\nc"]


def test_cr_at_chunk_end_followed_by_lf_is_one_line_end() -> None:
    # Were the LF counted again it would be a blank line and dispatch "a" alone.
    events, _ = run_parser([b"data: a\r", b"\ndata: b\r\n\r\n"])
    assert [e.data for e in events] == ["a\nb"]


def test_cr_at_chunk_end_survives_empty_chunks_before_its_lf() -> None:
    events, _ = run_parser([b"data: a\r", b"", b"\ndata: b\n\n"])
    assert [e.data for e in events] == ["a\nb"]


def test_cr_at_chunk_end_dispatches_without_waiting_for_the_next_chunk() -> None:
    parser = SSEParser()
    assert parser.feed(b"data: a\r\r") == [ParsedEvent(data="a")]


def test_cr_then_cr_is_two_line_ends() -> None:
    assert datas(b"data: a\r\rdata: b\r\r") == ["a", "b"]


def test_line_starting_with_colon_is_a_comment() -> None:
    assert datas(b": ping\n:\ndata: x\n: more\n\n") == ["x"]


def test_line_without_colon_is_a_field_with_empty_value() -> None:
    assert datas(b"data\n\n") == [""]
    assert datas(b"data\ndata\n\n") == ["\n"]


def test_only_one_leading_space_of_a_value_is_stripped() -> None:
    assert datas(b"data:  two\n\n") == [" two"]


def test_value_without_space_after_colon_is_kept_whole() -> None:
    assert datas(b"data:x\n\n") == ["x"]


def test_value_may_contain_colons() -> None:
    assert datas(b"data: a: b:c\n\n") == ["a: b:c"]


def test_field_names_are_case_sensitive() -> None:
    assert datas(b"Data: x\n\ndata: y\n\n") == ["y"]


def test_unknown_fields_are_ignored() -> None:
    assert datas(b"foo: bar\ndata: x\nStep 2\n\n") == ["x"]


# --------------------------------------------------------------------------- data and event type


def test_data_lines_joined_with_lf_and_final_lf_removed() -> None:
    assert datas(b"data: a\ndata:\ndata: b\n\n") == ["a\n\nb"]


def test_event_type_defaults_to_message() -> None:
    assert parse(b"data: x\n\n")[0].event == "message"


def test_event_field_sets_the_type_and_it_resets_after_dispatch() -> None:
    assert [e.event for e in parse(b"event: token\ndata: x\n\ndata: y\n\n")] == ["token", "message"]


def test_empty_event_field_means_message() -> None:
    assert parse(b"event:\ndata: x\n\n")[0].event == "message"


def test_block_with_empty_data_buffer_dispatches_nothing_and_resets_the_type() -> None:
    assert [e.event for e in parse(b"event: lost\n\ndata: x\n\n")] == ["message"]


def test_comment_only_block_dispatches_nothing() -> None:
    assert parse(b": ping\n\n: ping\n\n\n\n") == []


# --------------------------------------------------------------------------- id


def test_id_is_reported_on_the_event_and_kept_by_the_parser() -> None:
    events, parser = run_parser([b"id: 7\ndata: x\n\n"])
    assert events[0].id == "7" and parser.last_event_id == "7"


def test_event_without_id_inherits_the_last_one() -> None:
    assert [e.id for e in parse(b"id: 1\ndata: a\n\ndata: b\n\n")] == ["1", "1"]


def test_id_in_block_without_data_still_sets_the_last_event_id() -> None:
    events, parser = run_parser([b"id: 5\n\ndata: x\n\n"])
    assert parser.last_event_id == "5" and [e.id for e in events] == ["5"]


def test_id_containing_nul_is_ignored() -> None:
    events, parser = run_parser([b"id: 1\ndata: a\n\nid: 2\x003\ndata: b\n\n"])
    assert [e.id for e in events] == ["1", "1"] and parser.last_event_id == "1"


def test_empty_id_resets_the_last_event_id() -> None:
    events, parser = run_parser([b"id: 1\ndata: a\n\nid\ndata: b\n\n"])
    assert [e.id for e in events] == ["1", ""] and parser.last_event_id == ""


def test_last_event_id_starts_empty() -> None:
    assert SSEParser().last_event_id == ""


# --------------------------------------------------------------------------- retry


def test_retry_with_ascii_digits_sets_the_reconnection_time() -> None:
    events, parser = run_parser([b"retry: 2500\ndata: x\n\ndata: y\n\n"])
    assert parser.retry == 2500 and [e.retry for e in events] == [2500, 2500]


@pytest.mark.parametrize(
    "value", ["3s", "+5", "-1", " 5", "5 ", "", "1_000", "1.5", "\uff15", "\u00b2"],
    ids=["unit", "plus", "minus", "two-spaces", "trailing-space", "empty", "underscore",
         "decimal", "fullwidth-digit", "superscript"],
)
def test_retry_not_made_of_ascii_digits_is_ignored(value: str) -> None:
    events, parser = run_parser([b"retry: 100\n\n", f"retry: {value}\ndata: x\n\n".encode()])
    assert parser.retry == 100 and events[0].retry == 100


@pytest.mark.parametrize("digits", [19, 5000], ids=["past-any-delay", "past-python-s-conversion-limit"])
def test_retry_of_more_digits_than_any_delay_is_ignored_and_the_stream_goes_on(digits: int) -> None:
    events, parser = run_parser([b"retry: 100\n\n", b"retry: " + b"9" * digits + b"\ndata: x\n\ndata: y\n\n"])
    assert parser.retry == 100 and [e.data for e in events] == ["x", "y"]
    assert run_parser([b"retry: " + b"9" * 18 + b"\n"])[1].retry == 10**18 - 1


def test_retry_takes_effect_without_an_event_being_dispatched() -> None:
    _, parser = run_parser([b"retry: 42\n"])
    assert parser.retry == 42


def test_retry_starts_unset() -> None:
    assert SSEParser().retry is None


# --------------------------------------------------------------------------- all together

AWKWARD = (
    b": ping\r\n"
    b"retry: 2500\n"
    b"event: token\n"
    b"data:  two spaces\n"
    b"data: second line\r\n"
    b"id: 7\n\n"
    b'data: {"t": "x"}\r\r'
    b"id: 8\x00\n"
    b"data: next\n\n"
    b"retry: 3s\n"
    b"data: cut off by a proxy\n"
)
AWKWARD_EVENTS = [
    ParsedEvent(event="token", data=" two spaces\nsecond line", id="7", retry=2500),
    ParsedEvent(event="message", data='{"t": "x"}', id="7", retry=2500),
    ParsedEvent(event="message", data="next", id="7", retry=2500),
]


def test_awkward_cases_combined_stream() -> None:
    assert parser_outcome([AWKWARD]) == (AWKWARD_EVENTS, "7", 2500)


def test_awkward_stream_byte_by_byte_gives_the_same_events() -> None:
    assert parser_outcome(byte_by_byte(AWKWARD)) == (AWKWARD_EVENTS, "7", 2500)


def test_awkward_stream_cut_anywhere_in_two_gives_the_same_events() -> None:
    for cut in range(len(AWKWARD) + 1):
        assert parser_outcome(split_at(AWKWARD, [cut])) == (AWKWARD_EVENTS, "7", 2500), cut


def test_awkward_stream_cut_at_random_points_gives_the_same_events() -> None:
    rng = random.Random(2024)
    for _ in range(300):
        points = rng.sample(range(1, len(AWKWARD)), rng.randint(1, 12))
        assert parser_outcome(split_at(AWKWARD, points)) == (AWKWARD_EVENTS, "7", 2500), points


def _feed_cpu_time(size: int) -> float:
    """CPU seconds of this thread to feed one ``size``-byte line in 8-byte chunks (best of 3):
    thread time does not count the time other processes held the core, so load cannot inflate it."""
    stream = b"data: " + b"x" * size + b"\n\n"
    best = float("inf")
    for _ in range(3):
        parser, start = SSEParser(), time.thread_time()
        for i in range(0, len(stream), 8):
            parser.feed(stream[i : i + 8])
        best = min(best, time.thread_time() - start)
    return best


def test_parser_time_is_linear_in_the_input_not_in_its_square() -> None:
    # One long line in small chunks: a parser that re-scans or re-joins its buffer per chunk is
    # quadratic, so 16 times the input takes about 256 times as long; a linear one about 16
    # times. The bound sits 4 times away from both.
    assert _feed_cpu_time(160_000) < 64 * _feed_cpu_time(10_000)
