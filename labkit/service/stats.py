"""One typed snapshot of a server's books, named once: ``GET /stats`` serves it as JSON and
``/metrics`` reads its gauges and counters from it, so the two can never disagree on a name.

The engine reports a plain dict (``BatchEngine.stats()``); this is the one place its keys are
read and renamed (``reserved_blocks`` is ``held_blocks`` here and ``labkit_kv_blocks_in_use``
in Prometheus, the names the lab's notebooks and dashboards already use).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from labkit.hub import Hub, HubStats


@dataclass(frozen=True)
class ServiceStats:
    model: str
    open_streams: int
    waiting: int  # requests waiting for a batch slot (engine)
    running: int  # requests in the decode batch (engine)
    paused: int  # requests the engine holds paused
    free_blocks: int
    held_blocks: int  # KV-cache blocks reserved by live requests
    total_blocks: int
    releases: int
    late_events: int
    finishes: dict[str, int]  # requests that left the engine, by reason
    stream_ends: dict[str, int]  # streams closed, by how they ended
    errors: int
    draining: bool
    resumable_logs: int
    engine: dict[str, Any]  # the engine's own report, whole
    hub: HubStats

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def read_stats(model: str, engine: Any, hub: Hub, resumable_logs: int) -> ServiceStats:
    """Read the engine and the hub once (on the loop thread) and name what they say."""
    books, streams = engine.stats(), hub.stats()
    return ServiceStats(
        model=model,
        open_streams=streams.open_streams,
        waiting=books["waiting"],
        running=books["running"],
        paused=books["paused"],
        free_blocks=books["free_blocks"],
        held_blocks=books["reserved_blocks"],
        total_blocks=books["total_blocks"],
        releases=books["releases"],
        late_events=streams.late_events,
        finishes=books["finished"],
        stream_ends=streams.ends,
        errors=streams.errors,
        draining=streams.draining,
        resumable_logs=resumable_logs,
        engine=books,
        hub=streams,
    )
