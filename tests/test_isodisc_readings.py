"""Notebooks 02, 04 and 06 judge their hypotheses from the data: each verdict must be able to fail.

The synthetic tables below break one thing at a time and check that the verdict it decides turns
to FALSIFIED; the two end-to-end runs check, on the tiny model over real HTTP, that the isolation
counterfactual measures both modes and dates each stream in engine steps, and that a disconnect
trial records its release in steps.
"""
from __future__ import annotations

import pandas as pd
import pytest

from labkit.experiments import disconnect, isolation, leak
from labkit.experiments.client import launch_streams, run_sync
from labkit.experiments.profiles import Profile


def words(verdicts) -> dict[str, str]:
    return {v.name: v.word for v in verdicts}


# -- isolation ------------------------------------------------------------------------------------
def _iso_rows(differ: dict[tuple[str, int], bool]) -> pd.DataFrame:
    rows = []
    for mode in ("invariant", "plain"):
        for level in (1, 4):
            for prompt in range(level):
                bad = differ.get((mode, level), False) and prompt == 0
                rows.append({"mode": mode, "level": level, "repetition": 0, "prompt": prompt, "tokens": 8,
                             "identical": not bad, "first_diff": 3 if bad else None, "margin": float("nan")})
    return pd.DataFrame(rows)


def test_isolation_verdicts_fail_on_the_stream_that_differs():
    clean = words(isolation.verdicts({"streams": _iso_rows({("plain", 4): True})}))
    assert clean == {"invariant_equals_solo": "holds", "alone_equals_solo": "holds", "plain_diverges": "holds"}
    broken = words(isolation.verdicts({"streams": _iso_rows({("invariant", 4): True, ("plain", 1): True})}))
    assert broken["invariant_equals_solo"] == "FALSIFIED"
    assert broken["alone_equals_solo"] == "FALSIFIED"
    assert words(isolation.verdicts({"streams": _iso_rows({})}))["plain_diverges"] == "FALSIFIED"


def test_isolation_report_checks_the_invariant_mode_only():
    plain_differs = {"streams": _iso_rows({("plain", 4): True})}
    assert isolation.report(plain_differs) == "every concurrent stream had token ids identical to its solo run"
    assert "differed" in isolation.report({"streams": _iso_rows({("invariant", 4): True})})


def test_isolation_tables_from_before_the_counterfactual_still_read_as_the_invariant_mode():
    old = _iso_rows({}).drop(columns="mode")
    assert set(isolation.levels_table(old)["mode"]) == {"invariant"}
    assert isolation.summary({"streams": old})["invariant"]["streams"] == len(old)


def test_isolation_runs_both_modes_and_dates_each_stream_in_steps(tiny_gpt2):
    config = isolation.Config(model="tiny-gpt2", levels=(1, 2), repetitions=1, max_new_tokens=6)
    from labkit.server import serve_in_thread

    with serve_in_thread(tiny_gpt2, **isolation._settings(config, "invariant")) as server:
        tables = isolation.run(config, server=server)
    streams = tables["streams"]
    assert set(streams["mode"]) == {"invariant", "plain"}
    assert len(streams) == 2 * (1 + 2)
    assert streams.admitted_step.notna().all() and (streams.admitted_step >= 1).all()
    assert set(tables["steps"]["mode"]) == {"invariant", "plain"} and len(tables["steps"]) > 0
    assert set(tables["solo"]["mode"]) == {"invariant", "plain"}
    assert streams[streams["mode"] == "invariant"].identical.all()


def test_divergence_step_counts_one_token_per_step_from_the_first(server):
    launch = run_sync(launch_streams(server.url, [{"prompt": "Hello", "max_new_tokens": 5, "ignore_eos": True}]))
    rid = launch.results[0].request_id
    dated = isolation._divergence_step(server.url, rid, 3)
    record = server.hub.record(rid)
    assert dated["diverged_step"] == dated["admitted_step"] + 3
    assert dated["admitted_step"] + record.tokens_generated - 1 == record.release_step


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


@pytest.mark.parametrize("module", [isolation, disconnect, leak])
def test_every_checked_verdict_exists(module):
    tables = {
        isolation: {"streams": _iso_rows({})},
        disconnect: _trials(),
        leak: _outcome(),
    }[module]
    assert set(module.CHECKED) <= set(words(module.verdicts(tables)))
