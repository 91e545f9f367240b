"""Any OpenAI-compatible server as a target: how to talk to it, what it does differently, refusals.

Why: the lab's client-side measurements (framing, overlap, disconnects) mean as much against
vLLM, SGLang, llama.cpp's server or ``transformers serve`` as against labkit, and all of them
speak the OpenAI streaming API. So there is one client path for every target: ``POST
/v1/completions`` (or ``/v1/chat/completions``) with ``stream: true``, read by the lab's own
:func:`~labkit.experiments.client.timed_stream`, and nothing in-process.

Servers differ in small ways that change what a measurement means: some never send ``data:
[DONE]``, some send no usage in a stream, some refuse or ignore ``stream_options``, and each has
its own way (or none) to generate past end-of-sequence. :mod:`labkit.experiments.target_probe`
finds these out by asking, never by the server's name, and :meth:`Target.body` builds every
request from what it found (:class:`Quirks`).

A target that cannot be measured raises :class:`TargetError`, whose message is one line naming
the target and what failed; the command line prints it and exits non-zero.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any, Literal
from urllib.parse import urlsplit

import httpx

from labkit.experiments.client import (
    ReadOptions,
    StreamResult,
    async_client,
    launch_streams,
    run_sync,
    timed_stream,
)

__all__ = ["API", "Quirks", "Reading", "Target", "TargetError", "read"]

API = Literal["openai", "openai-chat"]


class TargetError(Exception):
    """A target the lab cannot measure; ``str()`` is the one line the command line prints."""

    def __init__(self, url: str, what: str) -> None:
        super().__init__(f"target {url}: {what}")


# --------------------------------------------------------------------------- reading a stream


@dataclass(frozen=True)
class Reading:
    """One OpenAI stream as the client saw it, from a :class:`StreamResult` of unnamed events.

    A *token chunk* is a chunk whose choice has not finished yet (a chat stream's opening
    role-only chunk is not one). ``tokens`` is the usage's ``completion_tokens`` when the server
    sent usage, else the count of token chunks (one chunk may carry more than one token).
    """

    result: StreamResult
    chunk_times: tuple[float, ...]
    text: str
    done: bool  # the stream ended with data: [DONE]
    usage: dict[str, Any] | None
    finish_reason: str | None
    error: str | None  # an HTTP status, an error chunk, or a client-side failure

    @property
    def chunks(self) -> int:
        return len(self.chunk_times)

    @property
    def tokens(self) -> int:
        counted = (self.usage or {}).get("completion_tokens")
        return int(counted) if isinstance(counted, int) else self.chunks

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.result.sent if self.chunk_times else None

    @property
    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    @property
    def duration(self) -> float | None:
        return self.result.duration

    @property
    def ok(self) -> bool:
        return self.error is None


def read(result: StreamResult) -> Reading:
    """Interpret ``result`` (from :func:`timed_stream`) as an OpenAI completion stream."""
    times, text, usage, finish, error = [], [], None, None, _http_error(result)
    for event in result.events:
        data = event.data
        if isinstance(data.get("usage"), dict):
            usage = data["usage"]
        if isinstance(data.get("error"), dict):
            error = error or f"error chunk: {data['error'].get('message', data['error'])}"
        for choice in data.get("choices") or []:
            delta = choice.get("delta") or {}
            piece = choice.get("text", delta.get("content"))
            if choice.get("finish_reason") is not None:
                finish = choice["finish_reason"]
            elif not ("role" in delta and not piece):
                times.append(event.time)
            text.append(piece or "")
    done = bool(result.events) and result.events[-1].data.get("raw") == "[DONE]"
    return Reading(result, tuple(times), "".join(text), done, usage, finish, error)


def _http_error(result: StreamResult) -> str | None:
    if result.error:
        return result.error
    if result.status != 200:
        return f"HTTP {result.status}: {_message(result.body)}"
    if not result.content_type.startswith("text/event-stream"):
        return f"answered {result.content_type or 'no content type'}, not text/event-stream"
    return None


def _message(body: Any) -> str:
    """The readable part of an error body: OpenAI's ``error.message``, FastAPI's ``detail``, or text."""
    if isinstance(body, dict):
        inner = body.get("error", body)
        if isinstance(inner, dict):
            return str(inner.get("message") or inner.get("detail") or inner)[:200]
        return str(body.get("message") or body.get("detail") or inner)[:200]
    text = " ".join(str(body).split())
    return text[:120] + ("..." if len(text) > 120 else "")


# --------------------------------------------------------------------------- the target


@dataclass(frozen=True)
class Quirks:
    """What :func:`probe` found; :meth:`Target.body` builds requests from it."""

    models: tuple[str, ...] = ()
    models_listed: str = "not probed"  # "yes", or why not (e.g. "HTTP 404")
    sends_done: bool = True
    usage_when_asked: bool = False
    usage_unasked: bool = False
    stream_options_accepted: bool = True
    eos_flags: dict[str, str] = field(default_factory=dict)  # flag -> what happened
    eos_flag: str | None = None  # the flag that made a stream run to max_tokens
    eos_reached_without_flag: bool = False
    labkit_internals: bool = False  # GET /stats answers with the engine's block counts

    @property
    def stream_options(self) -> str:
        if not self.stream_options_accepted:
            return "refused (the request fails with it)"
        if self.usage_when_asked and not self.usage_unasked:
            return "honoured (usage only when asked)"
        if self.usage_when_asked:
            return "ignored (usage sent either way)"
        return "ignored (no usage either way)"


@dataclass(frozen=True)
class Target:
    """An OpenAI-compatible server at ``url`` (scheme, host and port; a trailing ``/v1`` is dropped).

    ``pid`` is the server's process id when it runs on this machine (for CPU-time measurements).
    """

    url: str
    model: str | None = None
    api: API = "openai"
    pid: int | None = None
    quirks: Quirks = Quirks()
    timeout: float = 30.0
    api_key: str | None = field(default=None, repr=False)  # sent as a bearer token; never printed or saved

    def __post_init__(self) -> None:
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise TargetError(self.url, "not an http:// or https:// URL with a host")
        path = parts.path.rstrip("/")
        path = path.removesuffix("/v1")
        object.__setattr__(self, "url", f"{parts.scheme}://{parts.netloc}{path}")
        if self.api not in ("openai", "openai-chat"):
            raise TargetError(self.url, f"api must be openai or openai-chat, got {self.api!r}")

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, connections: int = 1, timeout: float | None = None) -> httpx.AsyncClient:
        """An httpx client for this target (its headers, no proxy from the environment)."""
        return async_client(self.url, connections, timeout or self.timeout, headers=self.headers)

    def sync_client(self, timeout: float | None = None) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=timeout or self.timeout, trust_env=False, headers=self.headers)

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.api == "openai-chat" else "/v1/completions"

    def body(
        self, prompt: str, max_tokens: int, *, usage: bool = True, eos: bool = True, stream: bool = True
    ) -> dict[str, Any]:
        """One request: greedy, ``max_tokens`` long (past eos where the target has a way), streamed."""
        body: dict[str, Any] = {"max_tokens": max_tokens, "temperature": 0, "stream": stream}
        if self.api == "openai-chat":
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        if self.model:
            body["model"] = self.model
        if stream and usage and self.quirks.stream_options_accepted:
            body["stream_options"] = {"include_usage": True}
        if eos and self.quirks.eos_flag:
            body.update(EOS_FLAGS[self.quirks.eos_flag](max_tokens))
        return body

    def stream(self, body: dict[str, Any], options: ReadOptions | None = None) -> Reading:
        """Send one streaming request and read it (for probes; experiments launch many at once)."""

        async def one() -> StreamResult:
            async with self.client() as client:
                return await timed_stream(client, body, path=self.path, options=options or ReadOptions())

        return read(run_sync(one()))

    def launch(self, bodies: list[dict[str, Any]], options: ReadOptions | None = None) -> tuple[list[Reading], float]:
        """Every body at once, each on its own connection: the readings and the makespan."""
        options = options or ReadOptions()
        launch = run_sync(
            launch_streams(
                self.url,
                bodies,
                replace(options, timeout=max(options.timeout, self.timeout)),
                path=self.path,
                headers=self.headers,
            )
        )
        return [read(r) for r in launch.results], launch.makespan


#: the request fields some servers accept to generate past end-of-sequence, and what they add
EOS_FLAGS = {
    "ignore_eos": lambda n: {"ignore_eos": True},
    "min_tokens": lambda n: {"min_tokens": n},
    # transformers serve: a per-request GenerationConfig (JSON text) whose eos id -1 matches no token
    "generation_config": lambda n: {"generation_config": json.dumps({"eos_token_id": -1})},
}
