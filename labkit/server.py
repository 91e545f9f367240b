"""Running the service: its settings, a server in a background thread, and ``labkit serve``.

``serve_in_thread`` is for notebooks and tests: uvicorn on a free loopback port in one thread,
the engine's step thread beside it, and on exit both are stopped and joined, so a test can
assert that no thread was left behind. ``serve_from_args`` is the blocking CLI form.

Shutdown drains before uvicorn stops serving (:class:`LabServer`): new requests get 503 and
every open stream ends with an ``error`` event of type ``shutdown`` within ``drain_grace``
seconds. uvicorn alone would instead wait for every stream to end by itself.
"""
from __future__ import annotations

import argparse
import asyncio
import socket
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, fields
from typing import Any, Iterator

from labkit.engine.config import EngineConfig
from labkit.hub import DELIVERY_MODES, Hub, HubConfig
from labkit.hub import POLICIES
from labkit.service.responses import RESPONSE_CLASSES

_ENGINE_FIELDS = ("block_size", "num_blocks", "max_batch", "max_waiting", "kv_cache_mb", "device", "dtype",
                  "batch_invariant", "tile_rows")
_HUB_FIELDS = ("policy", "high_water", "stall_timeout", "first_token", "max_pause", "queue_timeout")


@dataclass(frozen=True)
class ServiceConfig:
    """Every engine, hub and service setting of one server; each is also a ``labkit serve`` flag."""

    # engine
    block_size: int = 16
    num_blocks: int | None = None  # None: enough for max_batch full contexts (capped by kv_cache_mb)
    max_batch: int = 32
    max_waiting: int | None = 128  # requests waiting for a slot before 429; None: no limit
    kv_cache_mb: int = 512
    device: str = "cpu"
    dtype: str = "float32"
    batch_invariant: bool = True
    tile_rows: int = 8
    # hub
    policy: str = "pause_then_drop"  # pause briefly, then drop: the combination the chapter argued for
    high_water: int = 8  # events queued for one stream that count as "behind"
    stall_timeout: float = 0.25  # seconds behind (drop) or paused (pause_then_drop) before dropping
    first_token: str = "prefill"  # or "step_end"
    max_pause: float | None = 10.0  # seconds a stream may stay paused before it is dropped (see HubConfig)
    queue_timeout: float | None = 60.0  # seconds a request may wait for its first token (see HubConfig)
    # service
    response_class: str = "starlette"  # or "write_only": never listens for the client leaving
    keepalive_interval: float = 15.0  # seconds without an event before a ": ping" comment
    pad_bytes: int = 0  # pad every token event with an SSE comment of this many bytes (a lab device)
    drain_grace: float = 5.0  # seconds open streams get to end at shutdown
    resume_grace: float = 10.0  # seconds a resumable run survives without a connected client
    resume_log_events: int = 4096  # events kept per resumable stream
    retry_after_s: int = 1  # Retry-After on 429 and 503
    default_max_tokens: int = 256  # chat completions that name no limit
    max_body_bytes: int = 1 << 20  # larger request bodies get 413 before anything reads or tokenizes them
    # network
    host: str = "127.0.0.1"
    port: int = 8000
    sndbuf: int | None = None  # SO_SNDBUF for every connection; None: let the kernel autotune it
    log_level: str = "info"

    def __post_init__(self) -> None:
        for build in (self.engine_config, self.hub_config):
            try:
                build()
            except ValueError as exc:
                raise ValueError(f"ServiceConfig: {exc}") from None
        if self.response_class not in RESPONSE_CLASSES:
            raise ValueError(f"ServiceConfig.response_class must be one of {RESPONSE_CLASSES}, got {self.response_class!r}")
        for name in ("keepalive_interval", "drain_grace", "resume_grace"):
            _check(name, getattr(self, name), lambda v: isinstance(v, (int, float)) and v > 0, "a number > 0")
        for name in ("resume_log_events", "retry_after_s", "default_max_tokens", "max_body_bytes"):
            _check(name, getattr(self, name), lambda v: _is_int(v) and v >= 1, "an int >= 1")
        _check("pad_bytes", self.pad_bytes, lambda v: _is_int(v) and 0 <= v <= 64 * 2**20, "an int in [0, 64 MiB]")
        _check("port", self.port, lambda v: _is_int(v) and 0 <= v <= 65535, "an int in [0, 65535]")
        _check("sndbuf", self.sndbuf, lambda v: v is None or (_is_int(v) and v >= 4096), "None or an int >= 4096")
        _check("host", self.host, lambda v: isinstance(v, str) and bool(v), "a host name or address")

    def engine_config(self) -> EngineConfig:
        return EngineConfig(**{name: getattr(self, name) for name in _ENGINE_FIELDS})

    def hub_config(self) -> HubConfig:
        return HubConfig(**{name: getattr(self, name) for name in _HUB_FIELDS})


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check(name: str, value: Any, ok: Any, what: str) -> None:
    if not ok(value):
        raise ValueError(f"ServiceConfig.{name} must be {what}, got {value!r}")


def _uvicorn_server(app: Any, config: ServiceConfig) -> Any:
    import uvicorn

    class LabServer(uvicorn.Server):
        """uvicorn's server, draining the hub before it stops serving."""

        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            await app.state.service.drain()
            await super().shutdown(sockets=sockets)

    uv_config = uvicorn.Config(app, host=config.host, port=config.port, log_level=config.log_level,
                               loop="asyncio", lifespan="on", timeout_graceful_shutdown=2)
    return LabServer(uv_config)


def _build(model: Any, config: ServiceConfig) -> tuple[Any, Hub, Any]:
    from labkit.engine.engine import BatchEngine
    from labkit.service.app import build_app

    if isinstance(model, str):
        from labkit.models import load_model

        model = load_model(model)
    engine = BatchEngine(model, config.engine_config())
    hub = Hub(engine, config.hub_config())
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

    def drain(self, timeout: float = 60.0) -> None:
        """Start the shutdown drain now, from this thread, and wait for it: new requests get 503
        and open streams end with ``error: shutdown``. The server keeps serving until exit."""
        loop = self.hub.loop
        assert loop is not None, "the server is not running"
        asyncio.run_coroutine_threadsafe(self.service.drain(), loop).result(timeout)


@contextmanager
def serve_in_thread(model: Any = "smollm2-135m", *, startup_timeout: float = 60.0,
                    **settings: Any) -> Iterator[RunningServer]:
    """Serve ``model`` (a name or a LoadedModel) on a free loopback port until the block ends."""
    settings.setdefault("port", 0)
    settings.setdefault("log_level", "warning")
    config = ServiceConfig(**settings)
    engine, hub, app = _build(model, config)
    sock = _listening_socket(config)
    server = _uvicorn_server(app, config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="labkit-uvicorn", daemon=True)
    thread.start()
    try:
        _wait_started(server, thread, startup_timeout)
        port = sock.getsockname()[1]
        host = f"[{config.host}]" if ":" in config.host else config.host
        yield RunningServer(f"http://{host}:{port}", port, config, engine, hub, app)
    finally:
        server.should_exit = True
        thread.join(startup_timeout)
        hub.stop()
        sock.close()
        if thread.is_alive():
            raise RuntimeError("the uvicorn thread did not stop")


def _listening_socket(config: ServiceConfig) -> socket.socket:
    """Bind the server's socket ourselves, so the port can be 0 and SO_SNDBUF can be set.

    Accepted connections inherit SO_SNDBUF from the listening socket; setting it also stops
    Linux from growing the send buffer to megabytes, which hides a slow reader's backlog from
    the application (see the buffers and slowclient experiments).
    """
    sock = socket.socket(socket.AF_INET6 if ":" in config.host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if config.sndbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, config.sndbuf)
    sock.bind((config.host, config.port))
    return sock


def _wait_started(server: Any, thread: threading.Thread, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the server failed to start (see the log above)")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the server did not start within {timeout} s")
        time.sleep(0.01)


# -- the CLI -------------------------------------------------------------------------------------
_CHOICES = {"policy": POLICIES, "first_token": DELIVERY_MODES, "response_class": RESPONSE_CLASSES,
            "dtype": ("float32", "bfloat16", "float16"),
            "log_level": ("critical", "error", "warning", "info", "debug", "trace")}
_OPTIONAL_INTS = ("num_blocks", "max_waiting", "sndbuf")


def _optional_int(text: str) -> int | None:
    return None if text.lower() in ("none", "") else int(text)


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """``--model`` and one flag per :class:`ServiceConfig` field (``--max-batch``, ``--policy``...)."""
    parser.add_argument("--model", default="smollm2-135m", help="model name or local path (default: %(default)s)")
    for f in fields(ServiceConfig):
        flag = "--" + f.name.replace("_", "-")
        kwargs: dict[str, Any] = {"default": f.default, "dest": f.name, "help": "(default: %(default)s)"}
        if f.name in _OPTIONAL_INTS:
            kwargs.update(type=_optional_int, metavar="N|none")
        elif isinstance(f.default, bool):
            kwargs.update(action=argparse.BooleanOptionalAction)
        else:
            kwargs.update(type=type(f.default), choices=_CHOICES.get(f.name))
        parser.add_argument(flag, **kwargs)


def config_from_args(args: argparse.Namespace) -> ServiceConfig:
    return ServiceConfig(**{f.name: getattr(args, f.name) for f in fields(ServiceConfig)})


def serve_from_args(args: argparse.Namespace) -> None:
    """Serve until SIGINT or SIGTERM (blocking); then drain, stop the step thread and return."""
    config = config_from_args(args)
    engine, hub, app = _build(args.model, config)
    sock = _listening_socket(config)
    try:
        _uvicorn_server(app, config).run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn re-raises the SIGINT it caught, after a clean shutdown
        pass
    finally:
        hub.stop()
        sock.close()
