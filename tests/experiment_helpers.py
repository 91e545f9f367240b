"""Assertions shared by the experiment tests."""
from __future__ import annotations

import pandas as pd


def assert_columns(table: pd.DataFrame, *names: str) -> None:
    missing = set(names) - set(table.columns)
    assert not missing, f"missing columns {sorted(missing)}"


def assert_figures_are_labelled(module, tables) -> None:
    """Every figure an experiment draws carries a label starting with the experiment's name."""
    import matplotlib.pyplot as plt

    figures = module.plot(tables)
    assert figures and all(f.get_label().startswith(module.NAME) for f in figures)
    for fig in figures:
        plt.close(fig)
