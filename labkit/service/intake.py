"""What a request body may contain, and how its prompt becomes token ids without stalling anyone.

Every route's body model is built from the types here, so the limits are written once and the
OpenAPI schema states them (pydantic turns each constraint into both a check and a schema rule):

* text is valid Unicode: a JSON escape such as ``"\\ud800"`` (a lone surrogate) parses, but no
  tokenizer can take it, so it is refused as the client's fault (422), never a 500;
* at most :data:`MAX_STOP_STRINGS` stop strings of 1 to :data:`MAX_STOP_CHARS` characters. An
  empty stop string is refused in every shape (``""`` as well as ``[""]``): it occurs at every
  position, so taken literally it would end the answer before its first token, and reading it
  as "no stop" in one shape but not the other was the inconsistency. "No stop" is ``null``,
  ``[]`` or leaving the field out;
* at most :data:`MAX_MESSAGES` chat messages, of :data:`MAX_CONTENT_PARTS` text parts each and
  :data:`MAX_TOTAL_PARTS` in all, counted before any part is validated (256 messages of 64 parts
  were 16,384 models to build, ~40 ms of work per body).

A body larger than :data:`INLINE_BODY_BYTES` is parsed and validated in a worker thread
(:class:`OffLoopBody`), as a long prompt is tokenized in one; FastAPI would do both on the event
loop, where 16 bodies of 520 KB at once held a neighbour stream for 1.7 s.

Then the prompt, in order of cost: a prompt whose length in characters could not fit the
model's context is refused before any tokenizer sees it (:class:`PromptLimits`), and only then is
it tokenized, or the chat template applied, in a thread of its own if it is long
(:func:`off_loop`). On the event loop a 1 MiB prompt held every other stream's writes for
0.6-1.8 s.
"""

from __future__ import annotations

import asyncio
import json
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar

from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import AfterValidator, BeforeValidator, Field, Strict, StrictStr
from pydantic_core import PydanticCustomError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from labkit.errors import InvalidRequest, PromptTooLong
from labkit.schema import as_sent, clip
from labkit.service.errors import ServiceError

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_MESSAGES = 256
MAX_CONTENT_PARTS = 64
MAX_TOTAL_PARTS = 1024  # text parts in all the messages of one chat
NO_BOUND = 1 << 20  # characters per token when the vocabulary cannot be read: the body limit rules
INLINE_CHARS = 2048  # prompts up to this long are tokenized in place (a few ms at most)
MAX_TOKENIZING = 2  # large prompts tokenized (or bodies parsed) at once per server; more wait their turn
CLIENT_CLOSED = 499  # nginx's status for "the client closed the connection": no one receives it
INLINE_BODY_BYTES = 16 * 1024  # bodies up to this are parsed and validated in place (well under 1 ms)

T = TypeVar("T")


def _unicode(text: str) -> str:
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise PydanticCustomError(
                "invalid_unicode", "must be valid Unicode text (it holds a lone surrogate)"
            ) from None
    return text


def _integer(value: Any) -> Any:
    """JSON numbers with no fraction: ``5`` and ``5.0`` (JSON Schema's ``integer`` is both), no
    "5", no ``true``."""
    if isinstance(value, (str, bool)):
        raise PydanticCustomError("int_type", "Input should be a valid integer")
    return value


Text = Annotated[StrictStr, AfterValidator(_unicode)]
Prompt = Annotated[Text, Field(min_length=1)]
StopText = Annotated[Text, Field(min_length=1, max_length=MAX_STOP_CHARS)]
Stop = StopText | Annotated[list[StopText], Field(max_length=MAX_STOP_STRINGS)] | None
# Constraints come before a validator in each Annotated: after one, pydantic still checks them
# but leaves them out of the JSON schema (it writes "ge" where JSON Schema says "minimum").
Number = Annotated[float, Strict(), Field(allow_inf_nan=False)]  # a JSON number: no "0.5", no true
NoFraction = BeforeValidator(_integer)
Count = Annotated[int, Field(ge=1), NoFraction]
TokenId = Annotated[int, Field(ge=0), NoFraction]
MAX_PROMPT_IDS = 1 << 17  # token ids in one prompt: more than any context the lab serves


def _token_ids(value: Any) -> Any:
    """Fail fast on a list of token ids: at its first bad item or at its length, with one error.
    Left to itself pydantic would build one error per bad item on the event loop (a list of
    170,000 strings took seconds, stalling every other stream)."""
    if not isinstance(value, list):
        return value
    if len(value) > MAX_PROMPT_IDS:
        raise PydanticCustomError("too_long", "at most {most} token ids", {"most": MAX_PROMPT_IDS})
    for i, item in enumerate(value):
        whole = isinstance(item, int) or (isinstance(item, float) and item.is_integer())
        if isinstance(item, bool) or not whole or item < 0:
            raise PydanticCustomError("token_id", "item {i} is not a token id (an integer >= 0)", {"i": i})
    return value


TokenIds = Annotated[list[TokenId], Field(min_length=1, max_length=MAX_PROMPT_IDS), BeforeValidator(_token_ids)]
Seed = Annotated[int, Field(ge=-(2**63), lt=2**64), NoFraction]  # what torch.Generator takes


def _parts_in_all(messages: Any) -> Any:
    """Refuse more than :data:`MAX_TOTAL_PARTS` text parts in all, before any part is validated."""
    if isinstance(messages, list):
        parts = sum(len(m["content"]) for m in messages if isinstance(m, dict) and isinstance(m.get("content"), list))
        if parts > MAX_TOTAL_PARTS:
            raise PydanticCustomError(
                "too_many_parts",
                "at most {most} content parts in all messages, got {parts}",
                {"most": MAX_TOTAL_PARTS, "parts": parts},
            )
    return messages


PartsInAll = BeforeValidator(_parts_in_all)


def accepting(*allowed: Any) -> BeforeValidator:
    """For an option this server does not support: only ``null`` and ``allowed`` (its "off" values)
    pass; anything else is refused with a message that says so (the field's place names it)."""
    shown = ", ".join(["null", *(_show(a) for a in allowed)])

    def check(value: Any) -> Any:
        if value is None or any(_same(value, a) for a in allowed):
            return value
        raise PydanticCustomError(
            "unsupported", "not supported by this server (accepted: {accepted})", {"accepted": shown}
        )

    return BeforeValidator(check)


def _same(value: Any, allowed: Any) -> bool:
    if isinstance(value, bool) or isinstance(allowed, bool):  # False is not 0 here
        return type(value) is type(allowed) and value == allowed
    return bool(value == allowed)


def _show(value: Any) -> str:
    return json.dumps(value)


# -- prompts -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PromptLimits:
    """What a prompt's length in characters alone says about its length in tokens.

    No token stands for more characters than the longest entry of the tokenizer's vocabulary
    (byte-level BPE spells each byte as one character, SentencePiece each character as one), so
    a prompt of more than ``max_context * chars_per_token`` characters cannot fit. Only a
    tokenizer whose normalizer deletes characters could break that bound; none of the lab's does.
    """

    max_context: int
    chars_per_token: int

    @property
    def max_chars(self) -> int:
        return self.max_context * self.chars_per_token

    @classmethod
    def of(cls, tokenizer: Any, max_context: int) -> PromptLimits:
        return cls(max_context, _longest_token(tokenizer))

    def check_chars(self, chars: int) -> None:
        if chars > self.max_chars:
            raise PromptTooLong(
                f"a prompt of {chars} characters cannot fit the model's context of "
                f"{self.max_context} tokens (at most {self.max_chars} characters could)"
            )


def _longest_token(tokenizer: Any) -> int:
    try:
        return max(len(token) for token in tokenizer.get_vocab())
    except (AttributeError, TypeError, ValueError):  # no vocabulary to read: no bound from characters
        return NO_BOUND


_LIMITS: weakref.WeakKeyDictionary[Any, PromptLimits] = weakref.WeakKeyDictionary()


def limits_of(engine: Any) -> PromptLimits:
    """The engine's :class:`PromptLimits`, read from its vocabulary once."""
    limits = _LIMITS.get(engine)
    if limits is None:
        limits = _LIMITS[engine] = PromptLimits.of(engine.tokenizer, engine.max_context)
    return limits


async def off_loop(work: Callable[..., T], *args: Any, size: int, inline: int = INLINE_CHARS) -> T:
    """``work(*args)``, in a thread of its own when ``size`` (characters, or bytes) is over
    ``inline``, large enough to be felt, so that the event loop keeps writing other streams meanwhile.

    A short prompt is tokenized in place: a thread costs more than a millisecond of work. A thread
    per large prompt, ended with its work, rather than a pool: a server that was only ever sent
    short prompts runs no thread but the step thread, as before, and none outlives its work.
    """
    if size <= inline:
        return work(*args)
    async with _tokenizing():
        return await _in_thread(work, *args)


_GATES: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = weakref.WeakKeyDictionary()


def _tokenizing() -> asyncio.Semaphore:
    """This loop's gate: at most ``MAX_TOKENIZING`` tokenizer threads at once, so a crowd of
    large prompts queues on the loop instead of starting a thread each."""
    loop = asyncio.get_running_loop()
    gate = _GATES.get(loop)
    if gate is None:
        gate = _GATES[loop] = asyncio.Semaphore(MAX_TOKENIZING)
    return gate


async def _in_thread(work: Callable[..., T], *args: Any) -> T:
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if not future.done():  # the request may have been cancelled meanwhile
            future.set_exception(error) if error is not None else future.set_result(result)

    def run() -> None:
        result, error = None, None
        try:
            result = work(*args)
        except Exception as exc:  # noqa: BLE001 - handed to the awaiting request, raised there
            error = exc
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the loop closed first: nobody is waiting
            pass

    threading.Thread(target=run, name="labkit-tokenize", daemon=True).start()
    return await future


async def encode_text(encode: Callable[[str], Any], text: str) -> list[int]:
    """``encode(text)`` off the loop; a tokenizer that refuses the text is the client's fault."""
    try:
        ids = await off_loop(encode, text, size=len(text))
    except (TypeError, ValueError, UnicodeError) as exc:
        raise InvalidRequest("the prompt could not be tokenized") from exc
    return [int(t) for t in ids]


async def prompt_ids(engine: Any, text: str) -> list[int]:
    """Token ids of a text prompt: refused by its length first, then tokenized off the loop."""
    limits_of(engine).check_chars(len(text))
    return await encode_text(engine.tokenizer.encode, text)


async def chat_ids(engine: Any, turns: list[dict[str, str]]) -> list[int]:
    """The tokenizer's chat template when it has one, otherwise ``role: text`` lines; off the loop.

    The template only adds text around the messages, so their characters bound the prompt from
    below and the cheap check comes first here too. A template that refuses the messages (some
    insist that roles alternate) is the client's fault: 422.
    """
    chars = sum(len(t["role"]) + len(t["content"]) for t in turns)
    limits_of(engine).check_chars(chars)
    tokenizer = engine.tokenizer
    if not getattr(tokenizer, "chat_template", None):
        text = "".join(f"{t['role']}: {t['content']}\n" for t in turns) + "assistant:"
        return await encode_text(tokenizer.encode, text)
    from jinja2 import TemplateError

    try:
        ids = await off_loop(_apply_template, tokenizer, turns, size=chars)
    except (TemplateError, TypeError, ValueError, KeyError, UnicodeError) as exc:
        raise InvalidRequest("the model's chat template could not render these messages") from exc
    return ids


def _apply_template(tokenizer: Any, turns: list[dict[str, str]]) -> list[int]:
    ids = tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    return [int(t) for t in ids]


# -- bodies --------------------------------------------------------------------------------------
class OffLoopBody(APIRoute):
    """A route whose JSON body is parsed and validated by :func:`parse_body`: in place up to
    :data:`INLINE_BODY_BYTES`, in a worker thread beyond (:func:`off_loop`, the tokenizer's gate).

    FastAPI then finds the validated model as the request's JSON and takes it as it is (pydantic
    does not validate an instance of the model again), so the route and its OpenAPI schema are
    unchanged; a refusal is the one FastAPI would make, except that JSON past the parser's limits
    (nesting, an integer's digits) is named rather than a bare 400, and a body that does not say
    it is JSON is a 415 (:func:`_refuse_unless_json`). A C-level ``json.loads`` still
    holds the GIL for its length (a few ms for a 1 MiB body), but no longer the loop for the
    validation.
    """

    def get_route_handler(self) -> Callable[[Request], Any]:
        handler, field = super().get_route_handler(), self.body_field
        if field is None:
            return handler

        async def route(request: Request) -> Response:
            headers = request.headers
            if headers.get("expect", "").lower() == "100-continue":
                # refused by its head alone, the body not asked for (RFC 9110, 10.1.1); without the
                # expectation the body is read first: closing on an unread body could reset the
                # connection under the client before it read the refusal
                _refuse_unless_json(headers.get("content-type"), headers.getlist("content-encoding"))
            try:
                body = await request.body()
            except ClientDisconnect:  # gone before its body was whole: no one to answer, no server error
                return Response(status_code=CLIENT_CLOSED)
            if body:  # empty: FastAPI's "body: Field required"
                _refuse_unless_json(headers.get("content-type"), headers.getlist("content-encoding"))
                request._json = await off_loop(parse_body, field, body, size=len(body), inline=INLINE_BODY_BYTES)
            return await handler(request)

        return route


def _refuse_unless_json(content_type: str | None, content_encoding: list[str]) -> None:
    """A body must say it is JSON (``application/json`` or ``application/*+json``, as FastAPI reads
    it), or it is refused with 415 naming what it said. FastAPI would hand its bytes to validation
    ("body: Input should be a valid dictionary"), which hides the cause: ``curl -d`` sends
    ``application/x-www-form-urlencoded`` unless told otherwise. Reading it as JSON anyway, as
    llama.cpp's server does, would let a web page on any origin post here without the browser's
    preflight: ``text/plain`` is a simple request, ``application/json`` is not.

    A compressed body is a 415 too, with ``Accept-Encoding: identity`` (RFC 9110, 15.5.16): read
    as it came, gzip's bytes were "invalid JSON", and inflating them would let 1 MiB on the wire
    become any size in memory; every line of the header counts. Each header is quoted :func:`as_sent`."""
    said_encoding = ", ".join(content_encoding)
    if {c.strip().lower() for c in said_encoding.split(",")} - {"", "identity"}:
        raise ServiceError(
            415,
            "unsupported_media_type",
            f"a body with Content-Encoding: {clip(as_sent(said_encoding))} is not read; send it uncompressed",
            {"Accept-Encoding": "identity"},
        )
    kind = (content_type or "").split(";")[0].strip().lower()
    if kind != "application/json" and not (kind.startswith("application/") and kind.endswith("+json")):
        said = "no Content-Type" if content_type is None else f"Content-Type: {clip(as_sent(content_type))}"
        raise ServiceError(
            415,
            "unsupported_media_type",
            f"the body must be JSON (Content-Type: application/json); this one has {said}",
        )


def _past_the_parser(said: str) -> RequestValidationError:
    return RequestValidationError(
        [{"type": "json_invalid", "loc": ("body",), "msg": "JSON decode error", "input": {}, "ctx": {"error": said}}]
    )


def parse_body(field: Any, body: bytes) -> Any:
    """The route's body model from JSON bytes, or the refusal FastAPI would raise for them."""
    try:
        value = json.loads(body)
    except json.JSONDecodeError as exc:
        error = {"type": "json_invalid", "loc": ("body", exc.pos), "msg": "JSON decode error", "input": {}}
        raise RequestValidationError([{**error, "ctx": {"error": exc.msg}}]) from None
    except UnicodeDecodeError:  # not UTF-8 (or -16, -32) text: FastAPI's 400, answered as invalid JSON
        raise HTTPException(400, "There was an error parsing the body") from None
    except RecursionError:  # JSON, but past what the parser takes (FastAPI: a bare 400)
        raise _past_the_parser("nested too deeply") from None
    except ValueError as exc:  # int's limit of 4,300 digits, or a ValueError from elsewhere in json
        raise _past_the_parser(
            "a number with too many digits" if "Exceeds the limit" in str(exc) else "not JSON it parses"
        ) from None
    model, errors = field.validate(value, {}, loc=("body",))
    if errors:
        raise RequestValidationError(errors)
    return model
