"""Experiment 2, ``isolation``: does a stream's answer depend on its neighbours in the batch?

Rows of a batch should not interact, so a prompt streamed beside N-1 others should produce the
same token ids as the same prompt streamed alone. That is a property to test, not to assume:
padding, tiling or a different matmul shape can change which of two close tokens wins. Each
prompt is first streamed alone over HTTP; then the first N prompts are streamed at once, for
each N and several repetitions, and every stream is compared with its solo run. Where two runs
differ we report the first differing position and, from the reference model (plain
transformers, no batching), the logit margin between the two tokens there: a small margin says
"a near tie broken differently", a large one says "a bug".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pandas as pd

from labkit.experiments.client import launch_in_turn, launch_streams, run_sync
from labkit.experiments.profiles import Profile
from labkit.experiments.progress import Progress, doing, tick
from labkit.experiments.servers import serving
from labkit.prompts import PROMPTS

NAME = "isolation"


@dataclass(frozen=True)
class Config:
    model: str = "smollm2-135m"
    levels: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    repetitions: int = 3
    max_new_tokens: int = 64

    @classmethod
    def for_profile(cls, profile: Profile) -> Config:
        if profile.full:
            return cls(model=profile.model)
        return cls(model=profile.model, levels=(1, 2, 4, 8), repetitions=2, max_new_tokens=24)

    def __post_init__(self) -> None:
        if not self.levels or min(self.levels) < 1 or max(self.levels) > len(PROMPTS):
            raise ValueError(f"isolation.Config.levels must lie in [1, {len(PROMPTS)}], got {self.levels!r}")
        if self.repetitions < 1 or self.max_new_tokens < 1:
            raise ValueError("isolation.Config.repetitions and max_new_tokens must be >= 1")


def server_options(config: Config) -> dict[str, Any]:
    return {"model": config.model, "max_batch": max(config.levels)}


def units(config: Config) -> int:
    return 1 + len(config.levels) * config.repetitions


def bodies(config: Config, n: int) -> list[dict[str, Any]]:
    return [{"prompt": p, "max_new_tokens": config.max_new_tokens} for p in PROMPTS[:n]]


def run(config: Config, *, server: Any = None, progress: Progress | None = None) -> dict[str, pd.DataFrame]:
    with serving(server, **server_options(config)) as srv:
        doing(progress, f"solo reference runs of {max(config.levels)} prompts")
        solo = run_sync(launch_in_turn(srv.url, bodies(config, max(config.levels))))
        tick(progress)
        solo_ids = [r.token_ids for r in solo.results]
        rows = []
        for level in config.levels:
            for rep in range(config.repetitions):
                doing(progress, f"{level} streams at once, repetition {rep + 1}/{config.repetitions}")
                launch = run_sync(launch_streams(srv.url, bodies(config, level)))
                rows += [
                    _compare(level, rep, i, r.token_ids, solo_ids[i], r.error) for i, r in enumerate(launch.results)
                ]
                tick(progress, streams=rows)
        streams = pd.DataFrame(rows)
        streams = add_margins(streams, srv.engine.model, solo_ids)
    return {"streams": streams, "levels": levels_table(streams)}


def _compare(level: int, rep: int, index: int, ids: list[int], solo: list[int], error: str | None) -> dict[str, Any]:
    first = first_difference(ids, solo)
    return {
        "level": level,
        "repetition": rep,
        "prompt": index,
        "tokens": len(ids),
        "solo_tokens": len(solo),
        "identical": first is None and error is None,
        "first_diff": first,
        "solo_token": solo[first] if first is not None and first < len(solo) else None,
        "concurrent_token": ids[first] if first is not None and first < len(ids) else None,
        "client_error": error,
    }


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where the two sequences differ (a length difference counts); None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def add_margins(streams: pd.DataFrame, loaded: Any, solo_ids: list[list[int]]) -> pd.DataFrame:
    """For each differing stream: the reference model's logit margin where the two runs split.

    ``margin`` is logit(solo token) - logit(concurrent token) after the prompt and the tokens both
    runs share; ``top2_margin`` is the gap between the reference's best two logits there.
    """
    streams = streams.copy()
    streams["margin"] = float("nan")
    streams["top2_margin"] = float("nan")
    differing = streams[streams.solo_token.notna() & streams.concurrent_token.notna()]
    for idx, row in differing.iterrows():
        prompt, position = int(row.prompt), int(row.first_diff)
        logits = reference_logits(loaded, PROMPTS[prompt], solo_ids[prompt][:position])
        top = logits.topk(2).values
        streams.loc[idx, "margin"] = float(logits[int(row.solo_token)] - logits[int(row.concurrent_token)])
        streams.loc[idx, "top2_margin"] = float(top[0] - top[1])
    return streams


def reference_logits(loaded: Any, prompt: str, prefix: list[int]):
    """Next-token logits of the plain transformers model (no cache, no batch) after prompt + prefix."""
    import torch

    ids = list(loaded.tokenizer.encode(prompt)) + list(prefix)
    with torch.inference_mode():
        out = loaded.model(input_ids=torch.tensor([ids]))
    return out.logits[0, -1].float()


def levels_table(streams: pd.DataFrame) -> pd.DataFrame:
    """Per level: streams compared, how many were identical, and the smallest margin where not."""
    grouped = streams.groupby("level")
    table = pd.DataFrame(
        {
            "streams": grouped.size(),
            "identical": grouped.identical.sum().astype(int),
            "min_first_diff": grouped.first_diff.min(),
            "min_abs_margin": grouped.margin.apply(lambda m: m.abs().min()),
        }
    ).reset_index()
    return table


def summary(tables: dict[str, pd.DataFrame]) -> dict[str, Any]:
    streams = tables["streams"]
    return {
        "streams": len(streams),
        "identical": int(streams.identical.sum()),
        "differing": int((~streams.identical).sum()),
    }


def report(tables: dict[str, pd.DataFrame]) -> str:
    """Stable text for any profile when the property holds; the count only when it does not."""
    s = summary(tables)
    if s["differing"] == 0:
        return "every concurrent stream had token ids identical to its solo run"
    return f"{s['differing']} of {s['streams']} concurrent streams differed from their solo run"


def plot(tables: dict[str, pd.DataFrame]) -> list:
    from labkit.plots import new_figure

    levels = tables["levels"]
    fig, (ax,) = new_figure("isolation_identical")
    ax.bar(levels.level.astype(str), levels.streams, color="lightgray", label="streams compared")
    ax.bar(levels.level.astype(str), levels.identical, color="tab:green", label="identical to solo run")
    ax.set(xlabel="concurrent streams", ylabel="streams", title="Concurrent streams against their solo runs")
    ax.legend()
    return [fig]
