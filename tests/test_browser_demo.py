"""The browser demo: a real server, real headless Chromium (the system's), bounded in time.

The page streams with EventSource from the resumable GET route and with fetch from the POST
route; the server cuts the EventSource connection mid-stream and the browser must come back by
itself with Last-Event-ID, after the server's retry: delay, and end with the uninterrupted events.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from service_helpers import TIMEOUT, lab_server

from labkit.experiments import browser

pytestmark = pytest.mark.skipif(browser.missing() is not None, reason=str(browser.missing()))


def test_the_demo_page_is_served_with_lab_routes_and_loads_nothing_from_elsewhere(tiny_gpt2: Any) -> None:
    with lab_server(tiny_gpt2) as server:
        page = httpx.get(server.url + "/lab/demo", timeout=TIMEOUT)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "EventSource" in page.text and "fetch(" in page.text
    assert "http://" not in page.text and "https://" not in page.text  # no CDN


def test_the_drop_hook_cuts_the_connection_without_ending_the_stream(tiny_gpt2: Any) -> None:
    with lab_server(tiny_gpt2) as server, httpx.Client(base_url=server.url, timeout=TIMEOUT) as http:
        first = http.post("/v1/stream", json={"prompt": "Hi", "max_new_tokens": 12, "ignore_eos": True, "resumable": True})
        rid, token = first.headers["x-request-id"], first.headers["x-resume-token"]
        url = f"/lab/demo/events/{rid}"
        with http.stream("GET", url, params={"token": token, "retry": 300, "drop_after": 5}) as cut:
            seen = bytearray()
            with pytest.raises(httpx.RemoteProtocolError):  # closed before the chunked body ended
                for chunk in cut.iter_raw():
                    seen += chunk
        rest = http.get(url, params={"token": token}, headers={"Last-Event-ID": "5"}).text
    assert seen.startswith(b"retry: 300\n\n") and b"id: 5\n" in seen and b"id: 6\n" not in seen
    # ids: 1 start, 2..13 the twelve tokens, 14 done; after 5 come tokens 6..13 and done
    assert rest.count("event: token") == 8 and "id: 6\n" in rest and "id: 5\n" not in rest
    assert "event: done" in rest


def test_chromium_resumes_exactly_and_waits_as_long_as_retry_says(tiny_gpt2: Any, tmp_path: Any) -> None:
    config = browser.Config(model="tiny-gpt2", tokens=16, drop_after=6, retries_ms=(200, 1200), repetitions=1,
                            timeout=30)
    with lab_server(tiny_gpt2) as server:
        tables = browser.run(config, server=server, screenshot=tmp_path / "shot.png")
    runs = tables["runs"]
    cut = runs[runs.condition != browser.UNINTERRUPTED]
    assert (runs.ended_by == "done").all() and runs.same_as_uninterrupted.all()
    assert (cut.connections == 2).all() and (cut.first_id_after_reconnect == 7).all()
    delays = cut.set_index("retry_ms").reconnect_delay_ms
    assert delays[200] >= 200 and delays[1200] >= 1200 and delays[1200] > delays[200]
    assert [v.holds for v in browser.verdicts(tables, config)] == [True, True, True]
    assert (tmp_path / "shot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the engine's steps of the run, for its step-time spread: every page's stream decoded in them
    steps = tables["steps"]
    assert list(steps.columns[:5]) == ["step", "started", "seconds", "decoded", "prefilled"]
    assert steps.decoded.sum() >= len(runs) * config.tokens - len(runs)
