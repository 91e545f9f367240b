"""Resume logs that outlive their server: the Redis Streams store, and the 204 that ends a
finished stream's reconnects.

The store's logic is tested on fakeredis; what a user sees across a restart is tested on a real
``redis-server`` (started on a free loopback port for the test, nothing persisted, stopped after),
with two servers in turn: a client that read N events of a run, whose server then stopped,
resumes on the next server with no event lost or repeated."""
from __future__ import annotations

import asyncio
import contextlib
import shutil
import socket
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from service_helpers import TIMEOUT, RawClient, lab_server, tokens_of

from labkit.schema import StreamEncoder
from labkit.server import local_redis
from labkit.service.frames import Frame
from labkit.service.resume_redis import LEASE_S, PREFIX, RedisStore, store_cost
from labkit.service.resume_store import LOST_MESSAGE, StoredLog, same_digest, token_digest

BODY = {"prompt": "Once upon a time,", "max_new_tokens": 30, "resumable": True}
NO_REDIS = shutil.which("redis-server") is None
needs_redis = pytest.mark.skipif(NO_REDIS, reason="redis-server is not installed (make system-deps installs it)")


# -- the store, on fakeredis -------------------------------------------------------------------------
def fake_store(capacity: int = 64) -> RedisStore:
    fakeredis = pytest.importorskip("fakeredis")
    client = fakeredis.FakeAsyncRedis(server=fakeredis.FakeServer(), protocol=2)
    return RedisStore("redis://fake", capacity=capacity, ttl=60.0, client=client)


def token_frames(count: int, end: str | None = None) -> list[Frame]:
    """start, ``count`` tokens, then ``done`` or ``error`` if ``end`` says so; ids 1, 2, 3, ..."""
    encoder = StreamEncoder()
    frames = [Frame("start", encoder.start("req-x", "m", 3), 1)]
    frames += [Frame("token", encoder.token(i, 100 + i, f"t{i}"), encoder.last_id) for i in range(count)]
    if end == "done":
        frames.append(Frame("done", encoder.done("length", 3, count), encoder.last_id))
    return frames


async def write(store: RedisStore, frames: list[Frame], token: str = "secret-token") -> None:
    await store.create("req-x", token)
    for frame in frames:
        await store.append("req-x", frame)


async def read_all(store: RedisStore, log: StoredLog, cursor: int) -> list[Frame]:
    return [f async for f in store.follow(log, cursor, keepalive=60.0) if f is not None]


def test_a_stored_log_is_found_only_with_its_token_and_says_how_it_ends() -> None:
    async def body() -> None:
        store = fake_store()
        await write(store, token_frames(3))
        assert await store.find("req-x", "wrong-token") is None and await store.find("req-y", "secret-token") is None
        assert await store.find("req-x", "secret-token") == StoredLog("req-x", 1, 4, ended=False, running=True)
        await store.append("req-x", token_frames(3, end="done")[-1])
        await store.release("req-x")
        assert await store.find("req-x", "secret-token") == StoredLog("req-x", 1, 5, ended=True, running=False)
        assert b"secret-token" not in await store.redis.hget(PREFIX + "req-x:meta", "token")  # only its hash
        assert 0 < await store.redis.pttl(PREFIX + "req-x") <= 60_000  # a released log expires
        await store.forget("req-x")
        assert await store.find("req-x", "secret-token") is None
        await store.aclose()

    asyncio.run(body())


def test_following_a_stored_log_replays_after_the_cursor_then_takes_live_events_to_the_end() -> None:
    async def body() -> None:
        store, frames = fake_store(), token_frames(6, end="done")
        await write(store, frames[:4])
        log = await store.find("req-x", "secret-token")
        assert log is not None
        reader = asyncio.ensure_future(read_all(store, log, cursor=2))
        await asyncio.sleep(0.05)
        for frame in frames[4:]:  # written while the reader waits
            await store.append("req-x", frame)
        assert await asyncio.wait_for(reader, TIMEOUT) == frames[2:]
        await store.aclose()

    asyncio.run(body())


def test_a_log_whose_server_died_is_ended_once_with_a_shutdown_error() -> None:
    """No last event and no lease (a server killed mid-run): the readers end the log with one
    ``shutdown`` error at the next id; whoever loses the race to write it reads the winner's."""
    async def body() -> None:
        store, frames = fake_store(), token_frames(2)
        await write(store, frames)
        await store.redis.delete(PREFIX + "req-x:lease")  # what LEASE_S after a crash looks like
        log = await store.find("req-x", "secret-token")
        assert log is not None and not log.running and not log.ended
        first, second = await asyncio.gather(read_all(store, log, 1), read_all(store, log, 3))
        assert first[:-1] == frames[1:] and first[-1] == second[-1] and len(second) == 1
        assert first[-1].kind == "error" and first[-1].id == 4 and LOST_MESSAGE.encode() in first[-1].data
        assert await store.redis.xlen(PREFIX + "req-x") == 4
        await store.aclose()

    asyncio.run(body())


def test_a_vanished_log_ends_its_reader_with_a_cancelled_error_it_does_not_store() -> None:
    async def body() -> None:
        store = fake_store()
        await write(store, token_frames(2))
        log = await store.find("req-x", "secret-token")
        await store.forget("req-x")  # cancelled for want of a reader, or expired
        assert log is not None and [(f.kind, f.id) for f in await read_all(store, log, 3)] == [("error", 4)]
        assert not await store.redis.exists(PREFIX + "req-x")  # and ending it created nothing
        await store.aclose()

    asyncio.run(body())


def test_a_reader_keeps_the_log_watched_even_held_at_a_yield_and_no_longer_once_closed(monkeypatch) -> None:
    """A slow client holds its reader at a ``yield`` longer than the mark lasts: the mark is kept
    apart from the reads (a review found it lapsed under a live follower)."""
    from labkit.service import resume_redis

    monkeypatch.setattr(resume_redis, "LEASE_S", 0.3)
    monkeypatch.setattr(resume_redis, "REFRESH_S", 0.1)

    async def body() -> None:
        store = fake_store()
        await write(store, token_frames(2))
        log = await store.find("req-x", "secret-token")
        assert log is not None and not await store.watched("req-x")
        reader = store.follow(log, 1, keepalive=60.0)
        assert (await reader.__anext__()).id == 2
        await asyncio.sleep(1.0)  # held at the yield: three of the mark's lifetimes
        assert await store.watched("req-x")
        await reader.aclose()
        await asyncio.sleep(0.5)
        assert not await store.watched("req-x")  # it lapses on its own once the reader is gone
        await store.aclose()

    asyncio.run(body())


def test_token_digests_compare_whole_tokens_only() -> None:
    digest = token_digest("abc")
    assert same_digest("abc", digest) and not same_digest("abd", digest) and not same_digest("é", digest)
    assert LEASE_S > 1.0  # a lease outlives at least one refresh interval


# -- a real redis-server, two servers in turn ---------------------------------------------------------
@pytest.fixture()
def redis_url() -> Iterator[str]:
    if NO_REDIS:
        pytest.skip("redis-server is not installed (make system-deps installs it)")
    with local_redis() as url:
        yield url


def resume(url: str, rid: str, token: str, last_id: int) -> RawClient:
    client = RawClient(url).request("GET", f"/v1/streams/{rid}/events",
                                    headers={"Last-Event-ID": str(last_id), "X-Resume-Token": token})
    client.read_to_end()
    return client


@needs_redis
def test_a_restarted_server_resumes_from_redis_with_no_event_lost_or_repeated(tiny_gpt2: Any,
                                                                               redis_url: str) -> None:
    with lab_server(tiny_gpt2, resume_store=redis_url) as first:
        reader = RawClient(first.url).post("/v1/stream", BODY)
        seen = reader.read_events(6)[:6]  # start + 5 tokens
        start = seen[0][1]
        rid, token = start["request_id"], start["resume_token"]
        first.engine.pause(rid)  # mid-run when its server stops
        reader.close_rst()
        first.drain()  # the run ends with error: shutdown, logged like every event
    with lab_server(tiny_gpt2, resume_store=redis_url) as second, \
            httpx.Client(base_url=second.url, timeout=TIMEOUT) as client:
        rest = resume(second.url, rid, token, last_id=6)
        assert rest.status == 200 and rest.headers["x-request-id"] == rid
        events = seen + rest.events
        assert [int(e[2]) for e in events] == list(range(1, len(events) + 1))  # nothing lost, nothing twice
        assert events[-1][0] == "error" and events[-1][1]["error"]["type"] == "shutdown"
        solo = client.post("/v1/generate", json={k: v for k, v in BODY.items() if k != "resumable"}).json()
        made = tokens_of(events)
        assert len(made) < BODY["max_new_tokens"] and made == solo["token_ids"][:len(made)]
        replay = resume(second.url, rid, token, last_id=0).events
        assert replay[1:] == events[1:] and "resume_token" not in replay[0][1]  # the store never held it
        assert resume(second.url, rid, token, last_id=len(events)).status == 204  # it has everything: stop
        for wrong in ("not-the-token", ""):
            assert resume(second.url, rid, wrong, last_id=6).status == 404


@pytest.mark.parametrize("store", ["memory", pytest.param("redis", marks=needs_redis)])
def test_a_finished_stream_answers_a_bare_204_to_a_reconnect_at_its_last_event(tiny_gpt2: Any, store: str,
                                                                             request: pytest.FixtureRequest) -> None:
    """EventSource reconnects after a stream ends and stops only on a non-200 answer: one that read
    to ``done`` and comes straight back with its Last-Event-ID gets 204, before any stream starts."""
    url = request.getfixturevalue("redis_url") if store == "redis" else "memory"
    with lab_server(tiny_gpt2, resume_store=url) as server:
        reader = RawClient(server.url).post("/v1/stream", BODY)
        events = reader.read_to_end()
        start, last = events[0][1], len(events)
        assert events[-1][0] == "done" and events[-1][2] == str(last)
        path, token = f"/v1/streams/{start['request_id']}/events", {"X-Resume-Token": start["resume_token"]}
        for target, headers in ((path, {"Last-Event-ID": str(last)}), (f"{path}?after={last}", {})):
            again = RawClient(server.url).request("GET", target, headers={**token, **headers})
            again.read_to_end()
            assert again.status == 204 and again.raw == b"" and "content-type" not in again.headers
        unknown = RawClient(server.url).request("GET", "/v1/streams/req-none/events",
                                                headers={"Last-Event-ID": "1", "X-Resume-Token": "x"})
        unknown.read_to_end()
        assert unknown.status == 404


@needs_redis
def test_a_finished_stream_stays_resumable_from_redis_after_a_restart(tiny_gpt2: Any, redis_url: str) -> None:
    with lab_server(tiny_gpt2, resume_store=redis_url) as first:
        events = RawClient(first.url).post("/v1/stream", BODY).read_to_end()
    start, last = events[0][1], len(events)
    with lab_server(tiny_gpt2, resume_store=redis_url) as second:
        assert resume(second.url, start["request_id"], start["resume_token"], last).status == 204
        tail = resume(second.url, start["request_id"], start["resume_token"], last - 2)
        assert tail.status == 200 and tail.events == events[-2:]


def test_the_memory_store_forgets_every_stream_with_its_server(tiny_gpt2: Any) -> None:
    with lab_server(tiny_gpt2) as first:
        events = RawClient(first.url).post("/v1/stream", BODY).read_to_end()
    with lab_server(tiny_gpt2) as second:
        assert resume(second.url, events[0][1]["request_id"], events[0][1]["resume_token"], 2).status == 404


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # uvicorn exits its thread
def test_a_server_whose_resume_store_does_not_answer_does_not_start(tiny_gpt2: Any) -> None:
    with socket_port() as port:  # nothing listens on it once the block ends
        pass
    with pytest.raises(RuntimeError, match="failed to start"):
        with lab_server(tiny_gpt2, resume_store=f"redis://127.0.0.1:{port}/0", check_settled=False):
            pass


@needs_redis
def test_many_streams_writing_at_once_wait_for_a_connection_instead_of_failing(redis_url: str) -> None:
    """300 runs appending together (a reconnect storm's worth) share the store's connections: each
    waits its turn; none fails with the pool's MaxConnectionsError (redis-py's asyncio pool holds
    100 and raises at the 101st), which the server answered as 503 store_unavailable."""
    async def body() -> None:
        store = RedisStore(redis_url, capacity=64, ttl=60.0)
        frames = token_frames(1)
        try:
            await asyncio.gather(*(store.create(f"req-{i}", "t") for i in range(300)))
            await asyncio.gather(*(store.append(f"req-{i}", frame) for i in range(300) for frame in frames))
            assert [await store.redis.xlen(PREFIX + f"req-{i}") for i in (0, 299)] == [2, 2]
        finally:
            await store.redis.flushdb()
            await store.aclose()

    asyncio.run(body())


@needs_redis
def test_store_cost_reports_latency_and_bytes_per_event(redis_url: str) -> None:
    cost = asyncio.run(store_cost(redis_url, events=200))
    assert cost["events"] == 200
    assert 0 < cost["append_us_median"] <= cost["append_us_p90"] <= cost["append_us_max"]
    assert cost["redis_bytes_per_event"] > 0 and cost["sse_bytes_per_event"] > 40


@needs_redis
def test_followers_from_the_store_are_capped_per_stream_per_client_and_in_all(tiny_gpt2: Any, redis_url: str) -> None:
    """A server that follows another's streams from the store holds them to MAX_FOLLOWERS each, as
    its own; to the store's ``readers`` in all (each follower holds a Redis connection in a blocking
    read, and a run's write that found none free failed every resumable stream); and one client to
    its ``resumable_share`` of those readers (one client took all 128 and shut others out: reviews)."""
    from service_helpers import wait_until

    from labkit.service.resume import CROWDED, MAX_FOLLOWERS

    long = {**BODY, "max_new_tokens": 200}
    with lab_server(tiny_gpt2, resume_store=redis_url) as runs, lab_server(tiny_gpt2, resume_store=redis_url) as other:
        creators = [RawClient(runs.url).post("/v1/stream", long) for _ in range(2)]
        starts = [c.read_events(2)[0][1] for c in creators]
        for start in starts:
            runs.engine.pause(start["request_id"])  # standing still, so every follower stays attached
        resume, share = other.service.resume, other.service.resume.limits.share

        def follow(start: dict[str, Any], local: str = "127.0.0.1") -> RawClient:
            return RawClient(other.url, local=local).request("GET", f"/v1/streams/{start['request_id']}/events?after=2",
                                                             headers={"X-Resume-Token": start["resume_token"]})  # fmt: skip

        def refusal(client: RawClient) -> str:
            client.read_to_end()
            assert client.status == 429 and client.json()["error"]["type"] == "queue_full", client.raw
            return client.json()["error"]["message"]

        first = [follow(starts[0]) for _ in range(MAX_FOLLOWERS)]
        wait_until(lambda: sum(resume._stored.values()) == MAX_FOLLOWERS, what="the followers")
        assert refusal(follow(starts[0])) == CROWDED
        resume.store.readers = readers = int(MAX_FOLLOWERS / share)  # 127.0.0.1 holds its whole share of them
        assert "this client follows 4 streams from the resume store, its share" in refusal(follow(starts[1]))
        second = follow(starts[1], local="127.0.0.2")  # another client still resumes here
        wait_until(lambda: sum(resume._stored.values()) == MAX_FOLLOWERS + 1, what="the follower")
        resume.store.readers = MAX_FOLLOWERS + 1  # as if the store had no reader left
        assert "the resume store serves 5 followers at once" in refusal(follow(starts[1], local="127.0.0.3"))
        first.pop().close_fin()
        wait_until(lambda: sum(resume._stored.values()) == MAX_FOLLOWERS, what="the follower to leave")
        resume.store.readers = readers
        first.append(follow(starts[0]))  # the place it left, taken again
        for start in starts:
            runs.engine.resume(start["request_id"])
        for client in (*creators, *first, second):
            assert client.read_to_end()[-1][0] == "done"
        wait_until(lambda: not resume._stored and not resume._readers, what="every follower to leave")


@needs_redis
def test_a_follower_on_another_server_keeps_the_run_alive_past_the_grace(tiny_gpt2: Any, redis_url: str) -> None:
    """The creator hangs up; a follower on a server sharing the store reads on. The run outlives
    its grace there as it would for a follower here (it was cancelled, and the follower got a bare
    EOF and then 404: a hostile review)."""
    from service_helpers import wait_until

    with lab_server(tiny_gpt2, resume_store=redis_url, resume_grace=0.5) as runs, \
            lab_server(tiny_gpt2, resume_store=redis_url) as other:  # fmt: skip
        creator = RawClient(runs.url).post("/v1/stream", {**BODY, "max_new_tokens": 40})
        start = creator.read_events(2)[0][1]
        rid = start["request_id"]
        runs.engine.pause(rid)  # standing still, so the grace runs out before the end
        follower = RawClient(other.url).request("GET", f"/v1/streams/{rid}/events?after=2",
                                                headers={"X-Resume-Token": start["resume_token"]}).read_head()
        creator.close_fin()
        log = runs.service.resume.get(rid)
        wait_until(lambda: log.followers == 0 and log.timer is not None, what="the creator to leave")
        first = log.timer
        wait_until(lambda: log.timer not in (None, first), what="the grace to run out, and another to start")
        assert runs.service.resume.get(rid) is log and not log.expired
        runs.engine.resume(rid)
        events = follower.read_to_end()
        assert events[-1][0] == "done" and len(tokens_of(events)) == 39, events[-3:]


@needs_redis
def test_a_draining_server_tells_its_store_followers_and_the_run_goes_on_elsewhere(tiny_gpt2: Any,
                                                                                 redis_url: str) -> None:
    """A follower of another server's run, on a server that drains, gets ``error: shutdown``
    without an id (a review: a bare end of stream), and resumes the run where it runs."""
    from service_helpers import wait_until

    with lab_server(tiny_gpt2, resume_store=redis_url) as runs:
        with lab_server(tiny_gpt2, resume_store=redis_url) as other:
            creator = RawClient(runs.url).post("/v1/stream", {**BODY, "max_new_tokens": 40})
            start = creator.read_events(2)[0][1]
            rid = start["request_id"]
            runs.engine.pause(rid)
            follower = RawClient(other.url).request("GET", f"/v1/streams/{rid}/events?after=2",
                                                    headers={"X-Resume-Token": start["resume_token"]}).read_head()
            wait_until(lambda: other.service.resume._stored, what="the follower")
            other.drain(TIMEOUT)
            events = follower.read_to_end()
            assert events[-1][0] == "error" and events[-1][1]["error"]["type"] == "shutdown", events[-2:]
            last = bytes(follower.raw).replace(b"\r\n", b"\n").strip().split(b"\n\n")[-1]
            assert b"event: error" in last and b"id:" not in last  # no id: the log's next event needs it
            assert not other.service.resume._stored
        runs.engine.resume(rid)
        again = RawClient(runs.url).request("GET", f"/v1/streams/{rid}/events?after=2",
                                            headers={"X-Resume-Token": start["resume_token"]})
        assert again.read_to_end()[-1][0] == "done"
        creator.close_fin()


@needs_redis
@pytest.mark.slow
def test_a_server_killed_mid_run_leaves_a_log_the_next_server_ends_with_a_shutdown_error(
        tiny_gpt2: Any, redis_url: str) -> None:
    """SIGKILL: no drain, no last event. The next server replays what was logged, waits while the
    dead server's lease runs out, then ends the log with ``error: shutdown`` (once, logged)."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    from service_helpers import healthy, wait_until

    repo = Path(__file__).resolve().parents[1]
    with socket_port() as port:
        pass
    code = ("import argparse, sys; from labkit.server import add_serve_arguments, serve_from_args; "
            "p = argparse.ArgumentParser(); add_serve_arguments(p); serve_from_args(p.parse_args(sys.argv[1:]))")
    argv = ["--model", "tiny-gpt2", "--port", str(port), "--resume-store", redis_url, "--step-delay", "0.05",
            "--log-level", "warning"]  # 400 tokens at 50 ms a step: mid-run whenever the kill lands
    proc = subprocess.Popen([sys.executable, "-c", code, *argv], cwd=repo, env={**os.environ, "PYTHONPATH": str(repo)})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: healthy(url) or proc.poll() is not None, timeout=120, what="the server to start")
        reader = RawClient(url).post("/v1/stream", {**BODY, "max_new_tokens": 400})
        seen = reader.read_events(4)[:4]
        proc.send_signal(signal.SIGKILL)
        proc.wait(TIMEOUT)
        reader.close_rst()  # its connection died with the server, with no last event
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    start = seen[0][1]
    with lab_server(tiny_gpt2, resume_store=redis_url) as second:
        rest = resume(second.url, start["request_id"], start["resume_token"], last_id=4)
        events = seen + rest.events
        assert [int(e[2]) for e in events] == list(range(1, len(events) + 1))
        assert events[-1][0] == "error" and events[-1][1]["error"]["message"] == LOST_MESSAGE
        again = resume(second.url, start["request_id"], start["resume_token"], last_id=len(events) - 1)
        assert again.events == events[-1:]  # the ending was logged once, as event len(events)


@contextlib.contextmanager
def socket_port() -> Iterator[int]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        yield probe.getsockname()[1]
