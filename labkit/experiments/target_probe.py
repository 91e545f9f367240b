"""Probing a target before measuring it: is it there, does it speak OpenAI's streams, and how.

Why: a measurement means something only when the requests behind it did what was asked, and
servers differ in ways a request cannot see in advance (``[DONE]``, usage in streams,
``stream_options``, a way to generate past end-of-sequence). A handful of small requests answers
each question; :func:`quirks_table` shows the answers, and the :class:`Quirks` they fill in shape
every later request. A target that cannot be measured at all raises :class:`TargetError`.
"""

from __future__ import annotations

import os
from dataclasses import replace

import httpx
import pandas as pd

from labkit.experiments.target import (
    API,
    EOS_FLAGS,
    Quirks,
    Reading,
    Target,
    TargetError,
)

__all__ = ["connect", "cpu_seconds", "probe", "quirks_table"]

PROBE_PROMPT = "The lighthouse keeper counted the ships every evening, writing their names in a ledger"
PROBE_TOKENS = 8


def connect(
    url: str,
    model: str | None = None,
    api: API = "openai",
    pid: int | None = None,
    timeout: float = 30.0,
    api_key: str | None = None,
) -> Target:
    """A probed :class:`Target`, or :class:`TargetError` saying why ``url`` cannot be measured."""
    target = Target(url, model, api, pid, timeout=timeout, api_key=api_key)
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
        raise TargetError(
            target.url, f"POST {target.path} (stream) failed: {plain.error}" + _hint(plain, listed, target, models)
        )
    if not any("choices" in event.data for event in plain.result.events):
        raise TargetError(target.url, f"POST {target.path} streamed no completion chunks (not an OpenAI stream?)")
    asked = target.stream(
        {**target.body(PROBE_PROMPT, PROBE_TOKENS, eos=False), "stream_options": {"include_usage": True}}
    )
    flags, flag = _eos_flags(target, tested=plain.finish_reason != "length")
    quirks = Quirks(
        models=models,
        models_listed=listed,
        sends_done=plain.done,
        usage_when_asked=asked.ok and asked.usage is not None,
        usage_unasked=plain.usage is not None,
        stream_options_accepted=asked.ok,
        eos_flags=flags,
        eos_flag=flag,
        eos_reached_without_flag=plain.finish_reason != "length",
        labkit_internals=_has_stats(target),
    )
    return replace(target, quirks=quirks)


def _hint(reading: Reading, listed: str, target: Target, models: tuple[str, ...]) -> str:
    """What the failure most likely means: no such API at all, or a model the server does not have."""
    if reading.result.status == 404 and listed != "yes":
        return f"; GET /v1/models: {listed}: not an OpenAI-compatible API?"
    if target.model is not None and models and target.model not in models:
        return f"; GET /v1/models lists: {', '.join(models)}"
    return ""


def _models(target: Target) -> tuple[tuple[str, ...], str]:
    """The model ids ``GET /v1/models`` lists, and "yes" or why there are none. Unreachable: refused."""
    try:
        with target.sync_client() as client:
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
    for flag in EOS_FLAGS:
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
        with target.sync_client(timeout=5.0) as client:
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
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def quirks_table(target: Target) -> pd.DataFrame:
    """What the probe found, one question a row, as the command line and the notebooks show it."""
    q = target.quirks
    eos = "; ".join(f"{flag}: {what}" for flag, what in q.eos_flags.items()) or "not probed"
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
