"""The lab's rules for a reading: interleaved repetitions, spread, verdicts, the machine record,
and the step clock read over HTTP."""

from __future__ import annotations

import httpx
import pandas as pd
import pytest

from labkit.experiments.readings import (
    MachineState,
    Verdict,
    fetch_steps,
    interleaved,
    machine_record,
    quiet_line,
    span,
    spread,
    step_spread,
    verdict_lines,
    verdict_table,
)


def test_repetitions_are_interleaved_a_b_c_a_b_c():
    order = list(interleaved(["a", "b", "c"], 2))
    assert order == [(0, "a"), (0, "b"), (0, "c"), (1, "a"), (1, "b"), (1, "c")]
    with pytest.raises(ValueError):
        list(interleaved(["a"], 0))


def test_spread_gives_median_min_max_and_the_count_per_condition():
    table = pd.DataFrame({"level": [1, 1, 1, 4, 4, 4], "s": [1.0, 3.0, 2.0, 10.0, 30.0, 20.0]})
    out = spread(table, "level", "s").set_index("level")
    assert out.loc[1, ["n", "s_median", "s_min", "s_max"]].tolist() == [3, 2.0, 1.0, 3.0]
    assert out.loc[4, "s_median"] == 20.0
    assert span([1.0, 3.0, 2.0], "{:.1f}", " s") == "2.0 s (1.0–3.0 s)"
    assert span([]) == "n/a"


def test_a_verdict_line_names_the_hypothesis_and_the_verdict_without_numbers():
    v = [
        Verdict("overlap", "more streams, more tokens/s", "32 streams < 2x one", True, "9.1x (8.0-9.9)"),
        Verdict("isolation", "same tokens", "any stream differs", False, "2 of 32 differ"),
    ]
    assert verdict_lines(v) == "overlap: holds\nisolation: FALSIFIED"
    table = verdict_table(v)
    assert table.loc["isolation", "verdict"] == "FALSIFIED"
    assert table.loc["overlap", "evidence"] == "9.1x (8.0-9.9)"


def test_the_machine_record_counts_other_processes_cpu_not_ours():
    before = MachineState.now()
    x = 0
    for i in range(2_000_000):  # burn some CPU of our own: it must not count as "others"
        x += i
    after = MachineState.now()
    record = machine_record(before, after)
    assert record["cpu_s"] > 0
    assert record["others_cpu_share"] is not None and 0 <= record["others_cpu_share"] <= 1
    assert record["quiet"] == (record["others_cpu_share"] < 0.10)
    assert "CPUs" in quiet_line(record)
    assert quiet_line(None).startswith("No record")


def test_step_spread_separates_decode_only_steps():
    steps = pd.DataFrame(
        {
            "step": [1, 2, 3, 4],
            "started": [0.0, 1.0, 2.0, 3.0],
            "seconds": [0.5, 0.01, 0.02, 0.03],
            "decoded": [0, 2, 2, 2],
            "prefilled": [2, 0, 0, 0],
        }
    )
    s = step_spread(steps)
    assert s["all"]["n"] == 4 and s["decode_only"]["n"] == 3
    assert s["decode_only"]["p50_ms"] == pytest.approx(20.0)
    assert s["all"]["max_ms"] == pytest.approx(500.0)


def test_the_step_log_is_read_over_http_and_counts_every_step(server):
    before = fetch_steps(server.url)
    since = int(before["step"].max()) if len(before) else 0
    r = httpx.post(
        f"{server.url}/v1/generate", json={"prompt": "Hello", "max_new_tokens": 5, "ignore_eos": True}, timeout=30
    )
    assert r.status_code == 200
    steps = fetch_steps(server.url, since=since)
    assert len(steps) >= 5  # a prefill step and at least four decode steps
    assert (steps["step"].diff().dropna() == 1).all()  # numbered without gaps
    assert (steps["seconds"] > 0).all()
    assert steps["decoded"].max() == 1
