"""What a server says about itself, read over HTTP (or ``/proc``), never from its objects.

Each witness needs a capability of the target (:class:`~labkit.lab.target.Caps`) and raises
:class:`~labkit.lab.target.NotMeasurable` without it: labkit's lab routes give the step log
(``GET /lab/steps``), per-stream records (``GET /lab/streams``) and a cache check run on the step
thread between two steps (``GET /lab/integrity``); ``/stats`` gives labkit's counters;
``/metrics`` any Prometheus server's; the process's CPU time comes from ``/proc/PID/stat``. The
step log and the records carry the server's ``time.perf_counter()``: on one machine (a thread or a
process) that is the client's clock too.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import pandas as pd

from labkit.lab.client import get_json

__all__ = ["Books", "step_table", "wait_for", "until", "WaitTimeout"]

STEP_COLUMNS = ["step", "started", "seconds", "decoded", "prefilled", "prefill_tokens", "surge"]
IDS_PER_REQUEST = 100


class WaitTimeout(TimeoutError):
    """A bounded wait ran out; the message says what it waited for and the last answer."""


def wait_for(check: Any, *, timeout: float, what: str, interval: float = 0.02) -> Any:
    """Call ``check`` until it returns something truthy and return that; :class:`WaitTimeout`
    after ``timeout`` seconds (it runs at least once)."""
    deadline = time.monotonic() + timeout
    while True:
        answer = check()
        if answer:
            return answer
        if time.monotonic() >= deadline:
            raise WaitTimeout(f"gave up after {timeout:g} s waiting for {what} (last answer: {answer!r:.200})")
        time.sleep(interval)


async def until(check: Any, *, timeout: float, what: str, interval: float = 0.005) -> Any:
    """:func:`wait_for` inside a running event loop (``check`` is called on the loop, so it must not
    block): what ``check`` returned once truthy; :class:`WaitTimeout` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not (answer := check()):
        if time.monotonic() >= deadline:
            raise WaitTimeout(f"gave up after {timeout:g} s waiting for {what} (last answer: {answer!r:.200})")
        await asyncio.sleep(interval)
    return answer


def step_table(records: list[dict[str, Any]]) -> pd.DataFrame:
    return pd.DataFrame(records, columns=STEP_COLUMNS)


class Books:
    """The server's own books, for :class:`~labkit.lab.target.Target`."""

    url: str
    caps: Any
    pid: int | None
    headers: dict[str, str]

    def need(self, *caps: str, what: str = "this measurement") -> None:  # defined by Target
        raise NotImplementedError

    def _get(self, path: str, timeout: float = 30.0) -> Any:
        status, body = get_json(self.url, path, timeout=timeout, headers=self.headers)
        if status != 200:
            raise OSError(f"GET {path}: HTTP {status}: {str(body)[:200]}")
        return body

    def stats(self) -> dict[str, Any]:
        """labkit's ``GET /stats``: running, waiting, blocks, releases, finishes, step."""
        self.need("stats", what="the server's counters")
        return dict(self._get("/stats"))

    def deadline_readings(self) -> list[dict[str, Any]]:
        """The deadline gate's ledger, oldest first: deadline_s, predicted_s, steps, step_s, refused."""
        self.need("lab", what="the deadline gate's readings")
        return list(self._get("/lab/deadline")["readings"])

    def current_step(self) -> int:
        self.need("lab", what="the engine's step clock")
        return int(self._get(f"/lab/steps?since={2**62}")["step"])

    def steps(self, since: int = 0) -> pd.DataFrame:
        """The engine's steps numbered above ``since``: started, seconds, decoded, prefilled (prompts),
        prefill_tokens (their chunks' tokens) and surge (whether they had the surge budget)."""
        self.need("lab", what="the engine's step log")
        return step_table(self._get(f"/lab/steps?since={since}")["steps"])

    def records(self, rids: list[str | None]) -> list[dict[str, Any] | None]:
        """The server's record of each stream (None for an unknown or missing id), in order."""
        self.need("lab", what="the server's stream records")
        asked = [rid for rid in rids if rid]
        found: dict[str, Any] = {}
        for first in range(0, len(asked), IDS_PER_REQUEST):
            part = asked[first : first + IDS_PER_REQUEST]
            found.update(zip(part, self._get(f"/lab/streams?ids={','.join(part)}")["streams"]))
        return [found.get(rid) if rid else None for rid in rids]

    def records_since(self, clock: float) -> list[dict[str, Any]]:
        """Every stream the server took after its clock read ``clock``."""
        self.need("lab", what="the server's stream records")
        return list(self._get(f"/lab/streams?since={clock!r}")["streams"])

    def clock(self) -> float:
        """The server's ``perf_counter`` now (to tell a run's records from earlier ones)."""
        self.need("lab", what="the server's clock")
        return float(self._get("/lab/streams?since=inf")["clock"])

    def released(self, rids: list[str | None], timeout: float = 60.0) -> list[dict[str, Any] | None]:
        """The records once each shows its sequence left the engine; at ``timeout``, as they are
        (a stream still held then is a finding, not a reason to lose the other rows)."""
        latest: list[dict[str, Any] | None] = []

        def all_released() -> bool:
            latest[:] = self.records(rids)
            return all(r is None or r["released"] is not None for r in latest)

        try:
            wait_for(all_released, timeout=timeout, what="the streams' release", interval=0.02)
        except WaitTimeout:
            pass
        return latest

    def idle_books(self, timeout: float = 30.0) -> dict[str, Any]:
        """Once the server is idle (bounded wait): is the cache whole, is anything still held or
        registered? The cache check runs on the step thread between two steps."""
        self.need("lab", what="the server's cache books")
        self.wait_idle(timeout)
        answer = self._get("/lab/integrity", timeout=timeout + 30.0)
        s = answer["stats"]
        return {
            "cache_whole": bool(answer["ok"] and s["free_blocks"] == s["total_blocks"]),
            "held_blocks": s["held_blocks"],
            "running": s["running"],
            "waiting": s["waiting"],
            "open_streams": s["open_streams"],
            "what": answer["what"],
        }

    def wait_idle(self, timeout: float = 30.0) -> bool:
        """Until ``/stats`` shows nothing running, waiting or open (bounded); False at the bound."""

        def idle() -> bool:
            s = self.stats()
            return s["running"] == 0 and s["waiting"] == 0 and s["open_streams"] == 0

        try:
            return bool(wait_for(idle, timeout=timeout, what="an idle server"))
        except WaitTimeout:
            return False

    def metrics(self) -> dict[str, float]:
        """A Prometheus ``GET /metrics`` as ``{"name{labels}": value}`` (prometheus-client's parser)."""
        from prometheus_client.parser import text_string_to_metric_families

        self.need("metrics", what="the server's metrics")
        status, text = get_json(self.url, "/metrics", headers=self.headers)
        if status != 200 or not isinstance(text, str):
            raise OSError(f"GET /metrics: HTTP {status}")
        out = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
                out[f"{sample.name}{{{labels}}}" if labels else sample.name] = float(sample.value)
        return out

    def cpu_seconds(self) -> float:
        """User plus system CPU seconds of the server's process so far (``/proc/PID/stat``)."""
        self.need("cpu", what="the server's CPU time")
        with open(f"/proc/{self.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
