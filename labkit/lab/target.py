"""What the lab measures: a server, probed once, that says what it can show.

Three kinds, one interface. :class:`LocalLab` is labkit in a background thread of this process,
with its lab routes and its engine at hand; :class:`Process` is a server in its own process
(``labkit serve`` or any command), whose CPU time can be read and which can be restarted;
:func:`connect` gives any OpenAI-compatible URL. Each carries :class:`Caps`, the witnesses it
offers (labkit's native events, its step log and stream records, ``/stats``, ``/metrics``, its
CPU time, settings per condition, the engine itself). An experiment states what it needs; what a
target cannot show becomes a "not measurable against this target, because …" row
(:class:`NotMeasurable`), never a second implementation.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from labkit.lab.client import Launch, Request, async_client, get_json, makespan, read, run_sync
from labkit.lab.stream import API, ReadOptions, Stream
from labkit.lab.witness import Books

__all__ = ["Caps", "Quirks", "Target", "LocalLab", "Process", "TargetError", "NotMeasurable", "EOS_FLAGS"]


class TargetError(Exception):
    """A target the lab cannot measure at all; ``str()`` is the one line the CLI prints."""

    def __init__(self, url: str, what: str) -> None:
        super().__init__(f"target {url}: {what}")


class NotMeasurable(Exception):
    """This measurement cannot be made against this target; ``because`` says why."""

    def __init__(self, what: str, because: str) -> None:
        super().__init__(f"{what}: not measurable against this target, because {because}")
        self.what, self.because = what, because


@dataclass(frozen=True)
class Caps:
    """The witnesses a target offers; each false one has a reason in :meth:`why_not`."""

    native: bool = False  # labkit's /v1/stream: named events, ids, token ids, request ids
    lab: bool = False  # labkit's lab routes: step log, stream records, cache integrity, floods
    stats: bool = False  # labkit's GET /stats
    metrics: bool = False  # a Prometheus GET /metrics
    cpu: bool = False  # the server's process is on this machine (its CPU time can be read)
    engine: bool = False  # the engine itself, in this process
    settings: bool = False  # a server with other settings can be started per condition
    restart: bool = False  # the server can be stopped and started again

    def why_not(self, cap: str) -> str:
        return _WHY[cap]


_WHY = {
    "native": "it speaks only the OpenAI API (no labkit events, ids or token ids)",
    "lab": "it has no lab routes (labkit serve --lab-routes: step log, stream records, integrity)",
    "stats": "it has no labkit /stats",
    "metrics": "it has no Prometheus /metrics",
    "cpu": "its process is not on this machine (--target-pid)",
    "engine": "its engine is not in this process (a LocalLab only)",
    "settings": "its settings are fixed: the lab cannot start it with others",
    "restart": "the lab did not start it, so it cannot restart it",
}

#: the request fields some servers accept to generate past end-of-sequence, and what they add
EOS_FLAGS = {
    "ignore_eos": lambda n: {"ignore_eos": True},
    "min_tokens": lambda n: {"min_tokens": n},
    # transformers serve: a per-request GenerationConfig whose eos id -1 matches no token
    "generation_config": lambda n: {"generation_config": '{"eos_token_id": -1}'},
}


@dataclass(frozen=True)
class Quirks:
    """What a probe found about an OpenAI-compatible server; requests are built from it."""

    models: tuple[str, ...] = ()
    models_listed: str = "not probed"
    sends_done: bool = True
    usage_when_asked: bool = False
    usage_unasked: bool = False
    stream_options_accepted: bool = True
    eos_flags: dict[str, str] = field(default_factory=dict)
    eos_flag: str | None = "ignore_eos"
    eos_reached_without_flag: bool = False


class Target(Books):
    """A server at ``url`` speaking ``api``; every request of every experiment is built here.

    ``lab_owned``: the lab started it for its own run, so results go to ``<data>/<group>/``, not
    to ``<data>/target-<group>/`` where another server's runs go.
    """

    lab_owned = False

    def __init__(
        self,
        url: str,
        *,
        api: API = "openai",
        model: str | None = None,
        caps: Caps = Caps(),
        quirks: Quirks = Quirks(),
        pid: int | None = None,
        api_key: str | None = None,
        extra_body: dict[str, Any] | None = None,
        name: str = "",
    ) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise TargetError(url, "not an http:// or https:// URL with a host")
        if api not in ("labkit", "openai", "openai-chat"):
            raise TargetError(url, f"api must be labkit, openai or openai-chat, got {api!r}")
        self.url = f"{parts.scheme}://{parts.netloc}{parts.path.rstrip('/').removesuffix('/v1')}"
        self.api, self.model, self.quirks, self.pid = api, model, quirks, pid
        # labkit's own events (token ids, request ids) come only through its own API
        local = pid is not None and Path(f"/proc/{pid}/stat").exists()
        self.caps = replace(caps, cpu=caps.cpu or local, native=caps.native and api == "labkit")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.extra_body = dict(extra_body or {})
        self.name = name or parts.netloc
        self.tally: Counter[str] = Counter()
        self.last_failure = ""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r}, api={self.api!r}, model={self.model!r})"

    # -- requests ---------------------------------------------------------------------------
    def request(
        self, prompt: str, max_tokens: int, *, ignore_eos: bool = True, stream: bool = True, **extra: Any
    ) -> Request:
        """One greedy request for ``max_tokens`` tokens (past end-of-sequence where the target has
        a way), in this target's dialect; ``extra`` fields go into the body as they are."""
        if self.api == "labkit":
            body = {"prompt": prompt, "max_new_tokens": max_tokens, "ignore_eos": ignore_eos, **extra}
            return Request(
                "/v1/stream" if stream else "/v1/generate", body, "labkit", headers=self.headers, stream=stream
            )
        body = {"max_tokens": max_tokens, "temperature": 0, "stream": stream, **self.extra_body, **extra}
        if self.api == "openai-chat":
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        if self.model:
            body.setdefault("model", self.model)
        if stream and self.quirks.stream_options_accepted:
            body.setdefault("stream_options", {"include_usage": True})
        if ignore_eos and self.quirks.eos_flag:
            body.update(EOS_FLAGS[self.quirks.eos_flag](max_tokens))
        path = "/v1/chat/completions" if self.api == "openai-chat" else "/v1/completions"
        return Request(path, body, self.api, headers=self.headers, stream=stream)

    def resume_request(self, stream: Stream, after: str = "") -> Request:
        """labkit's resume route for a resumable ``stream`` (its start event holds the resume token),
        after event ``after`` (default: the last the stream read)."""
        token = str(stream.events[0].data.get("resume_token")) if stream.events else ""
        headers = {**self.headers, "Last-Event-ID": after or stream.last_event_id or "0", "X-Resume-Token": token}
        return Request(f"/v1/streams/{stream.request_id}/events", None, "labkit", "GET", headers)

    async def stream(self, request: Request, options: ReadOptions | None = None, **how: Any) -> Stream:
        """One request, read as ``options`` say (``how``: ``client``, ``result``, ``raw``,
        ``leave``; see :func:`labkit.lab.client.read`); every stream is tallied, so a run whose
        every stream failed can say so."""
        stream = await read(self.url, request, options, **how)
        self.tally["streams"] += 1
        if stream.failure:
            self.tally["failed"] += 1
            self.last_failure = stream.failure
        return stream

    async def launch_async(self, requests: Sequence[Request], options: Any = None) -> Launch:
        """Every request at once, each on its own connection (``options``: one, or one each)."""
        opts = list(options) if isinstance(options, Sequence) else [options or ReadOptions()] * len(requests)
        if len(opts) != len(requests):
            raise ValueError(f"{len(requests)} requests but {len(opts)} read options")
        async with async_client(
            self.url, max(1, len(requests)), max((o.timeout for o in opts), default=300.0)
        ) as client:
            tasks = [asyncio.ensure_future(self.stream(r, o, client=client)) for r, o in zip(requests, opts)]
            try:
                streams = await asyncio.gather(*tasks)
            finally:  # a failure (or a cancel) ends every sibling, never orphans one
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
        return Launch(list(streams), makespan(streams))

    def read(self, request: Request, options: ReadOptions | None = None, **how: Any) -> Stream:
        """:meth:`stream` from synchronous code."""
        return run_sync(self.stream(request, options, **how))

    def launch(self, requests: Sequence[Request], options: Any = None) -> Launch:
        """:meth:`launch_async` from synchronous code."""
        return run_sync(self.launch_async(requests, options))

    # -- what it can do ---------------------------------------------------------------------
    def need(self, *caps: str, what: str = "this measurement") -> None:
        """Raise :class:`NotMeasurable` unless the target has every one of ``caps``."""
        for cap in caps:
            if not getattr(self.caps, cap):
                raise NotMeasurable(what, self.caps.why_not(cap))

    def variant(self, **settings: Any) -> Target:
        """This server with other settings; only a target that can start servers has them."""
        if settings:
            raise NotMeasurable(f"settings {_settings_text(settings)}", self.caps.why_not("settings"))
        return self

    def close(self) -> None:
        """Stop what the lab started for this target (nothing, for a remote one)."""

    def __enter__(self) -> Target:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _settings_text(settings: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(settings.items()))


LOCAL_CAPS = Caps(native=True, lab=True, stats=True, metrics=True, engine=True, settings=True)


class LocalLab(Target):
    """labkit serving ``model`` in a background thread, lab routes on (the notebooks' default).

    :meth:`variant` starts (once) a server with other settings on the same loaded model, so a
    measurement may compare policies or response classes; :meth:`close` stops every one.
    """

    lab_owned = True

    def __init__(self, model: Any = "tiny-gpt2", *, api: API = "labkit", **settings: Any) -> None:
        from labkit.models import load_model
        from labkit.server import serve_in_thread

        self.loaded = load_model(model) if isinstance(model, str) else model
        self.settings = settings
        self._context: Any = serve_in_thread(self.loaded, **settings)
        self.server = self._context.__enter__()
        self._variants: dict[str, LocalLab] = {}
        super().__init__(self.server.url, api=api, model=self.loaded.name, caps=LOCAL_CAPS, name="labkit (in-thread)")

    @property
    def engine(self) -> Any:
        """The running engine: read only its public API (``stats()``, ``steps_since()``)."""
        return self.server.engine

    def variant(self, **settings: Any) -> Target:
        wanted = {**self.settings, **settings}
        flat = self.server.config.flat()
        if all(flat.get(k) == v for k, v in settings.items()):
            return self
        key = repr(sorted(wanted.items()))
        if key not in self._variants:
            self._variants[key] = LocalLab(self.loaded, api=self.api, **wanted)
        return self._variants[key]

    def close(self) -> None:
        for other in self._variants.values():
            other.close()
        self._variants.clear()
        if self._context is not None:
            context, self._context = self._context, None
            context.__exit__(None, None, None)


class Process(Target):
    """A server in a process of its own, started by the lab, so its CPU time can be read and it can
    be restarted. :meth:`labkit` builds the ``labkit serve`` command; any other command works
    too (``transformers serve …``, ``llama-server …``) given its URL and health route."""

    def __init__(
        self,
        command: Sequence[str],
        url: str,
        *,
        health: str = "/health",
        api: API = "openai",
        caps: Caps = Caps(),
        log: Path | None = None,
        startup_s: float = 180.0,
        env: dict[str, str] | None = None,
        **target: Any,
    ) -> None:
        super().__init__(url, api=api, caps=replace(caps, restart=True), **target)
        self.command, self.health, self.log, self.startup_s = list(command), health, log, startup_s
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    @classmethod
    def labkit(
        cls,
        model: str,
        *,
        api: API = "labkit",
        port: int | None = None,
        env: dict[str, str] | None = None,
        **settings: Any,
    ) -> Process:
        """``labkit serve`` on ``port`` (a free loopback one by default) with its lab routes, ``settings``
        as flags; a second server on a port the first used comes back where its clients look for it."""
        port = port or free_port()
        flags = [f"--{k.replace('_', '-')}={v}" for k, v in settings.items() if not isinstance(v, bool)]
        flags += [f"--{'' if v else 'no-'}{k.replace('_', '-')}" for k, v in settings.items() if isinstance(v, bool)]
        command = [sys.executable, "-m", "labkit.cli", "serve", "--model", model, "--port", str(port), "--lab-routes"]
        caps = Caps(native=True, lab=True, stats=True, metrics=True)
        url = f"http://127.0.0.1:{port}"
        return cls([*command, *flags], url, health="/healthz", api=api, caps=caps, model=model, env=env)

    def start(self) -> None:
        if self.log is None:
            self.proc = subprocess.Popen(
                self.command, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, env=self.env
            )
        else:
            with open(self.log, "ab") as out:  # the child holds its own copy of the descriptor
                self.proc = subprocess.Popen(self.command, stdout=out, stderr=subprocess.STDOUT, env=self.env)
        self.pid, self.caps = self.proc.pid, replace(self.caps, cpu=True)
        deadline = time.monotonic() + self.startup_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise TargetError(self.url, f"{Path(self.command[0]).name} exited with {self.proc.returncode} at start")
            with contextlib.suppress(OSError):
                if get_json(self.url, self.health, timeout=2.0)[0] == 200:
                    return
            time.sleep(0.2)
        self.stop()
        raise TargetError(self.url, f"not healthy within {self.startup_s:g} s")

    def stop(self, grace: float = 10.0) -> int | None:
        """SIGTERM, then SIGKILL after ``grace`` seconds; the exit status."""
        proc, self.proc = self.proc, None
        return None if proc is None else stop_process(proc, grace)

    def restart(self) -> None:
        self.stop()
        self.start()

    def close(self) -> None:
        self.stop()


def stop_process(proc: subprocess.Popen[Any], grace: float = 10.0) -> int:
    """SIGTERM, then SIGKILL after ``grace`` seconds; always reaped; the exit status."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5.0)
    return proc.returncode


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
