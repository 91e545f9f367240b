"""Experiment 1, ``wire``: what goes over the wire, checked event by event.

Each prompt is streamed from ``/v1/stream`` and answered whole by ``/v1/generate`` on the same
server. For every stream we check what a client relies on: the content type, the request id
header against the ``start`` event, the order start, token..., done, the same token ids, text,
usage and finish reason as the JSON answer, a last event id that matches the count of events, and
nothing left unfinished; and we count the bytes per token and the empty text deltas.

Before that, one short stream is captured byte for byte on a plain socket (``raw``, ``raw_chunks``),
and the article's awkward inputs are read by our parser and by httpx-sse (``awkward``); both
come from :mod:`labkit.experiments.wire_cases`. :func:`verdicts` judges the notebook's hypotheses.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

import pandas as pd

from labkit.experiments import wire_cases
from labkit.experiments.client import StreamResult, async_client, run_sync, timed_stream
from labkit.experiments.profiles import Profile
from labkit.experiments.progress import Progress, doing, tick
from labkit.experiments.readings import Verdict, current_step, fetch_steps, span
from labkit.experiments.servers import serving
from labkit.prompts import PROMPTS

NAME = "wire"

#: (column, what it checks) in the order the checks table lists them.
CHECKS = (
    ("content_type_ok", "media type text/event-stream; charset=utf-8"),
    ("request_id_matches", "X-Request-ID equals the start event's request_id"),
    ("order_ok", "events in the order start, token..., done"),
    ("ids_match", "token ids identical to /v1/generate"),
    ("text_matches", "text identical to /v1/generate"),
    ("usage_matches", "usage identical to /v1/generate"),
    ("finish_matches", "finish reason identical to /v1/generate"),
    ("last_id_ok", "last event id equals the number of events"),
    ("nothing_unfinished", "nothing unfinished at the end"),
)


@dataclass(frozen=True)
class Config:
    model: str = "smollm2-135m"
    prompts: int = 40
    max_new_tokens: int = 32
    concurrency: int = 8  # prompts in flight at once, each streamed and generated together
    raw_tokens: int = 3  # tokens of the one stream whose raw bytes are shown

    @classmethod
    def for_profile(cls, profile: Profile) -> Config:
        return cls(model=profile.model, prompts=40 if profile.full else 12, concurrency=8 if profile.full else 4)

    def __post_init__(self) -> None:
        for name in ("prompts", "max_new_tokens", "concurrency"):
            if getattr(self, name) < 1:
                raise ValueError(f"wire.Config.{name} must be >= 1, got {getattr(self, name)!r}")


def server_options(config: Config) -> dict[str, Any]:
    return {"model": config.model, "max_batch": max(2 * config.concurrency, 2)}


def units(config: Config) -> int:
    return config.prompts


def run(config: Config, *, server: Any = None, progress: Progress | None = None) -> dict[str, pd.DataFrame]:
    doing(progress, f"{config.prompts} prompts, each streamed and answered as JSON")
    with serving(server, **server_options(config)) as srv:
        first_step = current_step(srv.url)
        raw = capture(srv.url, config)
        rows = run_sync(_measure(srv.url, config, progress))
        steps = fetch_steps(srv.url, since=first_step)  # the engine's steps of this run
    events = _event_sizes(rows)  # takes each row's per-event list out before the table is built
    streams = pd.DataFrame(rows)
    _, body = wire_cases.split_head(raw)
    return {
        "streams": streams,
        "checks": checks_table(streams),
        "events": events,
        "raw": wire_cases.raw_lines(raw),
        "raw_chunks": wire_cases.chunk_table(body),
        "awkward": wire_cases.compare(),
        "steps": steps,
    }


RAW_PROMPT = "The capital of France is"


def capture(url: str, config: Config) -> bytes:
    """One short stream's bytes as they crossed the socket (see :func:`wire_cases.capture_raw`)."""
    body = json.dumps({"prompt": RAW_PROMPT, "max_new_tokens": config.raw_tokens}).encode()
    return wire_cases.capture_raw(url, "/v1/stream", body)


async def _measure(url: str, config: Config, progress: Progress | None) -> list[dict[str, Any]]:
    gate = asyncio.Semaphore(config.concurrency)
    async with async_client(url, connections=2 * config.concurrency) as client:

        async def one(i: int) -> dict[str, Any]:
            body = {"prompt": PROMPTS[i % len(PROMPTS)], "max_new_tokens": config.max_new_tokens}
            async with gate:
                stream, answer = await asyncio.gather(
                    timed_stream(client, body), client.post("/v1/generate", json=body)
                )
            tick(progress)
            return compare(i, stream, answer.json() if answer.status_code == 200 else {})

        return list(await asyncio.gather(*(one(i) for i in range(config.prompts))))


def compare(index: int, stream: StreamResult, answer: dict[str, Any]) -> dict[str, Any]:
    """One stream against its JSON answer: the checks of :data:`CHECKS`, sizes and times."""
    events = stream.events
    start = events[0].data if events and events[0].event == "start" else {}
    tokens = stream.tokens
    completion = len(tokens)
    return {
        "prompt": index,
        "status": stream.status,
        "content_type": stream.content_type,
        "content_type_ok": _is_event_stream(stream.content_type),
        "request_id_matches": bool(stream.request_id) and stream.request_id == start.get("request_id"),
        "order_ok": _in_order(stream),
        "ids_match": stream.token_ids == answer.get("token_ids"),
        "text_matches": stream.text == answer.get("text"),
        "usage_matches": stream.usage == answer.get("usage"),
        "finish_matches": stream.finish_reason == answer.get("finish_reason"),
        "last_id_ok": stream.last_event_id == str(len(events)),
        "nothing_unfinished": stream.unfinished_bytes == 0 and stream.error is None,
        "events": len(events),
        "tokens": completion,
        "finish_reason": stream.finish_reason,
        "bytes": stream.total_bytes,
        "bytes_per_token": stream.total_bytes / completion if completion else float("nan"),
        "empty_deltas": _empty_deltas(tokens, stream.finish_reason),
        "ttft_s": stream.ttft,
        "duration_s": stream.duration,
        "_events": [(e.event, e.nbytes) for e in events],
    }


def _empty_deltas(tokens: list, finish_reason: str | None) -> int:
    """Token events with no text, not counting a closing end-of-sequence token (it never has text)."""
    counted = tokens[:-1] if finish_reason == "eos" else tokens
    return sum(1 for e in counted if e.data.get("text") == "")


def _is_event_stream(content_type: str) -> bool:
    parts = [p.strip().lower() for p in content_type.split(";")]
    return parts[0] == "text/event-stream" and "charset=utf-8" in parts[1:]


def _in_order(stream: StreamResult) -> bool:
    kinds = [e.event for e in stream.events]
    if len(kinds) < 2 or kinds[0] != "start" or kinds[-1] != "done":
        return False
    middle = stream.events[1:-1]
    return all(e.event == "token" and e.data.get("index") == i for i, e in enumerate(middle))


def checks_table(streams: pd.DataFrame) -> pd.DataFrame:
    """How many of the streams passed each check: ``passed`` of ``streams``."""
    total = len(streams)
    rows = [{"check": text, "passed": int(streams[col].sum()), "streams": total} for col, text in CHECKS]
    rows.append(
        {
            "check": "token events with an empty text delta (end-of-sequence tokens not counted)",
            "passed": int(streams.empty_deltas.sum()),
            "streams": int(streams.tokens.sum()),
        }
    )
    return pd.DataFrame(rows)


def _event_sizes(rows: list[dict[str, Any]]) -> pd.DataFrame:
    """Every event's wire size, by kind: where the bytes of a stream go."""
    sizes = [{"prompt": r["prompt"], "event": kind, "bytes": n} for r in rows for kind, n in r.pop("_events")]
    return pd.DataFrame(sizes)


def full_length(streams: pd.DataFrame) -> pd.DataFrame:
    """Streams that ran to their token limit: per-token cost is comparable only between these,
    since a stream the model ends early spreads its start and done events over fewer tokens."""
    return streams[streams.finish_reason == "length"]


def summary(tables: dict[str, pd.DataFrame]) -> dict[str, Any]:
    streams, checks = tables["streams"], tables["checks"]
    return {
        "streams": len(streams),
        "all_checks_passed": bool((checks.passed[:-1] == checks.streams[:-1]).all()),
        "full_length_streams": int(full_length(streams).shape[0]),
        "bytes_per_token_min": float(full_length(streams).bytes_per_token.min()),
        "bytes_per_token_max": float(full_length(streams).bytes_per_token.max()),
        "token_event_bytes_median": float(tables["events"].query("event == 'token'").bytes.median()),
        "stream_bytes_median": float(streams.bytes.median()),
        "token_events": int(streams.tokens.sum()),
        "empty_deltas": int(streams.empty_deltas.sum()),
        "token_share_median": float(token_share(tables).median()),
        "raw_chunks": int((tables["raw_chunks"].bytes > 0).sum()),
        "awkward_cases": len(tables["awkward"]),
        "awkward_ours_follows": int(tables["awkward"]["ours follows the rule"].sum()),
        "awkward_httpx_sse_follows": int(tables["awkward"]["httpx-sse follows the rule"].sum()),
        "awkward_differ": int(tables["awkward"].differ.sum()),
    }


def token_share(tables: dict[str, pd.DataFrame]) -> pd.Series:
    """Per full-length stream, the share of its bytes that are token events (start and done are the rest)."""
    events = tables["events"]
    full = set(full_length(tables["streams"]).prompt)
    mine = events[events.prompt.isin(full)]
    total = mine.groupby("prompt").bytes.sum()
    return mine[mine.event == "token"].groupby("prompt").bytes.sum().reindex(total.index, fill_value=0) / total


def one_event_per_chunk(tables: dict[str, pd.DataFrame]) -> tuple[int, int]:
    """(chunks holding exactly one whole SSE event, chunks with a payload) in the raw capture."""
    chunks = tables["raw_chunks"]
    payloads = chunks[chunks.bytes > 0].payload
    whole = sum(1 for p in payloads if p.endswith("\\n\\n") and p.count("\\n\\n") == 1)
    return whole, len(payloads)


def verdicts(tables: dict[str, pd.DataFrame]) -> list[Verdict]:
    checks, awkward = tables["checks"], tables["awkward"]
    failed = [row.check for row in checks.iloc[: len(CHECKS)].itertuples() if row.passed != row.streams]
    wrong = list(awkward.loc[~awkward["ours follows the rule"], "case"])
    both = awkward["ours follows the rule"] & awkward["httpx-sse follows the rule"]
    disagree = list(awkward.loc[both & ~awkward["same events"], "case"])
    differ = awkward[awkward.differ]
    share = token_share(tables)
    whole, chunks = one_event_per_chunk(tables)
    return [
        Verdict(
            "every stream keeps the client's contract",
            "each stream passes every check of the checks table",
            "any check fails for any stream",
            not failed,
            "failed: " + ", ".join(failed)
            if failed
            else f"all {len(CHECKS)} checks passed by all {checks.streams.iloc[0]} streams",
        ),
        Verdict(
            "each event travels in an HTTP chunk of its own",
            "uvicorn writes each piece the service yields as one chunk, and the service yields one event per piece",
            "a chunk of the raw capture holds part of an event or more than one",
            chunks > 0 and whole == chunks,
            f"{whole} of {chunks} chunks hold exactly one event",
        ),
        Verdict(
            "our parser follows the WHATWG rules on every awkward case",
            "the events our parser dispatches are those the rules prescribe",
            "any awkward case gives other events than the rules say",
            not wrong,
            "departs on: " + ", ".join(wrong) if wrong else f"all {len(awkward)} cases as the rules say",
        ),
        Verdict(
            "where both follow the rules, the two parsers dispatch the same events",
            "httpx-sse is an independent implementation of the same rules",
            "a case both handle by the rules gives different events (not only a different read)",
            not disagree and bool(both.any()),
            f"{int(awkward.differ.sum())} of {len(awkward)} cases differ: "
            + "; ".join(f"{case}: {why}" for case, why in zip(differ["case"], differ["where and why"])),
        ),
        Verdict(
            "token events carry most of a stream's bytes",
            "the schema's start and done are fixed costs that a full-length stream spreads over its tokens",
            "the median share of token-event bytes in the streams that ran to their limit is below one half",
            bool(len(share)) and float(share.median()) >= 0.5,
            f"token events: {span(share * 100, '{:.0f}', '%')} of a full-length stream's bytes ({len(share)} streams)",
        ),
    ]


def findings(tables: dict[str, pd.DataFrame]) -> str:
    """What this run found, as Markdown rendered from its tables (no typed numbers)."""
    full = full_length(tables["streams"])
    token_bytes = tables["events"].query("event == 'token'").bytes
    return (
        f"In this run a stream that ran to its limit of {int(full.tokens.max()) if len(full) else 0} tokens cost "
        f"**{span(full.bytes_per_token, '{:.1f}')} bytes per token** (median, min–max over {len(full)} streams), "
        f"and one token event **{span(token_bytes, '{:.0f}')} bytes**; the whole stream "
        f"{span(full.bytes, '{:.0f}')} bytes. At that rate 300 tokens make a stream of "
        f"{span(full.bytes_per_token * 300 / 1024, '{:.0f}')} KiB."
    )


def report(tables: dict[str, pd.DataFrame]) -> str:
    """The invariant lines a notebook prints: the same text for any profile when every check holds."""
    rows = list(tables["checks"].itertuples())[: len(CHECKS)]
    return "\n".join(
        f"{row.check}: "
        + (
            "every stream"
            if row.passed == row.streams
            else f"{row.streams - row.passed} of {row.streams} streams FAILED"
        )
        for row in rows
    )


def plot(tables: dict[str, pd.DataFrame]) -> list:
    from labkit.plots import new_figure

    streams, events = tables["streams"], tables["events"]
    fig, (left, right) = new_figure("wire_bytes", ncols=2)
    full = streams.finish_reason == "length"
    left.bar(streams.prompt[full], streams.bytes_per_token[full], color="tab:blue", label="ran to its token limit")
    left.bar(
        streams.prompt[~full],
        streams.bytes_per_token[~full],
        color="lightgray",
        label="ended early (start and done over few tokens)",
    )
    left.set(xlabel="stream (prompt number)", ylabel="bytes per token", title="Wire cost per token, whole stream")
    left.legend(loc="upper right")
    kinds = [k for k in ("start", "token", "done") if k in set(events.event)]
    right.boxplot([events.loc[events.event == k, "bytes"] for k in kinds], tick_labels=kinds)
    right.set(ylabel="bytes on the wire", title="Size of one event, by kind")
    return [fig]
