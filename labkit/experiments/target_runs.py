"""The client-side experiments against any OpenAI-compatible target: ``labkit run X --target URL``.

Each function takes a probed :class:`~labkit.experiments.target.Target` and returns named tables,
like the in-process experiments, and measures only what a client can see over HTTP, so it means
the same for labkit, vLLM or a server on another continent. What needs a server's internals
(block counts, step numbers, the engine's step cost) is listed in an ``unavailable`` table
rather than guessed.

* :func:`run_wire`: each prompt streamed and answered whole (temperature 0): framing, the order
  of chunks, ``[DONE]``, usage, text against the whole answer, bytes per token.
* :func:`run_overlap`: 1 to N streams at once, after one untimed warm-up at the largest level,
  repetitions interleaved (every level once per round, so a drift in the server's load spreads
  over all levels): makespan, tokens/s, time to first token and gaps; speedup against the same
  sweep's single-stream runs (``level × median single-stream makespan / makespan``).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import pandas as pd

from labkit.experiments.client import percentiles, run_sync, timed_stream
from labkit.experiments.profiles import Profile
from labkit.experiments.progress import Progress, doing, tick
from labkit.experiments.target import Reading, Target, read
from labkit.prompts import PROMPTS

__all__ = ["RUNS", "OverlapConfig", "WireConfig", "run_overlap", "run_wire"]


def _at_least(owner: str, **values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise ValueError(f"{owner}.{name} must be >= 1, got {value!r}")


# --------------------------------------------------------------------------- wire


@dataclass(frozen=True)
class WireConfig:
    prompts: int = 40
    max_tokens: int = 32
    concurrency: int = 8

    @classmethod
    def for_profile(cls, profile: Profile) -> WireConfig:
        return cls() if profile.full else cls(prompts=8, max_tokens=16, concurrency=4)

    @property
    def units(self) -> int:
        return self.prompts

    def __post_init__(self) -> None:
        _at_least("WireConfig", prompts=self.prompts, max_tokens=self.max_tokens, concurrency=self.concurrency)


WIRE_CHECKS = (
    ("answered_200", "HTTP 200 with text/event-stream"),
    ("order_ok", "chunks in the order [role], token..., finish, [usage], [DONE]"),
    ("done_sent", "ends with data: [DONE]"),
    ("usage_sent", "usage in the stream"),
    ("text_matches", "text identical to the same request answered whole"),
    ("finish_matches", "finish reason identical to the whole answer"),
    ("usage_matches", "usage identical to the whole answer"),
    ("no_error", "no error chunk, nothing cut off"),
)
WIRE_UNAVAILABLE = (
    ("request id header against the start event", "labkit's /v1/stream has a start event; OpenAI streams do not"),
    ("last event id against the event count", "OpenAI streams carry no event ids"),
    ("token ids identical to the whole answer", "OpenAI chunks carry text, not token ids"),
)


def run_wire(target: Target, config: WireConfig, progress: Progress | None = None) -> dict[str, pd.DataFrame]:
    doing(progress, f"{config.prompts} prompts, each streamed and answered whole")
    rows = run_sync(_wire(target, config, progress))
    streams = pd.DataFrame(rows)
    total = len(streams)
    checks = pd.DataFrame(
        [{"check": text, "passed": int(streams[col].sum()), "streams": total} for col, text in WIRE_CHECKS]
    )
    return {
        "streams": streams,
        "checks": checks,
        "sizes": size_table(streams),
        "unavailable": _unavailable(WIRE_UNAVAILABLE),
    }


def size_table(streams: pd.DataFrame) -> pd.DataFrame:
    """Bytes per token over the streams that ran to max_tokens (others spread fixed bytes over fewer)."""
    full = streams[streams.finish_reason == "length"]
    return pd.DataFrame(
        [
            {
                "streams_to_max_tokens": len(full),
                "tokens_per_stream": full.tokens.median(),
                "chunks_per_stream": full.chunks.median(),
                "bytes_per_token_median": full.bytes_per_token.median(),
                "bytes_per_token_min": full.bytes_per_token.min(),
                "bytes_per_token_max": full.bytes_per_token.max(),
                "ttft_median_ms": 1e3 * streams.ttft_s.median(),
            }
        ]
    )


async def _wire(target: Target, config: WireConfig, progress: Progress | None) -> list[dict[str, Any]]:
    gate = asyncio.Semaphore(config.concurrency)
    async with target.client(2 * config.concurrency) as client:

        async def one(i: int) -> dict[str, Any]:
            prompt = PROMPTS[i % len(PROMPTS)]
            async with gate:
                streamed, whole = await asyncio.gather(
                    timed_stream(client, target.body(prompt, config.max_tokens), path=target.path),
                    _whole(client, target.path, target.body(prompt, config.max_tokens, stream=False)),
                )
            tick(progress)
            return wire_row(i, read(streamed), whole)

        return list(await asyncio.gather(*(one(i) for i in range(config.prompts))))


async def _whole(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """The non-streamed answer's JSON, or {} (every comparison with it then fails, visibly)."""
    try:
        response = await client.post(path, json=body)
        return response.json() if response.status_code == 200 else {}
    except (httpx.HTTPError, ValueError):
        return {}


def wire_row(index: int, stream: Reading, whole: dict[str, Any]) -> dict[str, Any]:
    """One stream against the same request answered whole: the checks of :data:`WIRE_CHECKS`."""
    choice = (whole.get("choices") or [{}])[0]
    whole_text = choice.get("text", (choice.get("message") or {}).get("content"))
    result = stream.result
    return {
        "prompt": index,
        "status": result.status,
        "content_type": result.content_type,
        "answered_200": result.status == 200 and result.content_type.startswith("text/event-stream"),
        "order_ok": re.fullmatch(r"r?t*fu?d?", chunk_order(stream)) is not None,
        "done_sent": stream.done,
        "usage_sent": stream.usage is not None,
        "text_matches": stream.text == whole_text,
        "finish_matches": stream.finish_reason == choice.get("finish_reason"),
        "usage_matches": stream.usage is not None and stream.usage == whole.get("usage"),
        "no_error": stream.ok and result.unfinished_bytes == 0,
        "tokens": stream.tokens,
        "chunks": stream.chunks,
        "finish_reason": stream.finish_reason,
        "bytes": result.total_bytes,
        "bytes_per_token": result.total_bytes / stream.tokens if stream.tokens else float("nan"),
        "ttft_s": stream.ttft,
        "duration_s": stream.duration,
        "error": stream.error,
    }


def chunk_order(stream: Reading) -> str:
    """The stream's chunks as letters: r(ole), t(oken), f(inish), u(sage), d(one), e(rror)."""
    letters = []
    for event in stream.result.events:
        data, choices = event.data, event.data.get("choices") or []
        if data.get("raw") == "[DONE]":
            letters.append("d")
        elif "error" in data:
            letters.append("e")
        elif any(c.get("finish_reason") is not None for c in choices):
            letters.append("f")
        elif not choices:
            letters.append("u" if data.get("usage") else "e")
        else:
            delta = choices[0].get("delta") or {}
            letters.append("r" if "role" in delta and not delta.get("content") else "t")
    return "".join(letters)


# --------------------------------------------------------------------------- overlap


@dataclass(frozen=True)
class OverlapConfig:
    levels: tuple[int, ...] = (1, 4, 16, 32)
    repetitions: int = 3
    max_tokens: int = 64

    @classmethod
    def for_profile(cls, profile: Profile) -> OverlapConfig:
        return cls() if profile.full else cls(levels=(1, 2, 4), max_tokens=16)

    @property
    def units(self) -> int:
        return len(self.levels) * self.repetitions

    def __post_init__(self) -> None:
        if not self.levels or 1 not in self.levels or min(self.levels) < 1:
            raise ValueError(f"OverlapConfig.levels must include 1 and be >= 1, got {self.levels!r}")
        if self.repetitions < 3:
            raise ValueError(f"OverlapConfig.repetitions must be >= 3 (ranges need them), got {self.repetitions!r}")
        _at_least("OverlapConfig", max_tokens=self.max_tokens)


OVERLAP_UNAVAILABLE = (
    ("decode-step cost by batch size", "needs the engine in-process (labkit run overlap, no --target)"),
    ("first token at prefill's end vs the step's end", "a labkit hub setting"),
    ("step numbers of each token", "labkit's /v1/stream events only"),
)


def run_overlap(target: Target, config: OverlapConfig, progress: Progress | None = None) -> dict[str, pd.DataFrame]:
    def bodies(level: int) -> list[dict[str, Any]]:
        return [target.body(PROMPTS[i % len(PROMPTS)], config.max_tokens) for i in range(level)]

    doing(progress, f"warming up: {max(config.levels)} streams, not timed")
    target.launch(bodies(max(config.levels)))  # first batches pay for lazy set-up (pools, graphs, caches)
    rows = []
    for rep in range(config.repetitions):
        for level in config.levels:
            doing(progress, f"{level} streams at once, round {rep + 1}/{config.repetitions}")
            readings, makespan = target.launch(bodies(level))
            rows.append({"level": level, "round": rep, **launch_row(readings, makespan, config.max_tokens)})
            tick(progress, runs=rows)
    runs = pd.DataFrame(rows)
    solo = runs.loc[runs.level == 1, "makespan_s"].median()
    runs["speedup"] = runs.level * solo / runs.makespan_s
    return {"runs": runs, "levels": level_table(runs), "unavailable": _unavailable(OVERLAP_UNAVAILABLE)}


def launch_row(readings: list[Reading], makespan: float, max_tokens: int) -> dict[str, Any]:
    ttft = percentiles(r.ttft for r in readings if r.ttft is not None)
    gaps = percentiles(g for r in readings for g in r.gaps)
    tokens = sum(r.tokens for r in readings if r.ok)
    return {
        "makespan_s": makespan,
        "tokens": tokens,
        "tokens_per_s": tokens / makespan if makespan > 0 else float("nan"),
        "ttft_p50_s": ttft["p50"],
        "ttft_p99_s": ttft["p99"],
        "gap_p50_s": gaps["p50"],
        "gap_p99_s": gaps["p99"],
        "errors": sum(1 for r in readings if not r.ok),
        "short_streams": sum(1 for r in readings if r.ok and r.tokens < max_tokens),
    }


def level_table(runs: pd.DataFrame) -> pd.DataFrame:
    """One row per level: the median of its rounds and the range (low–high) of the headline numbers."""

    def span(values: pd.Series, fmt: str) -> str:
        low, high = fmt.format(values.min()), fmt.format(values.max())
        return low if low == high else f"{low}–{high}"

    rows = []
    for level, group in runs.groupby("level"):
        rows.append(
            {
                "streams": level,
                "rounds": len(group),
                "tokens_per_s": group.tokens_per_s.median(),
                "tokens_per_s_range": span(group.tokens_per_s, "{:.1f}"),
                "speedup": group.speedup.median(),
                "speedup_range": span(group.speedup, "{:.2f}"),
                "ttft_p50_ms": 1e3 * group.ttft_p50_s.median(),
                "ttft_p99_ms": 1e3 * group.ttft_p99_s.median(),
                "gap_p50_ms": 1e3 * group.gap_p50_s.median(),
                "gap_p99_ms": 1e3 * group.gap_p99_s.median(),
                "errors": int(group.errors.sum()),
                "short_streams": int(group.short_streams.sum()),
            }
        )
    return pd.DataFrame(rows)


# --------------------------------------------------------------------------- shared


def _unavailable(rows: tuple[tuple[str, str], ...]) -> pd.DataFrame:
    return pd.DataFrame([{"measurement": what, "status": "not available", "why": why} for what, why in rows])


#: experiment name -> (config class, run function) for ``labkit run NAME --target URL``.
RUNS: dict[str, tuple[Any, Callable[..., dict[str, pd.DataFrame]]]] = {
    "wire": (WireConfig, run_wire),
    "overlap": (OverlapConfig, run_overlap),
}
