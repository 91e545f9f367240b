"""Helpers for engine tests: an engine that checks its books after every step, and runners."""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

from prompt_lists import ENGINE_PROMPTS

from labkit.engine.config import EngineConfig
from labkit.engine.engine import BatchEngine
from labkit.engine.events import Event, FinishEvent, TokenEvent

PROMPTS = ENGINE_PROMPTS  # handed on under the name the tests use


class CheckedEngine(BatchEngine):
    """A BatchEngine whose cache books are verified after every step."""

    def step(self, on_event=None) -> list[Event]:
        events = super().step(on_event)
        self.check_integrity()
        return events


@dataclass
class Outcome:
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    reason: str | None = None
    usage: object = None


def make_engine(model, **config) -> CheckedEngine:
    config.setdefault("max_batch", 32)
    config.setdefault("block_size", 4)
    return CheckedEngine(model, EngineConfig(**config))


def collect(events: list[Event], outcomes: dict[str, Outcome]) -> None:
    for ev in events:
        out = outcomes.setdefault(ev.rid, Outcome())
        if isinstance(ev, TokenEvent):
            assert ev.index == len(out.tokens), "token events arrive in order, one index at a time"
            out.tokens.append(ev.token_id)
            out.text += ev.text
        else:
            assert isinstance(ev, FinishEvent) and out.reason is None, "exactly one finish per request"
            out.reason, out.usage = ev.reason, ev.usage


def drain(engine: BatchEngine, outcomes: dict[str, Outcome] | None = None, max_steps: int = 2000) -> dict[str, Outcome]:
    """Step until the engine has nothing left to do."""
    outcomes = {} if outcomes is None else outcomes
    for _ in range(max_steps):
        if not engine.has_work():
            return outcomes
        collect(engine.step(), outcomes)
    raise AssertionError(f"engine still busy after {max_steps} steps")


def solo(model, prompt, max_new_tokens: int = 16, **kwargs) -> Outcome:
    engine = make_engine(model)
    rid = engine.submit(prompt, max_new_tokens=max_new_tokens, **kwargs)
    return drain(engine)[rid]


def with_eos(loaded, eos_token_id: int):
    """The same weights, with ``eos_token_id`` declared the end of sequence."""
    model = copy.copy(loaded)
    model.model = copy.copy(loaded.model)
    model.model.config = copy.deepcopy(loaded.model.config)
    model.model.config.eos_token_id = eos_token_id
    return model


def assert_all_released(engine: BatchEngine) -> None:
    stats = engine.stats()
    assert stats["reserved_blocks"] == 0 and stats["free_blocks"] == stats["total_blocks"], stats
    assert stats["running"] == 0 and stats["waiting"] == 0, stats
