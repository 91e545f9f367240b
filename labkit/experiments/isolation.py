"""Experiment 2, ``isolation``: does a stream's answer depend on its neighbours in the batch?

Rows of a batch should not interact, so a prompt streamed beside N-1 others should produce the
same token ids as the same prompt streamed alone. That is a property to test, not to assume:
padding, tiling or a different matmul shape can change which of two close tokens wins. Each
prompt is first streamed alone over HTTP; then the first N prompts are streamed at once, for
each N and several repetitions, and every stream is compared with its solo run. Where two runs
differ we report the first differing position (token index, and the engine step that made that
token) and, from the reference model (plain transformers, no batching), the logit margin between
the two tokens there: a small margin says "a near tie broken differently", a large one says "a bug".

The counterfactual: the same prompts, in the same run, on a second server over the same loaded
model with ``batch_invariant=False`` (plain matmuls, whose summation order may follow the batch
shape). What the invariant mode buys is the difference between the two.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pandas as pd

from labkit.experiments.client import launch_in_turn, launch_streams, run_sync
from labkit.experiments.profiles import Profile
from labkit.experiments.progress import Progress, doing, tick
from labkit.experiments.readings import Verdict, current_step, fetch_steps, span
from labkit.experiments.servers import loaded_model, server_like
from labkit.prompts import PROMPTS

NAME = "isolation"
MODES = {"invariant": True, "plain": False}  # mode name -> EngineConfig.batch_invariant
CHECKED = ("invariant_equals_solo", "alone_equals_solo")  # verdicts that hold under every profile


@dataclass(frozen=True)
class Config:
    model: str = "smollm2-135m"
    levels: tuple[int, ...] = (1, 2, 8, 16)
    repetitions: int = 3
    max_new_tokens: int = 32
    modes: tuple[str, ...] = ("invariant", "plain")

    @classmethod
    def for_profile(cls, profile: Profile) -> Config:
        if profile.full:
            # Both modes, SmolLM2, 2 cores: solo runs 16 x 32 tokens (~45 s invariant, ~30 s plain)
            # and 3 x (1, 2, 8, 16) at once (~12 s a repetition): about 2.5 minutes with the load.
            return cls(model=profile.model)
        return cls(model=profile.model, levels=(1, 2, 4, 8), repetitions=3, max_new_tokens=24)

    def __post_init__(self) -> None:
        if not self.levels or min(self.levels) < 1 or max(self.levels) > len(PROMPTS):
            raise ValueError(f"isolation.Config.levels must lie in [1, {len(PROMPTS)}], got {self.levels!r}")
        if self.repetitions < 1 or self.max_new_tokens < 1:
            raise ValueError("isolation.Config.repetitions and max_new_tokens must be >= 1")
        if not self.modes or set(self.modes) - set(MODES):
            raise ValueError(f"isolation.Config.modes must be from {tuple(MODES)}, got {self.modes!r}")


def server_options(config: Config, mode: str | None = None) -> dict[str, Any]:
    return {"model": config.model, **_settings(config, mode or config.modes[0])}


def _settings(config: Config, mode: str) -> dict[str, Any]:
    return {"max_batch": max(config.levels), "batch_invariant": MODES[mode]}


def units(config: Config) -> int:
    return len(config.modes) * (1 + len(config.levels) * config.repetitions)


def bodies(config: Config, n: int) -> list[dict[str, Any]]:
    return [{"prompt": p, "max_new_tokens": config.max_new_tokens} for p in PROMPTS[:n]]


def run(config: Config, *, server: Any = None, progress: Progress | None = None) -> dict[str, pd.DataFrame]:
    """Each mode on its own server over one loaded model: solo runs, then every level, repeated."""
    model = loaded_model(server, config.model)
    parts, solos, steps = [], [], []
    for mode in config.modes:
        with server_like(server, model, **_settings(config, mode)) as srv:
            first_step = current_step(srv.url)
            solo_ids, rows = _one_mode(srv, config, mode, progress)
            parts.append(add_margins(pd.DataFrame(rows), model, solo_ids))
            solos += [
                {"mode": mode, "prompt": i, "tokens": len(ids), "token_ids": " ".join(map(str, ids))}
                for i, ids in enumerate(solo_ids)
            ]
            steps.append(fetch_steps(srv.url, since=first_step).assign(mode=mode))
    streams = pd.concat(parts, ignore_index=True)
    return {
        "streams": streams,
        "levels": levels_table(streams),
        "solo": pd.DataFrame(solos),
        "steps": pd.concat(steps, ignore_index=True),
    }


def _one_mode(
    srv: Any, config: Config, mode: str, progress: Progress | None
) -> tuple[list[list[int]], list[dict[str, Any]]]:
    """The solo token ids of every prompt, and a row per concurrent stream compared with its solo run."""
    doing(progress, f"{mode}: solo reference runs of {max(config.levels)} prompts")
    solo = run_sync(launch_in_turn(srv.url, bodies(config, max(config.levels))))
    tick(progress)
    solo_ids = [r.token_ids for r in solo.results]
    rows: list[dict[str, Any]] = []
    for level in config.levels:
        for rep in range(config.repetitions):
            doing(progress, f"{mode}: {level} streams at once, repetition {rep + 1}/{config.repetitions}")
            launch = run_sync(launch_streams(srv.url, bodies(config, level)))
            for i, r in enumerate(launch.results):
                row = {"mode": mode, **_compare(level, rep, i, r.token_ids, solo_ids[i], r.error)}
                rows.append({**row, **_divergence_step(srv.url, r.request_id, row["first_diff"])})
            tick(progress, streams=rows)
    return solo_ids, rows


def _divergence_step(url: str, rid: str | None, index: int | None) -> dict[str, Any]:
    """The engine step that made token ``index`` of stream ``rid``, read from the server's record.

    A stream decodes one token per step from its prefill (token 0) to its last token, and the
    engine releases it in the step that made the last one: token ``k`` came from step
    ``release_step - (tokens_generated - 1 - k)``; ``admitted_step`` is that of token 0.
    """
    import httpx

    out: dict[str, Any] = {"admitted_step": None, "diverged_step": None}
    if rid is None:
        return out
    record = httpx.get(f"{url}/lab/streams/{rid}", timeout=10).json()
    if record.get("release_step") is None or not record.get("tokens_generated"):
        return out
    first = int(record["release_step"]) - (int(record["tokens_generated"]) - 1)
    out["admitted_step"] = first
    if index is not None:
        out["diverged_step"] = first + int(index)
    return out


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
    seen: dict[tuple[int, int], Any] = {}  # repetitions often split at the same place: one forward each
    for idx, row in differing.iterrows():
        prompt, position = int(row.prompt), int(row.first_diff)
        if (prompt, position) not in seen:
            seen[prompt, position] = reference_logits(loaded, PROMPTS[prompt], solo_ids[prompt][:position])
        logits = seen[prompt, position]
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


def _with_mode(streams: pd.DataFrame) -> pd.DataFrame:
    """Tables from before the counterfactual had one mode, the invariant one."""
    return streams if "mode" in streams else streams.assign(mode="invariant")


def levels_table(streams: pd.DataFrame) -> pd.DataFrame:
    """Per mode and level: streams compared, how many were identical, and where the first differed."""
    grouped = _with_mode(streams).groupby(["mode", "level"], sort=False)
    table = pd.DataFrame(
        {
            "streams": grouped.size(),
            "identical": grouped.identical.sum().astype(int),
            "min_first_diff": grouped.first_diff.min(),
            "min_abs_margin": grouped.margin.apply(lambda m: m.abs().min()),
        }
    ).reset_index()
    return table


def divergences(tables: dict[str, pd.DataFrame]) -> pd.DataFrame:
    """One row per stream that left its solo run: where (token index), when (engine step) and by what margin."""
    streams = _with_mode(tables["streams"])
    columns = [
        "mode",
        "level",
        "repetition",
        "prompt",
        "first_diff",
        "admitted_step",
        "diverged_step",
        "solo_token",
        "concurrent_token",
        "margin",
        "top2_margin",
    ]
    return streams.loc[~streams.identical, [c for c in columns if c in streams]].reset_index(drop=True)


def summary(tables: dict[str, pd.DataFrame]) -> dict[str, Any]:
    streams = _with_mode(tables["streams"])
    out: dict[str, Any] = {}
    for mode, group in streams.groupby("mode", sort=False):
        out[mode] = {
            "streams": len(group),
            "identical": int(group.identical.sum()),
            "differing": int((~group.identical).sum()),
            "first_diff_min": None if group.first_diff.isna().all() else int(group.first_diff.min()),
        }
    return out


def report(tables: dict[str, pd.DataFrame]) -> str:
    """Stable text for any profile when the property holds (the invariant mode, the engine's
    default); the count only when it does not. The plain mode's count is data, not a check."""
    s = summary(tables).get("invariant", {"streams": 0, "differing": 0})
    if s["differing"] == 0:
        return "every concurrent stream had token ids identical to its solo run"
    return f"{s['differing']} of {s['streams']} concurrent streams differed from their solo run"


def verdicts(tables: dict[str, pd.DataFrame]) -> list[Verdict]:
    """The hypotheses of notebook 02, each judged against its falsification criterion."""
    streams = _with_mode(tables["streams"])
    inv, plain = (streams[streams["mode"] == m] for m in ("invariant", "plain"))
    alone = streams[streams.level == 1]

    def differ(group: pd.DataFrame) -> str:
        return f"{int((~group.identical).sum())} of {len(group)} streams differed"

    out = [
        Verdict(
            "invariant_equals_solo",
            "with batch_invariant=True every concurrent stream equals its solo run",
            "any concurrent stream's token ids differ from its solo run's",
            bool(len(inv)) and bool(inv.identical.all()),
            differ(inv),
        ),
        Verdict(
            "alone_equals_solo",
            "a stream served alone (level 1) repeats its solo run in either mode: the engine is deterministic",
            "any level-1 stream differs from its solo run",
            bool(len(alone)) and bool(alone.identical.all()),
            differ(alone),
        ),
    ]
    if len(plain):
        diverged = plain[~plain.identical]
        where = span(diverged.first_diff, "{:.0f}") if len(diverged) else "none"
        out.append(
            Verdict(
                "plain_diverges",
                "with batch_invariant=False some concurrent stream leaves its solo run",
                "no stream in the plain mode differs from its solo run",
                bool(len(diverged)),
                f"{differ(plain)}; first divergence at token {where}",
            )
        )
    return out


def findings(tables: dict[str, pd.DataFrame]) -> str:
    """The counterfactual in a few sentences, from this run's numbers."""
    said = []
    for mode, s in summary(tables).items():
        setting = MODES.get(mode)
        said.append(
            f"batch_invariant={setting}: {s['differing']} of {s['streams']} concurrent streams differed from their solo run"
            + (f", the earliest at token {s['first_diff_min']}" if s["first_diff_min"] is not None else "")
            + "."
        )
    div = divergences(tables)
    if len(div) and div.margin.notna().any():
        said.append(
            "Where they split, the reference model's best two tokens were "
            f"{span(div.top2_margin.abs(), '{:.3f}')} logits apart, and the two runs' tokens "
            f"{span(div.margin.abs(), '{:.3f}')} logits apart."
        )
    return " ".join(said)


def plot(tables: dict[str, pd.DataFrame]) -> list:
    """Per stream, the token where it first left its solo run (identical streams sit on the top
    line), for each mode; and the share of streams that differed, per level and mode."""
    from labkit.plots import new_figure

    streams = _with_mode(tables["streams"])
    fig, (left, right) = new_figure("isolation_divergence", ncols=2)
    top = int(streams.tokens.max()) if len(streams) else 1
    levels = sorted(streams.level.unique())
    for k, (mode, group) in enumerate(streams.groupby("mode", sort=False)):
        x = group.level.map(levels.index) + (k - 0.5) * 0.3 + (group.prompt % 7 - 3) * 0.02
        y = group.first_diff.fillna(top)
        left.scatter(x, y, s=14, alpha=0.6, label=f"batch_invariant={MODES.get(mode, mode)}")
        share = group.groupby("level").identical.apply(lambda s: 1 - s.mean()).reindex(levels)
        right.plot([str(v) for v in levels], share, "o-", label=f"batch_invariant={MODES.get(mode, mode)}")
    left.axhline(top, color="gray", lw=0.8, ls=":")
    left.set_ylim(-0.5, top + 1.5)
    left.set(
        xticks=range(len(levels)),
        xticklabels=[str(v) for v in levels],
        xlabel="concurrent streams",
        ylabel="first token that differs from the solo run",
        title=f"First divergence per stream (top line: identical, {top} tokens)",
    )
    left.legend(fontsize="small")
    right.set(
        ylim=(-0.05, 1.05),
        xlabel="concurrent streams",
        ylabel="share of streams that differed",
        title="Streams that left their solo run",
    )
    right.legend(fontsize="small")
    return [fig]
