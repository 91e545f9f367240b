"""Experiment 7, ``leak``: after many clients come and go, is everything given back exactly once?

Hundreds of streams, at most 48 open at once, against an engine that runs 8 at a time. A
fixed, seeded plan: 35% read to the end; half leave after 0 to 40 tokens, by FIN or RST; 15% read
slowly (a 0.25 s sleep after each read) and leave after 3 or 10 tokens. Then we look at the
server, not at the responses, through its own books over HTTP (``/stats``, ``/lab/streams``,
``/lab/integrity``; :mod:`labkit.experiments.servers`): the cache whole, nothing reserved,
running, waiting or registered in the hub, each stream finished once and each admitted stream
released once, no error in the hub. And what leaving cost: tokens generated per token read, and the total
time. Both response classes, on servers that differ in that one setting.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from typing import Any

import pandas as pd

from labkit.experiments.chapter import beside
from labkit.experiments.chapter_figures import figure
from labkit.experiments.client import run_sync
from labkit.experiments.disconnect import CLASSES
from labkit.experiments.profiles import Profile
from labkit.experiments.progress import Progress, doing, tick
from labkit.experiments.rawhttp import raw_stream as read_stream
from labkit.experiments.readings import Verdict, current_step, fetch_steps
from labkit.experiments.records import LeaveBy, StreamResult
from labkit.experiments.servers import (
    books,
    loaded_model,
    release_books,
    released_records,
    server_checks,
    server_like,
)
from labkit.experiments.workload import long_prompts, stream_body

NAME = "leak"


@dataclass(frozen=True)
class Client:
    """One client of the plan: how it reads, and when and how it leaves (``None``: never)."""

    index: int
    kind: str  # "full", "early" or "slow"
    leave_after: int | None
    leave_by: LeaveBy


@dataclass(frozen=True)
class Config:
    model: str = "smollm2-135m"
    streams: int = 300  # the chapter's (chapter.toml, [leak] streams)
    concurrency: int = 48
    max_batch: int = 8
    max_new_tokens: int = 48
    share_full: float = 0.35
    share_early: float = 0.50  # the rest (15%) are slow readers
    early_range: tuple[int, int] = (0, 40)  # tokens read before leaving, inclusive
    slow_leave_after: tuple[int, ...] = (3, 10)
    slow_sleep: float = 0.25
    response_classes: tuple[str, ...] = CLASSES
    seed: int = 7
    timeout: float = 300.0

    @classmethod
    def for_profile(cls, profile: Profile) -> Config:
        if profile.full:
            # The chapter's 300 streams, made short and run many at once so that both classes fit
            # in about 2 minutes on two cores: 16 tokens each, 32 in the batch (a B=32 step costs
            # ~140 ms for 32 tokens, against ~85 ms for 8 at B=8). Write-only, the heavier class:
            # 300 x 16 tokens = 150 full steps (~21 s) plus 300 prefills (~15 s).
            return cls(
                model=profile.model,
                concurrency=64,
                max_batch=32,
                max_new_tokens=16,
                early_range=(0, 12),
                slow_leave_after=(3, 10),
            )
        return cls(
            model=profile.model,
            streams=40,
            concurrency=12,
            max_batch=4,
            max_new_tokens=24,
            early_range=(0, 16),
            slow_sleep=0.05,
        )

    def __post_init__(self) -> None:
        if not (0 <= self.share_full and 0 <= self.share_early and self.share_full + self.share_early <= 1):
            raise ValueError(
                f"leak.Config shares must be in [0, 1] and sum to <= 1, got {self.share_full!r}, {self.share_early!r}"
            )
        if self.early_range[1] >= self.max_new_tokens or max(self.slow_leave_after) >= self.max_new_tokens:
            raise ValueError(
                f"leak.Config: clients must leave before max_new_tokens={self.max_new_tokens}, "
                f"got early_range={self.early_range!r}, slow_leave_after={self.slow_leave_after!r}"
            )
        if set(self.response_classes) - set(CLASSES) or self.streams < 1 or self.concurrency < 1:
            raise ValueError(f"leak.Config: response classes from {CLASSES}, streams and concurrency >= 1")


def server_options(config: Config) -> dict[str, Any]:
    return {"model": config.model, **_settings(config, config.response_classes[0])}


def _settings(config: Config, response_class: str) -> dict[str, Any]:
    return {"max_batch": config.max_batch, "response_class": response_class, "policy": "unbounded", "max_waiting": None}


def units(config: Config) -> int:
    return len(config.response_classes)


def plan(config: Config) -> list[Client]:
    """The same clients in the same order for every response class (seeded)."""
    rng = random.Random(config.seed)
    full = round(config.streams * config.share_full)
    early = round(config.streams * config.share_early)
    kinds = ["full"] * full + ["early"] * early + ["slow"] * (config.streams - full - early)
    rng.shuffle(kinds)
    clients = []
    for i, kind in enumerate(kinds):
        after = {"full": None, "early": rng.randint(*config.early_range), "slow": rng.choice(config.slow_leave_after)}[
            kind
        ]
        clients.append(Client(i, kind, after, rng.choice(("fin", "rst"))))
    return clients


def run(config: Config, *, server: Any = None, progress: Progress | None = None) -> dict[str, pd.DataFrame]:
    model = loaded_model(server, config.model)
    prompts = long_prompts(model, config.max_new_tokens)
    clients = plan(config)
    rows, outcomes, steps = [], [], []
    for kind in config.response_classes:
        with server_like(server, model, **_settings(config, kind)) as srv:
            before, first_step = books(srv.url), current_step(srv.url)
            doing(progress, f"{kind}: {len(clients)} streams, {config.concurrency} at a time")
            t0 = time.perf_counter()
            results = run_sync(run_clients(srv.url, config, clients, prompts))
            records = run_sync(released_records(srv.url, [r.request_id for r in results], timeout=config.timeout))
            elapsed = time.perf_counter() - t0  # until the engine let go of the last stream, zombies included
            rows += [stream_row(kind, c, r, rec) for c, r, rec in zip(clients, results, records)]
            mine = fetch_steps(srv.url, since=first_step).assign(response_class=kind)
            steps.append(mine)
            outcomes.append(
                {
                    "response_class": kind,
                    "total_s": elapsed,
                    "busy_steps": int(((mine.decoded > 0) | (mine.prefilled > 0)).sum()),
                    **server_checks(srv.url),
                    **release_books(srv.url, before),
                }
            )
            tick(progress, streams=rows, outcome=outcomes)
    streams = pd.DataFrame(rows)
    return {
        "streams": streams,
        "outcome": outcome_table(pd.DataFrame(outcomes), streams),
        "steps": pd.concat(steps, ignore_index=True),
    }


async def run_clients(url: str, config: Config, clients: list[Client], prompts: list[int]) -> list[StreamResult]:
    """Every client of the plan, at most ``concurrency`` connected at once."""
    gate = asyncio.Semaphore(config.concurrency)

    async def one(client: Client) -> StreamResult:
        body = stream_body(prompts[client.index % len(prompts)], config.max_new_tokens)
        async with gate:
            return await read_stream(
                url,
                body,
                sleep=config.slow_sleep if client.kind == "slow" else 0.0,
                leave_after_tokens=client.leave_after,
                leave_by=client.leave_by,
                leave_after_s=config.timeout,
            )

    return list(await asyncio.gather(*(one(c) for c in clients)))


def stream_row(kind: str, client: Client, r: StreamResult, rec: Any) -> dict[str, Any]:
    return {
        "response_class": kind,
        "client": client.index,
        "kind": client.kind,
        "leave_after": client.leave_after,
        "leave_by": client.leave_by if client.leave_after is not None else None,
        "tokens_read": len(r.tokens),
        "tokens_generated": getattr(rec, "tokens_generated", 0),
        "engine_finish": getattr(rec, "finish_reason", None),
        "left": r.left is not None,
        "cut": r.left is None and r.terminal is None,
        "error": r.error,
    }


def outcome_table(outcomes: pd.DataFrame, streams: pd.DataFrame) -> pd.DataFrame:
    """Per response class: the books afterwards, and tokens generated per token read."""
    rows = []
    for _, row in outcomes.iterrows():
        mine = streams[streams.response_class == row.response_class]
        gone = mine[mine.left]
        rows.append(
            {
                **row.to_dict(),
                "streams": len(mine),
                "left_early": len(gone),
                "cut": int(mine.cut.sum()),
                "client_errors": int(mine.error.notna().sum()),
                "generated_per_read": mine.tokens_generated.sum() / max(1, mine.tokens_read.sum()),
                "generated_per_read_leavers": gone.tokens_generated.sum() / max(1, gone.tokens_read.sum()),
            }
        )
    return pd.DataFrame(rows)


def summary(tables: dict[str, pd.DataFrame]) -> dict[str, Any]:
    out = tables["outcome"].set_index("response_class")
    return {
        kind: {
            "total_s": float(row.total_s),
            "generated_per_read_leavers": float(row.generated_per_read_leavers),
            "cache_whole": bool(row.cache_whole),
            "late_events": int(row.late_events),
        }
        for kind, row in out.iterrows()
    }


def beside_chapter(tables: dict[str, pd.DataFrame]) -> pd.DataFrame:
    out = tables["outcome"].set_index("response_class")
    listen, write = out.loc["starlette"], out.loc["write_only"]
    clean = bool(out.cache_whole.all() and (out.releases == out.admitted).all() and (out.open_streams == 0).all())
    return beside(
        [
            ("streams per response class", figure("leak", "streams"), f"{int(listen.streams)}", "streams"),
            ("left before the end", figure("leak", "left_early"), f"{int(listen.left_early)}", "streams"),
            ("blocks leaked, either class", figure("leak", "blocks_leaked"), "none" if clean else "SOME", ""),
            (
                "tokens generated per token read, leavers: Starlette / write-only",
                figure("leak", "generated_per_read"),
                f"{listen.generated_per_read_leavers:.1f} / {write.generated_per_read_leavers:.1f}",
                "tokens",
            ),
            (
                "write-only total time against Starlette's",
                figure("leak", "write_only_extra_time"),
                f"{100 * (write.total_s / listen.total_s - 1):+.0f}%",
                "",
            ),
            (
                "late events dropped, Starlette's run",
                figure("leak", "late_events"),
                f"{int(listen.late_events)}",
                "events",
            ),
        ]
    )


def findings(tables: dict[str, pd.DataFrame]) -> str:
    """A few plain sentences from this run's numbers."""
    out = tables["outcome"].set_index("response_class")
    said = [
        f"{kind.replace('_', '-')}: {int(row.left_early)} of {int(row.streams)} clients left early; the engine "
        f"generated {row.generated_per_read_leavers:.1f} tokens for every token they read, and the whole plan "
        f"took {row.total_s:.1f} s"
        + (f" ({int(row.busy_steps)} engine steps)." if "busy_steps" in row and pd.notna(row.busy_steps) else ".")
        for kind, row in out.iterrows()
    ]
    if {"starlette", "write_only"} <= set(out.index):
        extra = out.loc["write_only", "total_s"] / out.loc["starlette", "total_s"] - 1
        left = (
            "neither class left a block, a stream or a reservation behind"
            if out.cache_whole.all()
            else "something was left behind: see the checked cell above"
        )
        said.append(
            f"Not listening cost {100 * extra:+.0f}% in time (one run of each class: read the steps "
            f"beside the seconds); {left}."
        )
    return " ".join(said)


def verdicts(tables: dict[str, pd.DataFrame]) -> list[Verdict]:
    """The hypotheses of the leak half of notebook 06, judged against their criteria."""
    lines = report(tables).splitlines()
    failed = [line for line in lines if "FAILED" in line]
    out = tables["outcome"].set_index("response_class")
    verdicts = [
        Verdict(
            "nothing_leaks",
            "after every client of the plan has come and gone, either response class gives back every "
            "block, reservation and stream exactly once",
            "any check of the books fails for either class (cache, reservations, streams, finishes, releases, errors)",
            bool(lines) and not failed,
            "; ".join(failed) if failed else f"{len(lines)} classes, every check passed",
        )
    ]
    if {"starlette", "write_only"} <= set(out.index):
        listen, write = out.loc["starlette"], out.loc["write_only"]
        verdicts.append(
            Verdict(
                "listening_saves_work",
                "a response that listens for the disconnect generates fewer tokens per token its leavers read",
                "Starlette's class generates at least as many tokens per token read by leavers as the write-only class",
                bool(listen.generated_per_read_leavers < write.generated_per_read_leavers),
                f"{listen.generated_per_read_leavers:.2f} against {write.generated_per_read_leavers:.2f} tokens per token read",
            )
        )
    return verdicts


CHECKED = ("nothing_leaks",)


def report(tables: dict[str, pd.DataFrame]) -> str:
    """Stable lines for a checked cell: the leak invariants per response class."""
    lines = []
    for _, row in tables["outcome"].iterrows():
        ok = {
            "cache whole": bool(row.cache_whole),
            "nothing reserved": row.held_blocks == 0,
            "nothing running or waiting": row.running == 0 and row.waiting == 0,
            "no stream registered": row.open_streams == 0,
            "each stream finished once": row.finished == row.streams,
            "one release per admitted stream": row.releases == row.admitted,
            "no hub error": row.hub_errors == 0,
            "no stream cut short": row.cut == 0,
            "no client error": row.client_errors == 0,
        }
        failed = [name for name, good in ok.items() if not good]
        lines.append(f"{row.response_class}: " + ("; ".join(ok) if not failed else "FAILED: " + "; ".join(failed)))
    return "\n".join(lines)


def plot(tables: dict[str, pd.DataFrame]) -> list:
    """Left: per client that left, tokens read against tokens generated. Right: the engine's batch
    over the run in steps (sequences decoded per step, from the step log), one line per response
    class: what the zombies of the write-only class occupy, and for how many steps."""
    from labkit.plots import new_figure

    streams = tables["streams"]
    fig, (left, right) = new_figure("leak_work", ncols=2)
    for kind, group in streams[streams.left].groupby("response_class", sort=False):
        left.scatter(group.tokens_read, group.tokens_generated, s=10, alpha=0.6, label=kind.replace("_", "-"))
    left.set(
        xlabel="tokens the client read before leaving",
        ylabel="tokens the engine generated",
        title="Clients that left early",
    )
    left.legend()
    steps = tables.get("steps")
    if steps is None or steps.empty:
        right.text(0.5, 0.5, "no step log in this run", ha="center", va="center", transform=right.transAxes)
    else:
        for kind, group in steps.groupby("response_class", sort=False):
            right.plot(
                group.step - group.step.min(),
                group.decoded.rolling(10, min_periods=1).mean(),
                lw=1.2,
                label=kind.replace("_", "-"),
            )
    right.set(
        xlabel="engine steps since the class's first",
        ylabel="sequences decoded per step (mean of 10)",
        title="The batch over the plan",
    )
    if right.lines:
        right.legend()
    return [fig]
