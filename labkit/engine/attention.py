"""Attention over the paged KV cache: one query row per token, each against its own sequence's
cached positions up to its own.

A prefill chunk's rows are attended the way decode rows are (the runner writes the chunk's K/V
into the pool first), so a prompt's numbers cannot depend on how it was cut into chunks.
Batching is where a row could feel its neighbours. A softmax and the probability-weighted sum
of values are reductions along the context, and a kernel's rounding can change with the length
it reduces over; padding every row to the longest neighbour would make a row's numbers depend on
who else is in the batch. So each row attends over a width that depends on its own length only
(rounded up to ``span`` positions, the extra masked out), and rows of equal width are batched
together: what a row sees is the same tensor shape whether it is decoded alone or with 32 others.
With ``invariant=False`` all rows share the widest width: one call, fewer kernels, not invariant.

That path copies every row's K and V blocks into one contiguous tensor per layer and step (the
gather). The paged kernel (``kernels/paged_decode.cpp``, ``attention="kernel"``) reads them
straight from the pool through the block tables instead; it computes each (row, KV head) in a
fixed order set by that row's own length, so it is batch-invariant by construction in both
modes and needs no widths, groups or masks. ``choose_attention`` picks it when it can be built
(CPU, float32) and says why not otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from labkit.engine.kernels import decide, paged_decode_kernel

DEFAULT_SPAN = 64  # positions; widths are multiples of this (and of the block size)
GATHER_POSITIONS = 1 << 16  # positions one group's gather copies at most (a long prompt's rows are split)
ATTENTION_MODES = ("auto", "kernel", "gather")


@dataclass(frozen=True)
class AttentionChoice:
    """Which decode attention a runner uses, and why (``reason`` is shown in benches and logs)."""

    mode: str  # "kernel" or "gather"
    reason: str


def choose_attention(requested: str, device: torch.device, dtype: torch.dtype) -> AttentionChoice:
    """``"auto"``: the paged kernel where it applies and builds, the gather otherwise (with the
    reason). ``"kernel"`` raises ValueError where it cannot be had; ``"gather"`` always works."""
    if requested not in ATTENTION_MODES:
        raise ValueError(f"attention must be one of {ATTENTION_MODES}, got {requested!r}")
    if requested == "gather":
        return AttentionChoice("gather", "asked for")
    kernel, reason = decide("attention", requested, "paged kernel", device, dtype, paged_decode_kernel)
    return AttentionChoice("kernel" if kernel else "gather", reason if kernel else f"{reason}; using the gather")


@dataclass(frozen=True)
class PagedTables:
    """Each row's block table and length, checked once per step and shared by every layer."""

    tables: Tensor  # (rows, width) int32 block ids, padded with 0 past each row's used blocks
    lengths: Tensor  # (rows,) int32 positions each row attends over, >= 1
    block_size: int
    max_length: int
    max_block: int  # the largest block id any row reads: checked against the pool's size

    def __post_init__(self) -> None:
        """What the kernel relies on, checked however the tables were made (``build`` makes
        them right; a hand-made one must not reach native code wrong)."""
        t, n = self.tables, self.lengths
        ok = (
            t.dtype == torch.int32
            and n.dtype == torch.int32
            and t.dim() == 2
            and n.dim() == 1
            and t.shape[0] == n.shape[0] >= 1
            and t.is_contiguous()
            and n.is_contiguous()
            and self.block_size >= 1
        )
        if not ok:
            raise ValueError("PagedTables: tables (rows, width) and lengths (rows,) must be contiguous int32")
        if int(n.min()) < 1 or int(n.max()) != self.max_length:
            raise ValueError(f"PagedTables: lengths must be >= 1 and max_length their maximum ({self.max_length})")
        if -(-self.max_length // self.block_size) > t.shape[1]:
            raise ValueError(f"PagedTables: a length of {self.max_length} needs more than {t.shape[1]} blocks")
        if int(t.min()) < 0 or int(t.max()) > self.max_block:
            raise ValueError(f"PagedTables: block ids must lie in 0..max_block ({self.max_block})")

    @classmethod
    def build(cls, block_tables: Sequence[Sequence[int]], lengths: Sequence[int], block_size: int) -> PagedTables:
        """Refuse what would make the kernel read outside the pool: ValueError, never a crash."""
        if len(block_tables) != len(lengths) or not lengths:
            raise ValueError(f"{len(block_tables)} block tables for {len(lengths)} lengths (need >= 1 row)")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        used = []
        for row, (table, n) in enumerate(zip(block_tables, lengths)):
            if not isinstance(n, int) or n < 1:
                raise ValueError(f"row {row}: length must be a positive int, got {n!r}")
            need = -(-n // block_size)
            if need > len(table):
                raise ValueError(f"row {row}: length {n} needs {need} blocks, its table has {len(table)}")
            blocks = [int(b) for b in table[:need]]
            if min(blocks) < 0 or max(blocks) >= 2**31:
                raise ValueError(f"row {row}: block ids must lie in 0..2**31-1, got {min(blocks)}..{max(blocks)}")
            used.append(blocks)
        width = max(map(len, used))
        padded = [blocks + [0] * (width - len(blocks)) for blocks in used]
        return cls(
            torch.tensor(padded, dtype=torch.int32),
            torch.tensor(list(lengths), dtype=torch.int32),
            block_size,
            max(lengths),
            max(max(blocks) for blocks in used),
        )


def paged_decode(q: Tensor, pool: Tensor, paged: PagedTables) -> Tensor:
    """Decode attention read through the block tables: ``q`` (rows, heads, d) float32 on the CPU
    (any row/head strides, d contiguous), ``pool`` one layer's (2, kv_heads, num_blocks,
    block_size, d), contiguous. Returns (rows, heads * d)."""
    if q.dim() != 3 or pool.dim() != 5 or pool.shape[0] != 2:
        raise ValueError(
            f"paged_decode: q must be (rows, heads, d), pool (2, kv_heads, blocks, block_size, d); "
            f"got {tuple(q.shape)} and {tuple(pool.shape)}"
        )
    rows, heads, dim = q.shape
    _, kv_heads, num_blocks, block_size, pool_dim = pool.shape
    if q.dtype != torch.float32 or pool.dtype != torch.float32 or q.device.type != "cpu" or pool.device.type != "cpu":
        raise ValueError(f"paged_decode needs float32 CPU tensors, got q {q.dtype} {q.device}, pool {pool.dtype}")
    if pool_dim != dim or heads % kv_heads or block_size != paged.block_size or rows != paged.lengths.shape[0]:
        raise ValueError(
            f"paged_decode: q {tuple(q.shape)}, pool {tuple(pool.shape)}, {paged.lengths.shape[0]} rows of "
            f"block size {paged.block_size} do not fit together"
        )
    if paged.max_block >= num_blocks:
        raise ValueError(f"paged_decode: block id {paged.max_block} is past the pool's {num_blocks} blocks")
    if q.stride(2) != 1 or not pool.is_contiguous():
        raise ValueError("paged_decode: q's last dimension and the pool must be contiguous")
    out = torch.empty(rows, heads * dim, dtype=torch.float32)
    status = _paged_function()(
        q.data_ptr(),
        pool.data_ptr(),
        paged.tables.data_ptr(),
        paged.lengths.data_ptr(),
        out.data_ptr(),
        q.stride(0),
        q.stride(1),
        rows,
        heads,
        kv_heads,
        dim,
        num_blocks,
        block_size,
        paged.tables.shape[1],
        paged.max_length,
        dim**-0.5,
        torch.get_num_threads(),
    )
    if status != 0:
        raise ValueError(f"paged_decode kernel refused its arguments (status {status})")
    return out


_FUNCTION: list[Any] = []  # the loaded entry point, looked up once (paged_decode_kernel takes a lock)


def _paged_function() -> Any:
    if not _FUNCTION:
        _FUNCTION.append(paged_decode_kernel().function)
    return _FUNCTION[0]


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
    paged: PagedTables | None = None  # set: the paged kernel reads the blocks (no groups, no gather)

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
    kernel: bool = False,
) -> DecodePlan:
    """Sort the rows by attention width, group equal widths, and list the blocks each reads;
    with ``kernel``, keep the rows in order and hand the kernel their tables and lengths."""
    if kernel:
        paged = PagedTables.build(block_tables, [p + 1 for p in positions], block_size)
        slots = [block_tables[r][p // block_size] * block_size + p % block_size for r, p in enumerate(positions)]
        return DecodePlan(list(range(len(positions))), _long(slots, device), [], paged)
    widths = [attend_width(p + 1, block_size, span) for p in positions]
    if not invariant:
        widths = [max(widths)] * len(widths)
    order = sorted(range(len(widths)), key=lambda row: widths[row])
    slots = [
        block_tables[row][positions[row] // block_size] * block_size + positions[row] % block_size for row in order
    ]
    groups = []
    for start, stop in _runs([widths[row] for row in order], GATHER_POSITIONS):
        rows = order[start:stop]
        blocks = [b for row in rows for b in _padded_table(block_tables[row], widths[row] // block_size)]
        bias = _mask_bias([positions[row] + 1 for row in rows], widths[rows[0]], kv_heads, dtype, device)
        groups.append(Group(start, stop, widths[rows[0]], _long(blocks, device), bias))
    return DecodePlan(order, _long(slots, device), groups)


def _runs(values: list[int], most: int) -> list[tuple[int, int]]:
    """(start, stop) of each run of equal values, cut where a run's values would sum past ``most``."""
    runs: list[tuple[int, int]] = []
    for i, value in enumerate(values):
        if runs and value == values[runs[-1][0]] and (i - runs[-1][0] + 1) * value <= most:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


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
    if plan.paged is not None:
        return paged_decode(q, kv_cache, plan.paged)
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
