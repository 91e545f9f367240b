"""The chapter's published figures, set beside ours.

The chapter's numbers come from GPT-2 small (float32) on an RTX 2060 that other work shared, under Windows, over loopback. Its
numbers are quoted here only so that a notebook can print them next to what this machine
measured; nothing in the lab computes with them. Each ``*_beside`` function returns a table
with one row per quantity: what it is, the chapter's figure (as the chapter states it), ours
(from this run's tables), and the unit.
"""

from __future__ import annotations

from typing import Any

import pandas as pd

__all__ = ["CHAPTER_SETUP", "beside", "span", "wire_beside", "isolation_beside", "overlap_beside", "buffers_beside"]

CHAPTER_SETUP = "GPT-2 small, float32, RTX 2060 (shared), Windows, loopback"


def beside(rows: list[tuple[str, str, Any, str]]) -> pd.DataFrame:
    """The chapter's figure beside ours, one quantity a row: the table every ``*_beside`` returns."""
    return pd.DataFrame(rows, columns=["quantity", "chapter (GPU)", "this run", "unit"])


def span(values: Any, fmt: str = "{:.2f}") -> str:
    """``low–high`` of the values (one number when they agree; ``n/a`` when there are none)."""
    values = pd.Series(values, dtype=float).dropna()
    if values.empty:
        return "n/a"
    low, high = fmt.format(values.min()), fmt.format(values.max())
    return low if low == high else f"{low}–{high}"


def _range(values: Any, fmt: str = "{:.0f}") -> str:
    values = pd.Series(values).dropna()
    if values.empty:
        return "n/a"
    low, high = values.min(), values.max()
    return fmt.format(low) if fmt.format(low) == fmt.format(high) else f"{fmt.format(low)}–{fmt.format(high)}"


def wire_beside(tables: dict[str, pd.DataFrame]) -> pd.DataFrame:
    streams, checks, events = tables["streams"], tables["checks"], tables["events"]
    passed = int((checks.passed[:-1] == checks.streams[:-1]).all())
    full = streams[streams.finish_reason == "length"]
    n = int(full.tokens.max()) if not full.empty else 0
    return beside(
        [
            (
                "streams passing every check",
                "40 of 40",
                f"{len(streams) if passed else 'not all'} of {len(streams)}",
                "streams",
            ),
            ("streams that ran to their token limit", "40 of 40", f"{len(full)} of {len(streams)}", "streams"),
            ("bytes per token, whole stream (full-length streams)", "73–76", _range(full.bytes_per_token), "bytes"),
            (f"one {n}-token stream", "about 2,400 (32 tokens)", _range(full.bytes), "bytes"),
            ("one token event (median)", "—", f"{events.bytes[events.event == 'token'].median():.0f}", "bytes"),
            (
                "token events with an empty delta",
                "0 of 1,280",
                f"{int(streams.empty_deltas.sum())} of {int(streams.tokens.sum())}",
                "events",
            ),
        ]
    )


def isolation_beside(tables: dict[str, pd.DataFrame]) -> pd.DataFrame:
    streams = tables["streams"]
    return beside(
        [
            (
                "concurrent streams identical to their solo run",
                "189 of 189",
                f"{int(streams.identical.sum())} of {len(streams)}",
                "streams",
            ),
            (
                "levels compared",
                "1, 2, 4, 8, 16, 32 × 3",
                ", ".join(map(str, sorted(streams.level.unique()))) + f" × {streams.repetition.nunique()}",
                "streams",
            ),
        ]
    )


def overlap_beside(tables: dict[str, pd.DataFrame]) -> pd.DataFrame:
    levels, solo, fit = tables["levels"], tables["solo"], tables["step_fit"].iloc[0]
    top, one = levels[levels.level == levels.level.max()], levels[levels.level == 1]
    n = int(top.level.iloc[0])
    joiners = tables["joiners"].groupby("background").ttft_s
    p50, p99 = joiners.median() * 1000, joiners.quantile(0.99) * 1000
    delivery = tables["delivery"].groupby("mode").ttft_s.median() * 1000
    rows = [
        (f"back to back: {n} × level 1's median", "22.05 (for 32)", f"{top.back_to_back_s.iloc[0]:.2f}", "s"),
        (f"makespan, {n} streams at once", "1.49–1.55 (for 32)", _range(top.makespan_s, "{:.2f}"), "s"),
        (f"aggregate throughput, {n} streams", "1,320–1,376 (for 32)", _range(top.tokens_per_s), "tokens/s"),
        ("throughput, one stream", "90–94", _range(one.tokens_per_s), "tokens/s"),
        ("one stream (level 1) median time to first token", "16", f"{solo.ttft_s.median() * 1000:.0f}", "ms"),
        ("one stream (level 1) median gap between tokens", "10.1", f"{solo.gap_p50_s.median() * 1000:.1f}", "ms"),
        (f"median gap, {n} streams", "about 17 (for 32)", _range(top.gap_p50_s * 1000, "{:.1f}"), "ms"),
        (f"p99 gap, {n} streams", "22 (for 32)", _range(top.gap_p99_s * 1000, "{:.1f}"), "ms"),
        (
            f"median / p99 time to first token, {n} streams",
            "441 / 442 (for 32, step-end delivery)",
            f"{top.ttft_p50_s.median() * 1000:.0f} / {top.ttft_p99_s.median() * 1000:.0f}",
            "ms",
        ),
        ("decode step: fixed cost", "about 9.6", f"{fit.intercept_ms:.2f}", "ms"),
        ("decode step: cost per added sequence", "about 0.17", f"{fit.ms_per_sequence:.3f}", "ms"),
        (
            f"step at {int(fit.largest_batch)} over step at 1",
            "1.5 (32 over 1)",
            f"{fit.largest_over_smallest:.2f}",
            "×",
        ),
    ]
    chapter_joiners = {0: "16 (idle)", 8: "41 / 62 (8 running)", 24: "47 / 77 (24 running)"}
    for background in p50.index:
        label = "idle engine" if background == 0 else f"{background} long streams running"
        rows.append(
            (
                f"joiner first token, median / p99: {label}",
                chapter_joiners.get(background, "—"),
                f"{p50[background]:.0f} / {p99[background]:.0f}",
                "ms",
            )
        )
    for mode in delivery.index:
        rows.append(
            (
                f"median first token, {mode.replace('_', ' ')} delivery",
                "441 (32 streams, step end)" if mode == "step_end" else "not built (an exercise)",
                f"{delivery[mode]:.0f}",
                "ms",
            )
        )
    return beside(rows)


def buffers_beside(tables: dict[str, pd.DataFrame]) -> pd.DataFrame:
    chapter = {133: "252,434", 1024: "262,395", 16384: "278,613", 65536: "327,705 or 262,164"}
    rows = []
    for row in tables["by_size"].itertuples():
        low, high = int(row.bytes_accepted_min), int(row.bytes_accepted_max)
        ours = f"{low:,}" if low == high else f"{low:,}–{high:,}"
        rows.append(
            (
                f"accepted before the write blocks, {int(row.event_bytes):,}-byte events",
                chapter.get(int(row.event_bytes), "—"),
                ours,
                "bytes",
            )
        )
    return beside(rows)
