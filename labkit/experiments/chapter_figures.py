"""The chapter's published figures, read from one data file: ``chapter.toml`` beside this module.

Why a file: the figures were string literals in five modules, so nobody could see them all at
once or tell a typo from a figure. Now each lives once, under a section (the experiment) and a
key (the quantity), as the chapter states it ("about 9.6", "73–76"). The loader refuses a file
with a missing or an unknown key, naming it, so a renamed quantity cannot fall silently to "—".
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from importlib.resources import files
from pathlib import Path
from typing import Any

__all__ = ["KEYS", "NO_FIGURE", "ChapterFigures", "load", "figures", "figure"]

NO_FIGURE = "—"  # shown where the chapter gives no figure for a quantity we measure

#: every section of the file and the keys it must have, no more and no fewer
KEYS: dict[str, tuple[str, ...]] = {
    "wire": ("streams_passing", "streams_to_limit", "bytes_per_token", "one_stream_bytes", "empty_deltas"),
    "isolation": ("identical", "levels"),
    "overlap": (
        "back_to_back_s",
        "makespan_s",
        "throughput",
        "throughput_one",
        "ttft_one_ms",
        "gap_one_ms",
        "gap_p50_ms",
        "gap_p99_ms",
        "ttft_p50_p99_ms",
        "step_fixed_ms",
        "step_per_sequence_ms",
        "step_largest_over_one",
        "joiner_idle",
        "joiner_8",
        "joiner_24",
        "delivery_step_end",
        "delivery_prefill",
    ),
    "buffers": ("accepted_133", "accepted_1024", "accepted_16384", "accepted_65536"),
    "slowclient": ("naive_slow_of", "naive_done_s", "slow_pace", "unbounded_left_engine_s", "drop_left_engine_s"),
    "disconnect": (
        "listen_release_max_ms",
        "listen_unread",
        "listen_waiting_admitted",
        "listen_fin_rst",
        "write_to_limit",
        "write_tokens_read",
    ),
    "leak": ("streams", "left_early", "blocks_leaked", "generated_per_read", "write_only_extra_time", "late_events"),
    "extensions": (
        "first_token_step_end_ms",
        "first_token_prefill",
        "paused_slot_seconds",
        "resumed",
        "eager_peak",
        "seeded_sampling",
        "bfloat16_together",
    ),
}


@dataclass(frozen=True)
class ChapterFigures:
    setup: str  # the chapter's machine, in words
    sections: Mapping[str, Mapping[str, str]]

    def __call__(self, section: str, key: str) -> str:
        return self.sections[section][key]

    def values(self) -> set[str]:
        """Every figure in the file (what a table's chapter column may show, besides NO_FIGURE)."""
        return {value for keys in self.sections.values() for value in keys.values()}


def load(path: str | Path | None = None) -> ChapterFigures:
    """Read and check the figures file (the packaged ``chapter.toml`` unless ``path`` is given)."""
    if path is None:
        text = (files("labkit.experiments") / "chapter.toml").read_text(encoding="utf-8")
    else:
        text = Path(path).read_text(encoding="utf-8")
    return parse(tomllib.loads(text))


def parse(data: Mapping[str, Any]) -> ChapterFigures:
    """The figures from a parsed file; ``ValueError`` names every missing or unknown key."""
    problems = []
    if not isinstance(data.get("setup"), str):
        problems.append("setup: missing or not text")
    for name in sorted(set(data) - set(KEYS) - {"setup"}):
        problems.append(f"[{name}]: not a known section")
    for name, keys in KEYS.items():
        section = data.get(name)
        if not isinstance(section, Mapping):
            problems.append(f"[{name}]: missing")
            continue
        problems += [f"[{name}] {key}: missing" for key in keys if key not in section]
        problems += [f"[{name}] {key}: not a known key" for key in section if key not in keys]
        problems += [f"[{name}] {key}: not text" for key, value in section.items() if not isinstance(value, str)]
    if problems:
        raise ValueError("chapter figures: " + "; ".join(problems))
    return ChapterFigures(setup=data["setup"], sections={name: dict(data[name]) for name in KEYS})


@cache
def figures() -> ChapterFigures:
    """The packaged figures, read once."""
    return load()


def figure(section: str, key: str) -> str:
    """One of the chapter's figures, as the chapter states it."""
    return figures()(section, key)
