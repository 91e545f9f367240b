"""Experiment 5, ``slowclient``: who pays when a reader cannot keep up?

N streams of a fixed number of tokens (``ignore_eos``: every stream makes exactly that many),
every token event padded with an SSE comment (a laboratory device that makes a stream long
enough to fill the buffers between server and client; real token events are far smaller). In a
run, k of the readers (0 or 1) are slow; each hub policy has its own server, all started once on
one loaded model, and the runs go (policy, k) by (policy, k), repetition after repetition
(``readings.interleaved``), so every policy is compared with its own k = 0 runs made in between.

"Slow" is a fraction of what the same server writes. A first run with nobody slow (a warm-up,
not counted) measures the rate a reader that keeps up is written to; the slow reader then takes
``slow_fraction`` of that per second (``read_bytes`` per read, then ``slow_sleep``). Each run
records the rate the slow reader actually read at; divided by its policy's k = 0 write rate
(the median over those runs) it is the achieved ratio, which must stay at most 0.5.

The hub acts on its queue, after the kernel's buffers are full: ``pause`` when a stream is
``high_water`` events behind, ``drop`` when it stays that far behind for ``stall_timeout``,
``pause_then_drop`` when it stays paused that long (``labkit.hub.policies``). The server's
``SO_SNDBUF`` is capped (Linux would otherwise grow it to hold a whole stream), and the sizes are
chosen so that a reader at a tenth of the write rate falls that far behind, and stays paused past
the stall timeout, well before its stream ends: a stream is ``max_new_tokens`` events, the
buffers hold about a dozen.

Healthy completion is read in seconds (from the launch, the last healthy reader's end) and in
steps (the engine step whose events released the last healthy sequence, counted from the run's
first step, from the server's own records over HTTP). A slow reader leaves (RST) ``linger``
seconds after the last healthy reader ended; by then its policy has done what it does.
"""

from __future__ import annotations

import time
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from labkit.experiments.chapter import beside
from labkit.experiments.chapter_figures import NO_FIGURE, figure
from labkit.experiments.client import run_sync
from labkit.experiments.profiles import Profile
from labkit.experiments.progress import Progress, doing, tick
from labkit.experiments.readings import Verdict, current_step, fetch_steps, interleaved, span, spread
from labkit.experiments.servers import loaded_model, server_checks, server_like
from labkit.experiments.slowreaders import Pace, launch, read_rate, records, stats
from labkit.experiments.workload import bodies
from labkit.hub import POLICIES
from labkit.prompts import PROMPTS

NAME = "slowclient"
ISOLATION_LIMIT = 1.25  # a policy isolates when healthy completion at k=1 stays within this of k=0
DELAY_LIMIT = 1.5  # naive delays when healthy completion at k=1 is at least this times k=0
MAX_RATIO = 0.5  # a slow reader reads at most this share of what the server writes


@dataclass(frozen=True)
class Config:
    model: str = "smollm2-135m"
    streams: int = 6  # the chapter ran 8; 6 keeps the full run within its time budget
    max_new_tokens: int = 48
    pad_bytes: int = 16 * 1024
    slow_counts: tuple[int, ...] = (0, 1)
    policies: tuple[str, ...] = POLICIES
    repetitions: int = 3
    slow_fraction: float = 0.1  # the slow reader's pace, as a share of the measured write rate
    slow_sleep: float = 0.1  # seconds a slow reader sleeps after each read
    read_bytes: int = 64 * 1024  # the most one read takes off the socket (slow: set by the pace)
    server_sndbuf: int | None = 16 * 1024  # the server's SO_SNDBUF; None: Linux autotunes it
    high_water: int = 8
    stall_timeout: float = 0.25
    linger: float = 0.5  # seconds a slow reader reads on after the last healthy one ended
    kv_cache_mb: int = 64  # per server: five run at once on one model
    read_timeout: float = 120.0  # a reader leaves (RST) after this long, whatever it has read
    # a full batch (used by notebook 07's saturation runs)
    saturation_batch: int = 4
    saturation_slow: int = 2
    saturation_fast: int = 4
    saturation_tokens: int = 16  # per fast request; slow ones ask for max_new_tokens

    @classmethod
    def for_profile(cls, profile: Profile) -> Config:
        if profile.full:
            return cls(model=profile.model)
        # four streams, short sleeps: the tiny model writes fast, and the pace follows it
        # (and a stream long enough that a slow reader falls behind well before its end)
        # high_water 32 and a 0.1 s stall timeout: pause_then_drop's pause (16 events taken off at
        # the slow pace) lasted 0.6-1 s; drop's timer runs from the mark until the slow stream's
        # last token is made (0.25-0.4 s here, shorter on a faster engine). At 8 and 0.25 s, a
        # 2.5x longer timeout (a faster writer's shorter pause) saw neither policy drop, 0 of 3
        return cls(
            model=profile.model, streams=4, max_new_tokens=128, slow_sleep=0.02, read_timeout=60.0, saturation_fast=3,
            high_water=32, stall_timeout=0.1,
        )  # fmt: skip

    def __post_init__(self) -> None:
        if not 1 <= self.streams <= len(PROMPTS) or max(self.slow_counts, default=0) >= self.streams:
            raise ValueError(
                f"slowclient.Config: need slow counts < streams <= {len(PROMPTS)}, "
                f"got streams={self.streams!r}, slow_counts={self.slow_counts!r}"
            )
        if 0 not in self.slow_counts:
            raise ValueError(f"slowclient.Config.slow_counts must include 0 (the baseline), got {self.slow_counts!r}")
        if set(self.policies) - set(POLICIES):
            raise ValueError(f"slowclient.Config.policies must come from {POLICIES}, got {self.policies!r}")
        if not 0 < self.slow_fraction <= MAX_RATIO:
            raise ValueError(f"slowclient.Config.slow_fraction must be in (0, {MAX_RATIO}], got {self.slow_fraction!r}")
        if self.slow_sleep <= 0 or self.read_bytes < 1 or self.read_timeout <= 0 or self.repetitions < 1:
            raise ValueError(
                "slowclient.Config: need slow_sleep > 0, read_bytes >= 1, read_timeout > 0, repetitions >= 1"
            )
        if self.saturation_slow >= self.saturation_batch:
            raise ValueError(
                f"slowclient.Config.saturation_slow must be < saturation_batch, got {self.saturation_slow!r}"
            )


def server_options(config: Config) -> dict[str, Any]:
    """The first policy's server, as ``run`` would start it (for a notebook to start it itself)."""
    return {"model": config.model, **server_settings(config, config.policies[0])}


def server_settings(config: Config, policy: str, *, max_batch: int | None = None) -> dict[str, Any]:
    """What a server for ``policy`` is started with."""
    return {
        "policy": policy,
        "pad_bytes": config.pad_bytes,
        "high_water": config.high_water,
        "stall_timeout": config.stall_timeout,
        "max_batch": max_batch or config.streams,
        "sndbuf": config.server_sndbuf,
        "kv_cache_mb": config.kv_cache_mb,
    }


def conditions(config: Config) -> list[tuple[str, int]]:
    return [(policy, k) for policy in config.policies for k in config.slow_counts]


def units(config: Config) -> int:
    return 1 + config.repetitions * len(conditions(config))


def requests(config: Config) -> list[dict[str, Any]]:
    """The same N requests in every run: fixed prompts, ``ignore_eos``, so each makes N tokens."""
    return bodies(list(range(config.streams)), config.streams, config.max_new_tokens, ignore_eos=True)


# --------------------------------------------------------------------------- the run


def run(config: Config, *, server: Any = None, progress: Progress | None = None) -> dict[str, pd.DataFrame]:
    model = loaded_model(server, config.model)
    streams: list[dict[str, Any]] = []
    runs: list[dict[str, Any]] = []
    steps: list[pd.DataFrame] = []
    with ExitStack() as stack:
        servers = {
            p: stack.enter_context(server_like(server, model, **server_settings(config, p))) for p in config.policies
        }
        doing(progress, "a warm-up run with nobody slow: the write rate the slow reader is paced by")
        pace = calibrate(servers[config.policies[0]], config)
        tick(progress)
        for rep, (policy, k) in interleaved(conditions(config), config.repetitions):
            doing(progress, f"{policy}: {k} slow of {config.streams}, repetition {rep + 1}/{config.repetitions}")
            more, row, log = measure_run(servers[policy], config, pace, policy, k, rep)
            streams, runs, steps = streams + more, runs + [row], steps + [log]
            tick(progress, runs=runs)
        checks = [_check(srv, p, streams) for p, srv in servers.items()]
    runs_table = with_ratios(pd.DataFrame(runs))
    return {
        "runs": runs_table,
        "compare": compare_table(runs_table),
        "streams": pd.DataFrame(streams),
        "steps": pd.concat(steps, ignore_index=True),
        "pace": pd.DataFrame([pace]),
        "checks": pd.DataFrame(checks),
    }


def calibrate(srv: Any, config: Config) -> dict[str, Any]:
    """One run with nobody slow: the median rate a reader that keeps up was written to, and the
    slow reader's read size that takes ``slow_fraction`` of it per second."""
    healthy = Pace(0.0, config.read_bytes, config.read_timeout)
    done = run_sync(launch(srv.url, requests(config), [healthy] * config.streams))
    writer = float(np.nanmedian([read_rate(r) for r in done.results]))
    read_bytes = max(256, int(writer * config.slow_fraction * config.slow_sleep))
    return {
        "writer_kib_per_s": writer / 1024,
        "slow_fraction": config.slow_fraction,
        "slow_sleep_s": config.slow_sleep,
        "read_bytes": read_bytes,
        "paced_kib_per_s": read_bytes / config.slow_sleep / 1024,
    }


def measure_run(
    srv: Any, config: Config, pace: dict[str, Any], policy: str, k: int, rep: int
) -> tuple[list[dict[str, Any]], dict[str, Any], pd.DataFrame]:
    """N streams at once, the first k read slowly: a row per stream, one for the run, its steps."""
    slow = Pace(config.slow_sleep, int(pace["read_bytes"]), config.read_timeout)
    healthy = Pace(0.0, config.read_bytes, config.read_timeout)
    paces = [slow if i < k else healthy for i in range(config.streams)]
    step0, dropped0 = current_step(srv.url), _dropped(srv.url)
    started = time.perf_counter()
    done = run_sync(launch(srv.url, requests(config), paces, linger=config.linger))
    run_s = time.perf_counter() - started
    recs = run_sync(records(srv.url, [r.request_id for r in done.results]))
    log = fetch_steps(srv.url, since=step0)
    label = {"policy": policy, "slow_readers": k, "repetition": rep}
    rows = [
        stream_row(r, rec, done.t0, step0) | label | {"stream": i, "role": "slow" if i < k else "healthy"}
        for i, (r, rec) in enumerate(zip(done.results, recs))
    ]
    row = run_row(rows, log) | label | {"dropped": _dropped(srv.url) - dropped0, "run_s": run_s}
    return rows, row, log.assign(**label)


def _dropped(url: str) -> int:
    return int(stats(url)["hub"]["dropped"].get("slow_client", 0))


def stream_row(r: Any, rec: dict[str, Any] | None, t0: float, step0: int) -> dict[str, Any]:
    """What one client saw and what the server recorded: seconds from the launch, steps from the
    run's first step."""
    rec = rec or {}
    released, release_step = rec.get("released"), rec.get("release_step")
    return {
        "end": r.finish_reason or ("left" if r.left else "cut"),
        "tokens_received": len(r.tokens),
        "bytes_received": r.total_bytes,
        "read_kib_per_s": read_rate(r) / 1024,
        "done_s": None if r.ended is None else r.ended - t0,
        "left_engine_s": None if released is None else released - t0,
        "left_engine_step": None if release_step is None else release_step - step0,
        "engine_finish": rec.get("finish_reason"),
        "tokens_generated": rec.get("tokens_generated", 0),
        "max_queue": rec.get("max_queue", 0),
        "pauses": rec.get("pauses", 0),
        "error": r.error,
    }


def run_row(rows: list[dict[str, Any]], log: pd.DataFrame) -> dict[str, Any]:
    healthy = [r for r in rows if r["role"] == "healthy"]
    slow = [r for r in rows if r["role"] == "slow"]
    return {
        "healthy_done_s": max((r["done_s"] for r in healthy if r["done_s"] is not None), default=np.nan),
        "healthy_done_step": max((r["left_engine_step"] or 0 for r in healthy), default=np.nan),
        "healthy_kib_per_s": float(np.nanmedian([r["read_kib_per_s"] for r in healthy])),
        "healthy_cut": sum(1 for r in healthy if r["end"] != "length" or r["error"]),
        "step_ms": _mean_interval_ms(log),
        "steps": len(log),
        "slow_kib_per_s": float(np.nanmedian([r["read_kib_per_s"] for r in slow])) if slow else np.nan,
        "slow_paused": sum(1 for r in slow if r["pauses"] > 0),
        "slow_max_queue": max((r["max_queue"] for r in slow), default=0),
    }


def _mean_interval_ms(log: pd.DataFrame) -> float:
    """The run's steps, start to start, on average: under naive the step thread waits between
    steps for the slow reader, and in bursts, so a median would hide it."""
    if len(log) < 2:
        return float("nan")
    return 1000 * float(log.started.max() - log.started.min()) / (len(log) - 1)


def with_ratios(runs: pd.DataFrame) -> pd.DataFrame:
    """Each run's slow reader against its policy's write rate: the median rate its healthy
    readers were written to in the k = 0 runs of the same server."""
    writer = runs[runs.slow_readers == 0].groupby("policy").healthy_kib_per_s.median()
    return runs.assign(
        writer_kib_per_s=runs.policy.map(writer), slow_ratio=runs.slow_kib_per_s / runs.policy.map(writer)
    )


def compare_table(runs: pd.DataFrame) -> pd.DataFrame:
    """Per policy and k: healthy completion in seconds and steps, median (min–max), beside the
    policy's own k = 0; the slow reader's achieved ratio; how many runs paused or dropped it."""
    table = spread(runs, ["policy", "slow_readers"], ["healthy_done_s", "healthy_done_step", "step_ms", "slow_ratio"])
    base = table[table.slow_readers == 0].set_index("policy")
    grouped = runs.groupby(["policy", "slow_readers"], sort=True)
    acted = grouped.agg(
        paused_runs=("slow_paused", lambda s: int((s > 0).sum())),
        dropped_runs=("dropped", lambda s: int((s > 0).sum())),
    )
    table = table.merge(acted.reset_index(), on=["policy", "slow_readers"])
    order = {p: i for i, p in enumerate(POLICIES)}
    table = table.assign(
        done_vs_k0=table.healthy_done_s_median / table.policy.map(base.healthy_done_s_median),
        steps_vs_k0=table.healthy_done_step_median - table.policy.map(base.healthy_done_step_median),
    )
    return table.sort_values(["policy", "slow_readers"], key=lambda c: c.map(order) if c.name == "policy" else c)


def _check(srv: Any, policy: str, streams: list[dict[str, Any]]) -> dict[str, Any]:
    mine = [r for r in streams if r["policy"] == policy]
    return {
        "policy": policy,
        "part": "slow readers",
        "streams": len(mine),
        "unended": sum(1 for r in mine if r["end"] == "cut"),
        **server_checks(srv.url),
    }


# --------------------------------------------------------------------------- reading the tables


def _one(compare: pd.DataFrame, policy: str, k: int) -> pd.Series | None:
    rows = compare[(compare.policy == policy) & (compare.slow_readers == k)]
    return rows.iloc[0] if len(rows) else None


def verdicts(tables: dict[str, pd.DataFrame]) -> list[Verdict]:
    """The hypotheses of notebook 05, each judged against the criterion stated before measuring."""
    runs, compare = tables["runs"], tables["compare"]
    k1 = int(runs.slow_readers[runs.slow_readers > 0].min())
    out = []
    base, slow = _one(compare, "naive", 0), _one(compare, "naive", k1)
    if base is not None and slow is not None:
        ratio = slow.healthy_done_s_median / base.healthy_done_s_median
        apart = slow.healthy_done_s_min > base.healthy_done_s_max
        out.append(
            Verdict(
                "naive_delays_healthy",
                "Under naive, one slow reader delays the healthy streams.",
                f"healthy median completion at k={k1} under {DELAY_LIMIT}x its k=0 median, or the two ranges overlap",
                bool(ratio >= DELAY_LIMIT and apart),
                f"k=0 {_span(runs, 'naive', 0)}, k={k1} {_span(runs, 'naive', k1)} ({ratio:.2f}x)",
            )
        )
    rows = {p: _one(compare, p, k1) for p in compare.policy.unique() if p != "naive"}
    ratios = {p: float(r.done_vs_k0) for p, r in rows.items() if r is not None}
    if ratios:
        out.append(
            Verdict(
                "queues_isolate_healthy",
                "With a queue per stream (unbounded, pause, drop, pause_then_drop) a slow reader does not delay the healthy streams.",
                f"for any of them, healthy median completion at k={k1} above {ISOLATION_LIMIT}x its own k=0 median",
                all(r <= ISOLATION_LIMIT for r in ratios.values()),
                ", ".join(f"{p} {r:.2f}x" for p, r in ratios.items()),
            )
        )
    deltas = compare[compare.slow_readers > 0].steps_vs_k0.abs()
    out.append(
        Verdict(
            "same_steps",
            "Whatever the policy, a slow reader costs the healthy streams seconds, never steps: they finish after as many engine steps as with nobody slow.",
            "for any policy, the healthy streams' median finishing step at k>0 more than 2 steps from k=0",
            bool((deltas <= 2).all()),
            ", ".join(f"{r.policy} {r.steps_vs_k0:+.0f}" for r in compare[compare.slow_readers > 0].itertuples()),
        )
    )
    acts = (("pause", "paused_runs"), ("drop", "dropped_runs"), ("pause_then_drop", "dropped_runs"))
    fired: dict[str, tuple[int, int]] = {}
    for policy, col in acts:
        row = _one(compare, policy, k1)
        if row is not None:
            fired[policy] = (int(row[col]), int(row.n))
    if fired:
        out.append(
            Verdict(
                "policies_act",
                f"At k={k1} the policies act as designed: pause pauses the slow stream, drop and pause_then_drop drop it, in every run.",
                "any such run in which the policy did not act",
                all(a == n for a, n in fired.values()),
                ", ".join(f"{p} acted in {a} of {n}" for p, (a, n) in fired.items()),
            )
        )
    ratio = runs.slow_ratio.dropna()
    out.append(
        Verdict(
            "slow_is_slow",
            f"The slow reader reads at most {MAX_RATIO} of what the same server writes to a reader that keeps up.",
            f"any run whose slow reader's achieved ratio is above {MAX_RATIO}",
            bool(len(ratio) and (ratio <= MAX_RATIO).all()),
            f"achieved ratio {span(ratio)} over {len(ratio)} runs",
        )
    )
    return out


def _span(runs: pd.DataFrame, policy: str, k: int) -> str:
    return span(runs[(runs.policy == policy) & (runs.slow_readers == k)].healthy_done_s, "{:.1f}", " s")


CHECKED = ("naive_delays_healthy", "same_steps", "policies_act", "slow_is_slow")
"""The verdicts that hold under both profiles (nbval checks them in notebook 05)."""


def checked(tables: dict[str, pd.DataFrame]) -> list[Verdict]:
    return [v for v in verdicts(tables) if v.name in CHECKED]


def summary(tables: dict[str, pd.DataFrame]) -> dict[str, Any]:
    compare = tables["compare"]
    by = lambda col: {f"{r.policy} k={r.slow_readers}": round(float(getattr(r, col)), 3) for r in compare.itertuples()}  # noqa: E731
    return {
        "healthy_done_s_median": by("healthy_done_s_median"),
        "healthy_done_step_median": by("healthy_done_step_median"),
        "done_vs_k0": by("done_vs_k0"),
        "slow_ratio_max": float(tables["runs"].slow_ratio.max()),
        "verdicts": {v.name: v.holds for v in verdicts(tables)},
    }


def findings(tables: dict[str, pd.DataFrame]) -> str:
    """Plain sentences from this run's numbers (printed, never typed, under the tables)."""
    runs, pace = tables["runs"], tables["pace"].iloc[0]
    k1 = int(runs.slow_readers[runs.slow_readers > 0].min())
    said = [
        f"A reader that keeps up was written to at {pace.writer_kib_per_s:.0f} KiB/s in the warm-up run; the slow reader "
        f"took {int(pace.read_bytes)} bytes per read and slept {pace.slow_sleep_s:g} s, and achieved "
        f"{span(runs.slow_ratio.dropna())} of its policy's k=0 write rate."
    ]
    for policy in runs.policy.unique():
        said.append(
            f"{policy}: healthy streams done after {_span(runs, policy, 0)} with nobody slow, "
            f"{_span(runs, policy, k1)} with {k1} slow."
        )
    return " ".join(said)


def beside_chapter(tables: dict[str, pd.DataFrame]) -> pd.DataFrame:
    streams, runs = tables["streams"], tables["runs"]
    k1 = int(runs.slow_readers[runs.slow_readers > 0].min())

    def slow(policy: str, col: str) -> pd.Series:
        return streams[(streams.policy == policy) & (streams.role == "slow")][col]

    return beside(
        [
            (
                f"naive: last healthy stream done, {k1} slow (none slow); chapter: {figure('slowclient', 'naive_slow_of')}",
                figure("slowclient", "naive_done_s"),
                f"{_span(runs, 'naive', k1)} ({_span(runs, 'naive', 0)})",
                "s",
            ),
            (
                "slow reader's pace, share of the write rate",
                figure("slowclient", "slow_pace"),
                span(runs.slow_ratio.dropna()),
                "ratio",
            ),
            (
                "unbounded: slow sequence left the engine",
                figure("slowclient", "unbounded_left_engine_s"),
                span(slow("unbounded", "left_engine_s")),
                "s",
            ),
            (
                "drop: slot given back after",
                figure("slowclient", "drop_left_engine_s"),
                span(slow("drop", "left_engine_s")),
                "s",
            ),
            ("pause_then_drop: slot given back after", NO_FIGURE, span(slow("pause_then_drop", "left_engine_s")), "s"),
        ]
    )


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
    if "saturation" in tables and len(tables["saturation"]):  # runs before the full batch moved to notebook 07
        failed = int(tables["saturation"].fast_errors.sum())
        lines.append("under a full batch no fast reader failed: " + ("yes" if failed == 0 else f"NOT ({failed} did)"))
    return "\n".join(lines)


# --------------------------------------------------------------------------- the figure


def plot(tables: dict[str, pd.DataFrame]) -> list:
    return [plot_policies(tables["runs"])]


def plot_policies(runs: pd.DataFrame):
    """Left: every run's healthy completion over its policy's k=0 median (all points, k=0 beside
    k>0). Right: every slow reader's achieved share of its policy's write rate."""
    from labkit.plots import new_figure

    fig, (left, right) = new_figure("slowclient_policies", ncols=2, width=11.0)
    policies = [p for p in POLICIES if p in set(runs.policy)]
    base = runs[runs.slow_readers == 0].groupby("policy").healthy_done_s.median()
    for x, policy in enumerate(policies):
        for k, group in runs[runs.policy == policy].groupby("slow_readers"):
            dx = -0.15 if k == 0 else 0.15
            y = group.healthy_done_s / base[policy]
            left.scatter(
                [x + dx] * len(y),
                y,
                color="gray" if k == 0 else "C3",
                s=22,
                zorder=3,
                label=f"k={k}" if x == 0 else None,
            )
            left.hlines(y.median(), x + dx - 0.1, x + dx + 0.1, color="black", lw=1.5)
        slow = runs[(runs.policy == policy) & (runs.slow_readers > 0)].slow_ratio
        right.scatter([x] * len(slow), slow, color="C0", s=22, zorder=3)
    left.axhline(1.0, color="gray", lw=0.8)
    left.axhline(ISOLATION_LIMIT, color="gray", ls="--", lw=0.8, label=f"{ISOLATION_LIMIT}x (isolation limit)")
    left.set(ylabel="healthy streams done, ÷ own k=0 median", title="What the healthy streams pay (every run)")
    right.axhline(MAX_RATIO, color="C3", ls="--", lw=0.8, label=f"{MAX_RATIO} (most a slow reader may take)")
    right.set(ylabel="slow reader's bytes/s ÷ server's write rate", title="How slow the slow reader was", ylim=(0, 1))
    for ax in (left, right):
        ax.set_xticks(range(len(policies)), policies, rotation=20)
        ax.legend(fontsize=8)
    return fig
