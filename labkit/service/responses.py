"""Streaming response classes: Starlette's own, and one that never listens for the client leaving.

What the installed code does (starlette 1.10, uvicorn 0.54, read from site-packages):

* uvicorn's h11 and httptools protocols put ``spec_version: "2.3"`` in the HTTP scope.
* Below 2.4, ``StreamingResponse.__call__`` runs ``listen_for_disconnect(receive)`` beside the
  body loop in one task group; ``http.disconnect`` cancels the group, so ``CancelledError``
  lands at the body generator's current ``await``.
* At 2.4 and above it only runs the body loop and turns an ``OSError`` from ``send`` into
  ``ClientDisconnect``. But uvicorn's ``send`` returns quietly once the connection is lost
  (``if self.disconnected: return``), so no ``send`` ever fails.

:class:`WriteOnlyStreamingResponse` is that 2.4 path on this server: nothing ever tells it the
client left, so the generator runs to the end of the request. It exists for the experiment that
measures what listening is worth.

Both classes add one thing: a non-awaiting ``on_close`` callback and an explicit ``aclose()`` of
the body generator, run however the response ends. If the disconnect lands while Starlette
awaits ``send()``, the generator is parked at a ``yield`` and its ``finally`` would otherwise
wait for the garbage collector.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import anyio
from starlette.requests import ClientDisconnect
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

SSE_MEDIA_TYPE = "text/event-stream; charset=utf-8"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
RESPONSE_CLASSES = ("starlette", "write_only")


class ClosingStreamingResponse(StreamingResponse):
    """Starlette's StreamingResponse, unchanged, plus the close-however-it-ends hook."""

    def __init__(self, content: Any, *, on_close: Callable[[], None] | None = None, **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self._serve(scope, receive, send)
        finally:
            await self._cleanup()

    async def _serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        await super().__call__(scope, receive, send)

    async def _cleanup(self) -> None:
        if self.on_close is not None:
            self.on_close()
        aclose = getattr(self.body_iterator, "aclose", None)
        if aclose is not None:
            with anyio.CancelScope(shield=True):  # bounded: the generator's finally never awaits long
                await aclose()


class WriteOnlyStreamingResponse(ClosingStreamingResponse):
    """Starlette's spec-2.4 path: write, never listen; learn of a disconnect only if a write fails."""

    async def _serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.stream_response(send)
        except OSError:
            raise ClientDisconnect() from None
        if self.background is not None:
            await self.background()


def response_class(name: str) -> type[ClosingStreamingResponse]:
    if name == "starlette":
        return ClosingStreamingResponse
    if name == "write_only":
        return WriteOnlyStreamingResponse
    raise ValueError(f"response class must be one of {RESPONSE_CLASSES}, got {name!r}")


def sse_response(
    body: Any,
    kind: str,
    *,
    request_id: str | None = None,
    on_close: Callable[[], None] | None = None,
    headers: Mapping[str, str] | None = None,
) -> ClosingStreamingResponse:
    """A ``text/event-stream`` response of class ``kind`` with the headers every stream carries."""
    all_headers = dict(SSE_HEADERS)
    if request_id is not None:
        all_headers["X-Request-ID"] = request_id
    all_headers.update(headers or {})
    return response_class(kind)(body, media_type=SSE_MEDIA_TYPE, headers=all_headers, on_close=on_close)
