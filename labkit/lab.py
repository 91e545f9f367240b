"""``make lab``: run every notebook in place, regenerating its outputs, data/ and figures/.

Notebooks are executed with nbclient in a kernel of this interpreter, one after another, under
the profile in ``LABKIT_PROFILE`` (``full`` unless told otherwise), so the committed notebooks
always show the outputs of the last full run.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"


def run_notebook(path: Path, timeout: int) -> float:
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    t0 = time.perf_counter()
    NotebookClient(nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}).execute()
    nbformat.write(nb, path)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--profile", default=os.environ.get("LABKIT_PROFILE", "full"), choices=["ci", "full"])
    parser.add_argument("--only", nargs="*", help="notebook name prefixes, e.g. 01 05")
    parser.add_argument("--cell-timeout", type=int, default=1800)
    args = parser.parse_args(argv)
    os.environ["LABKIT_PROFILE"] = args.profile
    paths = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))
    if args.only:
        paths = [p for p in paths if any(p.name.startswith(o) for o in args.only)]
    total = time.perf_counter()
    for path in paths:
        print(f"running {path.relative_to(ROOT)} ({args.profile}) ...", flush=True)
        print(f"  done in {run_notebook(path, args.cell_timeout):.0f} s", flush=True)
    print(f"\n{len(paths)} notebooks in {time.perf_counter() - total:.0f} s under the {args.profile} profile.")
    print(f"  notebooks with fresh outputs: {NOTEBOOKS.relative_to(ROOT)}/")
    if args.profile == "full":
        print("  tables and results.json:     data/<experiment>/")
        print("  figures:                     figures/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
