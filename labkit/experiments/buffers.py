"""Experiment 4, ``buffers``: how much a client that never reads absorbs before the server blocks.

Between the engine and a reader sit the server's write buffer and both kernels' socket buffers,
none of which the application sees. A raw-socket client sends ``POST /lab/flood`` and then reads
nothing; the server writes SSE events of a fixed size as fast as the connection accepts them and
times every write. The first write that does not return within the block threshold marks the
point where backpressure begins; the bytes written before it are what the path absorbed. We also
read, with ``FIONREAD``, how many of them sit in the client's own receive buffer. The client then
leaves by RST, and we wait until the server has finished the response.

The kernel gives the reference: Linux autotunes a TCP socket's send buffer up to the third field
of ``net.ipv4.tcp_wmem`` while data is queued, and a receive buffer that is never read stays near
``tcp_rmem``'s default. Both are read from ``/proc`` in every run (``kernel``), never typed. One
ordinary token stream is also read to the end, so the size of a real token event on the wire
(``token_events``) turns bytes into tokens.

The model plays no part here (no token is generated), but each profile serves its own model
anyway, so that what the notebook's first table says is served is what is served; loading
SmolLM2 from its cache costs a few seconds.
"""

from __future__ import annotations

import contextlib
import socket
import time
import uuid
from dataclasses import dataclass
from typing import Any

import pandas as pd

from labkit.experiments.client import async_client, launch_streams, run_sync
from labkit.experiments.profiles import Profile
from labkit.experiments.progress import Progress, doing, tick
from labkit.experiments.rawhttp import RawConnection
from labkit.experiments.readings import Verdict, current_step, fetch_steps, interleaved, span
from labkit.experiments.servers import serving
from labkit.experiments.waiting import WaitTimeout, await_for
from labkit.machine import unread_bytes  # FIONREAD; None where the platform has none (Windows)
from labkit.prompts import PROMPTS

NAME = "buffers"


@dataclass(frozen=True)
class Config:
    model: str = "tiny-gpt2"
    event_sizes: tuple[int, ...] = (133, 1024, 16384, 65536)
    repetitions: int = 3
    flood_bytes: int = 32 * 2**20  # the most a flood may write: far beyond any buffer seen here
    block_threshold: float = 0.2  # a write slower than this has blocked
    timeout: float = 30.0  # give up waiting for the block after this long
    token_stream_tokens: int = 16  # one ordinary stream, read to the end, to size a token event

    @classmethod
    def for_profile(cls, profile: Profile) -> Config:
        if profile.full:
            return cls(model=profile.model)
        # ci drops the smallest events, the slowest to fill the buffers (tens of thousands of writes)
        return cls(model=profile.model, event_sizes=(1024, 16384, 65536))

    def __post_init__(self) -> None:
        if not self.event_sizes or min(self.event_sizes) < 32:
            raise ValueError(f"buffers.Config.event_sizes must be >= 32 bytes, got {self.event_sizes!r}")
        if self.repetitions < 1 or self.block_threshold <= 0 or self.timeout <= 0:
            raise ValueError("buffers.Config.repetitions, block_threshold and timeout must be positive")


def server_options(config: Config) -> dict[str, Any]:
    return {"model": config.model}


def units(config: Config) -> int:
    return len(config.event_sizes) * config.repetitions


def run(config: Config, *, server: Any = None, progress: Progress | None = None) -> dict[str, pd.DataFrame]:
    rows = []
    with serving(server, **server_options(config)) as srv:
        first_step = current_step(srv.url)
        for rep, size in interleaved(config.event_sizes, config.repetitions):
            doing(progress, f"{size:,}-byte events, repetition {rep + 1}/{config.repetitions}")
            rows.append({"event_bytes": size, "repetition": rep, **run_sync(flood_once(srv.url, size, config))})
            tick(progress, floods=rows)
        doing(progress, "one ordinary token stream, to size a token event")
        tokens = token_events(srv.url, config.token_stream_tokens)
        steps = fetch_steps(srv.url, since=first_step)
    floods = pd.DataFrame(rows)
    return {
        "floods": floods,
        "by_size": by_size(floods),
        "kernel": kernel_settings(),
        "token_events": tokens,
        "steps": steps,
    }


def token_events(url: str, tokens: int) -> pd.DataFrame:
    """Wire bytes of each token event of one ordinary stream read to the end."""
    launch = run_sync(launch_streams(url, [{"prompt": PROMPTS[1], "max_new_tokens": tokens}]))
    events = launch.results[0].tokens
    return pd.DataFrame({"index": range(len(events)), "nbytes": [e.nbytes for e in events]})


def kernel_settings() -> pd.DataFrame:
    """The Linux socket-buffer limits (min, default, max bytes) that bound what a path can absorb."""
    rows = []
    for name in ("tcp_rmem", "tcp_wmem"):
        path = f"/proc/sys/net/ipv4/{name}"
        try:
            low, default, high = (int(v) for v in open(path).read().split())
        except (OSError, ValueError):
            continue
        rows.append({"setting": f"net.ipv4.{name}", "min": low, "default": default, "max": high})
    return pd.DataFrame(rows, columns=["setting", "min", "default", "max"])


async def flood_once(url: str, size: int, config: Config) -> dict[str, Any]:
    """One client that never reads; the server's record of what it accepted, and the client's view."""
    flood_id = f"buffers-{size}-{uuid.uuid4().hex[:8]}"
    body = {
        "flood_id": flood_id,
        "event_bytes": size,
        "block_threshold": config.block_threshold,
        "count": max(1, min(1_000_000, config.flood_bytes // size)),
    }
    conn = RawConnection(url)
    async with async_client(url, connections=2) as poll:
        try:
            await conn.connect()
            started = time.perf_counter()
            await conn.send("POST", "/lab/flood", body)
            record = await _poll(poll, flood_id, lambda r: r["blocked"] or r["finished"], config.timeout)
            seen = {
                "client_rcvbuf": conn.sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF),
                "client_unread_bytes": unread_bytes(conn.sock),
                "seconds_to_block": time.perf_counter() - started,
            }
        finally:
            conn.leave("rst")
        final = await _poll(poll, flood_id, lambda r: r["finished"], config.timeout)
    return {**_accepted(record), **seen, "server_finished": bool(final and final["finished"])}


def _accepted(record: dict[str, Any] | None) -> dict[str, Any]:
    record = record or {}
    return {
        "blocked": bool(record.get("blocked")),
        "bytes_accepted": record.get("bytes_accepted"),
        "events_accepted": record.get("events_accepted"),
        "wire_bytes_accepted": record.get("wire_bytes_accepted"),
    }


async def _poll(client: Any, flood_id: str, done: Any, timeout: float) -> dict[str, Any] | None:
    """GET the flood's record until ``done(record)`` or ``timeout``; the last record seen."""
    seen: list[dict[str, Any]] = []

    async def record() -> dict[str, Any] | None:
        response = await client.get(f"/lab/flood/{flood_id}")
        if response.status_code == 200:
            seen.append(response.json())
            return seen[-1] if done(seen[-1]) else None
        return None

    with contextlib.suppress(WaitTimeout):  # at the bound, the caller judges the last record
        await await_for(record, timeout=timeout, what=f"flood {flood_id}")
    return seen[-1] if seen else None


def by_size(floods: pd.DataFrame) -> pd.DataFrame:
    grouped = floods.groupby("event_bytes")
    return pd.DataFrame(
        {
            "repetitions": grouped.size(),
            "blocked": grouped.blocked.sum().astype(int),
            "bytes_accepted_min": grouped.bytes_accepted.min(),
            "bytes_accepted_max": grouped.bytes_accepted.max(),
            "client_unread_min": grouped.client_unread_bytes.min(),
            "client_unread_max": grouped.client_unread_bytes.max(),
        }
    ).reset_index()


def kernel_value(tables: dict[str, pd.DataFrame], setting: str, field: str) -> int | None:
    """One field (min, default, max) of a kernel setting read in this run, or None off Linux."""
    kernel = tables.get("kernel")
    if kernel is None or kernel.empty or setting not in set(kernel.setting):
        return None
    return int(kernel.set_index("setting").loc[setting, field])


TRANSPORT_HIGH_WATER = 64 * 1024  # asyncio's default write-buffer high-water mark, which uvicorn keeps


def summary(tables: dict[str, pd.DataFrame]) -> dict[str, Any]:
    table = tables["by_size"]
    out: dict[str, Any] = {
        f"{int(r.event_bytes)}": [int(r.bytes_accepted_min), int(r.bytes_accepted_max)] for r in table.itertuples()
    }
    if "token_events" in tables and len(tables["token_events"]):
        out["token_event_bytes_median"] = float(tables["token_events"].nbytes.median())
    return out


def verdicts(tables: dict[str, pd.DataFrame]) -> list[Verdict]:
    """The hypotheses of notebook 04, judged against their criteria (the kernel's limits as read)."""
    floods = tables["floods"]
    wmem_default = kernel_value(tables, "net.ipv4.tcp_wmem", "default")
    wmem_max = kernel_value(tables, "net.ipv4.tcp_wmem", "max")
    server_side = floods.bytes_accepted - floods.client_unread_bytes
    out = [
        Verdict(
            "every_flood_blocks",
            "a client that reads nothing makes the server's write block once the buffers are full",
            "any flood ran to its end, or to the timeout, without a blocked write",
            bool(len(floods)) and bool(floods.blocked.all()),
            f"{int(floods.blocked.sum())} of {len(floods)} floods blocked",
        ),
        Verdict(
            "server_finishes_after_leave",
            "after the client leaves by RST the server ends the response",
            "any flood's response was still unfinished at the timeout",
            bool(len(floods)) and bool(floods.server_finished.all()),
            f"{int(floods.server_finished.sum())} of {len(floods)} finished",
        ),
    ]
    if wmem_max is not None and wmem_default is not None:
        bound = wmem_max + floods.client_rcvbuf + TRANSPORT_HIGH_WATER + floods.event_bytes
        over = floods[floods.bytes_accepted > bound]
        out.append(
            Verdict(
                "bounded_by_the_kernel",
                "what the path absorbs is at most the kernel's largest send buffer (tcp_wmem max) plus the "
                "client's receive buffer, the server transport's high-water mark and one event",
                "any flood accepted more bytes than that bound",
                over.empty,
                f"{len(over)} of {len(floods)} floods over; accepted {span(floods.bytes_accepted / 1024, '{:.0f}', ' KiB')}, "
                f"tcp_wmem max {wmem_max / 1024:.0f} KiB",
            )
        )
        out.append(
            Verdict(
                "send_buffer_grows",
                "the server's side holds more than the kernel's default send buffer: Linux grows it while data waits",
                "any flood's bytes on the server's side (accepted minus what sat in the client) were at most tcp_wmem's default",
                bool(len(floods)) and bool((server_side > wmem_default).all()),
                f"server side {span(server_side / 1024, '{:.0f}', ' KiB')} against a default of {wmem_default / 1024:.0f} KiB",
            )
        )
    medians = floods.groupby("event_bytes").bytes_accepted.median()
    if len(medians) > 1:
        ratio = float(medians.max() / medians.min())
        out.append(
            Verdict(
                "bytes_not_events",
                "the buffers hold bytes, not events: the amount absorbed hardly depends on the event size",
                "the median bytes accepted of two event sizes differ by more than a factor of 1.5",
                ratio <= 1.5,
                f"largest median / smallest median = {ratio:.2f}",
            )
        )
    return out


CHECKED = (
    "every_flood_blocks",
    "server_finishes_after_leave",
    "bounded_by_the_kernel",
    "send_buffer_grows",
    "bytes_not_events",
)


def findings(tables: dict[str, pd.DataFrame]) -> str:
    """Bytes turned into tokens, from this run's numbers."""
    floods = tables["floods"]
    said = [
        f"Before a write blocked, the path absorbed {span(floods.bytes_accepted / 1024, '{:.0f}', ' KiB')} "
        f"(median, min–max over {len(floods)} floods of {floods.event_bytes.nunique()} event sizes), of which "
        f"{span(floods.client_unread_bytes / 1024, '{:.0f}', ' KiB')} sat in the client's receive buffer."
    ]
    wmem_max = kernel_value(tables, "net.ipv4.tcp_wmem", "max")
    if wmem_max is not None:
        said.append(f"The kernel lets a send buffer grow to {wmem_max / 1024:.0f} KiB (tcp_wmem max, read from /proc).")
    token = tables.get("token_events")
    if token is not None and len(token):
        per_token = float(token.nbytes.median())
        smallest = float(floods.bytes_accepted.min())
        said.append(
            f"An ordinary token event here is {span(token.nbytes, '{:.0f}', ' bytes')} on the wire, so even the "
            f"smallest amount absorbed holds about {smallest / per_token:,.0f} token events: a reader of ordinary "
            f"tokens is never pushed back on; with 64 KiB events it holds about {smallest / (65536 + per_token):,.0f}."
        )
    return " ".join(said)


def report(tables: dict[str, pd.DataFrame]) -> str:
    """Stable text for any profile: did every flood block, and did the server finish each one after
    the client left. Counts appear only when something did not happen."""
    floods = tables["floods"]
    lines = []
    for column, what in (
        ("blocked", "a write blocked while the client read nothing"),
        ("server_finished", "the server finished the response after the client left"),
    ):
        missing = len(floods) - int(floods[column].sum())
        lines.append(f"{what}: " + ("every flood" if missing == 0 else f"{missing} of {len(floods)} floods did NOT"))
    return "\n".join(lines)


def plot(tables: dict[str, pd.DataFrame]) -> list:
    from labkit.plots import new_figure

    floods = tables["floods"]
    fig, (ax,) = new_figure("buffers_accepted")
    sizes = sorted(floods.event_bytes.unique())
    labels = [_size_label(s) for s in sizes]
    for rep, group in floods.groupby("repetition"):
        group = group.set_index("event_bytes").reindex(sizes)
        ax.plot(labels, group.bytes_accepted / 1024, "o", alpha=0.7, label=f"repetition {rep + 1}")
    ax.plot(
        labels,
        floods.groupby("event_bytes").client_unread_bytes.median().reindex(sizes) / 1024,
        "k_",
        markersize=18,
        label="in the client's receive buffer (median)",
    )
    kernel = tables.get("kernel")
    if kernel is not None and len(kernel):
        limits = kernel.set_index("setting")
        for setting, field, style in (("net.ipv4.tcp_wmem", "max", "--"), ("net.ipv4.tcp_rmem", "default", ":")):
            if setting in limits.index:
                value = int(limits.loc[setting, field])
                ax.axhline(
                    value / 1024,
                    color="gray",
                    ls=style,
                    lw=1,
                    label=f"{setting.split('.')[-1]} {field} (kernel): {value / 1024:,.0f} KiB",
                )
    ax.set(
        xlabel="size of one event",
        ylabel="KiB written before a write blocked",
        title="A client that never reads: bytes accepted before the server blocks",
    )
    ax.set_ylim(bottom=0)
    ax.legend(fontsize="small")
    return [fig]


def _size_label(size: int) -> str:
    return f"{size // 1024} KiB" if size >= 1024 and size % 1024 == 0 else f"{size} B"
