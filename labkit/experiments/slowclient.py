"""Experiment 5, ``slowclient``: who pays when some readers cannot keep up?

Eight streams of 64 tokens, every token event padded with a 64 KiB SSE comment so that one
stream is about 4 MB (a laboratory device: real token events are about 100 bytes). k of the
eight readers (0, 1, 2, 4) sleep 0.25 s after each read; the others read at once. Every hub
policy gets its own server (one loaded model, one server at a time). We record the healthy
streams' completion time and p99 gap, when each slow stream's sequence left the engine (the
server's own timestamps), and what each slow client finally received.

On this machine Linux grows a connection's send buffer to about 4 MB, so a whole padded stream
fits in the server's kernel buffer and no policy ever sees a slow reader. The main runs therefore
cap the server's ``SO_SNDBUF`` at 256 KiB (the service's ``sndbuf`` setting; the chapter's stack
absorbed 0.25 to 0.33 MB); one extra run (``sndbuf`` "linux") shows what happens without the cap.

Two more tables. ``saturation``: with the batch full, how many slots paused streams hold while
other requests wait. ``eager``: what a server that formats events eagerly would hold for the slow
readers under ``unbounded``: the hub's peak queue (sampled, measured) times the size of one event
on the wire (measured); the lab's server queues unformatted events and pads while writing.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pandas as pd

from labkit.experiments.chapter import beside, span
from labkit.experiments.client import percentiles, run_sync
from labkit.experiments.profiles import Profile
from labkit.experiments.progress import Progress, doing, tick
from labkit.experiments.records import StreamResult
from labkit.experiments.saturation import Saturation, measure_saturation, plot_timeline
from labkit.experiments.servers import launch_readers, loaded_model, server_checks, server_like, wait_released
from labkit.experiments.workload import bodies, long_prompts
from labkit.hub import POLICIES
from labkit.prompts import PROMPTS

NAME = "slowclient"


@dataclass(frozen=True)
class Config:
    model: str = "smollm2-135m"
    streams: int = 8
    max_new_tokens: int = 64
    pad_bytes: int = 64 * 1024
    slow_counts: tuple[int, ...] = (0, 1, 2, 4)
    policies: tuple[str, ...] = POLICIES
    slow_sleep: float = 0.25  # seconds a slow reader sleeps after each read
    read_bytes: int = 64 * 1024  # the most one read takes off the socket
    slow_pace: float | None = 0.5  # a slow reader takes at most this share of a healthy one's rate
    server_sndbuf: int | None = 256 * 1024  # the server's SO_SNDBUF; None: Linux autotunes (to ~4 MB)
    high_water: int = 8
    stall_timeout: float = 0.25
    max_batch: int = 32  # the main runs never fill the batch
    saturation_policies: tuple[str, ...] = ("unbounded", "pause", "pause_then_drop")
    saturation_batch: int = 4
    saturation_slow: int = 2
    saturation_fast: int = 6
    saturation_tokens: int = 32  # per fast request; slow ones ask for max_new_tokens
    uncapped_policy: str | None = "naive"  # one run, k=1, with Linux's own send buffer; None: skip
    read_timeout: float = 120.0  # a reader leaves (RST) after this long, whatever it has read

    @classmethod
    def for_profile(cls, profile: Profile) -> Config:
        if profile.full:
            return cls(model=profile.model)
        # small events, short streams, short sleeps: each run takes a second or two
        return cls(
            model=profile.model,
            streams=4,
            max_new_tokens=24,
            pad_bytes=8 * 1024,
            slow_counts=(0, 1),
            slow_sleep=0.03,
            read_bytes=8 * 1024,
            server_sndbuf=16 * 1024,
            saturation_fast=3,
            saturation_tokens=12,
            read_timeout=60.0,
        )

    def __post_init__(self) -> None:
        if not 1 <= self.streams <= len(PROMPTS) or max(self.slow_counts, default=0) > self.streams:
            raise ValueError(
                f"slowclient.Config: need slow counts <= streams <= {len(PROMPTS)}, "
                f"got streams={self.streams!r}, slow_counts={self.slow_counts!r}"
            )
        unknown = set(self.policies) | set(self.saturation_policies) | {self.uncapped_policy or "naive"}
        if unknown - set(POLICIES):
            raise ValueError(f"slowclient.Config policies must come from {POLICIES}, got {sorted(unknown)!r}")
        if self.slow_sleep < 0 or self.read_bytes < 1 or self.read_timeout <= 0:
            raise ValueError("slowclient.Config: need slow_sleep >= 0, read_bytes >= 1, read_timeout > 0")
        if self.saturation_slow >= self.saturation_batch:
            raise ValueError(
                f"slowclient.Config.saturation_slow must be < saturation_batch, got {self.saturation_slow!r}"
            )


def server_options(config: Config) -> dict[str, Any]:
    """The first policy's server, as ``run`` would start it (for a notebook to start it itself)."""
    return {"model": config.model, **server_settings(config, config.policies[0])}


def server_settings(
    config: Config, policy: str, *, max_batch: int | None = None, sndbuf: int | None | str = "config"
) -> dict[str, Any]:
    """What a server for ``policy`` is started with (``sndbuf`` defaults to the config's cap)."""
    return {
        "policy": policy,
        "pad_bytes": config.pad_bytes,
        "high_water": config.high_water,
        "stall_timeout": config.stall_timeout,
        "max_batch": max_batch or config.max_batch,
        "sndbuf": config.server_sndbuf if sndbuf == "config" else sndbuf,
    }


def saturation_config(config: Config) -> Saturation:
    return Saturation(
        slow=config.saturation_slow,
        fast=config.saturation_fast,
        slow_tokens=config.max_new_tokens,
        fast_tokens=config.saturation_tokens,
        slow_sleep=config.slow_sleep,
        read_bytes=config.read_bytes,
        read_timeout=config.read_timeout,
    )


def units(config: Config) -> int:
    extra = len(config.saturation_policies) + (config.uncapped_policy is not None)
    return len(config.policies) * len(config.slow_counts) + extra


def run(config: Config, *, server: Any = None, progress: Progress | None = None) -> dict[str, pd.DataFrame]:
    model = loaded_model(server, config.model)
    prompts = long_prompts(model, config.max_new_tokens)
    rows: list[dict[str, Any]] = []
    samples: list[pd.DataFrame] = []
    checks: list[Any] = []
    asked = config
    for (policy, sndbuf), group in _by_server(_mix_runs(config)):
        with server_like(server, model, **server_settings(config, policy, sndbuf=sndbuf)) as srv:
            served: list[dict[str, Any]] = []
            for k in group:
                doing(progress, f"{policy}: {k} slow of {config.streams} readers")
                more, queue = measure_mix(srv, config, prompts, policy, k, sndbuf)
                served, samples = served + more, samples + [queue]
                config = paced(config, more) if k == 0 else config
                tick(progress, streams=rows + served)
            rows += served
            checks.append(_check(srv, policy, "slow readers", served))
    saturation: list[dict[str, Any]] = []
    timeline: list[pd.DataFrame] = []
    for policy in config.saturation_policies:
        doing(progress, f"{policy} under a full batch")
        with server_like(server, model, **server_settings(config, policy, max_batch=config.saturation_batch)) as srv:
            row, line = measure_saturation(srv, saturation_config(config), prompts, policy)
            saturation, timeline = saturation + [row], timeline + [line]
            checks.append(_check(srv, policy, "full batch", []))
            tick(progress, saturation=saturation, checks=checks)
    streams, queues = pd.DataFrame(rows), _concat(samples)
    return {
        "streams": streams,
        "grid": grid_table(streams),
        "queues": queues,
        "eager": eager_table(streams, queues),
        "saturation": pd.DataFrame(saturation),
        "timeline": _concat(timeline),
        "pace": pace_table(asked, config, streams),
        "checks": pd.DataFrame(checks),
    }


def _mix_runs(config: Config) -> list[tuple[str, int, int | None]]:
    runs = [(policy, k, config.server_sndbuf) for policy in config.policies for k in config.slow_counts]
    return runs + ([(config.uncapped_policy, 1, None)] if config.uncapped_policy is not None else [])


def paced(config: Config, rows: list[dict[str, Any]]) -> Config:
    """After a run with nobody slow: shrink the slow reader's reads, if needed, so that it takes at
    most ``slow_pace`` of the rate the server wrote to each reader.

    Why: whether a reader is slow depends on how fast the engine writes, and on two shared CPU
    cores that varies by several times; the chapter's GPU wrote 25 times faster than its reader.
    Once paced, ``slow_pace`` is None and later runs keep the same reader.
    """
    if config.slow_pace is None:
        return config
    writer = float(np.nanmedian([r["kib_per_s"] for r in rows if r["role"] == "healthy"])) * 1024
    wanted = int(writer * config.slow_sleep * config.slow_pace)
    return replace(config, read_bytes=max(1024, min(config.read_bytes, wanted)), slow_pace=None)


def pace_table(asked: Config, used: Config, streams: pd.DataFrame) -> pd.DataFrame:
    healthy = streams[(streams.role == "healthy") & (streams.slow_readers == 0)]
    return pd.DataFrame(
        [
            {
                "writer_kib_per_s": healthy.kib_per_s.median(),
                "slow_pace": asked.slow_pace,
                "read_bytes": used.read_bytes,
                "slow_sleep_s": used.slow_sleep,
                "reader_kib_per_s": used.read_bytes / 1024 / max(used.slow_sleep, 1e-9),
            }
        ]
    )


def _concat(frames: list[pd.DataFrame]) -> pd.DataFrame:
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def _by_server(runs: list[tuple[str, int, int | None]]) -> list[tuple[tuple[str, int | None], list[int]]]:
    """Consecutive runs that share a server's settings, grouped: one server start per group."""
    groups: dict[tuple[str, int | None], list[int]] = {}
    for policy, k, sndbuf in runs:
        groups.setdefault((policy, sndbuf), []).append(k)
    return list(groups.items())


def _check(srv: Any, policy: str, part: str, rows: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "policy": policy,
        "part": part,
        "streams": len(rows),
        "unended": sum(1 for r in rows if r["end"] == "cut"),
        **server_checks(srv),
    }


# --------------------------------------------------------------------------- k slow readers of N


def measure_mix(
    srv: Any, config: Config, prompts: list[int], policy: str, k: int, sndbuf: int | None
) -> tuple[list[dict[str, Any]], pd.DataFrame]:
    """N streams at once, the first k read slowly; a row per stream, and the sampled queues."""
    reads = [
        dict(sleep=config.slow_sleep if i < k else 0.0, read_bytes=config.read_bytes, leave_after_s=config.read_timeout)
        for i in range(config.streams)
    ]
    requests = bodies(prompts, config.streams, config.max_new_tokens)
    results, samples, t0 = run_sync(launch_readers(srv, requests, reads))
    records = run_sync(wait_released(srv.hub, [r.request_id for r in results]))
    sndbuf_name = "linux" if sndbuf is None else str(sndbuf)
    rows = [
        stream_row(r, rec, t0)
        | {
            "policy": policy,
            "slow_readers": k,
            "stream": i,
            "role": "slow" if i < k else "healthy",
            "sndbuf": sndbuf_name,
        }
        for i, (r, rec) in enumerate(zip(results, records))
    ]
    return rows, samples.assign(policy=policy, slow_readers=k, sndbuf=sndbuf_name)


def stream_row(r: StreamResult, rec: Any, t0: float) -> dict[str, Any]:
    """What one client saw and what the server recorded, in seconds from the launch."""
    released = rec.released if rec is not None else None
    sizes = [e.nbytes for e in r.tokens]
    unread = sum(e.nbytes for e in r.events if released is not None and e.time > released)
    return {
        "tokens_received": len(r.tokens),
        "end": r.finish_reason or ("left" if r.left else "cut"),
        "client_done_s": None if r.ended is None else r.ended - t0,
        "gap_p99_s": percentiles(r.gaps, (99,))["p99"],
        "left_engine_s": None if released is None else released - t0,
        "engine_finish": getattr(rec, "finish_reason", None),
        "tokens_generated": getattr(rec, "tokens_generated", 0),
        "max_queue": getattr(rec, "max_queue", 0),
        "pauses": getattr(rec, "pauses", 0),
        "bytes_received": r.total_bytes,
        "event_bytes": float(np.median(sizes)) if sizes else np.nan,
        "kib_per_s": float(np.median(sizes) / np.median(r.gaps)) / 1024 if len(sizes) > 1 else np.nan,
        "unread_at_release_bytes": unread,
        "error": r.error,
    }


def grid_table(streams: pd.DataFrame) -> pd.DataFrame:
    """Per policy and k: the healthy streams' worst completion and p99 gap; the slow ones' fate."""
    rows = []
    for (sndbuf, policy, k), group in streams.groupby(["sndbuf", "policy", "slow_readers"], sort=False):
        healthy, slow = group[group.role == "healthy"], group[group.role == "slow"]
        rows.append(
            {
                "sndbuf": sndbuf,
                "policy": policy,
                "slow_readers": k,
                "healthy_done_s": healthy.client_done_s.max(),
                "healthy_gap_p99_s": healthy.gap_p99_s.max(),
                "healthy_kib_per_s": healthy.kib_per_s.median(),
                "slow_left_engine_min_s": slow.left_engine_s.min(),
                "slow_left_engine_max_s": slow.left_engine_s.max(),
                "slow_done_max_s": slow.client_done_s.max(),
                "slow_tokens_min": slow.tokens_received.min(),
                "slow_tokens_max": slow.tokens_received.max(),
                "slow_ends": ", ".join(sorted(set(slow.end))),
                "slow_max_queue": slow.max_queue.max(),
                "slow_pauses": slow.pauses.max(),
            }
        )
    return pd.DataFrame(rows)


def eager_table(streams: pd.DataFrame, queues: pd.DataFrame) -> pd.DataFrame:
    """Under ``unbounded``, per number of slow readers: each slow stream's peak queue (the hub's
    record), summed, times the bytes of one formatted event (measured on the wire); beside it the
    arithmetic bound (every token of every slow stream) and the sampled peak over all streams."""
    rows = []
    main = streams[(streams.policy == "unbounded") & (streams.sndbuf != "linux") & (streams.slow_readers > 0)]
    for k, group in main.groupby("slow_readers"):
        sampled = queues[(queues.policy == "unbounded") & (queues.slow_readers == k) & (queues.sndbuf != "linux")]
        slow, event_bytes = group[group.role == "slow"], float(group.event_bytes.median())
        rows.append(
            {
                "slow_readers": k,
                "slow_peak_events": int(slow.max_queue.sum()),
                "event_bytes": event_bytes,
                "eager_bytes": float(slow.max_queue.sum()) * event_bytes,
                "all_streams_peak_events": int(sampled.queued_events.max()) if len(sampled) else 0,
                "bound_bytes": k * float(group.tokens_generated.max()) * event_bytes,
                "unread_at_release_bytes": float(slow.unread_at_release_bytes.sum()),
            }
        )
    return pd.DataFrame(rows)


def calibrate(srv: Any, config: Config, prompts: list[int]) -> Config:
    """One run with nobody slow on ``srv``, then :func:`paced`: the reader later runs should use."""
    rows, _ = measure_mix(srv, config, prompts, "calibration", 0, config.server_sndbuf)
    return paced(config, rows)


# --------------------------------------------------------------------------- reading the tables


def summary(tables: dict[str, pd.DataFrame]) -> dict[str, Any]:
    grid = tables["grid"]
    main = grid[grid.sndbuf != "linux"]
    one = main[main.slow_readers == main.slow_readers[main.slow_readers > 0].min()].set_index("policy")
    base = main[main.slow_readers == 0].set_index("policy")
    return {
        "healthy_done_s_k0": base.healthy_done_s.round(3).to_dict(),
        "healthy_done_s_k1": one.healthy_done_s.round(3).to_dict(),
        "healthy_gap_p99_s_k1": one.healthy_gap_p99_s.round(3).to_dict(),
        "slow_left_engine_max_s_k1": one.slow_left_engine_max_s.round(3).to_dict(),
        "eager_bytes": tables["eager"].set_index("slow_readers").eager_bytes.to_dict(),
    }


def beside_chapter(tables: dict[str, pd.DataFrame]) -> pd.DataFrame:
    main, eager, sat = tables["grid"][tables["grid"].sndbuf != "linux"], tables["eager"], tables["saturation"]
    k1 = main.slow_readers[main.slow_readers > 0].min()

    def ours(policy: str, col: str, k: int | None = None, scale: float = 1.0, fmt: str = "{:.2f}") -> str:
        rows = main[(main.policy == policy) & ((main.slow_readers > 0) if k is None else (main.slow_readers == k))]
        return span(scale * rows[col], fmt)

    ms: dict[str, Any] = dict(scale=1000.0, fmt="{:.0f}")
    return beside(
        [
            (
                "naive: last healthy stream done, 1 slow of 8 (none slow)",
                "28 (1)",
                f"{ours('naive', 'healthy_done_s', k1)} ({ours('naive', 'healthy_done_s', 0)})",
                "s",
            ),
            (
                "naive: healthy p99 gap, 1 slow (none slow)",
                "about 1,000 (19)",
                f"{ours('naive', 'healthy_gap_p99_s', k1, **ms)} ({ours('naive', 'healthy_gap_p99_s', 0, **ms)})",
                "ms",
            ),
            (
                "unbounded: slow sequence left the engine",
                "after about 1",
                ours("unbounded", "slow_left_engine_max_s"),
                "s",
            ),
            (
                "pause: slow sequence held its slot and blocks until",
                "21–25",
                ours("pause", "slow_left_engine_max_s"),
                "s",
            ),
            ("drop: slot given back after", "0.6–0.8", ours("drop", "slow_left_engine_max_s"), "s"),
            ("drop: slow client read its slow_client error at", "18.7–19.7", ours("drop", "slow_done_max_s"), "s"),
            (
                "eager server: held for the most slow readers",
                "about 4 MB per reader (arithmetic)",
                span(eager.eager_bytes.tail(1) / 2**20),
                "MiB (measured)",
            ),
            (
                "pause, full batch: most slots held by paused streams",
                "not measured (argued)",
                span(sat.loc[sat.policy == "pause", "paused_slots_max_while_waiting"], "{:.0f}"),
                "slots",
            ),
        ]
    )


def findings(tables: dict[str, pd.DataFrame], config: Config) -> str:
    """A few plain sentences from this run's numbers (what the notebook says under its tables)."""
    grid, pace = tables["grid"].set_index(["sndbuf", "policy", "slow_readers"]), tables["pace"].iloc[0]
    cap, k = str(config.server_sndbuf), max(config.slow_counts)
    row = lambda policy, n, buf=cap: grid.loc[(buf, policy, n)] if (buf, policy, n) in grid.index else None  # noqa: E731
    base, naive, pause, drop = row("unbounded", 0), row("naive", k), row("pause", k), row("drop", k)
    said = []
    if base is not None:
        said.append(
            f"With nobody slow, the streams ended after {base.healthy_done_s:.1f} s; the server wrote "
            f"about {pace.writer_kib_per_s:.0f} KiB/s to each reader; a slow reader took at most "
            f"{pace.reader_kib_per_s:.0f} KiB/s ({pace.read_bytes / 1024:.0f} KiB per read)."
        )
    if naive is not None:
        said.append(
            f"Under naive, with {k} slow, the last healthy stream ended after {naive.healthy_done_s:.1f} s "
            f"(p99 gap {1000 * naive.healthy_gap_p99_s:.0f} ms)."
        )
    if pause is not None and drop is not None:
        said.append(
            f"Pause kept the slow sequences in the engine until {pause.slow_left_engine_max_s:.1f} s; "
            f"drop cancelled them by {drop.slow_left_engine_max_s:.1f} s, and their clients ended with "
            f"{drop.slow_ends} at {drop.slow_done_max_s:.1f} s."
        )
    linux = grid.xs("linux", level="sndbuf") if "linux" in grid.index.get_level_values(0) else None
    if linux is not None and len(linux):
        said.append(
            f"With Linux's own send buffer, naive's healthy streams ended after "
            f"{linux.healthy_done_s.max():.1f} s beside one slow reader: the kernel took the backlog."
        )
    return " ".join(said)


def report(tables: dict[str, pd.DataFrame]) -> str:
    """Stable lines for a checked notebook cell: the invariants every server kept."""
    checks = tables["checks"]
    bad = checks[~(checks.cache_whole & (checks.open_streams == 0) & (checks.unended == 0))]
    lines = [
        f"{'every' if bad.empty else 'NOT every'} server ended with its cache whole and no stream open, "
        f"and every client was told how its stream ended (done or error)"
    ]
    lines += [f"  failed: {row.policy}, {row.part} ({row.what or 'streams open or cut'})" for _, row in bad.iterrows()]
    healthy = tables["streams"][tables["streams"].role == "healthy"]
    cut = int(((healthy.end != "length") | healthy.error.notna()).sum())
    lines.append(
        "every healthy reader got its whole stream and a normal end, whatever the policy: "
        + ("yes" if cut == 0 else f"NOT ({cut} of {len(healthy)} did not)")
    )
    if len(tables["saturation"]):
        failed = int(tables["saturation"].fast_errors.sum())
        lines.append("under a full batch no fast reader failed: " + ("yes" if failed == 0 else f"NOT ({failed} did)"))
    return "\n".join(lines)


def plot(tables: dict[str, pd.DataFrame]) -> list:
    return [_plot_grid(tables["grid"]), plot_timeline(tables["timeline"], "slowclient_full_batch")]


def _plot_grid(grid: pd.DataFrame):
    from labkit.plots import new_figure

    fig, (left, right) = new_figure("slowclient_policies", ncols=2)
    main = grid[grid.sndbuf != "linux"]
    for policy, group in main.groupby("policy", sort=False):
        left.plot(group.slow_readers, group.healthy_done_s, "o-", label=policy)
        slow = group[group.slow_readers > 0]
        right.plot(slow.slow_readers, slow.slow_left_engine_max_s, "o-", label=policy)
    left.set(
        xlabel="slow readers among the streams",
        ylabel="s until the last healthy stream ended",
        title="What the healthy streams pay",
    )
    right.set(
        xlabel="slow readers among the streams",
        ylabel="s until the last slow sequence left the engine",
        title="How long slow streams hold the engine",
    )
    left.legend()
    return fig
