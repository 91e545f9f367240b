"""GET /metrics (Prometheus, one registry per app), GET /stats, and the lab routes."""
from __future__ import annotations

import uuid
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families
from service_helpers import TIMEOUT, RawClient, lab_server, sse_post, wait_until


def scrape(client: httpx.Client) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    response = client.get("/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(response.text) for s in family.samples}


def test_metrics_count_streams_tokens_and_finishes(tiny_gpt2: Any) -> None:
    with lab_server(tiny_gpt2) as server, httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
        for prompt in ("Hello", "The cat", "One two"):
            sse_post(client, "/v1/stream", {"prompt": prompt, "max_new_tokens": 5})
        leaver = RawClient(server.url).post("/v1/stream", {"prompt": "Bye", "max_new_tokens": 400})
        rid = leaver.read_events(2)[0][1]["request_id"]
        leaver.close_rst()
        wait_until(lambda: server.hub.record(rid).released is not None, what="the cancel")
        metrics = scrape(client)
    assert metrics[("labkit_time_to_first_token_seconds_count", ())] == 4
    assert metrics[("labkit_inter_token_gap_seconds_count", ())] >= 3 * 4
    assert metrics[("labkit_finishes_total", (("reason", "length"),))] == 3
    assert metrics[("labkit_finishes_total", (("reason", "cancelled"),))] == 1
    assert metrics[("labkit_stream_ends_total", (("end", "client_gone"),))] == 1
    assert metrics[("labkit_open_streams", ())] == 0
    assert metrics[("labkit_kv_blocks_in_use", ())] == 0 and metrics[("labkit_queue_depth", ())] == 0
    assert metrics[("labkit_late_events_total", ())] >= 1
    assert ("python_gc_collections_total", (("generation", "2"),)) in metrics  # a full collection stalls every stream
    assert ("python_gc_frozen_objects", ()) in metrics


def test_the_heap_freezes_after_a_collection_later_garbage_is_collected_and_a_scrape_never_recounts() -> None:
    """In a process of its own: a freeze is for the whole interpreter, and this one is the tests'."""
    import subprocess
    import sys

    script = """if True:
        import gc, weakref
        from labkit.server import freeze_heap
        class Node: pass
        def cycle():
            a, b = Node(), Node()
            a.other, b.other = b, a
            return weakref.ref(a)
        before = cycle()  # garbage already: the freeze must not keep it forever
        frozen = freeze_heap()
        assert before() is None and frozen == gc.get_freeze_count() > 10_000, frozen
        after = cycle()
        gc.collect()
        assert after() is None  # made after the freeze: collected as ever
        from types import SimpleNamespace as NS
        from labkit.service.metrics import StateCollector
        def walk():
            raise AssertionError("a scrape walked the frozen list (about 33 ms on the event loop)")
        gc.get_freeze_count = walk
        hub = NS(queued_events=0, dropped={})
        stats = NS(open_streams=0, waiting=0, running=0, paused=0, held_blocks=0, total_blocks=8, finishes={},
                   stream_ends={}, late_events=0, hub=hub)
        gauges = {m.name: m.samples[0].value for m in StateCollector(lambda: stats).collect() if m.samples}
        assert gauges["python_gc_frozen_objects"] == frozen, gauges
        print("ok")
    """
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_two_servers_in_one_process_keep_separate_metrics(tiny_gpt2: Any) -> None:
    with lab_server(tiny_gpt2) as one, lab_server(tiny_gpt2) as two:
        with httpx.Client(base_url=one.url, timeout=TIMEOUT) as client:
            sse_post(client, "/v1/stream", {"prompt": "Hello", "max_new_tokens": 3})
            assert scrape(client)[("labkit_finishes_total", (("reason", "length"),))] == 1
        with httpx.Client(base_url=two.url, timeout=TIMEOUT) as client:
            assert ("labkit_finishes_total", (("reason", "length"),)) not in scrape(client)


def test_stats_report_engine_and_hub_state(tiny_gpt2: Any) -> None:
    with lab_server(tiny_gpt2, policy="drop") as server, httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
        sse_post(client, "/v1/stream", {"prompt": "Hello", "max_new_tokens": 3})
        stats = client.get("/stats").json()
    for key in ("open_streams", "waiting", "running", "paused", "free_blocks", "held_blocks", "total_blocks",
                "releases", "late_events", "finishes", "stream_ends", "errors", "draining", "engine", "hub"):
        assert key in stats, key
    assert stats["free_blocks"] == stats["total_blocks"] and stats["held_blocks"] == 0
    assert stats["finishes"] == {"length": 1} and stats["releases"] == 1
    assert stats["hub"]["policy"] == "drop" and stats["model"] == "tiny-gpt2"


def flood_state(client: httpx.Client, flood_id: str) -> dict[str, Any]:
    """The flood's record, or {} while its request has not reached the server yet."""
    response = client.get(f"/lab/flood/{flood_id}")
    return response.json() if response.status_code == 200 else {}


def test_flood_measures_the_bytes_accepted_before_a_write_blocks(tiny_gpt2: Any) -> None:
    flood_id = uuid.uuid4().hex[:8]
    with lab_server(tiny_gpt2) as server, httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
        reader = RawClient(server.url, decode=False).post("/lab/flood", {"flood_id": flood_id, "event_bytes": 16384,
                                                                         "count": 2000})  # 32 MB, far past any buffer
        record = wait_until(lambda: flood_state(client, flood_id).get("blocked") and flood_state(client, flood_id),
                            what="the write to block")  # the raw client has read nothing
        assert record["bytes_accepted"] == record["events_accepted"] * 16384 > 0
        assert record["wire_bytes_accepted"] > record["bytes_accepted"]
        reader.close_rst()
        wait_until(lambda: flood_state(client, flood_id)["finished"], what="the flood to end")
        assert client.get("/lab/flood/unknown").status_code == 404


def test_flood_events_have_exactly_the_requested_size(tiny_gpt2: Any) -> None:
    with lab_server(tiny_gpt2) as server:
        reader = RawClient(server.url, decode=False).post("/lab/flood", {"event_bytes": 100, "count": 5})
        reader.read_to_end()
    assert len(reader.raw) == 500 and reader.raw.count(b"event: flood\n") == 5


def test_stats_and_metrics_name_the_same_books_the_same_way(tiny_gpt2: Any) -> None:
    with lab_server(tiny_gpt2) as server, httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
        for prompt in ("Hello", "The cat"):
            sse_post(client, "/v1/stream", {"prompt": prompt, "max_new_tokens": 4})
        wait_until(lambda: server.hub.open_streams == 0, what="the streams to close")
        stats, metrics = client.get("/stats").json(), scrape(client)
    pairs = {"open_streams": "labkit_open_streams", "waiting": "labkit_queue_depth",
             "running": "labkit_running_requests", "paused": "labkit_paused_requests",
             "held_blocks": "labkit_kv_blocks_in_use", "total_blocks": "labkit_kv_blocks_total",
             "late_events": "labkit_late_events_total"}
    for key, name in pairs.items():
        assert stats[key] == metrics[(name, ())], key
    assert stats["finishes"] == {"length": metrics[("labkit_finishes_total", (("reason", "length"),))]}
    assert stats["stream_ends"] == {"length": metrics[("labkit_stream_ends_total", (("end", "length"),))]}
    assert stats["hub"]["states"] == {} and stats["hub"]["dropped"] == {}
