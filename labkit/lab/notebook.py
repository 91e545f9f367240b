"""What a notebook's first cells call: the profile, the target, and the table that says so.

Each notebook opens with a ``parameters`` cell (papermill's convention: ``profile_name``,
``model_name``, ``target_url``, ``device``), then :func:`setup`, whose first output says which
profile, model and target this run uses, the code's commit and state now, and how long the
previous ``make lab`` took for this notebook (``<data>/durations.csv``, written by ``make lab``).
"""

from __future__ import annotations

import datetime as dt
import logging
from pathlib import Path
from typing import Any

import pandas as pd

from labkit.lab.profiles import Profile, get_profile, repo_root
from labkit.lab.record import code_dirty, git_commit
from labkit.lab.runner import use_profile
from labkit.lab.target import LocalLab, Target
from labkit.machine import describe, pin_threads

__all__ = ["setup", "target_for", "record_durations", "read_durations"]

SCALE = {"full": "the chapter's sizes (each measurement's scale table says where not, and why)", "ci": "a test run"}
DURATION_COLUMNS = ["notebook", "profile", "seconds", "commit", "date"]


def setup(notebook: str, profile_name: str = "", model_name: str = "", *, device: str = "cpu") -> Profile:
    """Threads, plot and table defaults, the profile every ``run`` uses; shows the profile table.

    ``profile_name`` empty means ``LABKIT_PROFILE``, else ``full``: a reader who opens a notebook
    gets the real model unless something outside asks for less.
    """
    from labkit.plots import apply_style

    threads = pin_threads(device)
    apply_style()
    # wide enough that a verdict's evidence and the widest table (05's slow readers) print whole
    for key, value in (("width", 150), ("max_columns", 40), ("max_colwidth", 400), ("precision", 3)):
        pd.set_option(f"display.{key}", value)
    for name in ("uvicorn", "uvicorn.access", "uvicorn.error"):
        logging.getLogger(name).setLevel(logging.WARNING)
    logging.getLogger("asyncio").setLevel(logging.ERROR)  # an in-thread server writing to a client that left
    profile = get_profile(profile_name or None, model_name or None, default="full")
    use_profile(profile)
    _show(profile_table(profile, notebook, device, threads))
    return profile


def profile_table(profile: Profile, notebook: str, device: str = "cpu", threads: str = "") -> pd.DataFrame:
    """What this run uses and where it comes from: profile, model, device and threads, the kernels
    (built, or in one line why not), the machine's readings (or "not available on this platform")."""
    from labkit.engine.kernels import build_summary

    dirty = code_dirty()
    rows = {
        "profile": profile.name,
        "model": profile.model,
        "device": f"{device}; {threads}" if threads else device,
        "kernels": build_summary() if device == "cpu" else "CPU only: the engine uses torch's ops on " + device,
        **describe(),
        "scale": SCALE[profile.name],
        "results written to": _shown(profile.data_dir),
        "code now": f"commit {git_commit() or 'unknown'}" + (" with uncommitted changes" if dirty else ""),
        "previous make lab of this notebook": previous_duration(notebook, profile),
    }
    return pd.DataFrame({"value": rows}).rename_axis("setting")


def target_for(profile: Profile, url: str = "", *, device: str = "cpu", **settings: Any) -> Target:
    """``url`` empty: labkit serving the profile's model in a background thread (stop it with
    ``target.close()``); else the server at ``url``, probed (see :func:`labkit.lab.probe.connect`)."""
    if url:
        from labkit.lab.probe import connect

        return connect(url, model=profile.model if profile.model not in ("tiny-gpt2", "smollm2-135m") else None)
    return LocalLab(profile.model, device=device, **settings)


def _shown(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(repo_root().resolve()))
    except ValueError:
        return str(path)


def _show(table: pd.DataFrame) -> None:
    try:
        from IPython import get_ipython
        from IPython.display import display
    except ImportError:
        print(table.to_string())
        return
    display(table) if get_ipython() is not None else print(table.to_string())


# -- durations ---------------------------------------------------------------------------------
def read_durations(profile: Profile) -> pd.DataFrame:
    path = profile.data_dir / "durations.csv"
    return pd.read_csv(path, dtype={"commit": str}) if path.exists() else pd.DataFrame(columns=DURATION_COLUMNS)


def record_durations(profile: Profile, seconds: dict[str, float], commit: str | None) -> Path:
    """Replace the rows of the notebooks just run; recompute the total over all notebooks."""
    old = read_durations(profile)
    old = old[(old.profile == profile.name) & ~old.notebook.isin([*seconds, "total"])]
    date = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    new = [{"notebook": n, "profile": profile.name, "seconds": round(s, 1), "commit": commit or "", "date": date}
           for n, s in seconds.items()]  # fmt: skip
    rows = pd.concat([old, pd.DataFrame(new)], ignore_index=True).sort_values("notebook")
    total = {"notebook": "total", "profile": profile.name, "seconds": round(float(rows.seconds.sum()), 1),
             "commit": commit or "", "date": date}  # fmt: skip
    path = profile.data_dir / "durations.csv"
    path.parent.mkdir(parents=True, exist_ok=True)
    pd.concat([rows, pd.DataFrame([total])], ignore_index=True)[DURATION_COLUMNS].to_csv(path, index=False)
    return path


def previous_duration(notebook: str, profile: Profile) -> str:
    """ "12 min (commit abc1234, 2026-12-01)": the previous run's, not this one's."""
    table = read_durations(profile)
    row = table[(table.notebook == notebook) & (table.profile == profile.name)]
    if row.empty:
        return f"none recorded for the {profile.name} profile"
    seconds = float(row.seconds.iloc[0])
    took = f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"
    return f"{took} (commit {str(row.commit.iloc[0])[:7]}, {str(row.date.iloc[0])[:10]})"
