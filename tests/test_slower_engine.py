"""A slower engine changes no verdict: every notebook's checked verdicts that read the engine, run
at the ci sizes against an engine made about three times slower (``EngineConfig.step_delay``),
read exactly as the committed notebooks print them.

Why this is the test: the lab counts holds, leaves and waits in steps and tokens wherever the
engine is what is timed, so an engine of another speed (a laptop, a future optimisation) must
reach the same verdicts. The expected lines are the outputs of the committed notebooks' checked
cells (``print(x.checked())`` after ``x = run(module.SPEC, target, ...)``), the same ones nbval
compares the normal ci run with. A faster engine is the other direction of the same argument:
nothing here waits a time in seconds for the engine, so shorter steps only shorten the runs.
"""
from __future__ import annotations

import ast
import importlib
import json
import statistics
import time
from pathlib import Path

import pytest

from labkit.lab import LocalLab, run
from labkit.lab.profiles import Profile

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
SLOWER = 3.0  # the engine's step takes this many times as long


def checked_cells(path: Path) -> list[tuple[str, str, dict, str]]:
    """(module, SPEC, overrides, expected output) for each checked cell of notebook ``path``."""
    cells = json.loads(path.read_text())["cells"]
    runs: dict[str, tuple[str, str, dict]] = {}
    found = []
    for cell in cells:
        if cell["cell_type"] != "code":
            continue
        source = "".join(cell["source"])
        for node in ast.walk(ast.parse(source)):
            call = node.value if isinstance(node, ast.Assign) else None
            if isinstance(call, ast.Call) and getattr(call.func, "id", "") == "run" and call.args:
                spec = call.args[0]
                if isinstance(spec, ast.Attribute) and isinstance(spec.value, ast.Name):
                    overrides = {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg}
                    runs[node.targets[0].id] = (spec.value.id, spec.attr, overrides)  # type: ignore[attr-defined]
        if "NBVAL_CHECK_OUTPUT" in source:
            for name, (module, attr, overrides) in runs.items():
                if f"print({name}.checked())" in source:
                    text = "".join("".join(o.get("text", "")) for o in cell.get("outputs", []))
                    found.append((module, attr, overrides, text.strip()))
    return found


#: checked cells whose measurement never reads the slowed engine, and why: running them here would
#: only repeat the normal ci run (they are still checked there, by nbval)
OWN_PROCESSES = "reads labkit serve processes the measurement starts itself, at the engine's own speed"
TICKS = "reads the lab's /lab/slow routes, timed ticks that no engine step produces"
NOT_THIS_ENGINE = {("overlap", "GUIDELLM"): OWN_PROCESSES, ("edge", "STORM"): OWN_PROCESSES,
                   ("edge", "RESTART"): OWN_PROCESSES, ("edge", "THREADS"): TICKS, ("edge", "SIX"): TICKS,
                   ("edge", "GZIP"): TICKS}  # fmt: skip
ALL_CASES = [(nb.stem, *case) for nb in sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb")) for case in checked_cells(nb)]
CASES = [case for case in ALL_CASES if tuple(case[1:3]) not in NOT_THIS_ENGINE]


def step_seconds(lab: LocalLab) -> float:
    """The median duration of a decode step of 8 streams on this machine, now."""
    since = lab.current_step()
    lab.launch([lab.request("How long is a step?", 24) for _ in range(8)])
    steps = lab.steps(since)
    return statistics.median(steps[(steps.prefilled == 0) & (steps.decoded > 0)].seconds)


@pytest.fixture(scope="module")
def slow_lab(tiny_gpt2):
    with LocalLab(tiny_gpt2) as probe:
        step = step_seconds(probe)
    with LocalLab(tiny_gpt2, step_delay=(SLOWER - 1) * step) as lab:
        assert step_seconds(lab) >= (SLOWER - 1) * step  # it really is slower (room for a loaded probe)
        yield lab


def test_every_notebook_has_checked_verdicts_to_compare():
    assert {case[0] for case in CASES} >= {"03_overlap"}


def test_every_measurement_left_out_is_a_checked_cell_of_a_notebook():
    """The list of exceptions cannot outlive the cells it names."""
    assert set(NOT_THIS_ENGINE) <= {tuple(case[1:3]) for case in ALL_CASES}


@pytest.mark.slow
@pytest.mark.parametrize("notebook, module, attr, overrides, expected", CASES, ids=lambda v: v if isinstance(v, str) and "\n" not in v else "")
def test_a_slower_engine_reaches_the_committed_verdicts(slow_lab, tmp_path, monkeypatch, notebook, module, attr, overrides, expected):
    monkeypatch.setenv("LABKIT_OUT", str(tmp_path))
    spec = getattr(importlib.import_module(f"labkit.experiments.{module}"), attr)
    started = time.monotonic()
    result = run(spec, slow_lab, profile=Profile("ci"), show=False, **overrides)
    assert result.checked() == expected, (f"{notebook}: {spec.name} under a {SLOWER:g}x slower engine "
                                          f"({time.monotonic() - started:.0f} s)\n{result.verdict_table().to_string()}\n"
                                          f"{result.tables['rows'].to_string()}")
