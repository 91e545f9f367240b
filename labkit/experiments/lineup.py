"""Notebook 09's servers: labkit at its defaults and at each budget of the sweep, llama.cpp's
``llama-server`` and ``transformers serve``, each in a process of its own on 127.0.0.1, started
once by :func:`start` and kept up (idle while another is measured) as one :class:`Lineup`; and
:func:`each`, which runs any experiment against each of them in turn. The load experiment that
compares them is :mod:`labkit.experiments.peers`.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable
from functools import partial
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import pandas as pd

from labkit.engine.config import DEFAULT_STEP_TOKENS, DEFAULT_SURGE_TOKENS
from labkit.lab import Experiment, LocalLab, NotMeasurable, Process, Target, TargetError, quirks_table
from labkit.lab.probe import probe
from labkit.lab.profiles import repo_root
from labkit.lab.runner import run
from labkit.lab.target import free_port
from labkit.machine import resident_mib
from labkit.prompts import cycle

LABKIT, UNCHUNKED, LLAMA, TRANSFORMERS, ENGINE = (
    "labkit", "labkit unchunked", "llama.cpp", "transformers serve", "engine alone")  # fmt: skip
PEERS = (LLAMA, TRANSFORMERS)
SERVING = ("fastapi", "uvicorn", "openai", "rich", "pydantic")  # what transformers serve imports
TRANSFORMERS_CLI = "import sys; from transformers.cli.transformers import main; sys.argv[0] = 'transformers'; main()"
WARM_STREAMS, WARM_TOKENS = 4, 8


DEFAULT = (DEFAULT_STEP_TOKENS, DEFAULT_SURGE_TOKENS)  # labkit's (step budget, surge budget) unless told otherwise
Budgets = tuple[int | None, int | None]


def labkit_name(budget: int | None) -> str:
    """A point of the sweep: labkit at ``budget`` alone, no surge budget (None: unchunked)."""
    return UNCHUNKED if budget is None else f"labkit, budget {budget}"


def label(budgets: Budgets) -> str:
    """What a table's ``budget`` column says of a labkit: ``64, surge 2048``, ``16`` or ``unchunked``."""
    step, surge = budgets
    return "unchunked" if step is None else str(step) if surge is None else f"{step}, surge {surge}"


def sweep(budgets: tuple[int | None, ...]) -> dict[str, Budgets]:
    """labkit at its defaults, then each budget of the sweep alone (no surge budget), by name."""
    return {LABKIT: DEFAULT} | {labkit_name(b): (b, None) for b in budgets}


# --------------------------------------------------------------------------- the servers


class Lineup(Target):
    """Servers the lab started once and keeps up, by name (``missing``: each one that could not
    start, and why); ``budgets``: each labkit's (step, surge) budgets; ``loaded``: the model in
    this process, for the engine-alone reading. As a target, it is its labkit's URL."""

    lab_owned = True

    def __init__(self, servers: dict[str, Target], missing: dict[str, str], budgets: dict[str, Budgets],
                 loaded: Any = None, up_s: dict[str, float] | None = None) -> None:  # fmt: skip
        first = next(iter(servers.values()))
        super().__init__(first.url, api=first.api, model=first.model, name=" + ".join(servers))
        self.servers, self.missing, self.budgets, self.loaded = servers, missing, budgets, loaded
        self.up_s = up_s or {}

    def server(self, name: str) -> Target:
        if name in self.servers:
            return self.servers[name]
        raise NotMeasurable(name, self.missing.get(name, f"this lineup started no {name} (peers.start(...))"))

    def close(self) -> None:
        for server in self.servers.values():
            with contextlib.suppress(Exception):
                server.close()

    def table(self) -> pd.DataFrame:
        """Each server: up (how soon, its memory, its command) or not measurable, and why."""
        rows = [{"server": n, "status": f"up in {self.up_s.get(n, float('nan')):.1f} s at {s.url}",
                 "resident MiB": None if s.pid is None else resident_mib(s.pid),
                 "command": " ".join(Path(a).name if "/" in a else a for a in getattr(s, "command", [])[:14])}
                for n, s in self.servers.items()]  # fmt: skip
        rows += [{"server": n, "status": f"not measurable: {why}"} for n, why in self.missing.items()]
        return pd.DataFrame(rows).set_index("server")


def as_lineup(target: Target) -> Lineup:
    """``target`` itself when it is a lineup; any other target as a lineup of one."""
    if isinstance(target, Lineup):
        return target
    if isinstance(target, LocalLab):
        budgets = (target.settings.get("step_tokens", DEFAULT_STEP_TOKENS),
                   target.settings.get("surge_tokens", DEFAULT_SURGE_TOKENS))  # fmt: skip
        name = LABKIT if budgets == DEFAULT else labkit_name(budgets[0])
        return Lineup({name: target}, {}, {name: budgets}, target.loaded)
    return Lineup({target.name: target}, {}, {})


def each(spec: Experiment, target: Target, **sizes: Any) -> dict:
    """``spec`` against labkit and each peer in turn (each is compared with itself: its own idle,
    its own rounds without the effect), unsaved: one server's run would overwrite another's under
    ``<data>/target-<group>/``. A missing server: one line saying why."""
    lineup, out = as_lineup(target), {}
    for name in (LABKIT, *PEERS) if isinstance(target, Lineup) else lineup.servers:
        if name in lineup.missing:
            print(f"{name}: not measurable, because {lineup.missing[name]}")
        elif name in lineup.servers:
            out[name] = run(spec, lineup.servers[name], save=False, **sizes)
    return out


def side_by_side(results: dict[str, Any], table: str = "") -> pd.DataFrame:
    """Each server's ``table`` (empty: its verdicts), one below the other, the server as the first index."""
    return pd.concat({n: r.verdict_table() if not table else r.table(table) for n, r in results.items()},
                     names=["server"])  # fmt: skip


def checked(results: dict[str, Any]) -> str:
    """labkit's checked lines of :func:`each`'s results: which peers run differs between machines."""
    return results[LABKIT].checked() if LABKIT in results else ""


def quirks(target: Target) -> pd.DataFrame:
    """What each server's probe found, one column a server."""
    return pd.DataFrame({n: quirks_table(s).set_index("question").answer for n, s in as_lineup(target).servers.items()})


def start(
    model: str, budgets: tuple[int | None, ...] = (None,), *, peers: tuple[str, ...] = PEERS,
    engine: Target | None = None, num_blocks: int = 384, threads: int = 2, log_dir: Path | None = None,
) -> Lineup:  # fmt: skip
    """labkit at its defaults, labkit at each budget of the sweep (no surge budget), and the peers,
    each started, probed and warmed up once; a peer that cannot start is kept as a reason.
    ``num_blocks`` of 16 tokens: labkit's and transformers serve's caches (llama.cpp's is one
    shared context pool, large enough for the burst's long prompt).
    The servers' output goes to ``log_dir`` (default ``build/peers/`` in the checkout)."""
    log_dir = log_dir or repo_root() / "build" / "peers"
    env = {"OMP_NUM_THREADS": str(threads)}
    labkits = sweep(budgets)
    make: dict[str, Callable[[], Process]] = {
        name: partial(Process.labkit, model, api="openai", env=env, num_blocks=num_blocks, max_batch=32,
                      step_tokens="none" if step is None else step, surge_tokens="none" if surge is None else surge,
                      log_level="warning")
        for name, (step, surge) in labkits.items()}  # fmt: skip
    make |= {p: partial(PEER_STARTS[p], model, num_blocks, env, log_dir) for p in peers}
    servers: dict[str, Target] = {}
    missing: dict[str, str] = {}
    up_s: dict[str, float] = {}
    try:
        for name, starter in make.items():
            began = time.perf_counter()
            try:
                server = probe(starter())
                server.name = name
                servers[name] = server
                server.launch([server.request(p, WARM_TOKENS) for p in cycle(WARM_STREAMS)])  # a first run is slower
                up_s[name] = time.perf_counter() - began
            except (TargetError, NotMeasurable) as exc:
                missing[name] = getattr(exc, "because", str(exc))
                with contextlib.suppress(Exception):
                    servers.pop(name).close()
        if LABKIT not in servers:
            raise TargetError(model, f"labkit serve did not start: {missing.get(LABKIT)}")
    except BaseException:
        for server in servers.values():
            server.close()
        raise
    loaded = getattr(engine, "loaded", None) if engine is not None and engine.caps.engine else None
    return Lineup(servers, missing, {n: b for n, b in labkits.items() if n in servers}, loaded, up_s)


def _log(log_dir: Path, name: str) -> Path:
    log_dir.mkdir(parents=True, exist_ok=True)
    return log_dir / f"{name.split()[0].replace('.', '_')}.log"


def _llama(model: str, num_blocks: int, env: dict[str, str], log_dir: Path) -> Process:
    from labkit.peers import PeerMissing, llama_server

    found = llama_server()
    if isinstance(found, PeerMissing):
        raise NotMeasurable(LLAMA, found.reason)
    if model != "smollm2-135m":
        raise NotMeasurable(LLAMA, f"its GGUF holds SmolLM2-135M's weights, and this run serves {model}")
    port = free_port()
    # one KV pool shared by the slots, as labkit's blocks are: split 32 ways, 8192 tokens hold 256 a slot, too
    # few for the burst's long prompt
    command = [*found.command(port, parallel=32, context=8192, threads=int(env["OMP_NUM_THREADS"])), "--kv-unified"]
    return Process(command, f"http://127.0.0.1:{port}", health="/health", log=_log(log_dir, LLAMA),
                   extra_body={"cache_prompt": False}, name=LLAMA)  # fmt: skip


def _transformers(model: str, num_blocks: int, env: dict[str, str], log_dir: Path) -> Process:
    lacking = [m for m in SERVING if find_spec(m) is None]
    if lacking:
        raise NotMeasurable(TRANSFORMERS, f"it needs transformers[serving] (missing {', '.join(lacking)}): "
                            "pip install 'transformers[serving]'")  # fmt: skip
    port = free_port()  # a batch of at most 4096 tokens: with its own choice it made a third fewer tokens/s here
    command = [sys.executable, "-c", TRANSFORMERS_CLI, "serve", str(hf_folder(model)), "--continuous-batching",
               "--device", "cpu", "--dtype", "float32", "--host", "127.0.0.1", "--port", str(port),
               "--cb-block-size", "16", "--cb-num-blocks", str(num_blocks), "--log-level", "info",
               "--cb-max-batch-tokens", "4096"]  # fmt: skip
    return Process(command, f"http://127.0.0.1:{port}", health="/health", log=_log(log_dir, TRANSFORMERS), env=env,
                   name=TRANSFORMERS)  # fmt: skip


PEER_STARTS = {LLAMA: _llama, TRANSFORMERS: _transformers}


def hf_folder(model: str) -> Path:
    """The saved Hugging Face folder of the very weights labkit serves as ``model``."""
    from labkit.models.cache_dir import cached_folder
    from labkit.models.smollm2 import saved_folder

    if model == "smollm2-135m":
        return saved_folder()
    if model == "tiny-llama":  # seeded: the same weights labkit builds, saved once
        return cached_folder("tiny-llama-hf", _save_tiny_llama)
    raise NotMeasurable(TRANSFORMERS, f"it batches Llama models from a saved folder (smollm2-135m or tiny-llama), "
                        f"not {model}")  # fmt: skip


def _save_tiny_llama(dest: Path) -> None:
    from labkit import load_model

    loaded = load_model("tiny-llama")
    loaded.model.save_pretrained(str(dest))
    loaded.tokenizer.save_pretrained(str(dest))
