"""Notebook 01's measurements as a specification: raw bytes taken apart, the client's contract
checked stream by stream (against labkit's own API and an OpenAI one), and the awkward cases.

The expectations for the awkward cases are the WHATWG "event stream interpretation" rules applied
by hand to each case's bytes, written here a second time, apart from the lab's table, so that a
wrong expectation there cannot make its own check pass.
"""
from __future__ import annotations

import json
from typing import Any

import pandas as pd
import pytest
from target_helpers import STUB_MODEL, labkit_serve_process, quirky_stub, uvicorn_in_thread
from wire_helpers import httpx_sse_events

from labkit.cli import main
from labkit.experiments import wire
from labkit.experiments.wire_cases import AWKWARD, CASES, escaped, httpx_sse, ours
from labkit.lab import LocalLab, Stream, Target, run
from labkit.lab.stream import TimedEvent
from labkit.lab.target import Quirks
from labkit.sse import parse

M = "message"
SPEC: dict[str, list[tuple[str, str, str, int | None]]] = {
    "CRLF line ends": [(M, "a", "", None), (M, "b", "", None)],  # CRLF, CR and LF each end a line
    "CR-only line ends": [(M, "a", "", None), (M, "b", "", None)],
    "CRLF cut across reads": [(M, "a", "", None)],  # the LF after a CR is the same line end
    "comments": [(M, "x", "", None)],  # a line beginning with a colon is ignored
    "multi-line data": [(M, "one\ntwo", "", None)],  # data lines are joined with one LF
    "BOM at the start": [(M, "x", "", None)],  # the decoder drops one leading BOM
    "field with no colon": [(M, "", "", None), (M, "y", "", None)],  # the whole line names the field
    "blank line inside a payload": [(M, '{"text": "a', "", None)],  # 'b"}' is then an unknown field
    "id with a NUL": [(M, "a", "1", None), (M, "b", "1", None)],  # the id with NUL is ignored
    "retry not a number": [(M, "a", "", None), (M, "b", "", 1500)],  # "soon" ignored, 1500 kept
    "blank line cut across reads": [(M, "a", "", None), (M, "b", "", None)],
    "character cut across reads": [(M, "é", "", None)],  # UTF-8 decoded across reads
}
BY_NAME = {name: reads for name, reads, _, _ in CASES}


# -- awkward input ---------------------------------------------------------------------------------
def test_every_case_has_an_independent_expectation_and_the_lab_table_states_the_same() -> None:
    assert {name for name, *_ in CASES} == set(SPEC)
    for name, _, _, expected in CASES:
        assert list(expected) == SPEC[name], name


@pytest.mark.parametrize("name", SPEC)
def test_our_parser_follows_the_rules_however_the_bytes_are_cut(name: str) -> None:
    whole = b"".join(BY_NAME[name])
    byte_by_byte = tuple(whole[i : i + 1] for i in range(len(whole)))
    assert [e for e, _ in ours(BY_NAME[name])] == [e for e, _ in ours(byte_by_byte)] == SPEC[name]
    assert [(e.event, e.data, e.id, e.retry) for e in parse(whole)] == SPEC[name]


@pytest.mark.parametrize("name", SPEC)
def test_httpx_sse_read_by_read_gives_what_its_connect_sse_gives(name: str) -> None:
    assert [e for e, _ in httpx_sse(BY_NAME[name])] == httpx_sse_events(list(BY_NAME[name]))


def test_the_awkward_table_finds_the_bom_departure_and_the_cr_held_back() -> None:
    result = run(AWKWARD, LocalTarget(), save=False, show=False)
    rows = result.table().set_index("case")
    assert rows["ours follows"].all() and not rows.loc["BOM at the start", "httpx-sse follows"]
    assert not rows.loc["CR-only line ends", "same reads"] and "@end" in rows.loc["CR-only line ends", "httpx-sse"]
    assert rows.loc["comments", "same reads"] and rows.loc["comments", "same events"]
    assert [v.outcome for v in result.verdicts] == ["holds", "holds"]
    assert "httpx-sse departs on: BOM at the start" in result.verdicts[1].evidence


def _awkward(**changes: Any) -> dict[str, pd.DataFrame]:
    row = {"case": "c", "ours follows": True, "httpx-sse follows": True, "same events": True, "same reads": True}
    return {"rows": pd.DataFrame([row, {**row, "case": "d", **changes}])}


@pytest.mark.parametrize("changes, outcomes", [
    ({}, ["holds", "holds"]),
    ({"ours follows": False, "same events": False}, ["falsified", "holds"]),
    ({"same events": False}, ["holds", "falsified"]),
    ({"httpx-sse follows": False, "same events": False}, ["holds", "holds"]),  # a departure, not a disagreement
])  # fmt: skip
def test_awkward_verdicts_can_fail(changes: dict[str, Any], outcomes: list[str]) -> None:
    assert [v.outcome for v in wire.AWKWARD.verdicts(_awkward(**changes), wire.AWKWARD.sizes_for("ci"))] == outcomes


def test_escaped_shows_line_ends_control_bytes_and_the_bom() -> None:
    assert escaped(b"a\r\nb\x00") == "a\\r\\nb\\x00" and escaped("\ufeffz".encode()) == "\\ufeffz"


# -- raw bytes -------------------------------------------------------------------------------------
def test_dechunk_reads_sizes_in_hex_extensions_and_the_last_chunk() -> None:
    body = b"3\r\nabc\r\n10;ext=1\r\n" + b"x" * 16 + b"\r\n0\r\n\r\n"
    assert wire.dechunk(body) == [("3", b"abc"), ("10;ext=1", b"x" * 16), ("0", b"")]


@pytest.mark.parametrize("payloads, kinds", [
    ([b"data: a\n\n", b"event: t\ndata: b\n\n", b""], ["one", "one"]),
    ([b"data: a\r\n\r\n", b": ping\n\n"], ["one", "one"]),  # a comment block is a block too
    ([b"data: a\n", b"\ndata: b\n\n"], ["part", "several"]),  # the second ends the first event, then holds one
    ([b"data: a\n", b"\n", b"data: b\n\n"], ["part", "part", "one"]),
    ([b"data: a\n\ndata: b\n\n"], ["several"]),
])  # fmt: skip
def test_chunks_are_classed_by_the_events_they_hold(payloads: list[bytes], kinds: list[str]) -> None:
    assert wire.chunk_kinds(payloads) == kinds


@pytest.mark.parametrize("part, several, outcome", [(0, 0, "holds"), (1, 0, "falsified"), (0, 2, "falsified")])
def test_the_chunk_verdict_counts_every_capture(part: int, several: int, outcome: str) -> None:
    rows = pd.DataFrame([{"chunks": 18, "one": 18, "part": 0, "several": 0},
                         {"chunks": 18 + part + several, "one": 18, "part": part, "several": several}])  # fmt: skip
    assert wire.RAW.verdicts({"rows": rows}, wire.RAW.sizes_for("ci"))[0].outcome == outcome


# -- the contract ----------------------------------------------------------------------------------
def _event(event: str, data: dict[str, Any], nbytes: int = 60) -> TimedEvent:
    return TimedEvent(0.0, nbytes, event, "", json.dumps(data))


def labkit_pair(*, usage: dict[str, int] | None = None, rid: str = "req-1") -> tuple[Stream, Stream]:
    streamed = Stream(api="labkit", status=200, content_type="text/event-stream; charset=utf-8", request_id=rid)
    events = [_event("start", {"request_id": "req-1"}, 100),
              *(_event("token", {"index": i, "id": 7 + i, "text": t}) for i, t in enumerate(["a", "b"])),
              _event("done", {"finish_reason": "length", **({"usage": usage} if usage else {})}, 100)]  # fmt: skip
    for n, e in enumerate(events, 1):
        streamed.add(e)
        streamed.last_event_id = str(n)
    streamed.total_bytes = sum(e.nbytes for e in events)
    whole = Stream(api="labkit", status=200, content_type="application/json")
    whole.body = {"text": "ab", "token_ids": [7, 8], "finish_reason": "length", **({"usage": usage} if usage else {})}
    return streamed, whole


def test_a_labkit_stream_that_matches_its_whole_answer_passes_every_check() -> None:
    row = wire.contract_row(*labkit_pair(usage={"prompt_tokens": 3, "completion_tokens": 2}))
    assert all(row[c] for c, _ in wire.CHECKS), row
    assert (row["tokens"], row["bytes"], row["token_event_bytes"]) == (2, 320, 120)


def test_two_missing_values_are_not_the_same_answer() -> None:
    row = wire.contract_row(*labkit_pair(usage=None))
    assert row["usage"] is False and row["text"] and row["token_ids"]


def test_a_wrong_request_id_and_a_missing_whole_answer_fail_their_checks() -> None:
    streamed, whole = labkit_pair(usage={"prompt_tokens": 3, "completion_tokens": 2}, rid="req-2")
    whole.error = "HTTP 503: shutting down"
    row = wire.contract_row(streamed, whole)
    assert not row["request_id"] and not row["text"] and not row["token_ids"] and row["failure"].startswith("HTTP")


def test_openai_chunks_are_classed_and_their_order_checked() -> None:
    chunks = [{"choices": [{"delta": {"role": "assistant", "content": ""}, "finish_reason": None}]},
              {"choices": [{"delta": {"content": "hi"}, "finish_reason": None}]},
              {"choices": [{"delta": {}, "finish_reason": "length"}]}, {"choices": [], "usage": {"total_tokens": 3}},
              {"raw": "[DONE]"}]  # fmt: skip
    streamed = Stream(api="openai-chat", status=200, content_type="text/event-stream")
    for c in chunks:
        streamed.add(_event("message", c))
    assert [wire.kind(e, "openai-chat") for e in streamed.events] == ["role", "token", "finish", "usage", "[DONE]"]
    whole = Stream(api="openai-chat", status=200, content_type="application/json")
    whole.body = {"choices": [{"message": {"content": "hi"}, "finish_reason": "length"}], "usage": {"total_tokens": 3}}
    row = wire.contract_row(streamed, whole)
    assert all(row[c] for c in ("content_type", "order", "text", "usage", "finish_reason", "nothing_cut"))
    assert "request_id" not in row and "token_ids" not in row
    streamed.events.insert(1, streamed.events.pop())  # [DONE] before the tokens
    assert not wire.contract_row(streamed, whole)["order"]


def _contract_rows(n: int, failing: str | None = None, native: bool = True, share: float = 0.8) -> pd.DataFrame:
    rows = []
    for i in range(n):
        row = {c: True for c, _ in wire.CHECKS if native or c not in ("request_id", "token_ids", "last_event_id")}
        if failing and i == 0:
            row[failing] = False
        rows.append({"prompt": i, **row, "tokens": 16, "finish": "length", "bytes": 1000,
                     "token_event_bytes": int(1000 * share), "empty_deltas": 0, "failure": None})  # fmt: skip
    return pd.DataFrame(rows)


@pytest.mark.parametrize("failing, share, outcomes", [
    (None, 0.8, ["holds", "holds"]), ("usage", 0.8, ["falsified", "holds"]), (None, 0.4, ["holds", "falsified"]),
])  # fmt: skip
def test_contract_verdicts_can_fail(failing: str | None, share: float, outcomes: list[str]) -> None:
    s = wire.CONTRACT.sizes_for("ci")
    tables = {"rows": _contract_rows(4, failing, share=share)}
    tables.update(wire.CONTRACT.tables(tables, s))
    assert [v.outcome for v in wire.CONTRACT.verdicts(tables, s)] == outcomes
    beside = tables["beside_chapter"].set_index("quantity")["this run"]
    assert beside["streams passing every check"] == ("3 of 4" if failing else "4 of 4")


def test_checks_needing_labkit_s_events_are_not_measurable_rows_against_an_openai_target() -> None:
    s = wire.CONTRACT.sizes_for("ci")
    tables = {"rows": _contract_rows(3, native=False)}
    tables.update(wire.CONTRACT.tables(tables, s))
    checks = tables["checks"]
    missing = checks[checks.passed.isna()]
    assert len(missing) == 3 and missing.note.str.startswith("not measurable against this target, because").all()
    verdict = wire.CONTRACT.verdicts(tables, s)[0]
    assert verdict.outcome == "holds" and "3 not measurable" in verdict.evidence


@pytest.mark.parametrize("override", [{"prompts": "40"}, {"prompt": 4}])
def test_sizes_are_checked_by_name_and_kind(override: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        wire.CONTRACT.sizes_for("ci", **override)


# -- against real servers --------------------------------------------------------------------------
class LocalTarget:
    """What AWKWARD's runner needs of a target: it measures nothing over the network."""

    def __init__(self) -> None:
        from labkit.lab.target import Caps

        self.caps, self.name, self.tally = Caps(), "none", {}

    def need(self, *caps: str, what: str = "") -> None: ...

    def variant(self, **settings: Any) -> LocalTarget:
        return self


def test_raw_captures_of_a_real_server_are_chunked_http_with_one_event_a_chunk(tiny_gpt2: Any) -> None:
    with LocalLab(tiny_gpt2) as target:
        raw = run(wire.RAW, target, save=False, show=False, captures=2, tokens=4)
    lines = list(raw.table("raw").line)
    assert lines[0] == "HTTP/1.1 200 OK\\r\\n" and "Transfer-Encoding: chunked\\r\\n" in lines
    assert "content-type: text/event-stream; charset=utf-8\\r\\n" in lines and lines[-2:] == ["0\\r\\n", "\\r\\n"]
    chunks = raw.table("chunks")
    assert [int(x, 16) for x in chunks["size line"]] == list(chunks.bytes) and chunks.bytes.iloc[-1] == 0
    assert list(raw.table().tokens) == [3, 4, 4] and raw.verdicts[0].outcome == "holds"


def test_a_server_without_done_or_usage_fails_those_checks_and_passes_the_rest() -> None:
    """The stub sends no ``data: [DONE]`` and no usage; its streams end early unless min_tokens asks.
    A finish reason ends an OpenAI stream whole, so nothing is cut; the missing usage fails."""
    with uvicorn_in_thread(quirky_stub()) as url:
        target = Target(url, model=STUB_MODEL, quirks=Quirks(eos_flag="min_tokens"))
        contract = run(wire.CONTRACT, target, save=False, show=False, prompts=3, tokens=6, concurrency=3)
    checks = contract.table("checks").set_index("check").passed
    passed = {c: checks[what] for c, what in wire.CHECKS}
    assert passed["usage"] == 0 and passed["nothing_cut"] == 3  # two missing usages do not pass
    assert passed["content_type"] == passed["order"] == passed["text"] == passed["finish_reason"] == 3
    assert contract.verdicts[0].outcome == "falsified" and (contract.table().tokens == 6).all()


@pytest.mark.slow
def test_labkit_run_wire_against_labkit_serve_in_its_own_process(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("LABKIT_OUT", str(tmp_path))
    with labkit_serve_process() as (url, _):
        assert main(["run", "wire", "--target", url, "--profile", "ci", "--set", "prompts=4"]) == 0
    printed = capsys.readouterr().out
    assert "witness: lab" in printed and "every stream keeps the client's contract" in printed
    record = json.loads((tmp_path / "data" / "target-wire" / "contract" / "results.json").read_text())
    assert [v["outcome"] for v in record["verdicts"]] == ["holds", "holds"]
    checks = pd.read_csv(tmp_path / "data" / "target-wire" / "contract" / "checks.csv")
    assert checks.note.fillna("").str.startswith("not measurable").sum() == 3  # the OpenAI API, no labkit events
