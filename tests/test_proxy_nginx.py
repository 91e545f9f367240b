"""nginx as the lab's child process: the config it gets, and that it is always stopped.

The config tests need no nginx; the others start the real one (skipped, saying why, where it is
not installed: ``make system-deps`` installs it as root, as on CI).
"""
from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from labkit.experiments.proxy import Route, nginx_binary, nginx_config, running_nginx

needs_nginx = pytest.mark.skipif(nginx_binary() is None,
                                 reason="nginx is not installed (make system-deps installs it as root)")


def nginx_processes_using(folder: Path) -> list[int]:
    """Pids of live processes whose command line names ``folder`` (our nginx's config is in it)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                state = (entry / "stat").read_text().split(") ", 1)[1][0]
            except OSError:
                continue
            if "nginx" in cmdline and str(folder) in cmdline and state != "Z":
                pids.append(int(entry.name))
    return pids


# --------------------------------------------------------------------------- the config


def test_config_keeps_every_file_in_its_folder_and_listens_on_loopback_only(tmp_path):
    text = nginx_config(tmp_path, 8081, [Route("a", "http://127.0.0.1:9000")])
    assert "daemon off;" in text and "master_process off;" in text
    assert f"pid {tmp_path / 'nginx.pid'};" in text and f"error_log {tmp_path / 'error.log'}" in text
    for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"):
        assert f"{kind}_temp_path {tmp_path / kind};" in text
    assert "listen 127.0.0.1:8081;" in text and text.count("listen") == 1


def test_a_route_says_exactly_the_settings_it_was_given():
    plain = Route("plain", "http://127.0.0.1:9000").location()
    assert "proxy_buffering on;" in plain and "gzip off;" in plain and "proxy_http_version 1.1;" in plain
    assert "proxy_ignore_headers" not in plain and "gzip_types" not in plain
    assert "proxy_pass http://127.0.0.1:9000/;" in plain and "location /plain/ {" in plain
    odd = Route("odd", "http://127.0.0.1:9000", buffering=False, honour_accel=False, gzip=True,
                read_timeout=0.25, http_version="1.0").location()
    assert "proxy_buffering off;" in odd and "proxy_ignore_headers X-Accel-Buffering;" in odd
    assert "gzip on;" in odd and "gzip_types text/event-stream;" in odd and "proxy_http_version 1.0;" in odd
    assert "proxy_read_timeout 250ms;" in odd


@pytest.mark.parametrize("kwargs", [
    {"name": "Has Space"}, {"name": "../up"}, {"upstream": "http://127.0.0.1:9000/path"},
    {"upstream": "127.0.0.1:9000"}, {"read_timeout": 0}, {"http_version": "2"},
])
def test_bad_routes_are_refused_before_any_config_is_written(kwargs):
    with pytest.raises(ValueError, match="Route"):
        Route(**{"name": "ok", "upstream": "http://127.0.0.1:9000", **kwargs})


# --------------------------------------------------------------------------- the process


@needs_nginx
def test_nginx_proxies_to_a_labkit_server_and_is_gone_after_the_block(tiny_gpt2):
    from labkit.server import serve_in_thread

    with serve_in_thread(tiny_gpt2) as server, running_nginx([Route("app", server.url)]) as nginx:
        folder, process = nginx.folder, nginx.process
        assert nginx_processes_using(folder) == [process.pid]
        response = httpx.get(f"{nginx.base('app')}/healthz", trust_env=False, timeout=10)
        assert response.status_code == 200 and response.json()["status"] == "ok"
        with pytest.raises(KeyError, match="no route"):
            nginx.base("other")
    assert process.returncode is not None  # stopped and reaped
    assert nginx_processes_using(folder) == [] and not folder.exists()


@needs_nginx
def test_nginx_is_stopped_when_the_block_raises():
    with pytest.raises(RuntimeError, match="inside"), running_nginx([Route("app", "http://127.0.0.1:9")]) as nginx:
        process, folder = nginx.process, nginx.folder
        raise RuntimeError("inside")
    assert process.returncode is not None and nginx_processes_using(folder) == []


@needs_nginx
def test_a_config_nginx_refuses_fails_at_start_with_nginx_s_own_reason():
    with pytest.raises(RuntimeError, match="host not found"), \
            running_nginx([Route("app", "http://no-such-host.invalid:80")]):
        pass  # pragma: no cover


def test_without_nginx_the_reason_is_clear(monkeypatch):
    from labkit.experiments import proxy

    monkeypatch.setattr(proxy, "nginx_binary", lambda: None)
    with pytest.raises(proxy.NginxUnavailable, match="make system-deps"), \
            running_nginx([Route("app", "http://127.0.0.1:9")]):
        pass  # pragma: no cover
