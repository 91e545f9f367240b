"""Bearer tokens on the ``/v1/`` routes: self-contained, expiring, checked once as a request starts.

Off unless ``HttpConfig.auth_secret`` is set. Then every ``/v1/`` route (the lab's stream and
generate routes, the OpenAI routes, the resume route) needs ``Authorization: Bearer <token>``;
``/healthz``, ``/stats``, ``/metrics`` and the lab routes do not. A token is
``base64url(expiry_ms ":" subject) "." base64url(HMAC-SHA256(secret, first part))``: the server
keeps no list of tokens, so any server holding the same secret (a restarted one, a second
replica) accepts it, and it stops working at its expiry without anyone revoking it.

The check is made once, before the route runs (:class:`BearerAuth`), so a refusal is a 401 in the
JSON envelope before the first byte, with ``WWW-Authenticate`` as RFC 6750 section 3 has it: a
request with no token gets ``Bearer realm="labkit"`` (no error code: it was not told it needed
one), a malformed, forged or expired one ``error="invalid_token"`` too. Because it is made at
the start only, a token that expires while its stream runs does not end the stream; the client
learns of it when it reconnects or resumes with the same token, and gets 401: a reader that
resumes must refresh its token first. The token travels only in the header, never in the URL
(query strings end up in access logs); ``EventSource``, which cannot send headers, cannot use
these routes with auth on, which is why notebook 10's reader is a fetch-style one.

Tokens are minted by :func:`mint_token` (a test or notebook that holds the secret) or, on a lab
server, by ``POST /lab/token?ttl_s=...&subject=...`` (:data:`lab_router`, mounted only with the lab
routes: it hands a token to whoever asks, which only a lab server may do).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import re
import time
from dataclasses import dataclass

from fastapi import APIRouter, Query, Request
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from labkit.errors import LabkitError
from labkit.service.config import MAX_TTL_S
from labkit.service.errors import ServiceError, error_response

PROTECTED_PREFIX = "/v1/"
MAX_TOKEN_CHARS = 512  # longer is not one of ours; refused before any decoding
SUBJECT = re.compile(r"^[A-Za-z0-9_.@-]{1,64}$")  # who the token is for: printable, short, no separator
REALM = 'Bearer realm="labkit"'

lab_router = APIRouter()


class InvalidToken(LabkitError):
    """A token that is malformed, not signed with this secret, or expired; the message says which."""


@dataclass(frozen=True)
class Claims:
    subject: str
    expires: float  # Unix seconds


def mint_token(secret: str, ttl_s: float, subject: str = "lab", *, now: float | None = None) -> str:
    """A token for ``subject`` that expires ``ttl_s`` seconds after ``now`` (default: the clock)."""
    if not SUBJECT.match(subject):
        raise ValueError(f"subject must match {SUBJECT.pattern}, got {subject[:80]!r}")
    if not 0 < ttl_s <= MAX_TTL_S:
        raise ValueError(f"ttl_s must be in (0, {MAX_TTL_S}], got {ttl_s!r}")
    expires_ms = int(((time.time() if now is None else now) + ttl_s) * 1000)
    body = _b64(f"{expires_ms}:{subject}".encode("ascii"))
    return f"{body}.{_sign(secret, body)}"


def verify_token(secret: str, token: str, *, now: float | None = None) -> Claims:
    """The token's claims if this secret signed it and it has not expired; else :class:`InvalidToken`."""
    if len(token) > MAX_TOKEN_CHARS or token.count(".") != 1:
        raise InvalidToken("the token is malformed")
    body, signature = token.split(".")
    # compare_digest on bytes: a str argument with non-ASCII characters would raise TypeError
    if not hmac.compare_digest(signature.encode("utf-8", "replace"), _sign(secret, body).encode("ascii")):
        raise InvalidToken("the token's signature does not match")
    try:
        expires_ms, _, subject = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)).decode("ascii").partition(":")
        expires = int(expires_ms) / 1000
    except (binascii.Error, UnicodeDecodeError, ValueError):  # only a holder of the secret gets here
        raise InvalidToken("the token is malformed") from None
    if (time.time() if now is None else now) >= expires:
        raise InvalidToken("the token expired")
    return Claims(subject, expires)


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")


def _sign(secret: str, body: str) -> str:
    return _b64(hmac.new(secret.encode("utf-8"), body.encode("utf-8", "replace"), hashlib.sha256).digest())


class BearerAuth:
    """401 for a ``/v1/`` request without a valid token, before routing, body reading or any byte sent."""

    def __init__(self, app: ASGIApp, secret: str) -> None:
        self.app, self.secret = app, secret

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(PROTECTED_PREFIX):
            refusal = self._refusal(Headers(scope=scope).getlist("authorization"))
            if refusal is not None:
                message, challenge = refusal
                response = error_response(401, "unauthorized", message, {"WWW-Authenticate": challenge})
                return await response(scope, receive, send)
        await self.app(scope, receive, send)

    def _refusal(self, values: list[str]) -> tuple[str, str] | None:
        """None for a good token; else the message and the ``WWW-Authenticate`` challenge."""
        if not values:
            return "this route needs 'Authorization: Bearer <token>'", REALM
        scheme, _, token = values[0].strip().partition(" ")
        if len(values) > 1 or scheme.lower() != "bearer" or not token.strip():
            return "send one 'Authorization: Bearer <token>' header", f'{REALM}, error="invalid_request"'
        try:
            verify_token(self.secret, token.strip())
        except InvalidToken as exc:
            return str(exc), f'{REALM}, error="invalid_token", error_description="{exc}"'
        return None


@lab_router.post("/lab/token")
async def issue_token(
    request: Request,
    ttl_s: float | None = Query(default=None, gt=0, le=MAX_TTL_S),
    subject: str = Query(default="lab", pattern=SUBJECT.pattern),
) -> dict[str, object]:
    """A fresh token (lab servers only): what a notebook's client refreshes before it resumes."""
    http = request.app.state.service.config.http
    if http.auth_secret is None:
        raise ServiceError(404, "not_found", "this server checks no tokens (auth_secret is not set)")
    ttl = http.auth_ttl_s if ttl_s is None else ttl_s
    now = time.time()
    token = mint_token(http.auth_secret, ttl, subject, now=now)
    return {"token": token, "token_type": "Bearer", "expires_in": ttl, "expires_at": now + ttl}
