"""The chapter's figures live in one data file, ``labkit/experiments/chapter.toml``.

Issue 9: they were string literals in five modules. Now every figure a notebook prints beside
ours comes from the file, no module or notebook types one, the file ships in the wheel, and the
loader refuses a file whose keys differ from what the modules read.
"""
from __future__ import annotations

import ast
import copy
import tomllib
from pathlib import Path

import pandas as pd
import pytest

from labkit.experiments import chapter, disconnect, leak, slowclient
from labkit.experiments.chapter_figures import KEYS, NO_FIGURE, figures, load, parse

ROOT = Path(__file__).resolve().parent.parent
FILE = ROOT / "labkit" / "experiments" / "chapter.toml"


def raw() -> dict:
    return tomllib.loads(FILE.read_text(encoding="utf-8"))


def test_the_packaged_file_has_every_key_the_modules_read():
    loaded = load()
    assert {name: tuple(keys) for name, keys in loaded.sections.items()} == KEYS
    assert loaded == load(FILE) and loaded.setup.startswith("GPT-2 small")


@pytest.mark.parametrize(
    "break_it, says",
    [
        (lambda d: d["overlap"].pop("step_fixed_ms"), "[overlap] step_fixed_ms: missing"),
        (lambda d: d["wire"].update(bytes_per_tokn="73–76"), "[wire] bytes_per_tokn: not a known key"),
        (lambda d: d.update(proxy={"x": "1"}), "[proxy]: not a known section"),
        (lambda d: d.pop("leak"), "[leak]: missing"),
        (lambda d: d["buffers"].update(accepted_133=252434), "[buffers] accepted_133: not text"),
        (lambda d: d.pop("setup"), "setup: missing"),
    ],
)
def test_the_loader_refuses_a_file_whose_keys_differ(break_it, says):
    data = copy.deepcopy(raw())
    break_it(data)
    with pytest.raises(ValueError) as refused:
        parse(data)
    assert says in str(refused.value)


def test_the_file_ships_in_the_wheel():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "chapter.toml" in project["tool"]["setuptools"]["package-data"]["labkit.experiments"]


def committed(name: str) -> dict[str, pd.DataFrame]:
    folder = ROOT / "data" / name
    tables = {path.stem: pd.read_csv(path) for path in sorted(folder.glob("*.csv"))}
    if not tables:
        pytest.skip(f"no committed tables under data/{name}/")
    return tables


BESIDE = {
    "wire": chapter.wire_beside,
    "overlap": chapter.overlap_beside,
    "buffers": chapter.buffers_beside,
    "slowclient": slowclient.beside_chapter,
    "disconnect": disconnect.beside_chapter,
    "leak": leak.beside_chapter,
}


@pytest.mark.parametrize("name", BESIDE)
def test_every_figure_a_notebook_prints_beside_ours_comes_from_the_file(name):
    try:
        table = BESIDE[name](committed(name))
    except (KeyError, AttributeError) as exc:  # committed data from before a column was added
        pytest.skip(f"data/{name} predates this table's columns ({exc!r})")
    shown = set(table["chapter (GPU)"])
    assert shown <= figures().values() | {NO_FIGURE}, shown - figures().values()


def _figures_worth_finding() -> set[str]:
    """Figures specific enough that finding one typed elsewhere means it was copied, not read."""
    return {v for v in figures().values() if len(v) >= 4 and any(c.isdigit() for c in v)}


@pytest.mark.parametrize(
    "path",
    sorted((ROOT / "labkit" / "experiments").glob("*.py")) + sorted((ROOT / "notebooks").glob("[0-9]*.py")),
    ids=lambda p: p.name,
)
def test_no_module_or_notebook_types_a_chapter_figure(path):
    strings = {node.value for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Constant)}
    text = path.read_text() if path.parent.name == "notebooks" else ""
    typed = {f for f in _figures_worth_finding() if f in strings or f in text}
    assert not typed, f"{path.name} types the chapter's {sorted(typed)}; read them from chapter.toml"


def test_the_leak_test_runs_the_chapters_number_of_streams():
    assert leak.Config().streams == int(figures()("leak", "streams"))
