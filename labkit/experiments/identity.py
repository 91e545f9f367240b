"""Identity beyond greedy float32: seeded sampling, and bfloat16, against runs made alone.

Experiment 2 showed that a greedy float32 stream does not depend on its neighbours. Two more
cases the chapter left open: sampling, where each request owns a seeded generator, so a stream
should still be reproducible whatever runs beside it (and must differ from the greedy one, or the
check would pass with sampling silently ignored); and bfloat16, where the arithmetic is
coarser and a different order of a sum is more likely to flip a near tie. Each is reported as in
experiment 2: where two runs split, the first differing position and the float32 reference
model's logit margin between the two tokens there.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pandas as pd

from labkit.experiments.client import async_client, run_sync
from labkit.experiments.isolation import first_difference, reference_logits
from labkit.experiments.progress import Progress, doing, tick
from labkit.experiments.servers import server_like
from labkit.experiments.workload import stream_body
from labkit.prompts import PROMPTS

__all__ = ["measure_identity", "generate", "compare", "add_margins", "identity_table", "MUST_MATCH", "VS_GREEDY"]


SAMPLED_ALONE = "sampled float32: all at once vs alone"
SAMPLED_AGAIN = "sampled float32: all at once, run twice"
VS_GREEDY = "greedy vs sampled float32: all at once"
BF16_ALONE = "greedy bfloat16: all at once vs alone"
BF16_F32 = "greedy: bfloat16 alone vs float32"
MUST_MATCH = (SAMPLED_ALONE, SAMPLED_AGAIN)
"""Comparisons whose streams must be identical token for token (seeded sampling repeats)."""


def measure_identity(
    srv: Any,
    *,
    streams: int,
    tokens: int,
    bf16_streams: int,
    bf16_tokens: int,
    temperature: float,
    top_p: float,
    seed: int,
    progress: Progress | None = None,
) -> pd.DataFrame:
    """Token ids of the first ``streams`` prompts, sampled (prompt i with seed ``seed + i``) in
    float32: all at once, all at once again, and alone, and the greedy ones all at once: sampling
    that were silently ignored would make the sampled streams the greedy ones, and seeds that
    were ignored would make the two sampled runs differ. Then greedy bfloat16 for the first
    ``bf16_streams`` prompts, alone and all at once, and against float32. The bfloat16 server is
    started here, on the same loaded model (the runner copies the weights)."""
    n = streams
    greedy = [stream_body(i, tokens) for i in range(n)]
    sampled = [stream_body(i, tokens, temperature=temperature, top_p=top_p, seed=seed + i) for i in range(n)]
    doing(progress, f"identity: {n} streams greedy and sampled, all at once (twice) and alone")
    greedy_all = run_sync(generate(srv.url, greedy, together=True))
    sampled_all, sampled_again, sampled_solo = (
        run_sync(generate(srv.url, sampled, together=t)) for t in (True, True, False)
    )
    tick(progress)
    doing(progress, f"identity: {bf16_streams} streams in bfloat16, alone and all at once")
    small = [stream_body(i, bf16_tokens) for i in range(bf16_streams)]
    f32 = run_sync(generate(srv.url, small, together=True))  # float32 is batch-invariant (notebook 02)
    with server_like(None, srv.engine.model, dtype="bfloat16", max_batch=bf16_streams, policy="unbounded") as bf16:
        bf16_solo, bf16_all = (run_sync(generate(bf16.url, small, together=t)) for t in (False, True))
    tick(progress)
    pairs = {
        SAMPLED_ALONE: (sampled_solo, sampled_all),
        SAMPLED_AGAIN: (sampled_all, sampled_again),
        VS_GREEDY: (greedy_all, sampled_all),
        BF16_ALONE: (bf16_solo, bf16_all),
        BF16_F32: (f32, bf16_solo),
    }
    rows = [row for what, (a, b) in pairs.items() for row in compare(what, a, b)]
    return add_margins(pd.DataFrame(rows), srv.engine.model, {what: a for what, (a, _) in pairs.items()})


async def generate(url: str, requests: list[dict[str, Any]], together: bool) -> list[list[int]]:
    """Token ids from ``/v1/generate`` for each request, all at once or one after another."""
    async with async_client(url, connections=len(requests)) as client:

        async def one(body: dict[str, Any]) -> list[int]:
            response = await client.post("/v1/generate", json=body)
            return response.json()["token_ids"]

        if together:
            return list(await asyncio.gather(*(one(b) for b in requests)))
        return [await one(b) for b in requests]


def compare(what: str, reference: list[list[int]], other: list[list[int]]) -> list[dict[str, Any]]:
    rows = []
    for i, (a, b) in enumerate(zip(reference, other)):
        pos = first_difference(a, b)

        def token(ids: list[int], pos: int | None = pos) -> int | None:
            return ids[pos] if pos is not None and pos < len(ids) else None

        rows.append(
            {
                "comparison": what,
                "prompt": i,
                "identical": pos is None,
                "first_diff": pos,
                "reference_token": token(a),
                "other_token": token(b),
                "length": len(a),
            }
        )
    return rows


def add_margins(rows: pd.DataFrame, model: Any, tokens_by_prompt: dict[str, list[list[int]]]) -> pd.DataFrame:
    """Where two runs split: the float32 model's logit gap between the two tokens, and its top-2 gap."""
    rows = rows.assign(margin=np.nan, top2_margin=np.nan)
    split = rows[rows.reference_token.notna() & rows.other_token.notna()]
    for idx, row in split.iterrows():
        prefix = tokens_by_prompt[row.comparison][int(row.prompt)][: int(row.first_diff)]
        logits = reference_logits(model, PROMPTS[int(row.prompt)], prefix)
        top = logits.topk(2).values
        rows.loc[idx, "margin"] = float(logits[int(row.reference_token)] - logits[int(row.other_token)])
        rows.loc[idx, "top2_margin"] = float(top[0] - top[1])
    return rows


def identity_table(identity: pd.DataFrame) -> pd.DataFrame:
    grouped = identity.groupby("comparison", sort=False)
    return pd.DataFrame(
        {
            "streams": grouped.size(),
            "identical": grouped.identical.sum().astype(int),
            "differ": (grouped.size() - grouped.identical.sum()).astype(int),
            "earliest_divergence": grouped.first_diff.min(),
            "smallest_margin": grouped.margin.apply(lambda m: m.abs().min()),
        }
    ).reset_index()
