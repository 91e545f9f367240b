"""The parts of uvicorn that are not its public API and that labkit uses, and the versions tested.

``connections.GuardedH11Protocol`` subclasses uvicorn's ``H11Protocol`` and reads its connection
state; ``server.py``'s ``LabServer`` overrides ``uvicorn.Server.shutdown`` and walks its
connections. None of that is promised between uvicorn releases, so ``pyproject.toml`` pins uvicorn
to :data:`TESTED` and this module names every attribute used, for a test (and the server's
start) to fail with one clear sentence instead of an ``AttributeError`` deep in a connection.
"""

from __future__ import annotations

from importlib import metadata

TESTED = ((0, 54), (0, 55))  # uvicorn>=0.54,<0.55, as pinned in pyproject.toml
PIN = "uvicorn>=0.54,<0.55"
# what GuardedH11Protocol calls or reads on itself (methods it overrides call super())
PROTOCOL_METHODS = (
    "connection_made",
    "data_received",
    "on_response_complete",
    "connection_lost",
    "pause_writing",
    "resume_writing",
    "_unset_keepalive_if_required",
    "send_400_response",
)
PROTOCOL_STATE = ("transport", "conn", "loop", "cycle", "app", "connections", "flow")  # set in __init__ or on connect
CYCLE_STATE = ("response_started", "response_complete", "disconnected", "message_event", "transport")
SERVER_USES = ("shutdown", "capture_signals", "_captured_signals", "server_state")


class UnsupportedUvicorn(RuntimeError):
    """uvicorn lacks an internal labkit's connection guards use (the message names them)."""


def version() -> tuple[int, ...]:
    text = metadata.version("uvicorn")
    return tuple(int(part) for part in text.split(".")[:2] if part.isdigit())


def is_tested_version() -> bool:
    low, high = TESTED
    return low <= version()[:2] < high


def missing_methods() -> list[str]:
    """The H11Protocol methods labkit overrides or calls that this uvicorn lacks (class level)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    return [f"H11Protocol.{name}" for name in PROTOCOL_METHODS if not callable(getattr(H11Protocol, name, None))]


def check() -> None:
    """Raise UnsupportedUvicorn where an internal is missing: the classes' methods, which is what
    a server's start can afford (a test checks the state on real instances too)."""
    missing = missing_methods()
    if missing:
        raise UnsupportedUvicorn(
            f"uvicorn {metadata.version('uvicorn')} lacks what labkit's connection guards use "
            f"({', '.join(missing)}); install the tested version: pip install '{PIN}'"
        )
