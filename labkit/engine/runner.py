"""ModelRunner: the paged forward. It sees token ids, positions and block tables, never requests.

The KV pool holds every layer's keys and values in fixed-size blocks; the block manager
(``cache.py``) decides which blocks a sequence owns, and the runner only reads and writes the
slots it is told: position ``p`` of a sequence lives in block ``table[p // block_size]`` at
offset ``p % block_size``.

Prefill runs the prompts admitted together in one packed pass, each with its own positions and
blocks; decode runs one token for each of many sequences in one pass. With ``batch_invariant``
(the default) every matmul, prefill and decode, sums each element in one fixed order whatever the
number of rows (the fixed-order kernel, ``matmul.py``; where it cannot be built, calls whose
rounding was checked at start-up, ``layers.Tiling``, ``probe_chunk_rows``), each prompt attends
over its own rows only, and each decoding sequence's attention has a shape set by its own length
(see ``attention.py``), so a sequence's logits are bitwise the same whether it is prefilled or
decoded alone or beside any neighbours; the tests check exactly that.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

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
    prefill_attention,
)
from labkit.engine.layers import Tiling, probe_chunk_rows
from labkit.engine.matmul import FixedOrder, MatmulChoice, choose_matmul
from labkit.engine.networks import Network, build_network
from labkit.models.loaded import LoadedModel

_BIG_WEIGHT = 32 << 20  # bytes; see ModelRunner._tiling
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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
        max_prefill_tokens: int = 128,
        attention: str = "auto",
        matmul: str = "auto",
    ) -> None:
        if dtype not in _DTYPES:
            raise ValueError(f"ModelRunner dtype must be one of {tuple(_DTYPES)}, got {dtype!r}")
        if min(num_blocks, block_size, tile_rows, max_prefill_tokens) < 1:
            raise ValueError(
                f"num_blocks, block_size, tile_rows and max_prefill_tokens must be >= 1, "
                f"got {num_blocks}, {block_size}, {tile_rows}, {max_prefill_tokens}"
            )
        self.device = torch.device(device)
        self.dtype = _DTYPES[dtype]
        self.network = build_network(loaded, self.dtype, self.device)
        self.pool = KVPool(self.network, num_blocks, block_size, self.dtype, self.device)
        self.attention = choose_attention(attention, self.device, self.dtype)  # paged kernel or gather, and why
        self.block_size = block_size
        self.span = DEFAULT_SPAN
        self.max_prefill_tokens = max_prefill_tokens
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
        ``max_prefill_tokens`` rows, so a prefill pass is one call, but at most ``chunk_rows``
        for weights over ``_BIG_WEIGHT`` bytes, which only the last rows of each prompt or a
        decode batch meet and which are slow to probe); exact bmm tiles of ``tile_rows`` if any
        weight rounds 2-row calls differently."""
        sizes = {}
        for w, _ in self.network.matmuls():
            big = w.numel() * w.element_size() > _BIG_WEIGHT
            sizes[id(w)] = probe_chunk_rows(w, chunk_rows if big else max(chunk_rows, self.max_prefill_tokens))
        if min(sizes.values()) < 2:
            return Tiling(tile_rows, exact=True)
        return Tiling(min(sizes.values()), by_weight=sizes)

    @property
    def kv_bytes_per_block(self) -> int:
        """Bytes one block takes across all layers, keys and values together."""
        return self.pool.bytes_per_block

    @property
    def max_positions(self) -> int:
        return self.network.shape.max_positions

    def prefill(self, token_ids: Sequence[int], block_table: Sequence[int]) -> Tensor:
        """Run the whole prompt, write its K/V at positions 0..n-1 into the given blocks;
        return float32 logits (vocab,) of the last position."""
        return self.prefill_many([token_ids], [block_table])[0]

    def prefill_many(self, prompts: Sequence[Sequence[int]], block_tables: Sequence[Sequence[int]]) -> Tensor:
        """Prefill several prompts in packed passes: float32 logits (prompts, vocab), one row
        per prompt, of its last position.

        The prompts' tokens are laid end to end, each with its own positions 0..n-1 and its own
        blocks, so the matmuls see every prompt's rows at once; attention runs per prompt over
        its own rows, the same call as alone. In the batch-invariant mode the matmuls are tiled
        as in decode, so a prompt's logits (and the K/V it leaves) are bitwise those of its solo
        prefill. Passes hold at most ``max_prefill_tokens`` rows (a longer prompt goes alone): the
        matmuls gain little from more rows than a chunk, and smaller passes let the engine hand
        out the first passes' tokens sooner.
        """
        parts = [logits for _, logits in self.prefill_packs(prompts, block_tables)]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def prefill_packs(
        self, prompts: Sequence[Sequence[int]], block_tables: Sequence[Sequence[int]]
    ) -> Iterator[tuple[list[int], Tensor]]:
        """``prefill_many`` one pass at a time: yields (indices of the prompts in the pass, their
        logits) as each pass ends, so a caller can hand out first tokens without waiting for
        the last pass."""
        if len(prompts) != len(block_tables):
            raise ValueError(f"{len(prompts)} prompts but {len(block_tables)} block tables")
        for ids in prompts:
            if len(ids) == 0:
                raise ValueError("prefill needs at least one token")
            self._check_positions(len(ids) - 1)
        for group in _packs([len(ids) for ids in prompts], self.max_prefill_tokens):
            yield group, self._prefill_packed([prompts[i] for i in group], [block_tables[i] for i in group])

    @torch.inference_mode()
    def _prefill_packed(self, prompts: list[Sequence[int]], block_tables: list[Sequence[int]]) -> Tensor:
        bs, tile, net = self.block_size, self._tiling_now(), self.network
        lengths = [len(ids) for ids in prompts]
        rows = sum(lengths)
        padded = rows if tile is None else tile.padded(rows)
        filler = [0] * (padded - rows)  # filler rows: token 0 at position 0, never written or attended
        positions = [p for n in lengths for p in range(n)]
        slots = self._long([table[p // bs] * bs + p % bs for table, n in zip(block_tables, lengths) for p in range(n)])
        pos = self._long(positions + filler)
        x = net.embed(self._long([t for ids in prompts for t in ids] + filler), pos)
        at = net.positional(pos)
        starts = [0]
        for n in lengths:
            starts.append(starts[-1] + n)
        for layer in range(net.shape.num_layers):
            q, k, v = net.qkv(layer, x, at, tile)
            self.pool.write(layer, slots, k[:rows], v[:rows])
            attn = [prefill_attention(q[a:b], k[a:b], v[a:b]) for a, b in zip(starts, starts[1:])]
            if padded > rows:
                attn.append(attn[0].new_zeros(padded - rows, attn[0].shape[1]))
            x = net.finish(layer, x, attn[0] if len(attn) == 1 else torch.cat(attn), tile)
        last = [b - 1 for b in starts[1:]]
        out_rows = len(last) if tile is None else tile.padded(len(last))
        x = x.index_select(0, self._long(last + [last[0]] * (out_rows - len(last))))
        return net.logits(x, tile)[: len(last)].float()

    def plan_decode(
        self, positions: Sequence[int], block_tables: Sequence[Sequence[int]], *, kernel: bool | None = None
    ) -> DecodePlan:
        """The decode step's attention plan for these rows, in this runner's mode; ``kernel``
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

    @torch.inference_mode()
    def decode(self, tokens: Sequence[int], positions: Sequence[int], block_tables: Sequence[Sequence[int]]) -> Tensor:
        """One token per sequence, sequences of different lengths in one batched pass: token b
        sits at position positions[b] (= tokens already cached), its K/V is written there, and
        it attends to positions 0..positions[b]. Returns float32 logits (B, vocab)."""
        if not tokens:
            return torch.empty(0, self.network.vocab_size, device=self.device)
        self._check_positions(max(positions))
        plan = self.plan_decode(positions, block_tables)
        rows = len(tokens)
        net, tile = self.network, self._tiling_now()
        padded = rows if tile is None else tile.padded(rows)
        pad = [0] * (padded - rows)  # filler rows: token 0 at position 0, never written or attended
        # the step's index tensors in one transfer: token ids and positions in plan order, and
        # where each input row's result sits (filler rows keep their places at the end)
        ids, pos, back = self._long(
            [
                [tokens[r] for r in plan.order] + pad,
                [positions[r] for r in plan.order] + pad,
                plan.inverse + list(range(rows, padded)),
            ]
        )
        x = net.embed(ids, pos)
        at = net.positional(pos)
        for layer in range(net.shape.num_layers):
            q, k, v = net.qkv(layer, x, at, tile)
            self.pool.write(layer, plan.slots, k[:rows], v[:rows])
            attn = decode_attention(q[:rows], self.pool.kv[layer], plan)
            if padded > rows:
                attn = F.pad(attn, (0, 0, 0, padded - rows))
            x = net.finish(layer, x, attn, tile)
        x = x.index_select(0, back)
        return net.logits(x, tile)[:rows].float()

    def _check_positions(self, last: int) -> None:
        if last >= self.max_positions:
            raise ValueError(f"position {last} is past the model's {self.max_positions} positions")

    def _long(self, values: Sequence) -> Tensor:
        """``values`` (ints, or equal-length lists of ints) as one long tensor on the device."""
        return torch.tensor(list(values), dtype=torch.long, device=self.device)


def _packs(lengths: list[int], budget: int) -> list[list[int]]:
    """Consecutive prompts grouped so that each group holds at most ``budget`` tokens
    (a prompt longer than that is a group of its own)."""
    groups: list[list[int]] = []
    total = budget + 1
    for i, n in enumerate(lengths):
        if total + n > budget:
            groups.append([])
            total = 0
        groups[-1].append(i)
        total += n
    return groups
