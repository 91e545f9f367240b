"""An experiment as data: its sizes per profile, its conditions, and what one trial measures.

One :class:`Experiment` is one measurement (a notebook runs several, one per cell). It names its
sizes for each profile (``full`` is the chapter's unless :attr:`Experiment.chapter` says where and
why not), builds its conditions from them and from what the target can do, and measures one
condition on one target in :attr:`Experiment.measure`, returning a row (or rows); the runner
(:func:`labkit.lab.runner.run`) interleaves the repetitions, keeps every row, and turns them into
tables, verdicts and figures with the experiment's own functions. Where the engine is what is
timed, sizes count steps and tokens, not seconds, so a faster or slower engine changes no verdict.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from labkit.lab.target import Target
from labkit.lab.verdict import Verdict

__all__ = ["Sizes", "Experiment", "Trial", "Tables"]

Tables = dict[str, pd.DataFrame]
Row = dict[str, Any]


class Sizes:
    """An experiment's sizes, read as ``sizes.levels`` or ``sizes["levels"]``, checked when
    changed: an override must name a known size and keep its kind. (Not a Mapping, so that no
    method name such as ``values`` hides a size of that name.)"""

    def __init__(self, values: Mapping[str, Any] | None = None, **more: Any) -> None:
        object.__setattr__(self, "_values", {**(values or {}), **more})

    def __getattr__(self, name: str) -> Any:
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(name) from None

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("Sizes are fixed; use changed(...)")

    def __getitem__(self, key: str) -> Any:
        return self._values[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __contains__(self, key: object) -> bool:
        return key in self._values

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sizes) and self._values == other._values

    def __repr__(self) -> str:
        return f"Sizes({self._values!r})"

    def as_dict(self) -> dict[str, Any]:
        return dict(self._values)

    def keys(self) -> Any:  # so that dict(sizes) and **sizes work
        return self._values.keys()

    def changed(self, **overrides: Any) -> Sizes:
        out = dict(self._values)
        for key, value in overrides.items():
            if key not in out:
                close = difflib.get_close_matches(key, list(out), n=3)
                hint = f" (did you mean {', '.join(close)}?)" if close else f"; known: {', '.join(out)}"
                raise ValueError(f"no size named {key!r}{hint}")
            old = out[key]
            if isinstance(old, tuple) and isinstance(value, list):
                value = tuple(value)
            if (
                old is not None
                and not isinstance(value, type(old))
                and not (isinstance(old, float) and isinstance(value, int))
            ):
                raise ValueError(f"size {key!r} is a {type(old).__name__}, got {value!r}")
            out[key] = value
        return Sizes(out)


def _nothing(*_: Any) -> Any:
    return {}


@dataclass(frozen=True)
class Experiment:
    """One measurement, as data. See the module docstring.

    ``conditions(sizes, target)`` lists the conditions (dicts of named values, in run order);
    ``server(sizes, condition)`` the settings a condition's server needs (asked only of targets
    that can start servers with settings); ``prepare(target, sizes)`` runs once before the trials
    (a warm-up, a baseline) and its value is ``trial.state``; ``measure(trial)`` returns a row or
    rows; ``tables(rows, sizes)``, ``verdicts(tables, sizes)`` and ``plots(tables, sizes)`` derive
    the rest. ``needs`` names the target capabilities without which nothing here can be measured.
    ``chapter`` maps a size to ``(the chapter's value, why this run differs)`` where they differ.
    ``alternate`` runs the conditions in reverse order every other repetition (A B C, C B A, …):
    for servers that take turns, so none always runs first after another's load.
    """

    name: str
    title: str
    sizes: Mapping[str, Mapping[str, Any]]
    measure: Callable[[Trial], Row | list[Row]]
    conditions: Callable[[Sizes, Target], Sequence[Row]] = lambda sizes, target: [{}]
    server: Callable[[Sizes, Row], Row] = _nothing
    prepare: Callable[[Target, Sizes], Any] | None = None
    tables: Callable[[pd.DataFrame, Sizes], Tables] = _nothing
    verdicts: Callable[[Tables, Sizes], list[Verdict]] = lambda tables, sizes: []
    plots: Callable[[Tables, Sizes], list[Any]] = lambda tables, sizes: []
    needs: tuple[str, ...] = ()
    chapter: Mapping[str, tuple[Any, str]] = field(default_factory=dict)
    alternate: bool = False

    @property
    def group(self) -> str:
        """The notebook's experiment this measurement belongs to (``overlap`` of ``overlap.levels``)."""
        return self.name.split(".")[0]

    def sizes_for(self, profile: str, **overrides: Any) -> Sizes:
        return Sizes(self.sizes[profile]).changed(**overrides)

    def scale(self, sizes: Sizes) -> pd.DataFrame:
        """Each size against the chapter's: "chapter | this run | why" where they differ."""
        rows = []
        for key, value in sizes.as_dict().items():
            chapter, why = self.chapter.get(key, (value, ""))
            rows.append({"size": key, "this run": _text(value), "chapter": _text(chapter), "why it differs": why})
        table = pd.DataFrame(rows, columns=["size", "this run", "chapter", "why it differs"])
        table.loc[table["this run"] == table["chapter"], "why it differs"] = ""
        return table.set_index("size")


def _text(value: Any) -> str:
    if isinstance(value, (tuple, list)):
        return ", ".join(map(str, value)) if value else "(none)"
    return f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else str(value)


@dataclass
class Trial:
    """One condition of one repetition, as :attr:`Experiment.measure` sees it.

    ``keep(table, rows)`` adds rows to a named side table (one row per stream, say) beside the
    trial's own row; the condition's values and the repetition are added to every row.
    """

    target: Target
    condition: Row
    sizes: Sizes
    repetition: int
    state: Any = None
    kept: dict[str, list[Row]] = field(default_factory=dict)

    def keep(self, table: str, rows: Row | list[Row]) -> None:
        self.kept.setdefault(table, []).extend([rows] if isinstance(rows, dict) else rows)

    def __getattr__(self, name: str) -> Any:  # trial.level reads condition["level"]
        condition = self.__dict__.get("condition", {})
        if name in condition:
            return condition[name]
        raise AttributeError(name)
