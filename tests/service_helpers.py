"""Helpers for hub and service tests: a checked server, SSE readers, a raw-socket client, and a
fake engine for testing the hub without a model.

``lab_server`` wraps ``serve_in_thread`` with the checks every service test ends with: streams
closed and blocks released while the server still runs (no leak hidden by shutdown), the cache
whole after it stops, and no thread left behind. Meanwhile the heap is frozen, as ``labkit serve``
freezes its own (:func:`heap_frozen`).
"""
from __future__ import annotations

import asyncio
import gc
import json
import socket
import struct
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import h11
import httpx
import httpx_sse
from prompt_lists import SERVICE_PROMPTS

from labkit.engine.events import FinishEvent, TokenEvent, Usage
from labkit.hub import Hub, HubConfig
from labkit.hub.stream import Item, Stream
from labkit.schema import decode_event
from labkit.server import RunningServer, serve_in_thread
from labkit.sse import SSEParser

PROMPTS = SERVICE_PROMPTS  # handed on under the name the tests use
TIMEOUT = 30.0  # generous liveness bound; no test asserts speed
Event = tuple[str, dict[str, Any], str]  # (type, payload, id)


def healthy(url: str) -> bool:
    """Whether a server answers /healthz with 200 now (False while it starts or after it stops)."""
    try:
        return httpx.get(url + "/healthz", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def wait_until(predicate: Callable[[], Any], timeout: float = TIMEOUT, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.01)


def engine_idle(server: RunningServer) -> bool:
    stats = server.engine.stats()
    return stats["running"] == 0 and stats["waiting"] == 0 and stats["reserved_blocks"] == 0


def settle(server: RunningServer) -> None:
    """Every stream closed and every block back, with the server still running."""
    wait_until(lambda: server.hub.open_streams == 0, what="all streams to close")
    wait_until(lambda: engine_idle(server), what="the engine to release every block")


_servers_frozen = 0  # lab_servers open in this process now: the outermost freezes and unfreezes


@contextmanager
def heap_frozen() -> Iterator[None]:
    """The objects alive now, out of the collector's reach until the block ends: what
    ``labkit serve`` does at start (``server.freeze_heap``). A server in this process shares the
    test worker's heap (the models, torch, every test module: about 550,000 objects), and one full
    collection walks it with the GIL held: a 0.3-0.7 s stall of every stream, which a test would
    charge to the server (a gap, a send or stall timer firing). Objects made later are collected
    as ever; no collection first, as freeze_heap makes, which would cost 0.3 s per server."""
    global _servers_frozen
    _servers_frozen += 1
    if _servers_frozen == 1:
        gc.freeze()
    try:
        yield
    finally:
        _servers_frozen -= 1
        if _servers_frozen == 0:
            gc.unfreeze()


@contextmanager
def lab_server(model: Any, *, check_settled: bool = True, **settings: Any) -> Iterator[RunningServer]:
    before = set(threading.enumerate())
    with heap_frozen(), serve_in_thread(model, **settings) as server:
        yield server
        if check_settled:
            settle(server)
            server.hub.check_integrity().result(TIMEOUT)  # on the step thread, between two steps
    server.hub.check_integrity().result(TIMEOUT)  # the step thread has stopped: it runs here
    assert engine_idle(server), server.engine.stats()
    assert server.hub.open_streams == 0
    # tqdm's monitor is the progress bars' one thread per process, started by the first bar that runs
    wait_until(lambda: not {t for t in set(threading.enumerate()) - before if t.name != "tqdm_monitor"}, timeout=5,
               what="no thread left behind")


def occupy_a_slot(server: RunningServer, max_new_tokens: int = 200, tries: int = 3) -> RawClient:
    """A running stream paused in the engine: it keeps its batch slot until its client leaves.

    It is paused only once its first token exists, i.e. once it has been admitted: a request
    paused while still waiting would be stepped over, and the slot given to the next one. The
    pause is a wish the step thread applies at a step boundary, so a stream may finish before it
    lands (a test thread starved on a busy machine while a small model runs its tokens): then
    another stream takes its place, up to ``tries``, and the wait is for the pause or the end.
    """
    live = server.engine.scheduler.live
    for _ in range(tries):
        paused = server.engine.stats()["paused"]
        client = RawClient(server.url).post("/v1/stream", {"prompt": "Hello", "max_new_tokens": max_new_tokens})
        events = client.read_events(2)
        assert events[1][0] == "token", events
        rid = events[0][1]["request_id"]
        server.engine.pause(rid)
        wait_until(lambda p=paused, r=rid: server.engine.stats()["paused"] == p + 1 or r not in live, what="the pause")
        if server.engine.stats()["paused"] == paused + 1:
            return client
        client.close_rst()  # it ended before the pause landed: its slot is free again
    raise AssertionError(f"{tries} streams of {max_new_tokens} tokens each ended before their pause landed")


# -- reading streams with httpx-sse ------------------------------------------------------------
def sse_post(client: httpx.Client, path: str, body: dict[str, Any]) -> tuple[httpx.Response, list[Event]]:
    """POST, read the whole stream with httpx-sse, decode each event with the lab schema."""
    with httpx_sse.connect_sse(client, "POST", path, json=body) as source:
        events = [decode_event_sse(sse) for sse in source.iter_sse()]
        return source.response, events


def decode_event_sse(sse: httpx_sse.ServerSentEvent) -> Event:
    from labkit.sse import ParsedEvent

    kind, payload = decode_event(ParsedEvent(event=sse.event, data=sse.data, id=sse.id))
    return kind, payload, sse.id


def tokens_of(events: list[Event]) -> list[int]:
    return [p["id"] for kind, p, _ in events if kind == "token"]


def text_of(events: list[Event]) -> str:
    return "".join(p["text"] for kind, p, _ in events if kind == "token")


# -- a raw-socket client ------------------------------------------------------------------------
class RawClient:
    """HTTP/1.1 over a plain socket (h11), so a test controls reading and how the socket closes.

    ``rcvbuf`` caps the client's receive buffer (set before connecting, which also turns off
    Linux's autotuning). ``decode=False`` keeps the body as raw bytes only. ``local`` is the
    address to connect from.
    """

    def __init__(self, base_url: str, rcvbuf: int | None = None, decode: bool = True, local: str | None = None) -> None:
        parts = urlsplit(base_url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if local is not None:  # another client on the same loopback: 127.0.0.2, say
            self.sock.bind((local, 0))
        if rcvbuf is not None:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self.sock.settimeout(TIMEOUT)
        self.sock.connect((self.host, self.port))
        self.conn = h11.Connection(h11.CLIENT)
        self.parser = SSEParser()
        self.status: int | None = None
        self.headers: dict[str, str] = {}
        self.body = bytearray()
        self.events: list[Event] = []
        self.raw = bytearray()  # the body bytes as received (for pings and padding)
        self.ended = False
        self.decode = decode  # parse the body as lab SSE events; False keeps only the raw bytes

    def post(self, path: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> RawClient:
        return self.request("POST", path, json.dumps(body).encode(), headers)

    def request(self, method: str, path: str, data: bytes = b"", headers: dict[str, str] | None = None) -> RawClient:
        all_headers = [("Host", f"{self.host}:{self.port}"), ("Content-Length", str(len(data)))]
        if data:
            all_headers.append(("Content-Type", "application/json"))
        all_headers += list((headers or {}).items())
        out = self.conn.send(h11.Request(method=method, target=path, headers=all_headers))
        out += self.conn.send(h11.Data(data=data)) + self.conn.send(h11.EndOfMessage())
        self.sock.sendall(out)
        return self

    def read_head(self) -> RawClient:
        self._pump(lambda: self.status is not None)
        return self

    def read_events(self, count: int) -> list[Event]:
        """Read until ``count`` events in all have arrived (or the response ended)."""
        self._pump(lambda: len(self.events) >= count)
        return self.events

    def read_to_end(self) -> list[Event]:
        self._pump(lambda: False)
        return self.events

    def read_until(self, done: Callable[[], bool]) -> RawClient:
        self._pump(done)
        return self

    def _pump(self, done: Callable[[], bool]) -> None:
        while not done() and not self.ended:
            event = self.conn.next_event()
            if event is h11.NEED_DATA:
                self.conn.receive_data(self.sock.recv(65536))
            elif isinstance(event, h11.Response):
                self.status = event.status_code
                self.headers = {k.decode().lower(): v.decode() for k, v in event.headers}
            elif isinstance(event, h11.Data):
                self._on_body(bytes(event.data))
            elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                self.ended = True

    def _on_body(self, data: bytes) -> None:
        self.raw += data
        if not self.decode:
            return
        if self.headers.get("content-type", "").startswith("text/event-stream"):
            for parsed in self.parser.feed(data):
                kind, payload = decode_event(parsed)
                self.events.append((kind, payload, parsed.id))
        else:
            self.body += data

    def json(self) -> Any:
        return json.loads(bytes(self.body))

    def close_fin(self) -> None:
        """A clean close: FIN, then release the socket."""
        try:
            self.sock.shutdown(socket.SHUT_WR)
        finally:
            self.sock.close()

    def close_rst(self) -> None:
        """An abortive close: SO_LINGER 0 makes close() send RST instead of FIN."""
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.sock.close()

    def close(self, how: str) -> None:
        self.close_fin() if how == "fin" else self.close_rst()


# -- the hub without HTTP: a fake engine and an event loop ------------------------------------
@dataclass
class FakeRequest:
    max_new: int
    made: int = 0
    admitted: bool = False
    paused: bool = False


class FakeEngine:
    """One token per step for every running, unpaused request. ``hold`` keeps a step open right
    after its prefills; ``fail`` makes the next step raise; at most ``slots`` requests are
    admitted at once (None: all)."""

    def __init__(self, slots: int | None = None) -> None:
        self.slots = slots
        self.cond = threading.Condition()
        self.inbox: list[tuple[str, str, int]] = []
        self.requests: dict[str, FakeRequest] = {}
        self.calls: list[tuple[str, str]] = []
        self.hold: threading.Event | None = None
        self.holding = threading.Event()
        self.fail = False
        self.steps = 0
        self.stepping = False
        self.checks = 0

    def submit(self, prompt: Any, *, max_new_tokens: int = 64, request_id: str | None = None, **_: Any) -> str:
        rid = request_id or f"fake-{len(self.calls)}"
        self._put("submit", rid, max_new_tokens)
        return rid

    def cancel(self, rid: str) -> None:
        self._put("cancel", rid)

    def pause(self, rid: str) -> None:
        self._put("pause", rid)

    def resume(self, rid: str) -> None:
        self._put("resume", rid)

    def _put(self, verb: str, rid: str, max_new: int = 0) -> None:
        with self.cond:
            self.inbox.append((verb, rid, max_new))
            self.calls.append((verb, rid))
            self.cond.notify_all()

    def has_work(self) -> bool:
        admitted = sum(r.admitted for r in self.requests.values())
        can_admit = self.slots is None or admitted < self.slots
        return bool(self.inbox) or any(not r.paused and (r.admitted or can_admit) for r in self.requests.values())

    def wait_for_work(self, timeout: float) -> bool:
        with self.cond:
            return self.cond.wait_for(self.has_work, timeout)

    def check_integrity(self) -> None:
        """Counts the checks; raises if one ever runs while a step is running (a race)."""
        assert not self.stepping, "check_integrity ran during a step"
        self.checks += 1

    def step(self, on_event: Callable[[Any], None] | None = None) -> list[Any]:
        self.stepping = True
        try:
            return self._step(on_event)
        finally:
            self.stepping = False

    def _step(self, on_event: Callable[[Any], None] | None) -> list[Any]:
        events: list[Any] = []

        def emit(event: Any) -> None:
            events.append(event)
            if on_event is not None:
                on_event(event)

        if self.fail:
            raise RuntimeError("boom")
        self._apply_inbox(emit)
        room = len(self.requests) if self.slots is None else self.slots - sum(r.admitted for r in self.requests.values())
        fresh = [(rid, r) for rid, r in self.requests.items() if not r.admitted and not r.paused][:max(0, room)]
        for rid, req in fresh:
            req.admitted = True
            self._token(rid, req, emit)
        if fresh and self.hold is not None:
            self.holding.set()
            self.hold.wait(TIMEOUT)
            self.holding.clear()
        for rid, req in list(self.requests.items()):
            if req.admitted and not req.paused and (rid, req) not in fresh:
                self._token(rid, req, emit)
        self.steps += 1
        time.sleep(0.001)
        return events

    def _apply_inbox(self, emit: Callable[[Any], None]) -> None:
        with self.cond:
            inbox, self.inbox = self.inbox, []
        for verb, rid, max_new in inbox:
            if verb == "submit":
                self.requests[rid] = FakeRequest(max_new)
            elif rid in self.requests and verb == "cancel":
                req = self.requests.pop(rid)
                emit(FinishEvent(rid, "cancelled", Usage(3, req.made), time.perf_counter()))
            elif rid in self.requests:
                self.requests[rid].paused = verb == "pause"

    def _token(self, rid: str, req: FakeRequest, emit: Callable[[Any], None]) -> None:
        emit(TokenEvent(rid, req.made, 100 + req.made, f"t{req.made} ", time.perf_counter()))
        req.made += 1
        if req.made >= req.max_new:
            del self.requests[rid]
            emit(FinishEvent(rid, "length", Usage(3, req.made), time.perf_counter()))


@asynccontextmanager
async def running_hub(engine: Any, **config: Any) -> AsyncIterator[Hub]:
    hub = Hub(engine, HubConfig(**config))
    hub.start()
    try:
        yield hub
    finally:
        await hub.aclose()


def run(body: Callable[[], Awaitable[None]]) -> None:
    """Run an async test body; afterwards no thread of its may be left."""
    before = set(threading.enumerate())
    asyncio.run(asyncio.wait_for(body(), TIMEOUT))
    assert not set(threading.enumerate()) - before


async def read_all(stream: Stream) -> list[Item]:
    items: list[Item] = []
    while True:
        item = await stream.get(TIMEOUT)
        assert item is not None, f"stream stalled after {len(items)} items"
        items.append(item)
        if not isinstance(item, TokenEvent):
            return items


async def eventually(predicate: Callable[[], Any], what: str) -> None:
    for _ in range(int(TIMEOUT / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def indices(items: list[Item]) -> list[int]:
    return [i.index for i in items if isinstance(i, TokenEvent)]
