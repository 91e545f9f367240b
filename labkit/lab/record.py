"""What every result records beside its numbers: the code, the machine, and how busy it was.

A reader judges a number by where it came from: the commit and whether the tree was clean, the
versions, the CPU and threads, and whether other processes shared the machine while it ran (the
load average alone cannot say: the run's own client and server raise it). Readings that need
``/proc`` or ``os.getloadavg`` are ``None`` where the platform lacks them, and the line a
notebook prints says "not available on this platform" instead of failing.
"""

from __future__ import annotations

import datetime as dt
import os
import platform
import subprocess
import time
from dataclasses import dataclass
from importlib import metadata
from typing import Any

from labkit.lab.profiles import repo_root
from labkit.machine import busy_seconds, cpu_model, loadavg, own_seconds

__all__ = ["MachineState", "environment", "machine_record", "provenance_line", "git_commit", "code_dirty"]

QUIET_OTHERS_SHARE = 0.10  # a run is quiet when other processes used less than this share of the CPUs
PACKAGES = ("labkit", "torch", "transformers", "fastapi", "starlette", "uvicorn", "httpx", "numpy", "pandas")


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=repo_root(), capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


def git_commit() -> str | None:
    return (_git("rev-parse", "--short=7", "HEAD") or "").strip() or None


def code_dirty() -> bool | None:
    """Uncommitted changes to the code (labkit/, tests/, pyproject.toml, Makefile)? The run's own
    outputs (notebooks, data/, figures/) do not count. None without git."""
    out = _git("status", "--porcelain", "--", "labkit", "tests", "pyproject.toml", "Makefile")
    return None if out is None else bool(out.strip())


def environment(profile: Any) -> dict[str, Any]:
    """Versions, CPU, threads, model, profile, date and commit."""
    import torch

    return {
        "profile": profile.name,
        "model": profile.model,
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "git_commit": git_commit(),
        "code_dirty": code_dirty(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "packages": {name: _version(name) for name in PACKAGES},
    }


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


@dataclass(frozen=True)
class MachineState:
    """The machine at one moment: wall clock, load averages, CPU seconds used by everyone and by
    this process and its children. ``None`` where the platform does not say."""

    wall: float
    loadavg: tuple[float, float, float] | None
    busy_s: float | None
    own_s: float

    @classmethod
    def now(cls) -> MachineState:
        return cls(time.monotonic(), loadavg(), busy_seconds(), own_seconds())


def machine_record(before: MachineState, after: MachineState) -> dict[str, Any]:
    """Load before and after, this run's CPU seconds, the share other processes used, quiet or not."""
    wall = max(after.wall - before.wall, 1e-9)
    cpus = os.cpu_count() or 1
    own = after.own_s - before.own_s
    others = None
    if before.busy_s is not None and after.busy_s is not None:
        others = max(0.0, (after.busy_s - before.busy_s) - own) / (wall * cpus)
    return {
        "loadavg_before": None if before.loadavg is None else list(before.loadavg),
        "loadavg_after": None if after.loadavg is None else list(after.loadavg),
        "cpu_count": cpus,
        "wall_s": round(wall, 3),
        "cpu_s": round(own, 3),
        "others_cpu_share": None if others is None else round(others, 4),
        "quiet": None if others is None else others < QUIET_OTHERS_SHARE,
    }


def provenance_line(env: dict[str, Any], machine: dict[str, Any]) -> str:
    """One line: the commit the numbers came from, clean or not, and how quiet the machine was."""
    commit = env.get("git_commit") or "no git commit"
    dirty = {True: "uncommitted changes", False: "clean tree", None: "tree state unknown"}[env.get("code_dirty")]
    share = machine.get("others_cpu_share")
    if share is None:
        quiet = "other processes' share: not available on this platform"
    else:
        quiet = f"{'quiet' if machine.get('quiet') else 'NOT quiet'}: others used {share:.0%} of {machine['cpu_count']} CPUs"
    load = machine.get("loadavg_before")
    load_text = "load average: not available on this platform" if load is None else f"load {load[0]:.2f} before"
    return f"commit {commit} ({dirty}); {quiet}; {load_text}"
