"""Notebook 04's measurements as a specification: the flood's verdicts against the kernel's limits
as read, the unread stream's verdict, and both runs against labkit in its own process."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from target_helpers import labkit_serve_process

from labkit.cli import main
from labkit.experiments import buffers, wire
from labkit.lab import NotMeasurable, Target, run

CI = buffers.FLOOD.sizes_for("ci")
KERNEL = {"tcp_wmem_min": 4096, "tcp_wmem_default": 16384, "tcp_wmem_max": 4_194_304, "tcp_rmem_min": 4096,
          "tcp_rmem_default": 131072, "tcp_rmem_max": 6_291_456}  # fmt: skip


def floods(accepted: dict[int, list[int]] | None = None, **change: Any) -> dict[str, pd.DataFrame]:
    """Six repetitions of two event sizes, as a flood trial reports them, then the derived tables."""
    accepted = accepted or {1024: [4_000_000] * 6, 65536: [4_060_000] * 6}
    rows = pd.DataFrame([
        {"event_bytes": size, "repetition": rep, "blocked": True, "bytes_accepted": n, "events_accepted": n // size,
         "client_unread_bytes": 128_000, "client_rcvbuf": 131072, "server_finished": True, "token_event_bytes": 65.0,
         "same_machine": True, **KERNEL, **change}
        for size, values in accepted.items() for rep, n in enumerate(values)
    ])  # fmt: skip
    tables = {"rows": rows}
    tables.update(buffers.FLOOD.tables(tables, CI))
    return tables


def outcomes(tables: dict[str, pd.DataFrame]) -> dict[str, str]:
    return {v.name: v.outcome for v in buffers.FLOOD.verdicts(tables, CI)}


def test_every_flood_verdict_holds_on_a_run_like_this_machine_s() -> None:
    assert set(outcomes(floods()).values()) == {"holds"}
    assert [v.name for v in buffers.FLOOD.verdicts(floods(), CI) if v.checked] == [
        "every flood blocks", "the server finishes after the leave", "bounded by the kernel", "the send buffer grows"]


@pytest.mark.parametrize("change, falsified", [
    ({"blocked": False}, "every flood blocks"),
    ({"server_finished": False}, "the server finishes after the leave"),
    ({"bytes_accepted": 9_000_000}, "bounded by the kernel"),  # past tcp_wmem max + rcvbuf + high water + event
    ({"client_unread_bytes": 3_990_000}, "the send buffer grows"),  # the server's side at most the default
])  # fmt: skip
def test_each_flood_verdict_can_fail(change: dict[str, Any], falsified: str) -> None:
    found = outcomes(floods(**change))
    assert found[falsified] == "falsified" and sum(v == "falsified" for v in found.values()) == 1, found


def test_bytes_not_events_is_judged_on_an_interval() -> None:
    apart = outcomes(floods({133: [250_000, 260_000, 255_000] * 2, 65536: [4_000_000, 4_100_000, 3_900_000] * 2}))
    assert apart["bytes, not events"] == "falsified"
    straddles = outcomes(floods({133: [1_000_000, 3_000_000, 2_000_000] * 2, 65536: [1_500_000, 4_000_000, 2_900_000] * 2}))
    assert straddles["bytes, not events"] == "unclear"


@pytest.mark.parametrize("change", [{"same_machine": False}, {k: None for k in KERNEL}])
def test_without_this_machine_s_kernel_limits_the_kernel_verdicts_are_unclear(change: dict[str, Any]) -> None:
    tables = floods(**change)
    found = outcomes(tables)
    assert found["bounded by the kernel"] == found["the send buffer grows"] == "unclear"
    if "tcp_wmem_max" in change:
        assert (tables["kernel"].iloc[0] == "not available on this platform (no /proc)").all()


def test_the_kernel_limits_are_read_from_proc_not_typed() -> None:
    path = Path("/proc/sys/net/ipv4/tcp_wmem")
    if not path.exists():
        pytest.skip("no /proc/sys/net/ipv4 here")
    assert buffers.kernel()["tcp_wmem_max"] == int(path.read_text().split()[2])


def test_a_platform_without_fionread_is_not_measurable(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "fcntl", None)  # as on Windows
    with pytest.raises(NotMeasurable, match="no FIONREAD"):
        buffers.unread_bytes(None)  # type: ignore[arg-type]


def unread_rows(**change: Any) -> dict[str, pd.DataFrame]:
    row = {"tokens": 200, "bytes": 13_900, "waiting_bytes": 15_300, "end_waiting": True, "failure": None}
    return {"rows": pd.DataFrame([row, {**row, **change}])}


HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"


@pytest.mark.parametrize("sent, waiting", [
    (HEAD + b"transfer-encoding: chunked\r\n\r\n7\r\ndata: 1\r\n0\r\n\r\n", True),
    (HEAD + b"transfer-encoding: chunked\r\n\r\n7\r\ndata: 1\r\n", False),  # the last chunk not yet sent
    (HEAD + b"content-length: 7\r\n\r\ndata: 1", True),
    (HEAD + b"content-length: 9\r\n\r\ndata: 1", False),
    (HEAD + b"\r\ndata: 1\n\n", None),  # ends when the server closes: no peek sees that
    (b"", False), (b"HTTP/1.1 20", False), (b"not http at all\r\n\r\n", False),
])  # fmt: skip
def test_a_whole_answer_waiting_unread_is_seen_by_peeking_and_stays_to_be_read(sent: bytes, waiting: Any) -> None:
    import socket

    ours, server = socket.socketpair()
    with ours, server:
        server.sendall(sent)
        assert buffers.answer_waiting(ours, 1 << 20) is waiting
        assert buffers.unread_bytes(ours) == len(sent)  # peeked, not read


@pytest.mark.parametrize("change, outcome", [
    ({}, "holds"), ({"end_waiting": False}, "falsified"), ({"failure": "the stream was cut off before its end"}, "falsified"),
])  # fmt: skip
def test_the_unread_verdict_can_fail(change: dict[str, Any], outcome: str) -> None:
    verdict = buffers.UNREAD.verdicts(unread_rows(**change), buffers.UNREAD.sizes_for("ci"))[0]
    assert verdict.outcome == outcome and verdict.checked


def test_flood_sizes_are_checked_by_name_and_kind() -> None:
    with pytest.raises(ValueError, match="event_size"):
        buffers.FLOOD.sizes_for("ci", event_size=(1024,))
    assert buffers.FLOOD.sizes_for("ci", event_sizes=[133]).event_sizes == (133,)


@pytest.mark.slow
def test_labkit_run_buffers_against_labkit_serve_in_its_own_process(tmp_path, monkeypatch, capsys) -> None:
    """With lab routes both witnesses run; without them the flood is skipped by name and the
    client's own witness still runs."""
    monkeypatch.setenv("LABKIT_OUT", str(tmp_path))
    with labkit_serve_process("--lab-routes") as (url, _):
        assert main(["run", "buffers", "--target", url, "--profile", "ci", "--set", "event_sizes=(16384,65536)",
                     "--set", "repetitions=1", "--set", "streams=2", "--no-figures"]) == 0  # fmt: skip
    flood = json.loads((tmp_path / "data" / "target-buffers" / "flood" / "results.json").read_text())
    assert {v["name"]: v["outcome"] for v in flood["verdicts"] if v["checked"]} == dict.fromkeys(
        ["every flood blocks", "the server finishes after the leave", "bounded by the kernel", "the send buffer grows"],
        "holds")  # fmt: skip
    with labkit_serve_process() as (url, _):
        assert main(["run", "buffers", "--target", url, "--profile", "ci", "--set", "streams=2"]) == 0
    assert "skipped buffers.flood needs labkit's own server: it has no lab routes" in capsys.readouterr().out
    unread = json.loads((tmp_path / "data" / "target-buffers" / "unread" / "results.json").read_text())
    assert [v["outcome"] for v in unread["verdicts"]] == ["holds"]


@pytest.mark.parametrize("spec", [buffers.UNREAD, wire.RAW], ids=lambda s: s.name)
def test_what_needs_the_raw_reader_is_not_measurable_over_https(spec: Any) -> None:
    """No connection is made: the remote host is only named."""
    result = run(spec, Target("https://gpu-node-3.cluster.example:8000/v1"), save=False, show=False)
    assert list(result.table("not_measurable").because) == ["the raw reader speaks plain http only"]
    assert result.table("rows").empty and result.verdicts == []
