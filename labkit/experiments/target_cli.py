"""``labkit run NAME --target URL``: probe an OpenAI-compatible server, print its quirks, measure it.

Results go to ``<data>/target-NAME/`` (never over the lab's own ``<data>/NAME/``), with a
``results.json`` that records the target, the model and what the probe found. A target that
cannot be measured gets one line on stderr naming it and what failed, and exit status 2.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from dataclasses import asdict
from types import SimpleNamespace
from typing import Any

import pandas as pd

from labkit.experiments.profiles import Profile, get_profile
from labkit.experiments.progress import measuring
from labkit.experiments.results import partial_dir, write_results, write_tables
from labkit.experiments.target import Target, TargetError
from labkit.experiments.target_probe import connect, quirks_table
from labkit.experiments.target_runs import RUNS

__all__ = ["config_for", "measure_target", "run_target"]

PER_ROW = ("streams", "runs", "quirks")  # written to CSV, not printed: one row per stream or launch


def run_target(args: argparse.Namespace) -> int:
    chosen = list(RUNS) if args.name == "all" else [args.name]
    if any(name not in RUNS for name in chosen):
        print(f"labkit: {args.name} needs the lab's own server; with --target: {', '.join(RUNS)}", file=sys.stderr)
        return 2
    profile = get_profile(args.profile)
    try:
        configs = {name: config_for(name, profile, **_overrides(name, args)) for name in chosen}
    except ValueError as exc:
        print(f"labkit: {exc}", file=sys.stderr)
        return 2
    try:
        target = connect(args.target, args.model, args.api, args.target_pid, api_key=_api_key(args))
        print(f"profile {profile.name} (sizes); target {target.url}, model {target.model or '(server default)'}")
        print(_text(quirks_table(target)))
        for name in chosen:
            tables = measure_target(name, target, profile, configs[name], show_progress=True)
            for table_name, table in tables.items():
                if table_name not in PER_ROW:
                    print(f"\n{name}: {table_name}\n{_text(table)}")
    except TargetError as exc:
        print(f"labkit: {exc}", file=sys.stderr)
        return 2
    return 0


def _api_key(args: argparse.Namespace) -> str | None:
    """The key from the environment variable ``--api-key-env`` names (never from the command line,
    which ``ps`` and shell history show)."""
    name = getattr(args, "api_key_env", None)
    if name is None:
        return None
    if not os.environ.get(name):
        raise TargetError(args.target, f"--api-key-env {name}: that environment variable is not set")
    return os.environ[name]


def _overrides(name: str, args: argparse.Namespace) -> dict[str, Any]:
    if name == "overlap" and getattr(args, "levels", None):
        try:
            return {"levels": tuple(int(level) for level in args.levels.split(","))}
        except ValueError:
            raise ValueError(f"--levels must be comma-separated integers, got {args.levels!r}") from None
    return {}


def config_for(name: str, profile: Profile, **overrides: Any) -> Any:
    """Experiment ``name``'s config at ``profile``'s sizes, with ``overrides``; ValueError if invalid."""
    config_class, _run = RUNS[name]
    config = config_class.for_profile(profile)
    return config_class(**{**asdict(config), **overrides}) if overrides else config


def measure_target(
    name: str, target: Target, profile: Profile, config: Any = None, *, show_progress: bool = False, **overrides: Any
) -> dict[str, pd.DataFrame]:
    """Run experiment ``name`` against ``target`` (``config``, else ``profile``'s sizes with
    ``overrides``) and write its tables; each finished condition is kept in the partial folder
    until the whole run is written, as for the lab's own experiments.

    Raises :class:`TargetError` when every stream failed (the target went away or refuses).
    """
    config = config or config_for(name, profile, **overrides)
    run = RUNS[name][1]
    shown = SimpleNamespace(NAME=f"target-{name}", units=lambda c: c.units)  # what measuring() reads
    with measuring(shown, config, profile, show=show_progress) as progress:
        tables = run(target, config, progress)
    elapsed = progress.elapsed_s
    _refuse_if_all_failed(name, target, tables)
    tables = {**tables, "quirks": quirks_table(target)}
    write_tables(f"target-{name}", tables, profile)
    record = {
        "target": target.url,
        "model": target.model,
        "api": target.api,
        "quirks": asdict(target.quirks),
        "config": asdict(config),
    }
    write_results(f"target-{name}", profile, config=record, elapsed_s=elapsed, tables=tables)
    shutil.rmtree(partial_dir(f"target-{name}", profile), ignore_errors=True)
    return tables


def _refuse_if_all_failed(name: str, target: Target, tables: dict[str, pd.DataFrame]) -> None:
    first = next(iter(tables.values()))
    if "error" in first and len(first) and first.error.notna().all():
        raise TargetError(target.url, f"{name}: every round had failed streams, e.g. {first.error.iloc[0]}")
    if "errors" in first and "tokens" in first and len(first) and first.tokens.sum() == 0:
        raise TargetError(target.url, f"every stream of {name} failed ({int(first.errors.sum())} errors)")


def _text(table: pd.DataFrame) -> str:
    return table.to_string(index=False, float_format=lambda v: f"{v:.4g}")
