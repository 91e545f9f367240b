"""What to watch: ``/metrics`` scraped every ``scrape_every`` seconds during a small load run.

Requests arrive in waves, more at once than the batch holds, so the queue grows and drains.
Every scrape is parsed with prometheus-client's own parser
(``prometheus_client.parser.text_string_to_metric_families``) into one row: open streams, queue
depth, running requests, KV blocks in use, and the cumulative buckets of the first-token and
inter-token histograms. The plot shows the gauges over time and, per scrape interval, how many
new observations fell into each histogram bucket.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np
import pandas as pd

from labkit.experiments.client import async_client, run_sync, timed_stream
from labkit.experiments.profiles import Profile
from labkit.experiments.progress import Progress, doing, tick
from labkit.experiments.readings import Verdict, current_step, fetch_steps
from labkit.experiments.servers import loaded_model, server_like
from labkit.experiments.workload import stream_body

NAME = "watch"
GAUGES = {
    "labkit_open_streams": "open streams",
    "labkit_queue_depth": "queue depth",
    "labkit_running_requests": "running",
    "labkit_kv_blocks_in_use": "KV blocks in use",
}
HISTOGRAMS = {"labkit_time_to_first_token_seconds": "ttft", "labkit_inter_token_gap_seconds": "gap"}


@dataclass(frozen=True)
class Config:
    model: str = "tiny-gpt2"
    max_batch: int = 8
    waves: int = 3
    per_wave: int = 16  # more than max_batch: a queue forms
    wave_gap_s: float = 1.5
    tokens: int = 120
    scrape_every: float = 0.5
    timeout: float = 300.0

    @classmethod
    def for_profile(cls, profile: Profile) -> Config:
        if profile.full:  # SmolLM2 at B=8: ~85 ms a step; 3 waves of 16 x 24 tokens ~ 15-20 s
            return cls(model=profile.model, tokens=24, wave_gap_s=3.0)
        # tiny-gpt2: 200-token streams hold each wave's queue for ~1 s, scraped every 0.1 s (8-10
        # scrapes a wave see it); 120 tokens every 0.5 s gave 3-5 in all, and 0-1 at a 2.5x interval
        return cls(model=profile.model, tokens=200, scrape_every=0.1)

    def __post_init__(self) -> None:
        if self.per_wave <= self.max_batch or self.waves < 1 or self.scrape_every <= 0:
            raise ValueError("watch.Config: per_wave must exceed max_batch (a queue must form); waves >= 1")


def units(config: Config) -> int:
    return config.waves


def parse_scrape(text: str, t: float) -> dict[str, Any]:
    """One scrape as a flat row: gauges by name, histogram buckets as ``<short>_le_<bound>``."""
    from prometheus_client.parser import text_string_to_metric_families

    row: dict[str, Any] = {"t": t}
    for family in text_string_to_metric_families(text):
        if family.name in GAUGES:
            row[family.name] = family.samples[0].value
        elif family.name in HISTOGRAMS:
            short = HISTOGRAMS[family.name]
            for s in family.samples:
                if s.name.endswith("_bucket"):
                    row[f"{short}_le_{s.labels['le']}"] = s.value
                elif s.name.endswith("_count"):
                    row[f"{short}_count"] = s.value
                elif s.name.endswith("_sum"):
                    row[f"{short}_sum"] = s.value
    return row


class Scraper(threading.Thread):
    def __init__(self, url: str, every: float) -> None:
        super().__init__(daemon=True)
        self.url, self.every = url, every
        self.rows: list[dict[str, Any]] = []
        self.stop = threading.Event()
        self.start_t = time.perf_counter()

    def run(self) -> None:
        with httpx.Client(timeout=10) as http:
            while True:
                try:
                    text = http.get(self.url + "/metrics").text
                    self.rows.append(parse_scrape(text, time.perf_counter() - self.start_t))
                except httpx.HTTPError:
                    pass
                if self.stop.wait(self.every):
                    return


def run(config: Config, *, server: Any = None, progress: Progress | None = None) -> dict[str, pd.DataFrame]:
    model = loaded_model(server, config.model) if server is not None else config.model
    results: list[dict[str, Any]] = []
    with server_like(None, model, max_batch=config.max_batch) as srv:
        first_step = current_step(srv.url)
        scraper = Scraper(srv.url, config.scrape_every)
        scraper.start()
        try:
            run_sync(_load(srv.url, config, progress, results, scraper.start_t))
            time.sleep(2 * config.scrape_every)  # a scrape or two of the idle server after the load
        finally:
            scraper.stop.set()
            scraper.join(10)
        steps = fetch_steps(srv.url, since=first_step)  # the engine's steps of this run
    scrapes = pd.DataFrame(scraper.rows).fillna(0.0)
    return {"scrapes": scrapes, "requests": pd.DataFrame(results), "steps": steps}


async def _load(url: str, config: Config, progress: Progress | None, out: list[dict[str, Any]], t0: float) -> None:
    async with async_client(url, connections=config.waves * config.per_wave, timeout=config.timeout) as client:
        tasks = []
        for wave in range(config.waves):
            doing(progress, f"wave {wave + 1}/{config.waves}: {config.per_wave} streams")
            for i in range(config.per_wave):
                body = stream_body(wave * config.per_wave + i, config.tokens, ignore_eos=True)
                tasks.append(asyncio.ensure_future(timed_stream(client, body)))
            tick(progress)
            if wave + 1 < config.waves:
                await asyncio.sleep(config.wave_gap_s)
        for r in await asyncio.gather(*tasks):
            out.append(
                {
                    "sent_s": r.sent - t0,
                    "status": r.status,
                    "tokens": len(r.tokens),
                    "ended_by": r.terminal.event if r.terminal else "cut",
                }
            )


def buckets(scrapes: pd.DataFrame, short: str) -> tuple[list[str], np.ndarray]:
    """Bucket labels and new observations per bucket per scrape interval (not cumulative)."""
    cols = [c for c in scrapes.columns if c.startswith(f"{short}_le_")]
    cols.sort(key=lambda c: float(c.split("_le_")[1]))
    cum = scrapes[cols].to_numpy()
    per_bucket = np.diff(np.concatenate([np.zeros((len(cum), 1)), cum], axis=1), axis=1)  # le -> per bucket
    new = np.diff(np.concatenate([np.zeros((1, per_bucket.shape[1])), per_bucket], axis=0), axis=0)
    return [c.split("_le_")[1] for c in cols], new


def verdicts(tables: dict[str, pd.DataFrame], config: Config) -> list[Verdict]:
    s, req = tables["scrapes"], tables["requests"]
    last = s.iloc[-1]
    n = len(req)
    return [
        Verdict(
            "a queue shows while the batch is full",
            "With more streams than the batch holds, some scrape sees a queue and the batch full",
            "no scrape with queue depth > 0 and running == max_batch",
            bool(((s.labkit_queue_depth > 0) & (s.labkit_running_requests == config.max_batch)).any()),
            f"{int((s.labkit_queue_depth > 0).sum())} of {len(s)} scrapes saw a queue; "
            f"most open streams seen: {int(s.labkit_open_streams.max())}",
        ),
        Verdict(
            "the metrics account for every stream",
            "After the load, the first-token histogram counts every request, nothing is open or queued "
            "and no KV block is held",
            "a count other than the number of requests, or anything still open, queued or held",
            bool(
                last.ttft_count == n
                and last.labkit_open_streams == 0
                and last.labkit_queue_depth == 0
                and last.labkit_kv_blocks_in_use == 0
                and (req.ended_by == "done").all()
            ),
            f"ttft count {int(last.ttft_count)} for {n} requests; open {int(last.labkit_open_streams)}, "
            f"KV blocks in use {int(last.labkit_kv_blocks_in_use)} at the last scrape",
        ),
    ]


def summary(tables: dict[str, pd.DataFrame]) -> dict[str, Any]:
    s = tables["scrapes"]
    return {
        "scrapes": len(s),
        "max_open_streams": int(s.labkit_open_streams.max()),
        "max_queue_depth": int(s.labkit_queue_depth.max()),
        "max_kv_blocks_in_use": int(s.labkit_kv_blocks_in_use.max()),
    }


def plot(tables: dict[str, pd.DataFrame]) -> list:
    import matplotlib.pyplot as plt

    from labkit.plots import apply_style

    s = tables["scrapes"]
    apply_style()
    fig, (ax, ax_kv, ax_ttft, ax_gap) = plt.subplots(4, 1, figsize=(8.0, 9.0), sharex=True)
    fig.set_label("watch_metrics")
    for name in ("labkit_open_streams", "labkit_queue_depth", "labkit_running_requests"):
        ax.step(s.t, s[name], where="post", label=GAUGES[name])
    ax.set(ylabel="requests", title="/metrics, scraped during a load run in waves")
    ax.legend(fontsize=8)
    ax_kv.step(s.t, s.labkit_kv_blocks_in_use, where="post", color="C4")
    ax_kv.set(ylabel="KV blocks in use")
    for axis, short, what in ((ax_ttft, "ttft", "time to first token"), (ax_gap, "gap", "inter-token gap")):
        labels, new = buckets(s, short)
        if not labels:
            continue
        image = axis.pcolormesh(
            np.append(s.t.to_numpy(), s.t.iloc[-1] + 0.5),
            np.arange(len(labels) + 1),
            new.T,
            shading="flat",
            cmap="Blues",
        )
        axis.set_yticks(np.arange(len(labels)) + 0.5, [f"≤{lab}" for lab in labels], fontsize=6)
        axis.set(ylabel=f"{what} (s)")
        fig.colorbar(image, ax=axis, label="new observations")
    ax_gap.set(xlabel="seconds since the first scrape")
    return [fig]


def report(tables: dict[str, pd.DataFrame], config: Config) -> str:
    """Numbers-free lines for an nbval-checked cell."""
    from labkit.experiments.readings import verdict_lines

    return verdict_lines(verdicts(tables, config))
