"""One request's state inside the engine, from submit to finish."""

from __future__ import annotations

import enum
import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Self

import torch

from labkit.engine.events import FinishReason

GREEDY_BELOW = 1e-5
"""Temperatures below this are greedy (argmax), as in vLLM (``_SAMPLING_EPS = 1e-5``).

Why not refuse them: ``temperature -> 0`` is greedy decoding in the limit, which is what a client
asking for 1e-9 means, and vLLM (the server most clients were written against) accepts and
treats them so; llama.cpp is greedy only at ``<= 0``. Why not divide by them: a positive value
below ~1.4e-45 becomes 0 in float32, and the division then gives NaN probabilities, on which
``torch.multinomial`` raises inside the step. Deciding here, when the request is made, settles
it before the first byte of a stream.
"""

_seq_numbers = itertools.count(1)  # next() on a count is atomic under the GIL


class RequestId(str):
    """The id ``submit`` returns: a plain string that also remembers which submission it names.

    Ids may be used again once a request is over, so a string alone cannot tell a late cancel of
    a finished request from a cancel of the newer request that took its id. Passed back to
    ``cancel``/``pause``/``resume``, this one can: a wish for a request that is over is dropped.
    """

    number: int

    def __new__(cls, rid: str, number: int) -> Self:
        self = super().__new__(cls, rid)
        self.number = number
        return self

    def __reduce__(self) -> tuple[object, ...]:
        return (RequestId, (str(self), self.number))


@dataclass(frozen=True)
class SamplingParams:
    """What the client asked for. Greedy when ``temperature < GREEDY_BELOW`` (0 included).

    ``top_p`` always keeps the most likely token, so any value in (0, 1] is valid, however small:
    one that underflows in float32 samples only the most likely token (vLLM keeps one the same way).
    """

    max_new_tokens: int = 64
    stop: tuple[str, ...] = ()
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False  # run to max_new_tokens even past eos, as throughput benchmarks do

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or isinstance(self.max_new_tokens, bool) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {_short(self.max_new_tokens)}")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {_short(self.stop)}")
        if not (_is_real(self.temperature) and math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {_short(self.temperature)}")
        if not (_is_real(self.top_p) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {_short(self.top_p)}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise ValueError(f"seed must be an int or None, got {_short(self.seed)}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:  # what torch.Generator accepts
            raise ValueError(f"seed must lie in [-2**63, 2**64), got {_short(self.seed)}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be true or false, got {_short(self.ignore_eos)}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


def _is_real(value: object) -> bool:
    """An int or float (not a bool) that a float can hold: ``10**400`` would overflow in math and torch."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        float(value)
    except OverflowError:
        return False
    return True


def _short(value: object, limit: int = 60) -> str:
    """``repr(value)`` cut short: a refusal must not echo a megabyte of input back."""
    try:
        text = repr(value)
    except ValueError:  # an int past Python's digit limit for str()
        return f"an {type(value).__name__} too long to show"
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """Token ids, sampling state and place in the scheduler of one request.

    A running sequence is first *prefilling*: ``num_prefilled`` of its prompt tokens have their
    K/V in the cache, and each step may add a chunk; the step that adds the last chunk samples
    the first token. After that it decodes: ``pending`` is the last sampled token, not yet in
    the cache, and the next step feeds it at position ``num_cached``. ``number`` is unique for the life of the process, unlike ``rid``,
    which a client may use again once its request is over: the cache's books are kept by number,
    so nothing done to a finished sequence can reach a newer one with the same id.
    ``text`` is the request's TextState (built by the submitting thread).
    """

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    text: Any = None
    number: int = field(default_factory=lambda: next(_seq_numbers))
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    paused: bool = False
    finish_reason: FinishReason | None = None
    num_prefilled: int = 0  # prompt tokens whose K/V are in the cache

    @property
    def prefilling(self) -> bool:
        """Some of the prompt still has to go through the model (no token sampled yet)."""
        return self.num_prefilled < self.num_prompt

    @property
    def decoding(self) -> bool:
        """Running, unpaused and past its prefill: a step gives it one token."""
        return self.status is Status.RUNNING and not self.paused and not self.prefilling

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_output(self) -> int:
        return len(self.output_ids)

    @property
    def reservation(self) -> int:
        """Token slots reserved whole at admission: prompt + max_new_tokens.

        One more than the cache will ever hold (the last token is sampled, never fed back), kept
        so that one number, the one clients reason with, appears in every check.
        """
        return self.num_prompt + self.params.max_new_tokens

    @property
    def pending(self) -> int:
        return self.output_ids[-1]

    @property
    def num_cached(self) -> int:
        return self.num_prompt + self.num_output - 1
