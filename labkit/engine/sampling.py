"""Choosing the next token from one row of logits.

Each request samples with its own ``torch.Generator`` seeded from its ``seed``, so what a
sampled request draws depends on its own logits and seed only, never on which neighbours
shared the step.
"""
from __future__ import annotations

import secrets

import torch

from labkit.engine.sequence import SamplingParams


def make_generator(params: SamplingParams, device: str = "cpu") -> torch.Generator | None:
    if params.greedy:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(params.seed if params.seed is not None else secrets.randbits(63))
    return gen


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Pick a token id from a float32 ``(vocab,)`` row: argmax when greedy, else temperature + top-p."""
    if params.greedy:
        return int(torch.argmax(logits))
    logits = logits.float()
    # Shift the best logit to 0 before dividing: a tiny temperature then sends the others to
    # -inf (probability 0) instead of overflowing every entry to inf and the softmax to NaN.
    probs = torch.softmax((logits - logits.max()) / params.temperature, dim=-1)
    if params.top_p < 1.0:
        probs = _top_p(probs, params.top_p)
    return int(torch.multinomial(probs, 1, generator=generator))


def _top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches ``top_p``."""
    sorted_probs, order = torch.sort(probs, descending=True)
    before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    sorted_probs[before >= top_p] = 0.0
    kept = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return kept / kept.sum()
