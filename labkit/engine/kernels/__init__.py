"""Native kernels, compiled on first use with the machine's C++ compiler and cached.

``paged_decode.cpp`` (decode attention read through the block tables), ``fixed_matmul.cpp`` (the
batch-invariant mode's matmul) and ``rowwise.cpp`` (the row-wise work between the matmuls: RMSNorm,
rotary positions, the K/V write, the MLP gate, the greedy argmax) are plain C++ with OpenMP and no torch headers: each compiles
in about a second with ``g++`` alone (no ninja, no Python headers) and is called through
``ctypes`` with the tensors' data pointers (ctypes lets go of the GIL for the call). OpenMP comes from the ``libgomp.so.1`` torch has already loaded, so the
kernel's threads are torch's threads. The shared library lands in ``$XDG_CACHE_HOME/labkit/
kernels`` (``~/.cache`` by default) under a name that hashes the source, the flags and the CPU,
and is reused by every later process. When it cannot be built (no compiler, a compile error) the
caller gets the reason and the engine falls back to the gather path (see ``attention.py``).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("paged_decode.cpp")
MATMUL_SOURCE = Path(__file__).with_name("fixed_matmul.cpp")
ROWWISE_SOURCE = Path(__file__).with_name("rowwise.cpp")
# -ffp-contract=off: the compiler never fuses a * b + c into one rounding on its own (g++ does by
# default, and whether it does can change with an unrelated edit to a loop); every fma a kernel
# wants is written as one, so each kernel's rounding is what its source says, with any compiler
FLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-shared", "-fPIC", "-std=c++17")
_COMPILER_ENV = "LABKIT_CXX"  # which compiler to use; a path that does not exist forces the fallback


class KernelUnavailable(RuntimeError):
    """The native kernel could not be built or loaded on this machine (the message says why)."""


@dataclass(frozen=True)
class Kernel:
    """A loaded entry point and where it came from."""

    function: ctypes._CFuncPtr  # type: ignore[name-defined]
    path: Path
    vector: bool = True  # fixed_matmul: whether the AVX-512 path was compiled in (else the scalar one)
    entries: dict[str, ctypes._CFuncPtr] = field(default_factory=dict)  # type: ignore[name-defined]  # rowwise: by name


_lock = threading.Lock()
_loaded: dict[tuple[str, str], Kernel | KernelUnavailable] = {}


def compiler() -> str:
    return os.environ.get(_COMPILER_ENV) or os.environ.get("CXX") or "g++"


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "labkit" / "kernels"


def why_unavailable(what: str, device: torch.device, dtype: torch.dtype, load: Callable[[], Kernel]) -> str | None:
    """Why the native ``what`` cannot run for this device and dtype (CPU and float32 only, and it
    must build here), or None when it can; the runner's choices use it to fall back and say why."""
    if device.type != "cpu":
        return f"the {what} is CPU-only; device is {device}"
    if dtype != torch.float32:
        return f"the {what} is float32-only; dtype is {dtype}"
    try:
        load()
    except KernelUnavailable as err:
        return str(err)
    return None


def paged_decode_kernel(cxx: str | None = None) -> Kernel:
    """The compiled attention kernel, built once per machine and loaded once per process; raises
    ``KernelUnavailable`` (with the compiler's reason) when it cannot be had."""
    return _kernel(SOURCE, cxx or compiler())


def fixed_matmul_kernel(cxx: str | None = None) -> Kernel:
    """The compiled fixed-order matmul (``fixed_matmul.cpp``), as ``paged_decode_kernel``."""
    return _kernel(MATMUL_SOURCE, cxx or compiler())


def rowwise_kernel(cxx: str | None = None) -> Kernel:
    """The compiled row-wise ops (``rowwise.cpp``: RMSNorm, rotary positions, the K/V write, the MLP
    gate, the argmax), as ``paged_decode_kernel``; ``entries`` holds them by name."""
    return _kernel(ROWWISE_SOURCE, cxx or compiler())


def _kernel(source: Path, cxx: str) -> Kernel:
    with _lock:
        key = (source.name, cxx)
        if key not in _loaded:
            try:
                _loaded[key] = _load(source, cxx)
            except KernelUnavailable as err:
                _loaded[key] = err
            except OSError as err:  # an unreadable source, an unwritable cache directory, ...
                _loaded[key] = KernelUnavailable(f"could not build the kernel: {err}")
        found = _loaded[key]
    if isinstance(found, KernelUnavailable):
        raise found
    return found


def _load(source_path: Path, cxx: str) -> Kernel:
    exe = shutil.which(cxx)
    if exe is None:
        raise KernelUnavailable(f"no C++ compiler {cxx!r} on this machine (install g++, or set {_COMPILER_ENV})")
    # the headers beside the sources (cephes_exp.h) are part of what a build depends on
    source = source_path.read_bytes() + b"".join(h.read_bytes() for h in sorted(source_path.parent.glob("*.h")))
    key = hashlib.sha256(source + " ".join(FLAGS).encode() + _cpu_signature() + exe.encode()).hexdigest()[:16]
    target = cache_dir() / f"{source_path.stem}-{key}.so"
    if not target.exists():
        _compile(exe, source_path, target)
    try:
        lib = ctypes.CDLL(str(target))
    except OSError as err:
        raise KernelUnavailable(f"built {target} but could not load it: {err}") from None
    ptr, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    if source_path == MATMUL_SOURCE:
        fn = lib.labkit_fixed_matmul
        fn.argtypes = [ptr, i64, i64, i64, ptr, i64, ptr, ptr, i64, i32, i32]
        fn.restype = i32
        vector = bool(lib.labkit_fixed_matmul_has_vector())
        return Kernel(fn, target, vector=vector)
    if source_path == ROWWISE_SOURCE:
        entries = _rowwise_entries(lib)
        return Kernel(entries["rms_norm"], target, entries=entries)
    fn = lib.labkit_paged_decode
    fn.restype = i32
    fn.argtypes = [ptr] * 5 + [i64] * 2 + [i32] * 8 + [ctypes.c_float, i32]
    return Kernel(fn, target)


def _rowwise_entries(lib: ctypes.CDLL) -> dict[str, ctypes._CFuncPtr]:  # type: ignore[name-defined]
    ptr, i32, i64, f32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
    signatures = {
        "rms_norm": [ptr, ptr, i64, i64, i64, i64, ptr, f32, ptr, i32],
        "rope": [ptr, i64, i64, i64, i64, ptr, ptr, i64, i32],
        "kv_write": [ptr, ptr, i64, i64, i64, i64, ptr, ptr, i64],
        "silu_mul": [ptr, i64, i64, i64, ptr, i32],
        "argmax_rows": [ptr, i64, i64, i64, ptr, i32],
    }
    entries = {}
    for name, argtypes in signatures.items():
        fn = getattr(lib, f"labkit_{name}")
        fn.argtypes, fn.restype = argtypes, i32
        entries[name] = fn
    return entries


def _compile(exe: str, source: Path, target: Path) -> None:
    """Build into a temporary file and rename it into place, so two processes building at once
    never load a half-written library."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run(
            [exe, *FLAGS, str(source), "-o", tmp], capture_output=True, text=True, timeout=300, check=False
        )
        if done.returncode != 0:
            raise KernelUnavailable(f"{exe} failed to compile {source.name}: {done.stderr.strip()[-800:]}")
        os.replace(tmp, target)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise KernelUnavailable(f"could not run {exe}: {err}") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _cpu_signature() -> bytes:
    """What ``-march=native`` depends on: a library built for one CPU may not run on another."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor().encode()
    lines = [line for line in text.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(lines))).encode()
