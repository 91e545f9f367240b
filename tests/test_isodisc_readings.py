"""Notebooks 02, 04 and 06 judge their hypotheses from the data: each verdict must be able to fail.

The synthetic tables below break one thing at a time and check that the verdict it decides turns
to FALSIFIED; the two end-to-end runs check, on the tiny model over real HTTP, that the isolation
counterfactual measures both modes and dates each stream in engine steps, and that a disconnect
trial records its release in steps.
"""
from __future__ import annotations

import pandas as pd
import pytest

from labkit.experiments import buffers, isolation
from labkit.experiments.client import launch_streams, run_sync


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


# -- leak ----------------------------------------------------------------------------------------


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


@pytest.mark.parametrize("module", [isolation, buffers])
def test_every_checked_verdict_exists(module):
    tables = {
        isolation: {"streams": _iso_rows({})},
        buffers: _floods(),
    }[module]
    assert set(module.CHECKED) <= set(words(module.verdicts(tables)))
