"""The lab's experiments: one module per notebook, each a few :class:`~labkit.lab.Experiment`
specs (``SPECS``), run by :func:`labkit.lab.run`. One registry: :data:`GROUPS`."""

from __future__ import annotations

import importlib
from importlib.resources import files

from labkit.lab.experiment import Experiment

__all__ = ["GROUPS", "specs", "published"]

#: the notebook experiments, in the order ``labkit run all`` runs them
GROUPS = (
    "wire", "isolation", "overlap", "buffers", "slowclient", "disconnect", "leak", "extensions", "production", "peers",
    "burst", "edge",
)  # fmt: skip


def _module_specs(group: str) -> tuple[Experiment, ...]:
    return tuple(importlib.import_module(f"labkit.experiments.{group}").SPECS)


def specs(name: str) -> list[Experiment]:
    """``all``, a group (``overlap``) or one measurement (``overlap.levels``); KeyError naming the known ones."""
    if name == "all":
        return [spec for group in GROUPS for spec in _module_specs(group)]
    group = name.split(".")[0]
    if group not in GROUPS:
        raise KeyError(f"unknown experiment {name!r}; known: {', '.join(GROUPS)}")
    found = [spec for spec in _module_specs(group) if spec.name == name or spec.group == name]
    if not found:
        raise KeyError(f"unknown measurement {name!r}; {group} has {', '.join(s.name for s in _module_specs(group))}")
    return found


def published(section: str) -> dict[str, str]:
    """The chapter's published figures for one notebook, as the chapter states them (``chapter.toml``)."""
    import tomllib

    text = (files(__package__) / "chapter.toml").read_text(encoding="utf-8")
    return dict(tomllib.loads(text)[section])
