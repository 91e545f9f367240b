"""Running the service: a server in a background thread, and ``labkit serve``.

``serve_in_thread`` is for notebooks and tests: uvicorn on a free loopback port in one thread,
the engine's step thread beside it, and on exit both are stopped and joined, so a test can
assert that no thread was left behind. ``serve_from_args`` is the blocking CLI form; its flags
are made from :class:`~labkit.service.config.ServiceConfig`'s fields, one per leaf setting.

Shutdown (:class:`LabServer`) takes at most ``drain_grace`` seconds in all: the hub drains while
uvicorn still serves (new requests get 503, open streams end with ``error: shutdown``); what is
still writing when the drain's share of the grace is over is a writer blocked on a client that
does not read, and its connection is aborted; then uvicorn stops and the step thread is joined.
A signal that asked for this shutdown is not re-raised afterwards, so ``labkit serve`` exits 0.

This module imports the service; nothing in ``labkit.service`` imports it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import os
import re
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, get_type_hints

from labkit.engine.config import DTYPES
from labkit.hub import DELIVERY_MODES, POLICIES, Hub
from labkit.service.config import HttpConfig, ServiceConfig, leaves
from labkit.service.connections import guarded_protocol
from labkit.service.metrics import record_freeze

__all__ = [
    "RunningServer",
    "serve_in_thread",
    "add_serve_arguments",
    "config_from_args",
    "serve_from_args",
    "local_redis",
]

SHUTDOWN_RESERVE_S = 1.0  # of drain_grace, kept for aborting blocked writers, the step thread and exit
# Choices for fields of layers that are not ours to annotate (ours carry them in field metadata).
_CHOICES = {"policy": POLICIES, "first_token": DELIVERY_MODES, "dtype": DTYPES}


class RedactTokens(logging.Filter):
    """uvicorn's access-log line with a resume token's value (``?token=``, which a browser's
    EventSource must use: it cannot set headers) replaced: whoever reads the log could otherwise
    follow or resume another client's stream."""

    TOKEN = re.compile(r"([?&]token=)[^&\s]*")

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args  # uvicorn's: (client, method, path, http version, status)
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str):
            record.args = (*args[:2], self.TOKEN.sub(r"\1<redacted>", args[2]), *args[3:])
        return True


def no_websocket_advice(record: logging.LogRecord) -> bool:
    """Drops uvicorn's advice, at every upgrade request, to install a WebSocket library: serving
    none (``ws="none"``) is this service's choice, and the advice would send an operator astray."""
    return not record.getMessage().startswith("No supported WebSocket library")


def _uvicorn_server(app: Any, config: ServiceConfig) -> Any:
    import uvicorn

    from labkit.service import uvicorn_internals

    uvicorn_internals.check()  # a clear error now, not an AttributeError in the first connection
    if not uvicorn_internals.is_tested_version():
        logging.getLogger(__name__).warning(
            "uvicorn %s is not the tested %s: the connection guards may misbehave",
            uvicorn.__version__,
            uvicorn_internals.PIN,
        )
    service = app.state.service
    grace = config.drain_grace
    reserve = min(SHUTDOWN_RESERVE_S, grace / 2)

    class LabServer(uvicorn.Server):
        """uvicorn's server: drain the hub first, abort blocked writers, stop within drain_grace."""

        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            await service.drain(grace - reserve)
            for connection in list(self.server_state.connections):
                cycle = getattr(connection, "cycle", None)
                if cycle is not None and not cycle.response_complete and connection.transport is not None:
                    connection.transport.abort()
            await super().shutdown(sockets=sockets)

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            with super().capture_signals():
                yield
                self._captured_signals.clear()  # the shutdown it asked for is done: exit normally

    protocol = guarded_protocol(config.http, config.retry_after_s, service.metrics.connection_closed)
    uv_config = uvicorn.Config(
        app,
        host=config.http.host,
        port=config.http.port,
        log_level=config.http.log_level,
        loop="asyncio",
        http=protocol,
        lifespan="on",
        ws="none",  # HTTP and SSE only: an upgrade is a request like any other, answered by its route
        timeout_keep_alive=max(1, round(config.http.idle_timeout)),
        # uvicorn would believe X-Forwarded-For from any loopback peer, and a client could then
        # name itself anew on every request (the resumable share is per client)
        proxy_headers=bool(config.http.forwarded_allow_ips),
        forwarded_allow_ips=list(config.http.forwarded_allow_ips) or None,
        timeout_graceful_shutdown=max(0.1, reserve / 2),  # type: ignore[arg-type]  # uvicorn takes seconds as a float
    )
    access = logging.getLogger("uvicorn.access")  # after uvicorn.Config, which configures its loggers
    if not any(isinstance(f, RedactTokens) for f in access.filters):
        access.addFilter(RedactTokens())
    logging.getLogger("uvicorn.error").addFilter(no_websocket_advice)  # once: a filter is added at most once
    return LabServer(uv_config)


def _build(model: Any, config: ServiceConfig) -> tuple[Any, Hub, Any]:
    from labkit.engine.engine import BatchEngine
    from labkit.service.app import build_app

    if isinstance(model, str):
        from labkit.models import load_model

        model = load_model(model)
    engine = BatchEngine(model, config.engine)
    hub = Hub(engine, config.hub)
    return engine, hub, build_app(engine, hub, config)


@dataclass(frozen=True)
class RunningServer:
    url: str
    port: int
    config: ServiceConfig
    engine: Any
    hub: Hub
    app: Any

    @property
    def service(self) -> Any:
        return self.app.state.service

    def token(self, ttl_s: float | None = None, subject: str = "lab") -> str:
        """A bearer token this server accepts (it must have an ``auth_secret``), valid ``ttl_s`` seconds."""
        from labkit.service.auth import mint_token

        secret = self.config.http.auth_secret
        if secret is None:
            raise ValueError("this server checks no tokens: it was started without auth_secret")
        return mint_token(secret, self.config.http.auth_ttl_s if ttl_s is None else ttl_s, subject)

    def drain(self, timeout: float = 60.0) -> None:
        """Start the shutdown drain now, from this thread, and wait for it: new requests get 503
        and open streams end with ``error: shutdown``. The server keeps serving until exit."""
        loop = self.hub.loop
        assert loop is not None, "the server is not running"
        asyncio.run_coroutine_threadsafe(self.service.drain(), loop).result(timeout)


# What a server in a thread differs in from ``labkit serve``: any free port, a quieter log, and
# the lab routes the experiments read (a test or notebook asked for this server).
IN_THREAD = {"port": 0, "log_level": "warning", "lab_routes": True}


@contextmanager
def serve_in_thread(
    model: Any = "smollm2-135m", config: ServiceConfig | None = None, *, startup_timeout: float = 60.0, **settings: Any
) -> Iterator[RunningServer]:
    """Serve ``model`` (a name or a LoadedModel) on a loopback port until the block ends.

    ``config`` is used as given; else the settings start from ``IN_THREAD``. ``settings`` are
    flat names (``max_batch=4, policy="drop"``) applied on top, as in ``ServiceConfig.of``.
    """
    config = (config or ServiceConfig.of(**IN_THREAD)).replace(**settings)
    engine, hub, app = _build(model, config)
    sock = _listening_socket(config.http)
    server = _uvicorn_server(app, config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="labkit-uvicorn", daemon=True)
    thread.start()
    try:
        _wait_started(server, thread, startup_timeout)
        port = sock.getsockname()[1]
        host = config.http.host
        host = f"[{host}]" if ":" in host else host
        yield RunningServer(f"http://{host}:{port}", port, config, engine, hub, app)
    finally:
        server.should_exit = True
        thread.join(startup_timeout)
        hub.stop()
        sock.close()
        if thread.is_alive():
            raise RuntimeError("the uvicorn thread did not stop")


def _listening_socket(http: HttpConfig) -> socket.socket:
    """Bind the server's socket ourselves, so the port can be 0 and SO_SNDBUF can be set.

    Accepted connections inherit SO_SNDBUF from the listening socket; setting it also stops
    Linux from growing the send buffer to megabytes, which hides a slow reader's backlog from
    the application (see the buffers and slowclient experiments).
    """
    sock = socket.socket(socket.AF_INET6 if ":" in http.host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if http.sndbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, http.sndbuf)
    sock.bind((http.host, http.port))
    return sock


def _wait_started(server: Any, thread: threading.Thread, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the server failed to start (see the log above)")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the server did not start within {timeout} s")
        time.sleep(0.01)


REDIS_PROGRAM = "redis-server"


@contextmanager
def local_redis(startup_timeout: float = 10.0) -> Iterator[str]:
    """A throwaway ``redis-server`` on a free loopback port until the block ends; yields its URL.

    Nothing is persisted (``--save ''``, ``--appendonly no``), so two servers that use it in turn
    share only what the first wrote while it ran. ``FileNotFoundError`` names the missing program
    (``make system-deps`` installs Debian's). The process is stopped and reaped on exit.
    """
    program = shutil.which(REDIS_PROGRAM)
    if program is None:
        raise FileNotFoundError(f"{REDIS_PROGRAM} is not installed (make system-deps installs it)")
    with socket.socket() as probe:  # a free port; redis-server cannot be asked for "any"
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    argv = [program, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    proc = subprocess.Popen([*argv, "--loglevel", "warning"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_redis(port, proc, startup_timeout)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        try:
            proc.wait(startup_timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait_redis(port: int, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{REDIS_PROGRAM} exited with status {proc.returncode} on port {port}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as sock:
                sock.sendall(b"PING\r\n")
                if sock.recv(64).startswith(b"+PONG"):
                    return
        except OSError:
            pass
        time.sleep(0.02)
    raise RuntimeError(f"{REDIS_PROGRAM} did not answer on port {port} within {timeout} s")


# -- the CLI -------------------------------------------------------------------------------------
def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """``--model`` and one flag per leaf setting of :class:`ServiceConfig` (``--max-batch``, ...).

    Each flag's type, default and choices come from its dataclass field; its help from the
    field's metadata, else from the comment beside the field in its layer's source.
    """
    parser.add_argument("--model", default="smollm2-135m", help="model name or local path (default: %(default)s)")
    defaults = ServiceConfig().flat()
    for _, owner, f in leaves():
        kind = get_type_hints(owner)[f.name]
        help_text = f.metadata.get("help") or _field_comments(owner).get(f.name, "")
        kwargs: dict[str, Any] = {
            "default": defaults[f.name],
            "dest": f.name,
            "help": f"{help_text} (default: %(default)s)".strip(),
        }
        choices = f.metadata.get("choices") or _CHOICES.get(f.name)
        if kind is bool:
            kwargs.update(action=argparse.BooleanOptionalAction)
        elif kind == (int | None):
            kwargs.update(type=_optional(int), metavar="N|none")
        elif kind == (float | None):
            kwargs.update(type=_optional(float), metavar="SECONDS|none")
        elif kind == (str | None):
            kwargs.update(type=_optional(str), metavar="TEXT|none")
        elif kind == tuple[str, ...]:
            kwargs.update(type=_names, metavar="NAME,...")
        elif kind in (int, float, str):
            kwargs.update(type=kind, choices=choices)
        else:  # pragma: no cover - a new kind of field needs a parser here
            raise TypeError(f"no flag parser for {owner.__name__}.{f.name}: {kind}")
        parser.add_argument("--" + f.name.replace("_", "-"), **kwargs)
    parser.add_argument(
        "--auth-secret-env",
        metavar="NAME",
        help="read auth_secret from this environment variable (kept off the command line, which ps shows)",
    )


def config_from_args(args: argparse.Namespace) -> ServiceConfig:
    settings = {f.name: getattr(args, f.name) for _, _, f in leaves()}
    name = getattr(args, "auth_secret_env", None)
    if name:
        if settings["auth_secret"] is not None:
            raise SystemExit("give --auth-secret or --auth-secret-env, not both")
        if not os.environ.get(name):
            raise SystemExit(f"--auth-secret-env {name}: that environment variable is not set")
        settings["auth_secret"] = os.environ[name]
    return ServiceConfig.of(**settings)


def _optional(kind: type) -> Any:
    """A flag parser for ``kind | None``: "none" (or nothing) turns the setting off."""

    def parse(text: str) -> Any:
        return None if text.lower() in ("none", "") else kind(text)

    parse.__name__ = kind.__name__  # argparse names the type in its error messages
    return parse


def _names(text: str) -> tuple[str, ...]:
    return tuple(name.strip().lower() for name in text.split(",") if name.strip())


_COMMENT = re.compile(r"^\s+(\w+)\s*:[^#]*#\s*(.+)$")


def _field_comments(owner: type) -> dict[str, str]:
    """``name: type = default  # comment`` lines of a dataclass's source, as {name: comment}."""
    import inspect

    try:
        lines = inspect.getsource(owner).splitlines()
    except (OSError, TypeError):  # pragma: no cover - no source (frozen app)
        return {}
    return {m.group(1): m.group(2).strip() for m in map(_COMMENT.match, lines) if m}


def freeze_heap() -> int:
    """Collect, then move every object alive now (the model, torch's and transformers' modules:
    about 430,000 for SmolLM2) out of the collector's reach, as vLLM's ``freeze_gc_heap`` does
    once its engine is up; returns how many. A full collection walks all of them: 250-300 ms on
    an idle 2-core machine, up to 0.7 s under load, with the GIL held, so every stream stalls at
    once (one p99 gap at 32 streams in notebook 09). Objects made later are collected as ever.
    Only for a process that is a server (``labkit serve``): a notebook's or a test's heap stays
    its own."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    record_freeze(frozen)
    return frozen


def serve_from_args(args: argparse.Namespace) -> None:
    """Serve until SIGINT or SIGTERM (blocking); then drain, stop the step thread and return."""
    config = config_from_args(args)
    engine, hub, app = _build(args.model, config)
    sock = _listening_socket(config.http)
    server = _uvicorn_server(app, config)
    sock.listen(server.config.backlog)  # who connects while the heap freezes waits in the backlog, never refused
    freeze_heap()
    try:
        server.run(sockets=[sock])
    finally:
        hub.stop()
        sock.close()
    # The interpreter's last collections walk torch's and transformers' object graphs: 2-4 s on
    # a loaded 2-core machine, more than the drain grace. Nothing is left to finalize; skip them.
    gc.freeze()
