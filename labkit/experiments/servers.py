"""The server's side of a run: which server to measure, and what its own books say about it.

* :func:`serving` and :func:`server_like` reuse a notebook's server (when it already has the
  settings a measurement needs) and otherwise start one on the same loaded model.
* :func:`released_records` waits until the server's record of each stream shows that its
  sequence left the engine; :func:`books` and :func:`release_books` count, from ``/stats`` and
  the records, what one run did; :func:`server_checks` asks, once the server is idle, whether
  its cache is whole.

Everything here reads the server over HTTP (``GET /stats`` and the lab routes of
:mod:`labkit.service.lab_routes`), never its engine or hub from this thread: the hub is the
loop's and the engine the step thread's, and reading them from a third thread races both. The
cache check itself runs on the step thread between two steps (``GET /lab/integrity``). Times in
the records are the server's ``time.perf_counter()``: a server started by ``serve_in_thread``
runs in this process, so they are on the client's clock too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import fields
from typing import Any

import httpx

from labkit.experiments.waiting import WaitTimeout, await_for, wait_for
from labkit.hub.stream import StreamRecord

__all__ = [
    "serving",
    "server_like",
    "loaded_model",
    "stream_records",
    "released_records",
    "server_stats",
    "server_stats_async",
    "lab_client",
    "books",
    "release_books",
    "server_checks",
]

HTTP_TIMEOUT = 10.0  # one lab request; a wait is bounded by its own timeout
IDS_PER_REQUEST = 100  # request ids per ``/lab/streams?ids=``: a URL well under any server's line limit


@contextlib.contextmanager
def serving(server: Any = None, **options: Any) -> Iterator[Any]:
    """``server`` if one was given (left running), else a fresh ``serve_in_thread(**options)``.

    Why: notebooks start the server themselves and pass it in; the CLI and tests let the
    experiment start its own. Either way, whoever started it stops it.
    """
    if server is not None:
        yield server
        return
    from labkit.server import serve_in_thread

    with serve_in_thread(**options) as started:
        yield started


@contextlib.contextmanager
def server_like(given: Any, model: Any, **settings: Any) -> Iterator[Any]:
    """``given`` if it already runs with ``settings``, else a fresh server on the same ``model``.

    Why: a measurement compares settings that a server fixes when it starts (policy, response
    class, send buffer), while a notebook starts one server itself; the model is loaded once and
    shared, and only one of these servers runs at a time.
    """
    if given is not None and all(given.config.flat().get(k) == v for k, v in settings.items()):
        yield given
        return
    with serving(None, model=model, **settings) as server:
        yield server


def loaded_model(server: Any, name: str) -> Any:
    """The model ``server`` serves, if given; else ``name`` loaded once for every server to share."""
    if server is not None:
        return server.engine.model
    from labkit.models import load_model

    return load_model(name)


# --------------------------------------------------------------------------- the server's books


def _record(raw: dict[str, Any] | None) -> StreamRecord | None:
    """A record as served by ``/lab/streams`` (keys this client does not know are left out)."""
    if raw is None:
        return None
    known = {f.name for f in fields(StreamRecord)}
    return StreamRecord(**{k: v for k, v in raw.items() if k in known})


async def stream_records(client: httpx.AsyncClient, url: str, rids: Sequence[str]) -> list[StreamRecord | None]:
    """The server's records of ``rids``, in that order (None: it has none), a hundred per request."""
    out: list[StreamRecord | None] = []
    for first in range(0, len(rids), IDS_PER_REQUEST):
        part = rids[first : first + IDS_PER_REQUEST]
        response = await client.get(f"{url}/lab/streams", params={"ids": ",".join(part)})
        response.raise_for_status()
        out += [_record(raw) for raw in response.json()["streams"]]
    return out


async def released_records(url: str, rids: Sequence[str | None], timeout: float = 60.0) -> list[StreamRecord | None]:
    """The server's records of ``rids`` once each shows its sequence left the engine.

    At ``timeout`` the records are returned as they are: a stream still held then is what the
    run found (its row has no release, and :func:`server_checks` reports the held blocks), not
    a reason to lose the run's other rows. A ``None`` rid (the request was refused) gets ``None``.
    """
    asked = [rid for rid in rids if rid]
    latest: dict[str, StreamRecord | None] = {}

    async def all_released(client: httpx.AsyncClient) -> bool:
        latest.update(zip(asked, await stream_records(client, url, asked)))
        return all(r is None or r.released is not None for r in latest.values())

    async with lab_client() as client:
        with contextlib.suppress(WaitTimeout):
            await await_for(lambda: all_released(client), timeout=timeout, what=f"the release of {len(asked)} streams")
    return [latest.get(rid) if rid else None for rid in rids]


def server_stats(url: str) -> dict[str, Any]:
    """``GET /stats``: the engine's and the hub's books, read once on the server's loop."""
    response = httpx.get(f"{url}/stats", timeout=HTTP_TIMEOUT, trust_env=False)
    response.raise_for_status()
    return response.json()


async def server_stats_async(client: httpx.AsyncClient, url: str) -> dict[str, Any]:
    """:func:`server_stats` from a coroutine, on a client the caller holds open."""
    response = await client.get(f"{url}/stats")
    response.raise_for_status()
    return response.json()


def lab_client() -> httpx.AsyncClient:
    """An async client for the lab's own requests to a loopback server (no proxy from the environment)."""
    return httpx.AsyncClient(timeout=HTTP_TIMEOUT, trust_env=False)


def books(url: str) -> dict[str, Any]:
    """The server's counters now, to subtract from later ones (a notebook's server may be
    reused), and its clock, to tell this run's stream records from earlier ones."""
    # ``since=inf`` asks for no records, only the server's clock
    response = httpx.get(f"{url}/lab/streams", params={"since": "inf"}, timeout=HTTP_TIMEOUT, trust_env=False)
    response.raise_for_status()
    return {"stats": server_stats(url), "clock": response.json()["clock"]}


def release_books(url: str, before: dict[str, Any]) -> dict[str, Any]:
    """Since ``before``: streams submitted, finished, admitted, and blocks released.

    Exactly-once means finished == submitted (every stream ended once) and releases == admitted
    (a stream cancelled while it waited never held a block, so it has nothing to release).
    """
    response = httpx.get(f"{url}/lab/streams", params={"since": before["clock"]}, timeout=HTTP_TIMEOUT, trust_env=False)
    response.raise_for_status()
    records, after, was = response.json()["streams"], server_stats(url), before["stats"]
    return {
        "submitted": len(records),
        "finished": sum(after["finishes"].values()) - sum(was["finishes"].values()),
        "admitted": sum(1 for r in records if r["first_token_sampled"] is not None),
        "releases": after["releases"] - was["releases"],
        "late_events": after["late_events"] - was["late_events"],
        "hub_errors": after["errors"] - was["errors"],
    }


def _idle(stats: dict[str, Any]) -> bool:
    return stats["running"] == 0 and stats["waiting"] == 0 and stats["open_streams"] == 0


def server_checks(url: str, timeout: float = 30.0) -> dict[str, Any]:
    """Once the server is idle: is the cache whole, is any stream still registered or held?

    Waits (bounded) for ``/stats`` to show no running, waiting or open stream, then asks the
    server to check its cache on the step thread between two steps (``GET /lab/integrity``).
    A server still busy at ``timeout`` is checked as it is, and the counts say so.
    """
    with contextlib.suppress(WaitTimeout):
        wait_for(lambda: _idle(server_stats(url)), timeout=timeout, what="an idle server", interval=0.02)
    response = httpx.get(f"{url}/lab/integrity", timeout=timeout + HTTP_TIMEOUT, trust_env=False)
    response.raise_for_status()
    answer = response.json()
    stats = answer["stats"]
    return {
        "cache_whole": answer["ok"] and stats["free_blocks"] == stats["total_blocks"],
        "held_blocks": stats["held_blocks"],
        "running": stats["running"],
        "waiting": stats["waiting"],
        "open_streams": stats["open_streams"],
        "what": answer["what"],
    }
