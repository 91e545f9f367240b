"""Experiments read a server's books over HTTP, never from its engine or hub on their own thread.

Issue 9: the disconnect and leak experiments waited for releases by polling ``hub.record()`` and
counted finishes from ``engine.stats()`` on the experiment's thread, while the loop and the step
thread changed them; the cache check was started from there too. The lab routes now serve what
they need (``/lab/streams?ids=``/``?since=``, ``/lab/integrity``, run on the step thread between
two steps), and ``labkit.experiments.servers`` reads them.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import httpx
import pytest

from labkit.experiments.client import launch_streams, run_sync
from labkit.experiments.servers import (
    books,
    release_books,
    released_records,
    server_checks,
    server_stats,
)

TIMEOUT = 30.0
ROOT = Path(__file__).resolve().parent.parent


def get(server, path: str, **params) -> httpx.Response:
    return httpx.get(server.url + path, params=params, timeout=TIMEOUT, trust_env=False)


def one_stream(server, tokens: int = 4) -> str:
    launch = run_sync(launch_streams(server.url, [{"prompt": "Hello", "max_new_tokens": tokens, "ignore_eos": True}]))
    return launch.results[0].request_id


# -- the routes -----------------------------------------------------------------------------------
def test_streams_by_id_answer_in_the_order_asked_with_null_for_an_unknown_id(server):
    first, second = one_stream(server), one_stream(server)
    answer = get(server, "/lab/streams", ids=f"{second},req-nobody,{first}").json()
    assert [r and r["rid"] for r in answer["streams"]] == [second, None, first]
    assert answer["streams"][0]["release_step"] is not None and answer["streams"][0]["finish_reason"] == "length"


def test_streams_since_a_clock_reading_keep_only_later_submissions(server):
    clock = get(server, "/lab/streams", since="inf").json()
    assert clock["streams"] == []
    rid = one_stream(server)
    assert [r["rid"] for r in get(server, "/lab/streams", since=clock["clock"]).json()["streams"]] == [rid]


def test_ids_and_since_together_are_refused_rather_than_one_silently_ignored(server):
    refused = get(server, "/lab/streams", ids="r1", since="0")
    assert refused.status_code == 422 and "not both" in refused.json()["error"]["message"]


def test_too_many_ids_are_refused_with_the_envelope(server):
    refused = get(server, "/lab/streams", ids=",".join(f"r{i}" for i in range(1001)))
    assert refused.status_code == 422 and refused.json()["error"]["type"] == "invalid_request"


def test_integrity_runs_on_the_step_thread_and_reports_the_books(server, monkeypatch):
    threads: list[str] = []
    real = server.engine.check_integrity

    def spy() -> None:
        threads.append(threading.current_thread().name)
        real()

    monkeypatch.setattr(server.engine, "check_integrity", spy)
    answer = get(server, "/lab/integrity").json()
    assert answer["ok"] and answer["what"] == "" and threads == ["labkit-step"]
    assert answer["stats"]["free_blocks"] == answer["stats"]["total_blocks"]


def test_callers_asking_at_once_share_one_check_so_asking_cannot_stall_decoding(server, monkeypatch):
    runs: list[float] = []
    real = server.engine.check_integrity

    def slow() -> None:
        runs.append(time.perf_counter())
        time.sleep(0.3)  # a check that takes a while: the callers below all arrive during it
        real()

    monkeypatch.setattr(server.engine, "check_integrity", slow)

    async def ask_all() -> list[dict]:
        async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT, trust_env=False) as client:
            answers = await asyncio.gather(*(client.get("/lab/integrity") for _ in range(20)))
        return [a.json() for a in answers]

    answers = asyncio.run(ask_all())
    assert all(a["ok"] for a in answers) and len(answers) == 20
    assert len(runs) < 5  # one shared check per burst (a late arrival may start one more), never twenty
    assert get(server, "/lab/integrity").json()["ok"] and len(runs) >= 2  # a later caller gets a fresh check


def test_integrity_says_what_is_broken(server, monkeypatch):
    def broken() -> None:
        raise AssertionError("a block is lost from the pool")

    monkeypatch.setattr(server.engine, "check_integrity", broken)
    answer = get(server, "/lab/integrity").json()
    assert answer == {**answer, "ok": False, "what": "a block is lost from the pool"}
    monkeypatch.undo()
    assert not server_checks(server.url)["what"] and server_checks(server.url)["cache_whole"]


# -- the experiments' side ------------------------------------------------------------------------
def test_released_records_wait_for_every_release_and_keep_the_order(server):
    rids = [one_stream(server, 6), None, one_stream(server, 3)]
    records = run_sync(released_records(server.url, rids, timeout=TIMEOUT))
    assert records[1] is None and [r.rid for r in (records[0], records[2])] == [rids[0], rids[2]]
    assert all(r.released is not None and r.release_step is not None for r in (records[0], records[2]))


def test_release_books_count_one_run_only(server):
    one_stream(server)  # before the run: not counted
    before = books(server.url)
    for _ in range(3):
        one_stream(server)
    counted = release_books(server.url, before)
    assert counted == {"submitted": 3, "finished": 3, "admitted": 3, "releases": 3, "late_events": 0, "hub_errors": 0}


def test_server_checks_read_an_idle_server_as_whole(server):
    one_stream(server)
    checks = server_checks(server.url)
    assert checks == {"cache_whole": True, "held_blocks": 0, "running": 0, "waiting": 0, "open_streams": 0, "what": ""}
    assert server_stats(server.url)["held_blocks"] == 0


@pytest.fixture(scope="module")
def server_settings():
    return {"max_batch": 4, "policy": "unbounded", "response_class": "starlette", "max_waiting": None}


@pytest.mark.parametrize("module", ["servers", "disconnect", "leak", "slowclient"])
def test_these_experiments_never_read_the_engine_or_hub_directly(module):
    source = (ROOT / "labkit" / "experiments" / f"{module}.py").read_text()
    for reach in ("srv.hub", "server.hub", ".engine.stats(", ".check_integrity(", "hub.record"):
        assert reach not in source, f"{module}.py reaches into the server: {reach!r}"
