"""The engine: a paged KV cache, a scheduler, a model runner and the step loop that drives them.

Nothing here imports asyncio, FastAPI or the hub, so the engine can be tested on its own. Its
public face beyond ``labkit.BatchEngine`` and ``labkit.EngineConfig``: the events a step returns
(:class:`TokenEvent`, :class:`FinishEvent`) and :func:`logits_probe` (the runner's logits for rows
alone and in batches), which the lab's in-process measurements use instead of the parts inside.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from labkit.engine.events import FinishEvent, TokenEvent

__all__ = ["FinishEvent", "TokenEvent", "logits_probe"]

if TYPE_CHECKING:  # pragma: no cover
    from labkit.engine.probe import logits_probe


def __getattr__(name: str) -> Any:
    """The probe imports torch's runner: only when it is first used."""
    if name == "logits_probe":
        from labkit.engine.probe import logits_probe

        return logits_probe
    raise AttributeError(f"module 'labkit.engine' has no attribute {name!r}")
