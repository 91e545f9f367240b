"""The notebooks as a reader and CI meet them: paired text sources, the parameters cell, the kernel.

Each ``notebooks/NN_name.ipynb`` (outputs) is paired with ``NN_name.py`` (jupytext's percent
format: the prose and code people edit and review). The pair must agree cell for cell, or a
change made on one side would be silently lost; ``jupytext --sync notebooks/*.py`` brings them
back together. None of these tests runs a notebook: ``make test`` does that under nbval.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

jupytext = pytest.importorskip("jupytext")
from jupytext.config import load_jupytext_config  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
PAIRS = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))
KERNEL = "streamlab"


def out_of_sync(ipynb: Path) -> str | None:
    """None when ``ipynb`` and its ``.py`` hold the same cells; otherwise what differs, in words.

    The comparison is text against text: the ``.ipynb`` written as py:percent with the
    project's jupytext settings must be the ``.py`` byte for byte (outputs are not part of it).
    """
    source = ipynb.with_suffix(".py")
    if not source.exists():
        return f"{ipynb.name} has no paired {source.name}"
    config = load_jupytext_config(str(NOTEBOOKS))
    expected = jupytext.writes(jupytext.read(ipynb), fmt="py:percent", config=config)
    actual = source.read_text()
    if expected == actual:
        return None
    first = next(i for i, (a, b) in enumerate(zip(expected.splitlines() + [""], actual.splitlines() + [""]))
                 if a != b)
    return (f"{ipynb.name} and {source.name} differ from line {first + 1} of {source.name}; "
            f"run `jupytext --sync notebooks/{source.name}`")


def code_cells(ipynb: Path) -> list[dict]:
    return [c for c in json.loads(ipynb.read_text())["cells"] if c["cell_type"] == "code"]


def source(cell: dict) -> str:
    return "".join(cell["source"])


def test_there_are_notebooks_and_every_text_source_has_its_notebook():
    assert len(PAIRS) >= 7
    texts = {p.stem for p in NOTEBOOKS.glob("[0-9][0-9]_*.py")}
    assert texts == {p.stem for p in PAIRS}


@pytest.mark.parametrize("ipynb", PAIRS, ids=lambda p: p.stem)
def test_each_notebook_agrees_with_its_text_source(ipynb):
    assert out_of_sync(ipynb) is None, out_of_sync(ipynb)


def _copy_pair(ipynb: Path, folder: Path) -> Path:
    shutil.copy(ipynb, folder / ipynb.name)
    shutil.copy(ipynb.with_suffix(".py"), folder / ipynb.with_suffix(".py").name)
    return folder / ipynb.name


def test_an_edit_to_the_text_source_alone_is_caught(tmp_path):
    copy = _copy_pair(PAIRS[0], tmp_path)
    text = copy.with_suffix(".py")
    text.write_text(text.read_text().replace("# %% [markdown]\n# #", "# %% [markdown]\n# An added line.\n# #", 1))
    assert "differ from line" in out_of_sync(copy)


def test_an_edit_to_the_notebook_alone_is_caught(tmp_path):
    copy = _copy_pair(PAIRS[0], tmp_path)
    notebook = json.loads(copy.read_text())
    last = [c for c in notebook["cells"] if c["cell_type"] == "code"][-1]
    last["source"] = source(last) + "\nprint('edited in JupyterLab')"
    copy.write_text(json.dumps(notebook))
    assert "differ from line" in out_of_sync(copy)
    copy.with_suffix(".py").unlink()
    assert "has no paired" in out_of_sync(copy)


@pytest.mark.parametrize("ipynb", PAIRS, ids=lambda p: p.stem)
def test_the_first_code_cell_is_the_parameters_cell_and_defaults_to_the_full_profile(ipynb, monkeypatch):
    first = code_cells(ipynb)[0]
    assert "parameters" in first["metadata"].get("tags", [])
    monkeypatch.delenv("LABKIT_PROFILE", raising=False)
    unset: dict = {}
    exec(source(first), unset)  # the cell only reads the environment
    monkeypatch.setenv("LABKIT_PROFILE", "ci")
    ci: dict = {}
    exec(source(first), ci)
    assert (unset["profile_name"], ci["profile_name"]) == ("full", "ci")
    assert {"model_name", "target_url", "device"} <= set(unset), "the parameters a reader may set from outside"


@pytest.mark.parametrize("ipynb", PAIRS, ids=lambda p: p.stem)
def test_the_second_code_cell_shows_the_profile_table_for_this_notebook(ipynb):
    setup = source(code_cells(ipynb)[1])
    assert f'setup("{ipynb.stem}", profile_name, model_name' in setup


@pytest.mark.parametrize("ipynb", PAIRS, ids=lambda p: p.stem)
def test_the_notebook_declares_the_project_kernel(ipynb):
    assert json.loads(ipynb.read_text())["metadata"]["kernelspec"]["name"] == KERNEL
    assert f"name: {KERNEL}" in ipynb.with_suffix(".py").read_text()


@pytest.mark.parametrize("ipynb", PAIRS, ids=lambda p: p.stem)
def test_one_measurement_a_cell_and_its_verdicts_shown_and_checked(ipynb):
    """Each ``x = run(module.SPEC, ...)`` cell runs one measurement; its verdicts are shown below
    it, and the notebook prints its checked verdicts in cells nbval compares."""
    cells = [source(c) for c in code_cells(ipynb)]
    runs = [m for cell in cells for m in re.finditer(r"^(\w+) = run\((\w+)\.(\w+)", cell, re.M)]
    assert runs, "a notebook runs at least one measurement"
    for cell in cells:
        assert len(re.findall(r"^\w+ = run\(", cell, re.M)) <= 1, f"more than one measurement in a cell: {cell}"
    for run in runs:
        assert any(f"{run.group(1)}.verdict_table()" in c for c in cells), f"{run.group(1)}'s verdicts are not shown"
    assert any(c.startswith("# NBVAL_CHECK_OUTPUT") and ".checked())" in c for c in cells)


@pytest.mark.parametrize("ipynb", PAIRS, ids=lambda p: p.stem)
def test_no_duration_is_typed_into_the_prose(ipynb):
    """The expected duration comes from data/durations.csv (the first table), not from a sentence."""
    cells = json.loads(ipynb.read_text())["cells"]
    prose = "\n".join(source(c) for c in cells if c["cell_type"] == "markdown")
    typed = re.findall(r"takes? (?:about |roughly |several )?(?:\w+ )?minutes", prose)
    assert not typed, typed


JUPYTEXT = shutil.which("jupytext", path=str(Path(sys.executable).parent)) or shutil.which("jupytext")


@pytest.mark.skipif(JUPYTEXT is None, reason="the jupytext command is not installed")
def test_the_jupytext_command_agrees_that_the_pairs_are_in_sync(tmp_path):
    """The same check through jupytext's own CLI, on a copy (``--sync`` would rewrite stale files)."""
    copy = _copy_pair(PAIRS[3], tmp_path)
    shutil.copy(ROOT / "jupytext.toml", tmp_path / "jupytext.toml")
    out = subprocess.run([JUPYTEXT, "--to", "py:percent", "--output", "-", str(copy)], capture_output=True,
                         text=True, timeout=60, check=True)
    assert out.stdout == copy.with_suffix(".py").read_text()
