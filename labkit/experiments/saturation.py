"""A full batch: how many slots do paused streams hold while other requests wait?

The chapter argued this and did not measure it. Here a batch limit of 4 is filled first by slow
readers (who fall behind and, under ``pause``, are left out of the decode batch while keeping
their slot and blocks), and then fast requests arrive and wait for a slot. The engine's running,
paused and waiting counts are sampled every 10 ms; slot-seconds held by paused streams while
something waited is the cost, and the fast requests' time to first token and completion is who
paid it. Once every fast request has ended, the slow readers leave (RST): what they would have
read is not the question here. Used by ``slowclient`` (one stall timeout, several policies) and
``extensions`` (``pause_then_drop`` at several stall timeouts).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from labkit.experiments.client import percentiles, run_sync
from labkit.experiments.records import StreamResult
from labkit.experiments.servers import launch_readers, wait_released
from labkit.experiments.workload import bodies

__all__ = ["Saturation", "measure_saturation", "saturation_row", "plot_timeline"]


@dataclass(frozen=True)
class Saturation:
    """Who fills the batch: ``slow`` slow readers first, then ``fast`` requests that read at once."""

    slow: int = 2
    fast: int = 6
    slow_tokens: int = 64
    fast_tokens: int = 32
    slow_sleep: float = 0.25
    read_bytes: int = 64 * 1024
    read_timeout: float = 120.0


def measure_saturation(
    srv: Any, config: Saturation, prompts: list[int], label: str
) -> tuple[dict[str, Any], pd.DataFrame]:
    """One run on ``srv`` (whose batch limit and policy set the scene); a row, and the samples."""
    slow = bodies(prompts, config.slow, config.slow_tokens)
    fast = bodies(prompts[config.slow :] or prompts, config.fast, config.fast_tokens)
    slow_read = dict(sleep=config.slow_sleep, read_bytes=config.read_bytes, leave_after_s=config.read_timeout)
    fast_read = dict(sleep=0.0, read_bytes=config.read_bytes, leave_after_s=config.read_timeout)
    results, samples, t0 = run_sync(
        launch_readers(
            srv,
            slow + fast,
            [slow_read] * len(slow) + [fast_read] * len(fast),
            first=len(slow),
            leave_first_after_rest=True,
        )
    )
    records = run_sync(wait_released(srv.hub, [r.request_id for r in results]))
    return saturation_row(label, results[len(slow) :], records[: len(slow)], samples, t0), samples.assign(policy=label)


def saturation_row(
    label: str, fast: list[StreamResult], slow_records: list[Any], samples: pd.DataFrame, t0: float
) -> dict[str, Any]:
    waiting = samples.waiting > 0
    dt = samples.t.diff().fillna(0.0)
    ttft = percentiles((r.ttft for r in fast), (50, 100))
    released = [r.released - t0 for r in slow_records if r is not None and r.released is not None]
    return {
        "policy": label,
        "fast_ttft_p50_s": ttft["p50"],
        "fast_ttft_max_s": ttft["p100"],
        "fast_done_s": max((r.ended or t0) - t0 for r in fast),
        "paused_slots_max_while_waiting": int(samples.paused[waiting].max()) if waiting.any() else 0,
        "paused_slot_s_while_waiting": float((samples.paused * dt)[waiting].sum()),
        "waited_s": float(dt[waiting].sum()),
        "slow_left_engine_s": max(released) if released else np.nan,
        "fast_errors": sum(1 for r in fast if r.error or r.finish_reason not in ("length", "eos", "stop")),
    }


def plot_timeline(timeline: pd.DataFrame, name: str):
    """One panel per run: slots in use, slots held by paused streams, requests waiting."""
    from labkit.plots import new_figure

    labels = list(dict.fromkeys(timeline.policy))
    fig, axes = new_figure(name, ncols=len(labels))
    for ax, label in zip(axes, labels):
        line = timeline[timeline.policy == label]
        ax.step(line.t, line.running, where="post", label="running (slots in use)")
        ax.step(line.t, line.paused, where="post", label="paused (slots held)")
        ax.step(line.t, line.waiting, where="post", label="waiting for a slot")
        ax.set(title=label, xlabel="s from launch", ylabel="requests")
    axes[0].legend()
    return fig
