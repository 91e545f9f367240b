"""Notebook 02's measurements: concurrent streams against their solo runs, and logits bit for bit.

Every verdict is shown to come out both ways on small tables made by hand; the logits comparison
is run once, small, on the tiny model, where float32 must be bitwise batch-invariant and the
plain mode must not be; a target without labkit's token ids gets a "not measurable" row.
"""

from __future__ import annotations

from types import SimpleNamespace

import pandas as pd
import pytest
import torch

from labkit.experiments import isolation
from labkit.lab import Caps, Target, run
from labkit.lab.experiment import Sizes, Trial


class _Loaded:
    def __init__(self, loaded: object) -> None:
        self.loaded = loaded


def verdicts(spec, tables: dict[str, pd.DataFrame], **sizes) -> dict[str, str]:
    return {v.name: v.outcome for v in spec.verdicts({**tables, **spec.tables(tables, Sizes(sizes))}, Sizes(sizes))}


# --------------------------------------------------------------------------- streams


def test_the_full_sizes_are_the_chapters_189_streams():
    full = isolation.STREAMS.sizes_for("full")
    assert full.levels == (1, 2, 4, 8, 16, 32) and sum(full.levels) * full.repetitions == 189
    assert set(isolation.STREAMS.sizes["ci"]) == set(full)


def test_first_difference_counts_a_length_difference():
    assert isolation.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert isolation.first_difference([1, 5, 3], [1, 2, 3]) == 1
    assert isolation.first_difference([1, 2], [1, 2, 3]) == 2


def test_a_token_is_dated_by_the_step_that_made_it():
    record = {"release_step": 20, "tokens_generated": 10}  # tokens 0..9 made by steps 11..20
    assert isolation._step_of(record, 3) == 14 and isolation._step_of(record, 9) == 20
    assert isolation._step_of(None, 3) is None and isolation._step_of(record, None) is None


def _streams(differ: set[tuple[str, int]]) -> pd.DataFrame:
    rows = []
    for mode in ("invariant", "plain"):
        for level in (1, 4):
            for prompt in range(level):
                bad = (mode, level) in differ and prompt == 0
                rows.append({"mode": mode, "level": level, "repetition": 0, "prompt": prompt, "tokens": 8,
                             "identical": not bad, "first_diff": 3 if bad else None, "diverged_step": 9 if bad else None,
                             "failure": None, "solo_token": None, "concurrent_token": None})  # fmt: skip
    return pd.DataFrame(rows)


def test_stream_verdicts_hold_when_only_the_plain_mode_differs():
    assert verdicts(isolation.STREAMS, {"rows": _streams({("plain", 4)})}) == {
        "concurrent equals solo (invariant)": "holds", "alone equals solo": "holds"}  # fmt: skip


def test_stream_verdicts_fail_on_the_stream_that_differs():
    assert verdicts(isolation.STREAMS, {"rows": _streams({("invariant", 4)})})[
        "concurrent equals solo (invariant)"] == "falsified"  # fmt: skip
    assert verdicts(isolation.STREAMS, {"rows": _streams({("plain", 1)})})["alone equals solo"] == "falsified"


def test_the_divergences_table_lists_only_the_streams_that_differ():
    tables = isolation.stream_tables({"rows": _streams({("plain", 4)})}, Sizes())
    assert len(tables["divergences"]) == 1 and tables["divergences"].diverged_step.iloc[0] == 9
    plain4 = tables["levels"].set_index(["mode", "level"]).loc[("plain", 4)]
    assert (plain4.streams, plain4.identical) == (4, 3)


def test_a_target_without_token_ids_is_not_measurable():
    openai_only = Target("http://127.0.0.1:9", api="openai", caps=Caps())
    result = run(isolation.STREAMS, openai_only, save=False, show=False)
    assert result.tables["not_measurable"].because.iloc[0] == Caps().why_not("native")
    assert result.verdicts == []


def test_a_server_whose_settings_are_fixed_is_measured_as_it_is_served():
    assert isolation.modes(Target("http://127.0.0.1:9", caps=Caps(native=True))) == ("as served",)
    assert isolation.modes(Target("http://127.0.0.1:9", caps=Caps(native=True, settings=True))) == isolation.MODES


# --------------------------------------------------------------------------- logits


def test_compare_sees_one_bit_and_a_flip():
    solo = torch.tensor([1.0, 3.0, 2.5, 0.0])
    same = isolation.compare(solo, solo.clone())
    assert (same["differs"], same["delta"], same["flipped"], same["margin"]) == (False, 0.0, False, 0.5)
    nudged = isolation.compare(solo, torch.nextafter(solo, torch.full_like(solo, 9.0)))
    assert nudged["differs"] and 0 < nudged["delta"] < 1e-6 and not nudged["flipped"]
    flipped = isolation.compare(solo, torch.tensor([1.0, 2.4, 2.6, 0.0]))
    assert flipped["flipped"] and flipped["gap_moved"] == pytest.approx(0.7) and not flipped["overtaken"]
    third = isolation.compare(solo, torch.tensor([1.0, 3.0, 2.5, 3.5]))  # the top two kept their gap
    assert third["flipped"] and third["overtaken"] and third["gap_moved"] == 0.0


def test_the_flip_rate_is_half_the_share_of_pairs_where_the_move_beats_the_margin():
    assert isolation.flip_rate(pd.Series([0.1, 0.2]), pd.Series([0.15, 0.0])) == 0.125  # half of 1 pair in 4
    assert isolation.flip_rate(pd.Series([0.1]), pd.Series([0.0])) == 0.0


def _logit_rows(**differ: int) -> pd.DataFrame:
    rows = []
    for dtype in ("float32", "bfloat16"):
        for mode in ("invariant", "plain"):
            for batch in (1, 2, 32):
                n = differ.get(f"{mode}_{dtype}", 0) if batch > 1 else differ.get("alone", 0)
                rows.append({"dtype": dtype, "mode": mode, "batch": batch, "rows": 10, "differ": n, "share": n / 10,
                             "max_delta": 1e-5 * bool(n), "flips": 0, "flips_per_1000": 0.0})  # fmt: skip
    return pd.DataFrame(rows)


def _judged(rows: pd.DataFrame) -> dict[str, str]:
    return {v.name: v.outcome for v in isolation.logit_verdicts({"rows": rows}, Sizes())}


def test_logit_verdicts_hold_when_only_the_plain_mode_differs():
    judged = _judged(_logit_rows(plain_float32=10, plain_bfloat16=3))
    assert set(judged.values()) == {"holds"} and len(judged) == 5


def test_logit_verdicts_fail_on_one_bit():
    judged = _judged(_logit_rows(invariant_float32=1, invariant_bfloat16=1, alone=1))
    assert judged["invariant (float32): bitwise identical"] == "falsified"
    assert judged["invariant (bfloat16): bitwise identical"] == "falsified"
    assert judged["alone repeats itself"] == "falsified"
    assert judged["plain (float32): batched logits differ in bits"] == "falsified"


def test_only_float32_invariance_and_repetition_are_checked():
    checked = {v.name for v in isolation.logit_verdicts({"rows": _logit_rows()}, Sizes()) if v.checked}
    assert checked == {"alone repeats itself", "invariant (float32): bitwise identical"}


def test_power_counts_the_plain_tokens_compared_and_bounds_the_flips_they_could_expect():
    streams = _result(_streams({("plain", 4)}))
    row = isolation.power(streams, _result(_logit_rows(plain_float32=10))).iloc[0]  # no flip rate: 1.5 in 10 rows bound it
    assert row["plain tokens compared over HTTP"] == 4 * 8 and row["flips seen"] == 1
    assert row["flips expected, at most"] == pytest.approx(32 * 0.15)
    often = _logit_rows(plain_float32=10).assign(flips_per_1000=500.0)
    assert isolation.power(streams, _result(often)).iloc[0]["flips expected, at most"] == pytest.approx(32 * 0.5)


def test_power_says_why_when_a_measurement_saw_nothing():
    empty = _result(pd.DataFrame(), because="its model is not labkit's")
    assert list(isolation.power(empty, _result(_logit_rows())).because) == ["its model is not labkit's"]
    plain_free = _result(_streams(set()).query("mode == 'invariant'"))
    assert "no plain-mode streams" in isolation.power(plain_free, _result(_logit_rows())).because[0]


def _result(rows: pd.DataFrame, because: str | None = None) -> SimpleNamespace:
    tables = {"rows": rows} | ({"not_measurable": pd.DataFrame({"because": [because]})} if because else {})
    return SimpleNamespace(tables=tables)


@pytest.mark.slow
def test_float32_logits_are_bitwise_invariant_and_the_plain_mode_is_not(tiny_gpt2):
    sizes = Sizes(batches=(1, 2, 16), probes=3, tokens=4)
    out = {}
    for mode in isolation.MODES:
        trial = Trial(_Loaded(tiny_gpt2), {"dtype": "float32", "mode": mode}, sizes, 0)  # type: ignore[arg-type]
        out[mode] = pd.DataFrame(isolation.measure_logits(trial)).set_index("batch")
        assert len(trial.kept["tokens"]) == sum(min(3, b) for b in sizes.batches) * sizes.tokens
    assert out["invariant"]["differ"].sum() == 0
    assert out["plain"].loc[1, "differ"] == 0 and out["plain"].loc[16, "differ"] > 0
