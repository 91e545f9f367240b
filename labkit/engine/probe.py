"""A logits probe: rows decoded alone and inside batches, fed the same tokens, compared by the caller.

Batch invariance is a claim about numbers, and a token comparison sees a difference only where it
crosses a near tie. This probe gives the numbers: every probe row's logits at every step, alone
and in each batch, from one runner, every run on blocks of its own. The lab's isolation
experiment reads it through :func:`logits_probe` (``labkit.engine``'s public API), never the
runner or the block manager themselves.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from torch import Tensor

from labkit.engine.cache import BlockManager
from labkit.engine.runner import ModelRunner
from labkit.models.loaded import LoadedModel

__all__ = ["logits_probe"]


def logits_probe(
    loaded: LoadedModel,
    prompts: Sequence[Sequence[int]],
    batches: Sequence[int],
    probes: int,
    tokens: int,
    *,
    dtype: str = "float32",
    batch_invariant: bool = True,
    block_size: int = 16,
) -> Iterator[tuple[int, int, int, Tensor, Tensor]]:
    """``(batch, probe, step, solo, batched)``: probe row ``probe``'s float32 logits at ``step``
    decoded alone and inside a batch of ``batch`` rows (the first ``batch`` of ``prompts``, probes
    first). Probes are fed their solo run's greedy tokens in both, the other rows their own; step 0
    is the prefill (alone, or the batch's prompts packed in one pass)."""
    if max(batches) > len(prompts) or probes < 1 or tokens < 1:
        raise ValueError(f"logits_probe: need max(batches) <= {len(prompts)} prompts, probes >= 1 and tokens >= 1")
    rows = range(min(probes, max(batches)))
    need = sum(-(-(len(prompts[r]) + tokens) // block_size) for r in [*rows, *(r for b in batches for r in range(b))])
    blocks = BlockManager(need, block_size)
    runner = ModelRunner(loaded, num_blocks=need, block_size=block_size, dtype=dtype, batch_invariant=batch_invariant)
    table: dict[tuple[int | str, int], list[int]] = {
        (b, r): blocks.allocate((b, r), len(prompts[r]) + tokens) for b in batches for r in range(b)
    }
    table.update({("solo", r): blocks.allocate(("solo", r), len(prompts[r]) + tokens) for r in rows})
    solo = [runner.prefill(prompts[r], table["solo", r]) for r in rows]
    path = [[int(x.argmax())] for x in solo]
    own = {b: runner.prefill_many(prompts[:b], [table[b, r] for r in range(b)]) for b in batches}
    for step in range(tokens):
        if step:
            solo = [runner.decode([path[r][-1]], [len(prompts[r]) + step - 1], [table["solo", r]])[0] for r in rows]
            for r, x in zip(rows, solo):
                path[r].append(int(x.argmax()))
        for b in batches:
            if step:
                fed = [path[r][step - 1] if r in rows else int(own[b][r].argmax()) for r in range(b)]
                own[b] = runner.decode(
                    fed, [len(prompts[r]) + step - 1 for r in range(b)], [table[b, r] for r in range(b)]
                )
            for r in rows:
                if r < b:
                    yield b, r, step, solo[r], own[b][r]
