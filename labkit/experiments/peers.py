"""Notebook 09: labkit beside a peer, ``transformers serve``, measured by the same client.

Why: a lab that only measures its own server cannot say whether its numbers are good. Here
``labkit serve`` and ``transformers serve --continuous-batching`` run one after another as
processes of this interpreter on 127.0.0.1, with the same weights (one saved Hugging Face folder:
SmolLM2-135M under ``full``, the tiny random Llama under ``ci``), float32, CPU, each with a KV
cache of the same size, and the client-side experiments of :mod:`labkit.experiments.target_runs`
run against each: the overlap sweep, the disconnect probe (witnessed by the server's CPU time,
since it is local) and the slow-reader probe. Every request is built from what the probe found
(:mod:`labkit.experiments.target_probe`), never from the server's name.

A third server (llama.cpp's ``llama-server``, vLLM) joins as a column when its URL is given; it
is measured as it is (it is not started or stopped here, and its CPU time is not read).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pandas as pd

from labkit.experiments.profiles import Profile, repo_root
from labkit.experiments.progress import Progress, doing
from labkit.experiments.readings import Verdict, current_step, fetch_steps, span
from labkit.experiments.target import Target, TargetError
from labkit.experiments.target_disconnect import DisconnectConfig, run_disconnect
from labkit.experiments.target_probe import connect, quirks_table
from labkit.experiments.target_runs import OverlapConfig, run_overlap
from labkit.experiments.target_slow import SlowConfig, run_slow
from labkit.experiments.waiting import WaitTimeout, wait_for

__all__ = ["NAME", "Config", "Server", "serve", "run", "combine", "closing_table", "verdicts", "report", "plot"]

NAME = "peers"
LABKIT, TRANSFORMERS, EXTRA = "labkit", "transformers serve", "third server"


@dataclass(frozen=True)
class Config:
    model: str  # labkit's name for the model; the peer serves the same weights from its saved folder
    overlap: OverlapConfig = field(default_factory=OverlapConfig)
    disconnect: DisconnectConfig = field(default_factory=DisconnectConfig)
    slow: SlowConfig = field(default_factory=SlowConfig)
    block_size: int = 16
    num_blocks: int = 1024  # the same KV cache for both: num_blocks x block_size tokens
    threads: int = 2
    start_timeout_s: float = 240.0
    extra_url: str = ""  # a third server's URL (llama-server, vLLM), measured as it is

    @classmethod
    def for_profile(cls, profile: Profile, extra_url: str = "") -> Config:
        threads = max(1, min(2, os.cpu_count() or 1))
        if profile.model not in ("smollm2-135m", "tiny-llama"):
            raise ValueError(
                f"peers: the peer needs a saved Llama folder: smollm2-135m or tiny-llama, got {profile.model!r}"
            )
        if profile.full:
            return cls(
                profile.model,
                OverlapConfig(levels=(1, 4, 16, 32), repetitions=3, max_tokens=64),
                DisconnectConfig(streams=8, max_tokens=1024, hold_s=1.5, window_s=1.5, repetitions=3),
                SlowConfig(healthy=4, slow=(0, 2), max_tokens=64),
                num_blocks=1024,
                threads=threads,
                extra_url=extra_url,
            )
        return cls(
            profile.model,
            OverlapConfig(levels=(1, 2, 4), repetitions=3, max_tokens=16),
            # read 0.1 s of 470 tokens (the context holds 512): labkit makes 25-45 by then, so its
            # streams are still running when the clients leave on an engine 3x faster (0.5 s of 400
            # made 150-235, and 2.5x that hold saw every stream end before its client left)
            DisconnectConfig(streams=4, max_tokens=470, hold_s=0.1, window_s=0.5, follow_up_tokens=8, repetitions=3),
            SlowConfig(healthy=3, slow=(0, 2), max_tokens=16),
            num_blocks=256,
            threads=threads,
            start_timeout_s=120.0,
            extra_url=extra_url,
        )

    def units(self) -> int:
        per_server = self.overlap.units + self.disconnect.units + self.slow.units
        return per_server * (2 + bool(self.extra_url))


def units(config: Config) -> int:
    return config.units()


# --------------------------------------------------------------------------- the servers


@dataclass(frozen=True)
class Server:
    """A server to measure: its name, URL, process id (when started here) and start-up time."""

    name: str
    url: str
    pid: int | None = None
    startup_s: float = float("nan")
    command: str = ""


def model_folder(model: str) -> Path:
    """The saved Hugging Face folder both servers read: labkit's SmolLM2 cache, or the tiny Llama
    saved once (its weights are seeded, so labkit's ``tiny-llama`` is the same model)."""
    from labkit.models.cache_dir import cached_folder

    if model == "smollm2-135m":
        from labkit.models.smollm2 import _convert_gguf

        return cached_folder("smollm2-135m", _convert_gguf)
    if model == "tiny-llama":
        return cached_folder("tiny-llama-hf", _save_tiny_llama)
    raise ValueError(f"peers: no saved folder for {model!r} (smollm2-135m or tiny-llama)")


def _save_tiny_llama(dest: Path) -> None:
    from labkit.models.tiny import tiny_llama

    loaded = tiny_llama()
    loaded.model.save_pretrained(str(dest))
    loaded.tokenizer.save_pretrained(str(dest))


def peer_missing() -> str | None:
    """Why ``transformers serve`` cannot run here (its serving extra), or None."""
    missing = [m for m in ("fastapi", "uvicorn", "openai", "rich", "pydantic") if importlib.util.find_spec(m) is None]
    if missing:
        return f"transformers serve needs transformers[serving]; missing: {', '.join(missing)}"
    return None


def command(name: str, config: Config, port: int) -> list[str]:
    """The argv that starts ``name`` on ``port``: this interpreter, same weights, same cache size."""
    if name == LABKIT:
        return [
            sys.executable, "-m", "labkit.cli", "serve", "--model", config.model, "--port", str(port),
            "--host", "127.0.0.1", "--block-size", str(config.block_size), "--num-blocks", str(config.num_blocks),
            "--log-level", "warning", "--lab-routes",  # GET /lab/steps: labkit's step log
        ]  # fmt: skip
    folder = model_folder(config.model)
    script = (
        "import sys; from transformers.cli.transformers import main; sys.argv[0] = 'transformers'; sys.exit(main())"
    )
    return [
        sys.executable, "-c", script, "serve", str(folder), "--continuous-batching", "--device", "cpu",
        "--dtype", "float32", "--host", "127.0.0.1", "--port", str(port),
        "--cb-block-size", str(config.block_size), "--cb-num-blocks", str(config.num_blocks),
        "--cb-max-batch-tokens", str(4 * 1024), "--log-level", "info",
    ]  # fmt: skip


@contextlib.contextmanager
def serve(name: str, config: Config, log_dir: Path) -> Iterator[Server]:
    """Start server ``name`` as a child process on a free loopback port; stop it on the way out
    (SIGINT, then SIGKILL after 10 s: transformers serve can leave a thread spinning after its
    shutdown). Raises :class:`TargetError` (one line) when it does not answer in time."""
    port = _free_port()
    argv = command(name, config, port)
    env = {**os.environ, "PYTHONPATH": str(repo_root()), "OMP_NUM_THREADS": str(config.threads)}
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"{name.split()[0]}.log"
    url = f"http://127.0.0.1:{port}"
    t0 = time.perf_counter()
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, cwd=repo_root(), env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait_until_up(url, proc, config.start_timeout_s, log, name)
        shown = " ".join(Path(a).name for a in argv[3:])
        yield Server(name, url, proc.pid, time.perf_counter() - t0, f"{name.split()[0]} {shown}")
    finally:
        stop(proc, log)


def stop(proc: subprocess.Popen, log: Path | None = None, grace_s: float = 10.0) -> None:
    """SIGINT, then SIGKILL once the server says it finished (transformers serve keeps a thread
    spinning at full CPU after "Finished server process") or after ``grace_s``; always reaped."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)

        def finished() -> bool:
            return proc.poll() is not None or (
                log is not None and b"Finished server process" in log.read_bytes()[-4096:]
            )

        with contextlib.suppress(WaitTimeout):  # then it is killed
            wait_for(finished, timeout=grace_s, what="the server to finish", interval=0.05)
        if proc.poll() is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(0.2)  # its own exit, if it comes, comes now
    if proc.poll() is None:
        proc.kill()
    proc.wait(10)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_until_up(url: str, proc: subprocess.Popen, timeout: float, log: Path, name: str) -> None:
    def up() -> bool:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace").strip().splitlines()[-1:] or ["(no output)"]
            raise TargetError(url, f"{name} exited with status {proc.returncode}: {tail[0][:200]}")
        try:
            return httpx.get(url + "/v1/models", timeout=2, trust_env=False).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_for(up, timeout=timeout, what=f"{name} to answer GET /v1/models", interval=0.25)
    except WaitTimeout as exc:
        raise TargetError(url, f"{name} did not answer GET /v1/models within {timeout:g} s (log: {log})") from exc


# --------------------------------------------------------------------------- measuring one


def run(config: Config, server: Server, progress: Progress | None = None) -> dict[str, pd.DataFrame]:
    """The three client-side experiments against ``server``; every table has a ``server`` column."""
    doing(progress, f"{server.name}: probing {server.url}")
    target: Target = connect(server.url, pid=server.pid, timeout=120.0)
    tables: dict[str, pd.DataFrame] = {"quirks": quirks_table(target)}
    first_step = current_step(server.url) if server.name == LABKIT else 0
    measured = {
        "overlap": run_overlap(target, config.overlap, progress),
        "disconnect": run_disconnect(target, config.disconnect, progress),
        "slow": run_slow(target, config.slow, progress),
    }
    for prefix, parts in measured.items():
        tables.update({f"{prefix}_{table_name}": table for table_name, table in parts.items()})
    if server.name == LABKIT:  # the only server here with a step log (GET /lab/steps)
        tables["steps"] = fetch_steps(server.url, since=first_step)
    tables["servers"] = pd.DataFrame(
        [
            {
                "startup_s": server.startup_s,
                "command": server.command,
                "model": target.model,
                "eos_flag": target.quirks.eos_flag,
            }
        ]
    )
    return {name: table.assign(server=server.name) for name, table in tables.items()}


def combine(per_server: dict[str, dict[str, pd.DataFrame]]) -> dict[str, pd.DataFrame]:
    """One table per kind, the servers' rows one after another."""
    names = [n for tables in per_server.values() for n in tables]
    return {
        n: pd.concat([t[n] for t in per_server.values() if n in t], ignore_index=True) for n in dict.fromkeys(names)
    }


# --------------------------------------------------------------------------- reading them


def closing_table(tables: dict[str, pd.DataFrame]) -> pd.DataFrame:
    """The servers side by side: tokens/s per level, first token median and p99, release after a
    disconnect, the slow-reader effect; each as median (min–max) over the rounds."""
    runs, rows = tables["overlap_runs"], {}
    servers = list(dict.fromkeys(runs.server))
    for level in sorted(runs.level.unique()):
        rows[f"tokens/s at {level} streams"] = {
            s: span(runs[(runs.server == s) & (runs.level == level)].tokens_per_s, "{:.1f}") for s in servers
        }
    top = runs.level.max()
    for col, what in (("ttft_p50_s", "median"), ("ttft_p99_s", "p99")):
        rows[f"first token {what} at {top} streams (ms)"] = {
            s: span(1e3 * runs[(runs.server == s) & (runs.level == top)][col], "{:.0f}") for s in servers
        }
    d = tables.get("disconnect_runs", pd.DataFrame(columns=["server", "leave_by"]))
    for how in ("fin", "rst"):
        rows[f"release after {how.upper()} (1 = back to idle)"] = {
            s: span(d[(d.server == s) & (d.leave_by == how)].cpu_release, "{:.2f}") for s in servers
        }
    slow = tables.get("slow_runs", pd.DataFrame(columns=["server", "slow_readers"]))
    for k in sorted(k for k in slow.slow_readers.unique() if k):
        part = slow[slow.slow_readers == k]
        rows[f"healthy makespan with {k} slow readers / without"] = {
            s: span(part[part.server == s].effect, "{:.2f}") for s in servers
        }
        rows[f"slow readers' achieved read ratio (k={k})"] = {
            s: span(part[part.server == s].achieved_ratio, "{:.2f}") for s in servers
        }
    started = tables["servers"].set_index("server").startup_s
    rows["start-up until /v1/models answers (s)"] = {s: f"{started.get(s, float('nan')):.1f}" for s in servers}
    return pd.DataFrame(rows).T.rename_axis("measurement")


def _median(runs: pd.DataFrame, server: str, level: int, col: str = "tokens_per_s") -> float:
    part = runs[(runs.server == server) & (runs.level == level)][col]
    return float(part.median()) if len(part) else float("nan")


def verdicts(tables: dict[str, pd.DataFrame]) -> list[Verdict]:
    runs = tables["overlap_runs"]
    servers = list(dict.fromkeys(runs.server))
    top = int(runs.level.max())
    out = []
    if TRANSFORMERS in servers:
        ours, theirs = _median(runs, LABKIT, top), _median(runs, TRANSFORMERS, top)
        out.append(
            Verdict(
                "throughput_vs_peer",
                "labkit's aggregate tokens/s at the largest level is at least transformers serve's",
                "labkit's median tokens/s at the largest level is below transformers serve's",
                ours >= theirs,
                f"{top} streams: labkit {ours:.1f}, transformers serve {theirs:.1f} tokens/s (medians of rounds)",
            )
        )
    for s in servers:
        one, many = _median(runs, s, 1), _median(runs, s, top)
        out.append(
            Verdict(
                f"overlap_{_key(s)}",
                f"{s} batches: its aggregate tokens/s at the largest level is at least twice one stream's",
                "less than twice the tokens/s of one stream at the largest level",
                many >= 2 * one,
                f"{s}: {many:.1f} at {top} streams vs {one:.1f} at 1 ({many / one:.2f}x)",
            )
        )
    d = tables.get("disconnect_runs")
    if d is not None and "streams_left" in d:
        d = d[d.streams_left > 0]  # a round whose streams all ended before the leave witnesses nothing
    if d is not None and len(d):
        for s in servers:
            part = d[d.server == s].cpu_release
            if part.notna().any():
                out.append(
                    Verdict(
                        f"stops_after_leave_{_key(s)}",
                        f"{s} stops generating when its clients leave by FIN or RST",
                        "median release below 0.5 after FIN or after RST (server CPU time)",
                        bool(d[d.server == s].groupby("leave_by").cpu_release.median().min() >= 0.5),
                        f"{s}: release {span(part, '{:.2f}')} over {len(part)} rounds",
                    )
                )
    return out


def _key(server: str) -> str:
    return server.split()[0].lower()


def report(tables: dict[str, pd.DataFrame]) -> str:
    """What must hold whatever the timings: each server answered every stream of every round, at
    the requested length, and the slow readers were slow. No numbers, so nbval can check it."""
    lines = []
    runs = tables["overlap_runs"]
    for s in dict.fromkeys(runs.server):
        part = runs[runs.server == s]
        lines.append(f"{s}: overlap rounds without a failed stream: {'all' if part.errors.sum() == 0 else 'NOT all'}")
        lines.append(f"{s}: every stream ran to max_tokens: {'yes' if part.short_streams.sum() == 0 else 'no'}")
        slow = tables["slow_runs"]
        ratio = slow[(slow.server == s) & (slow.slow_readers > 0)].achieved_ratio
        lines.append(f"{s}: slow readers read at most half the write rate: {'yes' if (ratio <= 0.5).all() else 'no'}")
    return "\n".join(lines)


def unavailable_table(tables: dict[str, pd.DataFrame]) -> pd.DataFrame:
    """What needs a server's internals: shown for labkit (its own notebooks), not available for peers."""
    parts = [tables[n] for n in ("overlap_unavailable", "disconnect_unavailable", "slow_unavailable") if n in tables]
    rows = pd.concat(parts, ignore_index=True).drop_duplicates(["measurement", "server"])
    rows["status"] = np.where(rows.server == LABKIT, "shown in notebooks 03, 05, 06 (in-process)", "not available")
    return rows.pivot(index="measurement", columns="server", values="status")


# --------------------------------------------------------------------------- plots


def plot(tables: dict[str, pd.DataFrame]) -> list[Any]:
    """Tokens/s and time to first token against concurrency, the servers side by side."""
    import matplotlib.pyplot as plt

    runs = tables["overlap_runs"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for s, part in runs.groupby("server", sort=False):
        for ax, col, scale in ((left, "tokens_per_s", 1.0), (right, "ttft_p50_s", 1e3)):
            g = part.groupby("level")[col]
            med = g.median() * scale
            ax.plot(med.index, med.values, marker="o", label=s)
            ax.fill_between(med.index, g.min() * scale, g.max() * scale, alpha=0.2)
    left.set(xscale="log", xlabel="streams at once", ylabel="aggregate tokens/s", title="Throughput (median, min–max)")
    right.set(xscale="log", xlabel="streams at once", ylabel="first token, median over streams (ms)",
              title="Time to first token (median, min–max)")  # fmt: skip
    for ax in (left, right):
        ax.set_xticks(sorted(runs.level.unique()), labels=[str(v) for v in sorted(runs.level.unique())])
        ax.legend()
    fig.suptitle("labkit beside its peer(s): same weights, same client")
    fig.set_label("peers_overlap")
    return [fig]
