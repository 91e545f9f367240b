"""Shared fixtures: the tiny models are loaded once per test session, and a module's lab server
is one fixture whose model and settings the module names.

The prompt lists the tests share live in ``prompt_lists.py`` beside this file, not here: ``make
test`` collects ``notebooks/conftest.py`` too, and whichever conftest is imported last owns the
module name ``conftest``, so ``from conftest import ...`` is not reliable.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

# One intra-op thread: the tiny models are dominated by per-op overhead, and on a loaded
# 2-core machine a second torch thread makes them many times slower, not faster.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_gpt2():
    from labkit.models import load_model

    return load_model("tiny-gpt2")


@pytest.fixture(scope="session")
def tiny_llama():
    from labkit.models import load_model

    return load_model("tiny-llama")


@pytest.fixture(scope="session", params=["tiny-gpt2", "tiny-llama"])
def tiny_model(request, tiny_gpt2, tiny_llama):
    return tiny_gpt2 if request.param == "tiny-gpt2" else tiny_llama


# --------------------------------------------------------------------------- one lab server a module


@pytest.fixture(scope="module")
def server_model(tiny_gpt2: Any) -> Any:
    """The model a module's ``server`` serves; a module overrides this fixture to serve another."""
    return tiny_gpt2


@pytest.fixture(scope="module")
def server_settings() -> dict[str, Any]:
    """The settings a module's ``server`` starts with; a module overrides this fixture to change them."""
    return {}


@pytest.fixture(scope="module")
def server(server_model: Any, server_settings: dict[str, Any]) -> Iterator[Any]:
    """A checked lab server (``service_helpers.lab_server``) shared by one module's tests."""
    from service_helpers import lab_server

    with lab_server(server_model, **server_settings) as running:
        yield running
