"""The oldest Python labkit runs on is said in pyproject.toml, and everything else agrees, the code included.

Why a test: pyproject.toml once said 3.10 while the code used ``typing.Self``, ``asyncio.timeout``
and ``tomllib`` (all 3.11), so a reader on 3.10 met an ImportError in the middle of a notebook
instead of a refusal at install time. The floor is 3.11 because what labkit is tested with needs
it too (transformers 5.2x, fastapi, starlette, numpy 2.4 and pandas 3 all require 3.11).
``vermin`` reads the code and names the oldest Python each construct needs.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def floor() -> tuple[int, int]:
    spec = PYPROJECT["project"]["requires-python"]
    found = re.fullmatch(r">=\s*3\.(\d+)", spec)
    assert found, f"requires-python should be a plain floor like '>=3.11', got {spec!r}"
    return 3, int(found.group(1))


def test_every_statement_of_the_python_floor_agrees_with_pyproject() -> None:
    major, minor = floor()
    dotted = f"{major}.{minor}"
    assert PYPROJECT["tool"]["ruff"]["target-version"] == f"py{major}{minor}"
    assert PYPROJECT["tool"]["mypy"]["python_version"] == dotted
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    assert f"python={dotted}" in env["dependencies"]
    assert re.search(rf"^PYTHON_FLOOR := {re.escape(dotted)}$", (ROOT / "Makefile").read_text(), re.M)
    stated = re.findall(r"Python (3\.\d+)\+", (ROOT / "README.md").read_text())
    assert stated == [dotted], f"the README should state the floor once, as 'Python {dotted}+', found {stated}"


def vermin(paths: list[Path], target: tuple[int, int]) -> subprocess.CompletedProcess[str]:
    """vermin's verdict on ``paths`` against ``target`` and newer (exit status 0: nothing newer is used)."""
    pytest.importorskip("vermin", reason="vermin is a dev dependency: pip install -e '.[dev]'")
    command = [
        sys.executable,
        "-c",
        "import sys, vermin; sys.exit(vermin.main())",
        f"--target={target[0]}.{target[1]}-",
        "--violations",
    ]
    command += ["--no-tips", "--eval-annotations", "--no-parse-comments", *map(str, paths)]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)


def test_labkit_uses_nothing_newer_than_the_declared_floor() -> None:
    done = vermin([ROOT / "labkit"], floor())
    assert done.returncode == 0, f"labkit uses Python newer than {floor()}:\n{done.stdout}{done.stderr}"


def test_the_check_finds_code_newer_than_the_floor(tmp_path: Path) -> None:
    """The check above can fail: a module using 3.12's ``itertools.batched`` and 3.11's
    ``typing.Self`` is refused against a 3.11 floor for the first and a 3.10 one for both."""
    module = tmp_path / "newer.py"
    module.write_text("from itertools import batched\nfrom typing import Self\n")
    at_floor = vermin([module], (3, 11))
    assert at_floor.returncode != 0 and "itertools.batched" in at_floor.stdout and "typing.Self" not in at_floor.stdout
    below = vermin([module], (3, 10))
    assert below.returncode != 0 and "typing.Self" in below.stdout
