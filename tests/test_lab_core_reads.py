"""Core pieces notebook 08 needed: a gzip read, the send time of a read, a bounded wait inside a
loop, and a measurement that cannot be made saying why in one line."""

from __future__ import annotations

import asyncio
import gzip
import time

import pytest
from starlette.applications import Starlette
from starlette.requests import Request as StarletteRequest
from starlette.responses import Response
from starlette.routing import Route
from target_helpers import uvicorn_in_thread

from labkit.lab import Experiment, NotMeasurable, ReadOptions, Request, Target, run
from labkit.lab import client as lab_client
from labkit.lab.client import read, run_sync
from labkit.lab.profiles import Profile
from labkit.lab.witness import WaitTimeout, until

EVENTS = b"".join(b'event: token\ndata: {"id": %d, "text": "x"}\n\n' % i for i in range(3)) + b"event: done\ndata: {}\n\n"
BOMB = b": " + b"x" * (4 << 20) + b"\n\n"  # one 4 MiB comment: a few KiB compressed


def compressing_app() -> Starlette:
    """Gzips the stream (or the bomb) only for a client that accepts gzip."""

    async def stream(request: StarletteRequest) -> Response:
        body = BOMB if request.url.path == "/bomb" else EVENTS
        if "gzip" in request.headers.get("accept-encoding", ""):
            return Response(gzip.compress(body), media_type="text/event-stream", headers={"content-encoding": "gzip"})
        return Response(body, media_type="text/event-stream")

    return Starlette(routes=[Route("/stream", stream, methods=["POST"]), Route("/bomb", stream, methods=["POST"])])


def test_a_gzip_read_asks_for_gzip_and_reads_the_decoded_events_while_a_plain_read_declines_it() -> None:
    with uvicorn_in_thread(compressing_app()) as url:
        zipped = run_sync(read(url, Request("/stream", {}), ReadOptions(gzip=True)))
        plain = run_sync(read(url, Request("/stream", {})))
    assert zipped.headers["content-encoding"] == "gzip" and zipped.ok and zipped.tokens == 3
    assert "content-encoding" not in plain.headers and plain.tokens == 3


def test_a_gzip_read_counts_decoded_bytes_against_its_cap() -> None:
    with uvicorn_in_thread(compressing_app()) as url:
        bomb = run_sync(read(url, Request("/bomb", {}), ReadOptions(gzip=True, max_bytes=1 << 20)))
    assert bomb.error is not None and "cap of 1,048,576 bytes" in bomb.error


def test_a_read_is_timed_from_its_request_not_from_building_its_client(monkeypatch: pytest.MonkeyPatch) -> None:
    made = lab_client.async_client

    def slow_client(*args: object, **kwargs: object) -> object:
        time.sleep(0.3)
        return made(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(lab_client, "async_client", slow_client)
    with uvicorn_in_thread(compressing_app()) as url:
        before = time.perf_counter()
        stream = run_sync(read(url, Request("/stream", {})))
    assert stream.ok and stream.sent - before >= 0.3


def test_until_returns_what_the_check_found_and_gives_up_at_its_bound() -> None:
    seen = iter([0, None, "found"])
    assert asyncio.run(until(lambda: next(seen), timeout=5, what="a third look", interval=0.001)) == "found"
    with pytest.raises(WaitTimeout, match="waiting for nothing"):
        asyncio.run(until(lambda: False, timeout=0.05, what="nothing"))


def test_a_measurement_that_cannot_be_made_says_why_in_its_first_line_and_its_tables() -> None:
    def prepare(target: Target, sizes: object) -> None:
        raise NotMeasurable("demo.missing", "nginx is not installed here (apt-get install nginx)")

    spec = Experiment("demo.missing", "a demo", {"ci": {"n": 1}}, measure=lambda trial: {}, prepare=prepare)
    result = run(spec, Target("http://127.0.0.1:9"), profile=Profile("ci"), save=False, show=False)
    first = repr(result).splitlines()[0]
    assert first.endswith("because nginx is not installed here (apt-get install nginx)")
    assert list(result.table("anything").because) == ["nginx is not installed here (apt-get install nginx)"]
    assert result.checked() == "" and result.plot(save=False) == []


def test_an_unclear_verdict_with_an_unbounded_end_still_says_how_many_repetitions_would_decide() -> None:
    from labkit.lab import Interval, tell

    decided, evidence = tell(Interval(2.0, 1.0, float("inf"), 6), 1.0, "above")
    assert decided is None and "about 12 repetitions would decide it" in evidence
