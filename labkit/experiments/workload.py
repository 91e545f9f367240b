"""What the slow-client experiments send: requests for the lab's fixed prompts, and which of
those prompts make a model write long enough to be read slowly or left half-way."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from labkit.prompts import PROMPTS

__all__ = ["stream_body", "bodies", "long_prompts"]


def stream_body(index: int, tokens: int, **extra: Any) -> dict[str, Any]:
    """The request for fixed prompt ``index`` (the lab's 32 prompts, in turn)."""
    return {"prompt": PROMPTS[index % len(PROMPTS)], "max_new_tokens": tokens, **extra}


def bodies(prompts: Sequence[int], count: int, tokens: int, **extra: Any) -> list[dict[str, Any]]:
    """``count`` requests cycling through the prompt indices ``prompts``."""
    return [stream_body(prompts[i % len(prompts)], tokens, **extra) for i in range(count)]


_SCREENED: dict[str, dict[int, tuple[int, int]]] = {}  # model -> prompt -> (tokens asked, answer length)


def long_prompts(model: Any, tokens: int, want: int = 8) -> list[int]:
    """Indices of ``want`` prompts (or all there are) whose greedy answer runs ``tokens`` tokens.

    Why: an instruction-tuned model answers some bare prompts with an end-of-sequence token at
    once, and a stream that ends after one token cannot be read slowly or left half-way. The
    engine itself decodes the prompts in order, ``want`` at a time, until enough are found;
    results are kept for the process (the engine is batch-invariant, so the server agrees).
    """
    known = _SCREENED.setdefault(model.name, {})

    def long_enough() -> list[int]:
        return [i for i, (_, n) in sorted(known.items()) if n >= tokens]

    for start in range(0, len(PROMPTS), want):
        if len(long_enough()) >= want:
            break
        todo = [
            i
            for i in range(start, min(start + want, len(PROMPTS)))
            if i not in known or known[i][1] == known[i][0] < tokens
        ]  # unknown, or ran out of tokens
        lengths = _answer_lengths(model, [PROMPTS[i] for i in todo], tokens) if todo else []
        known.update((i, (tokens, n)) for i, n in zip(todo, lengths))
    if not long_enough():
        raise RuntimeError(f"no prompt makes {model.name} write {tokens} tokens before it ends")
    return long_enough()[:want]


def _answer_lengths(model: Any, prompts: list[str], tokens: int) -> list[int]:
    from labkit.engine.config import EngineConfig
    from labkit.engine.engine import BatchEngine
    from labkit.engine.events import FinishEvent

    longest = max(len(model.tokenizer.encode(p)) for p in prompts) + tokens
    blocks = len(prompts) * -(-longest // 16)  # just what they need, not the default half gigabyte
    engine = BatchEngine(model, EngineConfig(max_batch=len(prompts), num_blocks=blocks, block_size=16))
    rids = [engine.submit(prompt, max_new_tokens=tokens) for prompt in prompts]
    lengths: dict[str, int] = {}
    for _ in range(tokens + 2):
        lengths.update((e.rid, e.usage.completion_tokens) for e in engine.step() if isinstance(e, FinishEvent))
        if not engine.has_work():
            break
    return [lengths.get(rid, 0) for rid in rids]
