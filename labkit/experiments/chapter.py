"""The chapter's published figures, set beside ours.

The chapter's numbers come from GPT-2 small (float32) on an RTX 2060 that other work shared,
under Windows, over loopback. They live in one data file, ``chapter.toml``, read by
:mod:`labkit.experiments.chapter_figures`, and are quoted only so that a notebook can print them
next to what this machine measured; nothing in the lab computes with them. Each ``*_beside``
function returns a table with one row per quantity: what it is, the chapter's figure (as the
chapter states it), ours (from this run's tables), and the unit.
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from labkit.experiments.chapter_figures import NO_FIGURE, figure, figures

__all__ = ["CHAPTER_SETUP", "beside", "span", "wire_beside", "overlap_beside", "buffers_beside"]

CHAPTER_SETUP = figures().setup


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
                figure("wire", "streams_passing"),
                f"{len(streams) if passed else 'not all'} of {len(streams)}",
                "streams",
            ),
            (
                "streams that ran to their token limit",
                figure("wire", "streams_to_limit"),
                f"{len(full)} of {len(streams)}",
                "streams",
            ),
            (
                "bytes per token, whole stream (full-length streams)",
                figure("wire", "bytes_per_token"),
                _range(full.bytes_per_token),
                "bytes",
            ),
            (f"one {n}-token stream", figure("wire", "one_stream_bytes"), _range(full.bytes), "bytes"),
            ("one token event (median)", NO_FIGURE, f"{events.bytes[events.event == 'token'].median():.0f}", "bytes"),
            (
                "token events with an empty delta",
                figure("wire", "empty_deltas"),
                f"{int(streams.empty_deltas.sum())} of {int(streams.tokens.sum())}",
                "events",
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
        (
            f"back to back: {n} × level 1's median",
            figure("overlap", "back_to_back_s"),
            f"{top.back_to_back_s.iloc[0]:.2f}",
            "s",
        ),
        (f"makespan, {n} streams at once", figure("overlap", "makespan_s"), _range(top.makespan_s, "{:.2f}"), "s"),
        (f"aggregate throughput, {n} streams", figure("overlap", "throughput"), _range(top.tokens_per_s), "tokens/s"),
        ("throughput, one stream", figure("overlap", "throughput_one"), _range(one.tokens_per_s), "tokens/s"),
        (
            "one stream (level 1) median time to first token",
            figure("overlap", "ttft_one_ms"),
            f"{solo.ttft_s.median() * 1000:.0f}",
            "ms",
        ),
        (
            "one stream (level 1) median gap between tokens",
            figure("overlap", "gap_one_ms"),
            f"{solo.gap_p50_s.median() * 1000:.1f}",
            "ms",
        ),
        (f"median gap, {n} streams", figure("overlap", "gap_p50_ms"), _range(top.gap_p50_s * 1000, "{:.1f}"), "ms"),
        (f"p99 gap, {n} streams", figure("overlap", "gap_p99_ms"), _range(top.gap_p99_s * 1000, "{:.1f}"), "ms"),
        (
            f"median / p99 time to first token, {n} streams",
            figure("overlap", "ttft_p50_p99_ms"),
            f"{top.ttft_p50_s.median() * 1000:.0f} / {top.ttft_p99_s.median() * 1000:.0f}",
            "ms",
        ),
        ("decode step: fixed cost", figure("overlap", "step_fixed_ms"), f"{fit.intercept_ms:.2f}", "ms"),
        (
            "decode step: cost per added sequence",
            figure("overlap", "step_per_sequence_ms"),
            f"{fit.ms_per_sequence:.3f}",
            "ms",
        ),
        (
            f"step at {int(fit.largest_batch)} over step at 1",
            figure("overlap", "step_largest_over_one"),
            f"{fit.largest_over_smallest:.2f}",
            "×",
        ),
    ]
    chapter_joiners = {
        0: figure("overlap", "joiner_idle"),
        8: figure("overlap", "joiner_8"),
        24: figure("overlap", "joiner_24"),
    }
    for background in p50.index:
        label = "idle engine" if background == 0 else f"{background} long streams running"
        rows.append(
            (
                f"joiner first token, median / p99: {label}",
                chapter_joiners.get(background, NO_FIGURE),
                f"{p50[background]:.0f} / {p99[background]:.0f}",
                "ms",
            )
        )
    for mode in delivery.index:
        rows.append(
            (
                f"median first token, {mode.replace('_', ' ')} delivery",
                figure("overlap", "delivery_step_end") if mode == "step_end" else figure("overlap", "delivery_prefill"),
                f"{delivery[mode]:.0f}",
                "ms",
            )
        )
    return beside(rows)


def buffers_beside(tables: dict[str, pd.DataFrame]) -> pd.DataFrame:
    chapter = {int(key.removeprefix("accepted_")): value for key, value in figures().sections["buffers"].items()}
    rows = []
    for row in tables["by_size"].itertuples():
        low, high = int(row.bytes_accepted_min), int(row.bytes_accepted_max)
        ours = f"{low:,}" if low == high else f"{low:,}–{high:,}"
        rows.append(
            (
                f"accepted before the write blocks, {int(row.event_bytes):,}-byte events",
                chapter.get(int(row.event_bytes), NO_FIGURE),
                ours,
                "bytes",
            )
        )
    return beside(rows)
