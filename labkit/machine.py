"""What this machine can say about itself, on any platform: load, CPU time, the CPU, sockets, device.

Linux answers most of it from ``/proc``; macOS has no ``/proc``, Windows has neither ``/proc`` nor
``os.getloadavg``, ``fcntl`` or ``termios``. Every reading here returns None where the platform has
no such thing, never raises for that reason, and :func:`describe` turns the gaps into words
("not available on this platform: ...") that a notebook's first table can show, so a run on
another platform goes on and says what it could not read instead of failing or printing NaN.
"""

from __future__ import annotations

import importlib
import os
import platform
import socket
import struct
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

PROC = Path("/proc")  # a module attribute so that a test can point it at a folder without /proc
NOT_AVAILABLE = "not available on this platform"


# -- load and CPU time ---------------------------------------------------------------------------
def loadavg() -> tuple[float, float, float] | None:
    """The 1, 5 and 15 minute load averages; None where the OS keeps none (Windows)."""
    getloadavg = getattr(os, "getloadavg", None)
    if getloadavg is None:
        return None
    try:
        one, five, fifteen = getloadavg()
    except OSError:  # "load average not obtainable"
        return None
    return (one, five, fifteen)


def busy_seconds() -> float | None:
    """CPU seconds every process has used since boot: ``/proc/stat``'s first line less idle and
    iowait. None without ``/proc`` (macOS, Windows) or with a first line that is not the CPU total."""
    try:
        with open(PROC / "stat") as f:
            parts = f.readline().split()
        ticks = [int(x) for x in parts[1:]]
        clock = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, AttributeError):
        return None
    if not parts or parts[0] != "cpu" or len(ticks) < 4:
        return None
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)
    return (sum(ticks[:8]) - idle) / clock


def resident_mib(pid: int) -> float | None:
    """The resident memory of process ``pid`` in MiB (``/proc/PID/status``); None without ``/proc``."""
    try:
        with open(PROC / str(pid) / "status") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return None
    return kib / 1024


def own_seconds() -> float:
    """This process's CPU seconds and those of its live and reaped children (nginx, a server
    started as a process): psutil where it is installed, else ``os.times`` (reaped children only;
    Windows counts none)."""
    try:
        import psutil
    except ImportError:
        psutil = None
    if psutil is not None:
        try:
            me = psutil.Process()
            total = sum(me.cpu_times()[:4])
            for child in me.children(recursive=True):
                try:
                    total += sum(child.cpu_times()[:2])
                except psutil.Error:
                    pass
            return float(total)
        except psutil.Error:
            pass
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


# -- the CPU -------------------------------------------------------------------------------------
def cpu_model() -> str:
    """The CPU's name: ``/proc/cpuinfo`` on Linux, ``sysctl`` on macOS, else what ``platform`` knows."""
    for line in _cpuinfo_lines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    if sys.platform == "darwin":
        name = _command_output(["sysctl", "-n", "machdep.cpu.brand_string"])
        if name:
            return name
    return platform.processor() or platform.machine() or "unknown"


def cpu_flags() -> frozenset[str] | None:
    """The instruction-set flags ``/proc/cpuinfo`` lists (``fma``, ``avx2``, ``avx512f``, ...);
    None where there is no ``/proc`` to read them from."""
    for line in _cpuinfo_lines():
        if line.startswith(("flags", "Features")):  # x86 says flags, arm64 Features
            return frozenset(line.split(":", 1)[1].split())
    return None


def _cpuinfo_lines() -> list[str]:
    try:
        return (PROC / "cpuinfo").read_text().splitlines()
    except OSError:
        return []


def _command_output(command: list[str]) -> str | None:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=5, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    if done.returncode != 0:
        return None
    return done.stdout.strip() or None


# -- sockets -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SocketFeatures:
    """Which of the socket tools the experiments use this platform has."""

    so_linger: bool  # SO_LINGER, for leaving by RST
    fionread: bool  # FIONREAD through fcntl.ioctl: bytes waiting in a receive buffer
    fcntl: bool
    termios: bool

    def missing(self) -> list[str]:
        """``[]`` when everything is there, else one phrase per missing tool."""
        names = {"so_linger": "SO_LINGER", "fionread": "FIONREAD", "fcntl": "fcntl", "termios": "termios"}
        return [f"{label}: {NOT_AVAILABLE} ({sys.platform})" for key, label in names.items() if not getattr(self, key)]


def socket_features() -> SocketFeatures:
    fcntl, termios = _optional("fcntl"), _optional("termios")
    return SocketFeatures(
        so_linger=hasattr(socket, "SO_LINGER"),
        fionread=fcntl is not None and termios is not None and hasattr(termios, "FIONREAD"),
        fcntl=fcntl is not None,
        termios=termios is not None,
    )


def unread_bytes(sock: socket.socket) -> int | None:
    """Bytes waiting in ``sock``'s receive buffer (``FIONREAD``); None where the platform cannot say."""
    fcntl, termios = _optional("fcntl"), _optional("termios")
    if fcntl is None or termios is None or not hasattr(termios, "FIONREAD"):
        return None
    buf = bytearray(4)
    fcntl.ioctl(sock.fileno(), termios.FIONREAD, buf)
    return int.from_bytes(buf, sys.byteorder, signed=True)


def linger_zero(platform_name: str | None = None) -> bytes:
    """``struct linger`` set to (on, 0 seconds): closing then sends RST. Two ints on POSIX, two
    unsigned shorts on Windows."""
    return struct.pack("HH" if (platform_name or sys.platform) == "win32" else "ii", 1, 0)


def _optional(module: str) -> ModuleType | None:
    """The module, or None where this platform has none (``fcntl`` and ``termios`` on Windows)."""
    try:
        return importlib.import_module(module)
    except ImportError:
        return None


# -- device and threads --------------------------------------------------------------------------
def default_device() -> str:
    """``"cuda"`` where torch sees a CUDA device, else ``"cpu"`` (the engine's ``device``)."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def pin_threads(device: str, threads: int | None = None) -> str:
    """Fix torch's CPU thread count for an engine on ``device``, and say what was done.

    On the CPU the engine's step is the CPU's work, and the lab fixes the count (``threads``,
    default two, or fewer CPUs) so that runs compare. On a GPU the CPU only feeds the device:
    the count is left as torch set it."""
    import torch

    if not device.startswith("cpu"):
        return f"torch threads left at {torch.get_num_threads()}: the engine runs on {device}"
    if threads is not None and (not isinstance(threads, int) or threads < 1):
        raise ValueError(f"pin_threads: threads must be a positive int or None, got {threads!r}")
    count = threads if threads is not None else max(1, min(2, os.cpu_count() or 1))
    torch.set_num_threads(count)
    return f"torch pinned to {count} thread{'s' if count != 1 else ''} (the engine runs on the CPU)"


# -- in words ------------------------------------------------------------------------------------
def describe() -> dict[str, str]:
    """Each reading as a short phrase, the missing ones saying so: the machine's rows of a table."""
    load = loadavg()
    flags = cpu_flags()
    vector = sorted(flags & {"fma", "avx2", "avx512f", "asimd"}) if flags is not None else None
    missing = socket_features().missing()
    return {
        "platform": f"{sys.platform} {platform.machine()}, Python {platform.python_version()}",
        "cpu": f"{cpu_model()}, {os.cpu_count() or '?'} CPUs",
        "cpu flags": ", ".join(vector) if vector else ("none of fma, avx2, avx512f" if vector == [] else NOT_AVAILABLE),
        "load average": " ".join(f"{x:.2f}" for x in load) if load else f"{NOT_AVAILABLE} (no os.getloadavg)",
        "CPU busy seconds": "read from /proc/stat" if busy_seconds() is not None else f"{NOT_AVAILABLE} (no /proc)",
        "sockets": "; ".join(missing) if missing else "SO_LINGER, FIONREAD",
    }
