"""Notebook 07, ``extensions``: the chapter's reader exercises, measured on the lab's service.

* ``delivery``: each first token delivered when its own prefill ends, against at the end of the
  step (N streams arriving together), repetitions interleaved between the two servers.
* ``saturation``: a full batch (limit 4) with two slow readers holding slots while fast requests
  wait; ``pause`` against ``pause_then_drop`` at several stall timeouts, repetitions interleaved.
* ``resume``: a resumable stream whose client leaves by RST after N tokens and comes back with
  ``Last-Event-ID`` after a pause: exactly the missed events, in order, and the same text as an
  uninterrupted answer; and a client that comes back after the grace period (404).
* ``eager``: slow readers under ``unbounded``; the hub's peak queue (``GET /stats``, sampled) is
  then formatted eagerly for real, with the service's own encoder and padding, and the memory
  that takes is measured with ``tracemalloc``, beside the same events held as the hub holds them.
* ``identity``: sampled streams with per-request seeds against their solo runs, a repeat, and the
  greedy streams (which they must differ from); greedy streams in bfloat16 against their solo
  runs and float32; by first divergence and the float32 model's logit margin there.
"""

from __future__ import annotations

import asyncio
import time
import tracemalloc
from contextlib import ExitStack
from dataclasses import dataclass, replace
from typing import Any

import httpx
import numpy as np
import pandas as pd

from labkit.engine.events import TokenEvent
from labkit.experiments import slowclient
from labkit.experiments.chapter import beside
from labkit.experiments.chapter_figures import NO_FIGURE, figure
from labkit.experiments.client import async_client, launch_streams, run_sync
from labkit.experiments.identity import MUST_MATCH, VS_GREEDY, generate, identity_table, measure_identity
from labkit.experiments.profiles import Profile
from labkit.experiments.progress import Progress, doing, tick
from labkit.experiments.rawhttp import raw_stream
from labkit.experiments.readings import Verdict, current_step, fetch_steps, interleaved, span, spread
from labkit.experiments.records import EventSplitter, ReadOptions
from labkit.experiments.saturation import measure_saturation
from labkit.experiments.servers import loaded_model, server_like, serving
from labkit.experiments.slowreaders import Pace, launch, records, released
from labkit.experiments.workload import long_prompts, stream_body
from labkit.prompts import PROMPTS

NAME = "extensions"
EAGER_FACTOR = 10  # an eager server holds at least this many times what the lazy hub holds
SAMPLED_DIFFER = 0.5  # at least this share of sampled streams differ from the greedy ones


@dataclass(frozen=True)
class Config:
    model: str = "smollm2-135m"
    slow: slowclient.Config = slowclient.Config()  # events, buffers and readers for saturation and eager
    delivery_streams: int = 16
    delivery_tokens: int = 8
    delivery_repetitions: int = 3
    stall_timeouts: tuple[float, ...] = (0.25, 1.0)
    saturation_repetitions: int = 3
    resume_tokens: int = 24
    resume_leave_after: tuple[int, ...] = (4, 12)
    resume_waits: tuple[float, ...] = (0.2, 1.0)
    resume_grace: float = 2.0
    eager_readers: int = 4
    identity_streams: int = 6
    identity_tokens: int = 24
    bf16_streams: int = 4  # bfloat16 is several times slower than float32 on this CPU
    bf16_tokens: int = 16
    temperature: float = 0.8
    top_p: float = 0.95
    seed: int = 1000

    @classmethod
    def for_profile(cls, profile: Profile) -> Config:
        slow = slowclient.Config.for_profile(profile)
        if profile.full:
            return cls(model=profile.model, slow=slow)
        return cls(
            model=profile.model,
            slow=replace(slow, high_water=8, stall_timeout=0.25),  # notebook 05's ci mark, not measured here
            delivery_streams=4,
            stall_timeouts=(0.25,),
            resume_tokens=16,
            resume_leave_after=(4,),
            resume_waits=(0.2,),
            resume_grace=1.0,
            eager_readers=2,
            identity_streams=3,
            identity_tokens=12,
            bf16_streams=3,
            bf16_tokens=12,
        )

    def __post_init__(self) -> None:
        if max(self.resume_leave_after) >= self.resume_tokens or max(self.resume_waits) >= self.resume_grace:
            raise ValueError(
                f"extensions.Config: leave before resume_tokens and come back within resume_grace, "
                f"got {self.resume_leave_after!r}, {self.resume_waits!r}, {self.resume_grace!r}"
            )
        if not 1 <= self.identity_streams <= len(PROMPTS) or self.delivery_streams > len(PROMPTS):
            raise ValueError(f"extensions.Config: identity_streams and delivery_streams must be in [1, {len(PROMPTS)}]")
        if not 1 <= self.bf16_streams <= self.identity_streams:
            raise ValueError(
                f"extensions.Config.bf16_streams must be in [1, identity_streams], got {self.bf16_streams!r}"
            )
        if self.delivery_repetitions < 1 or self.saturation_repetitions < 1:
            raise ValueError("extensions.Config: repetitions must be >= 1")


def server_options(config: Config) -> dict[str, Any]:
    return {
        "model": config.model,
        "max_batch": max(config.delivery_streams, config.identity_streams),
        "first_token": "prefill",
        "resume_grace": config.resume_grace,
        "policy": "unbounded",
    }


def _settings(config: Config) -> dict[str, Any]:
    return {k: v for k, v in server_options(config).items() if k != "model"}


def saturation_runs(config: Config) -> list[tuple[str, float]]:
    """(policy, stall timeout): ``pause`` once, ``pause_then_drop`` at each stall timeout."""
    return [("pause", config.slow.stall_timeout)] + [("pause_then_drop", t) for t in config.stall_timeouts]


def units(config: Config) -> int:
    saturation = config.saturation_repetitions * len(saturation_runs(config))
    return 2 * config.delivery_repetitions + saturation + 1 + 2 + 1


def run(config: Config, *, server: Any = None, progress: Progress | None = None) -> dict[str, pd.DataFrame]:
    model = loaded_model(server, config.model)
    with server_like(server, model, **_settings(config)) as srv:
        first_step = current_step(srv.url)
        run_sync(generate(srv.url, [stream_body(0, 2)], together=False))  # warm-up: the first request is slower
        delivery = measure_delivery(srv, config, progress)
        doing(progress, "resuming with Last-Event-ID")
        resume = run_sync(measure_resume(srv, config))
        tick(progress)
        identity = measure_identity(
            srv,
            streams=config.identity_streams,
            tokens=config.identity_tokens,
            bf16_streams=config.bf16_streams,
            bf16_tokens=config.bf16_tokens,
            temperature=config.temperature,
            top_p=config.top_p,
            seed=config.seed,
            progress=progress,
        )
        steps = fetch_steps(srv.url, since=first_step)  # this server's steps (delivery, resume, identity)
    doing(progress, "eager formatting")
    eager, eager_line, read_bytes = measure_eager(model, config)
    tick(progress)
    saturation, timeline = measure_full_batch(model, config, read_bytes, progress)
    return {
        "delivery": delivery_table(delivery),
        "delivery_streams": delivery,
        "saturation": saturation,
        "saturation_summary": saturation_table(saturation),
        "saturation_timeline": timeline,
        "resume": resume,
        "eager": eager,
        "eager_timeline": eager_line,
        "identity": identity,
        "identity_summary": identity_table(identity),
        "steps": steps,
    }


# --------------------------------------------------------------------------- first-token delivery


def measure_delivery(srv: Any, config: Config, progress: Progress | None) -> pd.DataFrame:
    """N streams at once under each delivery mode, one server per mode (both on the shared
    model, both up at once), the modes taking turns: prefill, step end, prefill, …"""
    requests = [stream_body(i, config.delivery_tokens) for i in range(config.delivery_streams)]
    rows: list[dict[str, Any]] = []
    with ExitStack() as stack:
        servers = {
            mode: stack.enter_context(
                serving(srv if srv.config.hub.first_token == mode else None, **_delivery_options(srv, config, mode))
            )
            for mode in ("prefill", "step_end")
        }
        for rep, mode in interleaved(list(servers), config.delivery_repetitions):
            doing(progress, f"first token at {mode}, repetition {rep + 1}/{config.delivery_repetitions}")
            done = run_sync(launch_streams(servers[mode].url, requests))
            rows += [
                {"mode": mode, "repetition": rep, "stream": i, "ttft_s": r.ttft, "error": r.error}
                for i, r in enumerate(done.results)
            ]
            tick(progress, delivery=rows)
    return pd.DataFrame(rows)


def _delivery_options(srv: Any, config: Config, mode: str) -> dict[str, Any]:
    return {"model": srv.engine.model, "max_batch": config.delivery_streams, "first_token": mode}


def delivery_table(delivery: pd.DataFrame) -> pd.DataFrame:
    """Per mode: the median first-token time of each repetition, and their median (min–max)."""
    per_rep = delivery.groupby(["mode", "repetition"]).ttft_s.agg(ttft_p50_s="median", ttft_max_s="max").reset_index()
    return spread(per_rep, "mode", ["ttft_p50_s", "ttft_max_s"])


# --------------------------------------------------------------------------- a full batch


def measure_full_batch(
    model: Any, config: Config, read_bytes: int, progress: Progress | None
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """``pause`` and ``pause_then_drop`` at each stall timeout on a batch of 4 with 2 slow readers
    (paced as in the eager run), every server up at once, repetitions interleaved."""
    slow = config.slow
    rows, lines = [], []
    with ExitStack() as stack:
        servers = {
            run: stack.enter_context(
                server_like(
                    None,
                    model,
                    **slowclient.server_settings(
                        replace(slow, stall_timeout=run[1]), run[0], max_batch=slow.saturation_batch
                    ),
                )
            )
            for run in saturation_runs(config)
        }
        for rep, (policy, stall) in interleaved(list(servers), config.saturation_repetitions):
            label = "pause" if policy == "pause" else f"pause_then_drop {stall:g} s"
            doing(progress, f"{label} under a full batch, repetition {rep + 1}/{config.saturation_repetitions}")
            row, line = measure_saturation(
                servers[(policy, stall)], slowclient.saturation_config(slow, read_bytes), label
            )
            rows.append({**row, "repetition": rep, "stall_timeout_s": stall if policy != "pause" else np.inf})
            lines.append(line.assign(repetition=rep))
            tick(progress, saturation=rows)
    return pd.DataFrame(rows), pd.concat(lines, ignore_index=True)


def saturation_table(saturation: pd.DataFrame) -> pd.DataFrame:
    """Per policy and stall timeout, over the repetitions: median, min and max."""
    return spread(
        saturation,
        "policy",
        ["fast_done_s", "fast_ttft_p50_s", "paused_slot_s_while_waiting", "slow_left_engine_s", "slow_dropped"],
    )


# --------------------------------------------------------------------------- resuming


async def measure_resume(srv: Any, config: Config) -> pd.DataFrame:
    """Leave by RST after N tokens, come back with Last-Event-ID after a pause; and once too late."""
    prompt = long_prompts(srv.engine.model, config.resume_tokens)[0]
    body = stream_body(prompt, config.resume_tokens)
    async with async_client(srv.url) as client:
        reference = (await client.post("/v1/generate", json=body)).json()
        trials = [(n, w) for n in config.resume_leave_after for w in config.resume_waits]
        trials.append((config.resume_leave_after[0], config.resume_grace + 1.0))
        rows = [await resume_trial(srv, client, body, n, w, reference) for n, w in trials]
    return pd.DataFrame(rows)


async def resume_trial(
    srv: Any, client: httpx.AsyncClient, body: dict[str, Any], leave_after: int, wait: float, reference: dict[str, Any]
) -> dict[str, Any]:
    leaving = ReadOptions(leave_after_tokens=leave_after, leave_by="rst", leave_after_s=120.0)
    first = await raw_stream(srv.url, {**body, "resumable": True}, leaving)
    last = int(first.last_event_id or 0)
    start = next((e.data for e in first.events if e.event == "start"), {})
    await asyncio.sleep(wait)
    sent = time.perf_counter()
    status, later = await follow(client, first.request_id or "", start.get("resume_token", ""), last)
    ids = [int(e.id) for e in later if e.id]
    tokens = [e.data["id"] for e in first.tokens] + [e.data["id"] for e in later if e.event == "token"]
    record = (await records(srv.url, [first.request_id]))[0] or {}
    return {
        "leave_after": leave_after,
        "wait_s": wait,
        "status": status,
        "last_id_before": last,
        "first_id_after": ids[0] if ids else None,
        "events_after": len(ids),
        "in_order_no_gap": ids == list(range(last + 1, last + 1 + len(ids))),
        "same_tokens_as_generate": tokens == reference["token_ids"],
        "replay_ms": 1000 * (later[0].time - sent) if later else np.nan,
        "end": later[-1].event if later else None,
        "engine_finish": record.get("finish_reason"),
    }


async def follow(client: httpx.AsyncClient, rid: str, token: str, last: int) -> tuple[int, list[Any]]:
    """GET the stream's events after ``last`` with Last-Event-ID and the resume token that only
    the stream's creator was given; the status and what came."""
    splitter, events = EventSplitter(), []
    headers = {"Last-Event-ID": str(last), "X-Resume-Token": token}
    async with client.stream("GET", f"/v1/streams/{rid}/events", headers=headers) as response:
        if response.status_code == 200:
            async for chunk in response.aiter_raw():
                events += splitter.feed(chunk, time.perf_counter())
        else:
            await response.aread()
    return response.status_code, events


# --------------------------------------------------------------------------- eager formatting


def measure_eager(model: Any, config: Config) -> tuple[pd.DataFrame, pd.DataFrame, int]:
    """Slow readers under ``unbounded`` (capped send buffer), the server's ``/stats`` sampled over
    HTTP until their sequences have all left the engine (the queue then only shrinks); then the
    peak queue formatted eagerly and measured (:func:`eager_bytes`). Also returns the slow
    reader's read size, paced against this server's write rate, for the full-batch runs."""
    slow = replace(config.slow, streams=config.eager_readers)
    with server_like(None, model, **slowclient.server_settings(slow, "unbounded")) as srv:
        pace = slowclient.calibrate(srv, slow)
        read = Pace(slow.slow_sleep, int(pace["read_bytes"]), slow.read_timeout)
        done = run_sync(_slow_until_released(srv.url, slowclient.requests(slow), read))
    samples = done.samples
    peak = int(samples.queued_events.max()) if len(samples) else 0
    tokens = [(e.data["id"], e.data["text"]) for r in done.results for e in r.tokens] or [(0, " ")]
    eager, lazy = eager_bytes(tokens, peak, slow.pad_bytes), lazy_bytes(tokens, peak)
    row = {
        "slow_readers": config.eager_readers,
        "read_bytes": read.read_bytes,
        "peak_queued_events": peak,
        "eager_measured_mib": eager / 2**20,
        "lazy_measured_mib": lazy / 2**20,
        "eager_over_lazy": eager / lazy if lazy else np.nan,
        "bound_mib": config.eager_readers * slow.max_new_tokens * (slow.pad_bytes + 100) / 2**20,
        "pad_bytes": slow.pad_bytes,
        "server_sndbuf": slow.server_sndbuf,
    }
    return pd.DataFrame([row]), samples, read.read_bytes


async def _slow_until_released(url: str, requests: list[dict[str, Any]], pace: Pace) -> Any:
    """Every reader slow; they leave once every sequence has left the engine, and a few samples
    later (the queue then only shrinks: its peak is behind us)."""
    paces = [pace] * len(requests)
    return await launch(url, requests, paces, sample_every=0.05, until=released(url), linger=0.2)


def eager_bytes(tokens: list[tuple[int, str]], count: int, pad_bytes: int) -> int:
    """Bytes ``tracemalloc`` sees at its peak while ``count`` token events are formatted up front,
    with the service's encoder and padding, and held (as an eager server would hold them)."""
    from labkit.schema import StreamEncoder
    from labkit.service.frames import encode_item, wire_bytes

    encoder = StreamEncoder()
    events = [_token(i, tokens) for i in range(count)]
    tracemalloc.start()
    try:
        held = [wire_bytes(encode_item(encoder, event), pad_bytes) for event in events]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    del held
    return peak


def lazy_bytes(tokens: list[tuple[int, str]], count: int) -> int:
    """Bytes ``tracemalloc`` sees at its peak while ``count`` token events are held as the lab's
    hub holds them (engine events, formatted and padded only as they are written)."""
    tracemalloc.start()
    try:
        held = [_token(i, tokens) for i in range(count)]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    del held
    return peak


def _token(i: int, tokens: list[tuple[int, str]]) -> TokenEvent:
    token_id, text = tokens[i % len(tokens)]
    return TokenEvent(rid=f"eager-{i // 1000}", index=i, token_id=int(token_id), text=str(text), time=0.0, step=i)


# --------------------------------------------------------------------------- reading the tables


def _sampled(identity: pd.DataFrame, comparisons: tuple[str, ...] | str) -> pd.DataFrame:
    comparisons = (comparisons,) if isinstance(comparisons, str) else comparisons
    return identity[identity.comparison.isin(comparisons)]


def verdicts(tables: dict[str, pd.DataFrame]) -> list[Verdict]:
    """The hypotheses of notebook 07, each judged against the criterion stated before measuring."""
    identity, eager = tables["identity"], tables["eager"].iloc[0]
    vs_greedy, must = _sampled(identity, VS_GREEDY), _sampled(identity, MUST_MATCH)
    sat = tables["saturation"]
    pause = sat[sat.policy == "pause"]
    quickest = sat[sat.stall_timeout_s == sat.stall_timeout_s.min()]
    delivery = tables["delivery_streams"].groupby(["mode", "repetition"]).ttft_s.median().unstack("mode")
    out = [
        Verdict(
            "sampling_takes_effect",
            "Seeded sampling is in effect: most sampled streams differ from the greedy ones.",
            f"fewer than {SAMPLED_DIFFER:.0%} of the sampled streams differ from the greedy ones",
            bool(len(vs_greedy) and (~vs_greedy.identical).mean() >= SAMPLED_DIFFER),
            f"{int((~vs_greedy.identical).sum())} of {len(vs_greedy)} streams differ from greedy",
        ),
        Verdict(
            "seeded_sampling_repeats",
            "A seeded sampled stream repeats exactly: run again, and run alone instead of beside others.",
            "any sampled stream that differs between two runs with the same seed",
            bool(len(must) and must.identical.all()),
            f"{int(must.identical.sum())} of {len(must)} pairs identical",
        ),
        Verdict(
            "eager_costs_memory",
            "Formatting events eagerly holds far more memory for slow readers than the lab's lazy hub does.",
            f"the measured eager peak under {EAGER_FACTOR}x the measured lazy one for the same queued events",
            bool(eager.peak_queued_events > 0 and eager.eager_over_lazy >= EAGER_FACTOR),
            f"{int(eager.peak_queued_events)} events queued at the peak: eager {eager.eager_measured_mib:.2f} MiB, "
            f"lazy {eager.lazy_measured_mib:.3f} MiB (measured with tracemalloc)",
        ),
        Verdict(
            "drop_frees_slots",
            "With the batch full, pause_then_drop at its shortest stall timeout holds fewer slot-seconds "
            "for paused streams while requests wait than pause does.",
            "its median paused slot-seconds while waiting not below pause's",
            bool(quickest.paused_slot_s_while_waiting.median() < pause.paused_slot_s_while_waiting.median()),
            f"pause {span(pause.paused_slot_s_while_waiting)}, "
            f"{quickest.policy.iloc[0]} {span(quickest.paused_slot_s_while_waiting)} slot-s",
        ),
        Verdict(
            "prefill_delivery_is_earlier",
            "Delivering each first token when its own prefill ends gets it to the client sooner than at the step's end.",
            "the median first-token time at prefill not below the one at step end, in the median repetition",
            bool(delivery["prefill"].median() < delivery["step_end"].median()),
            f"prefill {span(delivery['prefill'] * 1e3, '{:.0f}', ' ms')}, "
            f"step end {span(delivery['step_end'] * 1e3, '{:.0f}', ' ms')} (medians of the repetitions)",
        ),
    ]
    return out


CHECKED = ("sampling_takes_effect", "seeded_sampling_repeats", "eager_costs_memory")
"""The verdicts that hold under both profiles (nbval checks them in notebook 07)."""


def checked(tables: dict[str, pd.DataFrame]) -> list[Verdict]:
    return [v for v in verdicts(tables) if v.name in CHECKED]


def summary(tables: dict[str, pd.DataFrame]) -> dict[str, Any]:
    delivery = tables["delivery"].set_index("mode")
    sat = tables["saturation_summary"].set_index("policy")
    return {
        "ttft_p50_s_median": delivery.ttft_p50_s_median.to_dict(),
        "fast_done_s_median": sat.fast_done_s_median.to_dict(),
        "paused_slot_s_while_waiting_median": sat.paused_slot_s_while_waiting_median.to_dict(),
        "eager_measured_mib": float(tables["eager"].eager_measured_mib.iloc[0]),
        "lazy_measured_mib": float(tables["eager"].lazy_measured_mib.iloc[0]),
        "identical": tables["identity_summary"].set_index("comparison").identical.to_dict(),
        "verdicts": {v.name: v.holds for v in verdicts(tables)},
    }


def findings(tables: dict[str, pd.DataFrame]) -> str:
    """Plain sentences from this run's numbers (printed, never typed, under the tables)."""
    eager, sat = tables["eager"].iloc[0], tables["saturation"]
    said = [
        f"At the peak, {int(eager.peak_queued_events)} events waited in the slow readers' queues; formatted eagerly "
        f"they took {eager.eager_measured_mib:.2f} MiB (measured), against {eager.lazy_measured_mib:.3f} MiB as the hub "
        f"holds them."
    ]
    for label, group in sat.groupby("policy", sort=False):
        said.append(
            f"{label}: the fast requests were done after {span(group.fast_done_s, '{:.1f}', ' s')}, while paused "
            f"streams held {span(group.paused_slot_s_while_waiting, '{:.1f}')} slot-seconds as others waited."
        )
    return " ".join(said)


def beside_chapter(tables: dict[str, pd.DataFrame]) -> pd.DataFrame:
    delivery = tables["delivery"].set_index("mode")
    sat, identity = tables["saturation"], tables["identity_summary"].set_index("comparison")
    back = tables["resume"][tables["resume"].status == 200]

    def first_token(mode: str) -> str:
        return f"{1000 * delivery.loc[mode, 'ttft_p50_s_median']:.0f}" if mode in delivery.index else "n/a"

    held = ", ".join(
        f"{label}: {span(group.paused_slot_s_while_waiting, '{:.1f}')}"
        for label, group in sat.groupby("policy", sort=False)
    )

    def same(key: str) -> str:
        return (
            f"{int(identity.loc[key, 'identical'])} of {int(identity.loc[key, 'streams'])}"
            if key in identity.index
            else "n/a"
        )

    streams = tables["delivery_streams"].stream.nunique()
    return beside(
        [
            (
                "first token median, all at once, step-end delivery",
                figure("extensions", "first_token_step_end_ms"),
                f"{first_token('step_end')} ({streams} streams)",
                "ms",
            ),
            (
                "the same, delivered when each prefill ends",
                figure("extensions", "first_token_prefill"),
                first_token("prefill"),
                "ms",
            ),
            (
                "full batch: slot-seconds held by paused streams",
                figure("extensions", "paused_slot_seconds"),
                held,
                "slot-s",
            ),
            (
                "resumed streams with exactly the missed events",
                figure("extensions", "resumed"),
                f"{int((back.in_order_no_gap & back.same_tokens_as_generate).sum())} of {len(back)}",
                "streams",
            ),
            (
                "eager server, peak for the slow readers",
                figure("extensions", "eager_peak"),
                f"{tables['eager'].eager_measured_mib.iloc[0]:.2f}",
                "MiB (measured, tracemalloc)",
            ),
            (
                "seeded sampling: all at once identical to alone",
                figure("extensions", "seeded_sampling"),
                same("sampled float32: all at once vs alone"),
                "streams",
            ),
            ("sampled streams identical to greedy", NO_FIGURE, same(VS_GREEDY), "streams"),
            (
                "bfloat16 greedy: all at once identical to alone",
                figure("extensions", "bfloat16_together"),
                same("greedy bfloat16: all at once vs alone"),
                "streams",
            ),
            (
                "bfloat16 greedy alone identical to float32",
                NO_FIGURE,
                same("greedy: bfloat16 alone vs float32"),
                "streams",
            ),
        ]
    )


def report(tables: dict[str, pd.DataFrame]) -> str:
    """Stable lines for a checked cell: resumption and seeded sampling, which must hold exactly."""
    resume = tables["resume"]
    back = resume[resume.status == 200]
    late = resume[resume.status != 200]
    exact = bool(back.in_order_no_gap.all() and back.same_tokens_as_generate.all() and (back.end == "done").all())
    expired = bool(len(late) and (late.status == 404).all())
    sampled = tables["identity"][tables["identity"].comparison.str.startswith("sampled")]
    lines = [
        "resumed within the grace period: "
        + ("exactly the missed events, in order, same tokens as /v1/generate" if exact and len(back) else "NOT EXACT"),
        "came back after the grace period: " + ("404, the log was forgotten" if expired else "UNEXPECTED"),
        "seeded sampling, all at once vs alone: " + ("identical token ids" if sampled.identical.all() else "DIFFERENT"),
    ]
    vs_greedy = _sampled(tables["identity"], VS_GREEDY)
    if len(vs_greedy):  # absent from runs made before the comparison existed
        differ = (~vs_greedy.identical.astype(bool)).mean() >= SAMPLED_DIFFER
        lines.append(
            "sampled streams against greedy ones: " + ("most differ" if differ else "NOT DIFFERENT: sampling ignored?")
        )
    return "\n".join(lines)


def plot(tables: dict[str, pd.DataFrame]) -> list:
    return [
        _plot_delivery(tables["delivery_streams"]),
        _plot_saturation(tables["saturation"]),
        _plot_eager(tables["eager_timeline"], tables["eager"]),
    ]


def _plot_delivery(delivery: pd.DataFrame):
    from labkit.plots import new_figure

    fig, (ax,) = new_figure("extensions_first_token")
    for (mode, rep), group in delivery.groupby(["mode", "repetition"]):
        values = np.sort(1000 * group.ttft_s.dropna().to_numpy())
        ax.plot(
            np.arange(1, len(values) + 1) / len(values),
            values,
            color="C0" if mode == "prefill" else "C1",
            alpha=0.8,
            label=f"delivered at {mode.replace('_', ' ')}" if rep == 0 else None,
        )
    ax.set(
        xlabel="fraction of streams",
        ylabel="ms to first token",
        title="First token: own prefill vs step end (each repetition)",
    )
    ax.legend()
    return fig


def _plot_saturation(saturation: pd.DataFrame):
    from labkit.plots import new_figure

    fig, (left, right) = new_figure("extensions_full_batch", ncols=2)
    labels = list(dict.fromkeys(saturation.policy))
    for x, label in enumerate(labels):
        group = saturation[saturation.policy == label]
        left.scatter([x] * len(group), group.paused_slot_s_while_waiting, color="C0", s=22, zorder=3)
        right.scatter([x] * len(group), group.fast_done_s, color="C3", s=22, zorder=3)
        for ax, col in ((left, "paused_slot_s_while_waiting"), (right, "fast_done_s")):
            ax.hlines(group[col].median(), x - 0.15, x + 0.15, color="black", lw=1.5)
    left.set(ylabel="slot-seconds held by paused streams\nwhile requests waited", title="Slots held (every run)")
    right.set(ylabel="s until the last fast request ended", title="What the fast requests paid (every run)")
    for ax in (left, right):
        ax.set_xticks(range(len(labels)), [label.replace("pause_then_drop", "p-t-d") for label in labels], rotation=30)
        ax.set_ylim(bottom=0)
    return fig


def _plot_eager(line: pd.DataFrame, eager: pd.DataFrame):
    from labkit.plots import new_figure

    row = eager.iloc[0]
    fig, (ax,) = new_figure("extensions_eager_memory")
    ax.plot(line.t, line.queued_events, label="events queued for the slow readers (GET /stats)")
    ax.axhline(row.peak_queued_events, ls=":", color="gray")
    ax.set(
        xlabel="s from launch", ylabel="events queued", title=f"{int(row.slow_readers)} slow readers, unbounded policy"
    )
    ax.text(
        0.02,
        0.95,
        f"peak formatted eagerly: {row.eager_measured_mib:.2f} MiB\nheld lazily: {row.lazy_measured_mib:.3f} MiB\n(measured, tracemalloc)",
        transform=ax.transAxes,
        va="top",
        fontsize=8,
    )
    ax.legend(loc="lower right")
    return fig
