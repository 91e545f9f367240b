"""Refusals as JSON: every error body the service sends is ``{"error": {"type", "message"}}``.

FastAPI's own 422 (``{"detail": [...]}``) and Starlette's 404/405 bodies are replaced by the
same envelope, so a client handles a refused request one way whatever refused it. The types a
stream can also carry in-band come from :data:`labkit.schema.ERROR_TYPES`; a few that only an
HTTP status can carry (``not_found``, ``gone``, ...) are added here.

A refusal never quotes a client's input at length (values are cut by :func:`labkit.schema.clip`,
messages by the envelope, and a validation error lists at most :data:`MAX_PROBLEMS` problems),
and a failure that is not a refusal says ``internal error`` and nothing else: exception names
and messages go to the log, not to the client (:mod:`labkit.service.openapi` documents the
envelope for each route's statuses).
"""

from __future__ import annotations

import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from labkit.errors import InvalidRequest, LabkitError, PromptTooLong, QueueFull
from labkit.hub import Draining
from labkit.schema import ERROR_TYPES, clip, error_envelope

HTTP_ONLY_TYPES = frozenset(
    {
        "not_found",
        "gone",
        "method_not_allowed",
        "payload_too_large",
        "unsupported_media_type",
        "http_error",
        "request_timeout",
        "over_capacity",
        "invalid_host",
        "deadline_unreachable",
        "unauthorized",
        "store_unavailable",
    }
)
INTERNAL = "internal error"  # all a client learns of a failure that is not its fault
MAX_PROBLEMS = 5  # validation problems listed in one message; the rest are counted


class ServiceError(LabkitError):
    """A refusal with its status and type, raised by routes before the first byte."""

    def __init__(self, status: int, type: str, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.type, self.message, self.headers = status, type, message, headers or {}


def envelope(type: str, message: str) -> dict[str, Any]:
    return error_envelope(type, message, ERROR_TYPES | HTTP_ONLY_TYPES)


def public_message(type: str, message: str) -> str:
    """What a client may read of an error: an ``internal_error``'s own message (an exception's
    name and text, from the step thread) stays in the log."""
    return INTERNAL if type == "internal_error" else message


def error_response(status: int, type: str, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(envelope(type, message), status_code=status, headers=headers)


class BodyLimit:
    """413 in the envelope for a request body over ``limit`` bytes, before any route reads it.

    A declared ``Content-Length`` is refused before a byte of the body is read; a chunked body is
    counted as it arrives. (Starlette's own limit answers in plain text, hence this one.)
    """

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isascii() and declared.isdigit() and int(declared) > self.limit:
            return await error_response(413, "payload_too_large", self._message())(scope, receive, send)
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:  # re-raised by FastAPI's body reader, enveloped by on_http
                    raise StarletteHTTPException(413, self._message())
            return message

        await self.app(scope, counted, send)

    def _message(self) -> str:
        return f"the request body is larger than {self.limit} bytes"


def as_service_error(exc: Exception, retry_after_s: int = 1) -> ServiceError:
    """Map labkit's named errors to HTTP: 422, 429 with Retry-After, 503 with Retry-After."""
    if isinstance(exc, ServiceError):
        return exc
    if isinstance(exc, PromptTooLong):
        return ServiceError(422, "prompt_too_long", str(exc))
    if isinstance(exc, InvalidRequest):
        return ServiceError(422, "invalid_request", str(exc))
    if isinstance(exc, QueueFull):
        return ServiceError(429, "queue_full", str(exc), {"Retry-After": str(retry_after_s)})
    if isinstance(exc, Draining):
        return ServiceError(503, "draining", str(exc), {"Retry-After": str(retry_after_s)})
    return ServiceError(500, "internal_error", INTERNAL)


def describe_validation(exc: RequestValidationError) -> str:
    """One readable line per problem: ``body.max_new_tokens: Input should be a valid integer``;
    the first :data:`MAX_PROBLEMS` of them, each place cut short (a key can be the client's)."""
    errors = list(exc.errors())
    parts = list(dict.fromkeys(_problem(err) for err in errors[:MAX_PROBLEMS]))  # union branches repeat
    if len(errors) > MAX_PROBLEMS:
        parts.append(f"and {len(errors) - MAX_PROBLEMS} more problems")
    return "; ".join(parts) or "invalid request"


# Places pydantic adds for the branches of a union and for validator functions: internal names
# (``function-after[functools.partial(<function ...>)]``), not places in the body.
_BRANCH = re.compile(
    r"^(function-\w+\[.*|constrained-\w+|json-or-python\[.*|lax-or-strict\[.*|"
    r"(str|int|float|bool|none|is-instance|literal|list|dict|tuple|union)(\[.*\])?)$"
)


def _problem(err: Any) -> str:
    if err.get("type") == "json_invalid":
        return f"invalid JSON: {clip(err.get('ctx', {}).get('error', err.get('msg')), 120)}"
    where = ".".join(clip(p) for p in err.get("loc", ()) if not (isinstance(p, str) and _BRANCH.match(p)))
    message = clip(err.get("msg"), 120)
    return f"{where}: {message}" if where else message


def install_error_handlers(app: FastAPI, retry_after_s: int) -> None:
    # Starlette types every handler as taking Exception; each narrows to the class it is installed for.
    async def on_validation(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return error_response(422, "invalid_request", describe_validation(exc))

    async def on_labkit(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, LabkitError)
        err = as_service_error(exc, retry_after_s)
        return error_response(err.status, err.type, err.message, err.headers)

    async def on_http(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        if exc.status_code == 400:  # FastAPI's "error parsing the body" (not UTF-8): invalid JSON, like any other
            return error_response(422, "invalid_request", "invalid JSON: the body is not JSON text in UTF-8")
        kind = {404: "not_found", 405: "method_not_allowed", 413: "payload_too_large"}.get(
            exc.status_code, "http_error"
        )
        return error_response(exc.status_code, kind, str(exc.detail), getattr(exc, "headers", None))

    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        # A bug, not a refusal: still answered in the envelope (Starlette logs the traceback).
        return error_response(500, "internal_error", INTERNAL)

    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(LabkitError, on_labkit)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(Exception, on_unexpected)
