"""Notebook 01, the wire, against any target. :data:`RAW`: streams captured byte for byte by the
raw reader (``curl --raw``): one short one by line and by chunk, and every capture's chunks counted
as holding one SSE event, part of one, or several. :data:`CONTRACT`: every prompt streamed and
answered whole, each stream checked as a client relies on it (two missing values are not equal;
checks that need labkit's events are "not measurable" against others), with bytes per token.
:data:`~labkit.experiments.wire_cases.AWKWARD`: the awkward cases, through two parsers.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

import pandas as pd

from labkit.experiments import published
from labkit.experiments.wire_cases import AWKWARD, escaped
from labkit.lab import Experiment, NotMeasurable, ReadOptions, Sizes, Stream, Trial, judge, span, spread
from labkit.lab.client import async_client, run_sync
from labkit.lab.stream import TimedEvent
from labkit.lab.target import Caps
from labkit.prompts import PROMPTS

# --------------------------------------------------------------------------- raw bytes


def dechunk(body: bytes) -> list[tuple[str, bytes]]:
    """A chunked body as (size line, payload) pairs, the closing zero-size chunk included."""
    chunks, pos = [], 0
    while pos < len(body) and (end := body.find(b"\r\n", pos)) >= 0:
        line = body[pos:end].decode("latin-1")
        size = int(line.split(";")[0], 16)
        chunks.append((line, body[end + 2 : end + 2 + size]))
        pos = end + 4 + size
        if size == 0:
            break
    return chunks


def chunk_kinds(payloads: list[bytes]) -> list[str]:
    """Each non-empty chunk: ``one`` whole SSE block (ending just past its blank line), ``part`` of one, ``several``."""
    ends, line_start, sse = set(), 0, b"".join(payloads)
    for match in re.finditer(rb"\r\n|\r|\n", sse):
        ends.update([match.end()] if match.start() == line_start else [])
        line_start = match.end()
    kinds, at = [], 0
    for payload in filter(None, payloads):
        start, at = at, at + len(payload)
        inside = sum(1 for e in ends if start < e <= at)
        kinds.append("several" if inside > 1 else "one" if inside and start in ends | {0} and at in ends else "part")
    return kinds


def measure_raw(trial: Trial) -> list[dict[str, Any]]:
    target, s = trial.target, trial.sizes
    if not target.url.startswith("http://"):
        raise NotMeasurable("raw bytes", "the raw reader speaks plain http only")
    options = ReadOptions(keep_wire=True, timeout=120)
    tokens = [s.short_tokens] + [s.tokens] * s.captures
    requests = [target.request(PROMPTS[i % len(PROMPTS)], n) for i, n in enumerate(tokens)]
    rows = []
    for i, stream in enumerate(target.launch(requests, options).streams):
        head, _, body = bytes(stream.wire).partition(b"\r\n\r\n")
        if not re.search(rb"(?im)^transfer-encoding:\s*chunked", head):
            raise NotMeasurable("chunk framing", "its streams are not sent with chunked transfer encoding")
        kinds = chunk_kinds([p for _, p in dechunk(body)])
        rows.append({"stream": i, "tokens": stream.tokens, "events": len(stream.events), "bytes": len(stream.wire),
                     "chunks": len(kinds), **{k: kinds.count(k) for k in ("one", "part", "several")},
                     "failure": stream.failure})  # fmt: skip
        if i == 0:
            trial.keep("raw", [{"line": escaped(x)} for x in re.findall(rb"[^\n]*\n|[^\n]+$", bytes(stream.wire))])
            trial.keep("chunks", [{"size line": x, "bytes": len(p), "payload": escaped(p)} for x, p in dechunk(body)])
    return rows


def raw_verdicts(tables: dict[str, pd.DataFrame], s: Sizes) -> list:
    rows = tables["rows"]
    chunks, one = int(rows.chunks.sum()), int(rows.one.sum())
    return [judge("each event travels in an HTTP chunk of its own", "the server writes one event per chunk",
                  "any chunk of any capture holds part of an event or several", chunks > 0 and one == chunks,
                  f"{one} of {chunks} chunks hold one whole event ({int(rows.part.sum())} part, "
                  f"{int(rows.several.sum())} several) in {len(rows)} streams", checked=True)]  # fmt: skip


RAW = Experiment(
    name="wire.raw", title="Streams as the bytes on the socket: the head, the chunks, the events",
    sizes={"full": {"short_tokens": 3, "captures": 16, "tokens": 32},
           "ci": {"short_tokens": 3, "captures": 8, "tokens": 16}},
    measure=measure_raw, verdicts=raw_verdicts,
    chapter={"captures": (0, "the chapter showed one short stream only; counting chunks needs many (issue 21)")},
)  # fmt: skip

# --------------------------------------------------------------------------- the contract

same = lambda a, b: a is not None and a == b  # noqa: E731 - two missing values are not the same answer
CHECKS = (  # (column, what it checks); the last three need labkit's native events
    ("content_type", "media type text/event-stream (charset utf-8 where given)"),
    ("order", "events in order (labkit: start, token..., done; OpenAI: [role], token..., finish, [usage], [DONE])"),
    ("text", "text identical to the whole answer's"), ("usage", "usage identical to the whole answer's"),
    ("finish_reason", "finish reason identical to the whole answer's"),
    ("nothing_cut", "the stream reached its own end, nothing unfinished"),
    ("request_id", "X-Request-ID equals the start event's request_id"),
    ("token_ids", "token ids identical to the whole answer's"), ("last_event_id", "last event id = number of events"),
)  # fmt: skip
ORDER = {"labkit": r"st*d", "openai": r"r?t*fu?D?", "openai-chat": r"r?t*fu?D?"}


def piece(event: TimedEvent) -> str | None:
    """The text an event carries: labkit's token text, or an OpenAI chunk's text or delta content."""
    choice = (event.data.get("choices") or [{}])[0]
    return event.data.get("text", choice.get("text", (choice.get("delta") or {}).get("content")))


def kind(event: TimedEvent, api: str) -> str:
    """labkit: the event's name; OpenAI: role, token (as the lab's Stream counts one), finish, usage, [DONE], error."""
    data, choices = event.data, event.data.get("choices") or []
    if api == "labkit" or data.get("raw") == "[DONE]" or "error" in data:
        return event.event if api == "labkit" else "error" if "error" in data else "[DONE]"
    if any(c.get("finish_reason") is not None for c in choices) or not choices:
        return "finish" if choices else "usage" if data.get("usage") else "error"
    return "token" if piece(event) or "role" not in (choices[0].get("delta") or {}) else "role"


def contract_row(streamed: Stream, whole: Stream) -> dict[str, Any]:
    api, events = streamed.api, streamed.events
    body = whole.body if whole.error is None and isinstance(whole.body, dict) else {}
    choice = (body.get("choices") or [{}])[0]
    answer = body if api == "labkit" else {"usage": body.get("usage"), "finish_reason": choice.get("finish_reason"),
                                            "text": choice.get("text", (choice.get("message") or {}).get("content"))}  # fmt: skip
    kinds = [kind(e, api) for e in events]
    media = [p.strip().lower() for p in streamed.content_type.split(";")]
    letters = "".join({"start": "s", "done": "d", "[DONE]": "D"}.get(k, k[0]) for k in kinds)
    row: dict[str, Any] = {
        "content_type": media[0] == "text/event-stream" and all(p == "charset=utf-8" for p in media[1:] if "=" in p),
        "order": re.fullmatch(ORDER[api], letters) is not None, "text": same(streamed.text, answer.get("text")),
        "usage": same(streamed.usage, answer.get("usage")),
        "finish_reason": same(streamed.finish_reason, answer.get("finish_reason")),
        "nothing_cut": streamed.ok and streamed.unfinished_bytes == 0}  # fmt: skip
    if api == "labkit":
        indices = [e.data.get("index") for e, k in zip(events, kinds) if k == "token"]
        row.update(order=row["order"] and indices == list(range(len(indices))),
                   request_id=same(streamed.request_id, (events[0].data if events else {}).get("request_id")),
                   token_ids=same(streamed.token_ids, answer.get("token_ids")),
                   last_event_id=streamed.last_event_id == str(len(events)))  # fmt: skip
    tokens = [e for e, k in zip(events, kinds) if k == "token"]
    row.update(tokens=streamed.tokens, finish=streamed.finish_reason, bytes=streamed.total_bytes,
               token_event_bytes=sum(e.nbytes for e in tokens), empty_deltas=sum(1 for e in tokens if not piece(e)),
               failure=streamed.failure or whole.error)  # fmt: skip
    return row


async def _contract(trial: Trial) -> list[dict[str, Any]]:
    target, s = trial.target, trial.sizes
    gate = asyncio.Semaphore(s.concurrency)
    async with async_client(target.url, 2 * s.concurrency, 300.0) as client:

        async def one(i: int) -> dict[str, Any]:
            requests = [target.request(PROMPTS[i % len(PROMPTS)], s.tokens, stream=how) for how in (True, False)]
            async with gate:
                streamed, whole = await asyncio.gather(*(target.stream(r, client=client) for r in requests))
            return {"prompt": i, **contract_row(streamed, whole)}

        return list(await asyncio.gather(*(one(i) for i in range(s.prompts))))


def contract_tables(tables: dict[str, pd.DataFrame], s: Sizes) -> dict[str, pd.DataFrame]:
    rows = tables["rows"].assign(bytes_per_token=lambda t: t.bytes / t.tokens, token_event_mean=lambda t:
                                 t.token_event_bytes / t.tokens, token_share=lambda t: t.token_event_bytes / t.bytes)  # fmt: skip
    gone = f"not measurable against this target, because {Caps().why_not('native')}"
    checks = pd.DataFrame([{"check": what, "passed": rows[c].astype(bool).sum() if c in rows else None,
                            "streams": len(rows), "note": "" if c in rows else gone} for c, what in CHECKS])  # fmt: skip
    full = rows[rows.finish == "length"]
    passing = int(rows[[c for c, _ in CHECKS if c in rows]].astype(bool).all(axis=1).sum())
    chapter = published("wire")
    beside = [
        ("streams passing every check", chapter["streams_passing"], f"{passing} of {len(rows)}", "streams"),
        ("streams run to their token limit", chapter["streams_to_limit"], f"{len(full)} of {len(rows)}", "streams"),
        ("bytes per token, whole stream", chapter["bytes_per_token"], span(full.bytes_per_token, "{:.1f}"), "bytes"),
        (f"one {s.tokens}-token stream", chapter["one_stream_bytes"], span(full.bytes, "{:,.0f}"), "bytes"),
        ("one token event (a stream's mean)", "—", span(full.token_event_mean, "{:.0f}"), "bytes"),
        ("token events with an empty delta", chapter["empty_deltas"],
         f"{int(rows.empty_deltas.sum()):,} of {int(rows.tokens.sum()):,}", "events"),
    ]  # fmt: skip
    return {"rows": rows, "checks": checks.astype({"passed": "Int64"}),
            "sizes": spread(full, "tokens", ["bytes", "bytes_per_token", "token_event_mean", "token_share"]),
            "beside_chapter": pd.DataFrame(beside, columns=["quantity", "chapter (GPU)", "this run", "unit"])}  # fmt: skip


def contract_verdicts(tables: dict[str, pd.DataFrame], s: Sizes) -> list:
    checks, rows = tables["checks"], tables["rows"]
    measured = checks[checks.passed.notna()]
    failed, missing = list(measured.check[measured.passed < measured.streams]), len(checks) - len(measured)
    share = rows[rows.finish == "length"].token_share
    return [
        judge("every stream keeps the client's contract", "each stream passes every check of the checks table",
              "any check fails for any stream", bool(len(rows)) and not failed,
              ("failed: " + "; ".join(failed) if failed else f"all {len(measured)} checks passed by all {len(rows)} "
               "streams") + (f"; {missing} not measurable against this target" if missing else ""), checked=True),
        judge("token events carry most of a stream's bytes", "start and done are fixed costs a stream spreads over "
              "its tokens", "the median share of token-event bytes in streams that ran to their limit is below one "
              "half", None if share.dropna().empty else float(share.median()) >= 0.5,
              f"token events: {span(share * 100, '{:.0f}', '%')} of the bytes ({len(share)} streams)", checked=True),
    ]  # fmt: skip


CONTRACT = Experiment(
    name="wire.contract", title="Every prompt streamed and answered whole: the client's checks, bytes per token",
    sizes={"full": {"prompts": 40, "tokens": 32, "concurrency": 8},
           "ci": {"prompts": 12, "tokens": 16, "concurrency": 4}},
    measure=lambda trial: run_sync(_contract(trial)), tables=contract_tables, verdicts=contract_verdicts,
    chapter={"prompts": (40, "a test run: fewer prompts"), "tokens": (32, "a test run: shorter streams")},
)  # fmt: skip

SPECS = (RAW, CONTRACT, AWKWARD)
