"""Experiment 6, ``disconnect``: how soon does the engine let go of a client that has left?

A client leaves by FIN (an orderly close) or by RST (an abortive one) at five moments: while its
request waits for a slot (the batch, limited to 4, is full of other streams), right after the
response's headers (before the first token), early (after 2 tokens), mid-stream and near the end.
Each is repeated (6 times in ``full``) against two servers that differ in one thing only: the
response class. Starlette's ``StreamingResponse`` listens for the disconnect and cancels the body;
the write-only class never listens, as Starlette's own does on servers that speak ASGI 2.4.

Measured, per trial: the time from the client's close (its clock) to the hub's ``close()`` (the
server noticed), and to the release of the stream's blocks (the engine's finish event), both
``time.perf_counter()`` in this process; the release also in engine steps after the hub's close
(the engine applies a cancel at its next step boundary, so one step is the expected answer, and
the seconds are then that step's duration); and tokens generated that nobody read (the server's
count minus the client's). Trials run a few at once (two repetitions, FIN and RST interleaved):
each is timed on its own stream's timestamps, and four streams is exactly the batch limit. The
engine's step log of each server is kept (``steps``), so a step's duration can be read beside.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from labkit.experiments.chapter import beside
from labkit.experiments.chapter import span as low_high
from labkit.experiments.chapter_figures import figure
from labkit.experiments.client import run_sync
from labkit.experiments.profiles import Profile
from labkit.experiments.progress import Progress, doing, tick
from labkit.experiments.rawhttp import raw_stream
from labkit.experiments.rawhttp import raw_stream as read_stream
from labkit.experiments.readings import Verdict, current_step, fetch_steps, span
from labkit.experiments.records import LeaveBy, StreamResult
from labkit.experiments.servers import (
    books,
    lab_client,
    loaded_model,
    release_books,
    released_records,
    server_checks,
    server_like,
    server_stats_async,
)
from labkit.experiments.waiting import await_for
from labkit.experiments.workload import bodies, long_prompts

NAME = "disconnect"
MOMENTS = ("waiting", "before_first", "early", "mid", "near_end")
CLASSES = ("starlette", "write_only")


@dataclass(frozen=True)
class Config:
    model: str = "smollm2-135m"
    repetitions: int = 6
    at_once: int = 2  # repetitions run together (each with FIN and RST): 4 streams, the batch limit
    max_batch: int = 4
    max_new_tokens: int = 32  # the chapter's 200 would make each write-only trial six times longer
    early_tokens: int = 2
    end_margin: int = 4  # "near the end" leaves this many tokens before max_new_tokens
    # The streams that fill the batch for the "waiting" moment: they must outlast the wait for a
    # full batch (read from /stats), the trial clients' connect, leave and the server's notice,
    # or a slot opens and a "waiting" request is admitted (16 SmolLM2 steps: ~1.3 s).
    blocker_tokens: int = 16
    moments: tuple[str, ...] = MOMENTS
    leave_by: tuple[LeaveBy, ...] = ("fin", "rst")
    response_classes: tuple[str, ...] = CLASSES
    drain_after_fin_s: float = 0.5
    timeout: float = 120.0

    @classmethod
    def for_profile(cls, profile: Profile) -> Config:
        if profile.full:
            return cls(model=profile.model)
        # tiny-gpt2's steps take a few ms: 200 of them keep the batch full for 0.45-0.75 s after it
        # filled, while the waiting clients were gone (left, released) within 12-46 ms; 64 lasted
        # 120-160 ms, close enough for an engine 3x faster to free a slot before they leave
        return cls(model=profile.model, repetitions=4, max_new_tokens=24, blocker_tokens=200)

    def __post_init__(self) -> None:
        if set(self.moments) - set(MOMENTS) or set(self.response_classes) - set(CLASSES):
            raise ValueError(
                f"disconnect.Config: moments from {MOMENTS} and classes from {CLASSES}, "
                f"got {self.moments!r}, {self.response_classes!r}"
            )
        if not 0 < self.early_tokens < self.max_new_tokens // 2 < self.max_new_tokens - self.end_margin:
            raise ValueError(
                f"disconnect.Config: need 0 < early_tokens < max_new_tokens/2 < max_new_tokens - "
                f"end_margin, got {self.early_tokens}, {self.max_new_tokens}, {self.end_margin}"
            )
        if self.repetitions < 1 or self.at_once < 1:
            raise ValueError("disconnect.Config.repetitions and at_once must be >= 1")


def server_options(config: Config) -> dict[str, Any]:
    return {"model": config.model, **_settings(config, config.response_classes[0])}


def _settings(config: Config, response_class: str) -> dict[str, Any]:
    return {"max_batch": config.max_batch, "response_class": response_class, "policy": "unbounded"}


def units(config: Config) -> int:
    return len(config.response_classes) * len(config.moments) * -(-config.repetitions // config.at_once)


def leave_after(config: Config, moment: str) -> int:
    """Tokens a client reads before it leaves (0: as soon as the headers are in)."""
    return {
        "waiting": 0,
        "before_first": 0,
        "early": config.early_tokens,
        "mid": config.max_new_tokens // 2,
        "near_end": config.max_new_tokens - config.end_margin,
    }[moment]


def run(config: Config, *, server: Any = None, progress: Progress | None = None) -> dict[str, pd.DataFrame]:
    model = loaded_model(server, config.model)
    prompts = long_prompts(model, config.max_new_tokens)
    rows, checks, steps = [], [], []
    for kind in config.response_classes:
        with server_like(server, model, **_settings(config, kind)) as srv:
            before, first_step = books(srv.url), current_step(srv.url)
            for moment in config.moments:
                for first in range(0, config.repetitions, config.at_once):
                    reps = range(first, min(first + config.at_once, config.repetitions))
                    doing(
                        progress,
                        f"{kind}: leave {moment}, repetitions {reps.start + 1}-{reps.stop}/{config.repetitions}",
                    )
                    rows += run_sync(trial_group(srv, config, prompts, kind, moment, list(reps)))
                    tick(progress, trials=rows)
            checks.append({"response_class": kind, **release_books(srv.url, before), **server_checks(srv.url)})
            steps.append(fetch_steps(srv.url, since=first_step).assign(response_class=kind))
    trials = pd.DataFrame(rows)
    return {
        "trials": trials,
        "by_moment": by_moment(trials),
        "checks": pd.DataFrame(checks),
        "steps": pd.concat(steps, ignore_index=True),
    }


# --------------------------------------------------------------------------- one group of trials


async def trial_group(
    srv: Any, config: Config, prompts: list[int], kind: str, moment: str, reps: list[int]
) -> list[dict[str, Any]]:
    """FIN and RST clients for each repetition in ``reps``, at once; a row per client."""
    plan = [(rep, how) for rep in reps for how in config.leave_by]
    blockers = await _fill_batch(srv, config, prompts) if moment == "waiting" else []
    requests = bodies(prompts[len(blockers) :] or prompts, len(plan), config.max_new_tokens)
    clients = [
        raw_stream(
            srv.url,
            body,
            leave_after_tokens=leave_after(config, moment),
            leave_by=how,
            drain_after_fin_s=config.drain_after_fin_s,
            timeout=config.timeout,
        )
        for body, (_, how) in zip(requests, plan)
    ]
    results = await asyncio.gather(*clients)
    records = await released_records(srv.url, [r.request_id for r in results], timeout=config.timeout)
    await asyncio.gather(*blockers)
    return [trial_row(kind, moment, rep, how, r, rec) for (rep, how), r, rec in zip(plan, results, records)]


async def _fill_batch(srv: Any, config: Config, prompts: list[int]) -> list[asyncio.Task[StreamResult]]:
    """Start ``max_batch`` streams that read at once, and return when all of them are running
    (``GET /stats``), or have already ended."""
    requests = bodies(prompts, config.max_batch, config.blocker_tokens, ignore_eos=True)  # each holds its slot
    tasks = [asyncio.ensure_future(read_stream(srv.url, body, leave_after_s=config.timeout)) for body in requests]

    async def full(client: Any) -> bool:
        return (
            all(t.done() for t in tasks) or (await server_stats_async(client, srv.url))["running"] >= config.max_batch
        )

    try:
        async with lab_client() as client:
            await await_for(lambda: full(client), timeout=config.timeout, what="a full batch", interval=0.01)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    return tasks


def trial_row(kind: str, moment: str, rep: int, how: str, r: StreamResult, rec: Any) -> dict[str, Any]:
    """The client's view and the server's record of one stream, times in ms from the client's close."""
    left = r.left_at
    sampled = getattr(rec, "first_token_sampled", None)
    generated = getattr(rec, "tokens_generated", 0)

    def since_left(t: float | None) -> float:
        return np.nan if t is None or left is None else 1000 * (t - left)

    return {
        "response_class": kind,
        "moment": moment,
        "repetition": rep,
        "leave_by": how,
        "tokens_read": len(r.tokens),
        "tokens_generated": generated,
        "tokens_unread": generated - len(r.tokens),
        "admitted_before_leave": sampled is not None and left is not None and sampled <= left,
        "ever_admitted": sampled is not None,
        "close_to_release_ms": since_left(getattr(rec, "released", None)),
        "close_to_hub_close_ms": since_left(getattr(rec, "closed", None)),
        "hub_close_to_release_steps": _steps_between(rec),
        "engine_finish": getattr(rec, "finish_reason", None),
        "left": r.left is not None,
        "error": r.error,
    }


def _steps_between(rec: Any) -> float:
    """Engine steps from the hub's close to the release: 1 when the next step boundary let go;
    0 or less when the stream had ended by itself before the close."""
    at_close, released = getattr(rec, "steps_at_close", None), getattr(rec, "release_step", None)
    return np.nan if at_close is None or released is None else float(released - at_close)


# --------------------------------------------------------------------------- tables


def by_moment(trials: pd.DataFrame) -> pd.DataFrame:
    """Per response class, moment and way of leaving: close-to-release and unread tokens."""
    grouped = trials.groupby(["response_class", "moment", "leave_by"], sort=False)
    return grouped.agg(
        trials=("tokens_read", "size"),
        tokens_read_max=("tokens_read", "max"),
        hub_close_ms_median=("close_to_hub_close_ms", "median"),
        hub_close_ms_max=("close_to_hub_close_ms", "max"),
        release_ms_median=("close_to_release_ms", "median"),
        release_ms_max=("close_to_release_ms", "max"),
        release_steps_median=("hub_close_to_release_steps", "median"),
        release_steps_max=("hub_close_to_release_steps", "max"),
        unread_median=("tokens_unread", "median"),
        unread_max=("tokens_unread", "max"),
        admitted_before_leave=("admitted_before_leave", "sum"),
        ever_admitted=("ever_admitted", "sum"),
    ).reset_index()


def summary(tables: dict[str, pd.DataFrame]) -> dict[str, Any]:
    trials = tables["trials"]
    out: dict[str, Any] = {}
    for kind, group in trials.groupby("response_class"):
        out[kind] = {
            "release_ms_max": float(group.close_to_release_ms.max()),
            "release_ms_median": float(group.close_to_release_ms.median()),
            "unread_max": int(group.tokens_unread.max()),
            "waiting_ever_admitted": int(group[group.moment == "waiting"].ever_admitted.sum()),
        }
    return out


def beside_chapter(tables: dict[str, pd.DataFrame]) -> pd.DataFrame:
    trials = tables["trials"]
    listen, write = trials[trials.response_class == "starlette"], trials[trials.response_class == "write_only"]
    abandoned = write[write.moment != "waiting"]
    fin_rst = listen.groupby("leave_by").close_to_release_ms.median()
    return beside(
        [
            (
                "Starlette's class: largest close-to-release",
                figure("disconnect", "listen_release_max_ms"),
                low_high([listen.close_to_release_ms.max()], "{:.1f}"),
                "ms",
            ),
            (
                "Starlette's class: tokens generated that nobody read",
                figure("disconnect", "listen_unread"),
                low_high(listen.tokens_unread, "{:.0f}"),
                "tokens",
            ),
            (
                "Starlette's class: waiting streams ever admitted",
                figure("disconnect", "listen_waiting_admitted"),
                f"{int(listen[listen.moment == 'waiting'].ever_admitted.sum())} of {int((listen.moment == 'waiting').sum())}",
                "streams",
            ),
            (
                "Starlette's class: median release, FIN / RST",
                figure("disconnect", "listen_fin_rst"),
                " / ".join(f"{fin_rst.get(k, float('nan')):.1f}" for k in ("fin", "rst")),
                "ms",
            ),
            (
                "write-only: abandoned sequences run to their limit",
                figure("disconnect", "write_to_limit"),
                f"{int((write.engine_finish == 'length').sum())} of {len(write)} (limit {int(write.tokens_generated.max())})",
                "streams",
            ),
            (
                "write-only: tokens the clients had read",
                figure("disconnect", "write_tokens_read"),
                low_high(abandoned.tokens_read, "{:.0f}"),
                "tokens",
            ),
        ]
    )


def findings(tables: dict[str, pd.DataFrame]) -> str:
    """A few plain sentences from this run's numbers."""
    trials = tables["trials"]
    said = []
    listen = trials[trials.response_class == "starlette"]
    if len(listen):
        waiting = listen[listen.moment == "waiting"]
        said.append(
            f"With Starlette's class the hub closed a departed client's stream "
            f"{span(listen.close_to_hub_close_ms, '{:.1f}', ' ms')} after the client's close "
            f"(median, min–max over {len(listen)} trials), and the engine released it "
            f"{span(listen.close_to_release_ms, '{:.0f}', ' ms')} after the close, with at most "
            f"{int(listen.tokens_unread.max())} token(s) generated that nobody read; "
            f"{int(waiting.ever_admitted.sum())} of {len(waiting)} requests left while waiting were ever admitted."
        )
        said.append(_waiting_in_steps(waiting, tables.get("steps")))
        said.append(_fin_rst_before_first(listen))
    write = trials[trials.response_class == "write_only"]
    if len(write):
        said.append(
            f"With the write-only class {int((write.engine_finish == 'length').sum())} of {len(write)} "
            f"abandoned streams ran to their limit of {int(write.tokens_generated.max())} tokens, released "
            f"{span(write.close_to_release_ms / 1000, '{:.1f}', ' s')} after their clients had gone."
        )
    return " ".join(x for x in said if x)


def _waiting_in_steps(waiting: pd.DataFrame, steps: pd.DataFrame | None) -> str:
    """Close → release of a request that left while it waited, told in steps and step durations."""
    if waiting.empty or waiting.hub_close_to_release_steps.isna().all():
        return ""
    text = (
        f"A request that left while waiting was released {span(waiting.hub_close_to_release_steps, '{:.0f}')} "
        f"step(s) after the hub's close (the engine applies a cancel at its next step boundary)"
    )
    if steps is not None and len(steps) and waiting.hub_close_to_release_steps.max() <= 1:
        mine = steps[steps.response_class == "starlette"] if "response_class" in steps else steps
        text += (
            f"; this server's steps lasted {span(mine.seconds * 1000, '{:.0f}', ' ms')}, so its "
            f"{span(waiting.close_to_release_ms, '{:.0f}', ' ms')} from close to release is "
            f"{span(waiting.close_to_hub_close_ms, '{:.0f}', ' ms')} for the server to notice plus the step "
            f"then running"
        )
    return text + "."


def fin_rst_admitted(trials: pd.DataFrame) -> pd.DataFrame:
    """Starlette's class, clients that left before their first token: admitted per way of leaving."""
    early = trials[(trials.response_class == "starlette") & (trials.moment == "before_first")]
    return (
        early.groupby("leave_by")
        .agg(
            trials=("ever_admitted", "size"),
            ever_admitted=("ever_admitted", "sum"),
            tokens_generated_max=("tokens_generated", "max"),
            hub_close_ms_median=("close_to_hub_close_ms", "median"),
        )
        .reset_index()
    )


def _fin_rst_before_first(listen: pd.DataFrame) -> str:
    table = fin_rst_admitted(listen)
    if len(table) < 2:
        return ""
    counts = {r.leave_by: (int(r.ever_admitted), int(r.trials)) for r in table.itertuples()}
    (fa, fn), (ra, rn) = counts.get("fin", (0, 0)), counts.get("rst", (0, 0))
    same = fa * rn == ra * fn
    verdict = "the same share" if same else "a different share"
    return (
        f"Clients that left before their first token: {fa} of {fn} leaving by FIN and {ra} of {rn} leaving by RST "
        f"were admitted (prefilled) anyway, {verdict} in this run."
    )


def verdicts(tables: dict[str, pd.DataFrame]) -> list[Verdict]:
    """The hypotheses of the disconnect half of notebook 06, judged against their criteria."""
    trials = tables["trials"]
    listen = trials[trials.response_class == "starlette"]
    write = trials[trials.response_class == "write_only"]
    waiting = listen[listen.moment == "waiting"]
    gone = listen.dropna(subset=["hub_close_to_release_steps"])
    late = gone[gone.hub_close_to_release_steps > 2]
    short = write[write.engine_finish != "length"]
    fr = fin_rst_admitted(trials).set_index("leave_by")
    share = (fr.ever_admitted / fr.trials).to_dict() if len(fr) else {}
    return [
        Verdict(
            "listening_releases_within_two_steps",
            "with Starlette's class the engine lets go of a departed client's stream within 2 steps of the hub's close",
            "any Starlette trial released more than 2 steps after the hub's close",
            bool(len(gone)) and late.empty,
            f"{len(late)} of {len(gone)} trials later than 2 steps; steps: "
            + span(gone.hub_close_to_release_steps, "{:.0f}"),
        ),
        Verdict(
            "waiting_never_admitted",
            "a request whose client left while it waited is never admitted (Starlette's class)",
            "any such request gets a slot",
            bool(len(waiting)) and not waiting.ever_admitted.any(),
            f"{int(waiting.ever_admitted.sum())} of {len(waiting)} admitted",
        ),
        Verdict(
            "write_only_runs_to_limit",
            "with the write-only class every abandoned stream is generated to its limit",
            "any write-only stream ends before max_new_tokens",
            bool(len(write)) and short.empty,
            f"{len(short)} of {len(write)} ended early",
        ),
        Verdict(
            "fin_rst_alike_before_first",
            "how a client closes (FIN or RST) before its first token does not change whether its request is admitted",
            "the admitted shares of FIN and RST clients differ in the same run",
            len(share) == 2 and share.get("fin") == share.get("rst"),
            "; ".join(f"{k.upper()}: {int(fr.ever_admitted[k])} of {int(fr.trials[k])} admitted" for k in fr.index),
        ),
    ]


CHECKED = ("listening_releases_within_two_steps", "waiting_never_admitted", "write_only_runs_to_limit")


def report(tables: dict[str, pd.DataFrame]) -> str:
    """Stable lines for a checked cell: the invariants, not the timings."""
    lines = []
    for _, row in tables["checks"].iterrows():
        whole = "cache whole" if row.cache_whole else "CACHE NOT WHOLE"
        once = "each stream finished once" if row.finished == row.submitted else "FINISHES != STREAMS"
        released = "one release per admitted stream" if row.releases == row.admitted else "RELEASES != ADMITTED"
        lines.append(
            f"{row.response_class}: {whole}; {once}; {released}; {row.open_streams} streams open, "
            f"{row.running} running, {row.waiting} waiting"
        )
    return "\n".join(lines + _behaviour(tables["trials"]))


def _behaviour(trials: pd.DataFrame) -> list[str]:
    """What each response class must do, on any machine: the listener never admits a request whose
    client left while it waited; the write-only class generates every stream to its limit."""
    listening, writing = (trials[trials.response_class == kind] for kind in CLASSES)
    waited = listening[listening.moment == "waiting"]
    lines = []
    if len(waited):
        lines.append(
            "starlette: a client that left while waiting was never admitted: "
            + ("yes" if not waited.ever_admitted.any() else f"NOT ({int(waited.ever_admitted.sum())} were)")
        )
    if len(writing):
        short = int((writing.engine_finish != "length").sum())
        lines.append(
            "write_only: every stream generated to its limit after its client left: "
            + ("yes" if short == 0 else f"NOT ({short} ended early)")
        )
    return lines


def plot(tables: dict[str, pd.DataFrame]) -> list:
    figures = [_plot_release(tables["trials"]), _plot_unread(tables["trials"])]
    if {"close_to_hub_close_ms", "hub_close_to_release_steps"} <= set(tables["trials"].columns):
        figures.insert(1, _plot_notice(tables["trials"]))
    return figures


def _plot_notice(trials: pd.DataFrame):
    """The best evidence: how soon after the client's close the server closed the stream (every
    trial, per class and way of leaving); and the steps from that close to the release."""
    from labkit.plots import new_figure

    fig, (left, right) = new_figure("disconnect_notice", ncols=2)
    for (kind, how), part in trials.groupby(["response_class", "leave_by"], sort=False):
        ms = np.sort(part.close_to_hub_close_ms.dropna().clip(lower=0.01).to_numpy())
        if len(ms):
            left.step(
                ms, np.arange(1, len(ms) + 1) / len(ms), where="post", label=f"{kind.replace('_', '-')}, {how.upper()}"
            )
    left.set(
        xscale="log",
        xlabel="ms from the client's close to the hub's close",
        ylabel="share of trials",
        title="When the server noticed",
    )
    left.legend(fontsize="small")
    listen = trials[trials.response_class == "starlette"].dropna(subset=["hub_close_to_release_steps"])
    for offset, (how, part) in zip((-0.12, 0.12), listen.groupby("leave_by", sort=False)):
        xs = [MOMENTS.index(m) + offset for m in part.moment]
        right.scatter(xs, part.hub_close_to_release_steps, s=14, alpha=0.7, label=how.upper())
    right.axhline(1, color="gray", lw=0.8, ls=":")
    if len(listen):
        low, high = listen.hub_close_to_release_steps.min(), listen.hub_close_to_release_steps.max()
        right.set_ylim(min(0, low) - 0.5, max(2, high) + 0.5)
    right.set(
        xticks=range(len(MOMENTS)),
        ylabel="engine steps from the hub's close to the release",
        title="Starlette's class: release in steps",
    )
    right.set_xticklabels([m.replace("_", " ") for m in MOMENTS], rotation=20)
    right.legend(fontsize="small")
    return fig


def _plot_release(trials: pd.DataFrame):
    from labkit.plots import new_figure

    fig, axes = new_figure("disconnect_release", ncols=2)
    for ax, (kind, group) in zip(axes, trials.groupby("response_class", sort=False)):
        for offset, (how, part) in zip((-0.12, 0.12), group.groupby("leave_by", sort=False)):
            xs = [MOMENTS.index(m) + offset for m in part.moment]
            ax.scatter(xs, part.close_to_release_ms.clip(lower=0.1), s=14, label=how.upper())
        ax.set(
            yscale="log",
            xticks=range(len(MOMENTS)),
            title=kind.replace("_", "-"),
            ylabel="ms from the client's close to the release",
        )
        ax.set_ylim(0.5 * trials.close_to_release_ms.clip(lower=0.1).min(), 2 * trials.close_to_release_ms.max())
        ax.set_xticklabels([m.replace("_", " ") for m in MOMENTS], rotation=20)
        ax.legend()
    return fig


def _plot_unread(trials: pd.DataFrame):
    from labkit.plots import new_figure

    fig, (ax,) = new_figure("disconnect_unread")
    table = trials.groupby(["moment", "response_class"]).tokens_unread.mean().unstack().reindex(MOMENTS)
    table.plot.bar(ax=ax, rot=20)
    ax.set(xlabel="", ylabel="tokens generated that nobody read (mean)", title="Work done for a client that had gone")
    return fig
