"""Serving benchmarks over real sockets: labkit's one-stream overhead, and labkit beside llama.cpp.

``bench_http``: one 64-token stream through ``labkit serve`` (a subprocess on 127.0.0.1) against
the same request through the engine alone in this process, interleaved, several rounds: the
ratio says what the hub, the service and the socket cost a single client.

``bench_serving``: the overlap workload (``streams`` prompts from :mod:`labkit.prompts`,
``max_tokens`` each, eos ignored) against labkit at several step budgets and against
``llama-server`` (:mod:`labkit.peers`), the servers alternated round by round; per run the
first-token and inter-token gaps (median and p99) and the aggregate tokens/s. ``bench_burst``:
``streams - 1`` decoding streams and one long prompt arriving among them: the running streams'
largest gap against their median gap (how long a prefill stalls them).

The client is deliberately small: httpx streaming, one task per stream, each line timed as it
arrives. Nothing here is asserted by tests; ratios measured in one run are what to read.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager as ContextManager
from dataclasses import dataclass, field

import httpx
import numpy as np
import pandas as pd

from labkit.prompts import PROMPTS

UNCHUNKED = "unchunked"  # the budget label of an engine that prefills whole prompts (step_tokens=None)


@dataclass(frozen=True)
class Server:
    """A running server: its URL and how to ask it for a stream (``kind``: labkit or llama.cpp)."""

    url: str
    kind: str  # "labkit" or "llama.cpp"

    def request(self, prompt: str, max_tokens: int) -> tuple[str, dict]:
        if self.kind == "labkit":
            return "/v1/stream", {"prompt": prompt, "max_new_tokens": max_tokens, "ignore_eos": True}
        body = {"prompt": prompt, "n_predict": max_tokens, "stream": True, "ignore_eos": True, "cache_prompt": False}
        return "/completion", body

    def is_token(self, line: str) -> bool:
        """A token arrived on this line (labkit: an ``event: token`` line; llama.cpp: a data
        line that is not the closing one)."""
        if self.kind == "labkit":
            return line == "event: token"
        return line.startswith("data: ") and '"stop":true' not in line.replace(" ", "")


@dataclass
class Timed:
    """One stream as its client saw it: when the request went out and when each token came."""

    sent: float
    tokens: list[float] = field(default_factory=list)

    @property
    def first_token(self) -> float:
        return self.tokens[0] - self.sent

    @property
    def gaps(self) -> list[float]:
        return list(np.diff(self.tokens))


async def _stream(client: httpx.AsyncClient, server: Server, prompt: str, max_tokens: int, delay: float = 0.0) -> Timed:
    await asyncio.sleep(delay)
    path, body = server.request(prompt, max_tokens)
    timed = Timed(time.perf_counter())
    async with client.stream("POST", server.url + path, json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if server.is_token(line):
                timed.tokens.append(time.perf_counter())
    return timed


async def _streams(server: Server, prompts: list[str], max_tokens: int, delays: list[float]) -> list[Timed]:
    limits = httpx.Limits(max_connections=len(prompts) + 1, max_keepalive_connections=len(prompts) + 1)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=limits) as client:
        return await asyncio.gather(*(_stream(client, server, p, max_tokens, d) for p, d in zip(prompts, delays)))


def run_streams(server: Server, prompts: list[str], max_tokens: int, delays: list[float] | None = None) -> list[Timed]:
    """Every prompt as its own stream, all at once (or each after its delay in seconds)."""
    return asyncio.run(_streams(server, prompts, max_tokens, delays or [0.0] * len(prompts)))


def summary(runs: list[Timed]) -> dict[str, float]:
    """First token and gap, median and p99 (ms), and tokens/s over the whole run."""
    firsts = [r.first_token for r in runs]
    gaps = [g for r in runs for g in r.gaps]
    tokens = sum(len(r.tokens) for r in runs)
    span = max(r.tokens[-1] for r in runs) - min(r.sent for r in runs)
    return {
        "first_p50_ms": 1000 * float(np.percentile(firsts, 50)),
        "first_p99_ms": 1000 * float(np.percentile(firsts, 99)),
        "gap_p50_ms": 1000 * float(np.percentile(gaps, 50)),
        "gap_p99_ms": 1000 * float(np.percentile(gaps, 99)),
        "tokens_per_s": tokens / span,
        "tokens": tokens,
    }


# -- servers as subprocesses ---------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def running(command: list[str], url: str, kind: str, threads: int, timeout: float = 240.0) -> Iterator[Server]:
    """Start ``command`` (torch's and OpenMP's threads set to ``threads``), wait until its health
    route answers 200, yield the server, stop it."""
    health = url + ("/healthz" if kind == "labkit" else "/health")
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        deadline = time.monotonic() + timeout
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"{command[0]} exited with {process.returncode} before it was ready")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(health, timeout=2.0).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{command[0]} was not ready within {timeout} s")
            time.sleep(0.2)
        yield Server(url, kind)
    finally:
        process.terminate()
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5)


def labkit_command(port: int, *, model: str, step_tokens: int | None, max_batch: int = 32) -> list[str]:
    budget = "none" if step_tokens is None else str(step_tokens)
    return [sys.executable, "-m", "labkit.cli", "serve", "--model", model,
            "--port", str(port), "--max-batch", str(max_batch), "--step-tokens", budget]  # fmt: skip


def labkit_server(model: str, threads: int, step_tokens: int | None, max_batch: int = 32) -> ContextManager[Server]:
    port = free_port()
    command = labkit_command(port, model=model, step_tokens=step_tokens, max_batch=max_batch)
    return running(command, f"http://127.0.0.1:{port}", "labkit", threads)


def llama_server(threads: int, parallel: int = 32) -> ContextManager[Server]:
    from labkit.peers import PeerMissing, llama_server

    peer = llama_server()
    if isinstance(peer, PeerMissing):
        raise RuntimeError(peer.reason)
    port = free_port()
    # room for the burst's long prompt in every slot (llama.cpp splits the context between them)
    command = peer.command(port, parallel=parallel, threads=threads, context=parallel * 1280)
    return running(command, f"http://127.0.0.1:{port}", "llama.cpp", threads)


def load() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


# -- one stream: the service's overhead ----------------------------------------------------------
@dataclass(frozen=True)
class HttpBench:
    model: str = "smollm2-135m"
    max_tokens: int = 64
    rounds: int = 3
    threads: int = 2


def _engine_alone(engine, prompt: str, max_tokens: int) -> float:  # noqa: ANN001
    """Tokens/s of one request through ``engine.step()``, submit to last token, stepped from a
    thread of its own as the server's step thread is: on a loaded 2-core machine, two-threaded
    steps run from the main thread were measured up to 20x slower than from another thread."""
    result: list[float] = []

    def run() -> None:
        t0 = time.perf_counter()
        engine.submit(prompt, max_new_tokens=max_tokens, ignore_eos=True)
        last, count = t0, 0
        while engine.has_work():
            for event in engine.step():
                if hasattr(event, "token_id"):
                    last, count = event.time, count + 1
        result.append(count / (last - t0))

    worker = threading.Thread(target=run, name="bench-step")
    worker.start()
    worker.join()
    return result[0]


def bench_http(cfg: HttpBench = HttpBench()) -> pd.DataFrame:
    """One stream, engine alone vs over HTTP, interleaved for ``rounds`` rounds; the last row is
    the median ratio (HTTP / engine)."""
    import torch

    from labkit.engine.config import EngineConfig
    from labkit.engine.engine import BatchEngine
    from labkit.models import load_model

    torch.set_num_threads(cfg.threads)
    engine = BatchEngine(load_model(cfg.model), EngineConfig(max_batch=1))
    prompt = PROMPTS[0]
    rows = []
    with labkit_server(cfg.model, cfg.threads, EngineConfig().step_tokens, max_batch=32) as server:
        run_streams(server, [prompt], 4)  # warm both: the first calls pay for lazy set-up
        _engine_alone(engine, prompt, 4)
        for r in range(cfg.rounds):
            alone = _engine_alone(engine, prompt, cfg.max_tokens)
            timed = run_streams(server, [prompt], cfg.max_tokens)[0]
            http = len(timed.tokens) / (timed.tokens[-1] - timed.sent)
            rows.append({"round": r + 1, "engine_tok_s": alone, "http_tok_s": http, "ratio": http / alone,
                         "load": load()})  # fmt: skip
    table = pd.DataFrame(rows)
    ratio = statistics.median(table.ratio)
    median = {"round": "median", "engine_tok_s": table.engine_tok_s.median(), "http_tok_s": table.http_tok_s.median()}
    return pd.concat([table, pd.DataFrame([{**median, "ratio": ratio, "load": load()}])], ignore_index=True)


# -- many streams: labkit's budgets beside llama.cpp ----------------------------------------------
@dataclass(frozen=True)
class ServingBench:
    model: str = "smollm2-135m"
    streams: int = 32
    max_tokens: int = 64
    budgets: tuple[int | None, ...] = (16, 32, 64, 128, 256, 512, 2048, None)
    rounds: int = 3
    threads: int = 2
    with_llama: bool = True
    burst_prompt_tokens: int = 1000


def _label(budget: int | None) -> str:
    return UNCHUNKED if budget is None else str(budget)


def bench_serving(cfg: ServingBench = ServingBench()) -> pd.DataFrame:
    """One row per (round, server): the overlap workload at ``cfg.streams`` streams, and the burst."""
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(cfg.streams)]
    rows = []
    for r in range(cfg.rounds):
        servers: list[tuple[str, Callable[[], ContextManager[Server]]]] = [
            (f"labkit {_label(b)}", functools.partial(labkit_server, cfg.model, cfg.threads, b)) for b in cfg.budgets
        ]
        if cfg.with_llama:
            servers.append(("llama.cpp", functools.partial(llama_server, cfg.threads, cfg.streams)))
        for name, start in servers if r % 2 == 0 else servers[::-1]:
            with start() as server:
                run_streams(server, prompts[:2], 4)  # warm-up
                row = {
                    "round": r + 1,
                    "server": name,
                    "load": load(),
                    **summary(run_streams(server, prompts, cfg.max_tokens)),
                }
                row.update(_burst(server, prompts, cfg))
                rows.append(row)
                print(row, flush=True)
    return pd.DataFrame(rows)


def long_prompt(tokens: int) -> str:
    """About ``tokens`` tokens of plain prose (the prompt pool, repeated)."""
    text = " ".join(PROMPTS)
    words = text.split()
    return " ".join(words[i % len(words)] for i in range(int(tokens * 0.88)))  # ~1.14 tokens a word


def _burst(server: Server, prompts: list[str], cfg: ServingBench) -> dict[str, float]:
    """``streams - 1`` streams decoding; once they run, one long prompt arrives. The running
    streams' gaps while it is prefilled: the largest against the median of all their gaps."""
    running_ = prompts[: cfg.streams - 1]
    burst_tokens = 3 * cfg.max_tokens // 2  # the running streams outlast the long prompt's prefill
    delays = [0.0] * len(running_) + [_warm_delay(cfg)]
    runs = run_streams_mixed(
        server, running_ + [long_prompt(cfg.burst_prompt_tokens)], burst_tokens, cfg.max_tokens, delays
    )
    arrived = runs[-1].sent
    gaps = [g for r in runs[:-1] for g in r.gaps]
    around = [
        b - a for r in runs[:-1] for a, b in zip(r.tokens, r.tokens[1:]) if b > arrived and a < runs[-1].tokens[0] + 0.5
    ]
    return {
        "burst_gap_p50_ms": 1000 * float(np.percentile(gaps, 50)),
        "burst_max_gap_ms": 1000 * max(around or [0.0]),
        "burst_first_token_ms": 1000 * runs[-1].first_token,
    }


def _warm_delay(cfg: ServingBench) -> float:
    return 2.5 if cfg.model == "smollm2-135m" else 0.5


def run_streams_mixed(
    server: Server, prompts: list[str], max_tokens: int, last_max_tokens: int, delays: list[float]
) -> list[Timed]:
    """Like :func:`run_streams`, but the last prompt asks for ``last_max_tokens``."""

    async def go() -> list[Timed]:
        limits = httpx.Limits(max_connections=len(prompts) + 1, max_keepalive_connections=len(prompts) + 1)
        async with httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=limits) as client:
            counts = [max_tokens] * (len(prompts) - 1) + [last_max_tokens]
            return await asyncio.gather(*(_stream(client, server, p, n, d) for p, n, d in zip(prompts, counts, delays)))

    return asyncio.run(go())


def main() -> None:
    """``python -m labkit.bench_serve http|serving``: print the table (and save it under /tmp)."""
    what = sys.argv[1] if len(sys.argv) > 1 else "http"
    print(f"load {load()}, {os.cpu_count()} cores", flush=True)
    table = bench_http() if what == "http" else bench_serving()
    with pd.option_context("display.width", 200, "display.max_columns", 30):
        print(table.round(3).to_string(index=False))
    table.to_csv(f"/tmp/labkit-bench-{what}.csv", index=False)


if __name__ == "__main__":
    main()
