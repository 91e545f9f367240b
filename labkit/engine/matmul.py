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

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import Tensor

from labkit.engine.kernels import Kernel, decide, fixed_matmul_kernel, write_atomically

PANEL = 48  # columns per panel: fixed_matmul.cpp's NR
MATMUL_MODES = ("auto", "kernel", "library")


@dataclass(frozen=True)
class MatmulChoice:
    """How a batch-invariant runner multiplies, and why (shown in benches and logs)."""

    mode: str  # "kernel" (fixed order, fixed_matmul.cpp) or "library" (probed torch.mm chunks)
    reason: str


def choose_matmul(requested: str, device: torch.device, dtype: torch.dtype) -> MatmulChoice:
    """``"auto"``: the fixed-order kernel where it applies, builds with hardware FMA and, measured
    once on this machine against the library (``speed_check``), is not much slower; the library's
    chunked matmuls otherwise (with the reason). ``"kernel"`` raises ValueError where it cannot be had."""
    if requested not in MATMUL_MODES:
        raise ValueError(f"matmul must be one of {MATMUL_MODES}, got {requested!r}")
    if requested == "library":
        return MatmulChoice("library", "asked for")
    kernel, reason = decide("matmul", requested, "fixed-order kernel", device, dtype, fixed_matmul_kernel)
    if kernel is None:
        return MatmulChoice("library", f"{reason}; using the library's matmuls")
    if requested == "kernel":
        return MatmulChoice("kernel", reason)
    check = speed_check(kernel)
    if not check.kernel_is_fast_enough:
        return MatmulChoice(
            "library", f"auto: the kernel measured slower here ({check.words()}); using the library's matmuls"
        )
    return MatmulChoice("kernel", f"{reason}; {check.words()}")


# -- is the kernel fast enough here? --------------------------------------------------------------
SPEED_SHAPE = (576, 1536)  # SmolLM2-135M's MLP up-projection, (in, out): the lab's most common product
SPEED_ROWS = (1, 32)  # a lone decode row and a full decode batch
SLOWER_LIMIT = 2.0  # auto takes the kernel unless it is more than this many times the library's time


@dataclass(frozen=True)
class SpeedCheck:
    """The kernel against torch's own matmul on one shape, at each of ``rows``: the fastest call of
    a few interleaved rounds, in ms. Measured once per build and thread count, kept beside the build."""

    rows: tuple[int, ...]
    kernel_ms: tuple[float, ...]
    library_ms: tuple[float, ...]
    threads: int

    @property
    def kernel_is_fast_enough(self) -> bool:
        return all(k <= SLOWER_LIMIT * lib for k, lib in zip(self.kernel_ms, self.library_ms))

    def words(self) -> str:
        """``measured once: kernel 0.05/0.9 ms, library 0.04/1.3 ms at 1/32 rows of 576x1536, 2 threads``."""
        ms = lambda values: "/".join(f"{v:.0f}" if v >= 10 else f"{v:.2g}" for v in values)  # noqa: E731
        rows = "/".join(map(str, self.rows))
        k, n = SPEED_SHAPE
        return (
            f"measured once: kernel {ms(self.kernel_ms)} ms, library {ms(self.library_ms)} ms "
            f"at {rows} rows of {k}x{n}, {self.threads} thread{'s' if self.threads != 1 else ''}"
        )


def speed_check(kernel: Kernel) -> SpeedCheck:
    """``kernel`` timed against ``torch.mm``, read from beside the build where it was measured
    before (a CPU's answer does not change). The fastest calls are compared, so a busy machine
    seldom decides, and the limit is generous: what it is for, a build that runs its fmas without
    a vector unit or an exotic CPU, costs tens of times the library's time, not twice."""
    threads = torch.get_num_threads()
    record = kernel.path.with_name(f"{kernel.path.stem}.speed-t{threads}.json")
    try:
        saved = json.loads(record.read_text())
        return SpeedCheck(tuple(saved["rows"]), tuple(saved["kernel_ms"]), tuple(saved["library_ms"]), threads)
    except (OSError, ValueError, KeyError, TypeError):
        pass
    check = _measure(kernel, threads)
    measured = {"rows": check.rows, "kernel_ms": check.kernel_ms, "library_ms": check.library_ms}
    write_atomically(record, json.dumps(measured).encode())  # an unwritable cache: measure again next time
    return check


def _measure(kernel: Kernel, threads: int, rounds: int = 3) -> SpeedCheck:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(SPEED_SHAPE, generator=gen) / SPEED_SHAPE[0] ** 0.5
    packed = PackedWeight.pack(weight)
    best: dict[tuple[str, int], float] = {}
    for _ in range(rounds):  # interleaved: kernel, library, kernel, library, ...
        for rows in SPEED_ROWS:
            x = torch.randn(rows, SPEED_SHAPE[0], generator=gen)
            runs = {"kernel": partial(fixed_matmul, x, packed, kernel=kernel), "library": partial(torch.mm, x, weight)}
            for name, run in runs.items():
                ms = _time_ms(run, max(8, 32 // rows))
                best[name, rows] = min(ms, best.get((name, rows), ms))
    timed = {name: tuple(round(best[name, r], 4) for r in SPEED_ROWS) for name in ("kernel", "library")}
    return SpeedCheck(SPEED_ROWS, timed["kernel"], timed["library"], threads)


def _time_ms(run: Callable[[], object], calls: int) -> float:
    """The fastest of ``calls`` calls of ``run``, in ms, after one to warm up: the best case, so
    that a thread parked by a busy machine (which can cost a whole call) does not decide."""
    run()
    best = float("inf")
    for _ in range(calls):
        started = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - started)
    return best * 1000


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


def fixed_matmul(
    x: Tensor, packed: PackedWeight, bias: Tensor | None = None, *, vector: bool = True, kernel: Kernel | None = None
) -> Tensor:
    """``x @ weight + bias`` in the fixed order, for ``x`` (rows, in) float32 on the CPU; a new
    contiguous tensor (rows, out). ``vector=False`` runs the scalar path (the same bits; the tests
    compare the two); ``kernel``, a build other than the process's (the speed check, the tests).
    The checks are the cheap ones a decode step can afford on every call."""
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
    if rows and (kernel.function if kernel is not None else _matmul())(
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
