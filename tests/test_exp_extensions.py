"""Notebook 07's measurements: a full batch, resuming, eager memory, seeded sampling, the kernel.

Every verdict is shown to come out both ways on small tables made by hand. Eager formatting is
measured for real (tracemalloc is deterministic enough to state what the padding contributes),
and resuming runs once against the tiny model: a client that leaves by RST over httpx, comes
back with Last-Event-ID, and gets exactly the missed events; after the grace, 404.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from labkit.experiments import extensions
from labkit.lab import LocalLab, Process, Sizes, run


def judged(spec, rows: pd.DataFrame, **sizes) -> dict[str, str]:
    s = Sizes(sizes)
    tables = {"rows": rows, **spec.tables({"rows": rows}, s)}
    return {v.name: v.outcome for v in spec.verdicts(tables, s)}


def test_every_spec_has_both_profiles_with_the_same_sizes():
    for spec in extensions.SPECS:
        assert set(spec.sizes["ci"]) == set(spec.sizes["full"]), spec.name


# --------------------------------------------------------------------------- a full batch


def test_slots_held_while_waiting_count_only_moments_when_someone_waited():
    times = np.arange(0.0, 5.0, 1.0)  # 0 1 2 3 4
    # waiting over [1, 3); one stalled stream released at 2, another held past the end
    assert extensions.held_while_waiting(times, [(1.0, 3.0)], [2.0, 10.0]) == 3
    assert extensions.held_while_waiting(times, [], [10.0]) == 0


def _batch_rows(pause_dropped=0, ptd_dropped=2, failed=0, pause_steps=(600, 610, 590) * 2, ptd_steps=(10, 20, 15) * 2):
    """Slot-steps held while others waited: under pause, and dropping 8 steps after the pause."""
    rows = []
    for rep in range(6):
        rows.append({"policy": "pause", "stall_steps": math.inf, "stall_timeout_s": math.inf, "repetition": rep, "stalled_slot_s": 3.0,
                     "stalled_slot_steps": pause_steps[rep], "others_done_s": 2.0, "others_steps": 600,
                     "stalled_paused": 2, "stalled_dropped": pause_dropped, "others_failed": failed})  # fmt: skip
        rows.append({"policy": "pause_then_drop", "stall_steps": 8, "stall_timeout_s": 0.2, "repetition": rep, "stalled_slot_s": 0.1,
                     "stalled_slot_steps": ptd_steps[rep], "others_done_s": 1.0, "others_steps": 300,
                     "stalled_paused": 2, "stalled_dropped": ptd_dropped, "others_failed": 0})  # fmt: skip
    return pd.DataFrame(rows)


def test_full_batch_verdicts_hold_when_pause_holds_and_drop_frees():
    assert set(judged(extensions.FULL_BATCH, _batch_rows(), slow=2).values()) == {"holds"}


def test_full_batch_verdicts_fail_on_a_release_a_hold_or_a_failed_request():
    assert judged(extensions.FULL_BATCH, _batch_rows(pause_dropped=1), slow=2)["pause keeps the slots"] == "falsified"
    held = judged(extensions.FULL_BATCH, _batch_rows(ptd_dropped=1), slow=2)
    assert held["pause_then_drop gives them back"] == "falsified"
    failed = judged(extensions.FULL_BATCH, _batch_rows(failed=1), slow=2)
    assert failed["pause keeps the slots"] == failed["pause_then_drop gives them back"] == "falsified"
    worse = judged(extensions.FULL_BATCH, _batch_rows(ptd_steps=(700, 800, 900) * 2), slow=2)
    assert worse["dropping after 8 steps frees slot-steps"] == "falsified"


# --------------------------------------------------------------------------- resuming


def _resume_rows(exact=True, late_status=404) -> pd.DataFrame:
    back = {"come_back": "at once", "status": 200, "in_order": True, "exact": exact}
    return pd.DataFrame([back, {**back, "exact": True}, {"come_back": "after the grace", "status": late_status,
                                                          "in_order": True, "exact": False}])  # fmt: skip


def test_resume_verdicts_come_out_both_ways():
    assert set(judged(extensions.RESUME, _resume_rows()).values()) == {"holds"}
    assert judged(extensions.RESUME, _resume_rows(exact=False))["resumed exactly"] == "falsified"
    assert judged(extensions.RESUME, _resume_rows(late_status=200))["forgotten after the grace"] == "falsified"


def test_a_client_that_left_by_rst_resumes_exactly_and_is_forgotten_after_the_grace(tiny_gpt2):
    with LocalLab(tiny_gpt2) as target:
        result = run(extensions.RESUME, target, save=False, show=False, tokens=8, leave_after=(2,), grace_s=1.0,
                     repetitions=1)  # fmt: skip
    rows = result.table("rows").set_index("come_back")
    assert rows.loc["at once", "tokens_before"] >= 2 and rows.loc["at once", "events_after"] > 0
    assert {v.name: v.outcome for v in result.verdicts} == {"resumed exactly": "holds",
                                                             "forgotten after the grace": "holds"}  # fmt: skip


def test_a_run_that_ends_within_the_grace_is_kept_a_grace_after_its_end_and_then_forgotten(tiny_gpt2):
    """The grace starts when the last follower leaves and again when the run ends within it (a
    finished log is kept a grace after it finished). A run that ends 2.5 s after its client left,
    with a 3 s grace, is still there 1.5 graces + 0.5 s after the leave; coming back a grace after
    the engine let the request go finds it forgotten, however long the run took."""
    with LocalLab(tiny_gpt2, step_delay=0.05) as target:
        result = run(extensions.RESUME, target, save=False, show=False, tokens=52, leave_after=(1,), grace_s=3.0,
                     repetitions=1)  # fmt: skip
    assert result.table("rows").set_index("come_back").loc["after the grace", "status"] == 404


# --------------------------------------------------------------------------- eager formatting


def test_eager_formatting_holds_the_padding_and_unpadded_no_more_than_the_hub():
    tokens = [(1000 + i, f" w{i}") for i in range(8)]
    held = extensions.held_bytes(tokens, 100, 16 * 1024)
    assert 100 * 16 * 1024 <= held["eager_bytes"] <= 100 * (16 * 1024 + 1024)
    assert held["eager_unpadded_bytes"] <= held["lazy_bytes"] < held["eager_bytes"] / 10


def _eager_rows(eager=68_000, unpadded=128, lazy=230, queued=62) -> pd.DataFrame:
    return pd.DataFrame([{"reader": i, "tokens": 64, "queued": queued, "eager_bytes": eager * queued,
                          "eager_unpadded_bytes": unpadded * queued, "lazy_bytes": lazy * queued} for i in range(4)])  # fmt: skip


def test_eager_verdicts_come_out_both_ways():
    assert set(judged(extensions.EAGER, _eager_rows(), pad_bytes=65536).values()) == {"holds"}
    small_pad = judged(extensions.EAGER, _eager_rows(eager=256), pad_bytes=128)
    assert small_pad["the padding is what eager holds"] == "falsified"
    heavy = judged(extensions.EAGER, _eager_rows(unpadded=300), pad_bytes=65536)
    assert heavy["unpadded, eager is no heavier"] == "falsified"
    assert set(judged(extensions.EAGER, _eager_rows(queued=0), pad_bytes=65536).values()) == {"unclear"}  # nothing held


def test_the_per_reader_table_sets_the_chapters_arithmetic_beside_the_measurement():
    table = extensions.eager_tables({"rows": _eager_rows()}, Sizes(pad_bytes=65536))["per_reader"]
    assert (table.chapter_arithmetic_MiB == 4.0).all() and (table.eager_bytes_per_event == 68_000).all()


# --------------------------------------------------------------------------- sampling and the kernel


def _sampling_rows(must_differ=False, greedy_differ=True) -> pd.DataFrame:
    rows = [{"comparison": c, "prompt": i, "failed": False,
             "first_diff": (3 if (must_differ and i == 0) else None) if c != "sampled vs greedy"
             else (0 if greedy_differ else None)}
            for c in ("all at once vs alone", "all at once, twice", "sampled vs greedy") for i in range(4)]  # fmt: skip
    return pd.DataFrame(rows)


def test_sampling_verdicts_notice_ignored_seeds_and_ignored_sampling():
    assert set(judged(extensions.SAMPLING, _sampling_rows()).values()) == {"holds"}
    assert judged(extensions.SAMPLING, _sampling_rows(must_differ=True))["seeded sampling repeats"] == "falsified"
    assert judged(extensions.SAMPLING, _sampling_rows(greedy_differ=False))["sampling takes effect"] == "falsified"


def _paged_rows(kernel_ms: list[float]) -> pd.DataFrame:
    return pd.DataFrame([{"repetition": r, "context": 64, "batch": 32, "mode": mode, "step_ms": ms,
                          "attention_ms": ms / 4, "copied_MiB": 0.0}
                         for r, k in enumerate(kernel_ms) for mode, ms in (("gather", 10.0), ("kernel", k))])  # fmt: skip


def test_a_kernel_verdict_is_unclear_where_the_repetitions_cannot_tell():
    def outcome(kernel_ms: list[float]) -> str:
        rows = _paged_rows(kernel_ms)
        return extensions.paged_verdicts({"rows": rows}, Sizes(batches=(32,)))[0].outcome

    assert outcome([8.0, 8.5, 7.9, 8.2, 8.1, 8.3]) == "holds"
    assert outcome([12.0, 12.5, 11.9, 12.2, 12.1, 12.3]) == "falsified"
    assert outcome([8.0, 12.0, 9.0, 11.0, 9.5, 10.5]) == "unclear"
    assert outcome([8.0, 8.5, 7.9]) == "unclear"  # three repetitions cannot bound a median


@pytest.mark.slow
def test_labkit_run_measures_what_a_server_in_its_own_process_shows_and_names_the_rest(tmp_path, monkeypatch, capsys):
    from labkit.cli import main

    monkeypatch.setenv("LABKIT_OUT", str(tmp_path))
    server = Process.labkit("tiny-gpt2")
    try:
        code = main(["run", "extensions", "--target", server.url, "--api", "labkit", "--profile", "ci", "--no-figures",
                     "--set", "tokens=8", "--set", "leave_after=(2,)", "--set", "repetitions=1"])  # fmt: skip
    finally:
        server.close()
    out = capsys.readouterr().out
    assert code == 0
    assert "skipped extensions.full_batch needs labkit's own server" in out and "skipped extensions.paged" in out
    assert "resumed exactly" in out and "seeded sampling repeats" in out
