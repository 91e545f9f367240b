"""``make lab``: run every notebook in place, regenerating its outputs, data/ and figures/.

Notebooks are executed with nbclient in a kernel of this interpreter, one after another. The
profile reaches them from outside, never by editing them: ``LABKIT_PROFILE`` is set for the
kernel, and each notebook's parameters cell reads it (``full`` unless told otherwise). The
committed notebooks therefore always show the outputs of the last full run. Each notebook's
duration is printed at the end and kept in ``<data>/durations.csv``, from which every notebook
states how long it takes.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"


def run_notebook(path: Path, timeout: int) -> tuple[float, str | None]:
    """Execute ``path`` in place: the seconds it took and the error that stopped it, if one did.

    A failed notebook is written too, with the outputs of every cell that ran and the error,
    so what was measured before the failure survives (its experiment also kept its finished
    conditions under ``data/<name>/partial/``). The source cells are not touched, so the paired
    ``.py`` stays in sync.
    """
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    nb = nbformat.read(path, as_version=4)
    t0 = time.perf_counter()
    error = None
    try:
        NotebookClient(
            nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
        ).execute()
    except CellExecutionError as exc:
        error = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
    nbformat.write(nb, path)
    return time.perf_counter() - t0, error


def closing_note(seconds: dict[str, float], profile: str) -> str:
    """Each notebook's duration and the total, as printed at the end of ``make lab``."""
    width = max(map(len, seconds), default=8)
    lines = [f"  {name:<{width}}  {s / 60:5.1f} min" for name, s in seconds.items()]
    total = sum(seconds.values())
    return "\n".join(
        [
            f"{len(seconds)} notebooks under the {profile} profile:",
            *lines,
            f"  {'total':<{width}}  {total / 60:5.1f} min",
        ]
    )


def noisy_runs(data_dir: Path, since: float) -> list[str]:
    """The experiments written since ``since`` (epoch seconds) whose run was not quiet."""
    import json

    warnings = []
    for path in sorted(data_dir.glob("*/*/results.json")):
        if path.stat().st_mtime < since:
            continue
        machine = json.loads(path.read_text()).get("machine") or {}
        if machine.get("quiet") is False:
            share = machine.get("others_cpu_share")
            warnings.append(
                f"{path.parent.parent.name}.{path.parent.name}: the machine was not quiet (other processes used {share:.0%} of the CPUs); "
                "its seconds are suspect, its step counts still hold"
            )
    return warnings


def main(argv: list[str] | None = None) -> int:
    from labkit.lab.notebook import record_durations
    from labkit.lab.profiles import get_profile
    from labkit.lab.record import code_dirty, git_commit

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--profile", default=os.environ.get("LABKIT_PROFILE", "full"), choices=["ci", "full"])
    parser.add_argument("--only", nargs="*", help="notebook name prefixes, e.g. 01 05")
    parser.add_argument("--cell-timeout", type=int, default=1800)
    args = parser.parse_args(argv)
    os.environ["LABKIT_PROFILE"] = args.profile  # the kernels inherit it; the parameters cells read it
    paths = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))
    if args.only:
        paths = [p for p in paths if any(p.name.startswith(o) for o in args.only)]
    seconds: dict[str, float] = {}
    failed: dict[str, str] = {}
    profile = get_profile(args.profile)
    if code_dirty():
        print("WARNING: labkit/ or tests/ has uncommitted changes; results.json will say so", flush=True)
    for path in paths:
        print(f"running {path.relative_to(ROOT)} ({args.profile}) ...", flush=True)
        started = time.time()
        took, error = run_notebook(path, args.cell_timeout)
        for warning in noisy_runs(profile.data_dir, since=started):
            print(f"  WARNING: {warning}", flush=True)
        if error is None:
            seconds[path.stem] = took
            print(f"  done in {took:.0f} s", flush=True)
        else:
            failed[path.stem] = error
            print(f"  FAILED after {took:.0f} s: {error} (outputs so far kept in the notebook)", flush=True)
    table = record_durations(profile, seconds, git_commit())  # only notebooks that ran to the end
    print()
    print(closing_note(seconds, args.profile))
    for name, error in failed.items():
        print(f"  {name} FAILED: {error}")
    print(f"  durations kept in:           {table.relative_to(ROOT) if table.is_relative_to(ROOT) else table}")
    print(f"  notebooks with fresh outputs: {NOTEBOOKS.relative_to(ROOT)}/")
    print(f"  tables and results.json:     {profile.data_dir}/<experiment>/")
    print(f"  figures:                     {profile.figures_dir}/")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
