"""``labkit bench attention``: what the paged decode's gather costs, and what reading the blocks
through the table instead buys, as context and batch grow.

Two attention modes on one runner (same weights, same pool, same scattered block tables):
``gather`` copies each row's K and V blocks into one contiguous tensor per layer and step, then
runs batched matmuls; ``kernel`` reads the pool in place (``engine/kernels/paged_decode.cpp``).
For every (context, batch) it times decode attention alone (the step's plan and every layer's
attention, random queries) and the whole decode step (``ModelRunner.decode``: every layer's
matmuls, attention, the lm head), each as the median of ``steps`` calls after ``warmup``. The
modes and cells are interleaved (gather, kernel, gather, kernel, ...) over ``reps`` repetitions,
all in one run; the table shows the median of the repetitions with their min and max.

The pool holds random keys and values (the step's cost does not depend on what they are), so no
prompt needs prefilling: every cell starts at once, at its context.
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd
import torch

from labkit.bench import median_ms
from labkit.engine.attention import AttentionChoice, choose_attention, decode_attention
from labkit.engine.runner import ModelRunner
from labkit.models import LoadedModel, load_model

MODES = ("gather", "kernel")


@dataclass(frozen=True)
class AttentionBench:
    model: str = "smollm2-135m"
    batches: tuple[int, ...] = (1, 8, 32)
    contexts: tuple[int, ...] = (64, 256, 512)
    reps: int = 3  # interleaved repetitions of every cell
    steps: int = 5  # timed calls per measurement (its median is the measurement)
    warmup: int = 1
    batch_invariant: bool = True
    block_size: int = 16
    seed: int = 0


def kernel_status() -> AttentionChoice:
    """Whether this machine can run the kernel (``mode == "kernel"``), and if not, why."""
    return choose_attention("auto", torch.device("cpu"), torch.float32)


def bench_runner(cfg: AttentionBench, loaded: LoadedModel, min_blocks: int = 0) -> ModelRunner:
    """A runner whose pool holds every cell's tables at once (the largest batch at the longest
    context), and at least ``min_blocks`` blocks."""
    per_seq = -(-(max(cfg.contexts) + 1) // cfg.block_size)
    runner = ModelRunner(
        loaded,
        num_blocks=max(max(cfg.batches) * per_seq, min_blocks),
        block_size=cfg.block_size,
        batch_invariant=cfg.batch_invariant,
        attention="gather",
    )
    if max(cfg.contexts) >= runner.max_positions:
        raise ValueError(f"context {max(cfg.contexts)} leaves no room in the model's {runner.max_positions} positions")
    return runner


def measure_attention(
    cfg: AttentionBench = AttentionBench(),
    loaded: LoadedModel | None = None,
    runner: ModelRunner | None = None,
) -> pd.DataFrame:
    """One row per measurement: rep, context, batch, mode, attention_ms, step_ms, copied_MiB.

    Only the gather is measured where the kernel cannot be built (see ``kernel_status``).
    ``runner`` (from ``bench_runner``) may be passed in to be shared; its pool is overwritten
    with random numbers and its attention mode is left as the last cell set it.
    """
    modes = MODES if kernel_status().mode == "kernel" else ("gather",)
    bs = cfg.block_size
    per_seq = {ctx: -(-(ctx + 1) // bs) for ctx in cfg.contexts}
    if runner is None:
        runner = bench_runner(cfg, loaded or load_model(cfg.model))
    runner.pool.kv.normal_(generator=torch.Generator().manual_seed(cfg.seed))
    shape = runner.network.shape
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    cells = {}
    for ctx in cfg.contexts:
        for batch in cfg.batches:
            ids = torch.randperm(runner.pool.num_blocks, generator=gen)[: batch * per_seq[ctx]].tolist()
            tables = [ids[i * per_seq[ctx] : (i + 1) * per_seq[ctx]] for i in range(batch)]
            tokens = torch.randint(50, 1000, (batch,), generator=gen).tolist()
            q = torch.randn(batch, shape.num_heads, shape.head_dim, generator=gen)
            cells[ctx, batch] = (tables, tokens, q)
    rows = []
    for rep in range(cfg.reps):
        for ctx in cfg.contexts:
            for batch in cfg.batches:
                for mode in modes:
                    tables, tokens, q = cells[ctx, batch]
                    runner.attention = AttentionChoice(mode, "bench")
                    row = {"rep": rep, "context": ctx, "batch": batch, "mode": mode}
                    row.update(_one_cell(runner, cfg, ctx, tables, tokens, q))
                    rows.append(row)
    return pd.DataFrame(rows)


@torch.inference_mode()
def _one_cell(runner: ModelRunner, cfg: AttentionBench, ctx: int, tables, tokens, q) -> dict[str, float]:
    positions = [ctx] * len(tokens)
    kernel = runner.attention.mode == "kernel"
    layers = runner.network.shape.num_layers

    def attention() -> None:
        plan = runner.plan_decode(positions, tables)
        for layer in range(layers):
            decode_attention(q, runner.pool.kv[layer], plan)

    def step() -> None:
        runner.decode(tokens, positions, tables)

    plan = runner.plan_decode(positions, tables, kernel=False)  # the widths the gather copies
    positions_copied = sum((g.stop - g.start) * g.width for g in plan.groups)
    per_position = 2 * layers * runner.network.shape.num_kv_heads * runner.network.shape.head_dim
    return {
        "attention_ms": median_ms(attention, cfg.warmup, cfg.steps),
        "step_ms": median_ms(step, cfg.warmup, cfg.steps),
        "copied_MiB": 0.0 if kernel else positions_copied * per_position * runner.pool.kv.element_size() / 2**20,
    }


def summarize(samples: pd.DataFrame) -> pd.DataFrame:
    """One row per (context, batch): each mode's median (min, max) over the repetitions, n, the
    gather's copy per step, and kernel / gather for attention and for the whole step."""
    out = []
    for (ctx, batch), cell in samples.groupby(["context", "batch"], sort=True):
        row: dict[str, float | int | str] = {"context": ctx, "batch": batch, "n": int(cell["rep"].nunique())}
        row["copied_MiB_per_step"] = float(cell.loc[cell["mode"] == "gather", "copied_MiB"].median())
        for what in ("attention", "step"):
            for mode in MODES:
                values = cell.loc[cell["mode"] == mode, f"{what}_ms"]
                for stat in ("median", "min", "max"):
                    row[f"{what}_{mode}_ms_{stat}"] = float(getattr(values, stat)()) if len(values) else float("nan")
            row[f"{what}_kernel/gather"] = row[f"{what}_kernel_ms_median"] / row[f"{what}_gather_ms_median"]  # type: ignore[operator]
        out.append(row)
    return pd.DataFrame(out)


def printable(summary: pd.DataFrame) -> pd.DataFrame:
    """The summary with each timing as one "median (min–max)" cell, for the terminal."""
    table = summary[["context", "batch", "n", "copied_MiB_per_step"]].copy()
    for what in ("attention", "step"):
        for mode in MODES:
            cols = [f"{what}_{mode}_ms_{stat}" for stat in ("median", "min", "max")]
            table[f"{what} {mode} ms"] = [
                f"{m:.2f} ({lo:.2f}–{hi:.2f})" for m, lo, hi in summary[cols].itertuples(index=False)
            ]
        table[f"{what} kernel/gather"] = summary[f"{what}_kernel/gather"].round(3)
    return table


def bench_attention(cfg: AttentionBench = AttentionBench(), loaded: LoadedModel | None = None) -> pd.DataFrame:
    """The CLI's table (numeric columns; ``printable`` formats it): see the module docstring."""
    status = kernel_status()
    if status.mode != "kernel":
        print(f"the paged kernel is unavailable ({status.reason}): only the gather is measured")
    return summarize(measure_attention(cfg, loaded))


__all__ = [
    "AttentionBench",
    "bench_runner",
    "bench_attention",
    "kernel_status",
    "measure_attention",
    "printable",
    "summarize",
]
