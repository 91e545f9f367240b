"""One plot style for every figure, and one way to save a figure.

Every figure the lab publishes goes through :func:`savefig`, so one command regenerates all of
them and a figure's file name always says which experiment drew it. A figure's name is its
matplotlib label (``fig.set_label("overlap_throughput")``), set by the experiment's ``plot``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.figure import Figure

__all__ = ["apply_style", "new_figure", "savefig", "with_range", "cdf"]

STYLE = {
    "figure.figsize": (6.4, 3.8),
    "figure.dpi": 100,
    "savefig.dpi": 130,
    "savefig.bbox": "tight",
    "axes.grid": True,
    "grid.alpha": 0.3,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.titlesize": 11,
    "axes.labelsize": 10,
    "legend.fontsize": 9,
    "legend.frameon": False,
}


def apply_style() -> None:
    """Set the lab's rcParams (matplotlib itself falls back to Agg where there is no display)."""
    import matplotlib

    matplotlib.rcParams.update(STYLE)  # type: ignore[arg-type]  # keys checked by matplotlib at run time


def new_figure(name: str, ncols: int = 1, width: float | None = None) -> tuple[Figure, list]:
    """A figure labelled ``name`` (its file name) with ``ncols`` axes side by side."""
    import matplotlib.pyplot as plt

    apply_style()
    w = width or 6.4 * (1 if ncols == 1 else 0.75 * ncols)
    fig, axes = plt.subplots(1, ncols, figsize=(w, 3.8), squeeze=False)
    fig.set_label(name)
    return fig, list(axes[0])


def savefig(fig: Figure, folder: Path, name: str | None = None) -> Path:
    """Write ``fig`` as ``<folder>/<name>.png`` (name: the figure's label)."""
    stem = name or fig.get_label()
    if not stem:
        raise ValueError("a figure needs a name: pass one or set it with fig.set_label(...)")
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{stem}.png"
    fig.savefig(path)
    return path


def cdf(ax: Any, values: Any, scale: float = 1.0, **style: Any) -> None:
    """The empirical distribution of ``values`` (NaNs dropped) as a step line."""
    import numpy as np

    data = np.sort(scale * np.asarray([v for v in values if v == v], dtype=float))
    ax.plot(data, np.arange(1, len(data) + 1) / max(1, len(data)), drawstyle="steps-post", **style)


def with_range(ax: Any, x: Any, table: Any, column: str, scale: float = 1.0, **style: Any) -> None:
    """``column_median`` as a line with markers, ``column_min``–``column_max`` as error bars (the
    columns :func:`labkit.lab.spread` makes)."""
    med, lo, hi = (scale * table[f"{column}_{s}"].to_numpy() for s in ("median", "min", "max"))
    ax.errorbar(x, med, yerr=[med - lo, hi - med], capsize=3, **style)
