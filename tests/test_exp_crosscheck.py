"""Notebook 03's cross-check: the lab's client beside GuideLLM on one server.

The verdicts come out both ways on rows made by hand, and a machine without GuideLLM gets a "not
measurable" row naming how to install it. The real thing (GuideLLM and the lab's client against a
``labkit serve`` process the lab starts) is notebook 03's section 6, whose checked line nbval
compares in ``make test``.
"""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
import pytest

from labkit.experiments import crosscheck, overlap
from labkit.lab import LocalLab, NotMeasurable, Sizes
from labkit.lab.witness import step_table

SIZES = crosscheck.GUIDELLM.sizes_for("ci")


def _rows(guidellm_tps: float = 100.0, guidellm_itl: float = 10.0, failed: int = 0,
          guidellm_step: float | None = None, together_tps: float = 50.0, together_itl: float = 20.0) -> pd.DataFrame:
    """Three runs a client in turns; the server's period is the client's ITL unless ``guidellm_step``
    says otherwise. And three runs of both at once, half the streams each: the lab client's 50
    tokens/s at 20 ms, GuideLLM's ``together_tps`` at ``together_itl``."""
    rows, half = [], SIZES.streams // 2
    for rep in range(3):
        rows.append({"tool": "lab client", "repetition": rep, "streams": SIZES.streams,
                     "tokens": SIZES.streams * SIZES.tokens, "tokens_per_s": 100.0 + rep, "itl_ms": 10.0 + rep / 10,
                     "failed": 0, "at_once": False, "server_period_ms": 10.0})  # fmt: skip
        rows.append({"tool": "GuideLLM", "repetition": rep, "streams": SIZES.streams,
                     "tokens": SIZES.streams * SIZES.tokens, "tokens_per_s": guidellm_tps + rep,
                     "itl_ms": guidellm_itl, "failed": failed, "at_once": False,
                     "server_period_ms": guidellm_itl if guidellm_step is None else guidellm_step})  # fmt: skip
        for tool, tps, itl in (("lab client", 50.0, 20.0), ("GuideLLM", together_tps, together_itl)):
            rows.append({"tool": tool, "repetition": rep, "streams": half, "tokens": half * SIZES.tokens,
                         "tokens_per_s": tps, "itl_ms": itl, "failed": 0, "at_once": True,
                         "server_period_ms": 20.0})  # fmt: skip
    return pd.DataFrame(rows)


def _said(rows: pd.DataFrame) -> dict[str, str]:
    return {v.name: v.outcome for v in crosscheck.verdicts({"rows": rows}, SIZES)}


def test_two_clients_that_read_the_same_pace_agree():
    assert set(_said(_rows()).values()) == {"holds"}


def test_a_client_that_sees_half_the_throughput_or_twice_the_latency_disagrees():
    assert _said(_rows(guidellm_tps=50.0))["tokens/s agree"] == "falsified"
    assert _said(_rows(guidellm_itl=20.0))["inter-token latency agrees"] == "falsified"
    assert _said(_rows(failed=1))["both clients whole"] == "falsified"


def test_a_client_that_slowed_the_server_still_reads_the_server_s_own_pace():
    """GuideLLM's processes share the cores: the server steps at 20 ms under it, 10 under the lab's."""
    said = _said(_rows(guidellm_tps=50.0, guidellm_itl=20.0))
    assert said["inter-token latency agrees"] == "falsified"
    assert said["each client reads the server's own pace"] == "holds"


def test_read_at_once_the_two_agree_or_part_run_by_run():
    """The at-once runs are judged apart from the turns: each run's two ratios within 0.8-1.25."""
    said = _said(_rows(guidellm_tps=50.0, guidellm_itl=20.0))
    assert said["tokens/s agree"] == "falsified" and said["read at once, the two agree"] == "holds"
    assert _said(_rows(together_tps=30.0))["read at once, the two agree"] == "falsified"
    one_run_off = _rows()
    one_run_off.loc[(one_run_off.tool == "GuideLLM") & one_run_off.at_once & (one_run_off.repetition == 1),
                    "itl_ms"] = 30.0  # fmt: skip
    said = _said(one_run_off)
    assert said["read at once, the two agree"] == "falsified" and said["inter-token latency agrees"] == "holds"


def test_without_runs_at_once_that_verdict_is_unclear_and_the_turns_are_judged_as_before():
    """Rows of the turns alone: the at-once verdict has nothing to judge."""
    old = _rows().query("not at_once")
    said = _said(old)
    assert said["read at once, the two agree"] == "unclear"
    assert {said[name] for name in said if name != "read at once, the two agree"} == {"holds"}
    assert crosscheck.tables({"rows": old}, SIZES)["at_once"].empty


def test_a_half_that_came_short_is_not_whole():
    rows = _rows()
    rows.loc[rows.at_once & (rows.tool == "lab client") & (rows.repetition == 0), "tokens"] -= 1
    assert _said(rows)["both clients whole"] == "falsified"


def test_a_client_whose_latency_is_not_the_server_s_step_misreads():
    assert _said(_rows(guidellm_itl=20.0, guidellm_step=10.0))["each client reads the server's own pace"] == "falsified"


def test_without_a_step_log_the_pace_check_is_unclear():
    rows = _rows().assign(server_period_ms=float("nan"))
    assert _said(rows)["each client reads the server's own pace"] == "unclear"
    assert _said(rows.drop(columns="server_period_ms"))["each client reads the server's own pace"] == "unclear"
    tables = crosscheck.tables({"rows": rows.drop(columns="server_period_ms")}, SIZES)
    assert tables["tools"].shape[0] == 2 and tables["tools"].n.tolist() == [3, 3], "the turns only"
    assert tables["at_once"].n.tolist() == [3, 3]


def test_one_run_outside_the_band_falsifies_even_beside_runs_without_a_period():
    rows = _rows()
    rows.loc[0, "server_period_ms"] = float("nan")
    rows.loc[1, "server_period_ms"] = 5.0  # GuideLLM's first run: ITL 10 ms at a 5 ms period
    assert _said(rows)["each client reads the server's own pace"] == "falsified"


def test_a_client_with_no_run_beside_a_period_leaves_the_pace_check_unclear():
    rows = _rows()
    rows.loc[rows.tool == "GuideLLM", "server_period_ms"] = float("nan")
    said = {v.name: v for v in crosscheck.verdicts({"rows": rows}, SIZES)}["each client reads the server's own pace"]
    assert said.outcome == "unclear" and "GuideLLM" in said.evidence


class _StepLog:
    """A step log as ``GET /lab/steps`` gives it: (step, started, seconds, decoded, prefilled)."""

    def __init__(self, steps: list[tuple]) -> None:
        self.rows = [dict(zip(["step", "started", "seconds", "decoded", "prefilled"], s)) for s in steps]

    def steps(self, since: int) -> pd.DataFrame:
        return step_table([r | {"prefill_tokens": 4 * r["prefilled"], "surge": False} for r in self.rows])


def test_the_period_runs_start_to_start_between_consecutive_decode_only_steps():
    log = _StepLog([(1, 0.00, 0.05, 0, 4), (2, 0.10, 0.05, 4, 0), (3, 0.20, 0.05, 4, 0), (4, 0.35, 0.05, 4, 1),
                    (5, 0.50, 0.05, 4, 0), (6, 0.65, 0.05, 4, 0), (8, 1.30, 0.05, 4, 0)])  # fmt: skip
    # 2->3: 100 ms; 5->6: 150 ms; not after a prefill (1->2, 4->5) nor across a gap in the numbers (6->8)
    assert crosscheck.server_period_ms(log, 0) == pytest.approx(125.0)
    assert math.isnan(crosscheck.server_period_ms(_StepLog([(1, 0.0, 0.05, 4, 0)]), 0)), "one step: no period"
    assert math.isnan(crosscheck.server_period_ms(log, None))


def test_the_server_period_is_read_from_a_real_server_s_step_log(tiny_gpt2):
    """The lab client's ITL against the in-thread server and that server's median decode period."""
    with LocalLab(tiny_gpt2) as target:
        first = target.current_step()
        row = crosscheck.lab_client(target, SIZES)
        step = crosscheck.server_period_ms(target, first)
    assert row["failed"] == 0 and row["tokens"] == SIZES.streams * SIZES.tokens
    assert 0 < step < float("inf")
    assert row["itl_ms"] >= 0.8 * step  # one token a step: no client reads a stream faster than the server steps


def test_a_missing_client_leaves_its_verdicts_unclear():
    rows = _rows().query("tool == 'lab client'")
    assert _said(rows)["tokens/s agree"] == "unclear"
    assert _said(rows)["read at once, the two agree"] == "unclear"


def test_without_guidellm_the_run_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.setenv("LABKIT_GUIDELLM", str(tmp_path / "nothing"))
    monkeypatch.setattr(crosscheck, "repo_root", lambda: tmp_path)
    monkeypatch.setattr(crosscheck.shutil, "which", lambda name: None)
    with pytest.raises(NotMeasurable, match="make guidellm"):
        crosscheck.guidellm_program()


def test_the_cross_check_is_one_of_notebook_03s_measurements():
    assert crosscheck.GUIDELLM in overlap.SPECS and crosscheck.GUIDELLM.group == "overlap"
    assert set(crosscheck.GUIDELLM.sizes["full"]) == set(crosscheck.GUIDELLM.sizes["ci"])


def test_sizes_are_the_lab_s_own():
    assert isinstance(SIZES, Sizes) and SIZES.streams >= 4 and SIZES.tokens >= 8
