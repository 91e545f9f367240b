"""Shutdown: stop admitting (503), end every open stream with ``error: shutdown``, release all."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from service_helpers import TIMEOUT, RawClient, healthy, lab_server, occupy_a_slot, wait_until

REPO = Path(__file__).resolve().parents[1]


def open_and_hold(server: Any, count: int) -> list[RawClient]:
    """``count`` running streams, paused in the engine so they stay open until the drain (each long
    enough that it cannot end before its pause lands, however slowly this thread gets the GIL)."""
    return [occupy_a_slot(server, max_new_tokens=480) for _ in range(count)]


def test_drain_ends_open_streams_with_a_shutdown_error_then_refuses_with_503(tiny_gpt2: Any) -> None:
    with lab_server(tiny_gpt2) as server:
        clients = open_and_hold(server, 4)
        server.drain()
        for client in clients:
            events = client.read_to_end()
            assert client.ended and events[-1][0] == "error"
            assert events[-1][1]["error"]["type"] == "shutdown"
        with httpx.Client(base_url=server.url, timeout=TIMEOUT) as http:
            for path in ("/v1/stream", "/v1/generate", "/v1/completions"):
                response = http.post(path, json={"prompt": "x"})
                assert response.status_code == 503 and response.json()["error"]["type"] == "draining"
                assert response.headers["retry-after"] == "1"
            assert http.get("/healthz").status_code == http.get("/health").status_code == 503
        assert server.hub.stats().ends == {"shutdown": 4}


def test_leaving_the_server_ends_streams_whose_clients_never_read(tiny_gpt2: Any) -> None:
    with lab_server(tiny_gpt2, check_settled=False, drain_grace=0.5) as server:
        clients = open_and_hold(server, 2)
    for client in clients:  # what was written before the server went away
        events = client.read_to_end()
        assert client.ended and events[-1][0] == "error" and events[-1][1]["error"]["type"] == "shutdown"


def test_healthz_is_ok_while_serving_and_answers_as_health_too(tiny_gpt2: Any) -> None:
    with lab_server(tiny_gpt2) as server, httpx.Client(base_url=server.url, timeout=TIMEOUT) as http:
        for path in ("/healthz", "/health"):  # /health: the name vLLM, llama.cpp's server and GuideLLM use
            response = http.get(path)
            assert response.status_code == 200 and response.json() == {"status": "ok", "model": "tiny-gpt2"}


def test_a_generate_in_flight_at_the_drain_gets_503_with_retry_after(tiny_gpt2: Any) -> None:
    """Every 503 says when to come back, including one made by a route after the drain began."""
    with lab_server(tiny_gpt2, max_batch=1, retry_after_s=3) as server:
        holder = occupy_a_slot(server)
        with ThreadPoolExecutor(1) as pool, httpx.Client(base_url=server.url, timeout=TIMEOUT) as http:
            pending = pool.submit(http.post, "/v1/generate", json={"prompt": "Hi", "max_new_tokens": 4})
            wait_until(lambda: server.engine.stats()["waiting"] == 1, what="the generate to wait for the slot")
            server.drain()
            response = pending.result(TIMEOUT)
        holder.read_to_end()
        assert response.status_code == 503, response.text
        assert response.headers["retry-after"] == "3"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_labkit_serve_exits_cleanly_within_the_drain_grace_on_sigterm() -> None:
    """A real ``labkit serve``: one client that never reads (its writer blocks on full buffers),
    one /v1/generate waiting for the slot it holds; SIGTERM. The process exits 0, within
    drain_grace (plus a generous allowance for interpreter exit), with no traceback."""
    grace, port = 2.0, free_port()
    argv = [sys.executable, "-m", "labkit.cli", "serve", "--model", "tiny-gpt2", "--port", str(port),
            "--policy", "pause", "--max-batch", "1", "--pad-bytes", "262144", "--sndbuf", "4096",
            "--drain-grace", str(grace), "--log-level", "warning"]
    proc = subprocess.Popen(argv, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: healthy(url) or proc.poll() is not None, timeout=120, what="the server to start")
        assert proc.poll() is None
        blocked = RawClient(url, rcvbuf=4096).post("/v1/stream", {"prompt": "Hello", "max_new_tokens": 400})
        wait_until(lambda: httpx.get(url + "/stats", timeout=TIMEOUT).json()["paused"] == 1,
                   what="the reader's stream to be paused")
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(httpx.post, url + "/v1/generate", json={"prompt": "Hi", "max_new_tokens": 4},
                                  timeout=TIMEOUT)
            wait_until(lambda: httpx.get(url + "/stats", timeout=TIMEOUT).json()["waiting"] == 1,
                       what="the generate to wait for the slot")
            started = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(TIMEOUT)
            elapsed = time.monotonic() - started
            response = pending.result(TIMEOUT)
        blocked.sock.close()
        _, stderr = proc.communicate(timeout=TIMEOUT)
        assert code == 0, stderr
        assert elapsed < grace + 5.0, (elapsed, stderr)  # far under TIMEOUT, which a drain that waited would take
        assert "Traceback" not in stderr and "CancelledError" not in stderr, stderr
        assert response.status_code == 503 and response.headers["retry-after"] == "1"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_a_sync_stream_sleeping_in_a_worker_thread_does_not_hold_shutdown_past_the_grace() -> None:
    """``/lab/slow/sync`` blocks a worker thread a minute between ticks; shutdown must not wait for it."""
    grace, port = 2.0, free_port()
    argv = [sys.executable, "-m", "labkit.cli", "serve", "--model", "tiny-gpt2", "--port", str(port), "--lab-routes",
            "--drain-grace", str(grace), "--log-level", "warning"]  # fmt: skip
    proc = subprocess.Popen(argv, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: healthy(url) or proc.poll() is not None, timeout=120, what="the server to start")
        with httpx.stream("GET", url + "/lab/slow/sync?n=3&interval=60", timeout=TIMEOUT) as ticks:
            assert next(ticks.iter_lines()).startswith("event: tick")  # the first tick; the next is a minute away
            started = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(TIMEOUT)
        elapsed = time.monotonic() - started
        _, stderr = proc.communicate(timeout=TIMEOUT)
        assert code == 0 and elapsed < grace + 5.0, (elapsed, stderr)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
