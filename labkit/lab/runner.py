"""One runner for every experiment: interleaved repetitions, progress, partial saves, the record.

``run(SPEC, target, **overrides)`` measures one :class:`~labkit.lab.experiment.Experiment` on one
target at the profile's sizes (``overrides`` change sizes by name) and returns a :class:`Result`:
its rows and tables, verdicts, figures on demand, the commit and the machine's state. Conditions
run in the order A B C, A B C, … (A B C, C B A, … where the spec alternates) so a drift in the
machine's load spreads over every condition.
Each finished trial's rows are written at once to ``<data>/<group>/<measurement>/partial/``; the
whole run replaces them with its tables and ``results.json`` (an unsaved run, with nothing). A
measurement the target cannot witness becomes a "not measurable" row naming why, and the rest goes on.
"""

from __future__ import annotations

import contextlib
import gc
import json
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from labkit.lab.client import RUN_ENDS
from labkit.lab.experiment import Experiment, Sizes, Tables, Trial
from labkit.lab.profiles import Profile, get_profile
from labkit.lab.record import MachineState, environment, machine_record, provenance_line
from labkit.lab.target import LocalLab, NotMeasurable, Target
from labkit.lab.verdict import Verdict, checked_lines, verdict_table

__all__ = ["run", "load", "Result", "use_profile"]

_CURRENT: dict[str, Profile] = {}


def use_profile(profile: Profile) -> None:
    """The profile :func:`run` uses when given none (a notebook's setup sets it once)."""
    _CURRENT["profile"] = profile


def current_profile() -> Profile:
    return _CURRENT.get("profile") or get_profile()


@dataclass
class Result:
    """One measurement's outcome: ``tables`` (``rows`` and what derives from them), ``verdicts``,
    ``env`` (commit, versions) and ``machine`` (how busy it was). Figures are drawn by :meth:`plot`."""

    spec: Experiment
    profile: Profile
    sizes: Sizes
    tables: Tables
    verdicts: list[Verdict]
    env: dict[str, Any]
    machine: dict[str, Any]
    elapsed_s: float
    target: str = ""
    folder: Path = Path()
    measured: list[str] = field(default_factory=lambda: ["rows"])  # tables measured, not derived
    figures: list[Path] = field(default_factory=list)

    def __repr__(self) -> str:
        trials = len(self.tables.get("rows", ()))
        missing = self.tables.get("not_measurable")
        gaps = "" if missing is None or missing.empty else f"; {len(missing)} not measurable (see not_measurable)"
        if missing is not None and not missing.empty and not trials:  # nothing measured: the one line that says why
            gaps = f"; not measurable against this target, because {missing.because.iloc[0]}"
        return (
            f"{self.spec.name} on {self.target}: {trials} rows in {self.elapsed_s:.1f} s{gaps}\n"
            f"{provenance_line(self.env, self.machine)}"
        )

    def table(self, name: str = "rows") -> pd.DataFrame:
        """A table by name; where the target could not witness what it derives from, the
        "not measurable" rows saying why (so a notebook's table cell runs against any target)."""
        if name not in self.tables and "not_measurable" in self.tables:
            return self.tables["not_measurable"]
        return self.tables[name]

    def verdict_table(self) -> pd.DataFrame:
        return verdict_table(self.verdicts)

    def checked(self) -> str:
        """The checked verdicts, one ``name: outcome`` line each (an nbval-checked cell prints this)."""
        return checked_lines(self.verdicts)

    def scale(self) -> pd.DataFrame:
        return self.spec.scale(self.sizes)

    def plot(self, save: bool = True) -> list[Any]:
        """The experiment's figures from the kept tables (nothing is measured again); saved under
        the profile's ``figures/`` unless ``save`` is False."""
        from labkit.plots import savefig

        if self.tables.get("rows") is None or self.tables["rows"].empty:
            return []
        figures = self.spec.plots(self.tables, self.sizes)
        if save:
            self.figures = [savefig(fig, folder=self.profile.figures_dir) for fig in figures]
            self._write_record()
        return figures

    def save(self) -> Path:
        """Every table as CSV and ``results.json``, replacing the partial rows."""
        self.folder.mkdir(parents=True, exist_ok=True)
        for name, table in self.tables.items():
            table.to_csv(self.folder / f"{name}.csv", index=False)
        shutil.rmtree(self.folder / "partial", ignore_errors=True)
        return self._write_record()

    def _write_record(self) -> Path:
        record = {
            "experiment": self.spec.name,
            "title": self.spec.title,
            "target": self.target,
            "environment": self.env,
            "machine": self.machine,
            "elapsed_s": round(self.elapsed_s, 3),
            "sizes": self.sizes.as_dict(),
            "beside_the_chapter": self.scale().reset_index().to_dict("records"),
            "verdicts": [v.__dict__ for v in self.verdicts],
            "measured": self.measured,
            "tables": {name: {"rows": len(t), "columns": list(map(str, t.columns))} for name, t in self.tables.items()},
            "figures": [str(p.relative_to(self.profile.out_root)) for p in self.figures],
        }
        path = self.folder / "results.json"
        self.folder.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record, indent=2, default=_plain) + "\n")
        return path


def _read(path: Path) -> pd.DataFrame:
    """A saved table; a run that measured nothing saved an empty one."""
    try:
        return pd.read_csv(path)
    except pd.errors.EmptyDataError:
        return pd.DataFrame()


def _plain(value: Any) -> Any:
    return value.item() if hasattr(value, "item") else str(value)


def run(
    spec: Experiment,
    target: Target | None = None,
    *,
    profile: Profile | None = None,
    save: bool = True,
    show: bool = True,
    max_seconds: float | None = None,
    **overrides: Any,
) -> Result:
    """Measure ``spec`` on ``target`` (None: labkit in a background thread, stopped at the end).

    ``max_seconds`` bounds the trials (GuideLLM's ``--max-seconds``; not the target's start or
    ``prepare``): every read ends by then, a trial still running then is dropped, and the trials
    not begun are one row of ``not_measurable``. A bound in seconds is for a target that will not
    end its answers; verdicts on a cut run stand on fewer repetitions."""
    profile = profile or current_profile()
    sizes = spec.sizes_for(profile.name, **overrides)
    owned = target is None
    target = target or LocalLab(profile.model)
    folder = data_folder(spec, profile, lab=owned or getattr(target, "lab_owned", False))
    before, started = MachineState.now(), time.perf_counter()
    try:
        rows, kept, missing = _trials(spec, target, sizes, folder / "partial", show, max_seconds)
    finally:
        if owned:
            target.close()
    tables: Tables = {"rows": pd.DataFrame(rows), **{k: pd.DataFrame(v) for k, v in kept.items()}}
    if missing:
        tables["not_measurable"] = pd.DataFrame(missing)
    measured = list(tables)
    verdicts: list[Verdict] = []
    if rows:
        tables.update(spec.tables(tables, sizes))
        verdicts = spec.verdicts(tables, sizes)
    result = Result(
        spec, profile, sizes, tables, verdicts, environment(profile), machine_record(before, MachineState.now()),
        time.perf_counter() - started, target.name, folder, measured,
    )  # fmt: skip
    if save:
        result.save()
    else:  # the partial rows only guarded against a crash: an unsaved run leaves nothing on disk
        shutil.rmtree(folder / "partial", ignore_errors=True)
    if show:
        print(result)
    return result


def data_folder(spec: Experiment, profile: Profile, lab: bool = True) -> Path:
    """``<data>/<group>/<measurement>``; ``<data>/target-<group>/…`` for a target the lab did not
    start, so measuring another server never overwrites the lab's own results."""
    return profile.data_dir / f"{'' if lab else 'target-'}{spec.group}" / spec.name.split(".", 1)[-1]


def _trials(
    spec: Experiment, target: Target, sizes: Sizes, partial: Path, show: bool, max_seconds: float | None = None
) -> tuple[list[dict[str, Any]], dict[str, list[dict[str, Any]]], list[dict[str, Any]]]:
    rows: list[dict[str, Any]] = []
    kept: dict[str, list[dict[str, Any]]] = {}
    missing: list[dict[str, Any]] = []
    try:
        target.need(*spec.needs, what=spec.name)
        conditions = list(spec.conditions(sizes, target))
        state = spec.prepare(target, sizes) if spec.prepare else None
    except NotMeasurable as exc:
        return rows, kept, [{"measurement": exc.what, "condition": "(all)", "because": exc.because}]
    repetitions = int(sizes.as_dict().get("repetitions", 1))
    bar = _bar(spec.name, len(conditions) * repetitions, show)
    skipped: set[int] = set()
    ends = None if max_seconds is None else time.perf_counter() + max_seconds
    budget, begun = RUN_ENDS.set(ends), 0
    try:
        for rep in range(repetitions):
            order = list(enumerate(conditions))
            for i, condition in order[::-1] if spec.alternate and rep % 2 else order:
                if ends is not None and time.perf_counter() >= ends:
                    missing.append(_spent(spec, len(conditions) * repetitions - begun))
                    return rows, kept, missing
                begun += 1
                if i in skipped:
                    bar.update(1)
                    continue
                label = ", ".join(f"{k}={v}" for k, v in condition.items()) or "the one condition"
                bar.set_postfix_str(f"{label}; repetition {rep + 1}/{repetitions}")
                try:
                    settings = spec.server(sizes, condition) if target.caps.settings else {}
                    trial = Trial(target.variant(**settings), dict(condition), sizes, rep, state)
                    with collector_paused():
                        began = time.perf_counter()
                        out = spec.measure(trial)
                        took = time.perf_counter() - began
                except NotMeasurable as exc:
                    skipped.add(i)
                    missing.append({"measurement": exc.what, "condition": label, "because": exc.because})
                    bar.update(1)
                    continue
                except Exception as exc:
                    if ends is None or time.perf_counter() < ends:
                        raise
                    print(f"{spec.name}: a trial failed as the budget ran out ({type(exc).__name__}: {exc})"[:300])
                if ends is not None and time.perf_counter() >= ends:  # its reads may have been cut: not kept
                    missing.append(_spent(spec, len(conditions) * repetitions - begun + 1))
                    return rows, kept, missing
                tag = {**condition, "repetition": rep}
                rows += [{**tag, **row} for row in ([out] if isinstance(out, dict) else out)]
                for name, more in trial.kept.items():
                    kept.setdefault(name, []).extend({**tag, **row} for row in more)
                kept.setdefault("trial_seconds", []).append({**tag, "seconds": round(took, 3)})  # what a size costs
                _keep(partial, {"rows": rows, **kept})
                bar.update(1)
    except BaseException:
        print(f"{spec.name}: stopped; the trials finished so far are in {partial}")
        raise
    finally:
        RUN_ENDS.reset(budget)
        bar.close()
        if state is not None and hasattr(state, "close"):
            state.close()  # engines or servers the experiment's prepare started
    return rows, kept, missing


def _spent(spec: Experiment, left: int) -> dict[str, Any]:
    return {"measurement": spec.name, "condition": f"the last {left} trials", "because": "max_seconds was spent"}


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """timeit's rule, for a trial: no garbage collection while its clocks run. The lab's client
    (and a labkit in this process) share the heap with the model: a full collection walks it in
    about 0.3 s with the GIL held, a pause the tables would charge to the server. Objects still
    go when their last reference does; cycles wait for the collector, which runs between trials."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _keep(folder: Path, tables: dict[str, list[dict[str, Any]]]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, rows in tables.items():
        pd.DataFrame(rows).to_csv(folder / f"{name}.csv", index=False)


def _bar(name: str, total: int, show: bool) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=name, unit="trial", disable=not show, leave=True)


def load(spec: Experiment, profile: Profile | None = None, *, lab: bool = True) -> Result:
    """A saved run read back: its measured tables, with the derived ones and the verdicts
    recomputed from them (nothing is measured again). ``lab=False``: a run against another target."""
    profile = profile or current_profile()
    folder = data_folder(spec, profile, lab)
    record = json.loads((folder / "results.json").read_text())
    sizes = Sizes({k: tuple(v) if isinstance(v, list) else v for k, v in record["sizes"].items()})
    tables: Tables = {name: _read(folder / f"{name}.csv") for name in record["measured"]}
    verdicts: list[Verdict] = []
    if not tables["rows"].empty:
        tables.update(spec.tables(tables, sizes))
        verdicts = spec.verdicts(tables, sizes)
    return Result(
        spec, profile, sizes, tables, verdicts, record["environment"], record["machine"], record["elapsed_s"],
        record.get("target", ""), folder, list(record["measured"]),
    )  # fmt: skip
