"""The hub's settings: the slow-reader policy, first-token delivery, and the two bounds that keep
clients that never read from holding a server (``max_pause``, ``queue_timeout``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from labkit.hub.policies import POLICIES

DELIVERY_MODES = ("prefill", "step_end")


@dataclass(frozen=True)
class HubConfig:
    """How the hub treats streams.

    ``first_token="prefill"`` hands each first token to its stream as soon as its own prefill
    ends; ``"step_end"`` holds a step's events until the whole step returns (the older way,
    kept so the two can be measured against each other).

    Two bounds keep a server from being held by clients that never read (``None`` turns one off):

    * ``max_pause`` (seconds, default 10): a stream that stays paused this long, under any
      policy that pauses, is dropped: its request is cancelled (slot and blocks come back) and
      its reader gets an ``error`` of type ``slow_client``. Without it, ``pause`` lets never-
      reading clients hold every slot and most of the cache for as long as they stay connected.
    * ``queue_timeout`` (seconds, default 60): a request that has not made its first token this
      long after it was submitted (it waited for a slot, or its prefill ran that long) ends with
      an ``error`` of type ``queue_timeout`` and leaves the queue, so a client gets an answer.
    """

    policy: str = "pause_then_drop"
    high_water: int = 8
    stall_timeout: float = 0.25
    first_token: str = "prefill"
    max_pause: float | None = 10.0
    queue_timeout: float | None = 60.0
    idle_wait: float = 0.05  # how long the idle step thread sleeps between checks for a stop
    history: int = 10_000  # closed streams' records kept for experiments

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"HubConfig.policy must be one of {POLICIES}, got {self.policy!r}")
        if self.first_token not in DELIVERY_MODES:
            raise ValueError(f"HubConfig.first_token must be one of {DELIVERY_MODES}, got {self.first_token!r}")
        if not _is_int(self.high_water) or self.high_water < 1:
            raise ValueError(f"HubConfig.high_water must be an int >= 1, got {self.high_water!r}")
        for name in ("stall_timeout", "idle_wait", "max_pause", "queue_timeout"):
            value = getattr(self, name)
            if value is None and name in ("max_pause", "queue_timeout"):
                continue
            if not _is_number(value) or value <= 0:
                raise ValueError(f"HubConfig.{name} must be a number > 0, got {value!r}")
        if not _is_int(self.history) or self.history < 0:
            raise ValueError(f"HubConfig.history must be an int >= 0, got {self.history!r}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
