"""The Redis Streams resume store: one stream per request id, its SSE ids as the entries' ids.

Keys, for request id ``R`` (prefix ``labkit:resume:``):

* ``R``: the events, one entry per event, entry id ``0-N`` for SSE id ``N`` (so ``XADD`` with an
  explicit id refuses an id that is not new, and "after N" is ``XREAD ... 0-N``), fields ``k``
  (start, token, done, error) and ``d`` (the event's SSE bytes); ``MAXLEN ~ resume_log_events``.
* ``R:meta``: a hash with the SHA-256 of the resume token (the token itself is never stored).
* ``R:lease``: present while a server runs the stream; it expires :data:`LEASE_S` after that
  server's last refresh, which is how a reader elsewhere learns that the run died with its server.
* ``R:watched``: present while a reader on any server follows the stream; it expires
  :data:`LEASE_S` after that reader's last refresh, which is how the server running it learns,
  when its grace runs out with no follower of its own, that someone still reads it.

Every key expires ``resume_store_ttl`` seconds after its stream's last write (refreshed with the
lease while the run is alive); a run cancelled because nobody came back is deleted at once.
Writes are one round trip per event: the ``XADD``, and every :data:`REFRESH_S` the expiries and
the lease in the same pipeline. :func:`store_cost` measures what that costs.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
import uuid
from collections.abc import AsyncGenerator
from typing import Any

from labkit.schema import StreamEncoder
from labkit.service.frames import Frame
from labkit.service.resume_store import (
    StoredLog,
    StoreUnavailable,
    gone_frame,
    is_terminal,
    lost_frame,
    same_digest,
    token_digest,
)

PREFIX = "labkit:resume:"
LEASE_S = 3.0  # a run's lease outlives its last refresh by this much
REFRESH_S = 1.0  # a live run refreshes its lease (and the keys' expiry) this often
WAIT_S = 1.0  # a reader blocks this long per XREAD, then checks the lease
OP_TIMEOUT_S = 5.0  # a Redis call that takes longer fails as StoreUnavailable
POOL = 256  # connections to Redis per server at most (each follower's XREAD BLOCK holds one a while)
READERS = POOL // 2  # followers at once, so that the runs' writes always find a connection


class RedisStore:
    def __init__(self, url: str, *, capacity: int, ttl: float, client: Any = None) -> None:
        if client is None:
            import redis.asyncio as aioredis

            # RESP2 whichever version of redis-py is installed (8.x defaults to RESP3: other reply shapes).
            # A blocking pool: a call waits (up to OP_TIMEOUT_S) for a free connection, where the
            # default pool raises at its 101st, so a burst of streams would each be refused with 503.
            pool = aioredis.BlockingConnectionPool.from_url(
                url, protocol=2, socket_connect_timeout=OP_TIMEOUT_S, max_connections=POOL, timeout=OP_TIMEOUT_S
            )
            client = aioredis.Redis.from_pool(pool)  # closed with the client
        self.redis, self.url = client, url
        self.capacity, self.ttl_ms = capacity, int(ttl * 1000)
        self.refresh_s: float | None = REFRESH_S
        self.readers = READERS
        self._refreshed: dict[str, float] = {}  # rid -> when its lease and expiries were last refreshed

    def _where(self) -> str:
        return f"the resume store at {self.url.split('@')[-1]}"  # no credentials in a message

    async def _call(self, work: Any, timeout: float = OP_TIMEOUT_S) -> Any:
        """``await work`` bounded by ``timeout``; any failure is :class:`StoreUnavailable`."""
        import redis

        try:
            return await asyncio.wait_for(work, timeout)
        except (TimeoutError, redis.RedisError, OSError) as exc:
            raise StoreUnavailable(f"{self._where()} failed: {type(exc).__name__}") from exc

    # -- writing (the server that runs the stream) ------------------------------------------------
    async def ping(self) -> None:
        await self._call(self.redis.ping())

    async def create(self, rid: str, token: str) -> None:
        pipe = self.redis.pipeline(transaction=False)
        pipe.hset(PREFIX + rid + ":meta", mapping={"token": token_digest(token)})
        pipe.pexpire(PREFIX + rid + ":meta", self.ttl_ms)
        pipe.set(PREFIX + rid + ":lease", b"1", px=int(LEASE_S * 1000))
        await self._call(pipe.execute())
        self._refreshed[rid] = time.monotonic()

    async def append(self, rid: str, frame: Frame) -> None:
        """``XADD`` one event (and refresh the lease if due) in one round trip."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.xadd(
            PREFIX + rid, {"k": frame.kind, "d": frame.data}, id=f"0-{frame.id}", maxlen=self.capacity, approximate=True
        )
        first = frame.id == 1
        if first or time.monotonic() - self._refreshed.get(rid, 0.0) >= REFRESH_S:
            self._refresh(pipe, rid)
        await self._call(pipe.execute())

    async def alive(self, rid: str) -> None:
        pipe = self.redis.pipeline(transaction=False)
        self._refresh(pipe, rid)
        await self._call(pipe.execute())

    def _refresh(self, pipe: Any, rid: str) -> None:
        for key in (PREFIX + rid, PREFIX + rid + ":meta"):
            pipe.pexpire(key, self.ttl_ms)
        pipe.set(PREFIX + rid + ":lease", b"1", px=int(LEASE_S * 1000))
        self._refreshed[rid] = time.monotonic()

    async def release(self, rid: str) -> None:
        """The run ended here: drop its lease; its log stays until the keys expire."""
        self._refreshed.pop(rid, None)
        pipe = self.redis.pipeline(transaction=False)
        pipe.delete(PREFIX + rid + ":lease")
        for key in (PREFIX + rid, PREFIX + rid + ":meta"):
            pipe.pexpire(key, self.ttl_ms)
        await self._call(pipe.execute())

    async def forget(self, rid: str) -> None:
        self._refreshed.pop(rid, None)
        await self._call(self.redis.delete(*(PREFIX + rid + key for key in ("", ":meta", ":lease", ":watched"))))

    async def watched(self, rid: str) -> bool:
        """Whether a reader on some server has followed this log within the last :data:`LEASE_S`."""
        return bool(await self._call(self.redis.exists(PREFIX + rid + ":watched")))

    # -- reading (any server) ---------------------------------------------------------------------
    async def find(self, rid: str, token: str) -> StoredLog | None:
        """The stored log of ``rid`` if ``token`` is its resume token; None otherwise (unknown, expired)."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.hget(PREFIX + rid + ":meta", "token")
        pipe.xrange(PREFIX + rid, count=1)
        pipe.xrevrange(PREFIX + rid, count=1)
        pipe.exists(PREFIX + rid + ":lease")
        digest, first, last, lease = await self._call(pipe.execute())
        if digest is None or not first or not same_digest(token, digest.decode("ascii", "replace")):
            return None
        (first_id, _), (last_id, fields) = first[0], last[0]
        ended = is_terminal(fields[b"k"].decode())
        return StoredLog(rid, _event_id(first_id), _event_id(last_id), ended, bool(lease))

    async def follow(self, log: StoredLog, cursor: int, keepalive: float) -> AsyncGenerator[Frame | None, None]:
        """The events after ``cursor``, then each new one as it is written, to the terminal event;
        ``None`` after ``keepalive`` seconds without one (time for a ping). While it reads, the log
        is marked watched, so its run outlives its grace. A log whose lease is gone without a last
        event is ended here with the ``shutdown`` error; one that vanished (expired, or cancelled)
        ends with a ``cancelled`` error that is not stored, and the next resume gets 404."""
        rid, quiet_since = log.rid, time.monotonic()
        watching = asyncio.get_running_loop().create_task(self._watch(rid))
        try:
            while True:
                frames = await self._after(rid, cursor, block_s=WAIT_S)
                for frame in frames:
                    yield frame
                    cursor = frame.id or cursor
                if frames:
                    if frames[-1].terminal:
                        return
                    quiet_since = time.monotonic()
                    continue
                if not await self._call(self.redis.exists(PREFIX + rid + ":lease")):
                    if not await self._end_lost(rid, cursor + 1):
                        yield gone_frame(cursor + 1)
                        return
                    continue
                if time.monotonic() - quiet_since >= keepalive:
                    yield None
                    quiet_since = time.monotonic()
        finally:
            watching.cancel()

    async def _watch(self, rid: str) -> None:
        """Mark the log watched every :data:`REFRESH_S`, apart from the reads: a slow client can
        hold its reader at a ``yield`` for longer than the mark lasts (a review)."""
        while True:
            with contextlib.suppress(StoreUnavailable):
                await self._call(self.redis.set(PREFIX + rid + ":watched", b"1", px=int(LEASE_S * 1000)))
            await asyncio.sleep(REFRESH_S)

    async def _after(self, rid: str, cursor: int, block_s: float) -> list[Frame]:
        work = self.redis.xread({PREFIX + rid: f"0-{cursor}"}, count=256, block=int(block_s * 1000))
        reply = await self._call(work, block_s + OP_TIMEOUT_S)  # the reply comes when the block ends
        entries = reply[0][1] if reply else []
        return [_frame(entry_id, fields) for entry_id, fields in entries]

    async def _end_lost(self, rid: str, event_id: int) -> bool:
        """Log the lost run's ``shutdown`` error as event ``event_id``, unless the log is gone (False).

        The explicit id makes it a race anyone can lose safely: if another reader (or a late
        writer) already wrote that id, Redis refuses this one and the reader reads theirs."""
        import redis

        frame = lost_frame(event_id)
        try:
            written = await self._call(
                self.redis.xadd(PREFIX + rid, {"k": frame.kind, "d": frame.data}, id=f"0-{event_id}", nomkstream=True)
            )
        except StoreUnavailable as exc:
            if isinstance(exc.__cause__, redis.ResponseError):  # that id exists: someone wrote first
                return True
            raise
        return written is not None

    async def aclose(self) -> None:
        await self.redis.aclose()


def _event_id(entry_id: bytes) -> int:
    return int(entry_id.split(b"-")[1])


def _frame(entry_id: bytes, fields: dict[bytes, bytes]) -> Frame:
    return Frame(fields[b"k"].decode(), fields[b"d"], _event_id(entry_id))


# -- what the log costs ------------------------------------------------------------------------------
async def store_cost(url: str, events: int = 1000, text: str = " word", capacity: int = 4096) -> dict[str, float]:
    """Write ``events`` token events the way a resumable run does (through :class:`RedisStore`,
    one awaited round trip each) and read back what they cost: microseconds per append (median,
    p90, max) and bytes per event in Redis (``MEMORY USAGE`` of the stream, divided by its
    ``XLEN``), beside the event's own SSE size. The scratch keys are deleted afterwards. From a
    notebook cell, whose loop is already running: ``labkit.lab.run_sync(store_cost(url))``."""
    store = RedisStore(url, capacity=max(capacity, events + 2), ttl=60.0)
    rid, encoder = f"cost-{uuid.uuid4().hex[:12]}", StreamEncoder()
    frames = [Frame("token", encoder.token(i, 1000 + i, text), i + 1) for i in range(events)]
    try:
        await store.create(rid, "cost")
        seconds = []
        for frame in frames:
            start = time.perf_counter()
            await store.append(rid, frame)
            seconds.append(time.perf_counter() - start)
        memory = await store.redis.memory_usage(PREFIX + rid, samples=0)
        length = await store.redis.xlen(PREFIX + rid)
    finally:
        await store.forget(rid)
        await store.aclose()
    micros = sorted(s * 1e6 for s in seconds)
    return {
        "events": float(length),
        "append_us_median": statistics.median(micros),
        "append_us_p90": micros[int(0.9 * (len(micros) - 1))],
        "append_us_max": micros[-1],
        "redis_bytes_per_event": memory / length,
        "sse_bytes_per_event": sum(len(f.data) for f in frames) / len(frames),
    }
