"""Choosing the next token for each row of a batch of logits.

Greedy rows take one argmax over the whole batch. Sampled rows (temperature and top-p) are
scaled, softmaxed and filtered together, then each draws with its own ``torch.Generator``, seeded
from its ``seed`` and living on the engine's device, so what a sampled request draws depends on
its own logits and seed only, never on which neighbours shared the step. A draw is one
``torch.multinomial`` per sampled row: that is the price of per-request generators, and exactly
the call a request made alone, which keeps seeded output what it always was.

A row whose distribution is not valid (NaN or no mass: a model overflow, parameters corrupted
after validation) gets ``None`` instead of a token, and the engine ends that request alone.
"""
from __future__ import annotations

import logging
import secrets
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch
from torch import Tensor

from labkit.engine.sequence import SamplingParams, Sequence

log = logging.getLogger(__name__)


def make_generator(params: SamplingParams, device: str | torch.device) -> torch.Generator | None:
    """A generator on ``device`` (where the logits are: multinomial needs both in one place)."""
    if params.greedy:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(params.seed if params.seed is not None else secrets.randbits(63))
    return gen


@dataclass
class _Rows:
    """The per-batch tensors sampling needs, kept while the batch's sampled rows stay the same."""

    key: tuple[object, ...]
    params: list[SamplingParams]  # held, so that the ids in the key stay theirs
    index: Tensor | None  # the same on the device; None when every row samples
    temperature: Tensor  # (k, 1)
    top_p_rows: Tensor | None  # which of the k sampled rows filter by top-p; None when none does
    top_p: Tensor | None  # (len(top_p_rows), 1)


class Sampler:
    """One token per row; see the module docstring. Call from the step thread only."""

    def __init__(self, device: str | torch.device) -> None:
        self.device = torch.device(device)
        self._rows: _Rows | None = None

    def sample(self, logits: Tensor, seqs: Seq[Sequence]) -> list[int | None]:
        """Token ids for float32 ``logits`` of shape ``(len(seqs), vocab)``, ``None`` for a row that failed."""
        greedy = torch.argmax(logits, dim=-1)
        sampled = [row for row, seq in enumerate(seqs) if not seq.params.greedy]
        if not sampled:
            return greedy.tolist()
        tokens: list[int | None] = greedy.tolist()
        try:
            dists = self._distributions(logits, seqs, sampled)
        except Exception:  # whatever broke the batch, find the rows it belongs to
            log.warning("batched sampling failed; sampling its rows one by one", exc_info=True)
            dists = [self._distribution_alone(logits[row:row + 1], seqs[row]) for row in sampled]
        picks: list[Tensor] = []
        drew: list[int] = []  # the rows whose draw is in picks, in order
        for row, probs in zip(sampled, dists):
            tokens[row] = None
            if probs is None:
                continue
            try:
                picks.append(torch.multinomial(probs, 1, generator=seqs[row].generator))
                drew.append(row)
            except Exception:  # this request ends with reason "error"; the rest go on
                log.warning("drawing a token for request %r failed", seqs[row].rid, exc_info=True)
        if picks:  # one transfer for every draw of the step
            for row, token in zip(drew, torch.cat(picks).tolist()):
                tokens[row] = token
        return tokens

    def _distributions(self, logits: Tensor, seqs: Seq[Sequence], sampled: list[int]) -> list[Tensor | None]:
        """Each sampled row's probabilities, or None where they are not a distribution."""
        rows = self._batch_rows(seqs, sampled, len(logits))
        x = logits if rows.index is None else logits.index_select(0, rows.index)
        probs = _probabilities(x.float(), rows.temperature, rows.top_p_rows, rows.top_p)
        valid = (torch.isfinite(probs).all(dim=-1) & (probs.sum(dim=-1) > 0)).tolist()
        return [probs[k] if ok else None for k, ok in enumerate(valid)]

    def _distribution_alone(self, logits: Tensor, seq: Sequence) -> Tensor | None:
        """One row alone, for when the batch raised: a row that still raises is that row's failure."""
        self._rows = None
        try:
            return self._distributions(logits, [seq], [0])[0]
        except Exception:
            return None
        finally:
            self._rows = None

    def _batch_rows(self, seqs: Seq[Sequence], sampled: list[int], batch: int) -> _Rows:
        key = (batch, *((seqs[row].number, id(seqs[row].params)) for row in sampled))
        if self._rows is not None and self._rows.key == key:
            return self._rows
        params = [seqs[row].params for row in sampled]
        filtered = [k for k, p in enumerate(params) if p.top_p < 1.0]
        dev = self.device
        self._rows = _Rows(
            key=key,
            params=params,
            index=None if len(sampled) == batch else torch.tensor(sampled, device=dev),
            temperature=torch.tensor([[p.temperature] for p in params], dtype=torch.float32, device=dev),
            top_p_rows=torch.tensor(filtered, device=dev) if filtered else None,
            top_p=torch.tensor([[params[k].top_p] for k in filtered], dtype=torch.float32, device=dev)
            if filtered else None,
        )
        return self._rows


def _probabilities(logits: Tensor, temperature: Tensor, top_p_rows: Tensor | None,
                   top_p: Tensor | None) -> Tensor:
    # Shift the best logit to 0 before dividing: a tiny temperature then sends the others to
    # -inf (probability 0) instead of overflowing every entry to inf and the softmax to NaN.
    shifted = logits - logits.amax(dim=-1, keepdim=True)
    probs = torch.softmax(shifted / temperature, dim=-1)
    if top_p_rows is not None and top_p is not None:
        probs.index_copy_(0, top_p_rows, _top_p(probs.index_select(0, top_p_rows), top_p))
    return probs


def _top_p(probs: Tensor, top_p: Tensor) -> Tensor:
    """Keep, per row, the smallest set of most likely tokens whose mass reaches ``top_p`` (k, 1).

    The most likely token is always kept, so a ``top_p`` too small for float32 leaves one token
    rather than none (which would divide zero by zero).
    """
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
    before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    drop = before >= top_p
    drop[:, 0] = False
    sorted_probs[drop] = 0.0
    kept = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return kept / kept.sum(dim=-1, keepdim=True)

