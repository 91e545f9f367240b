"""A full batch: how many slots do paused streams hold while other requests wait?

The chapter argued this and did not measure it. Here a batch limit of 4 is filled first by slow
readers (who fall behind and, under ``pause``, are left out of the decode batch while keeping
their slot and blocks), and once the server holds them paused, fast requests arrive and wait for
a slot. The server's running,
paused and waiting counts are sampled over HTTP (``GET /stats``) every 50 ms; slot-seconds held
by paused streams while something waited is the cost, and the fast requests' time to first token and completion is who
paid it. Once every fast request has ended, the slow readers leave (RST): what they would have
read is not the question here. Used by ``extensions``
(``pause`` against ``pause_then_drop`` at several stall timeouts, interleaved repetitions).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from labkit.experiments.client import percentiles, run_sync
from labkit.experiments.records import StreamResult
from labkit.experiments.slowreaders import Pace, launch, paused, records
from labkit.experiments.workload import bodies

__all__ = ["Saturation", "measure_saturation", "saturation_row", "plot_timeline"]


@dataclass(frozen=True)
class Saturation:
    """Who fills the batch: ``slow`` slow readers first, then ``fast`` requests that read at once."""

    slow: int = 2
    fast: int = 4
    slow_tokens: int = 48
    fast_tokens: int = 16
    slow_sleep: float = 0.1
    read_bytes: int = 64 * 1024  # the slow readers' read size (their pace, with ``slow_sleep``)
    read_timeout: float = 120.0
    sample_every: float = 0.05  # GET /stats this often


def measure_saturation(srv: Any, config: Saturation, label: str) -> tuple[dict[str, Any], pd.DataFrame]:
    """One run on ``srv`` (whose batch limit and policy set the scene); a row, and the samples of
    the server's ``/stats`` (running, paused, waiting) taken over HTTP while it ran."""
    slow = bodies(range(config.slow), config.slow, config.slow_tokens, ignore_eos=True)
    fast = bodies(range(config.slow, config.slow + config.fast), config.fast, config.fast_tokens, ignore_eos=True)
    paces = [Pace(config.slow_sleep, config.read_bytes, config.read_timeout)] * config.slow
    paces += [Pace(0.0, 64 * 1024, config.read_timeout)] * config.fast
    wait = paused(srv.url, config.slow)  # the fast requests arrive once the slow streams are paused
    done = run_sync(
        launch(srv.url, slow + fast, paces, first=config.slow, rest_after=wait, sample_every=config.sample_every)
    )
    slow_records = run_sync(records(srv.url, [r.request_id for r in done.results[: config.slow]]))
    row = saturation_row(label, done.results[config.slow :], slow_records, done.samples, done.t0)
    return row, done.samples.assign(policy=label)


def saturation_row(
    label: str, fast: list[StreamResult], slow_records: list[Any], samples: pd.DataFrame, t0: float
) -> dict[str, Any]:
    waiting = samples.waiting > 0
    dt = samples.t.diff().fillna(0.0)
    ttft = percentiles((r.ttft for r in fast), (50, 100))
    released = [r["released"] - t0 for r in slow_records if r and r.get("released") is not None]
    fast_done = max((r.ended or t0) - t0 for r in fast)
    # the slow readers leave only after the fast ones ended: a cancel before that was the server's
    dropped = [
        r for r in slow_records if r and r.get("finish_reason") == "cancelled" and r["released"] - t0 < fast_done
    ]
    return {
        "policy": label,
        "fast_ttft_p50_s": ttft["p50"],
        "fast_ttft_max_s": ttft["p100"],
        "fast_done_s": fast_done,
        "paused_slots_max_while_waiting": int(samples.paused[waiting].max()) if waiting.any() else 0,
        "paused_slot_s_while_waiting": float((samples.paused * dt)[waiting].sum()),
        "waited_s": float(dt[waiting].sum()),
        "slow_left_engine_s": max(released) if released else np.nan,
        "slow_dropped": len(dropped),
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
