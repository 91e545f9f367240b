"""Starting and stopping: every setting is a flag, a model can be named, and SIGINT drains."""
from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from service_helpers import TIMEOUT, RawClient, healthy, lab_server, wait_until

from labkit.server import add_serve_arguments, config_from_args
from labkit.service.config import ServiceConfig, leaves

REPO = Path(__file__).resolve().parents[1]


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return parser.parse_args(argv)


def test_every_setting_is_a_flag_and_parses_into_the_config() -> None:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    flags = {option for action in parser._actions for option in action.option_strings}
    for _, _, f in leaves():
        assert "--" + f.name.replace("_", "-") in flags, f.name
    args = parse(["--model", "tiny-gpt2", "--policy", "pause", "--max-waiting", "none", "--no-batch-invariant",
                  "--stall-timeout", "0.5", "--response-class", "write_only", "--port", "9001"])
    config = config_from_args(args)
    assert args.model == "tiny-gpt2" and config.hub.policy == "pause" and config.engine.max_waiting is None
    assert config.engine.batch_invariant is False and config.hub.stall_timeout == 0.5 and config.http.port == 9001
    assert config.response_class == "write_only" and config.http.host == "127.0.0.1"
    assert config_from_args(parse([])) == ServiceConfig()


def test_serve_in_thread_accepts_a_model_name() -> None:
    with lab_server("tiny-gpt2") as server, httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
        assert server.url.startswith("http://127.0.0.1:")
        assert client.get("/healthz").json()["model"] == "tiny-gpt2"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_labkit_serve_drains_open_streams_on_sigint() -> None:
    """A real process: a stream waiting for the only slot gets ``error: shutdown`` on SIGINT."""
    port = free_port()
    code = ("import argparse, sys; from labkit.server import add_serve_arguments, serve_from_args; "
            "p = argparse.ArgumentParser(); add_serve_arguments(p); serve_from_args(p.parse_args(sys.argv[1:]))")
    argv = ["--model", "tiny-gpt2", "--port", str(port), "--policy", "pause", "--max-batch", "1",
            "--pad-bytes", "65536", "--keepalive-interval", "0.2", "--drain-grace", "1", "--log-level", "warning"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", code, *argv], cwd=REPO, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: healthy(url) or proc.poll() is not None, timeout=120, what="the server to start")
        assert proc.poll() is None
        stalled = RawClient(url).post("/v1/stream", {"prompt": "Hello", "max_new_tokens": 400})
        stalled.read_events(1)  # then reads nothing: the pause policy holds its slot
        waiting = RawClient(url).post("/v1/stream", {"prompt": "Hi", "max_new_tokens": 4})
        waiting.read_until(lambda: b": ping" in waiting.raw)  # it waits for the slot
        proc.send_signal(signal.SIGINT)
        events = waiting.read_to_end()
        assert events[-1][0] == "error" and events[-1][1]["error"]["type"] == "shutdown"
        stalled.close_rst()
        assert proc.wait(TIMEOUT) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()




def test_sndbuf_bounds_what_a_client_that_never_reads_can_absorb(tiny_gpt2) -> None:
    """Without the cap Linux grows the send buffer to megabytes; with it the write blocks early."""
    from labkit.experiments import buffers
    from labkit.lab import Caps, Target, run

    with lab_server(tiny_gpt2, sndbuf=65536) as server:
        target = Target(server.url, api="labkit", caps=Caps(native=True, lab=True, stats=True))
        flood = run(buffers.FLOOD, target, save=False, show=False, event_sizes=(16384,), repetitions=1, flood_mib=8)
    record = flood.table().iloc[0]
    assert record.blocked, record
    assert record.bytes_accepted < 2**20, record


@pytest.mark.parametrize("value", [0, 1024, -1])
def test_sndbuf_below_one_page_is_refused(value: int) -> None:
    with pytest.raises(ValueError, match="sndbuf"):
        ServiceConfig.of(sndbuf=value)


def test_the_access_log_never_carries_a_resume_token(tiny_gpt2) -> None:
    """A browser resumes with ``?token=`` (EventSource sets no headers); the log line keeps the path, not the token."""
    import logging

    lines: list[str] = []
    collect = logging.Handler()
    collect.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    access = logging.getLogger("uvicorn.access")
    with lab_server(tiny_gpt2, log_level="info") as server:
        access.addHandler(collect)  # after the server's start, whose logging config replaces the handlers
        try:
            answer = httpx.get(server.url + "/v1/streams/req-1/events?after=2&token=s3cret-value", timeout=TIMEOUT)
        finally:
            access.removeHandler(collect)
    assert answer.status_code == 404
    assert any("/v1/streams/req-1/events?after=2&token=<redacted>" in line for line in lines), lines
    assert not any("s3cret" in line for line in lines), lines
