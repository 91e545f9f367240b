"""Connections cost the server only as long as the client keeps its side of the exchange.

Each test runs a real server with one setting made small and plays the client that breaks the
deal on a raw socket: says nothing, sends its head a byte at a time (slowloris), stops halfway
through its body, never reads its response, or arrives while too many connections are open.
Before these guards uvicorn held every such socket for as long as the client liked.

The cap counts connections being served, not sockets: before issue 25 it counted every open
socket at each request, so sockets that never sent a byte got a served keep-alive client 503.
"""
from __future__ import annotations

import contextlib
import json
import re
import select
import socket
import threading
import time
from typing import Any

import httpx
import pytest
from service_helpers import TIMEOUT, RawClient, lab_server, wait_until


def connect(server: Any, rcvbuf: int | None = None) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(TIMEOUT)
    sock.connect(("127.0.0.1", server.port))
    return sock


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes (FIN or RST); fails if it never does."""
    data = bytearray()
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return bytes(data)
        except TimeoutError:
            raise AssertionError(f"the server kept the connection open for {TIMEOUT} s") from None
        if not chunk:
            return bytes(data)
        data += chunk


def status_and_body(raw: bytes) -> tuple[int, dict[str, Any], dict[str, str]]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), json.loads(body), headers


def closes(server: Any) -> dict[str, float]:
    """``labkit_connections_closed_total`` by reason, from /metrics."""
    text = httpx.get(server.url + "/metrics", timeout=TIMEOUT).text
    return {m[1]: float(m[2]) for m in re.finditer(r'labkit_connections_closed_total\{reason="(\w+)"\} (\S+)', text)}


def test_a_connection_that_never_sends_a_request_is_closed_after_the_idle_timeout(tiny_gpt2: Any) -> None:
    with lab_server(tiny_gpt2, idle_timeout=0.3) as server:
        idle = [connect(server) for _ in range(5)]
        for sock in idle:
            assert read_until_closed(sock) == b""
            sock.close()
        assert closes(server)["idle_timeout"] == 5


def test_a_head_sent_a_byte_at_a_time_gets_408_and_is_never_served(tiny_gpt2: Any) -> None:
    """Slowloris: 40 bytes of head at 10 bytes/s would take 4 s; the head timeout is 0.5 s."""
    head = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    with lab_server(tiny_gpt2, header_timeout=0.5) as server:
        sock = connect(server)
        try:
            for byte in head:
                sock.sendall(bytes([byte]))
                time.sleep(0.1)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server closed on us: that is the point
        status, body, headers = status_and_body(read_until_closed(sock))
        sock.close()
        assert status == 408 and body["error"]["type"] == "request_timeout", body
        assert headers["connection"] == "close"
        assert closes(server)["header_timeout"] == 1


def test_a_body_that_stops_halfway_gets_408_and_the_connection_is_closed(tiny_gpt2: Any) -> None:
    with lab_server(tiny_gpt2, body_timeout=0.5) as server:
        sock = connect(server)
        sock.sendall(b"POST /v1/stream HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"prompt\": ")  # then nothing more
        status, body, _ = status_and_body(read_until_closed(sock))
        sock.close()
        assert status == 408 and body["error"]["type"] == "request_timeout", body
        assert closes(server)["body_timeout"] == 1
        assert server.hub.stats().ends == {}  # nothing was submitted


def ask(sock: socket.socket, path: str = "/healthz") -> int:
    """One GET on a kept-alive raw connection; the status of its answer."""
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
    data = bytearray()
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, "the server closed the connection instead of answering"
        data += chunk
    head, _, body = bytes(data).partition(b"\r\n\r\n")
    length = int(re.search(rb"(?i)content-length: (\d+)", head)[1])  # type: ignore[index]
    while len(body) < length:
        body += sock.recv(65536)
    return int(head.split()[1])


def served(server: Any, count: int) -> list[socket.socket]:
    """``count`` keep-alive connections, each served one request: each holds a slot until it closes."""
    held = [connect(server) for _ in range(count)]
    assert [ask(sock) for sock in held] == [200] * count
    return held


def test_a_request_beyond_the_connection_cap_gets_503_with_retry_after(tiny_gpt2: Any) -> None:
    with lab_server(tiny_gpt2, max_connections=3, retry_after_s=2) as server:
        held = served(server, 3)
        with httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
            refused = client.get("/healthz")
        assert refused.status_code == 503 and refused.headers["retry-after"] == "2"
        assert refused.json()["error"]["type"] == "over_capacity"
        assert refused.headers["connection"] == "close"
        for sock in held:
            sock.close()
        wait_until(lambda: httpx.get(server.url + "/healthz", timeout=TIMEOUT).status_code == 200,
                   what="a request to be served once the held connections closed")
        assert closes(server)["over_capacity"] >= 1


def test_sockets_that_send_nothing_never_cost_a_client_that_does(tiny_gpt2: Any) -> None:
    """The attack of issue 25: sockets that never send, re-opened as the idle timeout closes them,
    so that more than ``max_connections`` are always open. A client polling on its keep-alive
    connection, and a new client on a new one, must be served every time."""
    with lab_server(tiny_gpt2, max_connections=3, idle_timeout=0.3) as server:
        stop, silent = threading.Event(), []

        def keep_silent_sockets_open() -> None:
            while not stop.is_set():
                while len(silent) < 10:
                    silent.append(connect(server))
                for sock in list(silent):  # the idle timeout closed it: open another
                    if select.select([sock], [], [], 0)[0]:
                        silent.remove(sock)
                        sock.close()
                time.sleep(0.01)

        attacker = threading.Thread(target=keep_silent_sockets_open)
        with httpx.Client(base_url=server.url, timeout=TIMEOUT) as polling:
            assert polling.get("/healthz").status_code == 200  # established before the attack
            attacker.start()
            try:
                wait_until(lambda: len(silent) >= 10, what="the silent sockets")
                statuses = []
                for _ in range(8):
                    statuses.append(polling.get("/healthz").status_code)
                    statuses.append(httpx.get(server.url + "/healthz", timeout=TIMEOUT).status_code)
                    time.sleep(0.1)
            finally:
                stop.set()
                attacker.join(TIMEOUT)
                for sock in silent:
                    sock.close()
        assert statuses == [200] * 16, statuses
        assert "over_capacity" not in closes(server)


def test_a_burst_beyond_the_cap_serves_the_cap_and_refuses_only_the_rest(tiny_gpt2: Any) -> None:
    """30 clients connect, then each sends a stream request: the first 20 requests take the 20
    slots and are served whole; the other 10 get 503 with Retry-After and the envelope."""
    with lab_server(tiny_gpt2, max_connections=20) as server:
        clients = [RawClient(server.url) for _ in range(30)]
        for client in clients:
            client.post("/v1/stream", {"prompt": "Hello", "max_new_tokens": 4})
        for client in clients:
            client.read_to_end()
        served_whole = [c for c in clients if c.status == 200 and c.events[-1][0] == "done"]
        refused = [c for c in clients if c.status == 503]
        assert (len(served_whole), len(refused)) == (20, 10), [c.status for c in clients]
        for client in refused:
            assert client.headers["retry-after"] == "1" and client.json()["error"]["type"] == "over_capacity"
        for client in clients:
            client.close_fin()


def test_the_oldest_silent_connection_is_closed_when_too_many_wait(tiny_gpt2: Any) -> None:
    """Silent connections hold no slot, but their number is bounded too: a new one beyond
    ``max_pending_connections`` closes the one that has waited longest, never a served one."""
    with lab_server(tiny_gpt2, max_connections=2, max_pending_connections=3) as server:
        held = served(server, 1)
        silent = [connect(server) for _ in range(5)]
        for sock in silent[:2]:
            assert read_until_closed(sock) == b""
        for sock in silent[2:]:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            assert status_and_body(read_until_closed(sock))[0] == 200
        assert ask(held[0]) == 200
        for sock in silent + held:
            sock.close()
        assert closes(server)["crowded_out"] == 2


def test_a_client_that_stops_reading_is_cut_off_after_the_send_timeout(tiny_gpt2: Any) -> None:
    """Small buffers on both ends and big events: the writer blocks on the first few tokens.
    The unbounded policy never drops the stream, so only the send timeout can free the writer."""
    with lab_server(tiny_gpt2, policy="unbounded", sndbuf=4096, pad_bytes=256 * 1024,
                    send_timeout=0.5) as server:
        reader = RawClient(server.url, rcvbuf=4096).post("/v1/stream", {"prompt": "Hello", "max_new_tokens": 50})
        wait_until(lambda: closes(server).get("send_timeout") == 1, what="the send timeout to cut the connection")
        wait_until(lambda: server.hub.open_streams == 0, what="the blocked writer to end")
        reader.sock.settimeout(TIMEOUT)
        with pytest.raises(ConnectionResetError):  # an RST: the kernel dropped what it held for the client
            while reader.sock.recv(65536):
                pass
        reader.sock.close()


def test_a_connection_serves_at_most_its_requests_and_says_close_on_the_last(tiny_gpt2: Any) -> None:
    """nginx's keepalive_requests: an ordinary keep-alive client is told to close on the last one
    and simply reconnects; it loses no request."""
    with lab_server(tiny_gpt2, max_requests_per_connection=3) as server, \
            httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:  # fmt: skip
        answers = [client.get("/healthz") for _ in range(7)]
        assert [a.status_code for a in answers] == [200] * 7
        assert [a.headers.get("connection") for a in answers] == [None, None, "close"] * 2 + [None]
        assert closes(server)["max_requests"] == 2


def test_a_pipelined_flood_that_is_never_read_ends_at_the_request_bound(tiny_gpt2: Any) -> None:
    """One connection pipelines thousands of requests and reads no answer (a hostile review: the
    server served 60,000 of them, 10 s of CPU, and the slot was taken for 42 s, past the send
    timeout). The connection ends after ``max_requests_per_connection`` answers, each of which
    reaches the client (the close lingers, dropping the rest unread, where closing at once would
    reset the connection and destroy them); its slot is free once the linger ends."""
    with lab_server(tiny_gpt2, max_requests_per_connection=50, max_connections=1, send_timeout=60.0,
                    idle_timeout=1.0) as server:  # fmt: skip
        flood = connect(server)
        flood.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n" * 5000)
        wait_until(lambda: server.service.metrics.connections_closed.labels("max_requests")._value.get() == 1,
                   what="the flood's last answer")  # fmt: skip
        time.sleep(0.5)  # the answers sit unread while the server lingers
        raw = read_until_closed(flood)  # the server closed it: neither the send timeout nor the client
        last = raw[raw.rindex(b"HTTP/1.1"):].partition(b"\r\n\r\n")[0]
        assert raw.count(b"HTTP/1.1 200 OK") == raw.count(b"HTTP/1.1") == 50 and b"connection: close" in last
        flood.close()
        wait_until(lambda: httpx.get(server.url + "/healthz", timeout=TIMEOUT).status_code == 200,
                   what="the flood's slot to be free")  # fmt: skip
        assert closes(server).get("send_timeout") is None


def test_a_slow_but_steady_reader_is_not_cut_off(tiny_gpt2: Any) -> None:
    """The send timeout is about no progress, not about slowness: a reader that keeps reading,
    slower than the server writes (so the writer waits on it again and again), gets its stream."""
    with lab_server(tiny_gpt2, policy="unbounded", sndbuf=4096, pad_bytes=64 * 1024,
                    send_timeout=0.5) as server:
        reader = RawClient(server.url, rcvbuf=4096).post(
            "/v1/stream", {"prompt": "Hello", "max_new_tokens": 8, "ignore_eos": True})
        received = bytearray()
        while b"event: done" not in received:
            chunk = reader.sock.recv(4096)
            assert chunk, f"the server closed the stream after {len(received)} bytes"
            received += chunk
            time.sleep(0.01)
        reader.close_fin()
        assert len(received) > 8 * 64 * 1024
        assert "send_timeout" not in closes(server)


# -- framing ------------------------------------------------------------------------------------
GENERATE = b'{"prompt": "Hello", "max_new_tokens": 2}'


def test_a_request_with_both_content_length_and_transfer_encoding_is_answered_then_closed(tiny_gpt2: Any) -> None:
    """RFC 9112 6.1: chunked framing wins (as h11 reads it), and the server must close the
    connection after answering, so a request smuggled behind it is never served."""
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(GENERATE), GENERATE)
    with lab_server(tiny_gpt2) as server:
        sock = connect(server)
        sock.sendall(b"POST /v1/generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked
                     + b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        raw = read_until_closed(sock)
        sock.close()
    assert raw.count(b"HTTP/1.1 ") == 1, raw  # the pipelined request was never served
    status, body, headers = status_and_body(raw)
    assert status == 200 and body["usage"]["completion_tokens"] == 2
    assert headers["connection"] == "close"


def test_a_client_that_half_closes_has_left_even_after_a_whole_request(tiny_gpt2: Any) -> None:
    """Issue 25 asked whether ``shutdown(SHUT_WR)`` after a whole request should be answered. It is
    taken as the client leaving, as nginx takes it for a proxied request (``proxy_ignore_client_abort``
    off) and as the experiments leave "by FIN": a generation nobody waits for is not worth a batch
    slot. This client keeps reading, as a FIN-leaver drains; the server cancels and closes."""
    with lab_server(tiny_gpt2) as server:
        client = RawClient(server.url).post("/v1/stream", {"prompt": "Hello", "max_new_tokens": 400})
        rid = client.read_events(2)[0][1]["request_id"]
        client.sock.shutdown(socket.SHUT_WR)
        read_until_closed(client.sock)
        client.sock.close()
        record = server.hub.record(rid)
        wait_until(lambda: record.released is not None, what="the cancel")
        assert record.finish_reason == "cancelled" and record.tokens_generated < 400


def test_a_client_that_half_closes_in_the_middle_of_its_body_is_not_served(tiny_gpt2: Any) -> None:
    with lab_server(tiny_gpt2) as server:
        sock = connect(server)
        sock.sendall(b"POST /v1/stream HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n" + GENERATE)
        sock.shutdown(socket.SHUT_WR)
        assert read_until_closed(sock) == b""
        sock.close()
        assert server.hub.stats().ends == {}  # nothing was submitted


MALFORMED = {
    "two-lengths": b"POST /v1/generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n",
    "signed-length": b"POST /v1/generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: +5\r\n\r\nhello",
    "no-host": b"GET /healthz HTTP/1.1\r\n\r\n",
    "space-in-a-name": b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nBad Name: x\r\n\r\n",
    "head-past-16-kib": b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n" + b"X-Pad: " + b"a" * 40_000 + b"\r\n\r\n",
    "bad-chunk-size": b"POST /v1/generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                      b"Transfer-Encoding: chunked\r\n\r\nzz\r\n",
}  # fmt: skip


@pytest.mark.parametrize("split", [False, True], ids=["one-write", "two-writes"])
@pytest.mark.parametrize("request_bytes", MALFORMED.values(), ids=MALFORMED.keys())
def test_a_request_h11_cannot_read_gets_a_400_in_the_envelope_and_a_close(
    server: Any, request_bytes: bytes, split: bool
) -> None:
    """A head past 16 KiB too, whether it arrives whole in one read (h11 alone bounds only an
    incomplete head: one read of 250 KB was served) or in pieces."""
    sock = connect(server)
    sock.sendall(request_bytes[:20_000] if split else request_bytes)
    if split:
        time.sleep(0.2)
        with contextlib.suppress(OSError):  # closed after the first piece
            sock.sendall(request_bytes[20_000:])
    raw = read_until_closed(sock)
    sock.close()
    assert raw.count(b"HTTP/1.1 ") == 1, raw
    status, body, headers = status_and_body(raw)
    assert status == 400 and headers["content-type"] == "application/json"
    assert body["error"]["type"] == "invalid_request" and "malformed" in body["error"]["message"]


@pytest.mark.parametrize("tail", [MALFORMED["two-lengths"], MALFORMED["no-host"], b"GARBAGE \x00\x01\xff\r\n\r\n",
                                  MALFORMED["head-past-16-kib"]],
                         ids=["two-lengths", "no-host", "garbage", "head-past-16-kib"])
def test_a_malformed_request_pipelined_behind_a_stream_gets_its_400_after_it(server: Any, tail: bytes) -> None:
    """The stream first, whole; then the 400 in the envelope, not a silent close (a hostile review)."""
    sock = connect(server)
    sock.sendall(b"POST /v1/stream HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(GENERATE), GENERATE) + tail)
    raw = read_until_closed(sock)
    sock.close()
    first, _, rest = raw.partition(b"event: done")
    assert first.startswith(b"HTTP/1.1 200 ") and rest, raw[:300]
    assert b"HTTP/1.1 400 " in rest and b'"invalid_request"' in rest, rest[-300:]


@pytest.mark.parametrize("path", ["/v1/stream", "/healthz"])
def test_a_websocket_upgrade_is_answered_as_plain_http_in_the_envelope(
    server: Any, path: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The service speaks HTTP and SSE only: an upgrade to WebSocket is a request like any other
    (no 101, no bare 403 from a WebSocket library the service never uses), and its answer is the
    route's own, in the JSON envelope where it is an error."""
    sock = connect(server)
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: Upgrade, close\r\nUpgrade: websocket\r\n"
                 "Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n".encode())  # fmt: skip
    raw = read_until_closed(sock)
    sock.close()
    status, body, headers = status_and_body(raw)
    if path == "/healthz":
        assert status == 200
    else:
        assert status == 405 and headers["content-type"] == "application/json", raw
        assert body["error"]["type"] == "method_not_allowed"
    assert "WebSocket library" not in caplog.text  # uvicorn's advice to install one is dropped
