"""nginx in front of a labkit server, as a child process the lab starts and always stops.

The proxy is the first hop a real stream crosses, and the one that most often breaks it: it
may buffer a response (``proxy_buffering``), honour or ignore the service's
``X-Accel-Buffering: no``, compress ``text/event-stream`` (``gzip``), and cut a response whose
upstream stays quiet longer than ``proxy_read_timeout``. :class:`Route` names one such setting
of a location; :func:`running_nginx` writes one config with a location per route
(``/<route name>/...`` is proxied to ``<upstream>/...``), starts nginx on a free loopback port
and stops it when the block ends, whatever happened inside.

Everything nginx writes stays in a temporary folder: its pid file, error log and temp paths.
It runs in the foreground (``daemon off``) as one process (``master_process off``), so the
child we started is all there is to stop. :func:`nginx_binary` says whether nginx is here;
``make system-deps`` installs it (the Debian package) where it is not.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from labkit.experiments.waiting import wait_for

__all__ = ["Route", "Nginx", "NginxUnavailable", "nginx_binary", "running_nginx", "nginx_config", "free_port"]

_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,63}$")


class NginxUnavailable(RuntimeError):
    """nginx is not installed here (``make system-deps`` installs it as root)."""


@dataclass(frozen=True)
class Route:
    """One location of the proxy: ``/<name>/...`` proxied to ``upstream`` with these settings.

    ``honour_accel`` False adds ``proxy_ignore_headers X-Accel-Buffering``, so the service's
    ``X-Accel-Buffering: no`` no longer turns buffering off. ``read_timeout`` is nginx's
    ``proxy_read_timeout``: the longest silence allowed between two reads from the upstream.
    """

    name: str
    upstream: str  # http://127.0.0.1:PORT
    buffering: bool = True
    honour_accel: bool = True
    gzip: bool = False
    read_timeout: float = 60.0
    http_version: str = "1.1"  # to the upstream; nginx's own default is 1.0 before 1.29.7

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise ValueError(f"Route.name must be lower-case letters, digits, '-' or '_', got {self.name!r}")
        if not re.match(r"^http://[A-Za-z0-9.\[\]:-]+$", self.upstream):
            raise ValueError(f"Route.upstream must be http://host:port with no path, got {self.upstream!r}")
        if self.read_timeout <= 0:
            raise ValueError(f"Route.read_timeout must be > 0, got {self.read_timeout!r}")
        if self.http_version not in ("1.0", "1.1"):
            raise ValueError(f"Route.http_version must be '1.0' or '1.1', got {self.http_version!r}")

    def location(self) -> str:
        on_off = {True: "on", False: "off"}
        lines = [
            f"location /{self.name}/ {{",
            f"    proxy_pass {self.upstream}/;",
            f"    proxy_http_version {self.http_version};",
            '    proxy_set_header Connection "";',
            f"    proxy_buffering {on_off[self.buffering]};",
            f"    proxy_read_timeout {max(1, round(self.read_timeout * 1000))}ms;",
            f"    gzip {on_off[self.gzip]};",
        ]
        if not self.honour_accel:
            lines.append("    proxy_ignore_headers X-Accel-Buffering;")
        if self.gzip:
            lines += ["    gzip_types text/event-stream;", "    gzip_min_length 1;", "    gzip_proxied any;"]
        return "\n".join(lines + ["}"])


def nginx_config(folder: Path, port: int, routes: Sequence[Route]) -> str:
    """The whole config: foreground, one process, every path inside ``folder``, loopback only."""
    temp = "\n".join(
        f"    {kind}_temp_path {folder / kind};" for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    locations = "\n".join("    " + line for route in routes for line in route.location().splitlines())
    return f"""daemon off;
master_process off;
worker_processes 1;
pid {folder / "nginx.pid"};
error_log {folder / "error.log"} info;
events {{ worker_connections 256; }}
http {{
    access_log off;
{temp}
    server {{
        listen 127.0.0.1:{port};
{locations}
    }}
}}
"""


def nginx_binary() -> str | None:
    """Where nginx is (PATH, then /usr/sbin, where Debian puts it), or None."""
    return shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin:/usr/local/sbin")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Nginx:
    """A running nginx: its address, its routes' base URLs, and where its files are."""

    process: subprocess.Popen
    port: int
    folder: Path
    routes: tuple[Route, ...]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def base(self, route: str) -> str:
        """The base URL of route ``route``: ``<nginx>/<route>``."""
        if route not in {r.name for r in self.routes}:
            raise KeyError(f"no route {route!r}; routes: {', '.join(r.name for r in self.routes)}")
        return f"{self.url}/{route}"

    def error_log(self) -> str:
        path = self.folder / "error.log"
        return path.read_text(errors="replace") if path.exists() else ""


@contextlib.contextmanager
def running_nginx(routes: Sequence[Route], *, startup_timeout: float = 10.0) -> Iterator[Nginx]:
    """nginx serving ``routes`` on a free loopback port until the block ends; then stopped and reaped."""
    binary = nginx_binary()
    if binary is None:
        raise NginxUnavailable("nginx is not installed (run `make system-deps` as root, or apt-get install nginx)")
    with tempfile.TemporaryDirectory(prefix="labkit-nginx-") as tmp:
        folder = Path(tmp)
        port = free_port()
        conf = folder / "nginx.conf"
        conf.write_text(nginx_config(folder, port, routes))
        process = subprocess.Popen(
            [binary, "-p", str(folder), "-e", str(folder / "error.log"), "-c", str(conf)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        nginx = Nginx(process, port, folder, tuple(routes))
        try:
            _wait_accepting(nginx, startup_timeout)
            yield nginx
        finally:
            _stop(process)


def _wait_accepting(nginx: Nginx, timeout: float) -> None:
    def accepting() -> bool:
        if nginx.process.poll() is not None:
            stderr = nginx.process.stderr.read().decode(errors="replace") if nginx.process.stderr else ""
            raise RuntimeError(
                f"nginx exited with {nginx.process.returncode} at start: "
                f"{stderr.strip() or nginx.error_log().strip()[-2000:]}"
            )
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", nginx.port), timeout=0.2):
            return True
        return False

    wait_for(accepting, timeout=timeout, what=f"nginx to accept on port {nginx.port}")


def _stop(process: subprocess.Popen) -> None:
    """SIGTERM (nginx's fast shutdown), then SIGKILL if it lingers; always reaped."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5)
    if process.stderr is not None:
        process.stderr.close()
