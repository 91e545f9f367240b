"""Which profile a run uses, and where its outputs go.

``ci`` runs the tiny random GPT-2 with few repetitions, so every notebook runs in a test; ``full``
runs the embedded SmolLM2-135M at the chapter's sizes, and its outputs are what the notebooks are
committed with. ``LABKIT_PROFILE`` picks the profile wherever no one passes one; where it is unset
the notebooks run ``full`` (a reader opening one wants the real model) and ``labkit run`` runs
``ci`` (a quick look from the shell). A ``full`` run writes ``data/`` and ``figures/`` at the
repository root; a ``ci`` run writes the same tree under ``build/ci/`` (git-ignored), so a test
never overwrites the committed results. ``LABKIT_OUT`` moves the root for either.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["PROFILES", "Profile", "get_profile", "repo_root"]

PROFILES = ("ci", "full")
_DEFAULT_MODEL = {"ci": "tiny-gpt2", "full": "smollm2-135m"}


@dataclass(frozen=True)
class Profile:
    """A profile's name and the model it serves; experiments size themselves from the name."""

    name: str = "ci"
    model: str = ""

    def __post_init__(self) -> None:
        if self.name not in PROFILES:
            raise ValueError(f"Profile.name must be one of {PROFILES}, got {self.name!r}")
        if not self.model:
            object.__setattr__(self, "model", _DEFAULT_MODEL[self.name])

    @property
    def full(self) -> bool:
        return self.name == "full"

    @property
    def out_root(self) -> Path:
        override = os.environ.get("LABKIT_OUT")
        if override:
            return Path(override)
        return repo_root() if self.full else repo_root() / "build" / "ci"

    @property
    def data_dir(self) -> Path:
        return self.out_root / "data"

    @property
    def figures_dir(self) -> Path:
        return self.out_root / "figures"


def get_profile(name: str | None = None, model: str | None = None, default: str = "ci") -> Profile:
    """``name``, else ``LABKIT_PROFILE``, else ``default``; ``model`` overrides the profile's model."""
    return Profile(name or os.environ.get("LABKIT_PROFILE") or default, model or "")


def repo_root() -> Path:
    """The checkout holding this package (its ``pyproject.toml``), else the working directory."""
    here = Path(__file__).resolve().parents[2]
    return here if (here / "pyproject.toml").exists() else Path.cwd()
