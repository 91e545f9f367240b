"""Notebook 05, slow clients: who pays when a reader cannot keep up?

:data:`POLICIES` runs ``streams`` streams of ``tokens`` tokens at once; the first k readers
(``slow_counts``) read slowly, the rest at once. Against labkit every token event carries an SSE
comment of ``pad_bytes`` (a lab device: ordinary events fit the buffers between server and
client, notebook 04) and every hub policy has its own server, its ``sndbuf`` capped so Linux's
autotuning does not hide the backlog; any other target is measured as it is, one condition: its
own policy. Conditions run policy by policy, k = 0 first, repetition after repetition, so each
policy is compared with its own k = 0 runs.

"Slow" is relative to the target: a slow reader takes ``slow_fraction`` of the rate its
policy's k = 0 run just before was written at (one read of the bytes that allows, then
``slow_pace_s``). It reads until its stream's end or its ``error`` event, never leaving early
(``slow_timeout_s`` bounds it); what it read per read and its rate are measured, not assumed.
The stall timeout is ``stall_steps`` of a warm-up's step interval, so a policy drops at the same
point of a stream on a faster or slower engine.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from labkit.experiments import published
from labkit.hub import POLICIES as HUB_POLICIES
from labkit.lab import Experiment, ReadOptions, Sizes, Stream, Target, Trial, interval, judge, span, spread, tell
from labkit.lab.client import percentile as pct
from labkit.lab.verdict import worst
from labkit.prompts import cycle as prompts

OWN = "the server's own"
MAX_RATIO = 0.5  # a slow reader reads at most this share of what its server writes
DELAYS, ISOLATES = 1.5, 1.25  # healthy completion at k > 0 over k = 0: naive at least, queues at most


def settings(s: Sizes, policy: str, stall_s: float | None = None) -> dict[str, Any]:
    out = {"policy": policy, "pad_bytes": s.pad_bytes, "high_water": s.high_water, "max_batch": s.streams,
           "sndbuf": s.sndbuf, "kv_cache_mb": 64}  # fmt: skip
    return out if stall_s is None else {**out, "stall_timeout": round(stall_s, 4)}


def conditions(s: Sizes, target: Target) -> list[dict[str, Any]]:
    if max(s.slow_counts) >= s.streams or 0 not in s.slow_counts or not 0 < s.slow_fraction <= MAX_RATIO:
        raise ValueError(f"slowclient: need 0 in slow_counts < streams and 0 < slow_fraction <= {MAX_RATIO}: {s}")
    if set(s.policies) - set(HUB_POLICIES):
        raise ValueError(f"slowclient: policies must come from {HUB_POLICIES}, got {s.policies}")
    policies = s.policies if target.caps.settings else (OWN,)
    return [{"policy": p, "slow": k} for p in policies for k in sorted(s.slow_counts)]


def prepare(target: Target, s: Sizes) -> dict[str, Any]:
    """A warm-up with nobody slow (its write rate paces a slow reader until a k = 0 run has been
    measured), its step interval, and each policy's server, the stall timeout in those steps."""
    probe = target.variant(**settings(s, "unbounded")) if target.caps.settings else target
    launch(probe, s, 0, ReadOptions())  # a server's first run is slower than the rest
    since = probe.current_step() if probe.caps.lab else None
    rate = float(np.nanmedian([written_rate(x) for x in launch(probe, s, 0, ReadOptions()).streams]))
    step_s = float(np.median(np.diff(probe.steps(since).started))) if since is not None else np.nan
    stall = s.stall_steps * step_s if np.isfinite(step_s) else None
    servers = {OWN: target}
    for p in s.policies if target.caps.settings else ():  # naive and unbounded: no stall timer, as the warm-up's
        servers[p] = target.variant(**settings(s, p, None if p in ("naive", "unbounded") else stall))
    return {"servers": servers, "rate": {}, "writer_Bps": rate, "step_ms": 1e3 * step_s, "stall_timeout_s": stall}


def launch(target: Target, s: Sizes, k: int, slow: ReadOptions) -> Any:
    """The same ``streams`` requests; the first ``k`` read as ``slow`` says (on raw sockets)."""
    opts = [slow] * k + [ReadOptions(timeout=slow.timeout)] * (s.streams - k)
    return target.launch([target.request(p, s.tokens) for p in prompts(s.streams)], opts)


def written_rate(x: Stream) -> float:
    """Bytes per second a reader took off its socket, from the response head to its end."""
    end = x.ended or x.left_at
    return x.total_bytes / (end - x.headers_at) if x.headers_at and end and end > x.headers_at else np.nan


def measure(trial: Trial) -> dict[str, Any]:
    s, state, k = trial.sizes, trial.state, trial.slow
    target, writer = state["servers"][trial.policy], state["rate"].get(trial.policy, state["writer_Bps"])
    asked = max(1, int(s.slow_fraction * writer * s.slow_pace_s))
    slow = ReadOptions(pace=s.slow_pace_s, read_bytes=asked, rcvbuf=s.slow_rcvbuf, timeout=s.slow_timeout_s)
    since = target.current_step() if target.caps.lab else None
    streams = launch(target, s, k, slow).streams
    t0, healthy = min(x.sent for x in streams), streams[k:]
    gaps = [g for x in healthy for g in x.gaps]
    # writer_Bps and asked_read_bytes: what paced this run's slow readers (none at k = 0)
    row = {"healthy_done_s": max((x.ended or np.nan) - t0 for x in healthy), "healthy_gap_p50_ms": 1e3 * pct(gaps, 50),
           "healthy_gap_p99_ms": 1e3 * pct(gaps, 99), "healthy_Bps": np.nanmedian([written_rate(x) for x in healthy]),
           "healthy_not_whole": sum(not (x.ok and x.tokens == s.tokens) for x in healthy),
           "writer_Bps": writer if k else np.nan, "asked_read_bytes": asked if k else np.nan}  # fmt: skip
    if k == 0:
        state["rate"][trial.policy] = row["healthy_Bps"]
    records, log = [None] * len(streams), None
    if since is not None:
        records, log = target.released([x.request_id for x in streams], timeout=s.slow_timeout_s), target.steps(since)
        row["healthy_steps"] = max(steps_taken(r, log) for r in records[k:])
    trial.keep("slow", [slow_row(x, r, t0, log, writer) for x, r in zip(streams[:k], records)])
    return row


def slow_row(x: Stream, record: dict[str, Any] | None, t0: float, log: pd.DataFrame | None, writer: float) -> dict:
    """What a slow reader read (``ratio``: its rate over the write rate that paced it), and what
    the server's record says its request held: time and steps paused, the slot, the queue."""
    error_at = next((e.time - t0 for e in x.events if e.event == "error" or "error" in e.data), np.nan)
    row = {"tokens_read": x.tokens, "end": x.finish_reason or ("timeout" if x.error else "cut"),
           "done_s": (x.ended or np.nan) - t0, "read_bytes_per_read": x.total_bytes / max(1, x.reads),
           "read_Bps": written_rate(x), "ratio": written_rate(x) / writer, "error_event_s": error_at}  # fmt: skip
    if record is None or log is None:
        return row
    released = record["released"] or np.nan
    times = [record["submitted"], *record["moved"], record["released"] or np.inf]
    paused = [(a, b) for state, a, b in zip(record["states"], times, times[1:]) if state == "paused"]
    started = log.started.to_numpy()
    return {**row, "server_end": record["end"], "tokens_generated": record["tokens_generated"],
            "max_queue": record["max_queue"], "pauses": record["pauses"], "paused_s": sum(b - a for a, b in paused),
            "longest_pause_s": max((b - a for a, b in paused), default=0.0), "released_s": released - t0,
            "paused_steps": sum(int(((started > a) & (started <= b)).sum()) for a, b in paused),
            "slot_held_s": released - record["submitted"]}  # fmt: skip


def steps_taken(record: dict[str, Any] | None, log: pd.DataFrame) -> float:
    """Engine steps from the step that made a stream's first token to the one that released it."""
    if not record or record["first_token_sampled"] is None or record["release_step"] is None:
        return np.nan
    return float(record["release_step"] - log.step[log.started <= record["first_token_sampled"]].max())


def tables(t: dict[str, pd.DataFrame], s: Sizes) -> dict[str, pd.DataFrame]:
    """Per policy and k: the healthy streams (``done_vs_k0``: over the same repetition's k = 0);
    the slow readers: per read, rate, error event, release, time and steps paused, queue."""
    rows = t["rows"].copy()
    base = rows[rows.slow == 0].set_index(["policy", "repetition"]).healthy_done_s
    rows["done_vs_k0"] = rows.healthy_done_s / [base.get(key, np.nan) for key in zip(rows.policy, rows.repetition)]
    cols = ["healthy_done_s", "done_vs_k0", "healthy_steps", "healthy_gap_p99_ms", "healthy_gap_p50_ms"]
    out = {"rows": rows, "compare": spread(rows, ["policy", "slow"], [c for c in cols if c in rows])}
    if len(t.get("slow", ())):
        cols = ["read_bytes_per_read", "read_Bps", "ratio", "tokens_read", "error_event_s", "released_s",
                "slot_held_s", "paused_s", "paused_steps", "longest_pause_s", "max_queue"]  # fmt: skip
        out["slow_readers"] = spread(t["slow"], ["policy", "slow"], [c for c in cols if c in t["slow"]])
    return out


def verdicts(t: dict[str, pd.DataFrame], s: Sizes) -> list:
    rows, slow = t["rows"], t.get("slow", pd.DataFrame())
    cut, n = int(rows.healthy_not_whole.sum()), len(rows) * s.streams - int(rows.slow.sum())
    out = [judge("healthy streams whole", "every healthy stream under every policy ends with its own end, whole",
                 "any healthy stream failed or came short", cut == 0, f"{cut} of {n} not whole",
                 checked=True)]  # fmt: skip
    told = {p: tell(interval(rows[(rows.policy == p) & (rows.slow > 0)].done_vs_k0.to_numpy()),
                    DELAYS if p == "naive" else ISOLATES, "above" if p == "naive" else "below")
            for p in rows.policy.unique()}  # fmt: skip
    if "naive" in told:
        out.append(judge("naive delays the healthy", "under naive, slow readers delay the healthy streams", "the 95% "
                         f"interval of healthy completion (k > 0 over the same repetition's k = 0) lies below {DELAYS}",
                         told["naive"][0], f"ratio {told.pop('naive')[1]}"))  # fmt: skip
    if told:
        out.append(judge("queues isolate the healthy", "with a queue per stream slow readers do not delay the healthy "
                         "streams", f"for any other policy, the 95% interval of that ratio lies above {ISOLATES}",
                         worst(d for d, _ in told.values()),
                         "; ".join(f"{p}: {text}" for p, (_, text) in told.items())))  # fmt: skip
    if "healthy_steps" in rows:
        by = rows.groupby(["policy", "slow"]).healthy_steps.max().unstack()
        moved = by.sub(by[0], axis=0).abs().max(axis=1)
        out.append(judge("same steps", "a slow reader costs the healthy streams seconds, never engine steps", "for any "
                         "policy and k, a healthy stream's steps from first token to release differ from k = 0's by "
                         "more than 2", False if (moved > 2).any() else None if moved.isna().any() or moved.empty
                         else True, ", ".join(f"{p} {m:+.0f}" for p, m in moved.items()),
                         checked=True))  # fmt: skip
    if len(slow) and "server_end" in slow and set(rows.policy) & set(HUB_POLICIES):  # not a server's own policy
        known = slow[slow.server_end.notna()]  # a reader whose record never came says nothing of its policy
        gone = known.server_end == "slow_client"
        act = {"naive": known.max_queue <= 2, "unbounded": known.max_queue >= s.high_water, "pause": known.pauses > 0,
               "drop": gone, "pause_then_drop": gone}  # fmt: skip
        fired = {p: (int(act[p][known.policy == p].sum()), int((known.policy == p).sum())) for p in act}
        fired = {p: counts for p, counts in fired.items() if counts[1]}  # a target's own policy is none of these
        told_n, dropped = int((gone & (known.end == "slow_client")).sum()), int(gone.sum())
        out += [judge("policies act", "naive holds at most two of a slow stream's events, unbounded queues it past the mark, pause "
                      "pauses it, drop and pause_then_drop drop it, in every run", "any run where its policy did not",
                      all(a == n for a, n in fired.values()) if fired else None,
                      ", ".join(f"{p} {a} of {n}" for p, (a, n) in fired.items()) or "no policy set", checked=True),
                judge("the dropped reader is told", "a dropped slow reader, reading on, gets the slow_client error "
                      "event after its backlog", "any dropped reader ends without it",
                      told_n == dropped if dropped else None, f"{told_n} of {dropped}", checked=True)]  # fmt: skip
    if len(slow):
        ratio = slow.ratio.dropna()
        out.append(judge("slow is slow", f"a slow reader reads at most {MAX_RATIO} of what its server writes",
                         f"any slow reader above {MAX_RATIO}", None if ratio.empty else bool((ratio <= MAX_RATIO).all()),
                         f"achieved {span(ratio)} over {len(ratio)} readers", checked=True))  # fmt: skip
    return out


def plots(t: dict[str, pd.DataFrame], s: Sizes) -> list:
    from labkit.plots import new_figure

    rows, slow = t["rows"], t.get("slow", pd.DataFrame(columns=["policy", "ratio"]))
    fig, (left, right) = new_figure("slowclient_policies", ncols=2, width=11.0)
    policies = list(dict.fromkeys(rows.policy))
    for j, (k, g) in enumerate(rows.groupby("slow")):
        left.scatter(g.policy.map(policies.index) + 0.1 * (j - 1.5), g.done_vs_k0, s=16, label=f"k = {k}")
    right.scatter(slow.policy.map(policies.index), slow.ratio, s=16)
    left.axhline(ISOLATES, color="gray", ls="--", lw=0.8, label=f"queues' bar: {ISOLATES:g}")
    left.axhline(DELAYS, color="C3", ls=":", lw=0.8, label=f"naive's bar: {DELAYS:g}")
    right.axhline(MAX_RATIO, color="C3", ls="--", lw=0.8, label=f"the most a slow reader may read: {MAX_RATIO:g}")
    left.set(ylabel="healthy streams done ÷ the same repetition's k = 0", title="What the healthy pay", yscale="log")
    right.set(ylabel="slow reader's bytes/s ÷ the write rate pacing it", title="How slow the slow were", ylim=(0, 1))
    for ax in (left, right):
        ax.set_xticks(range(len(policies)), policies, rotation=20)
    left.legend(fontsize="small")
    right.legend(fontsize="small")
    return [fig]


POLICIES = Experiment(
    name="slowclient.policies",
    title="Slow readers among healthy ones under each policy, each against its own k = 0 runs",
    sizes={
        "full": {"policies": HUB_POLICIES, "streams": 8, "slow_counts": (0, 1, 2, 4), "tokens": 32, "pad_bytes": 65536,
                 "sndbuf": 16384, "high_water": 8, "stall_steps": 6, "slow_fraction": 0.33, "slow_pace_s": 0.05,
                 "slow_rcvbuf": 65536, "slow_timeout_s": 300.0, "repetitions": 2},
        "ci": {"policies": HUB_POLICIES, "streams": 4, "slow_counts": (0, 1), "tokens": 96, "pad_bytes": 4096,
               "sndbuf": 4096, "high_water": 8, "stall_steps": 8, "slow_fraction": 0.25, "slow_pace_s": 0.02,
               "slow_rcvbuf": 4096, "slow_timeout_s": 120.0, "repetitions": 2},
    },
    conditions=conditions,
    prepare=prepare,
    measure=measure,
    tables=tables,
    verdicts=verdicts,
    plots=plots,
    chapter={"stall_steps": ("0.25 s", "counted in steps of the measured step interval, so the drop falls at the "
                             "same point of a stream on any engine"),
             "slow_fraction": (published("slowclient")["slow_pace"], "a share of the server's measured write rate"),
             "tokens": (64, "every slow reader reads its stream to the end at a third of the write rate: 64 tokens "
                        "would take the runs past the notebook's time"),
             "repetitions": (1, "two, interleaved: with k = 1, 2 and 4 pooled, six paired ratios per policy, the "
                             "fewest that give a 95% interval")},
)  # fmt: skip

SPECS = (POLICIES,)
