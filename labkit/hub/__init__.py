"""The hub: the step thread that owns the engine, the streams it feeds, and the slow-reader
policies between them.

* :mod:`labkit.hub.hub`: :class:`Hub` (open, close, drain, stop, check_integrity), its stats.
* :mod:`labkit.hub.config`: :class:`HubConfig`, with the pause and queue bounds.
* :mod:`labkit.hub.stream`: a stream's queue, its :class:`StreamState` and the transition table.
* :mod:`labkit.hub.policies`: the five policies; each returns a :class:`Decision`.
* :mod:`labkit.hub.stepper`: the step thread and its one delivery channel to the loop.
"""

from labkit.hub.config import DELIVERY_MODES, HubConfig
from labkit.hub.hub import Draining, Hub, HubStats
from labkit.hub.policies import POLICIES, Decision, Flow
from labkit.hub.stream import (
    TRANSITIONS,
    IllegalTransition,
    Stream,
    StreamClosed,
    StreamError,
    StreamRecord,
    StreamState,
)

__all__ = [
    "DELIVERY_MODES",
    "POLICIES",
    "TRANSITIONS",
    "Decision",
    "Draining",
    "Flow",
    "Hub",
    "HubConfig",
    "HubStats",
    "IllegalTransition",
    "Stream",
    "StreamClosed",
    "StreamError",
    "StreamRecord",
    "StreamState",
]
