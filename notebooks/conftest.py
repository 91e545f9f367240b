"""pytest settings for the notebooks run under nbval (``make test``).

Every item nbval collects from a notebook carries the ``notebook`` marker, so
``pytest -m "not notebook"`` runs the unit and service tests alone and ``-m notebook`` the
notebooks alone. The hook sees the whole session's items; it marks only the notebooks' cells.
"""
from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.suffix == ".ipynb":
            item.add_marker(pytest.mark.notebook)
