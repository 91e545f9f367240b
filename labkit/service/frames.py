"""From hub items to SSE bytes: the one path every lab stream (live or replayed) takes.

A :class:`Frame` is an encoded event plus what a writer needs to know about it: its kind (to
pad token events, to stop after a terminal one) and its id (to resume after it). Padding is
never stored in a frame; :func:`wire_bytes` adds it as the frame is written, so a server that
pads events with 64 KiB holds only the small event in memory.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

from labkit.engine.events import FinishEvent, TokenEvent
from labkit.hub.stream import Item, Stream, StreamClosed, StreamError
from labkit.schema import StreamEncoder
from labkit.service.errors import public_message
from labkit.sse import sse_comment

TERMINAL = frozenset({"done", "error"})
_PING = sse_comment("ping")


@dataclass(frozen=True)
class Frame:
    kind: str  # start, token, done, error, ping
    data: bytes
    id: int | None = None

    @property
    def terminal(self) -> bool:
        return self.kind in TERMINAL


PING = Frame("ping", _PING)


def start_frame(encoder: StreamEncoder, request_id: str, model: str, prompt_tokens: int) -> Frame:
    return Frame("start", encoder.start(request_id, model, prompt_tokens), encoder.last_id)


def encode_item(encoder: StreamEncoder, item: Item) -> Frame:
    """A token, a done (or an ``error`` of type ``cancelled`` for a cancel nobody on this side
    asked for), or the hub's terminal error (an internal one says only ``internal error``)."""
    if isinstance(item, TokenEvent):
        data, kind = encoder.token(item.index, item.token_id, item.text), "token"
    elif isinstance(item, FinishEvent) and item.reason != "cancelled":
        data, kind = encoder.done(item.reason, item.usage.prompt_tokens, item.usage.completion_tokens), "done"
    else:
        data, kind = encoder.error(*failure(item, "the request was cancelled in the engine")), "error"
    return Frame(kind, data, encoder.last_id)


def failure(item: FinishEvent | StreamError, cancelled: str = "the request was cancelled") -> tuple[str, str]:
    """The error a terminal item that is not a finish stands for, as (type, message fit for a
    client): a ``FinishEvent`` here is a cancel (type ``"cancelled"``, the message given as
    ``cancelled``); a hub error keeps its type (an internal one says only ``internal error``)."""
    if isinstance(item, FinishEvent):
        return "cancelled", cancelled
    return item.type, public_message(item.type, item.message)


async def items(stream: Stream, keepalive: float | None) -> AsyncIterator[Item | None]:
    """The stream's items up to and including its terminal one, and ``None`` after ``keepalive``
    seconds without one (time for a ping). Ends quietly if the stream is closed under it."""
    while True:
        try:
            item = await stream.get(keepalive)
        except StreamClosed:
            return
        yield item
        if item is not None and not isinstance(item, TokenEvent):
            return


async def frames(stream: Stream, encoder: StreamEncoder, keepalive: float | None) -> AsyncIterator[Frame]:
    """:func:`items` as lab frames: ``PING`` for a quiet interval."""
    async for item in items(stream, keepalive):
        yield PING if item is None else encode_item(encoder, item)


def padding(size: int) -> bytes:
    """An SSE comment of ``size`` bytes (at least 4: ``": \\n\\n"``), built when asked for."""
    return sse_comment("x" * max(0, size - 4))


def wire_bytes(frame: Frame, pad_bytes: int) -> bytes:
    """What goes on the socket: a token event after its padding comment, if the server pads."""
    if pad_bytes and frame.kind == "token":
        return padding(pad_bytes) + frame.data
    return frame.data
