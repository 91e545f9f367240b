"""labkit: a continuous-batching engine, an SSE wire format and a streaming service, measured.

The public face is small; everything else is reached through its module.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["load_model", "BatchEngine", "EngineConfig", "serve_in_thread", "default_device"]
__version__ = "0.1.0"

_LAZY = {
    "load_model": "labkit.models",
    "BatchEngine": "labkit.engine.engine",
    "EngineConfig": "labkit.engine.config",
    "serve_in_thread": "labkit.server",
    "default_device": "labkit.machine",
}

if TYPE_CHECKING:  # pragma: no cover
    from labkit.engine.config import EngineConfig
    from labkit.engine.engine import BatchEngine
    from labkit.machine import default_device
    from labkit.models import load_model
    from labkit.server import serve_in_thread


def __getattr__(name: str) -> Any:
    """Import heavy parts (torch, FastAPI) only when they are first used."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'labkit' has no attribute {name!r}")
