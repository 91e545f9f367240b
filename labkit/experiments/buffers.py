"""Notebook 04: the buffers between the engine and a reader that stops reading.

:data:`FLOOD` (lab routes, the best witness): a client sends ``POST /lab/flood`` and reads nothing;
the server times its writes of events of one size, and the first slower than the block threshold
marks where it had to wait; the client reads ``FIONREAD`` and leaves by RST; ``tcp_wmem`` and
``tcp_rmem`` come from ``/proc`` in every trial. :data:`UNREAD` (any target): a client cannot see a
write block, only what waits. It holds streams unread, peeking at their receive buffers, until a
whole answer waits there through the end its framing marks, then reads: a writer whose last bytes
are already in the reader's buffer never waited for the reader.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import h11
import pandas as pd

from labkit import machine
from labkit.experiments import published
from labkit.lab import Experiment, NotMeasurable, ReadOptions, Request, Sizes, Stream, Trial, interval, judge, span
from labkit.lab.client import async_client, run_sync
from labkit.lab.verdict import spread, tell
from labkit.prompts import PROMPTS

MAX_PEEK = 4 * 1024 * 1024  # an ordinary answer is far smaller; a larger one is never seen whole: falsified
TRANSPORT_HIGH_WATER = 64 * 1024  # asyncio's default write-buffer high-water mark, which uvicorn keeps
LOOPBACK = ("127.0.0.1", "localhost", "::1")  # a server here has this machine's kernel and clock


def unread_bytes(sock: socket.socket) -> int:
    """Bytes waiting in this socket's receive buffer (``FIONREAD``), or not measurable here."""
    waiting = machine.unread_bytes(sock)
    if waiting is None:
        raise NotMeasurable("bytes waiting in the client's receive buffer", "this platform has no FIONREAD")
    return waiting


def kernel() -> dict[str, int | None]:
    """``net.ipv4.tcp_wmem`` and ``tcp_rmem`` (min, default, max bytes) from /proc; None where absent."""
    out: dict[str, int | None] = {f"{n}_{f}": None for n in ("tcp_wmem", "tcp_rmem") for f in ("min", "default", "max")}
    for name in ("tcp_wmem", "tcp_rmem"):
        with contextlib.suppress(OSError, ValueError):
            values = Path(f"/proc/sys/net/ipv4/{name}").read_text().split()
            out.update({f"{name}_{f}": int(v) for f, v in zip(("min", "default", "max"), values)})
    return out


# --------------------------------------------------------------------------- the flood


async def _poll(client: Any, flood_id: str, done: Any, timeout: float) -> dict[str, Any]:
    """``GET /lab/flood/{id}`` until ``done(record)`` or ``timeout``; the last record ({} if none)."""
    deadline, record = time.monotonic() + timeout, dict[str, Any]()
    while time.monotonic() < deadline and not (record and done(record)):
        await asyncio.sleep(0.02)
        record = answer.json() if (answer := await client.get(f"/lab/flood/{flood_id}")).status_code == 200 else record
    return record


async def _flood(trial: Trial) -> dict[str, Any]:
    target, s, size = trial.target, trial.sizes, trial.event_bytes
    flood_id = f"buffers-{size}-{uuid.uuid4().hex[:8]}"
    body = {"flood_id": flood_id, "event_bytes": size, "block_threshold": s.block_threshold_s,
            "count": max(1, min(1_000_000, s.flood_mib * 2**20 // size))}  # fmt: skip
    leave, result = asyncio.Event(), Stream()
    options = ReadOptions(read=False, leave_after_s=s.timeout_s, leave_by="rst", timeout=s.timeout_s)
    request = Request("/lab/flood", body, headers=target.headers)
    reader = asyncio.ensure_future(target.stream(request, options, result=result, leave=leave))
    async with async_client(target.url, 2, s.timeout_s) as poll:
        try:
            record = await _poll(poll, flood_id, lambda r: r["blocked"] or r["finished"], s.timeout_s)
            sock = result.socket  # the reader's, open until it leaves
            seen = {"client_unread_bytes": unread_bytes(sock) if sock else None,
                    "client_rcvbuf": sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) if sock else None}  # fmt: skip
        finally:
            leave.set()
            await reader
        final = await _poll(poll, flood_id, lambda r: r["finished"], s.timeout_s)
    return {"blocked": bool(record.get("blocked")), "bytes_accepted": record.get("bytes_accepted"),
            "events_accepted": record.get("events_accepted"), **seen, "server_finished": bool(final.get("finished")),
            "token_event_bytes": trial.state, "same_machine": urlsplit(target.url).hostname in LOOPBACK, **kernel()}  # fmt: skip


def token_event_bytes(target: Any, s: Sizes) -> float:
    """The median wire size of one ordinary token event, from a stream read to its end."""
    stream = target.read(target.request(PROMPTS[1], 16))
    return float(pd.Series([e.nbytes for e in stream.events if e.event == "token" or "choices" in e.data]).median())


def flood_tables(tables: dict[str, pd.DataFrame], s: Sizes) -> dict[str, pd.DataFrame]:
    rows = (r := tables["rows"]).assign(server_side_bytes=r.bytes_accepted - r.client_unread_bytes,
                                        token_events_held=r.bytes_accepted / r.token_event_bytes,  # no /proc: NaN
                                        **{c: pd.to_numeric(r[c]) for c in r.filter(regex="^tcp_")})  # fmt: skip
    kernel = rows.filter(regex="^tcp_").iloc[:1].astype(object).fillna("not available on this platform (no /proc)")
    beside = [(f"accepted before the write blocks, {n:,}-byte events", published("buffers").get(f"accepted_{n}", "—"),
               span(g.bytes_accepted, "{:,.0f}"), "bytes") for n, g in rows.groupby("event_bytes")]  # fmt: skip
    columns = ["bytes_accepted", "client_unread_bytes", "server_side_bytes", "events_accepted", "token_events_held"]
    return {"rows": rows, "by_size": spread(rows, "event_bytes", columns), "kernel": kernel,
            "beside_chapter": pd.DataFrame(beside, columns=["quantity", "chapter", "this run", "unit"])}  # fmt: skip


def flood_verdicts(tables: dict[str, pd.DataFrame], s: Sizes) -> list:
    rows, n = tables["rows"], len(tables["rows"])
    known = pd.notna(rows.tcp_wmem_max.iloc[0]) and bool(rows.same_machine.all())
    why = "" if known else "; the server's kernel limits are unknown here (not this machine, or no /proc)"
    bound = rows.tcp_wmem_max + rows.client_rcvbuf + TRANSPORT_HIGH_WATER + rows.event_bytes
    over, grown = int((rows.bytes_accepted > bound).sum()), int((rows.server_side_bytes > rows.tcp_wmem_default).sum())
    kib = lambda values: span(values / 1024, "{:.0f}", " KiB")  # noqa: E731
    medians = rows.groupby("event_bytes").bytes_accepted.median()
    hi, lo = medians.idxmax(), medians.idxmin()
    by = {k: rows.bytes_accepted[rows.event_bytes == k] for k in (hi, lo)}
    ratio = tell(interval(by[hi], others=by[lo]), 1.5, "below")
    return [
        judge("every flood blocks", "a client that reads nothing makes the server's write block once the buffers "
              "are full", "any flood ended, or hit the time limit, unblocked", n > 0 and bool(rows.blocked.all()),
              f"{int(rows.blocked.sum())} of {n} floods blocked", checked=True),
        judge("the server finishes after the leave", "after the client leaves by RST the server ends the response",
              "any flood's response was unfinished at the time limit", n > 0 and bool(rows.server_finished.all()),
              f"{int(rows.server_finished.sum())} of {n} finished", checked=True),
        judge("bounded by the kernel", "the path takes at most tcp_wmem's max, the client's receive buffer, the "
              "transport's high-water mark and one event", "any flood accepted more",
              over == 0 if known and bound.notna().all() and rows.bytes_accepted.notna().all() else None,
              f"{over} of {n} over; took {kib(rows.bytes_accepted)}, max {kib(rows.tcp_wmem_max)}{why}", checked=True),
        judge("the send buffer grows", "Linux grows the server's send buffer past tcp_wmem's default while data waits",
              "any flood held at most that default on the server's side (accepted minus the client's buffer)",
              grown == n if known and rows.server_side_bytes.notna().all() else None, f"{grown} of {n} above; server side {kib(rows.server_side_bytes)}, "
              f"default {kib(rows.tcp_wmem_default)}{why}", checked=True),
        judge("bytes, not events", "the buffers hold bytes: what they take hardly depends on the event size",
              "the 95% interval of the largest median over the smallest (by event size) lies above 1.5",
              ratio[0] if len(medians) > 1 else None, f"{hi:,}-byte over {lo:,}-byte events: {ratio[1]}"),
    ]  # fmt: skip


def flood_plots(tables: dict[str, pd.DataFrame], s: Sizes) -> list:
    from labkit.plots import new_figure

    rows, t = tables["rows"], tables["by_size"]
    fig, (ax,) = new_figure("buffers_accepted")
    label = {n: f"{n // 1024} KiB" if n >= 1024 else f"{n} B" for n in t.event_bytes}
    ax.plot(rows.event_bytes.map(label), rows.bytes_accepted / 1024, "o", alpha=0.6, label="accepted, each flood")
    for name, field, style in (("tcp_wmem", "max", "--"), ("tcp_rmem", "default", ":")):
        if pd.notna(rows[f"{name}_{field}"].iloc[0]):
            ax.axhline(rows[f"{name}_{field}"].iloc[0] / 1024, color="gray", ls=style, label=f"{name} {field} (kernel)")
    ax.set(xlabel="size of one event", ylabel="KiB accepted", title="A client that never reads", ylim=(0, None))
    ax.legend(fontsize="small")
    return [fig]


FLOOD_SIZES = {"repetitions": 6, "flood_mib": 32, "block_threshold_s": 0.2, "timeout_s": 30.0}
FLOOD = Experiment(
    name="buffers.flood", title="A client that never reads: bytes the path takes before the server's write blocks",
    sizes={"full": {"event_sizes": (133, 1024, 16384, 65536), **FLOOD_SIZES},
           "ci": {"event_sizes": (1024, 16384, 65536), **FLOOD_SIZES}},
    conditions=lambda s, target: [{"event_bytes": n} for n in s.event_sizes], prepare=token_event_bytes,
    measure=lambda trial: run_sync(_flood(trial)), tables=flood_tables, verdicts=flood_verdicts, plots=flood_plots,
    needs=("lab",), chapter={"event_sizes": ((133, 1024, 16384, 65536), "a test run leaves out the slowest flood")},
)  # fmt: skip

# --------------------------------------------------------------------------- an ordinary stream, unread


def answer_waiting(sock: socket.socket, most: int) -> bool | None:
    """Whether the bytes waiting unread in ``sock`` hold a whole answer, through the end its framing
    marks (the last chunk, or ``Content-Length``): peeked, so the reader later reads them all.
    None when the head says the answer ends only when the server closes: no peek can see that end."""
    waiting = unread_bytes(sock)
    if waiting <= 0:
        return False
    conn = h11.Connection(h11.CLIENT)
    conn.send(h11.Request(method="GET", target="/", headers=[("Host", "peek")]))
    conn.send(h11.EndOfMessage())
    conn.receive_data(sock.recv(min(waiting, most), socket.MSG_PEEK))
    with contextlib.suppress(h11.RemoteProtocolError):  # a broken answer: the read says so
        while (event := conn.next_event()) is not h11.NEED_DATA:
            if isinstance(event, h11.Response) and not {b"content-length", b"transfer-encoding"} & {
                name.lower() for name, _ in event.headers.raw_items()
            }:
                return None
            if isinstance(event, h11.EndOfMessage):
                return True
    return False


async def _held(target: Any, s: Sizes, prompt: str) -> dict[str, Any]:
    hold, result, started = asyncio.Event(), Stream(api=target.api), time.perf_counter()
    reader = asyncio.ensure_future(target.stream(target.request(prompt, s.tokens), result=result, hold=hold))
    whole: bool | None = False
    try:
        while not reader.done() and time.perf_counter() - started < s.timeout_s / 2:
            await asyncio.sleep(0.005)
            if result.socket is not None and (whole := answer_waiting(result.socket, MAX_PEEK)) is not False:
                break
    finally:
        resumed, waiting = time.perf_counter(), unread_bytes(result.socket) if result.socket else -1
        hold.set()
        stream = await reader
    if whole is None:
        raise NotMeasurable("whether a held answer has ended", "the server marks its end only by closing")
    return {"tokens": stream.tokens, "bytes": stream.total_bytes, "waiting_bytes": waiting, "held_s": resumed - started,
            "end_waiting": whole, "failure": stream.failure}  # fmt: skip


def unread_verdicts(tables: dict[str, pd.DataFrame], s: Sizes) -> list:
    whole = (rows := tables["rows"]).end_waiting.astype(bool) & rows.failure.isna()
    return [judge("an unread stream waits whole in the buffers", f"a {s.tokens}-token stream left unread sits whole "
                  "on its way; its writer never waits", f"any held stream's end not in the client's buffer within "
                  f"{s.timeout_s / 2:g} s, or a held stream cut or failed when read", bool(len(rows)) and bool(whole.all()),
                  f"{int(whole.sum())} of {len(rows)} whole; waiting {span(rows.waiting_bytes, '{:,.0f}')} bytes in the "
                  f"client's buffer (head and framing included), body {span(rows.bytes, '{:,.0f}')}", checked=True)]  # fmt: skip


async def _unread(trial: Trial) -> list[dict[str, Any]]:
    """The held streams at once, each held until its whole answer waits in its receive buffer."""
    target, s = trial.target, trial.sizes
    if not target.url.startswith("http://"):
        raise NotMeasurable("a stream left unread", "the raw reader speaks plain http only")
    return list(await asyncio.gather(*(_held(target, s, PROMPTS[1 + i]) for i in range(s.streams))))


UNREAD = Experiment(
    name="buffers.unread", title="An ordinary stream, not read until it settles, then read: what was waiting",
    sizes={size: {"tokens": 200, "streams": 4, "timeout_s": 120.0} for size in ("full", "ci")},
    measure=lambda trial: run_sync(_unread(trial)), verdicts=unread_verdicts,
    tables=lambda t, s: {"unread": spread(t["rows"], "tokens", ["waiting_bytes", "bytes", "held_s"])},
)  # fmt: skip


SPECS = (FLOOD, UNREAD)
