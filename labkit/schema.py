"""The lab's stream schema: which events a generation stream carries, and what each holds.

This docstring is the one place the schema is written down; the README copies the table.

=========  ===================================================  =================================
event      data (compact JSON object)                           when
=========  ===================================================  =================================
``start``  ``{"request_id": str, "model": str,                  first, once
           "prompt_tokens": int}``
``token``  ``{"index": int, "id": int, "text": str}``           once per generated token
``done``   ``{"finish_reason": str, "usage": {"prompt_tokens":  last, on a normal end
           int, "completion_tokens": int}}``
``error``  ``{"error": {"type": str, "message": str}}``         last, instead of ``done``
=========  ===================================================  =================================

Every event carries an SSE ``id:`` equal to its position in the stream: 1, 2, 3, ... Comments
(``: ping``) carry no id and do not advance the count, so a client that read to the end holds a
last event id that matches the count of events. ``index`` in a token event counts tokens from 0;
``text`` is the delta the token adds (possibly empty, when a token holds part of a character).

Why these choices:

* ``error`` uses the same envelope as the service's JSON error bodies. Once the first byte of a
  stream is sent the HTTP status is fixed at 200, so a failure after that can only be an event;
  the envelope is shared so a client handles both the same way. Error types the service uses
  are listed in :data:`ERROR_TYPES`.
* Payloads are JSON, which escapes CR and LF, so text with blank lines in it can never end an
  SSE event early. ``ensure_ascii=False`` keeps non-ASCII text readable and small.
* Every stream ends with ``done`` or ``error``: a stream that stops without one was cut.
* An error message never carries a client's input at length: :func:`clip` cuts an echoed value
  to 64 characters and makes it encodable (a lone surrogate becomes ``\\ud800``), and
  :func:`error_envelope` cuts any message to :data:`MAX_MESSAGE_CHARS`, so a refusal stays small
  whatever was sent.
* Readers are tolerant: :func:`decode_event` checks the keys it needs, ignores extra keys, and
  passes through event types it does not know (with their JSON object) so that new types can be
  added without breaking old clients.
"""

from __future__ import annotations

import json
from typing import Any

from labkit.sse import ParsedEvent, ServerSentEvent

__all__ = [
    "ERROR_TYPES",
    "MAX_MESSAGE_CHARS",
    "clip",
    "start_payload",
    "token_payload",
    "done_payload",
    "error_envelope",
    "StreamEncoder",
    "decode_event",
]

ERROR_TYPES = frozenset(
    {
        "invalid_request",
        "prompt_too_long",
        "queue_full",
        "draining",
        "slow_client",
        "shutdown",
        "internal_error",
        "cancelled",
        "queue_timeout",
    }
)

MAX_MESSAGE_CHARS = 512  # an error message is cut here, whoever built it
ECHO_CHARS = 64  # an input value quoted in a message is cut here


def clip(value: object, limit: int = ECHO_CHARS) -> str:
    """``value`` as text fit to quote in an error: at most ``limit`` characters and then "…", with
    anything UTF-8 cannot carry (a lone surrogate) escaped, so the message can always be sent."""
    text = str(value)
    if len(text) > limit:
        text = text[:limit] + "…"
    if not text.isascii():
        text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


def as_sent(header: str) -> str:
    """A header's value as its sender wrote it: Starlette decodes a header's bytes as Latin-1,
    so "²" would be quoted back as "Â²"; read as UTF-8 here (backslash-escaped where it is not)."""
    return header.encode("latin-1").decode("utf-8", "backslashreplace")


# Required keys and their types, per event type; nested objects are checked one level down.
_REQUIRED: dict[str, dict[str, Any]] = {
    "start": {"request_id": str, "model": str, "prompt_tokens": int},
    "token": {"index": int, "id": int, "text": str},
    "done": {"finish_reason": str, "usage": {"prompt_tokens": int, "completion_tokens": int}},
    "error": {"error": {"type": str, "message": str}},
}


def start_payload(request_id: str, model: str, prompt_tokens: int, resume_token: str | None = None) -> dict[str, Any]:
    """``resume_token`` only in a resumable stream's start, which only its creator receives."""
    payload = {"request_id": request_id, "model": model, "prompt_tokens": prompt_tokens}
    return payload if resume_token is None else {**payload, "resume_token": resume_token}


def token_payload(index: int, token_id: int, text: str) -> dict[str, Any]:
    return {"index": index, "id": token_id, "text": text}


def done_payload(finish_reason: str, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens}
    return {"finish_reason": finish_reason, "usage": usage}


def error_envelope(type: str, message: str, known: frozenset[str] = ERROR_TYPES) -> dict[str, Any]:
    """``{"error": {"type", "message"}}`` with the message clipped to :data:`MAX_MESSAGE_CHARS`;
    a type outside ``known`` is refused to catch typos early."""
    if type not in known:
        raise ValueError(f"unknown error type {type!r}; expected one of {sorted(known)}")
    return {"error": {"type": type, "message": clip(message, MAX_MESSAGE_CHARS)}}


def _dumps(payload: dict[str, Any]) -> str:
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":"))


class StreamEncoder:
    """Turns one stream's events into bytes, numbering them 1, 2, 3, ... as it goes.

    One encoder per stream; every route that streams uses it, so ids and framing cannot drift.
    """

    def __init__(self) -> None:
        self._last_id = 0

    @property
    def last_id(self) -> int:
        """Id of the last event encoded (0 before the first): also the number of events."""
        return self._last_id

    def start(self, request_id: str, model: str, prompt_tokens: int, resume_token: str | None = None) -> bytes:
        return self._event("start", start_payload(request_id, model, prompt_tokens, resume_token))

    def token(self, index: int, token_id: int, text: str) -> bytes:
        return self._event("token", token_payload(index, token_id, text))

    def done(self, finish_reason: str, prompt_tokens: int, completion_tokens: int) -> bytes:
        return self._event("done", done_payload(finish_reason, prompt_tokens, completion_tokens))

    def error(self, type: str, message: str) -> bytes:
        return self._event("error", error_envelope(type, message))

    def comment(self, text: str = "ping") -> bytes:
        """A comment: no id, no event for the client, the counter does not move."""
        return ServerSentEvent(comment=text).encode()

    def _event(self, name: str, payload: dict[str, Any]) -> bytes:
        self._last_id += 1
        return ServerSentEvent(data=_dumps(payload), event=name, id=self._last_id).encode()


def decode_event(event: ParsedEvent) -> tuple[str, dict[str, Any]]:
    """``(type, payload)`` of a parsed event; ``ValueError`` if a known type breaks the schema."""
    try:
        payload = json.loads(event.data)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{event.event} event: data is not JSON: {event.data!r}") from exc
    if not isinstance(payload, dict):
        raise ValueError(f"{event.event} event: data must be a JSON object, got {payload!r}")
    required = _REQUIRED.get(event.event)
    if required is not None:
        _check(payload, required, event.event)
    return event.event, payload


def _check(obj: dict[str, Any], required: dict[str, Any], where: str) -> None:
    for key, expected in required.items():
        if key not in obj:
            raise ValueError(f"{where}: missing key {key!r}")
        value = obj[key]
        if isinstance(expected, dict):
            if not isinstance(value, dict):
                raise ValueError(f"{where}.{key}: expected an object, got {value!r}")
            _check(value, expected, f"{where}.{key}")
        elif isinstance(value, bool) or not isinstance(value, expected):
            raise ValueError(f"{where}.{key}: expected {expected.__name__}, got {value!r}")
