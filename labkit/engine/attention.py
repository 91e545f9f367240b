"""Attention over the paged KV cache: a causal pass for a prompt, a batched pass for decode.

Decode is where batching could leak between rows. A softmax and the probability-weighted sum
of values are reductions along the context, and a kernel's rounding can change with the length
it reduces over; padding every row to the longest neighbour would make a row's numbers depend on
who else is in the batch. So each row attends over a width that depends on its own length only
(rounded up to ``span`` positions, the extra masked out), and rows of equal width are batched
together: what a row sees is the same tensor shape whether it is decoded alone or with 32 others.
With ``invariant=False`` all rows share the widest width: one call, fewer kernels, not invariant.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

DEFAULT_SPAN = 64  # positions; widths are multiples of this (and of the block size)


@dataclass
class Group:
    """Consecutive rows (after the plan's reordering) that attend over the same width."""

    start: int  # first row
    stop: int  # one past the last row
    width: int  # positions attended, a whole number of blocks
    blocks: Tensor  # (rows * width // block_size,) block ids, each row's blocks in order
    bias: Tensor  # (kv_heads * rows, 1, width): 0 at positions 0..position of that row, -inf after


@dataclass
class DecodePlan:
    """Everything about one decode step's attention that is the same for every layer."""

    order: list[int]  # batch rows sorted by group: row i of the step is input row order[i]
    slots: Tensor  # (rows,) flat cache slot (block * block_size + offset) of each new K/V
    groups: list[Group]

    @property
    def inverse(self) -> list[int]:
        """Where each input row sits in plan order: ``order[inverse[r]] == r``."""
        where = [0] * len(self.order)
        for i, row in enumerate(self.order):
            where[row] = i
        return where


def attend_width(length: int, block_size: int, span: int) -> int:
    """Positions a row of ``length`` cached tokens attends over: ``length`` rounded up to a unit
    that is a whole number of blocks and at least ``span`` positions."""
    unit = block_size * -(-span // block_size)
    return unit * -(-length // unit)


def plan_decode(
    positions: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
    *,
    invariant: bool,
    kv_heads: int,
    dtype: torch.dtype,
    device: torch.device,
    span: int = DEFAULT_SPAN,
) -> DecodePlan:
    """Sort the rows by attention width, group equal widths, and list the blocks each reads."""
    widths = [attend_width(p + 1, block_size, span) for p in positions]
    if not invariant:
        widths = [max(widths)] * len(widths)
    order = sorted(range(len(widths)), key=lambda row: widths[row])
    slots = [
        block_tables[row][positions[row] // block_size] * block_size + positions[row] % block_size for row in order
    ]
    groups = []
    for start, stop in _runs([widths[row] for row in order]):
        rows = order[start:stop]
        blocks = [b for row in rows for b in _padded_table(block_tables[row], widths[row] // block_size)]
        bias = _mask_bias([positions[row] + 1 for row in rows], widths[rows[0]], kv_heads, dtype, device)
        groups.append(Group(start, stop, widths[rows[0]], _long(blocks, device), bias))
    return DecodePlan(order, _long(slots, device), groups)


def _runs(values: list[int]) -> list[tuple[int, int]]:
    """(start, stop) of each run of equal values."""
    edges = [i for i in range(1, len(values)) if values[i] != values[i - 1]]
    return list(zip([0] + edges, edges + [len(values)]))


def _mask_bias(lengths: list[int], width: int, kv_heads: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Additive mask, (kv_heads * rows, 1, width): 0 on each row's cached positions, -inf past them."""
    limits = torch.tensor(lengths, device=device)
    masked = torch.arange(width, device=device)[None, :] >= limits[:, None]
    bias = torch.zeros(masked.shape, dtype=dtype, device=device).masked_fill_(masked, float("-inf"))
    return bias.repeat(kv_heads, 1)[:, None, :]


def _long(values: list[int], device: torch.device) -> Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)


def _padded_table(table: Sequence[int], num_blocks: int) -> list[int]:
    """The first ``num_blocks`` of a row's blocks; past its table, its first block again
    (masked out, but real memory: the cache is zero-filled, so no NaN can leak in)."""
    table = list(table[:num_blocks])
    return table + [table[0]] * (num_blocks - len(table))


def decode_attention(q: Tensor, kv_cache: Tensor, plan: DecodePlan) -> Tensor:
    """One query per row against its cached keys and values.

    ``q`` is (rows, heads, d) in plan order; ``kv_cache`` is one layer's pool, keys then values,
    (2, kv_heads, num_blocks, block_size, d). Returns (rows, heads * d).
    """
    outputs = [_attend_group(q[g.start : g.stop], kv_cache, g) for g in plan.groups]
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs)


def _attend_group(q: Tensor, kv_cache: Tensor, g: Group) -> Tensor:
    """Plain batched matmuls on contiguous (kv_heads * rows)-batches of one shape.

    Every tensor here is laid out the same way whatever the number of rows, because the
    matmul kernels pick their route from the layout: a strided key tensor that is only
    sometimes viewable without a copy gave different bits for one row than for eight.
    Query heads that share a KV head (grouped-query attention) become extra query rows.
    """
    rows, heads, dim = q.shape
    kv_heads = kv_cache.shape[1]
    batch = kv_heads * rows
    gathered = kv_cache.index_select(2, g.blocks)  # one copy of the row's blocks, keys and values
    keys, values = gathered[0].view(batch, g.width, dim), gathered[1].view(batch, g.width, dim)
    queries = q.reshape(rows, kv_heads, heads // kv_heads, dim).transpose(0, 1).reshape(batch, -1, dim)
    scores = torch.baddbmm(g.bias, queries, keys.transpose(1, 2), alpha=dim**-0.5)
    if q.dtype == torch.float32:
        probs = torch.softmax(scores, dim=-1)
    else:  # softmax in float32, as transformers does for half precision
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    out = torch.bmm(probs, values).view(kv_heads, rows, -1, dim).transpose(0, 1)
    return out.reshape(rows, heads * dim)


def prefill_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Causal attention of a whole prompt over itself: q (n, heads, d), k/v (n, kv_heads, d).

    A prompt always starts at position 0, so its own fresh keys and values are all it needs.
    """
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        is_causal=True,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out[0].transpose(0, 1).reshape(q.shape[0], -1)
