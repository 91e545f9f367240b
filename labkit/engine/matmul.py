"""The batch-invariant mode's matrix product: every output element summed in one fixed order.

``kernels/fixed_matmul.cpp`` computes ``y[m, n] = bias[n] + sum_k x[m, k] * w[k, n]`` as a chain of
fused multiply-adds in k order for every element. A fused multiply-add rounds once whether a vector
unit or a scalar loop runs it, so an element's bits depend on its own row and the weight only:
not on how many rows share the call, which register tile a row lands in, or how the columns are
split between threads. Batch invariance holds by construction, at any batch size, with no
padding and no probe (compare ``layers.Tiling``, the library fallback). (It assumes every thread
treats subnormal numbers alike, as they do unless a caller sets flush-to-zero on one thread.)

The weight is packed once, when the runner starts, into panels of 48 columns stored k-major, so
the kernel streams each panel contiguously instead of re-packing the weight on every call as the
library does; ``labkit bench step`` shows what that is worth beside the library's matmuls.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from labkit.engine.kernels import fixed_matmul_kernel, why_unavailable

PANEL = 48  # columns per panel: fixed_matmul.cpp's NR
MATMUL_MODES = ("auto", "kernel", "library")


@dataclass(frozen=True)
class MatmulChoice:
    """How a batch-invariant runner multiplies, and why (shown in benches and logs)."""

    mode: str  # "kernel" (fixed order, fixed_matmul.cpp) or "library" (probed torch.mm chunks)
    reason: str


def choose_matmul(requested: str, device: torch.device, dtype: torch.dtype) -> MatmulChoice:
    """``"auto"``: the fixed-order kernel where it applies and builds, the library's chunked
    matmuls otherwise (with the reason). ``"kernel"`` raises ValueError where it cannot be had."""
    if requested not in MATMUL_MODES:
        raise ValueError(f"matmul must be one of {MATMUL_MODES}, got {requested!r}")
    if requested == "library":
        return MatmulChoice("library", "asked for")
    why_not = why_unavailable("fixed-order kernel", device, dtype, fixed_matmul_kernel)
    if why_not is None:
        return MatmulChoice("kernel", "compiled and loaded" if requested == "kernel" else "auto: kernel available")
    if requested == "kernel":
        raise ValueError(f"matmul='kernel' is unavailable: {why_not}")
    return MatmulChoice("library", f"auto: {why_not}")


@dataclass(frozen=True, eq=False)
class PackedWeight:
    """A (in, out) float32 weight cut into panels of ``PANEL`` columns, each stored k-major
    (panels, in, PANEL); columns past ``out`` are zero."""

    panels: Tensor
    rows: int  # in
    cols: int  # out

    def __post_init__(self) -> None:
        """What the kernel will read, checked once here (however the object was made), so that no
        call can send it past the panels' end."""
        p = self.panels
        if not (
            self.rows >= 1
            and self.cols >= 1
            and p.dtype == torch.float32
            and p.is_cpu
            and p.is_contiguous()
            and tuple(p.shape) == (-(-self.cols // PANEL), self.rows, PANEL)
        ):
            raise ValueError(
                f"PackedWeight: panels must be contiguous float32 ({-(-self.cols // PANEL)}, {self.rows}, {PANEL}) "
                f"for a ({self.rows}, {self.cols}) weight, got {tuple(p.shape)} {p.dtype}"
            )

    @classmethod
    def pack(cls, weight: Tensor) -> PackedWeight:
        if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu" or 0 in weight.shape:
            raise ValueError(
                f"pack: a non-empty 2-D float32 CPU weight is needed, got {tuple(weight.shape)} {weight.dtype}"
            )
        k, n = weight.shape
        count = -(-n // PANEL)
        wide = weight.new_zeros(k, count * PANEL)
        wide[:, :n] = weight
        return cls(wide.view(k, count, PANEL).permute(1, 0, 2).contiguous(), k, n)


def fixed_matmul(x: Tensor, packed: PackedWeight, bias: Tensor | None = None, *, vector: bool = True) -> Tensor:
    """``x @ weight + bias`` in the fixed order, for ``x`` (rows, in) float32 on the CPU; a new
    contiguous tensor (rows, out). ``vector=False`` runs the scalar path (the same bits; the tests
    compare the two). The checks are the cheap ones a decode step can afford on every call."""
    if not (x.dtype == torch.float32 and x.is_cpu and x.dim() == 2 and x.shape[1] == packed.rows):
        raise ValueError(
            f"fixed_matmul: x must be (rows, {packed.rows}) float32 on the CPU, got {tuple(x.shape)} {x.dtype} {x.device}"
        )
    if bias is not None and not (
        bias.dtype == torch.float32 and bias.is_cpu and bias.shape == (packed.cols,) and bias.is_contiguous()
    ):
        raise ValueError(f"fixed_matmul: bias must be a contiguous float32 ({packed.cols},), got {tuple(bias.shape)}")
    if not x.is_contiguous():
        x = x.contiguous()
    rows = x.shape[0]
    out = x.new_empty(rows, packed.cols)
    if rows and _matmul()(
        x.data_ptr(),
        rows,
        packed.rows,
        packed.rows,
        packed.panels.data_ptr(),
        packed.cols,
        None if bias is None else bias.data_ptr(),
        out.data_ptr(),
        packed.cols,
        torch.get_num_threads(),
        int(vector),
    ):
        raise ValueError(
            f"fixed_matmul: the kernel refused x {tuple(x.shape)} against a ({packed.rows}, {packed.cols}) weight"
        )
    return out


_FUNCTION: list[Any] = []  # the loaded entry point, looked up once (fixed_matmul_kernel takes a lock)


def _matmul() -> Any:
    if not _FUNCTION:
        _FUNCTION.append(fixed_matmul_kernel().function)
    return _FUNCTION[0]


@dataclass(frozen=True, eq=False)
class FixedOrder:
    """What ``layers.linear`` gets in the batch-invariant mode when the kernel builds: each weight's
    packed panels, by ``id(weight)``. Any number of rows rounds alike, so nothing is padded.

    The panels are a copy, made when the runner starts: the invariant mode holds every matmul
    weight twice (the (in, out) original serves the plain mode and the bench's floor), and a weight
    changed in place afterwards is not seen here."""

    packed: dict[int, PackedWeight] = field(repr=False)

    @classmethod
    def of(cls, weights: list[Tensor]) -> FixedOrder:
        return cls({id(w): PackedWeight.pack(w) for w in weights})

    def padded(self, rows: int) -> int:
        return rows

    def matmul(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        packed = self.packed.get(id(weight))
        if packed is None or (packed.rows, packed.cols) != tuple(weight.shape):
            raise ValueError(f"a ({weight.shape[0]}, {weight.shape[1]}) weight was not packed when the runner started")
        return fixed_matmul(x, packed, bias)
