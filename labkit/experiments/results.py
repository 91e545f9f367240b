"""What a results file records, and writing one run's tables, figures and ``results.json``.

The environment (versions, CPU, threads, model, profile, date, commit) goes into every
``results.json``, so a reader can judge a number without asking where it came from. A run in
progress keeps its finished conditions under :func:`partial_dir`; :func:`save_run` replaces them
with the whole run.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import subprocess
from dataclasses import asdict, is_dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import pandas as pd

from labkit.experiments.profiles import Profile, repo_root
from labkit.machine import cpu_model

__all__ = ["environment", "write_tables", "write_results", "save_run", "partial_dir"]

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


def environment(profile: Profile) -> dict[str, Any]:
    """What a reader needs to judge a number: versions, CPU, threads, model, profile, date, commit."""
    import torch

    return {
        "profile": profile.name,
        "model": profile.model,
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": _git_commit(),
        "code_dirty": _code_dirty(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": cpu_model(),
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


def _code_dirty() -> bool | None:
    from labkit.experiments.readings import code_dirty

    return code_dirty()


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
    machine: dict[str, Any] | None = None,
) -> Path:
    """``<data>/<name>/results.json``: the environment, the machine's state during the run (load,
    CPU, quiet or not), the step-time spread (from a ``steps`` table), the config, the headline
    numbers and the files."""
    from labkit.experiments.readings import step_spread

    folder = profile.data_dir / name
    folder.mkdir(parents=True, exist_ok=True)
    record = {
        "experiment": name,
        "environment": environment(profile),
        "config": asdict(config) if is_dataclass(config) and not isinstance(config, type) else config,
        "elapsed_s": round(elapsed_s, 3),
        "machine": machine,
        "step_spread": step_spread(tables["steps"]) if "steps" in tables else None,
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
    machine: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Write one run of an experiment module: its CSVs, its figures and its ``results.json``.

    ``figures`` are the ones ``module.plot`` already drew (a notebook shows them first); None
    draws them here. ``machine`` is the run's record (``progress.machine`` of ``measuring``). Returns the paths written, under ``csvs``, ``figures`` and ``results``.
    """
    import shutil

    from labkit.plots import savefig

    csvs = write_tables(module.NAME, tables, profile)
    drawn = module.plot(tables) if figures is None else figures
    pngs = [savefig(fig, folder=profile.figures_dir) for fig in drawn]
    summary = module.summary(tables) if hasattr(module, "summary") else {}
    results = write_results(
        module.NAME,
        profile,
        config=config,
        elapsed_s=elapsed_s,
        tables=tables,
        figures=pngs,
        summary=summary,
        machine=machine,
    )
    shutil.rmtree(partial_dir(module.NAME, profile), ignore_errors=True)  # the whole run replaces it
    return {"csvs": csvs, "figures": pngs, "results": results}


def partial_dir(name: str, profile: Profile) -> Path:
    """Where a run in progress keeps its finished conditions: ``<data>/<name>/partial/``."""
    return profile.data_dir / name / "partial"
