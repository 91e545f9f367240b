"""The ``labkit`` command: serve, bench, run, demo."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="labkit", description="streamlab's engine, service and experiments")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_demo(sub)
    _add_bench(sub)
    _add_serve(sub)
    _add_run(sub)
    args = parser.parse_args(argv)
    _threads(getattr(args, "threads", None))
    return int(args.func(args) or 0)


def _threads(n: int | None) -> None:
    import torch

    if n:
        torch.set_num_threads(n)


def _add_demo(sub) -> None:
    p = sub.add_parser("demo", help="several concurrent prompts through the engine, printed with throughput")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--requests", type=int, default=6)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--threads", type=int, default=None)

    def run(args):
        from labkit.demo import run_demo

        run_demo(args.model, args.requests, args.new_tokens)

    p.set_defaults(func=run)


def _add_bench(sub) -> None:
    from labkit.engine.config import DTYPES  # the one list (light: no torch)

    p = sub.add_parser("bench", help="benchmarks: decode-step cost and generation throughput")
    p.add_argument("what", choices=["step", "generate", "attention"])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="float32", choices=DTYPES)
    p.add_argument("--batches", default=None, help="step, attention: comma-separated batch sizes")
    p.add_argument("--contexts", default="64,256,512", help="attention: comma-separated context lengths")
    p.add_argument("--context", type=int, default=64, help="step: tokens already in each sequence's cache")
    p.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="step (1), attention (3): measure every cell this many times, interleaved",
    )
    p.add_argument("--requests", type=int, default=32, help="generate: number of requests")
    p.add_argument("--new-tokens", type=int, default=64, help="generate: tokens per request")
    p.add_argument("--no-generate-batch", action="store_true", help="generate: skip transformers' generate_batch")
    p.add_argument(
        "--no-self-sized",
        action="store_true",
        help="generate: skip generate_batch with its own (memory-sized, slow to set up) cache",
    )
    p.add_argument(
        "--stop-at-eos",
        action="store_true",
        help="generate: let requests end on eos (by default each makes exactly --new-tokens)",
    )
    p.add_argument("--threads", type=int, default=None)
    p.add_argument(
        "--save",
        action="store_true",
        help="also write the table to data/bench/<what>.csv with its provenance (.json); the README renders it",
    )
    p.set_defaults(func=_bench)


def _bench(args) -> None:
    from labkit import bench
    from labkit.lab.record import MachineState

    before = MachineState.now()
    if args.what == "step":
        step = bench.StepBench(
            model=args.model,
            batches=tuple(int(b) for b in (args.batches or "1,2,4,8,16,32").split(",")),
            context=args.context,
            dtype=args.dtype,
            rounds=args.rounds or 1,
        )
        table = bench.bench_step(step)
    elif args.what == "attention":
        from labkit import bench_attention as ba

        table = ba.bench_attention(
            ba.AttentionBench(
                model=args.model,
                batches=tuple(int(b) for b in (args.batches or "1,8,32").split(",")),
                contexts=tuple(int(c) for c in args.contexts.split(",")),
                reps=args.rounds or 3,
            )
        )
    else:
        cfg = bench.GenerateBench(
            model=args.model,
            requests=args.requests,
            new_tokens=args.new_tokens,
            dtype=args.dtype,
            with_generate_batch=not args.no_generate_batch,
            with_self_sized=not args.no_self_sized,
            ignore_eos=not args.stop_at_eos,
        )
        table = bench.bench_generate(cfg)
    if args.save:
        _save_bench(args.what, table, before)
    if args.what == "attention":
        table = ba.printable(table)
    print(table.to_markdown(index=False, floatfmt=".2f") if _has_tabulate() else table.round(2).to_string(index=False))


def _save_bench(what: str, table, before) -> None:
    """``data/bench/<what>.csv`` and beside it the run's provenance (commit, load, threads)."""
    import json
    from pathlib import Path

    import torch

    from labkit.lab.record import MachineState, code_dirty, git_commit, machine_record

    folder = Path(__file__).resolve().parent.parent / "data" / "bench"
    folder.mkdir(parents=True, exist_ok=True)
    table.to_csv(folder / f"{what}.csv", index=False)
    import datetime as dt

    machine = machine_record(before, MachineState.now())
    meta = {
        "git_commit": git_commit(),
        "code_dirty": code_dirty(),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "torch_threads": torch.get_num_threads(),
        **machine,
    }
    (folder / f"{what}.json").write_text(json.dumps(meta, indent=2, default=str) + "\n")
    print(f"saved data/bench/{what}.csv (python -m labkit.readme renders it into README.md)")


def _has_tabulate() -> bool:
    try:
        import tabulate  # noqa: F401
    except ImportError:
        return False
    return True


def _add_serve(sub) -> None:
    from labkit.server import add_serve_arguments, serve_from_args

    p = sub.add_parser("serve", help="run the streaming service (uvicorn, 127.0.0.1 by default)")
    add_serve_arguments(p)
    p.set_defaults(func=serve_from_args)


def _add_run(sub) -> None:
    from labkit.lab.cli import add_run_arguments, run_from_args

    p = sub.add_parser("run", help="run an experiment (or all) and write data/ and figures/")
    add_run_arguments(p)
    p.set_defaults(func=run_from_args)


if __name__ == "__main__":
    sys.exit(main())
