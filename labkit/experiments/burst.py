"""Notebook 09's burst: a long prompt arrives while streams decode. Do the running streams stall?

:data:`BURST`: ``streams`` streams of ``tokens`` tokens decode; once every one of them has made
``arrive_after`` tokens (the moment is counted in their tokens, never in seconds) a prompt of about
``prompt_tokens`` tokens arrives. The running streams' gaps are sorted by what the client saw:
*before* the long prompt was sent (once every stream had its first token), *during* (a gap that
overlaps the span from its send to its first token) and *after*. Where the server has labkit's lab
routes, its step log says the same from its side: the steps that prefilled the long prompt
(between its submission and its first token sampled) and how long they took against the steps
before. Each server of a :class:`~labkit.experiments.lineup.Lineup` (labkit at its default budget
and unchunked, llama.cpp, transformers serve) takes its turn, round by round, after one burst of
its own as a warm-up that is not kept.
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any

import numpy as np
import pandas as pd

from labkit.experiments.lineup import LABKIT, LLAMA, TRANSFORMERS, UNCHUNKED, Lineup, as_lineup
from labkit.experiments.peers import budget_settings
from labkit.lab import Experiment, ReadOptions, Sizes, Stream, Target, Trial, interval, judge, span, spread, tell
from labkit.lab.client import async_client, percentile, run_sync
from labkit.lab.witness import WaitTimeout, until
from labkit.prompts import PROMPTS, cycle

SMOOTH = 3.0  # the running streams' largest gap over their median gap before the arrival, at most


@functools.cache
def long_prompt(tokens: int) -> str:
    """The fixed prompts run together (again from the first, as often as needed), cut to
    ``tokens`` tokens of SmolLM2's tokenizer (the tiny Llama's too) and decoded: the same text
    for every server, whose own count of it each server reports in its usage."""
    from labkit.models.tokenizers import smollm2_tokenizer

    tokenizer = smollm2_tokenizer()
    ids: list[int] = []
    while len(ids) < tokens:
        ids += list(tokenizer.encode(" " + " ".join(PROMPTS)))
    return str(tokenizer.decode(ids[:tokens])).strip()


def conditions(s: Sizes, target: Target) -> list[dict[str, Any]]:
    """The lineup's servers that ``servers`` names (a missing one: a "not measurable" row); a
    labkit in this process: the labkits it names, each started with its budget; any other alone."""
    if isinstance(target, Lineup):
        return [{"server": n} for n in s.servers]
    names = [n for n in s.servers if n.startswith(LABKIT)] if target.caps.settings else as_lineup(target).servers
    return [{"server": n} for n in names]


async def _burst(server: Target, s: Sizes) -> tuple[list[Stream], Stream | None, int]:
    """The running streams, the long prompt's stream (None if they never reached the arrival
    tokens), and the fewest tokens any running stream had made when it was sent."""
    running = [Stream(api=server.api) for _ in range(s.streams)]
    options = ReadOptions(timeout=s.timeout)
    async with async_client(server.url, s.streams + 1, s.timeout) as client:
        tasks = [asyncio.ensure_future(server.stream(server.request(p, s.tokens), options, client=client, result=r))
                 for p, r in zip(cycle(s.streams), running)]  # fmt: skip
        long, arrived = None, 0
        try:
            await until(lambda: all(len(r.token_times) >= s.arrive_after or r.ended for r in running),
                        timeout=s.timeout, what="the running streams' arrival tokens")  # fmt: skip
            arrived = min(len(r.token_times) for r in running)
            request = server.request(long_prompt(s.prompt_tokens), s.long_tokens)
            long = await server.stream(request, options, client=client)
        except WaitTimeout:
            pass
        finally:
            await asyncio.gather(*tasks)
    return running, long, arrived


def measure(trial: Trial) -> dict[str, Any]:
    """One burst; in the first round a server first runs one burst it does not keep: the lineup's
    warm-up never sent a long prompt, and a server's first one is slower (buffers that size are
    new), so round one's largest gap would measure that, not the budget."""
    s, server = trial.sizes, as_lineup(trial.target).server(trial.server)
    if trial.repetition == 0:
        run_sync(_burst(server, s))
    since = server.current_step() if server.caps.lab else None
    running, long, arrived = run_sync(_burst(server, s))
    whole = sum(r.ok and r.tokens == s.tokens for r in running) + int(bool(long and long.ok))
    row: dict[str, Any] = {"arrived_at_tokens": arrived, "whole": whole, "streams": s.streams + 1}
    if long is None or not long.token_times:
        return row
    sent, first = long.sent, long.token_times[0]
    steady = max(r.token_times[0] for r in running if r.token_times)
    pairs = [(a, b) for r in running for a, b in zip(r.token_times, r.token_times[1:])]
    before = [b - a for a, b in pairs if a >= steady and b <= sent]
    during = [b - a for a, b in pairs if b > sent and a < first]
    largest = max((b - a for a, b in pairs if b > sent), default=np.nan)
    row.update(prompt_tokens=(long.usage or {}).get("prompt_tokens"), long_ttft_s=first - sent,
               during_tokens=float(np.median([sum(sent < t <= first for t in r.token_times) for r in running])),
               gap_before_p50_s=percentile(before, 50), gap_during_p50_s=percentile(during, 50),
               gap_during_max_s=max(during, default=np.nan), largest_s=largest,
               gap_after_p50_s=percentile([b - a for a, b in pairs if a >= first], 50))  # fmt: skip
    # a median gap of 0: most events before the arrival came in reads of several (a fast engine, a
    # busy client); the ratio is then undefined, not infinite, and the verdict leaves the round out
    median = row["gap_before_p50_s"]
    row["largest_over_median"] = largest / median if median > 0 else np.nan
    trial.keep("by_token", by_token(running, sent))
    if since is not None:
        row.update(step_view(server, long, since, steady))
    return row


def by_token(running: list[Stream], sent: float) -> list[dict[str, Any]]:
    """Per token of the running streams: when it came (median over the streams, from the long
    prompt's send) and the largest and median gap before it."""
    n = min(len(r.token_times) for r in running)
    times = np.array([r.token_times[:n] for r in running])
    gaps = np.diff(times, axis=1)
    return [{"token": i + 1, "since_send_s": float(np.median(times[:, i + 1]) - sent),
             "gap_max_s": float(gaps[:, i].max()), "gap_p50_s": float(np.median(gaps[:, i]))}
            for i in range(n - 1)]  # fmt: skip


def step_view(server: Target, long: Stream, since: int, steady: float) -> dict[str, Any]:
    """From the server's books: the steps that ran the long prompt's chunks (those that overlap
    its submission → first token and prefilled), their longest, and the median step before."""
    record = server.records([long.request_id])[0]
    if not record or record["first_token_sampled"] is None:
        return {}
    steps = server.steps(since)
    lo, hi = record["submitted"], record["first_token_sampled"]
    window = steps[(steps.started <= hi) & (steps.started + steps.seconds >= lo) & (steps.prefill_tokens > 0)]
    calm = steps[(steps.started >= steady) & (steps.started + steps.seconds <= lo)]
    return {"prefill_steps": len(window), "server_during_s": hi - lo, "step_max_during_s": window.seconds.max(),
            "step_p50_before_s": calm.seconds.median()}  # fmt: skip


COLUMNS = ["arrived_at_tokens", "prompt_tokens", "long_ttft_s", "during_tokens", "gap_before_p50_s",
           "gap_during_p50_s", "gap_during_max_s", "gap_after_p50_s", "largest_over_median", "prefill_steps",
           "step_p50_before_s", "step_max_during_s"]  # fmt: skip


def tables(t: dict[str, pd.DataFrame], s: Sizes) -> dict[str, pd.DataFrame]:
    rows = t["rows"]
    return {"burst": spread(rows, "server", [c for c in COLUMNS if c in rows])}


def verdicts(t: dict[str, pd.DataFrame], s: Sizes) -> list:
    rows = t["rows"]
    steps = rows.get("prefill_steps", pd.Series(np.nan, index=rows.index))
    chunked, unchunked = (steps[rows.server == n].dropna() for n in (LABKIT, UNCHUNKED))
    ours = rows[rows.server == LABKIT].dropna(subset=["largest_s"]) if "largest_s" in rows else rows.iloc[:0]
    smooth, evidence = tell(interval(ours.largest_s.to_numpy(), others=ours.gap_before_p50_s.to_numpy()), SMOOTH,
                            "below") if len(ours) else (None, "labkit: not measured")  # fmt: skip
    return [
        judge("every burst stream whole", "every running stream and every long prompt ends with its own end, at the "
              "length asked for", "any failed or came short", bool((rows.whole == rows.streams).all()),
              ", ".join(f"{n}: {int(g.whole.sum())}/{int(g.streams.sum())}" for n, g in rows.groupby("server")),
              checked=True),
        judge("chunked: the long prompt over several steps", "at labkit's default budget the long prompt is "
              "prefilled in more than one step (the step log)", "any round prefilled it in one step",
              bool((chunked >= 2).all()) if len(chunked) else None, f"prefill steps {span(chunked, '{:.0f}')}",
              checked=True),
        judge("unchunked: in one step", "unchunked labkit prefills the long prompt in one step",
              "any round took more or fewer", bool((unchunked == 1).all()) if len(unchunked) else None,
              f"prefill steps {span(unchunked, '{:.0f}')}", checked=True),
        judge("smooth at the default budget", f"at labkit's default budget the running streams' largest gap from the "
              f"arrival on is at most {SMOOTH:g}× their median gap before it", f"the 95% interval of the ratio lies "
              f"above {SMOOTH:g}", smooth, f"largest/median gap {evidence}"),
    ]  # fmt: skip


def plots(t: dict[str, pd.DataFrame], s: Sizes) -> list:
    from labkit.plots import new_figure

    rows, tokens = t["rows"], t.get("by_token", pd.DataFrame())
    servers = list(dict.fromkeys(rows.server))
    fig, axes = new_figure("peers_burst", ncols=len(servers), width=3.6 * len(servers) + 1)
    for ax, name in zip(axes, servers):
        for rep, g in tokens[tokens.server == name].groupby("repetition") if len(tokens) else ():
            ax.plot(1e3 * g.since_send_s, 1e3 * g.gap_max_s, ".-", lw=0.8, ms=3, label=f"round {rep + 1}")
        ttft = rows[rows.server == name].get("long_ttft_s", pd.Series(dtype=float)).median()
        if ttft == ttft:
            ax.axvspan(0, 1e3 * ttft, color="C3", alpha=0.12, label="send → its first token")
        ax.axvline(0, color="C3", lw=0.8)
        ax.set(title=name, xlabel="ms since the long prompt was sent", ylabel="largest gap over the streams (ms)")
        ax.set_yscale("log")
    low, high = min(ax.get_ylim()[0] for ax in axes), max(ax.get_ylim()[1] for ax in axes)
    for ax in axes:
        ax.set_ylim(low, high)  # one scale for every server, so the panels compare
    axes[0].legend(fontsize="x-small")
    return [fig]


BURST = Experiment(
    name="burst.arrival",
    title="A long prompt arrives among decoding streams: their gaps before, during and after",
    sizes={"full": {"servers": (LABKIT, UNCHUNKED, LLAMA, TRANSFORMERS), "streams": 31, "tokens": 48,
                    "arrive_after": 8, "prompt_tokens": 1000, "long_tokens": 4, "timeout": 300.0, "repetitions": 6},
           "ci": {"servers": (LABKIT, UNCHUNKED, LLAMA, TRANSFORMERS), "streams": 7, "tokens": 24,
                  "arrive_after": 4, "prompt_tokens": 200, "long_tokens": 4, "timeout": 120.0, "repetitions": 3}},
    conditions=conditions,
    server=budget_settings,
    measure=measure,
    tables=tables,
    verdicts=verdicts,
    plots=plots,
    alternate=True,
)  # fmt: skip

SPECS = (BURST,)
