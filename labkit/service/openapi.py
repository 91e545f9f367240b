"""What the OpenAPI schema says each route answers, so that the schema and the service agree.

Routes pass these as ``responses=``. Every refusal is documented with the one envelope the
service sends (:class:`ErrorBody`), which also replaces FastAPI's default 422 (a ``{"detail":
[...]}`` body the service never sends); streams are documented as ``text/event-stream``.
``tests/test_service_openapi.py`` holds the two to each other with a schema-driven fuzz.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from labkit.service.responses import SSE_MEDIA_TYPE

Responses = dict[int | str, dict[str, Any]]


class ErrorDetail(BaseModel):
    type: str
    message: str


class ErrorBody(BaseModel):
    """``{"error": {"type", "message"}}``: every refusal, whatever refused it."""

    error: ErrorDetail


_WHY = {
    404: "Nothing by that name (unknown, or expired).",
    410: "What was asked for existed but is gone.",
    413: "The body is larger than the server's limit.",
    415: "The body is not sent as JSON (Content-Type: application/json), or is compressed (Accept-Encoding: identity).",
    422: "The request can never be served as written (invalid_request, prompt_too_long).",
    429: "The waiting list is full, or a deadline_s cannot be met (deadline_unreachable); Retry-After says when to try again.",
    503: "The server is draining or shutting down; Retry-After says when to try again.",
}


def refusals(*statuses: int) -> Responses:
    """``responses=`` for these statuses, each answered with an :class:`ErrorBody`."""
    return {status: {"model": ErrorBody, "description": _WHY[status]} for status in statuses}


def event_schema(names: list[str], numbered: bool) -> dict[str, Any]:
    """One server-sent event as a parsed object (before OpenAPI 3.2, a stream's ``schema`` is
    that of each event): its name, its data (JSON, or ``[DONE]``) and, if ``numbered``, its id."""
    properties: dict[str, Any] = {"event": {"enum": names}, "data": {"type": "string", "minLength": 1}}
    if numbered:
        properties["id"] = {"type": "string", "pattern": "^[1-9][0-9]*$"}
    return {"type": "object", "required": list(properties), "properties": properties}


LAB_EVENT = event_schema(["start", "token", "done", "error"], numbered=True)  # see labkit.schema
OPENAI_EVENT = event_schema(["message"], numbered=False)  # unnamed JSON chunks, then [DONE]


def sse(description: str, event: dict[str, Any], also_json: bool = False) -> Responses:
    """``responses=`` for a 200 that is a stream of server-sent events (or, also, a JSON object)."""
    content: dict[str, Any] = {SSE_MEDIA_TYPE: {"schema": event}}
    if also_json:
        content = {"application/json": {"schema": {"type": "object"}}, **content}
    return {200: {"description": description, "content": content}}


BODY_REFUSALS = refusals(413, 415, 422, 429, 503)  # what any route that submits a request may answer
LAB_STREAM = {
    **sse("Server-sent events: start, token..., done | error (see labkit.schema).", LAB_EVENT),
    **BODY_REFUSALS,
}
OPENAI_ANSWER = {
    **sse(
        "The whole answer as JSON, or with stream: true server-sent events of JSON chunks ending with data: [DONE].",
        OPENAI_EVENT,
        also_json=True,
    ),
    **BODY_REFUSALS,
}
RESUME = {
    **sse("The events after the cursor, then the live stream to its end.", LAB_EVENT),
    204: {"description": "The stream finished and nothing is after the cursor."},
    **refusals(404, 410, 422),
}
HEALTH = refusals(503)
