"""Drain on restart: SIGTERM to a real ``labkit serve`` process with streams open.

The server runs as a subprocess (``python -m labkit.cli serve``), as in production. Streams are
opened (some ``resumable``), plus one client that never reads: its writer blocks on full
buffers, and that is what keeps the drain open long enough to be seen. The server decodes two
sequences at a time and the holder keeps one slot, so the other streams take turns: at the
signal some are running and some are waiting. Then SIGTERM, and from that moment a prober sends
a request every ``probe_every`` seconds until the port refuses. Recorded on one clock (seconds
since the signal): every event each stream received and how it ended, every probe's answer, and
when the process exited (against ``drain_grace``). Finally the same command starts the server
again and a resumable stream's client reconnects with its token and ``Last-Event-ID``: the log
lived in the old process's memory, so the new one answers 404, the same answer an unknown id
gets; the client's ``error`` event (type ``shutdown``) already told it the stream is over.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pandas as pd

from labkit.experiments.profiles import Profile, repo_root
from labkit.experiments.progress import Progress, doing, tick
from labkit.experiments.readings import Verdict, fetch_steps
from labkit.experiments.waiting import wait_for
from labkit.sse import SSEParser

NAME = "drain"


@dataclass(frozen=True)
class Config:
    model: str = "tiny-gpt2"
    streams: int = 4  # reading clients; every other one resumable
    tokens: int = 400  # per stream (ignore_eos): long enough to be open at the signal
    drain_grace: float = 3.0
    pad_bytes: int = 16384  # per token event: fills the holder's buffers in a few events
    probe_every: float = 0.05
    start_timeout: float = 180.0  # the subprocess imports torch and loads the model
    timeout: float = 60.0

    @classmethod
    def for_profile(cls, profile: Profile) -> Config:
        if profile.full:  # SmolLM2: ~50 ms a token, so 60 tokens already outlast the signal
            return cls(model=profile.model, tokens=60)
        return cls(model=profile.model)

    def __post_init__(self) -> None:
        if self.streams < 2 or self.tokens < 8 or self.drain_grace <= 1.0:
            raise ValueError("drain.Config: streams >= 2, tokens >= 8, drain_grace > 1 s (1 s is kept for exit)")


def units(config: Config) -> int:
    return 3  # start and signal, exit, restart


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def serve_argv(config: Config, port: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "labkit.cli",
        "serve",
        "--model",
        config.model,
        "--port",
        str(port),
        "--max-batch",
        "2",
        "--policy",
        "pause",
        "--pad-bytes",
        str(config.pad_bytes),
        "--sndbuf",
        "4096",
        "--drain-grace",
        str(config.drain_grace),
        "--log-level",
        "warning",
        "--lab-routes",  # GET /lab/steps: the run's step log, read before the SIGTERM ends the process
    ]


@contextlib.contextmanager
def labkit_serve(config: Config, port: int) -> Iterator[subprocess.Popen]:
    """``labkit serve`` as a child process, healthy on ``port``; killed after if still alive."""
    root = repo_root()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen(
        serve_argv(config, port), cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        url = f"http://127.0.0.1:{port}"

        def up() -> bool:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"labkit serve exited with {proc.returncode}: {proc.communicate(timeout=30)[1][-2000:]}"
                )
            return _healthy(url)

        wait_for(up, timeout=config.start_timeout, what="labkit serve to answer /healthz", interval=0.1)
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=30)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/healthz", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


class Reader(threading.Thread):
    """One stream read to its end in a thread: each event with its arrival time."""

    def __init__(self, url: str, index: int, config: Config, clock: list[float]) -> None:
        super().__init__(daemon=True)
        self.url, self.index, self.config, self.clock = url, index, config, clock
        self.resumable = index % 2 == 1
        self.events: list[dict[str, Any]] = []
        self.status: int | None = None
        self.request_id = self.token = None
        self.failure: str | None = None

    def run(self) -> None:
        body = {
            "prompt": f"Stream {self.index} before the restart",
            "max_new_tokens": self.config.tokens,
            "ignore_eos": True,
            "resumable": self.resumable,
        }
        parser = SSEParser()
        try:
            with (
                httpx.Client(timeout=self.config.timeout) as http,
                http.stream("POST", self.url + "/v1/stream", json=body) as r,
            ):
                self.status = r.status_code
                self.request_id, self.token = r.headers.get("x-request-id"), r.headers.get("x-resume-token")
                for chunk in r.iter_raw():
                    now = time.monotonic()
                    for e in parser.feed(chunk):
                        self.events.append({"t": now, "event": e.event, "id": e.id, "data": e.data})
        except httpx.HTTPError as exc:
            self.failure = f"{type(exc).__name__}: {exc}"
        self.ended = time.monotonic()

    @property
    def tokens(self) -> int:
        return sum(e["event"] == "token" for e in self.events)

    @property
    def terminal(self) -> dict[str, Any] | None:
        last = self.events[-1] if self.events else None
        return last if last and last["event"] in ("done", "error") else None


def hold_without_reading(url: str, config: Config) -> socket.socket:
    """A client that sends a stream request and never reads: its writer blocks on the buffers."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    body = json.dumps({"prompt": "I never read", "max_new_tokens": config.tokens, "ignore_eos": True}).encode()
    sock.sendall(
        b"POST /v1/stream HTTP/1.1\r\nhost: " + f"{host}:{port}".encode() + b"\r\ncontent-type: "
        b"application/json\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )
    return sock


def probe_until_refused(url: str, config: Config, stop: threading.Event, out: list[dict[str, Any]]) -> None:
    """A short request every ``probe_every`` s; its status (or 'refused') and error type."""
    body = {"prompt": "A new request during the drain", "max_new_tokens": 2}
    with httpx.Client(timeout=5) as http:
        while not stop.is_set():
            sent = time.monotonic()
            try:
                r = http.post(url + "/v1/generate", json=body, headers={"connection": "close"})
                kind = (r.json().get("error") or {}).get("type") if r.status_code != 200 else None
                out.append(
                    {
                        "t": sent,
                        "status": r.status_code,
                        "error_type": kind,
                        "retry_after": r.headers.get("retry-after"),
                    }
                )
            except httpx.HTTPError as exc:
                out.append(
                    {"t": sent, "status": None, "error_type": f"refused ({type(exc).__name__})", "retry_after": None}
                )
                return
            stop.wait(config.probe_every)


def run(config: Config, *, server: Any = None, progress: Progress | None = None) -> dict[str, pd.DataFrame]:
    """``server`` is ignored: this experiment starts (and stops) its own ``labkit serve``."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    probes: list[dict[str, Any]] = []
    doing(progress, f"starting labkit serve --model {config.model}")
    with labkit_serve(config, port) as proc:
        holder = hold_without_reading(url, config)
        readers = [Reader(url, i, config, []) for i in range(config.streams)]
        try:
            time.sleep(0.2)  # the holder is admitted first and keeps its slot
            for r in readers:
                r.start()
            wait_for(  # every stream open (admitted, running or queued), and one of them decoding
                lambda: (
                    all(r.status is not None or not r.is_alive() for r in readers)
                    and any(r.tokens >= 3 for r in readers)
                ),
                timeout=config.timeout,
                what="every stream to open and one to have its first tokens",
                interval=0.01,
            )
            stop = threading.Event()
            prober = threading.Thread(target=probe_until_refused, args=(url, config, stop, probes), daemon=True)
            doing(progress, "SIGTERM")
            steps = fetch_steps(url)  # the load's steps; the log ends with the process
            signalled = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            prober.start()
            tick(progress)
            code = proc.wait(config.drain_grace + config.timeout)
            exited = time.monotonic()
            stop.set()
            prober.join(10)
            for r in readers:
                r.join(config.timeout)
            _, stderr = proc.communicate(timeout=30)
        finally:
            holder.close()
    tick(progress)
    streams = stream_table(readers, signalled)
    doing(progress, "restarting labkit serve and reconnecting")
    with labkit_serve(config, port) as again:
        reconnect = reconnect_table(url, readers, config)
        again.send_signal(signal.SIGTERM)
        again.wait(config.drain_grace + config.timeout)
    tick(progress)
    timeline = pd.DataFrame(
        [
            {"t": e["t"] - signalled, "what": f"stream {r.index} {e['event']}", "stream": r.index}
            for r in readers
            for e in r.events
        ]
        + [{"t": p["t"] - signalled, "what": f"probe {p['status'] or 'refused'}", "stream": None} for p in probes]
        + [{"t": exited - signalled, "what": "process exited", "stream": None}]
    ).sort_values("t", kind="stable")
    process = pd.DataFrame(
        [
            {
                "exit_code": code,
                "exited_after_s": exited - signalled,
                "drain_grace_s": config.drain_grace,
                "traceback_in_stderr": "Traceback" in stderr,
                "stderr_tail": stderr.strip()[-300:],
            }
        ]
    )
    probe_t = pd.DataFrame(probes)
    if len(probe_t):
        probe_t["t"] -= signalled
    return {
        "streams": streams,
        "probes": probe_t,
        "process": process,
        "timeline": timeline,
        "reconnect": reconnect,
        "steps": steps,
    }


def stream_table(readers: list[Reader], signalled: float) -> pd.DataFrame:
    rows = []
    for r in readers:
        term = r.terminal
        kind = None
        if term is not None and term["event"] == "error":
            kind = (json.loads(term["data"]).get("error") or {}).get("type")
        rows.append(
            {
                "stream": r.index,
                "resumable": r.resumable,
                "status": r.status,
                "tokens_before_signal": sum(e["event"] == "token" and e["t"] < signalled for e in r.events),
                "tokens": r.tokens,
                "ended_by": term["event"] if term else "cut",
                "error_type": kind,
                "last_event_id": r.events[-1]["id"] if r.events else None,
                "ended_after_signal_s": r.ended - signalled,
                "client_error": r.failure,
            }
        )
    return pd.DataFrame(rows)


def reconnect_table(url: str, readers: list[Reader], config: Config) -> pd.DataFrame:
    rows: list[dict[str, Any]] = []
    with httpx.Client(timeout=config.timeout) as http:
        for r in readers:
            if not r.resumable or not r.request_id:
                continue
            last = r.events[-1]["id"] if r.events else "0"
            got = http.get(
                f"{url}/v1/streams/{r.request_id}/events", params={"token": r.token}, headers={"Last-Event-ID": last}
            )
            rows.append(
                {
                    "stream": r.index,
                    "last_event_id": last,
                    "status": got.status_code,
                    "error_type": (got.json().get("error") or {}).get("type") if got.status_code >= 400 else None,
                    "body": got.text[:160],
                }
            )
    return pd.DataFrame(rows)


# --------------------------------------------------------------------------- readings


def verdicts(tables: dict[str, pd.DataFrame], config: Config) -> list[Verdict]:
    streams, probes, process = tables["streams"], tables["probes"], tables["process"].iloc[0]
    ended_ok = streams.apply(
        lambda s: s.ended_by == "done" or (s.ended_by == "error" and s.error_type == "shutdown"), axis=1
    )
    answered = probes[probes.status.notna()] if len(probes) else probes
    # 503 "draining" is the refusal; a request that got in at the very moment of the signal was
    # admitted and then ended by the drain itself: 503 "shutdown". Both carry Retry-After.
    refused_503 = bool(
        len(answered)
        and (answered.status == 503).all()
        and answered.error_type.isin(["draining", "shutdown"]).all()
        and answered.retry_after.notna().all()
    )
    resumable_told = streams[streams.resumable]
    told = bool(
        len(resumable_told) and ((resumable_told.ended_by == "done") | (resumable_told.error_type == "shutdown")).all()
    )
    reconnect = tables["reconnect"]
    return [
        Verdict(
            "drain ends every open stream",
            "On SIGTERM every open stream ends with its done or an error event of type shutdown; none is cut",
            "any stream that ends without a terminal event, or with another error",
            bool(ended_ok.all() and len(streams)),
            f"{int((streams.ended_by == 'done').sum())} done, {int((streams.error_type == 'shutdown').sum())} "
            f"ended by error: shutdown, {int((~ended_ok).sum())} otherwise, of {len(streams)}",
        ),
        Verdict(
            "drain refuses new work",
            "A request that reaches the server during the drain gets 503 with Retry-After (type draining; "
            "shutdown for one admitted at the very moment of the signal and ended by the drain)",
            "any answered request during the drain with another status, or none answered at all",
            refused_503,
            f"{len(answered)} answered: {answered.groupby(['status', 'error_type']).size().to_dict() if len(answered) else {}}, "
            f"then {len(probes) - len(answered)} refused at the socket",
        ),
        Verdict(
            "exits within its drain timeout",
            "The process exits 0 within drain_grace of the signal (plus the interpreter's exit)",
            "a non-zero exit, or an exit later than drain_grace + 2 s",
            bool(process.exit_code == 0 and process.exited_after_s <= config.drain_grace + 2.0),
            f"exit code {process.exit_code} after {process.exited_after_s:.2f} s (drain_grace {config.drain_grace:g} s)",
        ),
        Verdict(
            "a resumable client is told why",
            "A resumable stream's client reads an error event of type shutdown (or its done); "
            "after the restart its resume gets 404, as an unknown id does",
            "a resumable stream cut without the event, or a restarted server that answers its resume otherwise",
            bool(told and len(reconnect) and (reconnect.status == 404).all()),
            f"resume after restart: statuses {sorted(set(reconnect.status))}",
        ),
    ]


def summary(tables: dict[str, pd.DataFrame]) -> dict[str, Any]:
    p = tables["process"].iloc[0]
    return {
        "exited_after_s": round(float(p.exited_after_s), 3),
        "exit_code": int(p.exit_code),
        "ended_by": tables["streams"].ended_by.value_counts().to_dict(),
        "probe_statuses": tables["probes"].status.value_counts(dropna=False).to_dict() if len(tables["probes"]) else {},
    }


def plot(tables: dict[str, pd.DataFrame]) -> list:
    from labkit.plots import new_figure

    timeline, probes, streams = tables["timeline"], tables["probes"], tables["streams"]
    fig, (ax,) = new_figure("drain_timeline", width=8.0)
    labels = []
    for i, s in enumerate(streams.itertuples()):
        mine = timeline[(timeline.stream == s.stream) & timeline.what.str.endswith(" token")]
        ax.plot(mine.t, [i] * len(mine), "|", color="C0", markersize=7)
        end = timeline[(timeline.stream == s.stream) & timeline.what.str.match(r"stream \d+ (done|error)$")]
        ax.plot(
            end.t, [i] * len(end), "s" if s.ended_by == "error" else "o", color="C3" if s.ended_by == "error" else "C2"
        )
        labels.append(f"stream {s.stream}{' (resumable)' if s.resumable else ''}")
    row = len(labels)
    if len(probes):
        colors = ["C1" if st == 503 else "0.5" for st in probes.status]
        ax.scatter(probes.t, [row] * len(probes), c=colors, marker="v", zorder=3)
    labels.append("new requests (orange 503, grey refused)")
    exited = timeline[timeline.what == "process exited"].t
    ax.axvline(0, color="k", linewidth=1)
    for t in exited:
        ax.axvline(t, color="C3", linestyle="--", linewidth=1)
    ax.set_yticks(range(len(labels)), labels)
    ax.invert_yaxis()
    ax.set_xlim(left=-0.5)  # the last half second before the signal: tokens were flowing
    ax.set(
        xlabel="seconds since SIGTERM (black); the process exits at the red dashed line",
        title="Drain: open streams end (square: error shutdown, dot: done), new requests get 503",
    )
    return [fig]


def report(tables: dict[str, pd.DataFrame], config: Config) -> str:
    """Numbers-free lines for an nbval-checked cell; the exit time is a timing and stays unchecked."""
    from labkit.experiments.readings import verdict_lines

    return verdict_lines(v for v in verdicts(tables, config) if v.name != "exits within its drain timeout")
