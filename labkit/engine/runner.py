"""ModelRunner: the paged forward. It sees token ids, positions and block tables, never requests.

The KV pool holds every layer's keys and values in fixed-size blocks; the block manager
(``cache.py``) decides which blocks a sequence owns, and the runner only reads and writes the
slots it is told: position ``p`` of a sequence lives in block ``table[p // block_size]`` at
offset ``p % block_size``.

A step is one pass over rows of tokens (``forward``): a decode is one row, a prefill chunk a
run of rows of one prompt starting anywhere, and rows of many sequences go through the same
matmuls. Every row is computed the way a decode row is: its K/V is written into the pool, then
it attends to positions 0..its own through its sequence's blocks (``attention.py``). With
``batch_invariant`` (the default) every matmul sums each element in one fixed order whatever the
number of rows (the fixed-order kernel, ``matmul.py``; where it cannot be built, calls whose
rounding was checked at start-up, ``layers.Tiling``, ``probe_chunk_rows``) and each row's
attention has a shape and order set by its own position, so a sequence's logits are bitwise the
same whether its prompt is prefilled whole, in chunks or token by token, alone or beside any
neighbours; the tests check exactly that.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from labkit.engine import rowwise
from labkit.engine.attention import (
    DEFAULT_SPAN,
    DecodePlan,
    choose_attention,
    decode_attention,
    plan_decode,
)
from labkit.engine.config import DTYPES
from labkit.engine.layers import Tiling, probe_chunk_rows
from labkit.engine.matmul import FixedOrder, MatmulChoice, choose_matmul
from labkit.engine.networks import Network, build_network
from labkit.models.loaded import LoadedModel

_BIG_WEIGHT = 32 << 20  # bytes; see ModelRunner._tiling
_DTYPES = {name: getattr(torch, name) for name in DTYPES}  # config's names, as torch's dtypes


class KVPool:
    """Keys and values for every layer, in one tensor: (layers, 2, kv_heads, num_blocks,
    block_size, head_dim), keys at index 0 of the second axis and values at 1.

    Keys and values of a layer sit side by side so that one gather reads a row's blocks of both. Heads come before blocks so that gathering a
    row's blocks yields, per head, one contiguous run of positions, which attention can read
    without another copy. Zero-filled, so a masked slot that was never written still holds a
    finite number.
    """

    def __init__(
        self, network: Network, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        s = network.shape
        size = (s.num_layers, 2, s.num_kv_heads, num_blocks, block_size, s.head_dim)
        self.kv = torch.zeros(size, dtype=dtype, device=device)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.native = False  # write through rowwise.kv_write (one native call) instead of two index copies
        # each layer's keys and values with the blocks flattened into slots: (2, kv_heads, slots, d)
        self.flat = [self.kv[i].view(2, size[2], -1, size[-1]) for i in range(size[0])]

    @property
    def k(self) -> Tensor:
        """Every layer's keys, (layers, kv_heads, num_blocks, block_size, head_dim) (a view)."""
        return self.kv[:, 0]

    @property
    def v(self) -> Tensor:
        return self.kv[:, 1]

    @property
    def bytes_per_block(self) -> int:
        return self.kv.element_size() * self.kv.numel() // self.num_blocks

    def write(self, layer: int, slots: Tensor, k: Tensor, v: Tensor) -> None:
        """Store k/v (rows, kv_heads, d) at flat slots (block * block_size + offset)."""
        flat = self.flat[layer]
        if self.native:
            rowwise.kv_write(flat, slots, k, v)
            return
        flat[0].index_copy_(1, slots, k.transpose(0, 1))
        flat[1].index_copy_(1, slots, v.transpose(0, 1))


class ModelRunner:
    """Runs a LoadedModel's weights over a paged KV cache, prefill and batched decode."""

    def __init__(
        self,
        loaded: LoadedModel,
        *,
        num_blocks: int,
        block_size: int,
        device: str = "cpu",
        dtype: str = "float32",
        batch_invariant: bool = True,
        tile_rows: int = 8,
        chunk_rows: int = 32,
        probe_rows: int = 128,
        attention: str = "auto",
        matmul: str = "auto",
    ) -> None:
        if dtype not in _DTYPES:
            raise ValueError(f"ModelRunner dtype must be one of {tuple(_DTYPES)}, got {dtype!r}")
        if min(num_blocks, block_size, tile_rows, probe_rows) < 1:
            raise ValueError(
                f"num_blocks, block_size, tile_rows and probe_rows must be >= 1, "
                f"got {num_blocks}, {block_size}, {tile_rows}, {probe_rows}"
            )
        self.device = torch.device(device)
        self.dtype = _DTYPES[dtype]
        self.network = build_network(loaded, self.dtype, self.device)
        self.pool = KVPool(self.network, num_blocks, block_size, self.dtype, self.device)
        self.attention = choose_attention(attention, self.device, self.dtype)  # paged kernel or gather, and why
        self.block_size = block_size
        self.span = DEFAULT_SPAN
        self.probe_rows = probe_rows
        self.batch_invariant = batch_invariant
        self.tile_rows = tile_rows
        self.chunk_rows = chunk_rows
        # the invariant mode's matmul: the fixed-order kernel, or the library's probed chunks (and why)
        self.matmul = choose_matmul(matmul, self.device, self.dtype)
        if not batch_invariant:
            self.matmul = MatmulChoice("library", "plain mode: torch's matmuls")
        # the row-wise kernels (norms, rotary positions, the K/V write, the MLP gate, the greedy
        # argmax) come with the kernels, in both modes, unless the library's ops were asked for
        self.network.native_ops = self.pool.native = (
            matmul != "library" and rowwise.available(self.device, self.dtype, fast_only=matmul == "auto") is None
        )
        # what linear() gets: None = plain matmuls. The probe's answer holds for the thread count
        # it ran under (a kernel may split a reduction differently with more threads), so a
        # change of torch's thread count re-probes before the next forward (see _tiling_now);
        # the fixed-order kernel rounds alike on any number of threads and needs no probe.
        self._threads = torch.get_num_threads()
        self._tile: Tiling | FixedOrder | None = None
        if batch_invariant:
            if self.matmul.mode == "kernel":
                self._tile = FixedOrder.of([w for w, _ in self.network.matmuls()])
            else:
                self._tile = self._tiling(chunk_rows, tile_rows)

    def _tiling_now(self) -> Tiling | FixedOrder | None:
        if isinstance(self._tile, Tiling) and torch.get_num_threads() != self._threads:
            self._threads = torch.get_num_threads()
            self._tile = self._tiling(self.chunk_rows, self.tile_rows)
        return self._tile

    def _tiling(self, chunk_rows: int, tile_rows: int) -> Tiling:
        """For each weight, row chunks of the largest size that rounds alike (up to
        ``probe_rows`` rows, so a step's pass is one call or a few, but at most ``chunk_rows``
        for weights over ``_BIG_WEIGHT`` bytes, which only the last rows of each prompt or a
        decode batch meet and which are slow to probe); exact bmm tiles of ``tile_rows`` if any
        weight rounds 2-row calls differently."""
        sizes = {}
        for w, _ in self.network.matmuls():
            big = w.numel() * w.element_size() > _BIG_WEIGHT
            sizes[id(w)] = probe_chunk_rows(w, chunk_rows if big else max(chunk_rows, self.probe_rows))
        if min(sizes.values()) < 2:
            return Tiling(tile_rows, exact=True)
        return Tiling(min(sizes.values()), by_weight=sizes)

    @property
    def max_positions(self) -> int:
        return self.network.shape.max_positions

    def prefill(self, token_ids: Sequence[int], block_table: Sequence[int]) -> Tensor:
        """Run the whole prompt, write its K/V at positions 0..n-1 into the given blocks;
        return float32 logits (vocab,) of the last position."""
        return self.forward([Chunk(token_ids, 0, block_table)])[0]

    def prefill_many(self, prompts: Sequence[Sequence[int]], block_tables: Sequence[Sequence[int]]) -> Tensor:
        """Several whole prompts in one pass: float32 logits (prompts, vocab) of each last position."""
        if len(prompts) != len(block_tables):
            raise ValueError(f"{len(prompts)} prompts but {len(block_tables)} block tables")
        return self.forward([Chunk(ids, 0, table) for ids, table in zip(prompts, block_tables)])

    def decode(self, tokens: Sequence[int], positions: Sequence[int], block_tables: Sequence[Sequence[int]]) -> Tensor:
        """One token per sequence: token b sits at position positions[b] (= tokens already
        cached), its K/V is written there, and it attends to positions 0..positions[b].
        Returns float32 logits (B, vocab)."""
        if not tokens:
            return torch.empty(0, self.network.vocab_size, device=self.device)
        return self.forward([Chunk([t], p, table) for t, p, table in zip(tokens, positions, block_tables, strict=True)])

    @torch.inference_mode()
    def forward(self, chunks: Sequence[Chunk], sample: Sequence[bool] | None = None) -> Tensor:
        """One pass over every chunk's rows (a decode is a chunk of one token): float32 logits
        (sampled chunks, vocab) of each sampled chunk's last row, in order; ``sample=None``
        samples every chunk.

        Every row is one token at its own position: each layer writes all the rows' K/V into the
        pool first, then each row attends to positions 0..its own through its sequence's blocks,
        computed the way a decode row is (``attention.py``), so a chunk's rows see the rows
        before them in the same chunk. In the batch-invariant mode nothing a row computes depends
        on the other rows, so a prompt's logits and K/V are bitwise the same prefilled whole, in
        chunks of any size, token by token, or beside any neighbours.
        """
        sample = [True] * len(chunks) if sample is None else list(sample)
        if len(sample) != len(chunks):
            raise ValueError(f"{len(chunks)} chunks but {len(sample)} sample flags")
        rows = _Rows.of(chunks)
        self._check_positions(max(rows.positions))
        plan = self.plan_decode(rows.positions, rows.tables)
        count = len(rows.tokens)
        net, tile = self.network, self._tiling_now()
        padded = count if tile is None else tile.padded(count)
        pad = [0] * (padded - count)  # filler rows: token 0 at position 0, never written or attended
        picks = [plan.inverse[last] for last, wanted in zip(rows.lasts, sample) if wanted]
        out_rows = len(picks) if tile is None else tile.padded(len(picks))
        # the pass's index tensors in one transfer: token ids and positions in plan order
        ids, pos = self._long(
            [[rows.tokens[r] for r in plan.order] + pad, [rows.positions[r] for r in plan.order] + pad]
        )
        x = net.embed(ids, pos)
        at = net.positional(pos)
        for layer in range(net.shape.num_layers):
            q, k, v = net.qkv(layer, x, at, tile)
            self.pool.write(layer, plan.slots, k[:count], v[:count])
            attn = decode_attention(q[:count], self.pool.kv[layer], plan)
            if padded > count:
                attn = F.pad(attn, (0, 0, 0, padded - count))
            x = net.finish(layer, x, attn, tile)
        if not picks:
            return torch.empty(0, net.vocab_size, device=self.device)
        x = x.index_select(0, self._long(picks + picks[:1] * (out_rows - len(picks))))
        return net.logits(x, tile)[: len(picks)].float()

    def plan_decode(
        self, positions: Sequence[int], block_tables: Sequence[Sequence[int]], *, kernel: bool | None = None
    ) -> DecodePlan:
        """The attention plan for these rows (one per token), in this runner's mode; ``kernel``
        overrides the attention the runner chose (the bench plans both ways on one runner)."""
        return plan_decode(
            positions,
            block_tables,
            self.block_size,
            invariant=self.batch_invariant,
            kv_heads=self.network.shape.num_kv_heads,
            dtype=self.dtype,
            device=self.device,
            span=self.span,
            kernel=self.attention.mode == "kernel" if kernel is None else kernel,
        )

    def _check_positions(self, last: int) -> None:
        if last >= self.max_positions:
            raise ValueError(f"position {last} is past the model's {self.max_positions} positions")

    def _long(self, values: Sequence) -> Tensor:
        """``values`` (ints, or equal-length lists of ints) as one long tensor on the device."""
        return torch.tensor(list(values), dtype=torch.long, device=self.device)


class Chunk(NamedTuple):
    """Tokens of one sequence at positions ``start``, ``start + 1``, ..., and the blocks it owns."""

    token_ids: Sequence[int]
    start: int
    block_table: Sequence[int]


@dataclass(frozen=True)
class _Rows:
    """A pass's chunks laid end to end, one row per token: what the plan and the embedding read."""

    tokens: list[int]
    positions: list[int]
    tables: list[Sequence[int]]
    lasts: list[int]  # each chunk's last row

    @classmethod
    def of(cls, chunks: Sequence[Chunk]) -> _Rows:
        if not chunks:
            raise ValueError("a forward pass needs at least one chunk")
        tokens: list[int] = []
        positions: list[int] = []
        tables: list[Sequence[int]] = []
        lasts = []
        for chunk in chunks:
            n = len(chunk.token_ids)
            if n == 0:
                raise ValueError("prefill needs at least one token")
            if chunk.start < 0:
                raise ValueError(f"a chunk cannot start at position {chunk.start}")
            tokens.extend(chunk.token_ids)
            positions.extend(range(chunk.start, chunk.start + n))
            tables.extend([chunk.block_table] * n)
            lasts.append(len(tokens) - 1)
        return cls(tokens, positions, tables, lasts)
