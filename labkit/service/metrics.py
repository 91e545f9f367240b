"""Prometheus metrics, one registry per app.

A per-app :class:`CollectorRegistry` (not the process-global one) lets many servers live in one
process, as tests and notebooks run them, without "Duplicated timeseries" errors. Latencies are
histograms observed as tokens are written; everything that is state (open streams, queues,
blocks, finishes) is read from the hub and the engine when ``/metrics`` is scraped, so there is
no second set of books to drift from the first.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, GCCollector, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:  # pragma: no cover
    from labkit.service.stats import ServiceStats

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class Metrics:
    """Observer for the hub (first token, gaps between tokens) and the ``/metrics`` renderer."""

    def __init__(self, read: Callable[[], ServiceStats]) -> None:
        self.registry = CollectorRegistry()
        self.ttft = Histogram(
            "labkit_time_to_first_token_seconds",
            "From submit to the first token taken by the stream's writer.",
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self.gap = Histogram(
            "labkit_inter_token_gap_seconds",
            "Between consecutive tokens taken by one stream's writer.",
            buckets=GAP_BUCKETS,
            registry=self.registry,
        )
        self.connections_closed = Counter(
            "labkit_connections_closed",
            "Connections the server closed itself, by reason (a timeout, the cap).",
            ["reason"],
            registry=self.registry,
        )
        self.registry.register(StateCollector(read))
        GCCollector(registry=self.registry)  # python_gc_collections_total by generation: a full one stalls every stream

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def token_gap(self, seconds: float) -> None:
        self.gap.observe(seconds)

    def connection_closed(self, reason: str) -> None:
        self.connections_closed.labels(reason).inc()

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


_frozen = 0


def record_freeze(count: int) -> None:
    """The count :func:`labkit.server.freeze_heap` froze, for the gauge: ``gc.get_freeze_count()``
    walks the frozen list (about 33 ms for SmolLM2's 400,000 objects), and a scrape runs on the
    event loop, where that walk would stall every stream once per scrape."""
    global _frozen
    _frozen = count


class StateCollector(Collector):
    """Reads the server's stats snapshot at scrape time."""

    def __init__(self, read: Callable[[], ServiceStats]) -> None:
        self.read = read

    def collect(self) -> Iterator[Metric]:
        stats = self.read()
        yield _gauge("labkit_open_streams", "Streams registered in the hub.", stats.open_streams)
        yield _gauge("python_gc_frozen_objects", "Objects the collector skips (labkit serve's startup heap).", _frozen)
        yield _gauge("labkit_queue_depth", "Requests waiting for a batch slot.", stats.waiting)
        yield _gauge("labkit_running_requests", "Requests in the decode batch.", stats.running)
        yield _gauge("labkit_paused_requests", "Requests paused for a slow reader.", stats.paused)
        yield _gauge("labkit_stream_queued_events", "Events queued in the hub, all streams.", stats.hub.queued_events)
        yield _gauge("labkit_kv_blocks_in_use", "KV-cache blocks reserved by live requests.", stats.held_blocks)
        yield _gauge("labkit_kv_blocks_total", "KV-cache blocks in the pool.", stats.total_blocks)
        yield _counter("labkit_finishes", "Requests that left the engine, by reason.", "reason", stats.finishes)
        yield _counter("labkit_stream_ends", "Streams closed, by how they ended.", "end", stats.stream_ends)
        yield _counter(
            "labkit_stream_drops", "Streams the hub ended with an error, by type.", "type", stats.hub.dropped
        )
        late = CounterMetricFamily("labkit_late_events", "Engine events dropped for closed streams.")
        late.add_metric([], stats.late_events)
        yield late


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, label: str, counts: dict[str, int]) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=[label])
    for key, value in sorted(counts.items()):
        family.add_metric([key], value)
    return family
