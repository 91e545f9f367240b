"""A progress bar for one experiment run that also keeps what the run has measured so far.

Why: on the ``full`` profile one experiment runs for minutes. The bar (tqdm's notebook widget in
JupyterLab, a text bar in a terminal) names the condition and repetition in flight, and the
elapsed time is printed when the run ends. Each time an experiment finishes a condition it hands
the rows so far to :meth:`RunProgress.keep`, which writes them to ``<data>/<name>/partial/``: a
crash late in a run leaves every finished condition on disk. ``save_run`` removes that folder
once the whole run is written.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import pandas as pd

from labkit.experiments.profiles import Profile
from labkit.experiments.results import partial_dir

__all__ = ["Progress", "doing", "tick", "RunProgress", "measuring"]


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


class RunProgress:
    """``update``/``set_postfix_str`` go to the bar; ``keep`` writes the rows measured so far."""

    def __init__(self, name: str, total: int | None, folder: Path | None, show: bool = True) -> None:
        from tqdm.auto import tqdm

        self.name, self.folder = name, folder
        self.bar = tqdm(total=total, desc=name, unit="condition", disable=not show, leave=True)
        self.started = time.perf_counter()
        self.done = 0
        from labkit.experiments.readings import MachineState

        self.before = MachineState.now()
        self.after: MachineState | None = None

    def update(self, n: int = 1) -> None:
        self.done += n
        self.bar.update(n)

    def set_postfix_str(self, what: str) -> None:
        self.bar.set_postfix_str(what)

    def keep(self, **tables: Any) -> None:
        """Write each table of rows so far as ``<folder>/<table>.csv`` (replacing the last one)."""
        if self.folder is None:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        for table, rows in tables.items():
            frame = rows if isinstance(rows, pd.DataFrame) else pd.DataFrame(list(rows))
            frame.to_csv(self.folder / f"{table}.csv", index=False)

    @property
    def elapsed_s(self) -> float:
        return time.perf_counter() - self.started

    def close(self) -> None:
        from labkit.experiments.readings import MachineState

        if self.after is None:
            self.after = MachineState.now()
        self.bar.close()

    @property
    def machine(self) -> dict[str, Any]:
        """The run's machine record (load before and after, CPU used, quiet or not); for
        ``save_run(..., machine=progress.machine)``."""
        from labkit.experiments.readings import MachineState, machine_record

        return machine_record(self.before, self.after or MachineState.now())


@contextlib.contextmanager
def measuring(module: Any, config: Any, profile: Profile | None, *, show: bool = True) -> Iterator[RunProgress]:
    """A :class:`RunProgress` for ``module.run(config, progress=...)``; prints the elapsed time at
    the end, and where the finished conditions are if the run failed.

    ``profile`` None keeps nothing on disk (a run that will not be saved).
    """
    total = module.units(config) if hasattr(module, "units") else None
    folder = partial_dir(module.NAME, profile) if profile is not None else None
    progress = RunProgress(module.NAME, total, folder, show=show)
    try:
        yield progress
    except BaseException:
        progress.close()
        kept = f"; the conditions finished are in {folder}" if folder is not None and folder.exists() else ""
        print(f"{module.NAME}: stopped after {progress.elapsed_s:.1f} s, {_count(progress, total)}{kept}")
        raise
    progress.close()
    print(f"{module.NAME}: {_count(progress, total)} in {progress.elapsed_s:.1f} s")


def _count(progress: RunProgress, total: int | None) -> str:
    return f"{progress.done} of {total} conditions" if total else f"{progress.done} conditions"
