"""Notebook 07, exercise 8: reading the blocks through the table instead of gathering them.

The paged decode's default path used to copy every row's K and V blocks into one contiguous
tensor per layer and step (the gather), then run batched matmuls over the copy. The paged kernel
(``labkit/engine/kernels/paged_decode.cpp``) reads the blocks in place through the block tables.
This module measures both on one runner (same weights, pool and scattered tables; see
``labkit.bench_attention``): decode attention alone and the whole decode step, per context and
batch, the two modes and every cell interleaved over the repetitions. It also checks that the
kernel changes no token: greedy streams in both modes, and a row's logits alone against the same
row in a batch (on the same runner, before the timings).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import pandas as pd
import torch

from labkit.bench_attention import AttentionBench, bench_runner, kernel_status, measure_attention, summarize
from labkit.engine.attention import AttentionChoice
from labkit.engine.runner import ModelRunner
from labkit.experiments.profiles import Profile
from labkit.experiments.progress import Progress, doing, tick
from labkit.experiments.readings import Verdict, span
from labkit.experiments.servers import loaded_model
from labkit.prompts import PROMPTS

NAME = "paged"
BIG = 32  # the batch the hypothesis is about
_SOLO_LENGTHS = [1, 17, 63, 64, 65, 100, 130, 200]  # cached tokens of the solo-vs-batched rows


@dataclass(frozen=True)
class Config:
    model: str = "smollm2-135m"
    batches: tuple[int, ...] = (1, BIG)
    contexts: tuple[int, ...] = (64, 256, 512)
    repetitions: int = 3
    steps: int = 2  # timed calls per measurement, after one warm-up
    identity_streams: int = 4
    identity_tokens: int = 8

    @classmethod
    def for_profile(cls, profile: Profile) -> Config:
        if profile.full:
            return cls(model=profile.model)
        # the tiny GPT-2 has 512 positions: the longest context leaves room for the new token
        return cls(model=profile.model, contexts=(64, 256, 448), steps=3)


def units(config: Config) -> int:
    return config.repetitions * len(config.contexts) * len(config.batches) * 2 + 1


def run(config: Config, *, server: Any = None, progress: Progress | None = None) -> dict[str, pd.DataFrame]:
    """``samples`` (one row per measurement), ``summary`` (per context and batch: medians,
    min–max, n, kernel / gather), ``identity`` (kernel against gather, solo against batched) and
    ``kernel`` (whether it ran here, and why). No server is needed: it drives a runner directly
    (a ``server`` given only lends its model)."""
    loaded = loaded_model(server, config.model)
    status = kernel_status()
    rows: list[dict[str, Any]] = []

    def kept(row: dict[str, Any]) -> None:
        rows.append(row)
        doing(progress, f"context {row['context']}, batch {row['batch']}, {row['mode']}, rep {row['rep']}")
        tick(progress, samples=rows)

    bench = AttentionBench(
        model=config.model,
        batches=config.batches,
        contexts=config.contexts,
        reps=config.repetitions,
        steps=config.steps,
    )
    prompts = [list(loaded.tokenizer.encode(PROMPTS[i % len(PROMPTS)])) for i in range(config.identity_streams)]
    per = -(-(max(map(len, prompts)) + config.identity_tokens) // bench.block_size)
    # one runner (its start-up probe is slow) for everything below, with room for the identity checks
    solo = len(_SOLO_LENGTHS) * -(-(max(_SOLO_LENGTHS) + 1) // bench.block_size)
    runner = bench_runner(bench, loaded, min_blocks=max(per * len(prompts), solo))
    doing(progress, "identity: kernel against gather, solo against batched")
    identity = _identity(runner, prompts, config) if status.mode == "kernel" else pd.DataFrame()
    tick(progress)
    samples = measure_attention(bench, progress=kept, runner=runner)
    return {
        "samples": samples,
        "summary": summarize(samples),
        "identity": identity,
        "kernel": pd.DataFrame([{"mode": status.mode, "reason": status.reason}]),
    }


@torch.inference_mode()
def _identity(runner: ModelRunner, prompts: list[list[int]], config: Config) -> pd.DataFrame:
    """Greedy streams with each attention, and one row's decode logits alone against the same
    row among neighbours of other lengths, with the kernel (the runner's pool is scratch here)."""
    rng = random.Random(0)
    bs, blocks = runner.block_size, runner.pool.num_blocks
    per = -(-(max(map(len, prompts)) + config.identity_tokens) // bs)
    ids = rng.sample(range(blocks), per * len(prompts))
    tables = [ids[i * per : (i + 1) * per] for i in range(len(prompts))]
    streams = {}
    for mode in ("kernel", "gather"):
        runner.attention = AttentionChoice(mode, "identity check")
        streams[mode] = _greedy(runner, prompts, tables, config.identity_tokens)
    same = sum(a == b for a, b in zip(streams["kernel"], streams["gather"]))
    runner.attention = AttentionChoice("kernel", "identity check")
    solo_same, batches = _solo_vs_batched(runner, rng)
    return pd.DataFrame(
        [
            {
                "comparison": "greedy streams, kernel vs gather",
                "cases": len(prompts),
                "identical": same,
                "tokens": sum(map(len, streams["kernel"])),
            },
            {
                "comparison": "decode logits, solo vs batched (kernel)",
                "cases": batches,
                "identical": solo_same,
                "tokens": batches,
            },
        ]
    )


def _greedy(runner: ModelRunner, prompts: list[list[int]], tables: list[list[int]], tokens: int) -> list[list[int]]:
    """Greedy continuations of every prompt, decoded together (no eos stop: same length each)."""
    out = [[int(runner.prefill(p, t).argmax())] for p, t in zip(prompts, tables)]
    for _ in range(tokens - 1):
        positions = [len(p) + len(o) - 1 for p, o in zip(prompts, out)]
        logits = runner.decode([o[-1] for o in out], positions, tables)
        for o, row in zip(out, logits):
            o.append(int(row.argmax()))
    return out


def _solo_vs_batched(runner: ModelRunner, rng: random.Random) -> tuple[int, int]:
    """(batches in which a target row's logits equal its solo ones bitwise, batches tried), every
    row a target in turn, so that every length (one block, a block boundary, many) is checked."""
    lengths = _SOLO_LENGTHS
    per = -(-(max(lengths) + 1) // runner.block_size)
    ids = rng.sample(range(runner.pool.num_blocks), per * len(lengths))
    tables = [ids[i * per : (i + 1) * per] for i in range(len(lengths))]
    nexts = [
        int(runner.prefill([rng.randrange(50, 1000) for _ in range(n)], t).argmax()) for n, t in zip(lengths, tables)
    ]
    same, tried, sizes = 0, 0, (2, 5, 8)
    for target in range(len(lengths)):
        solo = runner.decode([nexts[target]], [lengths[target]], [tables[target]])[0]
        others = [r for r in range(len(lengths)) if r != target]
        for size in sizes:
            rows = [target] + rng.sample(others, min(size - 1, len(others)))
            rng.shuffle(rows)
            out = runner.decode([nexts[r] for r in rows], [lengths[r] for r in rows], [tables[r] for r in rows])
            same += bool(torch.equal(out[rows.index(target)], solo))
            tried += 1
    return same, tried


def report(tables: dict[str, pd.DataFrame]) -> str:
    """Stable lines for a checked cell: the kernel changes no token and no bit of a row's logits."""
    kernel = tables["kernel"].iloc[0]
    if kernel["mode"] != "kernel":
        return f"the paged kernel did not run here: {kernel['reason']}"
    lines = []
    for row in tables["identity"].itertuples(index=False):
        word = "identical" if row.identical == row.cases else f"DIFFERENT in {row.cases - row.identical} of {row.cases}"
        lines.append(f"{row.comparison}: {word}")
    return "\n".join(lines)


def _big(tables: dict[str, pd.DataFrame]) -> pd.DataFrame:
    summary = tables["summary"]
    return summary[summary.batch == summary.batch.max()].sort_values("context")


def verdicts(tables: dict[str, pd.DataFrame]) -> list[Verdict]:
    big = _big(tables)
    batch = int(big.batch.iloc[0]) if len(big) else BIG
    ran = tables["kernel"].iloc[0]["mode"] == "kernel"
    out = []
    for what, name, claim in (
        ("step", "kernel_step_is_cheaper", f"At {batch} sequences the whole decode step costs less with the kernel."),
        (
            "attention",
            "kernel_attention_is_cheaper",
            f"At {batch} sequences decode attention costs less with the kernel.",
        ),
    ):
        ratios = big[f"{what}_kernel/gather"]
        holds = ran and bool((big[f"{what}_kernel_ms_median"] < big[f"{what}_gather_ms_median"]).all())
        evidence = (
            ", ".join(f"context {c}: kernel/gather {r:.2f}" for c, r in zip(big.context, ratios))
            if ran
            else f"kernel unavailable: {tables['kernel'].iloc[0]['reason']}"
        )
        out.append(
            Verdict(
                name,
                claim,
                f"at any context measured, the kernel's median {what} time over the repetitions is not lower "
                "than the gather's",
                holds,
                evidence,
            )
        )
    return out


def checked(tables: dict[str, pd.DataFrame]) -> list[Verdict]:
    """None yet: a timing verdict is checked only once it holds under both profiles (the ci
    model's layers are so small that the step there is mostly overhead)."""
    return []


def findings(tables: dict[str, pd.DataFrame]) -> str:
    """Plain sentences from this run's numbers (printed, never typed)."""
    samples = tables["samples"]
    said = []
    for ctx in sorted(samples.context.unique()):
        cell = samples[(samples.context == ctx) & (samples.batch == samples.batch.max())]
        gather, kernel = cell[cell["mode"] == "gather"], cell[cell["mode"] == "kernel"]
        if not len(kernel):
            continue
        said.append(
            f"Context {ctx}, {int(cell.batch.iloc[0])} sequences: the step took {span(gather.step_ms, '{:.1f}', ' ms')} "
            f"with the gather (which copied {gather.copied_MiB.median():.1f} MiB per step) and "
            f"{span(kernel.step_ms, '{:.1f}', ' ms')} with the kernel; attention alone "
            f"{span(gather.attention_ms, '{:.1f}', ' ms')} against {span(kernel.attention_ms, '{:.1f}', ' ms')} "
            f"(n = {cell.rep.nunique()} repetitions each)."
        )
    return "\n\n".join(said) or "The kernel did not run here: only the gather was measured."


def summary(tables: dict[str, pd.DataFrame]) -> dict[str, Any]:
    s = tables["summary"]
    return {
        "kernel": tables["kernel"].iloc[0].to_dict(),
        "step_kernel/gather": {
            f"B{b} ctx{c}": float(r) for b, c, r in zip(s.batch, s.context, s["step_kernel/gather"])
        },
        "attention_kernel/gather": {
            f"B{b} ctx{c}": float(r) for b, c, r in zip(s.batch, s.context, s["attention_kernel/gather"])
        },
        "verdicts": {v.name: v.holds for v in verdicts(tables)},
    }


def plot(tables: dict[str, pd.DataFrame]) -> list:
    from labkit.plots import new_figure

    samples = tables["samples"]
    fig, axes = new_figure("paged_step_vs_context", ncols=2)
    for ax, what, title in zip(axes, ("attention", "step"), ("decode attention, all layers", "whole decode step")):
        for (mode, batch), group in samples.groupby(["mode", "batch"]):
            stats = group.groupby("context")[f"{what}_ms"].agg(["median", "min", "max"])
            ax.errorbar(
                stats.index,
                stats["median"],
                yerr=[stats["median"] - stats["min"], stats["max"] - stats["median"]],
                marker="o" if mode == "kernel" else "s",
                linestyle="-" if batch == samples.batch.max() else ":",
                capsize=3,
                label=f"{mode}, {batch} seq",
            )
        ax.set_xlabel("context (tokens cached per sequence)")
        ax.set_ylabel("ms per step (median, min–max)")
        ax.set_title(title)
        ax.legend(fontsize="small")
    return [fig]
