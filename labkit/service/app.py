"""The FastAPI app: routes assembled, errors enveloped, and the hub tied to the app's lifespan.

Routes live in modules named for what they serve: ``streaming`` (``/v1/stream``,
``/v1/generate``), ``openai`` (``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``),
``resume`` (``/v1/streams/{id}/events``), ``lab`` (``/lab/...``, mounted only when
``http.lab_routes`` asks for it); operations (``/stats``, ``/healthz`` or ``/health``, ``/metrics``) are here.
The schema and its pages (``/openapi.json``, ``/docs``, ``/redoc``) only when ``http.docs`` asks.
Every request first passes the guards (an allowed ``Host``, ``Retry-After`` on every 503), the
bearer-token check when ``auth_secret`` is set (:mod:`~labkit.service.auth`) and the body limit;
``gzip`` puts Starlette's compression innermost (:mod:`~labkit.service.compression`). Every route
is ``async def``: a sync route or dependency would run in AnyIO's thread pool, and the lab
promises that it starts no thread but the step thread (and the server's own, in
``serve_in_thread``). The exceptions are the lab routes of :mod:`~labkit.service.lab_threads`,
which exist to show what a sync route costs.

Shutdown happens in two steps. :meth:`Service.drain` runs while uvicorn still serves (see
``labkit.server.LabServer``): new requests get 503, every open stream ends with an ``error`` of
type ``shutdown``. Then the lifespan's end stops resume pumps and joins the step thread.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from labkit.service import auth, lab_demo, lab_routes, lab_threads, openai, openapi, resume, streaming
from labkit.service.compression import add_gzip
from labkit.service.config import ServiceConfig
from labkit.service.errors import BodyLimit, error_response, install_error_handlers
from labkit.service.guards import HostGuard, RetryAfterOn503
from labkit.service.state import Service


def build_app(engine: Any, hub: Any, config: ServiceConfig) -> FastAPI:
    """An app serving ``engine`` through ``hub``; the hub's step thread runs during the lifespan."""
    service = Service(engine, hub, config)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await service.resume.store.ping()  # a resume store that does not answer: the server does not start
        hub.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            await service.aclose()

    docs = config.http.docs  # off by default: the docs pages load their scripts from a CDN
    app = FastAPI(
        title="labkit streamlab",
        version="0.1.0",
        lifespan=lifespan,
        docs_url="/docs" if docs else None,
        redoc_url="/redoc" if docs else None,
        openapi_url="/openapi.json" if docs else None,
        redirect_slashes=False,  # "/v1/stream/" is a 404 in the envelope, not a 307 carrying ?token= along
    )
    add_gzip(app, config.http.gzip)  # first added, so innermost: it sees only what the routes answer
    app.add_middleware(BodyLimit, limit=config.http.max_body_bytes)
    if config.http.auth_secret is not None:  # before the body limit: a request without a token reads nothing
        app.add_middleware(auth.BearerAuth, secret=config.http.auth_secret)
    app.add_middleware(RetryAfterOn503, retry_after_s=config.retry_after_s)
    app.add_middleware(HostGuard, allowed=config.http.allowed_hosts)  # added last: runs first
    app.state.service = service
    install_error_handlers(app, config.retry_after_s)
    for module in (streaming, openai, resume):
        app.include_router(module.router)
    if config.http.lab_routes:
        app.include_router(lab_routes.router)
        app.include_router(lab_demo.router)
        app.include_router(auth.lab_router)
        app.include_router(lab_threads.router)
    _add_operations(app)
    return app


def _add_operations(app: FastAPI) -> None:
    @app.get("/stats")
    async def stats(request: Request) -> dict[str, Any]:
        return request.app.state.service.stats().as_dict()

    # HEAD too: a load balancer's or `curl -I`'s probe (RFC 9110 9.1: a server supports GET and HEAD)
    @app.api_route("/healthz", methods=["GET", "HEAD"], responses=openapi.HEALTH)
    @app.api_route("/health", methods=["GET", "HEAD"], responses=openapi.HEALTH)  # vLLM's, llama.cpp's, GuideLLM's
    async def healthz(request: Request) -> Response:
        service: Service = request.app.state.service
        if service.hub.draining:
            return error_response(503, "draining", "the server is draining")
        if not service.hub.stats().step_thread_alive:
            return error_response(503, "internal_error", "the step thread is not running")
        return JSONResponse({"status": "ok", "model": service.model_name})

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics(request: Request) -> Response:
        body, media_type = request.app.state.service.metrics.render()
        return Response(body, media_type=media_type)
