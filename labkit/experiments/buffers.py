"""Experiment 4, ``buffers``: how much a client that never reads absorbs before the server blocks.

Between the engine and a reader sit the server's write buffer and both kernels' socket buffers,
none of which the application sees. A raw-socket client sends ``POST /lab/flood`` and then reads
nothing; the server writes SSE events of a fixed size as fast as the connection accepts them and
times every write. The first write that does not return within the block threshold marks the
point where backpressure begins; the bytes written before it are what the path absorbed. We also
read, with ``FIONREAD``, how many of them sit in the client's own receive buffer. The client then
leaves by RST, and we wait until the server has finished the response.

The model plays no part here (no token is generated), but each profile serves its own model
anyway, so that what the notebook's first table says is served is what is served; loading
SmolLM2 from its cache costs a few seconds.
"""

from __future__ import annotations

import array
import asyncio
import fcntl
import socket
import termios
import time
import uuid
from dataclasses import dataclass
from typing import Any

import pandas as pd

from labkit.experiments.client import async_client, run_sync
from labkit.experiments.profiles import Profile
from labkit.experiments.progress import Progress, doing, tick
from labkit.experiments.rawhttp import RawConnection
from labkit.experiments.servers import serving

NAME = "buffers"


@dataclass(frozen=True)
class Config:
    model: str = "tiny-gpt2"
    event_sizes: tuple[int, ...] = (133, 1024, 16384, 65536)
    repetitions: int = 3
    flood_bytes: int = 32 * 2**20  # the most a flood may write: far beyond any buffer seen here
    block_threshold: float = 0.2  # a write slower than this has blocked
    timeout: float = 30.0  # give up waiting for the block after this long

    @classmethod
    def for_profile(cls, profile: Profile) -> Config:
        return cls(model=profile.model) if profile.full else cls(model=profile.model, repetitions=2)

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
        for size in config.event_sizes:
            for rep in range(config.repetitions):
                doing(progress, f"{size:,}-byte events, repetition {rep + 1}/{config.repetitions}")
                rows.append({"event_bytes": size, "repetition": rep, **run_sync(flood_once(srv.url, size, config))})
                tick(progress, floods=rows)
    floods = pd.DataFrame(rows)
    return {"floods": floods, "by_size": by_size(floods), "kernel": kernel_settings()}


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
            await conn.send_post("/lab/flood", body)
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


async def _poll(client: Any, flood_id: str, done: Any, timeout: float, every: float = 0.02) -> dict[str, Any] | None:
    """GET the flood's record until ``done(record)`` or ``timeout``; the last record seen."""
    deadline, record = time.perf_counter() + timeout, None
    while time.perf_counter() < deadline:
        response = await client.get(f"/lab/flood/{flood_id}")
        if response.status_code == 200:
            record = response.json()
            if done(record):
                break
        await asyncio.sleep(every)
    return record


def unread_bytes(sock: socket.socket) -> int:
    """Bytes waiting in this socket's receive buffer (``FIONREAD``), headers included."""
    buf = array.array("i", [0])
    fcntl.ioctl(sock.fileno(), termios.FIONREAD, buf)
    return int(buf[0])


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


def summary(tables: dict[str, pd.DataFrame]) -> dict[str, Any]:
    table = tables["by_size"]
    return {f"{int(r.event_bytes)}": [int(r.bytes_accepted_min), int(r.bytes_accepted_max)] for r in table.itertuples()}


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
    ax.set(
        xlabel="size of one event",
        ylabel="KiB written before a write blocked",
        title="A client that never reads: bytes accepted before the server blocks",
    )
    ax.set_ylim(bottom=0)
    ax.legend()
    return [fig]


def _size_label(size: int) -> str:
    return f"{size // 1024} KiB" if size >= 1024 and size % 1024 == 0 else f"{size} B"
