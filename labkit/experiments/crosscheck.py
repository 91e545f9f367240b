"""Notebook 03's cross-check: the lab's client beside GuideLLM, on one server, at one concurrency.

The lab measures with its own client, so an error in that client would be in every number. GuideLLM
(vLLM's benchmark tool) is an independent one: its ``concurrent`` profile keeps N requests in
flight, as the lab's launch does, and it reports output tokens/s and inter-token latency. Here the
two take turns against the same ``labkit serve`` process (the lab starts one, so neither client
shares a process with the server; an external target is measured as it is), on the same OpenAI
completions route, with the same number of streams, each ``tokens`` long past end-of-sequence.

Both quantities are computed the same way on both sides: tokens/s divides all output tokens by the
span between the earliest request and the latest end of a stream, and a request's inter-token latency is
(last token - first token) / (tokens - 1), its median over the requests.

The two clients share the machine with the server, so a heavier client slows the server it reads, and
the two can disagree while each reads truly. Two designs tell the cases apart. The server's own step
log (lab routes) is a witness: each run records the server's median decode period (from the start of
one decode-only step to the start of the next: the step and any wait for a core before the next
one), and each client's inter-token latency is judged against the period the server kept while that
client read it. And in a third condition the two clients read the server *at once*, half the streams
each, in the same batches: whatever one client costs the server, the other pays it too, so any
difference left is in the reading.

GuideLLM is a dev extra in an environment of its own (``make guidellm``: its pins differ from
labkit's), run as a program, never imported; where it is missing the rows say so.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from labkit.lab import Experiment, NotMeasurable, Process, Request, Sizes, Target, Trial, judge, span, spread
from labkit.lab.profiles import repo_root
from labkit.lab.target import stop_process
from labkit.lab.witness import wait_for
from labkit.models.tokenizers import smollm2_tokenizer_folder
from labkit.prompts import cycle

TOOLS = ("lab client", "GuideLLM")
AT_ONCE = "both at once"  # the condition in which each client reads half the streams, together
AGREE = (0.8, 1.25)  # the band a ratio of the two clients' medians must fall in


def guidellm_program() -> str:
    """``$LABKIT_GUIDELLM``, the repository's ``.venv-guidellm`` (``make guidellm``), or ``guidellm`` on PATH."""
    for found in (os.environ.get("LABKIT_GUIDELLM"), repo_root() / ".venv-guidellm" / "bin" / "guidellm",
                  shutil.which("guidellm")):  # fmt: skip
        if found and Path(found).is_file():
            return str(found)
    raise NotMeasurable("overlap.guidellm", "GuideLLM is not installed (make guidellm: a dev extra in .venv-guidellm)")


@dataclass
class Served:
    """The server both clients measure, and GuideLLM's program; a server the lab started is stopped."""

    target: Target
    program: str
    started: Process | None = None

    def close(self) -> None:
        if self.started is not None:
            self.started.close()


def prepare(target: Target, s: Sizes) -> Served:
    program = guidellm_program()
    if target.lab_owned or target.caps.settings:
        started = Process.labkit(target.model or "", max_batch=s.streams)
        return Served(started, program, started)
    return Served(target, program)


def measure(trial: Trial) -> dict[str, Any] | list[dict[str, Any]]:
    served, s = trial.state, trial.sizes
    target = served.target
    if trial.tool == AT_ONCE:
        return at_once(served, s)
    first = target.current_step() if target.caps.lab else None
    row = run_guidellm(served, s) if trial.tool == "GuideLLM" else lab_client(target, s)
    return row | {"at_once": False, "server_period_ms": server_period_ms(target, first)}


def at_once(served: Served, s: Sizes) -> list[dict[str, Any]]:
    """GuideLLM starts with half the streams; once the server holds all of them (``/stats``), the
    lab's client opens the other half; one row per client. GuideLLM's start takes seconds, so
    waiting for its requests is what puts both halves in the same batches."""
    target, half = served.target, s.streams // 2
    target.need("stats", what="two clients reading one server at once")
    first = target.current_step() if target.caps.lab else None
    with guidellm(served, s, half) as (proc, finish):

        def guidellm_in() -> bool:
            seen = target.stats()
            return proc.poll() is not None or seen["running"] + seen["waiting"] >= half

        wait_for(guidellm_in, timeout=s.timeout, what="GuideLLM's requests at the server")
        lab = lab_client(target, s, half)
        theirs = finish()
    period = {"at_once": True, "server_period_ms": server_period_ms(target, first)}
    return [lab | period | {"tool": "lab client"}, theirs | period | {"tool": "GuideLLM"}]


def server_period_ms(target: Target, first: int | None) -> float:
    """The server's median decode period since step ``first``, start to start of two consecutive
    decode-only steps: the pace its streams' tokens left at, whoever read them (a step's own
    ``seconds`` would leave out the time its thread waited for a core between steps); NaN where the
    target keeps no step log or no two decode steps followed each other."""
    if first is None:
        return float("nan")
    steps = target.steps(first)
    decode = (steps.decoded > 0) & (steps.prefilled == 0)
    follows = decode & decode.shift(1, fill_value=False) & (steps.step.diff() == 1)
    periods = steps.started.diff()[follows]
    return 1e3 * float(periods.median()) if len(periods) else float("nan")


def lab_client(target: Target, s: Sizes, streams: int | None = None) -> dict[str, Any]:
    streams = streams or s.streams
    body = {"max_tokens": s.tokens, "temperature": 0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}} | ({"model": target.model} if target.model else {})  # fmt: skip
    requests = [
        Request("/v1/completions", body | {"prompt": p}, "openai", headers=target.headers) for p in cycle(streams)
    ]
    launch = target.launch(requests)
    itl = [(st.token_times[-1] - st.token_times[0]) / (len(st.token_times) - 1) for st in launch.streams
           if len(st.token_times) > 1]  # fmt: skip
    return {"streams": streams, "tokens": launch.tokens, "tokens_per_s": launch.tokens_per_s,
            "itl_ms": 1e3 * float(np.median(itl)), "failed": sum(1 for st in launch.streams if st.failure)}  # fmt: skip


def run_guidellm(served: Served, s: Sizes) -> dict[str, Any]:
    """One GuideLLM run of ``streams`` requests at concurrency ``streams``."""
    with guidellm(served, s, s.streams) as (_, finish):
        return finish()


@contextlib.contextmanager
def guidellm(
    served: Served, s: Sizes, streams: int
) -> Iterator[tuple[subprocess.Popen[bytes], Callable[[], dict[str, Any]]]]:
    """GuideLLM started on ``streams`` requests at concurrency ``streams``, and a ``finish`` that
    waits for it (``s.timeout``) and reads its JSON back; a program still running on the way out
    is stopped."""
    with tempfile.TemporaryDirectory(prefix="labkit-guidellm-") as folder:
        out, log = Path(folder) / "benchmarks.json", Path(folder) / "guidellm.log"
        argv = [served.program, "run", "--disable-console-interactive",
                "--backend", f"kind=openai_http,target={served.target.url},request_format=/v1/completions",
                "--profile", f"kind=concurrent,streams={streams}",
                "--constraint", f"kind=max_requests,count={streams}",
                "--data", f"kind=synthetic_text,prompt_tokens={s.prompt_tokens},output_tokens={s.tokens}",
                "--tokenizer", f"kind=huggingface_auto,model={smollm2_tokenizer_folder()}",
                "--output", f"kind=json,path={out}"]  # fmt: skip
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "GUIDELLM__DEFAULT_RESULTS_DIR": folder}
        with open(log, "wb") as sink:
            proc = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT, env=env, cwd=folder)

        def finish() -> dict[str, Any]:
            try:
                code = proc.wait(timeout=s.timeout)
            except subprocess.TimeoutExpired:
                raise ChildProcessError(f"guidellm ran past {s.timeout:g} s") from None
            if code != 0 or not out.exists():
                said = log.read_text(errors="replace").strip().splitlines()[-1:] or ["no output"]
                raise ChildProcessError(f"guidellm exited with {code}: {said[0][:300]}")  # an OSError: one line
            return guidellm_row(json.loads(out.read_text())["benchmarks"][0], streams)

        try:
            yield proc, finish
        finally:
            stop_process(proc)


def guidellm_row(bench: dict[str, Any], streams: int) -> dict[str, Any]:
    """GuideLLM's JSON benchmark as the lab client's row: its output tokens over its duration."""
    metrics = bench["metrics"]
    tokens = float(metrics["output_token_count"]["successful"]["total_sum"])
    totals = metrics["request_totals"]
    return {"streams": streams, "tokens": int(tokens), "tokens_per_s": tokens / bench["duration"],
            "itl_ms": float(metrics["inter_token_latency_ms"]["successful"]["median"]),
            "failed": int(totals.get("errored", 0) + totals.get("incomplete", 0))}  # fmt: skip


def tables(t: dict[str, pd.DataFrame], s: Sizes) -> dict[str, pd.DataFrame]:
    rows = with_server_period(t["rows"]).assign(itl_over_period=lambda r: r.itl_ms / r.server_period_ms)
    columns = ["tokens_per_s", "itl_ms", "server_period_ms", "itl_over_period"]
    once = rows.at_once.astype(bool)
    return {"tools": spread(rows[~once], "tool", columns), "at_once": spread(rows[once], "tool", columns)}


def agree(rows: pd.DataFrame, column: str) -> tuple[bool | None, str]:
    """Whether GuideLLM's median over the lab client's lies in :data:`AGREE`, with both ranges."""
    g = {tool: rows[rows.tool == tool][column].dropna() for tool in TOOLS}
    if any(v.empty for v in g.values()):
        return None, "a client measured nothing"
    ratio = float(g["GuideLLM"].median() / g["lab client"].median())
    ranges = "; ".join(f"{tool} {span(v, '{:.1f}')}" for tool, v in g.items())
    return AGREE[0] <= ratio <= AGREE[1], f"GuideLLM/lab {ratio:.2f}; {ranges}"


def verdicts(t: dict[str, pd.DataFrame], s: Sizes) -> list:
    rows, n = t["rows"], len(t["rows"])
    bar = f"GuideLLM's median over the lab client's within {AGREE[0]:g}–{AGREE[1]:g}"
    once = rows.at_once.astype(bool)
    turns = rows[~once]
    return [
        judge("both clients whole", "every request of both clients ended at its length", "any failed",
              n > 0 and int(rows.failed.sum()) == 0 and bool((rows.tokens == rows.streams * s.tokens).all()),
              f"{int(rows.failed.sum())} failed; tokens per run {sorted(set(rows.tokens))}", checked=True),
        judge("tokens/s agree", bar, "outside it", *agree(turns, "tokens_per_s")),
        judge("inter-token latency agrees", bar, "outside it", *agree(turns, "itl_ms")),
        judge("each client reads the server's own pace", f"each client's inter-token latency over the server's "
              f"median decode period in the same run within {AGREE[0]:g}–{AGREE[1]:g}, every run", "a run outside it",
              *own_pace(turns)),
        judge("read at once, the two agree", f"with each client reading half the streams in the same batches, "
              f"GuideLLM's tokens/s and inter-token latency over the lab client's within {AGREE[0]:g}–{AGREE[1]:g}, "
              "every run", "a run outside it", *agree_at_once(rows[once])),
    ]  # fmt: skip


def agree_at_once(rows: pd.DataFrame) -> tuple[bool | None, str]:
    """Each at-once run's two ratios, GuideLLM over the lab client: falsified by any outside
    :data:`AGREE`; unclear where no run had both clients."""
    read = {"tokens_per_s": "tokens/s", "itl_ms": "ITL"}
    by = rows.pivot_table(index="repetition", columns="tool", values=list(read)) if len(rows) else None
    if by is None or any((column, tool) not in by for column in read for tool in TOOLS):
        return None, "no run read by both clients at once"
    ratios = {column: (by[column]["GuideLLM"] / by[column]["lab client"]).dropna() for column in read}
    said = "; ".join(f"GuideLLM/lab {name} {span(ratios[column])} over {len(ratios[column])} runs"
                     for column, name in read.items())  # fmt: skip
    if any(r.empty for r in ratios.values()):
        return None, said
    return bool(all(r.between(*AGREE).all() for r in ratios.values())), said


def with_server_period(rows: pd.DataFrame) -> pd.DataFrame:
    """The rows with a ``server_period_ms`` column (NaN in runs saved before the step log was read)."""
    return rows if "server_period_ms" in rows else rows.assign(server_period_ms=float("nan"))


def own_pace(rows: pd.DataFrame) -> tuple[bool | None, str]:
    """Each run's client ITL over the server's decode period then: a client that reads truly
    matches the server's clock, however much the client itself slowed the server. Falsified by any
    run outside :data:`AGREE`; unclear where a client has no run with both numbers."""
    rows = with_server_period(rows)
    ratio = rows.itl_ms / rows.server_period_ms
    said = "; ".join(
        f"{tool}: ITL/period {span(ratio[rows.tool == tool], '{:.2f}')}, server period "
        f"{span(rows.server_period_ms[rows.tool == tool], '{:.1f}', ' ms')}"
        for tool in TOOLS
    )
    if (~ratio.dropna().between(*AGREE)).any():
        return False, said
    missing = [tool for tool in TOOLS if ratio[rows.tool == tool].dropna().empty]
    if missing:
        return (
            None,
            f"no run of {' or '.join(missing)} with both its ITL and the server's period (a server's step "
            f"log needs labkit serve --lab-routes); {said}",
        )
    return True, said


GUIDELLM = Experiment(
    name="overlap.guidellm",
    title="The lab's client beside GuideLLM's concurrent profile: the same server, streams and length",
    sizes={"full": {"streams": 32, "tokens": 64, "prompt_tokens": 16, "repetitions": 3, "timeout": 300.0},
           "ci": {"streams": 8, "tokens": 16, "prompt_tokens": 16, "repetitions": 3, "timeout": 120.0}},
    conditions=lambda s, target: [{"tool": tool} for tool in (*TOOLS, AT_ONCE)],
    prepare=prepare, measure=measure, tables=tables, verdicts=verdicts, alternate=True,
)  # fmt: skip
