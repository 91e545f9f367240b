"""The programs an experiment starts beside the server, each for real on 127.0.0.1: nginx (plain,
and TLS with HTTP/2), headless Chromium, redis-server. Each starts, answers, and is gone after its
block (process reaped, files removed); a missing program is a NotMeasurable naming its package.
A test whose program this machine lacks is skipped, saying which (make system-deps installs them)."""
from __future__ import annotations

import contextlib
import json
import shutil
import socket
import ssl
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from labkit.lab import NotMeasurable
from labkit.lab.components import CHROMEDRIVER, CHROMIUM, Chromium, Components, Nginx, Redis, Route

needs_nginx = pytest.mark.skipif(shutil.which("nginx", path="/usr/sbin:/usr/bin:/usr/local/sbin") is None,
                                 reason="nginx is not installed (make system-deps installs it)")  # fmt: skip
needs_chromium = pytest.mark.skipif(not (Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists()),
                                    reason="chromium and chromedriver are not installed (make system-deps)")  # fmt: skip
needs_redis = pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")


class Answer(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        body = json.dumps({"path": self.path}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture()
def upstream() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Answer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join(5)


def closed(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
        return False
    return True


def test_a_route_is_checked_before_any_config_is_written():
    for bad in ({"name": "Up/Per"}, {"upstream": "http://127.0.0.1:9/path"}, {"read_timeout": 0}, {"http_version": "2"}):
        with pytest.raises(ValueError, match="Route"):
            Route(**{"name": "ok", "upstream": "http://127.0.0.1:9", **bad})
    location = Route("app", "http://127.0.0.1:9", buffering=False, honour_accel=False, ignore_client_abort=True).location()
    assert "proxy_buffering off;" in location and "proxy_ignore_headers X-Accel-Buffering;" in location
    assert "proxy_ignore_client_abort on;" in location and "gzip off;" in location


def test_a_missing_program_is_not_measurable_and_names_its_package(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda *a, **k: None)
    with pytest.raises(NotMeasurable, match=r"nginx is not installed \(apt-get install nginx\)"):
        Nginx([Route("app", "http://127.0.0.1:9")])
    with pytest.raises(NotMeasurable, match="redis-server is not installed"):
        Redis()


def test_components_started_before_one_that_fails_are_closed():
    closed_parts = []

    class Part:
        def __init__(self, name: str) -> None:
            self.name = name

        def close(self) -> None:
            closed_parts.append(self.name)

    def fails() -> Part:
        raise NotMeasurable("nginx", "nginx is not installed")

    with pytest.raises(NotMeasurable):
        Components.start(first=lambda: Part("first"), second=lambda: Part("second"), third=fails)
    assert closed_parts == ["second", "first"]


@needs_nginx
def test_nginx_proxies_each_route_logs_every_request_and_is_gone_after_its_block(upstream):
    with Nginx([Route("app", upstream), Route("gone", "http://127.0.0.1:9")]) as nginx:
        folder, process = nginx.folder, nginx.process
        assert httpx.get(f"{nginx.base('app')}/hello?x=1", trust_env=False, timeout=10).json() == {"path": "/hello?x=1"}
        assert httpx.get(f"{nginx.base('gone')}/x", trust_env=False, timeout=10).status_code == 502
        assert [(status, uri) for _, status, uri in nginx.access_log()] == [(200, "/app/hello?x=1"), (502, "/gone/x")]
        with pytest.raises(KeyError, match="no route"):
            nginx.base("other")
    assert process.returncode is not None and not folder.exists() and closed(nginx.port)


@needs_nginx
def test_nginx_with_tls_speaks_http2_with_a_certificate_it_made(upstream):
    with Nginx([Route("app", upstream)], tls=True) as nginx:
        context = ssl.create_default_context()
        context.check_hostname, context.verify_mode = False, ssl.CERT_NONE  # the lab's self-signed certificate
        context.set_alpn_protocols(["h2", "http/1.1"])
        with socket.create_connection(("127.0.0.1", nginx.port), timeout=10) as raw, \
                context.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
            assert tls.selected_alpn_protocol() == "h2"
        answer = httpx.get(f"{nginx.base('app')}/tls", verify=False, trust_env=False, timeout=10)
        assert nginx.url.startswith("https://") and answer.json() == {"path": "/tls"}


@needs_nginx
def test_a_config_nginx_refuses_fails_at_start_with_nginx_s_reason():
    with pytest.raises(RuntimeError, match="host not found"):
        Nginx([Route("app", "http://no-such-host.invalid:80")])


@needs_chromium
def test_chromium_runs_an_injected_script_on_an_origin_and_closes_a_tab(upstream):
    script = "window.lab = { echo: async (x) => ({ got: x, origin: location.origin }) };"
    with Chromium(script=script) as chromium:
        chromium.open(f"{upstream}/page")
        assert chromium.call("lab.echo", {"n": 1}, timeout=10) == {"got": {"n": 1}, "origin": upstream}
        assert chromium.call("Promise.reject", "no", timeout=10) == {"error": "no"}
        chromium.new_tab(f"{upstream}/tab")
        assert chromium.value("location.pathname") == "/tab" and chromium.value("typeof lab") == "object"
        chromium.close_tab()
        assert chromium.value("location.pathname") == "/page" and len(chromium.driver.window_handles) == 1
        service = chromium.driver.service.process
    assert service.poll() is not None  # chromedriver (and its browser) quit


@needs_redis
def test_redis_answers_and_its_port_is_closed_after_its_block():
    with Redis() as redis:
        port = int(redis.url.rsplit(":", 1)[1].split("/")[0])
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(b"PING\r\n")
            assert sock.recv(16).startswith(b"+PONG")
    assert closed(port)
