"""What the notebooks' first cells call: the profile table, the settings table, the defaults.

Why here and not in each notebook: the notebook narrates, the package computes (d2l, fastbook).
Each notebook opens with a ``parameters`` cell (papermill's convention) that names the profile,
``full`` unless ``LABKIT_PROFILE`` or papermill says otherwise, and then calls
:func:`setup_notebook`, whose first output is a small table saying which profile, model and scale
this run uses and how long it should take.
"""

from __future__ import annotations

import os
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from labkit.experiments.durations import expected_duration
from labkit.experiments.profiles import Profile, get_profile, repo_root

__all__ = ["setup_notebook", "profile_table", "settings_table", "SWITCH"]

SCALE = {"full": "the chapter's sizes and repetitions", "ci": "toy sizes, few repetitions: a test run, not a result"}
SWITCH = (
    "To switch: start Jupyter with LABKIT_PROFILE=ci (or full) in its environment, "
    "or run `papermill -p profile_name ci`, or edit profile_name in the parameters cell."
)


def setup_notebook(profile: str | None = None, model: str | None = None, notebook: str | None = None) -> Profile:
    """Threads, plot and table defaults; show the profile table and how to switch; the profile.

    ``profile`` None means ``LABKIT_PROFILE``, else ``full``: a reader who opens a notebook gets
    the real model unless something outside the notebook asks for less.
    """
    import logging

    import torch

    from labkit.plots import apply_style

    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    apply_style()
    pd.set_option("display.width", 140)
    pd.set_option("display.max_columns", 30)
    pd.set_option("display.max_colwidth", 90)
    pd.set_option("display.precision", 3)
    logging.getLogger("uvicorn").setLevel(logging.WARNING)
    logging.getLogger("uvicorn.access").setLevel(logging.WARNING)
    chosen = get_profile(profile or None, model or None, default="full")
    _show(profile_table(chosen, notebook))
    print(SWITCH)
    return chosen


def profile_table(profile: Profile, notebook: str | None = None) -> pd.DataFrame:
    """profile, model, scale, where results go and, for a named notebook, its expected duration."""
    rows = {
        "profile": profile.name,
        "model": profile.model,
        "scale": SCALE[profile.name],
        "results written to": _shown(profile.data_dir),
    }
    if notebook:
        rows["expected duration"] = expected_duration(notebook, profile)
    return pd.DataFrame({"value": rows}).rename_axis("setting")


def _shown(path: Path) -> str:
    """``data`` or ``build/ci/data``: relative to the checkout where it can be."""
    try:
        return str(path.resolve().relative_to(repo_root().resolve()))
    except ValueError:
        return str(path)


def settings_table(config: Any) -> pd.DataFrame:
    """A run's settings one per row (nested configs as ``outer.inner``), instead of one long line."""
    return pd.DataFrame({"value": dict(_flatten(config))}).rename_axis("setting")


def _flatten(config: Any, prefix: str = "") -> list[tuple[str, str]]:
    rows = []
    for field in fields(config):
        value = getattr(config, field.name)
        if is_dataclass(value) and not isinstance(value, type):
            rows += _flatten(value, f"{prefix}{field.name}.")
        else:
            rows.append((f"{prefix}{field.name}", _text(value)))
    return rows


def _text(value: Any) -> str:
    if isinstance(value, (tuple, list)):
        return ", ".join(_text(v) for v in value) if value else "(none)"
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10_000:
        return f"{value:,}"
    return str(value)


def _show(table: pd.DataFrame) -> None:
    """display() in a notebook, print elsewhere."""
    try:
        from IPython import get_ipython
        from IPython.display import display
    except ImportError:
        print(table.to_string())
        return
    if get_ipython() is None:
        print(table.to_string())
    else:
        display(table)
