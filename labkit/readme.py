"""The README's measured tables, rendered from the data files that hold them.

Why: a number typed into the README goes stale the moment the code changes, and nothing tells.
Each measured table sits between two markers::

    <!-- data: durations -->
    ...rendered table...
    <!-- /data -->

and ``python -m labkit.readme`` (run by ``make lab`` and ``make bench``) replaces what is between
them with the table rendered from ``data/``: ``durations`` from ``data/durations.csv``,
``bench_step`` and ``bench_generate`` from ``data/bench/*.csv`` (``labkit bench … --save``),
``peers`` from notebook 09's run (``data/peers/load/``).
``tests/test_readme.py`` fails when the README and its data disagree.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parent.parent
BLOCK = re.compile(r"(<!-- data: (?P<name>[a-z_]+) -->\n)(?P<body>.*?)(<!-- /data -->)", re.S)


def _provenance(path: Path) -> str:
    """``commit abc1234, 2026-11-30, load 0.12`` from the ``.json`` saved beside a bench table."""
    meta = path.with_suffix(".json")
    if not meta.exists():
        return ""
    m = json.loads(meta.read_text())
    dirty = ", uncommitted changes" if m.get("code_dirty") else ""
    load = m.get("loadavg_before", ["?"])[0]
    load = f"{load:.2f}" if isinstance(load, (int, float)) else load
    return (
        f"\n*One run: commit {str(m.get('git_commit') or '?')[:7]}{dirty}, {str(m.get('date', '?'))[:10]}, "
        f"{m.get('torch_threads', '?')} threads, load average {load} before.*\n"
    )


def durations(data: Path) -> str:
    """Each notebook with the commit it last ran at: a re-run of one notebook is not a ``make lab``."""
    table = pd.read_csv(data / "durations.csv", dtype={"commit": str})
    table = table[table.profile == "full"]
    lines = ["| notebook | minutes | commit |", "|---|---|---|"]
    notebooks = table[table.notebook != "total"]
    lines += [f"| `{r.notebook}` | {r.seconds / 60:.1f} | {str(r.commit)[:7]} |" for r in notebooks.itertuples()]
    if not notebooks.empty:
        lines.append(f"| **total** | **{notebooks.seconds.sum() / 60:.1f}** | |")
        lines.append("")
        commits = notebooks.commit.astype(str).str[:7].unique()
        when = str(notebooks.date.max())[:10]
        if len(commits) == 1:
            lines.append(f"*Last `make lab`: commit {commits[0]}, {when}.*")
        else:
            lines.append(f"*Notebooks last run at {len(commits)} commits (column above); the latest run {when}.*")
    return "\n".join(lines) + "\n"


def bench_step(data: Path) -> str:
    path = data / "bench" / "step.csv"
    t = pd.read_csv(path)
    ratios = ["engine/floor", "engine/bare", "plain/bare", "invariant/plain"]
    head = "| decode step, B | " + " | ".join(str(int(b)) for b in t.batch) + " |"
    lines = [head, "|---" * (len(t) + 1) + "|"]
    lines.append("| engine (invariant), ms | " + " | ".join(f"{x:.1f}" for x in t.engine_step_ms) + " |")
    lines.append("| engine (plain), ms | " + " | ".join(f"{x:.1f}" for x in t.engine_plain_ms) + " |")
    lines.append("| bare transformers forward, ms | " + " | ".join(f"{x:.1f}" for x in t.bare_forward_ms) + " |")
    lines.append("| matmul floor, ms | " + " | ".join(f"{x:.1f}" for x in t.matmul_floor_ms) + " |")
    lines.append(
        "| the invariant mode's matmuls, ms | " + " | ".join(f"{x:.1f}" for x in t.invariant_matmuls_ms) + " |"
    )
    for r in ratios:
        lines.append(f"| {r} | " + " | ".join(f"{x:.2f}" for x in t[r]) + " |")
    return "\n".join(lines) + "\n" + _provenance(path)


def bench_generate(data: Path) -> str:
    path = data / "bench" / "generate.csv"
    t = pd.read_csv(path)
    lines = [
        "| run (requests × tokens, greedy) | seconds | tokens/s | engine all at once is | same tokens as the engine |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['run']} | {r['seconds']:.2f} | {r['tokens_per_s']:.1f} | {r['engine_all_at_once/this']:.2f}× "
        f"| {r['same_tokens_as_engine']} |"
        for r in t.to_dict("records")
    ]
    return "\n".join(lines) + "\n" + _provenance(path)


def bench_attention(data: Path) -> str:
    """Gather against kernel per (context, batch): the copy per step, and the step and attention
    times as median (min–max) over the interleaved repetitions."""
    path = data / "bench" / "attention.csv"
    t = pd.read_csv(path)

    def cell(r: dict, what: str, mode: str) -> str:
        m, lo, hi = (r[f"{what}_{mode}_ms_{s}"] for s in ("median", "min", "max"))
        return f"{m:.1f} ({lo:.1f}–{hi:.1f})"

    lines = [
        "| context | B | gather copies, MiB/step | step, gather ms | step, kernel ms | kernel/gather (step) "
        "| attention, gather ms | attention, kernel ms | kernel/gather (attention) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {int(r['context'])} | {int(r['batch'])} | {r['copied_MiB_per_step']:.1f} | {cell(r, 'step', 'gather')} "
        f"| {cell(r, 'step', 'kernel')} | {r['step_kernel/gather']:.2f} | {cell(r, 'attention', 'gather')} "
        f"| {cell(r, 'attention', 'kernel')} | {r['attention_kernel/gather']:.2f} |"
        for r in t.to_dict("records")
    ]
    n = int(t["n"].min()) if len(t) else 0
    return "\n".join(lines) + f"\n\n*Median (min–max) of {n} interleaved repetitions.*\n" + _provenance(path)


def peers(data: Path) -> str:
    """Notebook 09's servers side by side (``data/peers/load/beside.csv``, written by ``make lab``):
    each cell the median (min–max) over the interleaved rounds, with the run's provenance."""
    folder = data / "peers" / "load"
    t = pd.read_csv(folder / "beside.csv", dtype=str).fillna("n/a")
    servers = [c for c in t.columns if c != "measurement"]
    lines = ["| | " + " | ".join(servers) + " |", "|---" * (len(servers) + 1) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in t[["measurement", *servers]].itertuples(index=False)]
    record = json.loads((folder / "results.json").read_text())
    env, machine = record["environment"], record["machine"]
    load = (machine.get("loadavg_before") or [None])[0]
    load = f"{load:.2f}" if isinstance(load, (int, float)) else "not recorded"
    return "\n".join(lines) + (
        f"\n\n*Median (min–max) of {record['sizes']['repetitions']} interleaved rounds: commit "
        f"{str(env.get('git_commit') or '?')[:7]}, {str(env.get('date', '?'))[:10]}, load average {load} before.*\n"
    )


RENDERERS: dict[str, Callable[[Path], str]] = {
    "durations": durations,
    "bench_step": bench_step,
    "bench_generate": bench_generate,
    "bench_attention": bench_attention,
    "peers": peers,
}


def render(text: str, data: Path) -> str:
    """``text`` with every marked block replaced by its table rendered from ``data``; a block
    whose data file does not exist yet is left as it is."""

    def one(m: re.Match[str]) -> str:
        render_block = RENDERERS.get(m["name"])
        if render_block is None:
            raise ValueError(f"README block {m['name']!r} has no renderer (known: {', '.join(RENDERERS)})")
        try:
            body = render_block(data)
        except FileNotFoundError:
            return m[0]
        return f"{m[1]}{body}{m[4]}"

    return BLOCK.sub(one, text)


def main() -> int:
    readme = ROOT / "README.md"
    old = readme.read_text()
    new = render(old, ROOT / "data")
    if new != old:
        readme.write_text(new)
        print("README.md: measured tables re-rendered from data/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
