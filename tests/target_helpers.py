"""Servers for the target tests, all on 127.0.0.1: a real ``labkit serve`` process, and small stubs.

The stub speaks OpenAI's streaming completions the way some servers do: no ``data: [DONE]``, no
usage in streams whatever ``stream_options`` says, ``ignore_eos`` refused with a 400, and the
model "ends" after three tokens unless ``min_tokens`` asks for more. The other stubs are a web
server that is not an API at all, and an API whose completions fail with 500.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route

REPO = Path(__file__).resolve().parents[1]
STUB_MODEL = "stub-model"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def uvicorn_in_thread(app: Any) -> Iterator[str]:
    """``app`` served by a real uvicorn on a free loopback port; yields its URL; stops it after."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, name="stub-uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the stub server did not start"
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
        assert not thread.is_alive(), "the stub server did not stop"


# --------------------------------------------------------------------------- the quirky stub


async def _models(request: Request) -> Response:
    return JSONResponse({"object": "list", "data": [{"id": STUB_MODEL, "object": "model"}]})


async def _completions(request: Request) -> Response:
    body = await request.json()
    if body.get("model", STUB_MODEL) != STUB_MODEL:
        return JSONResponse({"error": {"message": f"The model `{body['model']}` does not exist.",
                                       "type": "NotFoundError"}}, status_code=404)
    if "ignore_eos" in body:
        return JSONResponse({"error": {"message": "Unrecognized request argument: ignore_eos",
                                       "type": "invalid_request_error"}}, status_code=400)
    limit = int(body.get("max_tokens", 16))
    made = min(limit, max(3, int(body.get("min_tokens", 0))))
    finish = "length" if made == limit else "stop"
    if not body.get("stream"):
        return JSONResponse({"choices": [{"index": 0, "text": "tok " * made, "finish_reason": finish}],
                             "usage": {"prompt_tokens": 4, "completion_tokens": made, "total_tokens": 4 + made}})

    async def chunks() -> Any:
        for _ in range(made):
            await asyncio.sleep(0.002)
            yield _chunk("tok ", None)
        yield _chunk("", finish)  # and then nothing: no usage, no [DONE]

    return StreamingResponse(chunks(), media_type="text/event-stream")


def _chunk(text: str, finish: str | None) -> bytes:
    payload = {"id": "cmpl-stub", "object": "text_completion", "model": STUB_MODEL,
               "choices": [{"index": 0, "text": text, "finish_reason": finish}]}
    return f"data: {json.dumps(payload)}\n\n".encode()


def quirky_stub(api_key: str | None = None) -> Starlette:
    """The quirky stub; with ``api_key``, every request without ``Authorization: Bearer KEY`` gets 401."""
    def guarded(handler: Any) -> Any:
        async def check(request: Request) -> Response:
            if api_key is not None and request.headers.get("authorization") != f"Bearer {api_key}":
                return JSONResponse({"error": {"message": "Incorrect API key provided.",
                                               "type": "invalid_request_error"}}, status_code=401)
            return await handler(request)
        return check

    return Starlette(routes=[Route("/v1/models", guarded(_models)),
                             Route("/v1/completions", guarded(_completions), methods=["POST"])])


# --------------------------------------------------------------------------- a batching stub


class BatchingStub:
    """Streams whose every token takes longer the more streams are generating, like one batch.

    Each request generates in a task of its own; ``stops_on_disconnect`` decides whether a client
    that leaves cancels that task, or whether it runs on to ``max_tokens`` for nobody.
    """

    BASE_S, PER_STREAM_S = 0.002, 0.005

    def __init__(self, stops_on_disconnect: bool) -> None:
        self.stops_on_disconnect, self.generating = stops_on_disconnect, 0

    async def _generate(self, limit: int, queue: asyncio.Queue) -> None:
        self.generating += 1
        try:
            for _ in range(limit):
                await asyncio.sleep(self.BASE_S + self.PER_STREAM_S * self.generating)
                queue.put_nowait(_chunk("tok ", None))
            queue.put_nowait(_chunk("", "length"))
            queue.put_nowait(b"data: [DONE]\n\n")
        finally:
            self.generating -= 1

    async def completions(self, request: Request) -> Response:
        body = await request.json()
        queue: asyncio.Queue = asyncio.Queue()
        task = asyncio.ensure_future(self._generate(int(body.get("max_tokens", 16)), queue))

        async def chunks() -> Any:
            try:
                while (item := await queue.get()) is not None:
                    yield item
                    if item.startswith(b"data: [DONE]"):
                        return
            finally:
                if self.stops_on_disconnect:
                    task.cancel()

        return StreamingResponse(chunks(), media_type="text/event-stream")

    def app(self) -> Starlette:
        return Starlette(routes=[Route("/v1/models", _models),
                                 Route("/v1/completions", self.completions, methods=["POST"])])


# --------------------------------------------------------------------------- servers that are not targets


async def _web_page(request: Request) -> Response:
    return HTMLResponse("<html><body><h1>Not Found</h1><p>This is a web site.</p></body></html>", status_code=404)


def web_site() -> Starlette:
    """Answers every path, any method, with an HTML 404: a server that speaks no API."""
    return Starlette(routes=[Route("/{path:path}", _web_page, methods=["GET", "POST"])])


async def _broken(request: Request) -> Response:
    return JSONResponse({"error": {"message": "CUDA out of memory", "type": "server_error"}}, status_code=500)


def broken_api() -> Starlette:
    """Lists a model but fails every completion with a 500."""
    return Starlette(routes=[Route("/v1/models", _models), Route("/v1/completions", _broken, methods=["POST"])])


# --------------------------------------------------------------------------- a real labkit serve


@contextlib.contextmanager
def labkit_serve_process(*args: str) -> Iterator[tuple[str, subprocess.Popen]]:
    """``labkit serve --model tiny-gpt2`` as its own process on a free loopback port; SIGINT at the end."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", "labkit.cli", "serve", "--model", "tiny-gpt2", "--port", str(port),
            "--log-level", "warning", *args]
    proc = subprocess.Popen(argv, cwd=REPO, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while not _answers(url):
            assert proc.poll() is None, f"labkit serve exited with {proc.returncode}"
            assert time.monotonic() < deadline, "labkit serve did not start within 120 s"
            time.sleep(0.1)
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _answers(url: str) -> bool:
    try:
        return httpx.get(url + "/v1/models", timeout=1, trust_env=False).status_code == 200
    except httpx.HTTPError:
        return False
