"""The few tensor operations the paged forward is made of, written so a row never feels its neighbours.

Two facts about CPU kernels shape this file (both measured on the lab machine):

* A matmul's rounding depends on how many rows it has: one row takes a different kernel from
  two, and a 1536x576 weight gives different bits for 17+ rows than for 2-16. ``linear`` with
  ``tile_rows`` therefore always multiplies row tiles of exactly that many rows (one batched
  matmul over the tiles; the runner pads the batch with filler rows to whole tiles), so each
  row meets the same kernel whatever the batch size.
* Fused elementwise kernels (``F.silu``, ``F.gelu``, ``torch.sigmoid``) compute the ragged end
  of a tensor with a scalar routine that rounds differently from the vector one, so whether a
  row lands in that end depends on the batch size. ``exp``, ``tanh``, ``sqrt``, ``+ - * /``
  agree in both routines, so the activations here are composed from those.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor


#: A tiled weight larger than this is multiplied in column chunks of about this size, so each
#: chunk is read from memory once and stays in cache while every row tile passes over it
#: (the lm head is the one such weight in practice).
CHUNK_BYTES = 2 << 20


def linear(x: Tensor, weight: Tensor, bias: Tensor | None, tile_rows: int | None) -> Tensor:
    """``x @ weight.T + bias`` for ``x`` of shape (rows, in); ``weight`` is (out, in).

    With ``tile_rows`` (rows must be a multiple of it: the runner pads the batch once per step)
    the rows are multiplied tile by tile in one ``bmm``, so a row's result is bitwise the same
    at any batch size and any position in its tile. Without it, one plain matmul (faster,
    batch-dependent rounding).
    """
    if tile_rows is None:
        return F.linear(x, weight, bias)
    rows = x.shape[0]
    assert rows % tile_rows == 0, f"{rows} rows are not whole tiles of {tile_rows}"
    tiles = x.view(rows // tile_rows, tile_rows, -1)
    if weight.numel() * weight.element_size() <= CHUNK_BYTES:
        out = torch.bmm(tiles, weight.t().expand(tiles.shape[0], -1, -1)).view(rows, -1)
    else:
        chunk = CHUNK_BYTES // (weight.shape[1] * weight.element_size())
        parts = [torch.bmm(tiles, w.t().expand(tiles.shape[0], -1, -1)) for w in weight.split(chunk)]
        out = torch.cat(parts, dim=-1).view(rows, -1)
    return out if bias is None else out + bias


def layer_norm(x: Tensor, weight: Tensor, bias: Tensor, eps: float) -> Tensor:
    """GPT-2's LayerNorm; the kernel normalises each row on its own, so rows stay independent."""
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Llama's RMSNorm, normalised in float32 as transformers does, then scaled in ``x``'s dtype."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return weight * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


def silu(x: Tensor) -> Tensor:
    """x * sigmoid(x) from exp and division, which round alike at every position (see above)."""
    return x / (1 + torch.exp(-x))


_GELU_C = math.sqrt(2.0 / math.pi)


def gelu_tanh(x: Tensor) -> Tensor:
    """GPT-2's ``gelu_new``, the same formula transformers evaluates op by op."""
    return 0.5 * x * (1.0 + torch.tanh(_GELU_C * (x + 0.044715 * torch.pow(x, 3.0))))


class RopeTable:
    """cos/sin of every position up to ``max_positions``, computed once, looked up per step.

    ``inv_freq`` and ``scaling`` come from the checkpoint's own rotary module, so any rope type
    whose frequencies do not change with sequence length is reproduced exactly.
    """

    def __init__(self, inv_freq: Tensor, scaling: float, max_positions: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq.float().cpu()[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        self.cos = (angles.cos() * scaling).to(device=device, dtype=dtype)
        self.sin = (angles.sin() * scaling).to(device=device, dtype=dtype)

    def lookup(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos and sin for each row, shaped (rows, 1, head_dim) to broadcast over heads;
        looked up once per forward and shared by every layer."""
        return self.cos[positions][:, None, :], self.sin[positions][:, None, :]


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x`` (rows, heads, head_dim) by its row's angles (rotate-half convention)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin
