"""What every experiment shares: profiles, where results go, and what a results file records.

Two profiles. ``ci`` runs the tiny random GPT-2 with few repetitions, so the whole set finishes
in a few minutes and tests can run it on every change. ``full`` runs the embedded SmolLM2-135M
at the chapter's sizes; its outputs are what the notebooks are committed with. ``LABKIT_PROFILE``
picks the profile wherever no one passes one; where it is unset, the notebooks run ``full`` (a
reader opening one wants the real model) and ``labkit run`` runs ``ci`` (a quick look from the
shell; ``--profile full`` for the real thing). Either way the chosen profile is printed first.

Where results go: a ``full`` run writes ``data/<experiment>/*.csv``, ``data/<experiment>/
results.json`` and ``figures/*.png`` at the repository root. A ``ci`` run writes the same tree
under ``build/ci/`` (git-ignored), so a test run never overwrites the committed full results.
``LABKIT_OUT`` moves the root for either.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import platform
import subprocess
from collections.abc import Iterator
from dataclasses import asdict, dataclass, is_dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Protocol

import pandas as pd

__all__ = [
    "PROFILES",
    "Profile",
    "get_profile",
    "repo_root",
    "environment",
    "write_tables",
    "write_results",
    "serving",
    "Progress",
    "tick",
    "doing",
    "save_run",
    "partial_dir",
]

PROFILES = ("ci", "full")
_DEFAULT_MODEL = {"ci": "tiny-gpt2", "full": "smollm2-135m"}
_PACKAGES = (
    "labkit",
    "torch",
    "transformers",
    "fastapi",
    "starlette",
    "uvicorn",
    "httpx",
    "numpy",
    "pandas",
    "matplotlib",
)


@dataclass(frozen=True)
class Profile:
    """A profile's name and the model it serves; experiments size themselves from ``full``."""

    name: str = "ci"
    model: str = ""

    def __post_init__(self) -> None:
        if self.name not in PROFILES:
            raise ValueError(f"Profile.name must be one of {PROFILES}, got {self.name!r}")
        if not self.model:
            object.__setattr__(self, "model", _DEFAULT_MODEL[self.name])

    @property
    def full(self) -> bool:
        return self.name == "full"

    @property
    def out_root(self) -> Path:
        override = os.environ.get("LABKIT_OUT")
        if override:
            return Path(override)
        return repo_root() if self.full else repo_root() / "build" / "ci"

    @property
    def data_dir(self) -> Path:
        return self.out_root / "data"

    @property
    def figures_dir(self) -> Path:
        return self.out_root / "figures"


def get_profile(name: str | None = None, model: str | None = None, default: str = "ci") -> Profile:
    """``name`` or else ``LABKIT_PROFILE`` or else ``default``; ``model`` overrides the profile's model."""
    chosen = name or os.environ.get("LABKIT_PROFILE") or default
    return Profile(chosen, model or "")


def repo_root() -> Path:
    """The checkout holding this package (its ``pyproject.toml``), else the working directory."""
    here = Path(__file__).resolve().parents[2]
    return here if (here / "pyproject.toml").exists() else Path.cwd()


# --------------------------------------------------------------------------- environment


def environment(profile: Profile) -> dict[str, Any]:
    """What a reader needs to judge a number: versions, CPU, threads, model, profile, date, commit."""
    import torch

    return {
        "profile": profile.name,
        "model": profile.model,
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": _git_commit(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "packages": {name: _version(name) for name in _PACKAGES},
    }


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        if name == "labkit":  # run from a checkout that was never pip-installed
            import labkit

            return labkit.__version__
        return None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _git_commit() -> str | None:
    """HEAD of the checkout, or None (no git, no commit yet). Read-only: ``git rev-parse``."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=repo_root(), capture_output=True, text=True, timeout=5, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() or None


# --------------------------------------------------------------------------- writing


def write_tables(name: str, tables: dict[str, pd.DataFrame], profile: Profile) -> list[Path]:
    """One CSV per table in ``<data>/<name>/``; returns the paths written."""
    folder = profile.data_dir / name
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for table_name, table in tables.items():
        path = folder / f"{table_name}.csv"
        table.to_csv(path, index=False)
        paths.append(path)
    return paths


def write_results(
    name: str,
    profile: Profile,
    *,
    config: Any,
    elapsed_s: float,
    tables: dict[str, pd.DataFrame],
    figures: list[Path] = (),  # type: ignore[assignment]
    summary: dict[str, Any] | None = None,
) -> Path:
    """``<data>/<name>/results.json``: the environment, the config, the headline numbers, the files."""
    folder = profile.data_dir / name
    folder.mkdir(parents=True, exist_ok=True)
    record = {
        "experiment": name,
        "environment": environment(profile),
        "config": asdict(config) if is_dataclass(config) and not isinstance(config, type) else config,
        "elapsed_s": round(elapsed_s, 3),
        "summary": summary or {},
        "tables": {t: {"rows": len(df), "columns": list(map(str, df.columns))} for t, df in tables.items()},
        "figures": [_relative(p, profile.out_root) for p in figures],
    }
    path = folder / "results.json"
    path.write_text(json.dumps(record, indent=2, default=_jsonable) + "\n")
    return path


def _relative(path: Path, root: Path) -> str:
    try:
        return str(Path(path).resolve().relative_to(root.resolve()))
    except ValueError:
        return str(path)


def _jsonable(value: Any) -> Any:
    """numpy scalars, paths and tuples in configs and summaries, written as plain JSON."""
    if hasattr(value, "item"):
        return value.item()
    return str(value)


def save_run(
    module: Any,
    config: Any,
    profile: Profile,
    tables: dict[str, pd.DataFrame],
    elapsed_s: float,
    figures: list[Any] | None = None,
) -> dict[str, Any]:
    """Write one run of an experiment module: its CSVs, its figures and its ``results.json``.

    ``figures`` are the ones ``module.plot`` already drew (a notebook shows them first); None
    draws them here. Returns the paths written, under ``csvs``, ``figures`` and ``results``.
    """
    import shutil

    from labkit.plots import savefig

    csvs = write_tables(module.NAME, tables, profile)
    drawn = module.plot(tables) if figures is None else figures
    pngs = [savefig(fig, folder=profile.figures_dir) for fig in drawn]
    summary = module.summary(tables) if hasattr(module, "summary") else {}
    results = write_results(
        module.NAME, profile, config=config, elapsed_s=elapsed_s, tables=tables, figures=pngs, summary=summary
    )
    shutil.rmtree(partial_dir(module.NAME, profile), ignore_errors=True)  # the whole run replaces it
    return {"csvs": csvs, "figures": pngs, "results": results}


# --------------------------------------------------------------------------- running


class Progress(Protocol):
    """What an experiment reports progress to: a tqdm bar, a :class:`~labkit.experiments.progress.RunProgress`
    (which also keeps the rows measured so far), or nothing."""

    def update(self, n: int = 1) -> Any: ...


def doing(progress: Progress | None, what: str) -> None:
    """Name the unit of work about to start (condition, repetition) on ``progress``'s bar."""
    if progress is not None and hasattr(progress, "set_postfix_str"):
        progress.set_postfix_str(what)


def tick(progress: Progress | None, n: int = 1, **measured: Any) -> None:
    """Advance ``progress`` after a unit of work; ``measured`` (table name -> rows so far, a list of
    dicts or a DataFrame) is kept on disk by a progress that can, so a later crash loses no more
    than the unit in flight."""
    if progress is None:
        return
    if measured and hasattr(progress, "keep"):
        progress.keep(**measured)  # on disk first: an interrupt may come at any moment after
    progress.update(n)


def partial_dir(name: str, profile: Profile) -> Path:
    """Where a run in progress keeps its finished conditions: ``<data>/<name>/partial/``."""
    return profile.data_dir / name / "partial"


@contextlib.contextmanager
def serving(server: Any = None, **options: Any) -> Iterator[Any]:
    """``server`` if one was given (left running), else a fresh ``serve_in_thread(**options)``.

    Why: notebooks start the server themselves and pass it in; the CLI and tests let the
    experiment start its own. Either way, whoever started it stops it.
    """
    if server is not None:
        yield server
        return
    from labkit.server import serve_in_thread

    with serve_in_thread(**options) as started:
        yield started
