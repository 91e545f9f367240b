"""The browser demo's service side: the page, and the resume route that sends retry: and drops.

Notebook 08's ``production.browser`` drives the page with headless Chromium; here the page and
the drop hook are checked with httpx alone, so they need no browser.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from service_helpers import TIMEOUT, lab_server


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
