"""Choosing the next token for each row of a batch of logits.

Greedy rows take one argmax over the whole batch. Sampled rows (temperature and top-p) are
scaled, softmaxed and filtered together, then each draws with its own ``torch.Generator``, seeded
from its ``seed`` and living on the engine's device, so what a sampled request draws depends on
its own logits and seed only, never on which neighbours shared the step. Each draw is what
``torch.multinomial(probs, 1, generator)`` draws (the tests hold the two equal), with the random
numbers made row by row (the price of per-request generators) and the rest done for all rows
at once.

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

from labkit.engine.rowwise import argmax_rows
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
    """One token per row; see the module docstring. Call from the step thread only.

    ``native``: greedy rows take the native row-wise argmax (``rowwise.argmax_rows``, the same
    indices as ``torch.argmax``, several times faster over a step's float32 CPU logits)."""

    def __init__(self, device: str | torch.device, native: bool = False) -> None:
        self.device = torch.device(device)
        self.native = native and self.device.type == "cpu"
        self._rows: _Rows | None = None
        self._noise: Tensor | None = None  # (rows, vocab) float32, reused from step to step

    def sample(self, logits: Tensor, seqs: Seq[Sequence]) -> list[int | None]:
        """Token ids for float32 ``logits`` of shape ``(len(seqs), vocab)``, ``None`` for a row that failed."""
        native = self.native and logits.dtype == torch.float32 and logits.dim() == 2 and logits.shape[1] > 0
        greedy = argmax_rows(logits) if native else torch.argmax(logits, dim=-1)
        sampled = [row for row, seq in enumerate(seqs) if not seq.params.greedy]
        if not sampled:
            return greedy.tolist()
        try:
            probs, valid = self._distributions(logits, seqs, sampled)
        except Exception:  # whatever broke the batch, find the rows it belongs to
            log.warning("batched sampling failed; sampling its rows one by one", exc_info=True)
            probs, valid = self._distributions_alone(logits, seqs, sampled)
        # torch.multinomial's own draw of one sample (a race of exponentials): argmax(p / q) with
        # q ~ Exp(1) from the row's generator. Done here so that the rows share one division,
        # one argmax and one transfer, and skip multinomial's per-call checks (each a device sync).
        noise = self._noise_rows(len(sampled), probs.shape[-1])
        for k, row in enumerate(sampled):
            if valid[k]:
                try:
                    noise[k].exponential_(1, generator=seqs[row].generator)
                except Exception:  # this request ends with reason "error"; the rest go on
                    log.warning("drawing a token for request %r failed", seqs[row].rid, exc_info=True)
                    valid[k] = False
        drawn = torch.argmax(torch.div(probs, noise, out=noise), dim=-1)
        both = torch.cat([greedy, drawn]).tolist()  # one transfer for the whole step
        tokens: list[int | None] = list(both[: len(seqs)])
        for k, row in enumerate(sampled):
            tokens[row] = both[len(seqs) + k] if valid[k] else None
        return tokens

    def _distributions(self, logits: Tensor, seqs: Seq[Sequence], sampled: list[int]) -> tuple[Tensor, list[bool]]:
        """The sampled rows' probabilities (k, vocab), and which of them are a distribution."""
        rows = self._batch_rows(seqs, sampled, len(logits))
        x = logits if rows.index is None else logits.index_select(0, rows.index)
        probs = _probabilities(x.float(), rows.temperature, rows.top_p_rows, rows.top_p)
        mass = probs.sum(dim=-1)  # NaN or inf if any entry is (entries are never negative)
        return probs, (torch.isfinite(mass) & (mass > 0)).tolist()

    def _distributions_alone(
        self, logits: Tensor, seqs: Seq[Sequence], sampled: list[int]
    ) -> tuple[Tensor, list[bool]]:
        """Row by row, for when the batch raised: a row that still raises is that row's failure."""
        probs, valid = [], []
        for row in sampled:
            self._rows = None
            try:
                p, ok = self._distributions(logits[row : row + 1], [seqs[row]], [0])
            except Exception:
                log.warning("sampling request %r failed", seqs[row].rid, exc_info=True)
                p, ok = torch.zeros_like(logits[row : row + 1], dtype=torch.float32), [False]
            probs.append(p)
            valid += ok
        self._rows = None
        return torch.cat(probs), valid

    def _noise_rows(self, rows: int, vocab: int) -> Tensor:
        if self._noise is None or self._noise.shape[0] < rows or self._noise.shape[1] != vocab:
            self._noise = torch.empty(rows, vocab, dtype=torch.float32, device=self.device)
        return self._noise[:rows]

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
            if filtered
            else None,
        )
        return self._rows


def _probabilities(logits: Tensor, temperature: Tensor, top_p_rows: Tensor | None, top_p: Tensor | None) -> Tensor:
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
