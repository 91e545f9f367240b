"""Where labkit keeps what it converts once per machine, and how it writes there safely."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def labkit_cache_dir() -> Path:
    """``$LABKIT_CACHE`` if set, else ``~/.cache/labkit``; created on first use."""
    root = Path(os.environ.get("LABKIT_CACHE") or Path.home() / ".cache" / "labkit")
    root.mkdir(parents=True, exist_ok=True)
    return root


def cached_folder(name: str, build: Callable[[Path], None]) -> Path:
    """Return ``<cache>/<name>``, building it first with ``build(tmp_dir)`` if it is missing.

    The folder is built in a temporary sibling and renamed into place, so an interrupted build
    leaves no half-written folder that a later run would trust. If two processes race, the
    first rename wins and the loser's copy is discarded.
    """
    target = labkit_cache_dir() / name
    if target.is_dir():
        return target
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=target.parent))
    os.chmod(tmp, 0o755)
    try:
        build(tmp)
        os.rename(tmp, target)
    except OSError:
        if not target.is_dir():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
