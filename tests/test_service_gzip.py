"""Compression in the app: Starlette's GZipMiddleware compresses JSON answers and, by default, leaves
text/event-stream alone; told to compress events too, it still sends each event as it comes."""
from __future__ import annotations

import gzip
import zlib
from typing import Any

import httpx
import pytest
from service_helpers import TIMEOUT, RawClient, lab_server, wait_until

from labkit.service.config import ServiceConfig
from labkit.sse import SSEParser

BODY = {"prompt": "Once upon a time,", "max_new_tokens": 48}
GZIP = {"Accept-Encoding": "gzip"}


def raw_post(url: str, path: str, headers: dict[str, str]) -> RawClient:
    client = RawClient(url, decode=False).post(path, BODY, headers)
    client.read_to_end()
    return client


def test_gzip_is_off_by_default_and_refuses_an_unknown_mode() -> None:
    assert ServiceConfig().http.gzip == "off"
    with pytest.raises(ValueError, match="HttpConfig.gzip"):
        ServiceConfig.of(gzip="brotli")


def test_off_nothing_is_compressed(tiny_gpt2: Any) -> None:
    with lab_server(tiny_gpt2) as server:
        assert "content-encoding" not in raw_post(server.url, "/v1/generate", GZIP).headers


def test_default_compresses_json_answers_but_not_streams(tiny_gpt2: Any) -> None:
    with lab_server(tiny_gpt2, gzip="default") as server:
        answer = raw_post(server.url, "/v1/generate", GZIP)
        assert answer.headers["content-encoding"] == "gzip" and "accept-encoding" in answer.headers["vary"].lower()
        assert b'"token_ids"' in gzip.decompress(bytes(answer.raw))
        stream = raw_post(server.url, "/v1/stream", GZIP)
        assert stream.headers["content-type"].startswith("text/event-stream")
        assert "content-encoding" not in stream.headers and "vary" not in stream.headers
        assert bytes(stream.raw).startswith(b"event: start\n") and b"event: done\n" in stream.raw
        plain = raw_post(server.url, "/v1/generate", {})  # a client that did not ask for gzip
        assert "content-encoding" not in plain.headers


def test_events_mode_compresses_the_stream_without_holding_an_event_back(tiny_gpt2: Any) -> None:
    """Each event is flushed (Z_SYNC_FLUSH): with the request paused in the engine after a few
    tokens, everything sent so far decompresses to whole events while the stream is still open."""
    with lab_server(tiny_gpt2, gzip="events") as server:
        client = RawClient(server.url, decode=False).post("/v1/stream", {**BODY, "max_new_tokens": 200}, GZIP)
        inflate = zlib.decompressobj(16 + zlib.MAX_WBITS)
        parser, events = SSEParser(), []

        def tokens_seen(count: int) -> bool:
            events.extend(parser.feed(inflate.decompress(bytes(client.raw))))
            client.raw.clear()
            return sum(e.event == "token" for e in events) >= count

        client.read_until(lambda: tokens_seen(1))
        assert client.headers["content-encoding"] == "gzip"
        rid = next(e for e in events if e.event == "start").data.split('"request_id":"')[1].split('"')[0]
        server.engine.pause(rid)
        wait_until(lambda: server.engine.stats()["paused"] == 1, what="the pause")
        # read on the loop, after any token the engine made before the pause has been delivered there
        made = httpx.get(f"{server.url}/lab/streams/{rid}", timeout=TIMEOUT).json()["tokens_generated"]
        client.read_until(lambda: tokens_seen(made))  # all made so far, and no byte more is coming
        assert not client.ended and sum(e.event == "token" for e in events) == made
        client.close_rst()


def test_httpx_reads_a_compressed_stream_as_plain_events(tiny_gpt2: Any) -> None:
    with lab_server(tiny_gpt2, gzip="events") as server, httpx.Client(base_url=server.url,
                                                                      timeout=TIMEOUT) as client:
        response = client.post("/v1/stream", json=BODY)
        assert response.headers["content-encoding"] == "gzip"
        assert response.text.startswith("event: start\n") and "event: done\n" in response.text
