"""``load_model``: one entry point for labkit's named models, hub ids and local folders."""

from __future__ import annotations

from collections.abc import Callable

from labkit.models.hf_cache import load_pretrained
from labkit.models.loaded import LoadedModel
from labkit.models.smollm2 import load_smollm2
from labkit.models.tiny import tiny_gpt2, tiny_llama

#: labkit's own names; each loads without the network.
LOADERS: dict[str, Callable[[], LoadedModel]] = {
    "tiny-gpt2": tiny_gpt2,
    "tiny-llama": tiny_llama,
    "smollm2-135m": load_smollm2,
}


def known_models() -> list[str]:
    """The names ``load_model`` understands without a path or a cached hub id."""
    return list(LOADERS)


def load_model(name_or_path: str) -> LoadedModel:
    """Load a model by labkit name, local folder, or hub id already in the local HF cache.

    Every model comes back in eval mode, float32, with gradients off. Raises UnknownModel
    (or its subclasses WeightsNotCached and UnsupportedArchitecture) with a one-line reason.
    """
    loader = LOADERS.get(name_or_path)
    if loader is not None:
        return loader()
    return load_pretrained(name_or_path, known_models())
