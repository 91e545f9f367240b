"""Notebooks 05 and 07 read what they claim: a slow reader that is slow, policies compared with
their own baselines, verdicts that can come out false, eager memory that is measured, and an
identity check that would notice sampling being ignored.

Issue 9 found the slow reader reading at 78% of the write rate (so ``pause_then_drop`` never
fired), baselines from other policies' runs, an eager-memory figure labelled "measured" that was
arithmetic, and a sampled-identity check that would pass if sampling were ignored.
"""

from __future__ import annotations

import pandas as pd

from labkit.experiments import extensions
from labkit.experiments.identity import MUST_MATCH, VS_GREEDY

# --------------------------------------------------------------------------- tables by hand


def _verdict(tables: dict[str, pd.DataFrame], name: str, module=extensions) -> bool:
    return next(v for v in module.verdicts(tables) if v.name == name).holds


# --------------------------------------------------------------------------- identity and memory


def _identity(sampled_equals_greedy: bool) -> dict[str, pd.DataFrame]:
    rows = [
        {"comparison": what, "prompt": i, "identical": True if what in MUST_MATCH else sampled_equals_greedy}
        for what in (*MUST_MATCH, VS_GREEDY)
        for i in range(4)
    ]
    return {"identity": pd.DataFrame(rows)}


def test_sampling_silently_ignored_fails_the_identity_check():
    tables = _identity(sampled_equals_greedy=True)
    assert not _verdict({**tables, **_rest()}, "sampling_takes_effect", extensions)
    assert "NOT DIFFERENT" in extensions.report({**tables, **_rest()})


def test_sampling_in_effect_passes_it():
    tables = {**_identity(sampled_equals_greedy=False), **_rest()}
    assert _verdict(tables, "sampling_takes_effect", extensions)
    assert _verdict(tables, "seeded_sampling_repeats", extensions)


def _rest() -> dict[str, pd.DataFrame]:
    """The other tables ``extensions.verdicts`` and ``report`` read, with neutral values."""
    eager = pd.DataFrame(
        [{"peak_queued_events": 10, "eager_measured_mib": 1.0, "lazy_measured_mib": 0.01, "eager_over_lazy": 100.0}]
    )
    sat = pd.DataFrame(
        [
            {"policy": "pause", "stall_timeout_s": float("inf"), "paused_slot_s_while_waiting": 2.0},
            {"policy": "pause_then_drop 0.25 s", "stall_timeout_s": 0.25, "paused_slot_s_while_waiting": 0.5},
        ]
    )
    delivery = pd.DataFrame(
        [{"mode": m, "repetition": r, "ttft_s": t} for m, t in (("prefill", 0.1), ("step_end", 0.2)) for r in range(3)]
    )
    resume = pd.DataFrame(
        [{"status": 200, "in_order_no_gap": True, "same_tokens_as_generate": True, "end": "done"}, {"status": 404}]
    )
    return {"eager": eager, "saturation": sat, "delivery_streams": delivery, "resume": resume}


def test_eager_memory_is_measured_and_is_the_padded_events():
    tokens = [(11, " a"), (12, " b")]
    eager = extensions.eager_bytes(tokens, 100, 16 * 1024)
    lazy = extensions.lazy_bytes(tokens, 100)
    assert 100 * 16 * 1024 <= eager <= 2 * 100 * 16 * 1024
    assert lazy * 10 < eager
    assert extensions.eager_bytes(tokens, 100, 0) * 10 < eager  # the padding is what costs
