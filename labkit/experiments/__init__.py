"""The lab's experiments: one module each, found by name.

Every experiment module provides the same few names, so the CLI, the notebooks and the tests
drive all of them the same way:

``NAME: str``
    The experiment's name (``labkit run NAME``; ``data/NAME/``; figure names start with it).
``Config``
    A frozen dataclass with a ``model`` field and ``Config.for_profile(profile) -> Config``
    (``profile`` is a :class:`labkit.experiments.profiles.Profile`; its ``model`` is the default).
``server_options(config) -> dict``
    Keyword arguments for ``labkit.serve_in_thread`` (model, policy, engine and hub settings),
    so a notebook can start the server itself and pass it to ``run``.
``run(config, *, server=None, progress=None) -> dict[str, pandas.DataFrame]``
    Runs the measurement and returns named tables. Without ``server`` it starts its own with
    :func:`labkit.experiments.servers.serving` and stops it; ``progress`` gets ``update(n)`` calls.
``plot(tables) -> list[matplotlib.figure.Figure]``
    Each figure labelled with its file name (``fig.set_label``), which ``labkit.plots.savefig`` uses.

Optional: ``units(config) -> int`` (the progress bar's total) and ``summary(tables) -> dict``
(headline numbers for ``results.json`` and the notebooks' closing notes).

New experiments are added by a line in :data:`EXPERIMENTS`; a module not yet written is simply
not listed by :func:`names`.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

__all__ = ["EXPERIMENTS", "names", "load"]

#: experiment name -> module, in the order ``labkit run all`` runs them.
EXPERIMENTS: dict[str, str] = {
    "wire": "labkit.experiments.wire",
    "isolation": "labkit.experiments.isolation",
    "overlap": "labkit.experiments.overlap",
    "buffers": "labkit.experiments.buffers",
    "slowclient": "labkit.experiments.slowclient",
    "disconnect": "labkit.experiments.disconnect",
    "leak": "labkit.experiments.leak",
    "extensions": "labkit.experiments.extensions",
    "production": "labkit.experiments.production",
}


def names() -> list[str]:
    """Experiments whose module exists in this checkout, in run order."""
    return [name for name, module in EXPERIMENTS.items() if importlib.util.find_spec(module) is not None]


def load(name: str) -> ModuleType:
    """The module of experiment ``name``; KeyError with the known names otherwise."""
    if name not in EXPERIMENTS:
        raise KeyError(f"unknown experiment {name!r}; known: {', '.join(EXPERIMENTS)}")
    return importlib.import_module(EXPERIMENTS[name])
