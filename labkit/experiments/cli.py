"""``labkit run <name>|all``: run experiments, write their tables, results file and figures.

The lead's ``labkit/cli.py`` calls :func:`add_run_arguments` and :func:`run_from_args`; everything
else here is also usable from Python as :func:`run_experiment`.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pandas as pd

from labkit.experiments import EXPERIMENTS, load, names
from labkit.experiments.profiles import PROFILES, Profile, get_profile
from labkit.experiments.progress import measuring
from labkit.experiments.results import save_run

__all__ = ["add_run_arguments", "run_from_args", "run_experiment", "Outcome"]


@dataclass(frozen=True)
class Outcome:
    """What one experiment run produced and where it went."""

    name: str
    tables: dict[str, pd.DataFrame]
    csvs: list[Path]
    figures: list[Path]
    results: Path
    elapsed_s: float


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", choices=[*EXPERIMENTS, "all"], help="an experiment, or all of them")
    parser.add_argument(
        "--profile",
        choices=PROFILES,
        default=None,
        help="ci: tiny model, few repetitions; full: SmolLM2, the chapter's sizes (default: $LABKIT_PROFILE, else ci)",
    )
    parser.add_argument(
        "--model",
        default=None,
        help="serve this model instead of the profile's; with --target, the model to request "
        "(default: the first one GET /v1/models lists)",
    )
    parser.add_argument("--no-figures", action="store_true", help="write tables only")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument(
        "--target",
        default=None,
        metavar="URL",
        help="measure this OpenAI-compatible server instead of starting labkit's "
        "(wire, overlap, disconnect; e.g. http://gpu-node:8000)",
    )
    parser.add_argument(
        "--api",
        choices=("openai", "openai-chat"),
        default="openai",
        help="with --target: POST /v1/completions (openai) or /v1/chat/completions",
    )
    parser.add_argument(
        "--target-pid",
        type=int,
        default=None,
        metavar="PID",
        help="with --target: the server's process id, when it runs on this machine",
    )
    parser.add_argument(
        "--api-key-env",
        default=None,
        metavar="VAR",
        help="with --target: send the key in environment variable VAR as a bearer token",
    )
    parser.add_argument(
        "--levels",
        default=None,
        metavar="1,4,16,...",
        help="with --target: overlap's concurrency levels (default: the profile's)",
    )


def run_from_args(args: argparse.Namespace) -> int:
    import matplotlib

    matplotlib.use("Agg")  # the command line draws to files only
    if args.target:
        from labkit.experiments.target_cli import run_target

        return run_target(args)
    profile = get_profile(args.profile, args.model)
    chosen = names() if args.name == "all" else [args.name]
    print(f"profile {profile.name}, model {profile.model}; writing under {profile.out_root}")
    for name in chosen:
        outcome = run_experiment(name, profile, figures=not args.no_figures, show_progress=True)
        _report(outcome, profile)
    return 0


def run_experiment(
    name: str, profile: Profile | None = None, *, figures: bool = True, show_progress: bool = False, **overrides: Any
) -> Outcome:
    """Run experiment ``name`` under ``profile`` (``overrides`` replace config fields) and save it."""
    profile = profile or get_profile()
    module = load(name)
    config = module.Config.for_profile(profile)
    if overrides:
        config = replace(config, **overrides)
    with measuring(module, config, profile, show=show_progress) as progress:
        tables = module.run(config, progress=progress)
    elapsed = progress.elapsed_s
    written = save_run(
        module, config, profile, tables, elapsed, figures=None if figures else [], machine=progress.machine
    )
    _close_figures()
    return Outcome(name, tables, written["csvs"], written["figures"], written["results"], elapsed)


def _close_figures() -> None:
    """The command line draws to files only; free what it drew."""
    import matplotlib.pyplot as plt

    plt.close("all")


def _report(outcome: Outcome, profile: Profile) -> None:
    root = profile.out_root.resolve()

    def rel(path: Path) -> str:
        path = Path(path).resolve()
        return str(path.relative_to(root)) if path.is_relative_to(root) else str(path)

    print(f"{outcome.name}: {outcome.elapsed_s:.1f} s; tables {', '.join(rel(p) for p in outcome.csvs)}")
    if outcome.figures:
        print(f"  figures {', '.join(rel(p) for p in outcome.figures)}")
    print(f"  results {rel(outcome.results)}")
