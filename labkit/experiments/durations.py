"""How long each notebook takes: ``<data>/durations.csv``, written by ``make lab``, read by the notebooks.

Why a table and not a sentence: a notebook states its expected duration from the last measured
run, so the number changes when the code does and no one has to remember to retype it. One row
per notebook and profile, plus a ``total`` row, each with the commit and date of the run.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pandas as pd

from labkit.experiments.profiles import Profile

__all__ = ["COLUMNS", "TOTAL", "durations_path", "read_durations", "record_durations", "expected_duration"]

COLUMNS = ["notebook", "profile", "seconds", "commit", "date"]
TOTAL = "total"


def durations_path(profile: Profile) -> Path:
    return profile.data_dir / "durations.csv"


def read_durations(profile: Profile) -> pd.DataFrame:
    """The table for ``profile``, or an empty one with the right columns."""
    path = durations_path(profile)
    if not path.exists():
        return pd.DataFrame(columns=COLUMNS)
    return pd.read_csv(path, dtype={"commit": str})


def record_durations(profile: Profile, seconds: dict[str, float], commit: str | None) -> Path:
    """Replace the rows of the notebooks just run and recompute the total over all notebooks."""
    old = read_durations(profile)
    old = old[(old.profile == profile.name) & ~old.notebook.isin([*seconds, TOTAL])]
    date = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    new = pd.DataFrame(
        [
            {"notebook": nb, "profile": profile.name, "seconds": round(s, 1), "commit": commit or "", "date": date}
            for nb, s in seconds.items()
        ]
    )
    rows = pd.concat([old, new], ignore_index=True).sort_values("notebook")
    total = {
        "notebook": TOTAL,
        "profile": profile.name,
        "seconds": round(float(rows.seconds.sum()), 1),
        "commit": commit or "",
        "date": date,
    }
    table = pd.concat([rows, pd.DataFrame([total])], ignore_index=True)[COLUMNS]
    path = durations_path(profile)
    path.parent.mkdir(parents=True, exist_ok=True)
    table.to_csv(path, index=False)
    return path


def expected_duration(notebook: str, profile: Profile) -> str:
    """ "about 11 min (make lab at abc1234, 2026-11-30)", or why there is no number yet."""
    table = read_durations(profile)
    row = table[(table.notebook == notebook) & (table.profile == profile.name)]
    if row.empty:
        return f"not measured yet for the {profile.name} profile (make lab records it)"
    seconds, commit, date = float(row.seconds.iloc[0]), str(row.commit.iloc[0]), str(row.date.iloc[0])
    return f"about {_minutes(seconds)} (last make lab: commit {commit[:7]}, {date[:10]})"


def _minutes(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"
