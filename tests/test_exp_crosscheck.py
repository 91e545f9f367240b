"""Notebook 03's cross-check: the lab's client beside GuideLLM on one server.

The verdicts come out both ways on rows made by hand, and a machine without GuideLLM gets a "not
measurable" row naming how to install it. The real thing (GuideLLM and the lab's client against a
``labkit serve`` process the lab starts) is notebook 03's section 6, whose checked line nbval
compares in ``make test``.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from labkit.experiments import crosscheck, overlap
from labkit.lab import NotMeasurable, Sizes

SIZES = crosscheck.GUIDELLM.sizes_for("ci")


def _rows(guidellm_tps: float = 100.0, guidellm_itl: float = 10.0, failed: int = 0) -> pd.DataFrame:
    rows = []
    for rep in range(3):
        rows.append({"tool": "lab client", "repetition": rep, "tokens": SIZES.streams * SIZES.tokens,
                     "tokens_per_s": 100.0 + rep, "itl_ms": 10.0 + rep / 10, "failed": 0})  # fmt: skip
        rows.append({"tool": "GuideLLM", "repetition": rep, "tokens": SIZES.streams * SIZES.tokens,
                     "tokens_per_s": guidellm_tps + rep, "itl_ms": guidellm_itl, "failed": failed})  # fmt: skip
    return pd.DataFrame(rows)


def _said(rows: pd.DataFrame) -> dict[str, str]:
    return {v.name: v.outcome for v in crosscheck.verdicts({"rows": rows}, SIZES)}


def test_two_clients_that_read_the_same_pace_agree():
    assert set(_said(_rows()).values()) == {"holds"}


def test_a_client_that_sees_half_the_throughput_or_twice_the_latency_disagrees():
    assert _said(_rows(guidellm_tps=50.0))["tokens/s agree"] == "falsified"
    assert _said(_rows(guidellm_itl=20.0))["inter-token latency agrees"] == "falsified"
    assert _said(_rows(failed=1))["both clients whole"] == "falsified"


def test_a_missing_client_leaves_its_verdicts_unclear():
    rows = _rows().query("tool == 'lab client'")
    assert _said(rows)["tokens/s agree"] == "unclear"


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
