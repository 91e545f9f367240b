"""Models labkit can serve: two tiny random ones for tests, SmolLM2-135M offline, and local HF models."""

from labkit.models.hf_cache import UnsupportedArchitecture, WeightsNotCached
from labkit.models.loaded import LoadedModel
from labkit.models.registry import known_models, load_model

__all__ = ["LoadedModel", "UnsupportedArchitecture", "WeightsNotCached", "known_models", "load_model"]
