"""Native kernels, compiled on first use with the machine's C++ compiler and cached.

``paged_decode.cpp`` (decode attention read through the block tables), ``fixed_matmul.cpp`` (the
batch-invariant mode's matmul) and ``rowwise.cpp`` (the row-wise work between the matmuls: RMSNorm,
rotary positions, the K/V write, the MLP gate, the greedy argmax) are plain C++ with no torch
headers: each compiles in about a second with the compiler alone (no ninja, no Python headers) and
is called through ``ctypes`` with the tensors' data pointers (ctypes lets go of the GIL for the call).

Where the compiler takes ``-fopenmp`` the loops run on torch's threads (the ``libgomp`` torch has
loaded); where it does not (Apple's clang) the same source builds without it and runs on the
calling thread, with the same bits: OpenMP only decides which thread runs a row or a panel. The
instruction set is ``-march=native`` unless ``LABKIT_KERNEL_MARCH`` names another (``x86-64-v3``,
or ``none`` for the compiler's default); a flag the compiler refuses is left out and said. Each
optional flag is probed once per compiler and the answer cached. The shared library lands in
``$XDG_CACHE_HOME/labkit/kernels`` (``~/.cache`` by default) under a name that hashes the source,
its headers, the flags, the compiler and the CPU, and is reused by every later process.

What was built, and why not where nothing was, is one call away: :func:`build_report` (a row per
kernel) and :func:`build_summary` (one line a notebook's first table can show). A failure is logged
once per process; the runner's ``attention.reason`` and ``matmul.reason`` carry it, and the engine
falls back to torch's ops.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from labkit.machine import cpu_flags, cpu_model

SOURCE = Path(__file__).with_name("paged_decode.cpp")
MATMUL_SOURCE = Path(__file__).with_name("fixed_matmul.cpp")
ROWWISE_SOURCE = Path(__file__).with_name("rowwise.cpp")
SOURCES = {"paged_decode": SOURCE, "fixed_matmul": MATMUL_SOURCE, "rowwise": ROWWISE_SOURCE}
# -ffp-contract=off: the compiler never fuses a * b + c into one rounding on its own (g++ does by
# default, and whether it does can change with an unrelated edit to a loop); every fma a kernel
# wants is written as one, so each kernel's rounding is what its source says, with any compiler
# and any instruction set
BASE_FLAGS = ("-O3", "-ffp-contract=off", "-shared", "-fPIC", "-std=c++17")
OPENMP_FLAG = "-fopenmp"
FEATURES = {1: "fma", 2: "avx2", 4: "avx512f", 8: "openmp"}  # build_features.h's bits
_COMPILER_ENV = "LABKIT_CXX"  # which compiler to use; a path that does not exist forces the fallback
_MARCH_ENV = "LABKIT_KERNEL_MARCH"  # the instruction set: native (default), x86-64-v3, ..., or none
_PROBE = b'extern "C" int labkit_probe(int n) {\n  int s = 0;\n#pragma omp parallel for reduction(+ : s)\n  for (int i = 0; i < n; ++i) s += i;\n  return s;\n}\n'
_log = logging.getLogger(__name__)


class KernelUnavailable(RuntimeError):
    """The native kernel could not be built or loaded on this machine (the message says why, in a
    line)."""


@dataclass(frozen=True)
class BuildOptions:
    """How the kernels are compiled: the compiler and the target instruction set (``""``: the
    compiler's default). OpenMP is used wherever the compiler takes it."""

    compiler: str = "g++"
    march: str = "native"

    @classmethod
    def from_env(cls) -> BuildOptions:
        march = os.environ.get(_MARCH_ENV, "native").strip()
        return cls(compiler(), "" if march.lower() in ("", "none") else march)

    def wanted(self) -> tuple[str, ...]:
        """The optional flags, in the order they are probed."""
        return ((f"-march={self.march}",) if self.march else ()) + (OPENMP_FLAG,)


@dataclass(frozen=True)
class Kernel:
    """A loaded entry point and what it was built with."""

    function: ctypes._CFuncPtr  # type: ignore[name-defined]
    path: Path
    flags: tuple[str, ...] = ()
    features: frozenset[str] = frozenset()  # fma, avx2, avx512f, openmp: what the compiler was told to use
    notes: tuple[str, ...] = ()  # a flag left out and why ("without -fopenmp (...): one thread")
    entries: dict[str, ctypes._CFuncPtr] = field(default_factory=dict)  # type: ignore[name-defined]  # rowwise: by name


_lock = threading.Lock()
_loaded: dict[tuple[str, BuildOptions, str], Kernel | KernelUnavailable] = {}
_probed: dict[tuple[str, str, str], str] = {}
_logged: set[str] = set()


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


def why_slow(kernel: Kernel) -> str | None:
    """Why ``auto`` should not pick this build although it runs, or None: without hardware FMA
    (``-march=x86-64-v2``, an old CPU) every ``std::fma`` is a call into the C library, and the
    kernels are tens of times slower than torch's (measured: 70x at a 32-row decode step)."""
    if "fma" in kernel.features:
        return None
    target = next((f for f in kernel.flags if f.startswith("-march=")), "the compiler's default target")
    return f"the build ({target}) has no hardware FMA: each fma would be a software call, far slower than torch's ops"


def decide(
    setting: str, requested: str, what: str, device: torch.device, dtype: torch.dtype, load: Callable[[], Kernel]
) -> tuple[Kernel | None, str]:
    """A runner's choice for ``setting`` (``attention``, ``matmul``): the kernel and why, or None
    and why not. ``"kernel"`` takes any build that runs (ValueError where none does); ``"auto"``
    only one with hardware FMA. Notes on the build (no OpenMP) travel in the reason."""
    why_not = why_unavailable(what, device, dtype, load)
    if why_not is not None:
        if requested == "kernel":
            raise ValueError(f"{setting}='kernel' is unavailable: {why_not}")
        return None, f"auto: {why_not}"
    kernel = load()
    notes = "".join(f"; {note}" for note in kernel.notes)
    slow = why_slow(kernel)
    if requested == "kernel":
        return kernel, "compiled and loaded" + notes + (f"; slow here: {slow}" if slow else "")
    if slow is not None:
        return None, f"auto: {slow}"
    return kernel, "auto: kernel available" + notes


def paged_decode_kernel() -> Kernel:
    """The compiled attention kernel, built once per machine and loaded once per process; raises
    ``KernelUnavailable`` (with the compiler's reason) when it cannot be had."""
    return _kernel(SOURCE, BuildOptions.from_env())


def fixed_matmul_kernel() -> Kernel:
    """The compiled fixed-order matmul (``fixed_matmul.cpp``), as ``paged_decode_kernel``."""
    return _kernel(MATMUL_SOURCE, BuildOptions.from_env())


def rowwise_kernel() -> Kernel:
    """The compiled row-wise ops (``rowwise.cpp``: RMSNorm, rotary positions, the K/V write, the MLP
    gate, the argmax), as ``paged_decode_kernel``; ``entries`` holds them by name."""
    return _kernel(ROWWISE_SOURCE, BuildOptions.from_env())


# -- the report ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class KernelBuild:
    """One kernel's build on this machine: built or not, and in words why."""

    name: str
    built: bool
    compiler: str
    flags: tuple[str, ...] = ()
    features: frozenset[str] = frozenset()
    notes: tuple[str, ...] = ()
    reason: str = ""  # why it was not built ("" when it was)

    def words(self) -> str:
        """``built (g++ -march=native; OpenMP; FMA, AVX2, AVX-512)`` or ``not built — <reason>``."""
        if not self.built:
            return f"not built — {self.reason}"
        march = next((f for f in self.flags if f.startswith("-march=")), "default target")
        threads = "OpenMP" if "openmp" in self.features else "one thread"
        isa = ", ".join(_ISA[f] for f in ("fma", "avx2", "avx512f") if f in self.features) or "no FMA"
        said = f"built ({Path(self.compiler).name} {march}; {threads}; {isa})"
        return "; ".join((said, *self.notes))


_ISA = {"fma": "FMA", "avx2": "AVX2", "avx512f": "AVX-512"}


def build_report(options: BuildOptions | None = None) -> list[KernelBuild]:
    """Each kernel built (or found in the cache) with ``options`` (the environment's by default)."""
    options = options or BuildOptions.from_env()
    report = []
    for name, source in SOURCES.items():
        try:
            k = _kernel(source, options)
        except KernelUnavailable as err:
            report.append(KernelBuild(name, False, options.compiler, reason=str(err)))
        else:
            report.append(KernelBuild(name, True, options.compiler, k.flags, k.features, k.notes))
    return report


def build_summary(options: BuildOptions | None = None) -> str:
    """One line for a notebook's first table: ``kernels: built (...)``, or ``kernels: not built —
    <reason>; using the library path``, or one phrase per kernel where they differ."""
    report = build_report(options)
    said = {b.words() for b in report}
    if len(said) == 1:
        only = said.pop()
        return f"kernels: {only}" + ("; using the library path" if not report[0].built else "")
    return "kernels: " + "; ".join(f"{b.name} {b.words()}" for b in report)


# -- building and loading ------------------------------------------------------------------------
def _kernel(source: Path, options: BuildOptions) -> Kernel:
    with _lock:
        key = (source.name, options, str(cache_dir()))
        if key not in _loaded:
            try:
                _loaded[key] = _load(source, options)
            except KernelUnavailable as err:
                _loaded[key] = err
            except OSError as err:  # an unreadable source, an unwritable cache directory, ...
                _loaded[key] = KernelUnavailable(f"could not build the kernel: {err}")
            found = _loaded[key]
            if isinstance(found, KernelUnavailable) and str(found) not in _logged:
                _logged.add(str(found))
                _log.warning("kernels: %s not built — %s; the engine uses torch's ops instead", source.stem, found)
        found = _loaded[key]
    if isinstance(found, KernelUnavailable):
        raise found
    return found


def _load(source_path: Path, options: BuildOptions) -> Kernel:
    exe = shutil.which(options.compiler)
    if exe is None:
        raise KernelUnavailable(
            f"no C++ compiler {options.compiler!r} on this machine (install g++, or set {_COMPILER_ENV})"
        )
    flags, notes = _flags(exe, options)
    # the headers beside the sources (cephes_exp.h, build_features.h) are part of what a build depends on
    source = source_path.read_bytes() + b"".join(h.read_bytes() for h in sorted(source_path.parent.glob("*.h")))
    key = hashlib.sha256(source + " ".join(flags).encode() + _cpu_signature() + exe.encode()).hexdigest()[:16]
    target = cache_dir() / f"{source_path.stem}-{key}.so"
    if not target.exists():
        _compile(exe, flags, source_path, target)
    try:
        lib = ctypes.CDLL(str(target))
    except OSError as err:
        raise KernelUnavailable(f"built {target} but could not load it: {err}") from None
    lib.labkit_features.restype = ctypes.c_int
    bits = lib.labkit_features()
    features = frozenset(name for bit, name in FEATURES.items() if bits & bit)
    ptr, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    entries = {}
    if source_path.stem == "fixed_matmul":
        fn = lib.labkit_fixed_matmul
        fn.argtypes = [ptr, i64, i64, i64, ptr, i64, ptr, ptr, i64, i32, i32]
        fn.restype = i32
    elif source_path.stem == "rowwise":
        entries = _rowwise_entries(lib)
        fn = entries["rms_norm"]
    else:
        fn = lib.labkit_paged_decode
        fn.restype = i32
        fn.argtypes = [ptr] * 5 + [i64] * 2 + [i32] * 8 + [ctypes.c_float, i32]
    return Kernel(fn, target, flags, features, notes, entries)


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


def _flags(exe: str, options: BuildOptions) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The flags this compiler takes: the base ones (or KernelUnavailable), then each optional one
    it accepts; a refused one is left out with a note saying what that costs."""
    refused = _refusal(exe, "")
    if refused:
        raise KernelUnavailable(f"{Path(exe).name} failed to compile a test library: {refused}")
    flags, notes = list(BASE_FLAGS), []
    for flag in options.wanted():
        refused = _refusal(exe, flag)
        if not refused:
            flags.append(flag)
            continue
        cost = "one thread" if flag == OPENMP_FLAG else "the compiler's default target"
        notes.append(f"without {flag} ({refused}): {cost}")
    return tuple(flags), tuple(notes)


def _refusal(exe: str, flag: str) -> str:
    """``""`` when ``exe`` builds a small shared library with the base flags and ``flag``, else the
    compiler's complaint in a line. Cached in memory and beside the kernels, keyed by the compiler's
    path, size and time, so a process does not pay a compile to learn it again."""
    stat = os.stat(exe)
    key = (exe, f"{stat.st_size}-{stat.st_mtime_ns}", flag)
    if key in _probed:
        return _probed[key]
    record = cache_dir() / f"probe-{hashlib.sha256(repr(key).encode() + _PROBE).hexdigest()[:16]}.json"
    try:
        answer = str(json.loads(record.read_text())["refusal"])
    except (OSError, ValueError, KeyError, TypeError):
        answer = _try_compile(exe, flag)
        write_atomically(record, json.dumps({"compiler": exe, "flag": flag, "refusal": answer}).encode())
    _probed[key] = answer
    return answer


def _try_compile(exe: str, flag: str) -> str:
    with tempfile.TemporaryDirectory(prefix="labkit-probe-") as tmp:
        src = Path(tmp) / "probe.cpp"
        src.write_bytes(_PROBE)
        command = [exe, *BASE_FLAGS, *([flag] if flag else []), str(src), "-o", str(Path(tmp) / "probe.so")]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
        except (OSError, subprocess.TimeoutExpired) as err:
            return f"could not run it: {err}"
    return "" if done.returncode == 0 else _short(exe, done.stderr, done.returncode)


def _short(exe: str, stderr: str, status: int) -> str:
    """The compiler's first error in one line: ``clang: unsupported option '-fopenmp'``."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower() and "ld returned" not in line]
    linker = [line for line in lines if "ld:" in line or "cannot find" in line]
    first = (errors or linker or lines[-1:] or [""])[0]
    if not first:
        return f"{Path(exe).name} exited with status {status}"
    first = re.sub(r"^\S+?:(\d+:)+\s*", "", first)  # a source position: file.cpp:12:3:
    first = re.sub(r"^[\w.+-]+:\s+(?=(fatal )?error:)", "", first)  # the driver's name: clang: error:
    first = re.sub(r"^(fatal )?error:\s*", "", first)
    return f"{Path(exe).name}: {first}"[:200]


def _compile(exe: str, flags: tuple[str, ...], source: Path, target: Path) -> None:
    """Build into a temporary file and rename it into place, so two processes building at once
    never load a half-written library."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run(
            [exe, *flags, str(source), "-o", tmp], capture_output=True, text=True, timeout=300, check=False
        )
        if done.returncode != 0:
            raise KernelUnavailable(
                f"{Path(exe).name} failed to compile {source.name}: {_short(exe, done.stderr, done.returncode)}"
            )
        os.replace(tmp, target)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise KernelUnavailable(f"could not run {exe}: {err}") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def write_atomically(path: Path, data: bytes) -> None:
    """``path`` holds ``data`` or what it held before, never half of it; an unwritable cache is no error."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError:
        pass


def _cpu_signature() -> bytes:
    """What ``-march=native`` depends on: a library built for one CPU may not run on another."""
    flags = cpu_flags()
    return (cpu_model() + "\n" + " ".join(sorted(flags or ()))).encode()
