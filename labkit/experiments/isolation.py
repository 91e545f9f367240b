"""Notebook 02, isolation: does a stream's answer depend on its neighbours in the batch?

* :data:`STREAMS`: the chapter's comparison over HTTP: each prompt streamed alone, then the first
  N at once, every concurrent stream compared token id by token id with its solo run, in the
  batch-invariant mode and the plain one; where one differs, the token and the engine step.
* :data:`LOGITS`: what the claim is about. On the engine's runner, probes decoded alone and inside
  batches of several sizes, fed the same tokens, their logits compared bit for bit at every step,
  in both modes and two precisions, with the top-2 margin at every token and the greedy flips. A
  token comparison sees a difference only where it crosses a near tie; this one sees every one.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from labkit.lab import Experiment, Sizes, Stream, Target, Trial, judge
from labkit.prompts import PROMPTS, context_ids

MODES = ("invariant", "plain")


def modes(target: Target) -> tuple[str, ...]:
    """Both modes where the lab can start servers; else the one the server runs ("as served")."""
    return MODES if target.caps.settings else ("as served",)


def settings(s: Sizes, mode: str) -> dict[str, Any]:
    return {"max_batch": max(s.levels), "batch_invariant": mode != "plain"}


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where the two differ (a length difference counts); None if equal."""
    i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    return i if i is not None or len(a) == len(b) else min(len(a), len(b))


def compared(stream: Stream, other: Stream) -> tuple[int | None, str | None]:
    """Where ``stream``'s token ids first depart from ``other``'s, and what kept the two from being
    compared: a failure, or no token ids (only labkit's API sends them; two empty lists are equal
    and say nothing), so a stream counts as identical only with every token's id in hand."""
    failure = stream.failure or other.failure
    if failure is None and not all(len(x.token_ids) == x.tokens > 0 for x in (stream, other)):
        failure = "no token ids to compare (only labkit's own API sends them)"
    return first_difference(stream.token_ids, other.token_ids), failure


# --------------------------------------------------------------------------- streams over HTTP


def solo_runs(target: Target, s: Sizes) -> dict[str, list[Stream]]:
    """Every prompt streamed alone, one after another, on each mode's server: the references."""
    out = {}
    for mode in modes(target):
        server = target.variant(**settings(s, mode)) if target.caps.settings else target
        out[mode] = [server.read(server.request(p, s.tokens)) for p in PROMPTS[: max(s.levels)]]
    return out


def measure_streams(trial: Trial) -> list[dict[str, Any]]:
    target, s = trial.target, trial.sizes
    together = target.launch([target.request(p, s.tokens) for p in PROMPTS[: trial.level]]).streams
    records = target.records([st.request_id for st in together]) if target.caps.lab else [None] * len(together)
    rows = []
    for i, (stream, solo, record) in enumerate(zip(together, trial.state[trial.mode], records)):
        first, failure = compared(stream, solo)
        rows.append({"prompt": i, "tokens": stream.tokens, "identical": first is None and failure is None,
                     "first_diff": first, "diverged_step": _step_of(record, first), "failure": failure,
                     "solo_token": _at(solo.token_ids, first), "concurrent_token": _at(stream.token_ids, first)})  # fmt: skip
    return rows


def _at(ids: list[int], i: int | None) -> int | None:
    return ids[i] if i is not None and i < len(ids) else None


def _step_of(record: dict[str, Any] | None, index: int | None) -> int | None:
    """The engine step that made token ``index``: a stream makes one token per step from its
    prefill to its release, so token k came from ``release_step - (generated - 1 - k)``."""
    if record is None or index is None or record.get("release_step") is None:
        return None
    return int(record["release_step"]) - (int(record["tokens_generated"]) - 1 - index)


def stream_tables(tables: dict[str, pd.DataFrame], s: Sizes) -> dict[str, pd.DataFrame]:
    g = tables["rows"].groupby(["mode", "level"], sort=False)
    levels = pd.DataFrame({"streams": g.size(), "identical": g.identical.sum().astype(int),
                           "earliest_first_diff": g.first_diff.min(), "earliest_step": g.diverged_step.min()})  # fmt: skip
    rows = tables["rows"]
    return {"levels": levels.reset_index(), "divergences": rows[~rows.identical].reset_index(drop=True)}


def stream_verdicts(tables: dict[str, pd.DataFrame], s: Sizes) -> list:
    rows = tables["rows"]
    invariant, alone = rows[(rows["mode"] != "plain") & (rows.level > 1)], rows[rows.level == 1]

    def differ(g: pd.DataFrame) -> str:
        failed = int(g.failure.notna().sum())
        return f"{int((~g.identical).sum())} of {len(g)} streams differ from their solo run ({failed} failed or not compared)"

    return [
        judge("concurrent equals solo (invariant)", "with batch_invariant on (or as a server the lab did not start "
              "is set), every concurrent stream has its solo run's token ids", "any such stream differs or failed",
              bool(len(invariant)) and bool(invariant.identical.all()), differ(invariant), checked=True),
        judge("alone equals solo", "a stream served alone (level 1) repeats its solo run in every mode",
              "any level-1 stream differs or failed", None if alone.empty else bool(alone.identical.all()),
              differ(alone), checked=True),
    ]  # fmt: skip


STREAMS = Experiment(
    name="isolation.streams",
    title="Concurrent streams against their solo runs, token id by token id, in both modes",
    sizes={"full": {"levels": (1, 2, 4, 8, 16, 32), "tokens": 16, "repetitions": 3},
           "ci": {"levels": (1, 2, 4, 8), "tokens": 12, "repetitions": 2}},
    conditions=lambda s, target: [{"mode": m, "level": n} for m in modes(target) for n in s.levels],
    server=lambda s, c: settings(s, c["mode"]),
    prepare=solo_runs,
    measure=measure_streams,
    tables=stream_tables,
    verdicts=stream_verdicts,
    needs=("native",),
    chapter={"levels": ((1, 2, 4, 8, 16, 32), "a test run"), "repetitions": (3, "a test run"),
             "tokens": (64, "a solo run costs a step per token; isolation.logits has the power, comparing bits")},
)  # fmt: skip


# --------------------------------------------------------------------------- logits in process


def prompt_ids(tokenizer: Any, n: int) -> list[list[int]]:
    """The lab's prompts, then (past them) windows cut from the prompts run together."""
    ids = [list(tokenizer.encode(p)) for p in PROMPTS[:n]]
    return ids + context_ids(tokenizer, 4 * (n - len(ids)), 48)[::4]


def compare(solo: Any, batched: Any) -> dict[str, Any]:
    """A row's logits (a tensor) against its solo ones: bitwise equal?, the largest |Δ|, the solo
    top-2 margin, how far the batch moved that gap, whether the greedy token flipped, and whether
    a third token overtook both (a flip the top-2 gap's move cannot explain)."""
    import torch

    top = solo.topk(2)
    (a, b), moved = top.indices.tolist(), batched[top.indices[0]] - batched[top.indices[1]]
    return {"differs": not torch.equal(solo, batched), "delta": float((solo - batched).abs().max()),
            "margin": float(top.values[0] - top.values[1]), "gap_moved": abs(float(moved - solo[a] + solo[b])),
            "flipped": int(solo.argmax()) != int(batched.argmax()), "overtaken": int(batched.argmax()) not in (a, b)}  # fmt: skip


def measure_logits(trial: Trial) -> list[dict[str, Any]]:
    """Probes decoded alone, and inside batches of every size (probes first, other prompts as
    neighbours), every run on its own blocks (:func:`labkit.engine.logits_probe`); each probe row's
    logits compared with its solo ones at every step (step 0: the prefill)."""
    import torch

    from labkit.engine import logits_probe

    s, loaded = trial.sizes, trial.target.loaded  # type: ignore[attr-defined]
    with torch.inference_mode():
        probe = logits_probe(loaded, prompt_ids(loaded.tokenizer, max(s.batches)), s.batches, s.probes, s.tokens,
                             dtype=trial.dtype, batch_invariant=trial.mode == "invariant")  # fmt: skip
        kept = [{"batch": b, "probe": r, "step": step, **compare(solo, batched)} for b, r, step, solo, batched in probe]
    trial.keep("tokens", kept)
    return logit_rows(pd.DataFrame(kept))


def logit_rows(tokens: pd.DataFrame) -> list[dict[str, Any]]:
    """Per batch size: rows compared, how many differ in bits, the largest |Δ|, the first step with
    a difference, greedy flips, and the flip rate these differences imply (:func:`flip_rate`)."""
    out = []
    for b, g in tokens.groupby("batch"):
        out.append({"batch": b, "rows": len(g), "differ": int(g.differs.sum()), "share": float(g.differs.mean()),
                    "max_delta": float(g.delta.max()), "first_step": g.step[g.differs].min() if g.differs.any() else None,
                    "flips": int(g.flipped.sum()), "min_margin": float(g.margin.min()),
                    "flips_per_1000": 1000 * flip_rate(g.margin, g.gap_moved)})  # fmt: skip
    return out


def flip_rate(margins: pd.Series, moved: pd.Series) -> float:
    """The chance that a token flips, were margins and moves independent: half the share of
    (margin, move) pairs in which the move beats the margin (half the moves go the leader's way).
    It says how many tokens a comparison of greedy tokens needs to expect one flip."""
    m = np.sort(margins.to_numpy())
    return float(0.5 * np.searchsorted(m, moved.to_numpy(), side="left").sum() / max(1, len(m) * len(moved)))


def logit_verdicts(tables: dict[str, pd.DataFrame], s: Sizes) -> list:
    """Invariance is checked in float32, the fixed-order kernel's precision; in bfloat16 it rests on
    library calls probed at start-up, so there it is a reading, as is the plain mode everywhere."""
    rows = tables["rows"]
    alone = rows[rows.batch == 1]
    out = [judge("alone repeats itself", "a row decoded alone twice has the same logits, bit for bit, in every "
                 "mode and precision", "any bit differs", bool(len(alone)) and int(alone["differ"].sum()) == 0,
                 f"{int(alone['differ'].sum())} of {int(alone['rows'].sum())} rows differ", checked=True)]  # fmt: skip
    for (dtype, mode), g in rows[rows.batch > 1].groupby(["dtype", "mode"], sort=False):
        evidence = "; ".join(f"B={r.batch}: {r.differ} of {r.rows} rows, max |Δ| {r.max_delta:.2g}" for r in g.itertuples())  # fmt: skip
        if mode == "invariant":
            out.append(judge(f"invariant ({dtype}): bitwise identical", "with batch_invariant on, a row's logits in "
                             "any batch are bitwise its solo logits, at every step", "any row differs in any bit",
                             int(g["differ"].sum()) == 0, evidence, checked=dtype == "float32"))  # fmt: skip
        else:
            out.append(judge(f"plain ({dtype}): batched logits differ in bits", "with batch_invariant off, some row's "
                             "logits in a batch differ from its solo logits", "no row differs in any bit at any batch",
                             bool(g["differ"].sum() > 0), evidence))  # fmt: skip
    return out


def logit_plots(tables: dict[str, pd.DataFrame], s: Sizes) -> list:
    from labkit.plots import new_figure

    rows, tokens = tables["rows"], tables["tokens"]
    fig, (left, right) = new_figure("isolation_logits", ncols=2)
    for (dtype, mode), g in rows.groupby(["dtype", "mode"], sort=False):
        left.plot(g.batch.astype(str), g.share, "o-", label=f"{mode}, {dtype}")
    left.set(ylim=(-0.05, 1.05), xlabel="rows in the batch", ylabel="share of rows whose logits differ",
             title="Logits against the solo run, bit for bit")  # fmt: skip
    moved = tokens[(tokens.batch > 1) & tokens.differs.astype(bool)]
    for (dtype, mode, flipped), g in moved.groupby(["dtype", "mode", "flipped"]):
        right.scatter(g.gap_moved.clip(lower=1e-9), g.margin.clip(lower=1e-9), s=30 if flipped else 6,
                      marker="x" if flipped else ".", label=f"{mode}, {dtype}{': flipped' if flipped else ''}")  # fmt: skip
    right.axline((1e-9, 1e-9), slope=1, color="gray", lw=0.8, ls=":")  # below it, the move beats the margin
    right.set(xscale="log", yscale="log", xlabel="how far the batch moved the top-2 gap (no move: at the left)",
              ylabel="solo top-2 margin (ties at the bottom)", title="Top-2 flips: the move against the margin")  # fmt: skip
    for ax in (left, right):
        ax.legend(fontsize="small")
    return [fig]


LOGITS = Experiment(
    name="isolation.logits",
    title="Logits in a batch against the solo run, bit for bit, in both modes and two precisions",
    sizes={"full": {"batches": (1, 2, 16, 17, 32), "probes": 8, "tokens": 16, "dtypes": ("float32", "bfloat16")},
           "ci": {"batches": (1, 2, 16, 17, 32), "probes": 16, "tokens": 40, "dtypes": ("float32", "bfloat16")}},
    conditions=lambda s, target: [{"dtype": d, "mode": m} for d in s.dtypes for m in MODES],
    measure=measure_logits,
    tables=lambda t, s: {"flipped": t["tokens"][t["tokens"].flipped.astype(bool)].reset_index(drop=True)},
    verdicts=logit_verdicts,
    plots=logit_plots,
    needs=("engine",),
)  # fmt: skip


def power(streams: Any, logits: Any) -> pd.DataFrame:
    """What the token comparison could see, from the two measurements' results: the plain-mode
    tokens it compared in batches, and the flips that the logits measurement's float32 flip rate (its
    largest batch) expects among them; where no move beat any margin, by half of three over the
    margins seen (95%). Where either measured nothing of that, the rows saying why."""
    for result in (streams, logits):
        if result.tables["rows"].empty:
            return result.tables.get("not_measurable", pd.DataFrame({"because": ["nothing was measured"]}))
    s, g = streams.tables["rows"], logits.tables["rows"]
    plain = s[(s["mode"] == "plain") & (s.level > 1)]
    rates = g[(g["mode"] == "plain") & (g.dtype == "float32")].sort_values("batch")
    if plain.empty or rates.empty:
        return pd.DataFrame(
            {"because": ["no plain-mode streams in batches, or no plain float32 logits, to set side by side"]}
        )
    rate = rates.iloc[-1]
    compared, bound = int(plain.tokens.sum()), max(rate.flips_per_1000, 1500 / rate.rows)
    return pd.DataFrame([{"plain tokens compared over HTTP": compared, "flips per 1000 (logits)": rate.flips_per_1000,
                          "flips expected, at most": compared * bound / 1000, "flips seen": int((plain.first_diff.notna() & plain.failure.isna()).sum())}])  # fmt: skip


SPECS = (STREAMS, LOGITS)
