"""Notebook 07, ``extensions``: the chapter's reader exercises, measured on the lab's service.

* ``delivery``: each first token delivered when its own prefill ends, against at the end of the
  step (experiment 3's measurement, reused with N streams arriving together).
* ``saturation``: a full batch (limit 4) with two slow readers holding slots while fast requests
  wait; ``pause`` against ``pause_then_drop`` at several stall timeouts.
* ``resume``: a resumable stream whose client leaves by RST after N tokens and comes back with
  ``Last-Event-ID`` after a pause: exactly the missed events, in order, and the same text as an
  uninterrupted answer; and a client that comes back after the grace period (404).
* ``eager``: the memory a server that formats events eagerly would hold for four slow readers
  under ``unbounded``, sampled while they read: queued events x the measured size of one event.
* ``identity``: sampled streams with per-request seeds, and greedy streams in bfloat16, against
  their solo runs (and bfloat16 against float32), by first divergence and the float32 model's
  logit margin there.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, replace
from typing import Any

import httpx
import numpy as np
import pandas as pd

from labkit.experiments import overlap, slowclient
from labkit.experiments.chapter import beside, span
from labkit.experiments.client import async_client, run_sync
from labkit.experiments.identity import generate, identity_table, measure_identity
from labkit.experiments.profiles import Profile
from labkit.experiments.progress import Progress, doing, tick
from labkit.experiments.rawreader import Leave, read_stream
from labkit.experiments.records import EventSplitter, StreamResult
from labkit.experiments.saturation import measure_saturation
from labkit.experiments.servers import Sampler, loaded_model, server_like, wait_released
from labkit.experiments.workload import bodies, long_prompts, stream_body
from labkit.prompts import PROMPTS

NAME = "extensions"


@dataclass(frozen=True)
class Config:
    model: str = "smollm2-135m"
    slow: slowclient.Config = slowclient.Config()  # events, buffers and readers for saturation and eager
    delivery_streams: int = 16
    delivery_tokens: int = 8
    delivery_repetitions: int = 2
    stall_timeouts: tuple[float, ...] = (0.25, 1.0, 4.0)
    resume_tokens: int = 32
    resume_leave_after: tuple[int, ...] = (4, 16)
    resume_waits: tuple[float, ...] = (0.2, 1.0)
    resume_grace: float = 3.0
    eager_readers: int = 4
    identity_streams: int = 8
    identity_tokens: int = 32
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
            slow=slow,
            delivery_streams=4,
            delivery_repetitions=1,
            stall_timeouts=(0.25,),
            resume_tokens=16,
            resume_leave_after=(4,),
            resume_waits=(0.2,),
            resume_grace=1.0,
            eager_readers=2,
            identity_streams=3,
            identity_tokens=12,
        )

    def __post_init__(self) -> None:
        if max(self.resume_leave_after) >= self.resume_tokens or max(self.resume_waits) >= self.resume_grace:
            raise ValueError(
                f"extensions.Config: leave before resume_tokens and come back within resume_grace, "
                f"got {self.resume_leave_after!r}, {self.resume_waits!r}, {self.resume_grace!r}"
            )
        if not 1 <= self.identity_streams <= len(PROMPTS) or self.delivery_streams > len(PROMPTS):
            raise ValueError(f"extensions.Config: identity_streams and delivery_streams must be in [1, {len(PROMPTS)}]")


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


def units(config: Config) -> int:
    return 2 * config.delivery_repetitions + len(config.stall_timeouts) + 1 + 1 + 1 + 2


def run(config: Config, *, server: Any = None, progress: Progress | None = None) -> dict[str, pd.DataFrame]:
    model = loaded_model(server, config.model)
    with server_like(server, model, **_settings(config)) as srv:
        run_sync(generate(srv.url, [stream_body(0, 2)], together=False))  # warm-up: the first request is slower
        delivery = overlap.measure_delivery(srv, _delivery_config(config), progress)
        doing(progress, "resuming with Last-Event-ID")
        resume = run_sync(measure_resume(srv, config))
        tick(progress)
        identity = measure_identity(
            srv,
            streams=config.identity_streams,
            tokens=config.identity_tokens,
            temperature=config.temperature,
            top_p=config.top_p,
            seed=config.seed,
            progress=progress,
        )
    doing(progress, "eager formatting")
    eager, eager_line, paced = measure_eager(model, config)
    tick(progress)
    saturation, timeline = measure_full_batch(model, replace(config, slow=paced), progress)
    return {
        "delivery": overlap.delivery_table(delivery),
        "delivery_streams": delivery,
        "saturation": saturation,
        "saturation_timeline": timeline,
        "resume": resume,
        "eager": eager,
        "eager_timeline": eager_line,
        "identity": identity,
        "identity_summary": identity_table(identity),
    }


def _delivery_config(config: Config) -> overlap.Config:
    return overlap.Config(
        model=config.model,
        levels=(1,),
        repetitions=config.delivery_repetitions,
        backgrounds=(0,),
        joiners=1,
        joiner_tokens=config.delivery_tokens,
        delivery_streams=config.delivery_streams,
    )


# --------------------------------------------------------------------------- a full batch


def measure_full_batch(model: Any, config: Config, progress: Progress | None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """``pause`` and ``pause_then_drop`` at each stall timeout, on a batch of 4 with 2 slow readers."""
    slow = config.slow
    prompts = long_prompts(model, slow.max_new_tokens)
    runs = [("pause", slow.stall_timeout, "pause")]
    runs += [("pause_then_drop", t, f"pause_then_drop {t:g} s") for t in config.stall_timeouts]
    rows, lines = [], []
    for policy, stall, label in runs:
        doing(progress, f"{label} under a full batch")
        cfg = replace(slow, stall_timeout=stall)
        settings = slowclient.server_settings(cfg, policy, max_batch=cfg.saturation_batch)
        with server_like(None, model, **settings) as srv:
            row, line = measure_saturation(srv, slowclient.saturation_config(cfg), prompts, label)
        rows.append({**row, "stall_timeout_s": stall if policy != "pause" else np.inf})
        lines.append(line)
        tick(progress, saturation=rows)
    return pd.DataFrame(rows), pd.concat(lines, ignore_index=True)


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
    first = await read_stream(srv.url, {**body, "resumable": True}, leave_after_tokens=leave_after, leave_by="rst")
    last = int(first.last_event_id or 0)
    start = next((e.data for e in first.events if e.event == "start"), {})
    await asyncio.sleep(wait)
    sent = time.perf_counter()
    status, later = await follow(client, first.request_id or "", start.get("resume_token", ""), last)
    ids = [int(e.id) for e in later if e.id]
    tokens = [e.data["id"] for e in first.tokens] + [e.data["id"] for e in later if e.event == "token"]
    record = (await wait_released(srv.hub, [first.request_id]))[0]
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
        "engine_finish": getattr(record, "finish_reason", None),
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


def measure_eager(model: Any, config: Config) -> tuple[pd.DataFrame, pd.DataFrame, slowclient.Config]:
    """Slow readers under ``unbounded`` (with the capped send buffer), sampled until every one of
    their sequences has left the engine; the queue then only shrinks. Also returns the slow reader
    as paced here (:func:`slowclient.paced`), for the full-batch runs."""
    slow = replace(config.slow, streams=config.eager_readers)
    prompts = long_prompts(model, slow.max_new_tokens)
    with server_like(None, model, **slowclient.server_settings(slow, "unbounded")) as srv:
        slow = slowclient.calibrate(srv, slow, prompts)
        requests = bodies(prompts, config.eager_readers, slow.max_new_tokens)
        results, samples = run_sync(_slow_until_released(srv, slow, requests))
    event_bytes = float(np.median([e.nbytes for r in results for e in r.tokens])) if results else np.nan
    samples = samples.assign(eager_mb=samples.queued_events * event_bytes / 2**20)
    row = {
        "slow_readers": config.eager_readers,
        "read_bytes": slow.read_bytes,
        "event_bytes": event_bytes,
        "peak_queued_events": int(samples.queued_events.max()),
        "eager_peak_mb": float(samples.eager_mb.max()),
        "bound_mb": config.eager_readers * slow.max_new_tokens * event_bytes / 2**20,
        "pad_bytes": slow.pad_bytes,
        "server_sndbuf": slow.server_sndbuf,
    }
    return pd.DataFrame([row]), samples, replace(slow, streams=config.slow.streams)


async def _slow_until_released(
    srv: Any, slow: slowclient.Config, requests: list[dict[str, Any]]
) -> tuple[list[StreamResult], pd.DataFrame]:
    sampler = Sampler(srv)
    sampling = asyncio.ensure_future(sampler.run())
    results, flags = [StreamResult(sent=0.0) for _ in requests], [Leave() for _ in requests]
    t0 = time.perf_counter()
    readers = [
        asyncio.ensure_future(
            read_stream(
                srv.url,
                body,
                sleep=slow.slow_sleep,
                read_bytes=slow.read_bytes,
                leave_after_s=slow.read_timeout,
                leave=flag,
                result=result,
            )
        )
        for body, flag, result in zip(requests, flags, results)
    ]
    try:
        while not all(r.request_id for r in results) and not all(t.done() for t in readers):
            await asyncio.sleep(0.01)
        await wait_released(srv.hub, [r.request_id for r in results], timeout=slow.read_timeout)
        await asyncio.sleep(0.2)  # a few samples after the last release: the peak is behind us
    finally:
        for flag in flags:
            flag.set()
        await asyncio.gather(*readers, return_exceptions=True)
        sampler.stop()
        await sampling
    return results, sampler.table(t0)


# --------------------------------------------------------------------------- reading the tables


def summary(tables: dict[str, pd.DataFrame]) -> dict[str, Any]:
    delivery = tables["delivery"].set_index("mode")
    sat = tables["saturation"].set_index("policy")
    return {
        "ttft_p50_s": delivery.ttft_p50_s.to_dict(),
        "ttft_p99_s": delivery.ttft_p99_s.to_dict(),
        "fast_done_s": sat.fast_done_s.to_dict(),
        "paused_slot_s_while_waiting": sat.paused_slot_s_while_waiting.to_dict(),
        "eager_peak_mb": float(tables["eager"].eager_peak_mb.iloc[0]),
        "identical": tables["identity_summary"].set_index("comparison").identical.to_dict(),
    }


def beside_chapter(tables: dict[str, pd.DataFrame]) -> pd.DataFrame:
    delivery = tables["delivery"].set_index("mode")
    sat, identity = tables["saturation"], tables["identity_summary"].set_index("comparison")
    back = tables["resume"][tables["resume"].status == 200]
    first_token = {
        mode: f"{1000 * delivery.loc[mode, 'ttft_p50_s']:.0f} / {1000 * delivery.loc[mode, 'ttft_p99_s']:.0f}"
        for mode in delivery.index
    }
    held = ", ".join(f"{row.policy}: {row.paused_slot_s_while_waiting:.1f}" for row in sat.itertuples())

    def same(key: str) -> str:
        return (
            f"{int(identity.loc[key, 'identical'])} of {int(identity.loc[key, 'streams'])}"
            if key in identity.index
            else "n/a"
        )

    return beside(
        [
            (
                "first token median / p99, all at once, step-end delivery",
                "441 / 442 (32 streams)",
                f"{first_token.get('step_end', 'n/a')} ({tables['delivery_streams'].stream.nunique()} streams)",
                "ms",
            ),
            (
                "the same, delivered when each prefill ends",
                "not built (exercise 1)",
                first_token.get("prefill", "n/a"),
                "ms",
            ),
            ("full batch: slot-seconds held by paused streams", "not measured (exercise 2)", held, "slot-s"),
            (
                "resumed streams with exactly the missed events",
                "not built (exercise 4)",
                f"{int((back.in_order_no_gap & back.same_tokens_as_generate).sum())} of {len(back)}",
                "streams",
            ),
            (
                "eager server, peak for the slow readers",
                "about 4 MB per reader (arithmetic, exercise 6)",
                span(tables["eager"].eager_peak_mb),
                "MiB (measured)",
            ),
            (
                "seeded sampling: all at once identical to alone",
                "not compared (exercise 7)",
                same("sampled float32: all at once vs alone"),
                "streams",
            ),
            (
                "bfloat16 greedy: all at once identical to alone",
                "3 of 12 differed (Chapter 24, padded batch)",
                same("greedy bfloat16: all at once vs alone"),
                "streams",
            ),
            ("bfloat16 greedy alone identical to float32", "—", same("greedy alone: bfloat16 vs float32"), "streams"),
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
    return "\n".join(
        [
            "resumed within the grace period: "
            + (
                "exactly the missed events, in order, same tokens as /v1/generate"
                if exact and len(back)
                else "NOT EXACT"
            ),
            "came back after the grace period: " + ("404, the log was forgotten" if expired else "UNEXPECTED"),
            "seeded sampling, all at once vs alone: "
            + ("identical token ids" if sampled.identical.all() else "DIFFERENT"),
        ]
    )


def plot(tables: dict[str, pd.DataFrame]) -> list:
    return [
        _plot_delivery(tables["delivery_streams"]),
        _plot_saturation(tables["saturation"]),
        _plot_eager(tables["eager_timeline"], tables["eager"]),
    ]


def _plot_delivery(delivery: pd.DataFrame):
    from labkit.plots import first_token_cdf

    return first_token_cdf(delivery, "extensions_first_token", "First token: own prefill vs step end")


def _plot_saturation(saturation: pd.DataFrame):
    from labkit.plots import new_figure

    fig, (left, right) = new_figure("extensions_full_batch", ncols=2)
    labels = saturation.policy.str.replace("pause_then_drop", "p-t-d")
    left.bar(labels, saturation.paused_slot_s_while_waiting)
    left.set(ylabel="slot-seconds held by paused streams\nwhile requests waited", title="Slots held")
    right.bar(labels, saturation.fast_done_s)
    right.set(ylabel="s until the last fast request ended", title="What the fast requests paid")
    for ax in (left, right):
        ax.tick_params(axis="x", rotation=30)
    return fig


def _plot_eager(line: pd.DataFrame, eager: pd.DataFrame):
    from labkit.plots import new_figure

    fig, (ax,) = new_figure("extensions_eager_memory")
    ax.plot(line.t, line.eager_mb, label="queued events x bytes per event (measured)")
    ax.axhline(float(eager.bound_mb.iloc[0]), ls="--", color="gray", label="bound: readers x tokens x event size")
    ax.set(
        xlabel="s from launch",
        ylabel="MiB an eager server would hold",
        title=f"{int(eager.slow_readers.iloc[0])} slow readers, unbounded policy",
    )
    ax.legend()
    return fig
