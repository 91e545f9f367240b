"""Compilers unlike this machine's, for the kernel build tests: shell scripts in front of g++."""

from __future__ import annotations

import stat
from pathlib import Path


def fake_compiler(folder: Path, name: str, body: str) -> str:
    """A compiler called ``name``: a shell script that runs ``body`` (with "$@" its arguments)."""
    folder.mkdir(exist_ok=True)
    path = folder / name
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def like_apple_clang(folder: Path) -> str:
    """g++ that refuses -fopenmp with Apple clang's words."""
    refuse = (
        'for arg in "$@"; do if [ "$arg" = -fopenmp ]; then '
        "echo \"clang: error: unsupported option '-fopenmp'\" >&2; exit 1; fi; done\n"
        'exec g++ "$@"'
    )
    return fake_compiler(folder, "clang++", refuse)
