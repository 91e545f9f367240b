"""Any OpenAI-compatible server as a target: how to talk to it, what it does differently, refusals.

Why: the lab's client-side measurements (framing, overlap, disconnects) mean as much against
vLLM, SGLang, llama.cpp's server or ``transformers serve`` as against labkit, and all of them
speak the OpenAI streaming API. So there is one client path for every target: ``POST
/v1/completions`` (or ``/v1/chat/completions``) with ``stream: true``, read by the lab's own
:func:`~labkit.experiments.client.timed_stream`, and nothing in-process.

Servers differ in small ways that change what a measurement means: some never send ``data:
[DONE]``, some send no usage in a stream, some refuse or ignore ``stream_options``, and each has
its own way (or none) to generate past end-of-sequence. :func:`probe` finds these out by asking,
never by the server's name, and :func:`Target.body` builds every request from what it found.

A target that cannot be measured raises :class:`TargetError`, whose message is one line naming
the target and what failed; the command line prints it and exits non-zero.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Literal
from urllib.parse import urlsplit

import httpx
import pandas as pd

from labkit.experiments.client import (
    ReadOptions,
    StreamResult,
    async_client,
    launch_streams,
    run_sync,
    timed_stream,
)

__all__ = ["API", "Quirks", "Reading", "Target", "TargetError", "connect", "probe", "quirks_table", "read"]

API = Literal["openai", "openai-chat"]
PROBE_PROMPT = "The lighthouse keeper counted the ships every evening, writing their names in a ledger"
PROBE_TOKENS = 8


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
    def path(self) -> str:
        return "/v1/chat/completions" if self.api == "openai-chat" else "/v1/completions"

    def body(self, prompt: str, max_tokens: int, *, usage: bool = True, eos: bool = True,
             stream: bool = True) -> dict[str, Any]:
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
            body.update(_EOS_FLAGS[self.quirks.eos_flag](max_tokens))
        return body

    def stream(self, body: dict[str, Any], options: ReadOptions | None = None) -> Reading:
        """Send one streaming request and read it (for probes; experiments launch many at once)."""
        async def one() -> StreamResult:
            async with async_client(self.url, connections=1, timeout=self.timeout) as client:
                return await timed_stream(client, body, path=self.path, options=options or ReadOptions())

        return read(run_sync(one()))

    def launch(self, bodies: list[dict[str, Any]], options: ReadOptions | None = None) -> tuple[list[Reading], float]:
        """Every body at once, each on its own connection: the readings and the makespan."""
        options = options or ReadOptions()
        launch = run_sync(launch_streams(self.url, bodies, replace(options, timeout=max(options.timeout, self.timeout)),
                                         path=self.path))
        return [read(r) for r in launch.results], launch.makespan


_EOS_FLAGS = {
    "ignore_eos": lambda n: {"ignore_eos": True},
    "min_tokens": lambda n: {"min_tokens": n},
}


# --------------------------------------------------------------------------- connecting and probing


def connect(url: str, model: str | None = None, api: API = "openai", pid: int | None = None,
            timeout: float = 30.0) -> Target:
    """A probed :class:`Target`, or :class:`TargetError` saying why ``url`` cannot be measured."""
    target = Target(url, model, api, pid, timeout=timeout)
    if pid is not None and not _local_pid(pid):
        raise TargetError(target.url, f"--target-pid {pid} is not a process on this machine")
    return probe(target)


def probe(target: Target) -> Target:
    """Ask the target what it does; the same target with ``quirks`` (and a model) filled in."""
    models, listed = _models(target)
    if target.model is None and models:
        target = replace(target, model=models[0])
    plain = target.stream(target.body(PROBE_PROMPT, PROBE_TOKENS, usage=False, eos=False))
    if not plain.ok:
        raise TargetError(target.url, f"POST {target.path} (stream) failed: {plain.error}" + _hint(plain, listed))
    if plain.chunks == 0:
        raise TargetError(target.url, f"POST {target.path} streamed no completion chunks (not an OpenAI stream?)")
    asked = target.stream({**target.body(PROBE_PROMPT, PROBE_TOKENS, eos=False),
                           "stream_options": {"include_usage": True}})
    flags, flag = _eos_flags(target, tested=plain.finish_reason != "length")
    quirks = Quirks(models=models, models_listed=listed, sends_done=plain.done,
                    usage_when_asked=asked.ok and asked.usage is not None, usage_unasked=plain.usage is not None,
                    stream_options_accepted=asked.ok, eos_flags=flags, eos_flag=flag,
                    eos_reached_without_flag=plain.finish_reason != "length",
                    labkit_internals=_has_stats(target))
    return replace(target, quirks=quirks)


def _hint(reading: Reading, listed: str) -> str:
    if reading.result.status == 404 and listed != "yes":
        return f"; GET /v1/models: {listed}: not an OpenAI-compatible API?"
    return ""


def _models(target: Target) -> tuple[tuple[str, ...], str]:
    """The model ids ``GET /v1/models`` lists, and "yes" or why there are none. Unreachable: refused."""
    try:
        with httpx.Client(base_url=target.url, timeout=target.timeout, trust_env=False) as client:
            response = client.get("/v1/models")
    except httpx.ConnectError as exc:
        raise TargetError(target.url, f"cannot connect ({_reason(exc)})") from None
    except httpx.TimeoutException:
        raise TargetError(target.url, f"no answer to GET /v1/models within {target.timeout:g} s") from None
    except httpx.HTTPError as exc:
        raise TargetError(target.url, f"GET /v1/models failed: {type(exc).__name__}: {exc}") from None
    if response.status_code != 200:
        return (), f"HTTP {response.status_code}"
    try:
        data = response.json()["data"]
        return tuple(str(m["id"]) for m in data), "yes"
    except (ValueError, KeyError, TypeError):
        return (), "not an OpenAI model list"


def _reason(exc: Exception) -> str:
    text = str(exc) or type(exc).__name__
    return "connection refused" if "refused" in text.lower() else text


def _eos_flags(target: Target, tested: bool) -> tuple[dict[str, str], str | None]:
    """Each known flag: refused, accepted but ended early, or ran to max_tokens; the first that ran.

    ``tested``: the probe reached eos without a flag, so a flag that runs to max_tokens works.
    Otherwise "accepted" is all a probe can tell (a server may ignore a field it does not know).
    """
    found: dict[str, str] = {}
    for flag in _EOS_FLAGS:
        probe_target = replace(target, quirks=replace(target.quirks, eos_flag=flag))
        reading = probe_target.stream(probe_target.body(PROBE_PROMPT, PROBE_TOKENS, usage=False))
        if not reading.ok:
            found[flag] = f"refused ({reading.error})"
        elif reading.finish_reason == "length" and reading.tokens >= PROBE_TOKENS:
            found[flag] = "works (ran past eos)" if tested else "accepted (untested: eos not reached without it)"
        else:
            found[flag] = f"accepted; ended at {reading.tokens} tokens ({reading.finish_reason})"
    ran = [flag for flag, what in found.items() if what.startswith(("works", "accepted (untested"))]
    return found, (ran[0] if ran else None)


def _has_stats(target: Target) -> bool:
    try:
        with httpx.Client(base_url=target.url, timeout=5.0, trust_env=False) as client:
            response = client.get("/stats")
        return response.status_code == 200 and "free_blocks" in response.json()
    except (httpx.HTTPError, ValueError, TypeError):
        return False


def _local_pid(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat"):
            return True
    except OSError:
        return False


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of process ``pid`` so far, from ``/proc/PID/stat``."""
    import os

    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def quirks_table(target: Target) -> pd.DataFrame:
    """What the probe found, one question a row, as the command line and the notebooks show it."""
    q = target.quirks
    eos = ("; ".join(f"{flag}: {what}" for flag, what in q.eos_flags.items()) or "not probed")
    rows = [
        ("target", target.url),
        ("route", f"POST {target.path} (stream: true)"),
        ("models listed by GET /v1/models", ", ".join(q.models) if q.models else f"none ({q.models_listed})"),
        ("model requested", target.model or "(none: the server's default)"),
        ("ends streams with data: [DONE]", _yes(q.sends_done)),
        ("usage in streams with stream_options.include_usage", _yes(q.usage_when_asked)),
        ("usage in streams without asking", _yes(q.usage_unasked)),
        ("stream_options", q.stream_options),
        ("eos reached in the probe without a flag", _yes(q.eos_reached_without_flag)),
        ("ways to ignore eos", eos),
        ("used to ignore eos", q.eos_flag or "none found: streams may end before max_tokens"),
        ("labkit internals (GET /stats block counts)", "available" if q.labkit_internals else "not available"),
    ]
    return pd.DataFrame(rows, columns=["question", "answer"])


def _yes(value: bool) -> str:
    return "yes" if value else "no"
