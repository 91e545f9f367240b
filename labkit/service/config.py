"""ServiceConfig: one server's settings, as the engine's, the hub's and the HTTP layer's own.

``ServiceConfig(engine=EngineConfig(...), hub=HubConfig(...), http=HttpConfig(...), ...)`` nests
each layer's dataclass as that layer defines it: a default lives in one place (the layer's own
field), and nothing here copies a layer's field names. Fields of the service itself (what a
stream looks like, how long shutdown may take) sit on :class:`ServiceConfig` directly.

Every leaf name is unique across the layers, so a flat name is enough to find its layer:
:meth:`ServiceConfig.of` takes the flat form the experiments and tests use
(``ServiceConfig.of(max_batch=4, policy="drop", sndbuf=65536)``), ``labkit serve`` makes one flag
per leaf (:mod:`labkit.server`), and :meth:`ServiceConfig.flat` reads them back.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterator
from dataclasses import dataclass, field, fields, replace
from typing import Any, get_type_hints

from labkit.engine.config import EngineConfig
from labkit.hub import HubConfig
from labkit.service.responses import RESPONSE_CLASSES

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]")
# The service's waiting limit. EngineConfig's own default is "no limit" (for in-process use); a
# server must bound it, so this is the one default the service sets on a layer's field.
SERVICE_MAX_WAITING = 128
LAYERS = ("engine", "hub", "http")
GZIP_MODES = ("off", "default", "events")
MAX_TTL_S = 86400.0  # a token's longest life: a day
MIN_SECRET_CHARS = 16  # an HMAC secret shorter than this is guessable; refuse it rather than sign with it


def setting(default: Any, help: str, **extra: Any) -> Any:
    """A dataclass field whose help text (and ``choices``, if given) become its ``labkit serve`` flag's."""
    return field(default=default, metadata={"help": help, **extra})


@dataclass(frozen=True)
class HttpConfig:
    """The HTTP layer: where it listens and what a connection may cost the server.

    Timeouts protect against clients that hold a connection without finishing anything: an
    idle keep-alive connection, a request head sent a byte at a time (slowloris), a body that
    never completes, a response the client stops reading. The connection cap bounds how many
    connections are served at once, and a second bound how many may wait for their first request
    (:mod:`labkit.service.connections` says which is refused or closed, and when).
    """

    host: str = setting("127.0.0.1", "address to listen on (loopback by default)")
    port: int = setting(8000, "TCP port (0: any free port)")
    allowed_hosts: tuple[str, ...] = setting(
        LOOPBACK_HOSTS, "Host header names accepted (any port); '*' accepts any. Others get 400 (DNS rebinding)"
    )
    forwarded_allow_ips: tuple[str, ...] = setting(
        (), "proxy addresses ('*': any) whose X-Forwarded-For names the client; none: every client is its socket's peer"
    )
    lab_routes: bool = setting(False, "mount the /lab/... routes (per-stream records, /lab/flood) the experiments use")
    docs: bool = setting(False, "serve /docs, /redoc and /openapi.json (the docs pages load their scripts from a CDN)")
    sndbuf: int | None = setting(None, "SO_SNDBUF for every connection; none: let the kernel autotune it")
    idle_timeout: float = setting(5.0, "seconds a connection may wait for the first byte of its next request")
    header_timeout: float = setting(
        10.0, "seconds from a request's first byte until its head (line and headers) is complete"
    )
    body_timeout: float = setting(30.0, "seconds from the end of a request's head until its body is complete")
    send_timeout: float = setting(30.0, "seconds a response write may make no progress before the connection is closed")
    max_connections: int = setting(
        256, "connections served at once (each from its first request on); a new one beyond it gets 503"
    )
    max_pending_connections: int = setting(
        256, "connections not yet served (no complete request yet); one more closes the oldest of them"
    )
    max_requests_per_connection: int = setting(
        1000,
        "requests served on one connection; the last is answered with Connection: close (nginx's keepalive_requests)",
    )
    max_body_bytes: int = setting(1 << 20, "larger request bodies get 413 before anything reads or tokenizes them")
    log_level: str = setting("info", "uvicorn's log level", choices=LOG_LEVELS)
    deadline_gate: bool = setting(
        True, "refuse (429) a request whose deadline_s its predicted finish would miss; none is refused without one"
    )
    deadline_window: int = setting(32, "engine steps whose mean duration the deadline gate predicts with")
    deadline_window_s: float = setting(
        2.0, "seconds an idle engine's last steps still predict for the deadline gate; after that it admits"
    )
    # Not shown in repr: a config printed to a log must not carry the secret.
    auth_secret: str | None = field(
        default=None,
        repr=False,
        metadata={
            "help": "HMAC secret: every /v1/ route then needs 'Authorization: Bearer <token>' (labkit.service.auth); "
            "the flag shows it to ps, --auth-secret-env NAME reads it from the environment instead"
        },
    )
    auth_ttl_s: float = setting(300.0, "lifetime of a token that /lab/token or mint_token issues without a ttl_s")
    gzip: str = setting(
        "off",
        "Starlette's GZipMiddleware: off; default (its own exclusions, text/event-stream among them: only "
        "non-stream answers are compressed); events (text/event-stream too, each event flushed)",
        choices=GZIP_MODES,
    )

    def __post_init__(self) -> None:
        _check(self, "host", lambda v: isinstance(v, str) and bool(v), "a host name or address")
        _check(self, "port", lambda v: _is_int(v) and 0 <= v <= 65535, "an int in [0, 65535]")
        _check(
            self,
            "allowed_hosts",
            lambda v: (
                isinstance(v, tuple) and bool(v) and all(isinstance(h, str) and h and h == h.strip().lower() for h in v)
            ),
            "a non-empty tuple of lower-case host names",
        )
        _check(
            self,
            "forwarded_allow_ips",
            lambda v: isinstance(v, tuple) and all(isinstance(a, str) and a and a == a.strip() for a in v),
            "a tuple of addresses",
        )
        for name in ("lab_routes", "docs"):
            _check(self, name, lambda v: isinstance(v, bool), "a bool")
        _check(self, "sndbuf", lambda v: v is None or (_is_int(v) and v >= 4096), "None or an int >= 4096")
        for name in ("idle_timeout", "header_timeout", "body_timeout", "send_timeout"):
            _check(self, name, _positive_number, "a number > 0")
        for name in ("max_connections", "max_pending_connections", "max_requests_per_connection", "max_body_bytes"):
            _check(self, name, lambda v: _is_int(v) and v >= 1, "an int >= 1")
        _check(self, "log_level", lambda v: v in LOG_LEVELS, f"one of {LOG_LEVELS}")
        _check(self, "deadline_gate", lambda v: isinstance(v, bool), "a bool")
        _check(self, "deadline_window", lambda v: _is_int(v) and 1 <= v <= 4096, "an int in [1, 4096]")
        _check(self, "deadline_window_s", _positive_number, "a number > 0")
        secret = self.auth_secret
        if not (secret is None or (isinstance(secret, str) and len(secret) >= MIN_SECRET_CHARS)):
            # the value is not quoted: even a refused secret stays out of logs and tracebacks
            raise ValueError(f"HttpConfig.auth_secret must be None or a str of at least {MIN_SECRET_CHARS} characters")
        _check(self, "auth_ttl_s", lambda v: _positive_number(v) and v <= MAX_TTL_S, f"a number in (0, {MAX_TTL_S}]")
        _check(self, "gzip", lambda v: v in GZIP_MODES, f"one of {GZIP_MODES}")


@dataclass(frozen=True)
class ServiceConfig:
    """Every setting of one server: the three layers', and the service's own below them."""

    engine: EngineConfig = field(default_factory=lambda: EngineConfig(max_waiting=SERVICE_MAX_WAITING))
    hub: HubConfig = field(default_factory=HubConfig)
    http: HttpConfig = field(default_factory=HttpConfig)
    response_class: str = setting(
        "starlette", "starlette, or write_only: never listens for the client leaving", choices=RESPONSE_CLASSES
    )
    keepalive_interval: float = setting(15.0, "seconds without an event before a ': ping' comment")
    pad_bytes: int = setting(0, "pad every token event with an SSE comment of this many bytes (a lab device)")
    drain_grace: float = setting(5.0, "seconds shutdown may take: open streams end, then the process exits")
    resume_grace: float = setting(
        10.0, "seconds a resumable run survives without a connected client, and its log once it finished"
    )
    resume_log_events: int = setting(4096, "events kept per resumable stream")
    max_resumable: int = setting(
        64,
        "resumable streams alive at once, with or without a client; more get 429 (each runs for resume_grace unread)",
    )
    resume_store: str = setting(
        "memory",
        "where resumable streams' logs live: memory (lost with the process), or a redis://host:port/db URL "
        "(Redis Streams: a restarted server resumes them)",
    )
    resume_store_ttl: float = setting(60.0, "seconds a log in a redis resume_store outlives its last write")
    resumable_share: float = setting(
        0.5, "the share of max_resumable one client (by address) may hold at once; more get 429 (at least 1)"
    )
    retry_after_s: int = setting(1, "Retry-After on every 429 and 503")
    default_max_tokens: int = setting(256, "chat completions that name no limit")

    def __post_init__(self) -> None:
        for name, kind in (("engine", EngineConfig), ("hub", HubConfig), ("http", HttpConfig)):
            _check(self, name, lambda v, kind=kind: isinstance(v, kind), f"a {kind.__name__}")
        _check(self, "response_class", lambda v: v in RESPONSE_CLASSES, f"one of {RESPONSE_CLASSES}")
        _check(self, "resume_store", _is_store, "'memory' or a redis:// (or rediss://) URL")
        for name in ("keepalive_interval", "drain_grace", "resume_grace", "resume_store_ttl"):
            _check(self, name, _positive_number, "a number > 0")
        for name in ("resume_log_events", "max_resumable", "retry_after_s", "default_max_tokens"):
            _check(self, name, lambda v: _is_int(v) and v >= 1, "an int >= 1")
        _check(self, "resumable_share", lambda v: _positive_number(v) and v <= 1, "a number in (0, 1]")
        _check(self, "pad_bytes", lambda v: _is_int(v) and 0 <= v <= 64 * 2**20, "an int in [0, 64 MiB]")

    # -- the flat view ----------------------------------------------------------------------
    @classmethod
    def of(cls, **flat: Any) -> ServiceConfig:
        """A config from flat names (``max_batch=4, policy="drop", sndbuf=65536``), each routed to
        its layer; a layer may also be given whole (``engine=EngineConfig(...)``)."""
        return cls().replace(**flat)

    def replace(self, **flat: Any) -> ServiceConfig:
        """This config with the named settings changed (flat names, as in :meth:`of`)."""
        layers: dict[str, dict[str, Any]] = {name: {} for name in LAYERS}
        own: dict[str, Any] = {}
        for name, value in flat.items():
            layer = layer_of(name)
            (own if layer is None else layers[layer])[name] = value
        try:
            for layer, changes in layers.items():
                if changes:
                    own[layer] = replace(own.get(layer, getattr(self, layer)), **changes)
            return replace(self, **own)
        except ValueError as exc:
            raise ValueError(f"ServiceConfig: {exc}") from None

    def flat(self) -> dict[str, Any]:
        """Every leaf setting by its flat name."""
        values = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in LAYERS}
        for layer in LAYERS:
            part = getattr(self, layer)
            values.update({f.name: getattr(part, f.name) for f in fields(part)})
        return values


def leaves() -> Iterator[tuple[str | None, type, Any]]:
    """``(layer, dataclass, field)`` for every leaf setting; ``layer`` is None for the service's own."""
    for f in fields(ServiceConfig):
        if f.name in LAYERS:
            kind = get_type_hints(ServiceConfig)[f.name]
            for leaf in fields(kind):
                yield f.name, kind, leaf
        else:
            yield None, ServiceConfig, f


def _routes() -> dict[str, str | None]:
    table: dict[str, str | None] = {}
    for layer, _, leaf in leaves():
        if leaf.name in table or leaf.name in LAYERS:
            raise TypeError(f"setting {leaf.name!r} is defined twice; flat names must be unique across layers")
        table[leaf.name] = layer
    return table


def layer_of(name: str) -> str | None:
    """The layer (``engine``, ``hub``, ``http``) a flat name belongs to; None for the service's own."""
    if name in LAYERS:
        return None
    if name not in _ROUTES:
        close = difflib.get_close_matches(name, list(_ROUTES), n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise TypeError(f"ServiceConfig has no setting {name!r}{hint}")
    return _ROUTES[name]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def _is_store(value: Any) -> bool:
    return value == "memory" or (isinstance(value, str) and value.startswith(("redis://", "rediss://")))


def _check(config: Any, name: str, ok: Any, what: str) -> None:
    value = getattr(config, name)
    if not ok(value):
        raise ValueError(f"{type(config).__name__}.{name} must be {what}, got {value!r}")


_ROUTES = _routes()  # last: it builds the dataclasses above
