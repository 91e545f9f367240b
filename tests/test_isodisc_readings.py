"""Notebooks 04 and 06 judge their hypotheses from the data: each verdict must be able to fail.

The synthetic tables below break one thing at a time and check that the verdict it decides turns
to FALSIFIED; the end-to-end run checks, on the tiny model over real HTTP, that a disconnect trial records
its release in steps.
"""
from __future__ import annotations

import pandas as pd
import pytest

from labkit.experiments import buffers, disconnect, leak
from labkit.experiments.client import launch_streams, run_sync
from labkit.experiments.profiles import Profile


def words(verdicts) -> dict[str, str]:
    return {v.name: v.word for v in verdicts}


# -- disconnect ----------------------------------------------------------------------------------
def _trial(kind="starlette", moment="mid", how="fin", steps=1.0, admitted=True, finish="cancelled", generated=5):
    return {"response_class": kind, "moment": moment, "repetition": 0, "leave_by": how, "tokens_read": 2,
            "tokens_generated": generated, "tokens_unread": 1, "admitted_before_leave": admitted,
            "ever_admitted": admitted, "close_to_release_ms": 5.0, "close_to_hub_close_ms": 1.0,
            "hub_close_to_release_steps": steps, "engine_finish": finish, "left": True, "error": None}


def _trials(**broken) -> dict[str, pd.DataFrame]:
    rows = [
        _trial(moment="waiting", admitted=False, generated=0),
        _trial(moment="before_first", how="fin", admitted=broken.get("fin_admitted", False), generated=0),
        _trial(moment="before_first", how="rst", admitted=False, generated=0),
        _trial(steps=broken.get("steps", 1.0)),
        _trial(kind="write_only", finish=broken.get("write_finish", "length"), steps=-1.0),
    ]
    return {"trials": pd.DataFrame(rows)}


def test_disconnect_verdicts_fail_on_what_they_claim():
    assert set(words(disconnect.verdicts(_trials())).values()) == {"holds"}
    assert words(disconnect.verdicts(_trials(steps=3.0)))["listening_releases_within_two_steps"] == "FALSIFIED"
    assert words(disconnect.verdicts(_trials(write_finish="eos")))["write_only_runs_to_limit"] == "FALSIFIED"
    assert words(disconnect.verdicts(_trials(fin_admitted=True)))["fin_rst_alike_before_first"] == "FALSIFIED"


def test_fin_rst_sentence_comes_from_the_counts():
    text = disconnect.findings(_trials(fin_admitted=True))
    assert "1 of 1 leaving by FIN and 0 of 1 leaving by RST" in text and "a different share" in text
    assert "the same share" in disconnect.findings(_trials())


def test_steps_between_close_and_release():
    class Rec:
        steps_at_close, release_step = 10, 11

    assert disconnect._steps_between(Rec()) == 1.0
    assert pd.isna(disconnect._steps_between(None))


# -- leak ----------------------------------------------------------------------------------------
def _outcome(**changes) -> dict[str, pd.DataFrame]:
    base = {"total_s": 1.0, "busy_steps": 10, "cache_whole": True, "held_blocks": 0, "running": 0, "waiting": 0,
            "open_streams": 0, "finished": 4, "streams": 4, "releases": 3, "admitted": 3, "hub_errors": 0,
            "cut": 0, "client_errors": 0, "left_early": 2}
    rows = [{"response_class": "starlette", **base, "generated_per_read_leavers": 1.1},
            {"response_class": "write_only", **base, "generated_per_read_leavers": 3.0, **changes}]
    return {"outcome": pd.DataFrame(rows)}


def test_leak_verdicts_fail_on_a_broken_book_or_wasted_work():
    assert set(words(leak.verdicts(_outcome())).values()) == {"holds"}
    assert words(leak.verdicts(_outcome(held_blocks=2)))["nothing_leaks"] == "FALSIFIED"
    assert words(leak.verdicts(_outcome(generated_per_read_leavers=1.0)))["listening_saves_work"] == "FALSIFIED"


def test_the_full_leak_test_runs_the_chapters_300_streams_and_ci_fewer():
    assert leak.Config.for_profile(Profile("full")).streams == 300
    assert leak.Config.for_profile(Profile("ci")).streams < 300


# -- buffers -------------------------------------------------------------------------------------
def _floods(accepted: int = 4_000_000, unread: int = 128_000) -> dict[str, pd.DataFrame]:
    floods = pd.DataFrame([
        {"event_bytes": size, "repetition": 0, "blocked": True, "server_finished": True, "bytes_accepted": accepted,
         "client_unread_bytes": unread, "client_rcvbuf": 131072}
        for size in (133, 65536)
    ])
    kernel = pd.DataFrame([
        {"setting": "net.ipv4.tcp_rmem", "min": 4096, "default": 131072, "max": 6_291_456},
        {"setting": "net.ipv4.tcp_wmem", "min": 4096, "default": 16384, "max": 4_194_304},
    ])
    return {"floods": floods, "kernel": kernel}


def test_buffer_verdicts_read_the_kernels_limits_and_can_fail():
    assert set(words(buffers.verdicts(_floods())).values()) == {"holds"}
    assert words(buffers.verdicts(_floods(accepted=9_000_000)))["bounded_by_the_kernel"] == "FALSIFIED"
    assert words(buffers.verdicts(_floods(accepted=140_000)))["send_buffer_grows"] == "FALSIFIED"
    no_kernel = {**_floods(), "kernel": pd.DataFrame(columns=["setting", "min", "default", "max"])}
    assert "bounded_by_the_kernel" not in words(buffers.verdicts(no_kernel))


def test_kernel_settings_are_read_not_typed():
    table = buffers.kernel_settings()
    if table.empty:
        pytest.skip("no /proc/sys/net/ipv4 here")
    with open("/proc/sys/net/ipv4/tcp_wmem") as f:
        assert buffers.kernel_value({"kernel": table}, "net.ipv4.tcp_wmem", "max") == int(f.read().split()[2])


@pytest.mark.parametrize("module", [disconnect, leak, buffers])
def test_every_checked_verdict_exists(module):
    tables = {
        disconnect: _trials(),
        leak: _outcome(),
        buffers: _floods(),
    }[module]
    assert set(module.CHECKED) <= set(words(module.verdicts(tables)))
