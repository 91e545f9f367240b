"""Probing an OpenAI-compatible server before measuring it: is it there, and how does it stream.

A measurement means something only when its requests did what was asked, and servers differ in
ways a request cannot see in advance: ``[DONE]``, usage in streams, ``stream_options``, a way to
generate past end-of-sequence, and whether labkit's own witnesses (``/stats``, lab routes,
``/metrics``) answer. A handful of small requests, each bounded in time and size and the whole
probe in time, answers each question, by asking, never by the server's name.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import pandas as pd

from labkit.lab.client import get_json
from labkit.lab.stream import API, ReadOptions, Stream
from labkit.lab.target import EOS_FLAGS, Quirks, Target, TargetError

__all__ = ["connect", "probe", "quirks_table", "PROBE_TIMEOUT_S"]

PROMPT = "The lighthouse keeper counted the ships every evening, writing their names in a ledger"
TOKENS = 8
PROBE_TIMEOUT_S = 20.0  # each probe request
MAX_MODELS, MAX_MODEL_ID = 64, 512  # model ids read from /v1/models, and the longest kept
PROBE_BUDGET_S = 120.0  # the whole probe


def connect(
    url: str, *, model: str | None = None, api: API = "openai", pid: int | None = None, api_key: str | None = None,
    extra_body: dict[str, Any] | None = None, name: str = "",
) -> Target:  # fmt: skip
    """A probed :class:`Target` for ``url``, or :class:`TargetError` saying why it cannot be measured."""
    target = Target(url, api=api, model=model, pid=pid, api_key=api_key, extra_body=extra_body, name=name)
    if pid is not None and not target.caps.cpu:
        raise TargetError(target.url, f"--target-pid {pid} is not a process on this machine")
    return probe(target)


def probe(target: Target) -> Target:
    """Probe ``target`` in place (its model, witnesses and quirks) and return it: a server the lab
    started (a :class:`~labkit.lab.target.Process`) is measured with what a probe finds, too."""
    api = target.api
    deadline = time.monotonic() + PROBE_BUDGET_S
    models, listed = _models(target)
    if target.model is None and models:
        target.model = models[0]
    target.caps = replace(target.caps, **_witnesses(target))
    if api == "labkit":
        return target
    plain = _stream(target, deadline, usage=False, eos=False)
    if not plain.ok:
        raise TargetError(target.url, f"POST {_path(target)} (stream) failed: {plain.failure}{_hint(plain, listed)}")
    if not any("choices" in e.data for e in plain.events):
        raise TargetError(target.url, f"POST {_path(target)} streamed no completion chunks (not an OpenAI stream?)")
    asked = _stream(target, deadline, eos=False)
    flags: dict[str, str] = {}
    for flag in EOS_FLAGS:
        target.quirks = replace(target.quirks, eos_flag=flag)
        reading = _stream(target, deadline, usage=False)
        flags[flag] = _what_flag_did(reading, tested=plain.finish_reason != "length")
    ran = [f for f, what in flags.items() if what.startswith(("works", "accepted (untested"))]
    target.quirks = Quirks(
        models=models,
        models_listed=listed,
        sends_done=any(e.data.get("raw") == "[DONE]" for e in plain.events),
        usage_when_asked=asked.ok and asked.usage is not None,
        usage_unasked=plain.usage is not None,
        stream_options_accepted=asked.ok,
        eos_flags=flags,
        eos_flag=ran[0] if ran else None,
        eos_reached_without_flag=plain.finish_reason != "length",
    )
    return target


def _path(target: Target) -> str:
    return target.request(PROMPT, TOKENS).path


def _stream(target: Target, deadline: float, *, usage: bool = True, eos: bool = True) -> Stream:
    left = deadline - time.monotonic()
    if left <= 1:
        raise TargetError(target.url, f"the probe took longer than its {PROBE_BUDGET_S:g} s budget")
    request = target.request(PROMPT, TOKENS, ignore_eos=eos)
    if not usage and request.body is not None:
        request.body.pop("stream_options", None)
    if usage and request.body is not None and target.api != "labkit":
        request.body["stream_options"] = {"include_usage": True}
    return target.read(request, ReadOptions(timeout=min(PROBE_TIMEOUT_S, left), max_bytes=1 << 20, max_events=1000))


def _what_flag_did(reading: Stream, tested: bool) -> str:
    if not reading.ok:
        return f"refused ({reading.failure})"
    if reading.finish_reason == "length" and reading.tokens >= TOKENS:
        return "works (ran past eos)" if tested else "accepted (untested: eos not reached without it)"
    return f"accepted; ended at {reading.tokens} tokens ({reading.finish_reason})"


def _hint(reading: Stream, listed: str) -> str:
    return (
        f"; GET /v1/models: {listed}: not an OpenAI-compatible API?"
        if reading.status == 404 and listed != "yes"
        else ""
    )


def _models(target: Target) -> tuple[tuple[str, ...], str]:
    """The model ids ``GET /v1/models`` lists, and "yes" or why there are none."""
    try:
        status, body = get_json(target.url, "/v1/models", timeout=PROBE_TIMEOUT_S, headers=target.headers)
    except OSError as exc:
        raise TargetError(target.url, str(exc)) from None
    if status != 200:
        return (), f"HTTP {status}"
    try:  # a name every request will carry: the first few, of a sane length
        ids = tuple(str(m["id"]) for m in body["data"][:MAX_MODELS])
    except (KeyError, TypeError):
        return (), "not an OpenAI model list"
    sane = tuple(i for i in ids if 0 < len(i) <= MAX_MODEL_ID)
    return sane, "yes" if sane else f"no model id of 1 to {MAX_MODEL_ID} characters"


def _witnesses(target: Target) -> dict[str, bool]:
    """Which of labkit's witnesses answer: native events, /stats, lab routes, /metrics."""

    def answers(path: str, key: str | None) -> bool:
        try:
            status, body = get_json(target.url, path, timeout=5.0, headers=target.headers)
        except OSError:
            return False
        return status == 200 and (key is None or (isinstance(body, dict) and key in body))

    stats = answers("/stats", "free_blocks")
    metrics = answers("/metrics", None)
    lab = stats and answers("/lab/steps?since=4611686018427387904", "step")
    return {"stats": stats, "native": stats and target.api == "labkit", "lab": lab, "metrics": metrics}


def quirks_table(target: Target) -> pd.DataFrame:
    """What the probe found, one question a row."""
    q, caps = target.quirks, target.caps
    eos = "; ".join(f"{flag}: {what}" for flag, what in q.eos_flags.items()) or "not probed"
    yes = {True: "yes", False: "no"}
    rows = [
        ("target", target.url),
        ("route", f"POST {_path(target)} (stream)"),
        ("models listed by GET /v1/models", ", ".join(q.models) if q.models else f"none ({q.models_listed})"),
        ("model requested", target.model or "(none: the server's default)"),
        ("ends streams with data: [DONE]", yes[q.sends_done]),
        ("usage in streams with stream_options.include_usage", yes[q.usage_when_asked]),
        ("usage in streams without asking", yes[q.usage_unasked]),
        ("stream_options accepted", yes[q.stream_options_accepted]),
        ("eos reached in the probe without a flag", yes[q.eos_reached_without_flag]),
        ("ways to ignore eos", eos),
        ("used to ignore eos", q.eos_flag or "none found: streams may end before max_tokens"),
        *((f"witness: {cap}", "yes" if getattr(caps, cap) else f"no: {caps.why_not(cap)}") for cap in
          ("native", "lab", "stats", "metrics", "cpu")),
    ]  # fmt: skip
    return pd.DataFrame(rows, columns=["question", "answer"])
