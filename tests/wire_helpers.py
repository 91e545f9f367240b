"""Helpers for the SSE and schema tests: chunking a byte string, and two ways of reading it."""
from __future__ import annotations

from collections.abc import Iterable, Sequence

import httpx
from httpx_sse import connect_sse

from labkit.sse import ParsedEvent, SSEParser


def split_at(data: bytes, points: Iterable[int]) -> list[bytes]:
    """Cut ``data`` at the given offsets (any order, duplicates and out-of-range allowed)."""
    cuts = sorted({p for p in points if 0 < p < len(data)})
    bounds = [0, *cuts, len(data)]
    return [data[a:b] for a, b in zip(bounds, bounds[1:])]


def byte_by_byte(data: bytes) -> list[bytes]:
    return [data[i : i + 1] for i in range(len(data))]


def run_parser(chunks: Sequence[bytes]) -> tuple[list[ParsedEvent], SSEParser]:
    """Feed every chunk, then close; return the events and the parser (for its state)."""
    parser = SSEParser()
    events: list[ParsedEvent] = []
    for chunk in chunks:
        events += parser.feed(chunk)
    events += parser.close()
    return events, parser


def parser_outcome(chunks: Sequence[bytes]) -> tuple[list[ParsedEvent], str, int | None]:
    """Everything a client can observe: events, then last event id and retry at the end."""
    events, parser = run_parser(chunks)
    return events, parser.last_event_id, parser.retry


def httpx_sse_events(chunks: Sequence[bytes]) -> list[tuple[str, str, str, int | None]]:
    """(event, data, id, retry) as httpx-sse reads ``chunks`` from a real httpx response."""

    def handler(request: httpx.Request) -> httpx.Response:
        headers = {"content-type": "text/event-stream"}
        return httpx.Response(200, headers=headers, content=iter(list(chunks)))

    with httpx.Client(transport=httpx.MockTransport(handler)) as client:
        with connect_sse(client, "GET", "http://test/stream") as source:
            return [(e.event, e.data, e.id, e.retry) for e in source.iter_sse()]


def as_tuples(events: Sequence[ParsedEvent]) -> list[tuple[str, str, str, int | None]]:
    return [(e.event, e.data, e.id, e.retry) for e in events]
