"""Shared fixtures: the tiny models are loaded once per test session."""
from __future__ import annotations


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
