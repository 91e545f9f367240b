"""ASGI guards every request passes: an allowed ``Host``, and ``Retry-After`` on every 503.

:class:`HostGuard` answers 400 in the JSON envelope when the ``Host`` header names a host
outside ``allowed`` (the port is ignored). A page on another origin can make a browser send
requests to 127.0.0.1 by pointing its own DNS name there (DNS rebinding); the browser still
sends that name as ``Host``, so accepting only loopback names (by default) refuses it. An
HTTP/1.0 request may leave ``Host`` out (it is optional there, and no browser sends HTTP/1.0);
HTTP/1.1 requires it, and h11 refuses a request without one before any guard sees it.

:class:`RetryAfterOn503` adds ``Retry-After`` to any 503 that lacks one, whichever route or
handler made it, so a client always learns when to come back.
"""

from __future__ import annotations

import re

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from labkit.service.errors import error_response

_HOST = re.compile(r"(\[[0-9a-f:.]*\]|[^:\[\]]*)(?::(\d+))?")  # name, or [v6], then :port


def host_name(value: str) -> str:
    """``Host`` without its port, lower case: ``[::1]:8000`` → ``[::1]``, ``Example:80`` → ``example``.

    Anything that is not ``name``, ``[address]`` or either with ``:port`` (digits) comes back
    whole, so it matches no allowed name: ``localhost:evil.com`` and ``[::1]x`` are refused.
    """
    value = value.strip().lower()
    match = _HOST.fullmatch(value)
    return match.group(1) if match else value


class HostGuard:
    def __init__(self, app: ASGIApp, allowed: tuple[str, ...]) -> None:
        self.app, self.allowed, self.any = app, frozenset(allowed), "*" in allowed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not self.any:
            hosts = [v.decode("latin-1") for k, v in scope["headers"] if k == b"host"]
            optional = not hosts and scope["http_version"] == "1.0"
            if not optional and (len(hosts) != 1 or host_name(hosts[0]) not in self.allowed):
                allowed = ", ".join(sorted(self.allowed))
                message = (
                    f"Host {hosts[0][:64]!r} is not served here (allowed: {allowed})"
                    if len(hosts) == 1
                    else f"{len(hosts)} Host headers; one naming a served host is needed (allowed: {allowed})"
                )
                return await error_response(400, "invalid_host", message)(scope, receive, send)
        await self.app(scope, receive, send)


class RetryAfterOn503:
    def __init__(self, app: ASGIApp, retry_after_s: int) -> None:
        self.app, self.value = app, str(retry_after_s).encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_retry_after(message: Message) -> None:
            if message["type"] == "http.response.start" and message["status"] == 503:
                headers = list(message.get("headers", []))
                if not any(name.lower() == b"retry-after" for name, _ in headers):
                    message = {**message, "headers": [*headers, (b"retry-after", self.value)]}
            await send(message)

        await self.app(scope, receive, send_with_retry_after)
