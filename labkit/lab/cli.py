"""``labkit run NAME [--target URL]``: run experiments from the shell, write data/ and figures/.

``NAME`` is a notebook's experiment (``overlap``: all its measurements), one measurement
(``overlap.levels``) or ``all``. Without ``--target`` labkit serves the profile's model in a
background thread; with it, any OpenAI-compatible server is probed and measured, and what it
cannot show is refused by name with the reason (an experiment that needs labkit's engine) or
reported as "not measurable" rows. A target that cannot be measured, or whose every stream
failed, ends the command with one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import ast
import os
import sys
import time
from typing import Any

from labkit.lab.experiment import Sizes
from labkit.lab.profiles import PROFILES, get_profile

__all__ = ["add_run_arguments", "run_from_args"]


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    from labkit.experiments import GROUPS

    parser.add_argument("name", help=f"an experiment ({', '.join(GROUPS)}), one measurement (overlap.levels), or all")
    parser.add_argument("--profile", choices=PROFILES, default=None, help="ci (default) or full: the chapter's sizes")
    parser.add_argument("--model", default=None, help="serve this model; with --target, the model to request")
    parser.add_argument("--target", default=None, metavar="URL", help="measure this server instead of labkit's")
    parser.add_argument("--api", choices=("openai", "openai-chat", "labkit"), default="openai",
                        help="with --target: /v1/completions, /v1/chat/completions or labkit's /v1/stream")  # fmt: skip
    parser.add_argument("--target-pid", type=int, default=None, metavar="PID", help="the server's process, if local")
    parser.add_argument("--api-key-env", default=None, metavar="VAR", help="send the key in $VAR as a bearer token")
    parser.add_argument(
        "--set", action="append", default=[], metavar="SIZE=VALUE", help="change a size, e.g. levels=1,64"
    )
    parser.add_argument("--no-figures", action="store_true", help="write tables only")
    parser.add_argument("--max-seconds", type=float, default=None, metavar="S",
                        help="end the whole command by then: reads are cut, trials not begun are listed")  # fmt: skip


def run_from_args(args: argparse.Namespace) -> int:
    import matplotlib

    from labkit.experiments import specs
    from labkit.lab.probe import connect, quirks_table
    from labkit.lab.runner import run
    from labkit.lab.target import LocalLab, NotMeasurable, TargetError

    matplotlib.use("Agg")
    try:
        chosen = specs(args.name)
        overrides = dict(_size(text) for text in args.set)
        profile = get_profile(args.profile, None if args.target else args.model)
        known = Sizes({k: v for spec in chosen for k, v in spec.sizes[profile.name].items()})
        known.changed(**overrides)  # an unknown size, or one of the wrong kind, is refused here
        if args.target:
            target: Any = connect(args.target, model=args.model, api=args.api, pid=args.target_pid, api_key=_key(args))
            print(f"profile {profile.name} (sizes); target {target.url}, model {target.model or '(server default)'}")
            print(quirks_table(target).to_string(index=False))
        else:
            print(f"profile {profile.name}, model {profile.model}; writing under {profile.out_root}")
            target = LocalLab(profile.model)
    except (KeyError, ValueError, TargetError) as exc:
        return _fail(str(exc).strip("'\""))
    ends = None if args.max_seconds is None else time.perf_counter() + args.max_seconds
    try:
        for spec in chosen:
            if ends is not None and time.perf_counter() >= ends:
                print(f"skipped {spec.name}: the budget of {args.max_seconds:g} s (--max-seconds) was spent")
                continue
            missing = [cap for cap in spec.needs if not getattr(target.caps, cap)]
            if missing:
                reason = f"{spec.name} needs labkit's own server: {target.caps.why_not(missing[0])}"
                if len(chosen) == 1:
                    return _fail(reason)
                print(f"skipped {reason}")
                continue
            sizes = {k: v for k, v in overrides.items() if k in spec.sizes[profile.name]}
            before = dict(target.tally)
            left = None if ends is None else ends - time.perf_counter()
            result = run(spec, target, profile=profile, max_seconds=left, **sizes)
            if not args.no_figures:
                result.plot()
            print(result.verdict_table().to_string())
            streams = target.tally["streams"] - before.get("streams", 0)
            failed = target.tally["failed"] - before.get("failed", 0)
            if streams and failed == streams:
                return _fail(f"target {target.url}: every stream of {spec.name} failed ({target.last_failure})")
    except (TargetError, NotMeasurable) as exc:
        return _fail(str(exc))
    except (OSError, TimeoutError, KeyError, ValueError) as exc:  # a target that broke mid-run: one line, exit 2
        return _fail(f"target {target.url}: {type(exc).__name__}: {exc}"[:400])
    finally:
        target.close()
    return 0


def _fail(message: str) -> int:
    print(f"labkit: {message}", file=sys.stderr)
    return 2


def _key(args: argparse.Namespace) -> str | None:
    """The key from the environment variable ``--api-key-env`` names (never the command line)."""
    if args.api_key_env is None:
        return None
    if not os.environ.get(args.api_key_env):
        raise ValueError(f"--api-key-env {args.api_key_env}: that environment variable is not set")
    return os.environ[args.api_key_env]


def _size(text: str) -> tuple[str, Any]:
    """``levels=1,4,16`` -> ("levels", (1, 4, 16)); a value is read as a Python literal where it is one."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise ValueError(f"--set takes SIZE=VALUE, got {text!r}")
    try:
        parsed = ast.literal_eval(value)
    except (ValueError, SyntaxError):
        parsed = value
    return key.strip(), parsed
