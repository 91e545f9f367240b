"""The row-wise work between a layer's matmuls, each as one native call (``kernels/rowwise.cpp``).

RMSNorm (after the residual add), rotary positions, the K/V write into the paged pool, the Llama
MLP's gate and the greedy argmax. torch runs each of these as several parallel ops: RMSNorm is
six, the rotation four, the K/V write two index copies. At the decode step the tensors are small
and those ops' dispatch and thread hand-offs, not their arithmetic, are what they cost: at a
32-row SmolLM2 step about a fifth of the step. Each native call is one loop over rows on the
calling thread (two threads only for a large prefill pass), and a row's bits depend on that row
alone, so both modes use them; the runner turns them on where the kernels build (CPU, float32),
see ``ModelRunner.native_ops``.

Every function checks its tensors and raises ValueError for a shape, dtype or device it does not
take, before the kernel sees a pointer.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from labkit.engine.kernels import rowwise_kernel, why_slow, why_unavailable


def available(device: torch.device, dtype: torch.dtype, fast_only: bool = False) -> str | None:
    """None where the row-wise kernels run (CPU, float32, and they build; with ``fast_only``, a
    build with hardware FMA, as ``auto`` asks), else why not."""
    why_not = why_unavailable("row-wise kernels", device, dtype, rowwise_kernel)
    return why_slow(rowwise_kernel()) if why_not is None and fast_only else why_not


_ENTRIES: dict[str, Any] = {}  # the loaded entry points, looked up once (rowwise_kernel takes a lock)


def _entry(name: str) -> Any:
    if not _ENTRIES:
        _ENTRIES.update(rowwise_kernel().entries)
    return _ENTRIES[name]


def _rows(t: Tensor, what: str, width: int | None = None) -> Tensor:
    """``t`` as float32 CPU rows with contiguous elements (a row stride is fine), else ValueError."""
    if t.dim() != 2 or t.dtype != torch.float32 or not t.is_cpu or (width is not None and t.shape[1] != width):
        want = f"(rows, {width})" if width is not None else "(rows, width)"
        raise ValueError(f"{what} must be {want} float32 on the CPU, got {tuple(t.shape)} {t.dtype} on {t.device}")
    if t.stride(1) != 1 or (t.shape[0] > 1 and t.stride(0) < t.shape[1]):
        raise ValueError(f"{what} must have contiguous rows, got strides {t.stride()}")
    return t


def _ld(t: Tensor) -> int:
    return t.stride(0) if t.shape[0] > 1 else t.shape[1]


def rms_norm(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None) -> Tensor:
    """``x / sqrt(mean(x**2) + eps) * weight`` per row of ``x`` (rows, width), in a new tensor.

    With ``residual``, first ``x += residual`` **in place** (the residual stream's update, as the
    layer's ``add_`` did), so one pass reads ``x`` once for both. An inference-only op: the write
    goes through the data pointer, unseen by autograd."""
    x = _rows(x, "rms_norm: x")
    width = x.shape[1]
    if weight.dtype != torch.float32 or weight.shape != (width,) or not weight.is_contiguous() or not weight.is_cpu:
        raise ValueError(f"rms_norm: weight must be a contiguous float32 ({width},), got {tuple(weight.shape)}")
    if residual is not None:
        residual = _rows(residual, "rms_norm: residual", width)
        if residual.shape[0] != x.shape[0]:
            raise ValueError(f"rms_norm: residual has {residual.shape[0]} rows, x {x.shape[0]}")
        if residual.data_ptr() == x.data_ptr() and x.numel():
            raise ValueError("rms_norm: residual must not be x itself (x is updated in place)")
    out = torch.empty(x.shape[0], width, dtype=torch.float32)
    if x.shape[0] and _entry("rms_norm")(
        x.data_ptr(),
        None if residual is None else residual.data_ptr(),
        x.shape[0],
        width,
        _ld(x),
        0 if residual is None else _ld(residual),
        weight.data_ptr(),
        eps,
        out.data_ptr(),
        torch.get_num_threads(),
    ):
        raise ValueError(f"rms_norm: the kernel refused x {tuple(x.shape)}")
    return out


def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x`` (rows, heads, d) **in place** by the rows' ``cos`` and ``sin`` (rows, d), as
    ``layers.rotate`` does (bitwise: the same products and sums); returns ``x``.

    ``x`` may be a view into a wider row (the q and k heads of the fused q/k/v output)."""
    if x.dim() != 3 or x.dtype != torch.float32 or not x.is_cpu or x.stride(2) != 1 or x.stride(1) != x.shape[2]:
        raise ValueError(
            f"rope: x must be (rows, heads, d) float32 with contiguous heads, got {tuple(x.shape)} {x.stride()}"
        )
    rows, heads, d = x.shape
    ld = x.stride(0) if rows > 1 else heads * d
    if ld < heads * d:
        raise ValueError(f"rope: x's rows overlap (row stride {ld} < {heads * d})")
    for table, name in ((cos, "cos"), (sin, "sin")):
        if tuple(table.shape) not in ((rows, d), (rows, 1, d)):
            raise ValueError(f"rope: {name} must be ({rows}, {d}) or ({rows}, 1, {d}), got {tuple(table.shape)}")
    if rows == 0:
        return x
    cos, sin = _rows(cos.reshape(rows, d), "rope: cos", d), _rows(sin.reshape(rows, d), "rope: sin", d)
    if _ld(cos) != _ld(sin):
        raise ValueError("rope: cos and sin must have the same layout")
    if rows and _entry("rope")(
        x.data_ptr(), rows, ld, heads, d, cos.data_ptr(), sin.data_ptr(), _ld(cos), torch.get_num_threads()
    ):
        raise ValueError(f"rope: the kernel refused x {tuple(x.shape)} (d must be even and at most 1024)")
    return x


def kv_write(pool: Tensor, slots: Tensor, k: Tensor, v: Tensor) -> None:
    """Store ``k`` and ``v`` (rows, heads, d) at flat ``slots`` of one layer's ``pool``
    (2, heads, slots, d), keys at index 0: ``KVPool.write`` in one call. A slot out of range
    raises ValueError and writes nothing."""
    rows = k.shape[0]
    if (
        pool.dim() != 4
        or pool.shape[0] != 2
        or not pool.is_contiguous()
        or pool.dtype != torch.float32
        or not pool.is_cpu
    ):
        raise ValueError(f"kv_write: pool must be a contiguous float32 (2, heads, slots, d), got {tuple(pool.shape)}")
    _, heads, total, d = pool.shape
    for t, name in ((k, "k"), (v, "v")):
        if t.shape != (rows, heads, d) or t.dtype != torch.float32 or not t.is_cpu or t.stride()[1:] != (d, 1):
            raise ValueError(f"kv_write: {name} must be ({rows}, {heads}, {d}) float32 with contiguous heads")
    if k.stride(0) != v.stride(0):
        raise ValueError("kv_write: k and v must have the same row stride")
    if slots.shape != (rows,) or slots.dtype != torch.long or not slots.is_contiguous() or not slots.is_cpu:
        raise ValueError(f"kv_write: slots must be a contiguous long ({rows},), got {tuple(slots.shape)}")
    ld = k.stride(0) if rows > 1 else heads * d
    status = _entry("kv_write")(
        k.data_ptr(), v.data_ptr(), rows, ld, heads, d, slots.data_ptr(), pool.data_ptr(), total
    )
    if status:
        raise ValueError(f"kv_write: a slot is outside the pool's {total}" if status == 2 else "kv_write: bad shapes")


def silu_mul(gate_up: Tensor) -> Tensor:
    """``silu(gate) * up`` for ``gate_up`` (rows, 2 * width) holding gate then up, in one native
    pass (``labkit_silu_mul``): the Llama MLP's gate without five parallel torch ops. Every
    element is computed by the same code wherever it sits, so rows stay independent."""
    if gate_up.dim() != 2 or gate_up.dtype != torch.float32 or gate_up.device.type != "cpu" or gate_up.shape[1] % 2:
        raise ValueError(f"silu_mul: gate_up must be (rows, 2 * width) float32 on the CPU, got {tuple(gate_up.shape)}")
    if gate_up.stride(1) != 1 or (gate_up.shape[0] > 1 and gate_up.stride(0) < gate_up.shape[1]):
        gate_up = gate_up.contiguous()
    rows, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, width, dtype=torch.float32)
    if rows == 0:
        return out
    if _entry("silu_mul")(gate_up.data_ptr(), rows, width, _ld(gate_up), out.data_ptr(), torch.get_num_threads()):
        raise ValueError(f"silu_mul: the kernel refused gate_up {tuple(gate_up.shape)}")
    return out


def argmax_rows(logits: Tensor) -> Tensor:
    """``torch.argmax(logits, dim=-1)`` for float32 CPU ``logits`` (rows, vocab) in one native
    call (``labkit_argmax_rows``): the same indices (first maximum; a NaN counts as the largest),
    without torch's scalar loop over a step's logits."""
    if logits.dim() != 2 or logits.dtype != torch.float32 or logits.device.type != "cpu" or logits.shape[1] < 1:
        raise ValueError(f"argmax_rows: logits must be (rows, vocab) float32 on the CPU, got {tuple(logits.shape)}")
    if logits.stride(1) != 1 or (logits.shape[0] > 1 and logits.stride(0) < logits.shape[1]):
        logits = logits.contiguous()
    rows = logits.shape[0]
    out = torch.empty(rows, dtype=torch.long)
    if rows == 0:
        return out
    if _entry("argmax_rows")(
        logits.data_ptr(), rows, logits.shape[1], _ld(logits), out.data_ptr(), torch.get_num_threads()
    ):
        raise ValueError(f"argmax_rows: the kernel refused logits {tuple(logits.shape)}")
    return out
