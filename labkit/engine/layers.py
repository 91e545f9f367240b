"""The few tensor operations the paged forward is made of, written so a row never feels its neighbours.

The batch-invariant matmul is the fixed-order kernel (``matmul.py``) wherever it builds; where it
does not (no compiler, CUDA, another dtype) ``linear`` falls back to the library's matmuls, and
two facts about CPU kernels shape that fallback and the rest of this file (both measured on the
lab machine):

* A matmul's rounding can depend on how many rows it has: one row takes a matrix-vector kernel
  that rounds differently from two. With the weight stored (out, in) (``F.linear``'s layout) rows
  2-15 and rows 16+ round differently again; stored (in, out), every call of 2..thousands of rows
  rounded each row alike on one thread, and 2..16 did on two (a 1536-wide input split its
  reduction past 16 rows). So ``linear`` multiplies (in, out) weights in calls of 2..``rows``
  rows, ``rows`` checked on this machine when the runner starts (``probe_chunk_rows``); where
  no such size exists it falls back to bmm tiles of an exact size (see ``Tiling``).
* Fused elementwise kernels (``F.silu``, ``F.gelu``, ``torch.sigmoid``) compute the ragged end
  of a tensor with a scalar routine that rounds differently from the vector one, so whether a
  row lands in that end depends on the batch size. ``exp``, ``tanh``, ``sqrt``, ``+ - * /``
  agree in both routines, so the activations here are composed from those.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from labkit.engine.matmul import FixedOrder

#: A tiled weight larger than this is multiplied in column chunks of about this size, so each
#: chunk is read from memory once and stays in cache while every row tile passes over it
#: (the lm head is the one such weight in practice).
CHUNK_BYTES = 2 << 20


@dataclass(frozen=True)
class Tiling:
    """How the batch-invariant mode multiplies rows by a weight so that a row never feels the others.

    ``exact=False`` (chunks): the rows go through plain ``mm`` calls of 2..``rows`` rows each, the
    weight stored (in, out). On the lab's CPUs every such call rounds each row alike, whatever
    its neighbours and however many there are (the runner checks this with ``probe_chunk_rows``
    before relying on it), and a 2-row call costs what a 1-row one does, so a single sequence
    pays nothing and a batch of ``rows`` pays one efficient call. One row alone is never
    multiplied: it takes a different (matrix-vector) kernel.
    ``exact=True`` (tiles): every call is a ``bmm`` over tiles of exactly ``rows`` rows, the
    runner padding the batch to whole tiles; invariant on any backend, slower (the fallback).
    """

    rows: int
    exact: bool = False
    by_weight: dict[int, int] = field(default_factory=dict, repr=False)  # id(weight) -> its own chunk

    def rows_for(self, weight: Tensor) -> int:
        return self.by_weight.get(id(weight), self.rows)

    def padded(self, rows: int) -> int:
        """Rows the runner must hand ``linear`` for ``rows`` real ones."""
        if self.exact:
            return -(-rows // self.rows) * self.rows
        return max(rows, 2)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None, tiling: Tiling | FixedOrder | None) -> Tensor:
    """``x @ weight + bias`` for ``x`` of shape (rows, in); ``weight`` is stored (in, out).

    Without ``tiling``, one plain matmul (rounding depends on the number of rows). With it, a
    row's result is bitwise the same at any batch size and any place in the batch: through the
    fixed-order kernel (``FixedOrder``, see ``matmul.py``) or the library's probed chunks
    (``Tiling``); ``x`` must have ``tiling.padded(n)`` rows. The result is always a new
    tensor, never a view of ``x`` or ``weight``, so callers may add into it in place.
    """
    if isinstance(tiling, FixedOrder):
        return tiling.matmul(x, weight, bias)
    if tiling is None:
        return torch.matmul(x, weight) if bias is None else torch.addmm(bias, x, weight)
    rows, step = x.shape[0], tiling.rows_for(weight)
    if tiling.exact:
        out = _tiled(x, weight, step)
    elif rows <= step:
        assert rows >= 2, "one row alone takes the matrix-vector kernel: pad it (Tiling.padded)"
        out = torch.mm(x, weight)
    else:
        parts = [torch.mm(x[a : a + step], weight) for a in range(0, rows - rows % step, step)]
        if rows % step == 1:  # a lone last row rides in a 2-row call with its neighbour
            parts.append(torch.mm(x[-2:], weight)[1:])
        elif rows % step:
            parts.append(torch.mm(x[rows - rows % step :], weight))
        out = torch.cat(parts)
    return out if bias is None else out + bias


def _tiled(x: Tensor, weight: Tensor, tile_rows: int) -> Tensor:
    """One ``bmm`` over tiles of exactly ``tile_rows`` rows (weight in column chunks if large)."""
    rows = x.shape[0]
    assert rows % tile_rows == 0, f"{rows} rows are not whole tiles of {tile_rows}"
    tiles = x.view(rows // tile_rows, tile_rows, -1)
    if weight.numel() * weight.element_size() <= CHUNK_BYTES:
        return torch.bmm(tiles, weight.expand(tiles.shape[0], -1, -1)).view(rows, -1)
    chunk = CHUNK_BYTES // (weight.shape[0] * weight.element_size())
    parts = [torch.bmm(tiles, w.expand(tiles.shape[0], -1, -1)) for w in weight.split(chunk, dim=1)]
    return torch.cat(parts, dim=-1).view(rows, -1)


_PROBED: dict[tuple, int] = {}


def probe_chunk_rows(weight: Tensor, most: int) -> int:
    """The largest n <= ``most`` such that ``mm`` calls of 2..n rows give every row the same bits
    wherever it sits (0 if not even 2 does), tried on random rows in this process's thread
    count. Cached per weight shape, dtype, device and thread count.

    Kernel libraries choose their routes from the shapes (and the threads), not the values, so
    random rows find the same routes the model's rows will take.
    """
    key = (tuple(weight.shape), weight.dtype, weight.device.type, torch.get_num_threads(), most)
    if key not in _PROBED:
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(2 * most, weight.shape[0], generator=gen).to(weight.dtype).to(weight.device)
        reference = torch.cat([torch.mm(x[i : i + 2], weight) for i in range(0, 2 * most, 2)])
        good = 0
        for n in range(2, most + 1):
            picks = torch.randperm(2 * most, generator=gen)[:n].to(weight.device)
            if not torch.equal(torch.mm(x[picks], weight), reference[picks]):
                break
            good = n
        _PROBED[key] = good
    return _PROBED[key]


def layer_norm(x: Tensor, weight: Tensor, bias: Tensor, eps: float) -> Tensor:
    """GPT-2's LayerNorm; the kernel normalises each row on its own, so rows stay independent."""
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Llama's RMSNorm, normalised in float32 as transformers does, then scaled in ``x``'s dtype."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return weight * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


def silu(x: Tensor) -> Tensor:
    """x * sigmoid(x) from exp and division, which round alike at every position (see above).

    ``x / (1 + exp(-x))`` computed in one new buffer instead of four (same operations, same bits)."""
    d = torch.neg(x)
    d.exp_().add_(1)
    return torch.div(x, d, out=d)


_GELU_C = math.sqrt(2.0 / math.pi)


def gelu_tanh(x: Tensor) -> Tensor:
    """GPT-2's ``gelu_new``, the same formula transformers evaluates op by op."""
    return 0.5 * x * (1.0 + torch.tanh(_GELU_C * (x + 0.044715 * torch.pow(x, 3.0))))


class RopeTable:
    """cos/sin of every position up to ``max_positions``, computed once, looked up per step;
    the first half of ``sin`` is negated (the sign rotate-half would apply to ``x``).

    ``inv_freq`` and ``scaling`` come from the checkpoint's own rotary module, so any rope type
    whose frequencies do not change with sequence length is reproduced exactly.
    """

    def __init__(
        self, inv_freq: Tensor, scaling: float, max_positions: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq.float().cpu()[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        self.cos = (angles.cos() * scaling).to(device=device, dtype=dtype)
        sin = angles.sin() * scaling
        half = sin.shape[-1] // 2
        # rotate-half's minus sign moved into the table: (-a) * s == a * (-s) exactly
        self.sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1).to(device=device, dtype=dtype)

    def lookup(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos and sin for each row, shaped (rows, 1, head_dim) to broadcast over heads;
        looked up once per forward and shared by every layer."""
        return self.cos[positions][:, None, :], self.sin[positions][:, None, :]


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x`` (rows, heads, head_dim) by its row's angles (rotate-half convention);
    ``sin`` carries rotate-half's sign in its first half (see ``RopeTable``)."""
    half = x.shape[-1] // 2
    turned = torch.cat((x[..., half:], x[..., :half]), dim=-1).mul_(sin)
    return (x * cos).add_(turned)  # x * cos + turned * sin, two buffers instead of four
