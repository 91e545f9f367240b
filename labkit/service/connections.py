"""Connection guards: uvicorn's h11 protocol with head, body, idle and send timeouts and a cap.

uvicorn (0.54, h11 protocol, read from site-packages) arms one timer: keep-alive, after a
response completes. A fresh connection that sends nothing, a request head sent a byte at a time,
a body that never ends, and a response the client stops reading all hold their socket (and, for
the last, the writer coroutine) for as long as the client likes. :class:`GuardedH11Protocol`
adds one timer per phase of a request, read from h11's state after every read:

* ``idle``: no byte of the next request yet (a fresh connection, or after a response);
  on expiry the connection is closed.
* ``header``: some bytes, no complete head: 408 with the JSON envelope, then close.
* ``body``: head complete, body not: 408 (if no response started), then close.
* ``send``: the transport's buffer is over its high-water mark and the writer waits; if the
  buffer has not shrunk after ``send_timeout``, the connection is aborted (RST), which wakes the
  writer (uvicorn marks the cycle disconnected) and frees the socket at once.

A phase's timer starts when the phase starts and is not restarted by bytes within it, so a
trickle does not keep a connection alive. Each close is reported through ``on_close(reason)``.

The cap is on connections that are being served, not on sockets (:class:`Slots`):

* a connection takes one of ``max_connections`` slots when its first request head is complete,
  and keeps it until it closes: a request on a connection that holds a slot (every later request
  on a keep-alive connection) is never refused for capacity;
* a first request whose head completes while every slot is taken is answered 503
  ``over_capacity`` with ``Retry-After`` and the JSON envelope, and its connection is closed:
  slots go in the order heads arrive, and what is beyond the cap is the newest;
* a connection with no complete head yet (silent, or part of a head) holds no slot, so sockets
  that send nothing never cost a client that sends a request. Their number is bounded apart:
  beyond ``max_pending_connections`` a new connection closes the one that has waited longest
  (``crowded_out``), since a real client sends its request at once, and the oldest silent
  socket is the likeliest to be one that never will.

(Counting every open socket at each request, as before, let a crowd of silent sockets refuse
every request, even one on a connection served a moment earlier.)

One connection serves at most ``max_requests_per_connection`` requests (nginx's
``keepalive_requests``); the last is answered with ``Connection: close`` and the connection
ends (``max_requests``), lingering as nginx's does so that the answers sent reach the client. A client reconnects for more, as it must anyway. Without it, one
connection that pipelined 60,000 requests and read no answer made the server serve them all
(10 s of CPU, and a neighbour's stream at half pace) until the kernel's buffers filled, and only
then did the send timeout's clock start: its slot stayed taken for 42 s.

Framing, where uvicorn leaves a choice open:

* a request h11 cannot read at all (two ``Content-Length`` headers, a bad chunk size, HTTP/1.1
  without ``Host``, a head past 16 KiB) gets uvicorn's 400 and close, but in the JSON envelope
  rather than uvicorn's ``text/plain``;

* a request with both ``Content-Length`` and ``Transfer-Encoding`` is read as chunked (h11's
  reading) and answered with ``Connection: close``, then the connection is closed, as RFC 9112
  section 6.1 requires: whatever a front end thought the body was, nothing after it is served;
* a client that half-closes (``shutdown(SHUT_WR)``) has left, even after a whole request: uvicorn
  closes, and the request is cancelled. That is nginx's default for a proxied request
  (``proxy_ignore_client_abort off``) and the lab's meaning of leaving "by FIN"; answering it
  instead would leave a queued or paused request unnoticed until a write to the client failed.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, ClassVar

import h11
from uvicorn.protocols.http.h11_impl import DEFAULT_MAX_INCOMPLETE_EVENT_SIZE, H11Protocol

from labkit.service.config import HttpConfig
from labkit.service.errors import envelope

TRANSPORT_KEY = "labkit.transport"  # the scope key naming the connection's transport
MALFORMED = "the request cannot be read as HTTP/1.1: malformed framing, head or Host"
HEAD_END = re.compile(rb"\r?\n\r?\n")  # where a request head ends, as h11 reads it
CLOSE_REASONS = (
    "idle_timeout",
    "header_timeout",
    "body_timeout",
    "send_timeout",
    "over_capacity",
    "crowded_out",
    "max_requests",
)


class Slots:
    """One server's books for the cap: the connections that hold a slot, and those that have not
    asked for one yet (oldest first)."""

    def __init__(self, slots: int, pending: int) -> None:
        self.slots, self.most_pending = slots, pending
        self.held: set[object] = set()
        self.pending: dict[object, None] = {}  # insertion order: the oldest first

    def arrived(self, connection: object) -> object | None:
        """A new connection; the oldest pending one, if it must now make room."""
        self.pending[connection] = None
        if len(self.pending) > self.most_pending:
            oldest = next(iter(self.pending))
            del self.pending[oldest]
            return oldest
        return None

    def take(self, connection: object) -> bool:
        """Its first request head is complete: a slot if one is free (True), else False."""
        self.pending.pop(connection, None)
        if len(self.held) >= self.slots:
            return False
        self.held.add(connection)
        return True

    def leave(self, connection: object) -> None:
        self.held.discard(connection)
        self.pending.pop(connection, None)


@dataclass(frozen=True)
class Guards:
    http: HttpConfig
    retry_after_s: int
    on_close: Callable[[str], None]  # called with one of CLOSE_REASONS
    slots: Slots


def guarded_protocol(http: HttpConfig, retry_after_s: int, on_close: Callable[[str], None]) -> type[GuardedH11Protocol]:
    """A protocol class for ``uvicorn.Config(http=...)`` with these settings (and its own slots)."""
    guards = Guards(http, retry_after_s, on_close, Slots(http.max_connections, http.max_pending_connections))
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"guards": guards})


class GuardedH11Protocol(H11Protocol):
    guards: ClassVar[Guards] = Guards(HttpConfig(), 1, lambda reason: None, Slots(256, 256))

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.phase: str | None = None
        self._phase_timer: asyncio.TimerHandle | None = None
        self._send_timer: asyncio.TimerHandle | None = None
        self._send_buffered = 0
        self.admitted: bool | None = None  # None until the first request head is complete
        self.requests = 0  # served on this connection, pipelined ones too
        self.lingering = False  # its last answer is sent: what the client still sends is dropped
        self._linger_timer: asyncio.TimerHandle | None = None
        self.app = self._capped(self.app)

    # -- phases -------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        oldest = self.guards.slots.arrived(self)
        if isinstance(oldest, GuardedH11Protocol) and not oldest.transport.is_closing():
            self.guards.on_close("crowded_out")
            oldest.transport.close()
        self._follow_phase()

    def data_received(self, data: bytes) -> None:
        if self.lingering:
            return
        super().data_received(data)
        if self.admitted is None and self.cycle is not None:  # the first head is in: in arrival order
            self.admitted = self.guards.slots.take(self)
        self._follow_phase()

    def handle_events(self) -> None:
        """h11 bounds a head only while it is incomplete: one read that holds a whole head of
        250 KB passes. Here the next head (the first, or one pipelined) is measured whole."""
        if self.conn.their_state is h11.IDLE:
            buffered = self.conn.trailing_data[0]
            end = HEAD_END.search(buffered, 0, DEFAULT_MAX_INCOMPLETE_EVENT_SIZE + 4)
            if (end.end() if end else len(buffered)) > DEFAULT_MAX_INCOMPLETE_EVENT_SIZE:
                self.send_400_response("request head too large")
                return
        super().handle_events()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._unset_keepalive_if_required()  # the idle timer below replaces uvicorn's keep-alive
        self._follow_phase()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_phase()
        self._cancel_send()
        if self._linger_timer is not None:
            self._linger_timer.cancel()
        self.guards.slots.leave(self)
        super().connection_lost(exc)

    def _current_phase(self) -> str | None:
        if self.transport is None or self.transport.is_closing():
            return None
        state = self.conn.their_state
        if state is h11.IDLE:
            return "header" if self.conn.trailing_data[0] else "idle"
        if state is h11.SEND_BODY:
            return "body"
        return None  # the request is in, or the connection is ending: the send timer's turn

    def _follow_phase(self) -> None:
        if self.lingering:
            return
        phase = self._current_phase()
        if phase == self.phase:
            return
        self._cancel_phase()
        self.phase = phase
        if phase is not None:
            self._phase_timer = self.loop.call_later(getattr(self.guards.http, f"{phase}_timeout"), self._expire, phase)

    def _cancel_phase(self) -> None:
        if self._phase_timer is not None:
            self._phase_timer.cancel()
            self._phase_timer = None

    def _expire(self, phase: str) -> None:
        self._phase_timer = None
        if self.transport.is_closing():
            return
        self.guards.on_close(f"{phase}_timeout")
        if phase == "header":
            self.transport.write(
                _raw_response(
                    408,
                    "request_timeout",
                    f"the request head did not arrive within {self.guards.http.header_timeout} s",
                )
            )
        elif phase == "body" and self.cycle is not None and not self.cycle.response_started:
            self.transport.write(
                _raw_response(
                    408, "request_timeout", f"the request body did not arrive within {self.guards.http.body_timeout} s"
                )
            )
        if self.cycle is not None:  # the app sees http.disconnect; its later sends are dropped
            self.cycle.disconnected = True
            self.cycle.message_event.set()
        self.transport.close()

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a request h11 cannot read (two lengths, a bad chunk size, no Host in
        HTTP/1.1, a head past h11's 16 KiB): the same 400 and close, in the JSON envelope, also to a
        request pipelined behind a finished response. While a response is under way nothing more
        can be said, and it only closes."""
        if self.cycle is None or not self.cycle.response_started or self.cycle.response_complete:
            self.transport.write(_raw_response(400, "invalid_request", MALFORMED))
        self.transport.close()

    # -- sends --------------------------------------------------------------------------------
    def pause_writing(self) -> None:
        super().pause_writing()
        if self._send_timer is None:
            self._arm_send()

    def resume_writing(self) -> None:
        self._cancel_send()
        super().resume_writing()

    def _arm_send(self) -> None:
        self._send_buffered = self.transport.get_write_buffer_size()
        self._send_timer = self.loop.call_later(self.guards.http.send_timeout, self._send_expired)

    def _cancel_send(self) -> None:
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None

    def _send_expired(self) -> None:
        self._send_timer = None
        if self.transport.is_closing():
            return
        if self.transport.get_write_buffer_size() < self._send_buffered:
            self._arm_send()  # the client reads, slowly: that is progress
            return
        self.guards.on_close("send_timeout")
        sock = self.transport.get_extra_info("socket")
        if sock is not None:  # linger 0: the close is an RST and the kernel drops what it holds for this
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # client (else a FIN
        self.transport.abort()  # waits behind the queued bytes, and the client reads them on)

    # -- the cap --------------------------------------------------------------------------------
    def _capped(self, app: Any) -> Any:
        async def capped(scope: Any, receive: Any, send: Any) -> None:
            if scope["type"] == "http" and self.admitted is False:
                self.guards.on_close("over_capacity")
                message = f"all {self.guards.http.max_connections} connection slots are taken; retry later"
                await send(
                    {
                        "type": "http.response.start",
                        "status": 503,
                        "headers": _headers(_body("over_capacity", message), self.guards.retry_after_s),
                    }
                )
                await send({"type": "http.response.body", "body": _body("over_capacity", message)})
                return
            scope[TRANSPORT_KEY] = self.transport  # for a lab route that must cut its connection (lab_demo)
            self.requests += scope["type"] == "http"
            if self.requests == self.guards.http.max_requests_per_connection:
                self.guards.on_close("max_requests")
                send = _closing(send)
                if self.cycle is not None:  # its close, once the answer is sent, lingers
                    self.cycle.transport = _Lingering(self)  # type: ignore[assignment]  # a proxy of it
            elif scope["type"] == "http" and _both_lengths(scope["headers"]):
                send = _closing(send)
            await app(scope, receive, send)

        return capped

    def linger(self) -> None:
        """nginx's lingering close: a FIN after the last answer, then what the client still sends
        (requests it pipelined) is read and dropped, until it closes or for ``idle_timeout``.
        Closing at once with those requests unread would reset the connection, and a reset
        destroys the answers the client has not read yet."""
        self.lingering = True
        self._cancel_phase()
        if self.transport.can_write_eof():
            self.transport.write_eof()  # after what is buffered
        self.flow.resume_reading()  # uvicorn paused reading behind pipelined requests
        self._linger_timer = self.loop.call_later(self.guards.http.idle_timeout, self.transport.close)


class _Lingering:
    """The transport as the last request's cycle sees it: its ``close`` lingers."""

    def __init__(self, protocol: GuardedH11Protocol) -> None:
        self._protocol, self._transport = protocol, protocol.transport

    def close(self) -> None:
        self._protocol.linger()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def _both_lengths(headers: list[tuple[bytes, bytes]]) -> bool:
    names = {name for name, _ in headers}
    return b"content-length" in names and b"transfer-encoding" in names


def _closing(send: Any) -> Any:
    """``send`` with ``Connection: close`` on the response: h11 then ends the connection after it."""

    async def closing(message: Any) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", ()), (b"connection", b"close")]}
        await send(message)

    return closing


def _body(type: str, message: str) -> bytes:
    return json.dumps(envelope(type, message)).encode()


def _headers(body: bytes, retry_after_s: int | None = None) -> list[tuple[bytes, bytes]]:
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
    ]
    if retry_after_s is not None:
        headers.append((b"retry-after", str(retry_after_s).encode()))
    return headers


def _raw_response(status: int, type: str, message: str) -> bytes:
    """A whole response written straight to the transport, outside h11 (whose state may not allow one)."""
    body = _body(type, message)
    head = f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\n".encode()
    head += b"".join(name + b": " + value + b"\r\n" for name, value in _headers(body)) + b"\r\n"
    return head + body
