"""A hostile server on 127.0.0.1 for the lab's client: it answers every request with one canned
misbehaviour, byte by byte as written, and stops (its thread joined) when the block ends.

Each behaviour is a coroutine writing to the socket; every one is bounded in time and bytes, so
a client that fails to stop reading is what the test sees, never a server that runs forever.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import socket
import struct
import threading
import zlib
from collections.abc import Awaitable, Callable, Iterator

Writer = asyncio.StreamWriter
Behaviour = Callable[[Writer], Awaitable[None]]
SSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


def completion_chunk(text: str) -> bytes:
    payload = {"choices": [{"index": 0, "text": text, "finish_reason": None}]}
    return f"data: {json.dumps(payload)}\n\n".encode()


async def endless_stream(w: Writer, limit: int = 512 << 20) -> None:
    """An SSE stream that never ends (up to ``limit`` bytes, as fast as the client takes them)."""
    w.write(SSE_HEAD)
    piece = chunk(completion_chunk("x" * 4000) * 16)
    sent = 0
    while sent < limit:
        w.write(piece)
        sent += len(piece)
        await w.drain()


async def huge_json(w: Writer, size: int = 256 << 20) -> None:
    w.write(f"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {size}\r\n\r\n".encode())
    w.write(b'{"data": [')
    block = b'{"id": "m"},' * 50_000
    sent = 0
    while sent < size:
        w.write(block)
        sent += len(block)
        await w.drain()


@functools.lru_cache(maxsize=1)
def bomb() -> bytes:
    """gzip of 512 MiB of zeros, made a megabyte at a time (the server must not hold the bomb)."""
    packer, zeros = zlib.compressobj(9, zlib.DEFLATED, 31), bytes(1 << 20)
    return b"".join(packer.compress(zeros) for _ in range(512)) + packer.flush()


async def gzip_bomb(w: Writer) -> None:
    """Half a megabyte of gzip that inflates to half a gigabyte, sent whatever was asked."""
    body = bomb()
    w.write(f"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-encoding: gzip\r\n"
            f"content-length: {len(body)}\r\n\r\n".encode())
    w.write(body)
    await w.drain()


async def trickle_json(w: Writer, seconds: float = 60.0) -> None:
    """A JSON answer one byte every 0.2 s: each byte would reset a per-read timeout."""
    w.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 1000\r\n\r\n")
    for _ in range(int(seconds / 0.2)):
        w.write(b" ")
        await w.drain()
        await asyncio.sleep(0.2)


async def trickle_stream(w: Writer, seconds: float = 60.0) -> None:
    w.write(SSE_HEAD)
    for _ in range(int(seconds / 0.2)):
        w.write(chunk(b": .\n"))
        await w.drain()
        await asyncio.sleep(0.2)


async def cut_mid_chunk(w: Writer) -> None:
    """Three completion chunks, then half of a fourth HTTP chunk, then the connection closes."""
    w.write(SSE_HEAD + b"".join(chunk(completion_chunk("tok ")) for _ in range(3)))
    w.write(b"40\r\ndata: {\"choi")
    await w.drain()


async def reset_mid_head(w: Writer) -> None:
    """Half a head, then RST (``SO_LINGER`` 0)."""
    w.write(b"HTTP/1.1 200 OK\r\nContent-Ty")
    await w.drain()
    await asyncio.sleep(0.1)
    w.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    w.transport.abort()


def malformed(payload: bytes) -> Behaviour:
    """A well-framed stream whose one event carries ``payload``, then a proper end."""

    async def behave(w: Writer) -> None:
        w.write(SSE_HEAD + chunk(b"event: token\ndata: " + payload + b"\n\n") + chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        await w.drain()

    return behave


async def informational_flood(w: Writer, limit: int = 256 << 20) -> None:
    """Interim 103 answers without end: none of them is the response or its body."""
    piece = b"HTTP/1.1 103 Early Hints\r\nlink: </x>; rel=preload\r\n\r\n" * 1000
    sent = 0
    while sent < limit:
        w.write(piece)
        sent += len(piece)
        await w.drain()


async def cut_after_ids(w: Writer) -> None:
    """Three labkit events with ids 1-3, then half of a fourth HTTP chunk, then the connection closes."""
    events = (f'id: {i}\nevent: token\ndata: {{"index": {i - 1}, "id": 7, "text": "x"}}\n\n'.encode() for i in (1, 2, 3))
    w.write(SSE_HEAD + b"".join(chunk(e) for e in events))
    w.write(b"40\r\nid: 4\nevent: tok")
    await w.drain()


async def redirect(w: Writer) -> None:
    w.write(b"HTTP/1.1 302 Found\r\nlocation: http://elsewhere.example:8080/v1/completions\r\ncontent-length: 0\r\n\r\n")
    await w.drain()


def canned(head: str, body: bytes = b"", hold_s: float = 5.0) -> Behaviour:
    """One answer as given: the head's lines (CRLF added), then ``body`` as it goes on the wire;
    the connection then stays open ``hold_s`` seconds (or until the server stops). Closing at once
    would reset it (the request's body is unread), and a reset can outrun a slow client's reading."""

    async def behave(w: Writer) -> None:
        w.write(head.replace("\n", "\r\n").encode() + b"\r\n\r\n" + body)
        await w.drain()
        await asyncio.sleep(hold_s)

    return behave


def sse_body(*payloads: str) -> bytes:
    """Chunked SSE: one ``data:`` event per payload, then the end of the body."""
    return b"".join(chunk(f"data: {p}\n\n".encode()) for p in payloads) + b"0\r\n\r\n"


async def silent(w: Writer) -> None:
    """Takes the request and never answers (the handler's own bound ends it)."""
    await asyncio.sleep(60)


@contextlib.contextmanager
def hostile(behaviour: Behaviour) -> Iterator[str]:
    """A server answering every request with ``behaviour``; yields its URL."""
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    box: dict[str, object] = {}

    async def handle(reader: asyncio.StreamReader, writer: Writer) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            await asyncio.wait_for(behaviour(writer), 120)
        except (TimeoutError, OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()

    async def serve() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        box["port"] = server.sockets[0].getsockname()[1]
        box["server"] = server
        ready.set()
        async with server:
            await server.serve_forever()

    thread = threading.Thread(target=_run, args=(loop, serve), name="hostile", daemon=True)
    thread.start()
    assert ready.wait(10), "the hostile server did not start"
    try:
        yield f"http://127.0.0.1:{box['port']}"
    finally:
        loop.call_soon_threadsafe(lambda: [t.cancel() for t in asyncio.all_tasks(loop)])
        thread.join(10)
        assert not thread.is_alive(), "the hostile server did not stop"


def _run(loop: asyncio.AbstractEventLoop, serve: Callable[[], Awaitable[None]]) -> None:
    asyncio.set_event_loop(loop)
    with contextlib.suppress(asyncio.CancelledError):
        loop.run_until_complete(serve())
    loop.run_until_complete(asyncio.gather(*asyncio.all_tasks(loop), return_exceptions=True))
    loop.close()
