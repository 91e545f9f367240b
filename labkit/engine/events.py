"""What the engine tells the world: one event per token made and one per sequence finished.

Each event carries ``step``, the number of the engine step that made it (the engine's step clock,
see ``BatchEngine.step``): steps do not jitter with the machine the way seconds do. Events made
outside an engine (test doubles) default to step 0, which no engine step has.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

FinishReason = Literal["length", "eos", "stop", "cancelled", "error"]
"""Why a request left the engine. ``error``: this request alone failed inside a step (its next
token could not be drawn); its blocks were released and its neighbours went on."""


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class TokenEvent:
    """Token number ``index`` (0-based) of request ``rid``; ``text`` is the UTF-8-safe delta."""

    rid: str
    index: int
    token_id: int
    text: str
    time: float  # time.perf_counter() when the token was sampled
    step: int = 0  # the engine step that sampled it (1 is the first)


@dataclass(frozen=True)
class FinishEvent:
    """Request ``rid`` left the engine; its blocks were released at ``time`` (perf_counter).

    ``error`` is a short message fit for a client when ``reason == "error"`` (no internal names).
    """

    rid: str
    reason: FinishReason
    usage: Usage
    time: float
    step: int = 0  # the engine step that released it (1 is the first)
    error: str | None = None


Event = TokenEvent | FinishEvent


@dataclass(frozen=True)
class StepRecord:
    """One engine step on the clock: its number, when it began and how long it took (perf_counter
    seconds), how many sequences it decoded, how many prompts it prefilled a chunk of and how
    many prompt tokens those chunks held; ``surge``: its prompts had the surge budget (more were
    waiting to start than streams decoding, see scheduler.py). The spread of ``seconds`` over a
    run says how steady the machine was; effects are counted in steps."""

    step: int
    started: float
    seconds: float
    decoded: int
    prefilled: int
    prefill_tokens: int = 0
    surge: bool = False
