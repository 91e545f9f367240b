"""What the engine tells the world: one event per token made and one per sequence finished."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Union

FinishReason = Literal["length", "eos", "stop", "cancelled"]


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class TokenEvent:
    """Token number ``index`` (0-based) of request ``rid``; ``text`` is the UTF-8-safe delta."""

    rid: str
    index: int
    token_id: int
    text: str
    time: float  # time.perf_counter() when the token was sampled


@dataclass(frozen=True)
class FinishEvent:
    """Request ``rid`` left the engine; its blocks were released at ``time`` (perf_counter)."""

    rid: str
    reason: FinishReason
    usage: Usage
    time: float


Event = Union[TokenEvent, FinishEvent]
