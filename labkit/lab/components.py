"""Real programs an experiment starts beside the server: nginx, a headless Chromium, a redis-server.

Each starts in its constructor on 127.0.0.1, keeps what it writes in a temporary folder, and is
stopped and reaped by ``close()`` (or a ``with`` block's end) whatever happened. A program that is
not installed raises :class:`~labkit.lab.target.NotMeasurable` naming it and its Debian package
(``make system-deps`` installs them as root), and a cell says in one line what the machine lacks.
:class:`Nginx`: ``/<route>/`` proxied to each :class:`Route`'s upstream with its own buffering,
gzip, timeouts and client-abort settings, over HTTP/1.1 or TLS and HTTP/2. :class:`Chromium`:
Selenium on the system's Chromium and chromedriver. :class:`Redis`: a throwaway redis-server."""

from __future__ import annotations

import contextlib
import re
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from labkit.lab.target import NotMeasurable, free_port, stop_process
from labkit.lab.witness import wait_for

__all__ = ["Route", "Nginx", "Chromium", "Redis", "Components", "self_signed", "program"]

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,63}$")
_UPSTREAM = re.compile(r"^http://[A-Za-z0-9.\[\]:-]+$")


def program(name: str, package: str | None = None) -> str:
    """The path of ``name`` (PATH, then the sbin folders), or :class:`NotMeasurable` naming it."""
    found = shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/local/sbin")
    if found is None:
        raise NotMeasurable(name, f"{name} is not installed (apt-get install {package or name})")
    return found


class _Component(contextlib.AbstractContextManager[Any]):
    def close(self) -> None:  # pragma: no cover - every component has its own
        raise NotImplementedError

    def __exit__(self, *exc: object) -> None:
        self.close()


class Components(_Component):
    """What a measurement's ``prepare`` started, as attributes; the runner closes them after the last trial."""

    @classmethod
    def start(cls, **makers: Any) -> Components:
        """Each ``name=lambda: Thing(...)`` started in turn; if one fails, those before it are closed."""
        started = cls()
        try:
            for name, make in makers.items():
                setattr(started, name, make())
        except BaseException:
            started.close()
            raise
        return started

    def close(self) -> None:
        for part in reversed(list(vars(self).values())):
            part.close()


@dataclass(frozen=True)
class Route:
    """``/<name>/...`` proxied to ``upstream``; ``honour_accel`` False ignores the app's ``X-Accel-Buffering``,
    ``read_timeout`` is the longest silence between two reads from the upstream."""

    name: str
    upstream: str  # http://127.0.0.1:PORT, no path
    buffering: bool = True
    honour_accel: bool = True
    gzip: bool = False
    read_timeout: float = 60.0
    ignore_client_abort: bool = False
    http_version: str = "1.1"  # to the upstream; nginx's own default is 1.0 before 1.29.7

    def __post_init__(self) -> None:
        for ok, name, must in ((_NAME.match(self.name), "name", "lower-case letters, digits, '-' or '_'"),
                               (_UPSTREAM.match(self.upstream), "upstream", "http://host:port with no path"),
                               (0 < self.read_timeout <= 86400, "read_timeout", "in (0, 86400] seconds"),
                               (self.http_version in ("1.0", "1.1"), "http_version", "'1.0' or '1.1'")):  # fmt: skip
            if not ok:
                raise ValueError(f"Route.{name} must be {must}, got {getattr(self, name)!r}")

    def location(self) -> str:
        on = {True: "on", False: "off"}
        lines = [f"location /{self.name}/ {{", f"proxy_pass {self.upstream}/;", f"proxy_http_version {self.http_version};",
                 'proxy_set_header Connection "";', f"proxy_buffering {on[self.buffering]};", f"gzip {on[self.gzip]};",
                 f"proxy_read_timeout {max(1, round(self.read_timeout * 1000))}ms;",
                 f"proxy_ignore_client_abort {on[self.ignore_client_abort]};"]  # fmt: skip
        lines += [] if self.honour_accel else ["proxy_ignore_headers X-Accel-Buffering;"]
        lines += ["gzip_types text/event-stream application/json; gzip_min_length 1; gzip_proxied any;"] * self.gzip
        return "\n    ".join(lines) + "\n}"


def self_signed(folder: Path, host: str = "127.0.0.1") -> tuple[Path, Path]:
    """A certificate and key for ``host`` (a day's validity), made with the ``openssl`` CLI."""
    cert, key = folder / "cert.pem", folder / "key.pem"
    argv = [program("openssl"), "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", f"/CN={host}",
            "-addext", f"subjectAltName=IP:{host}", "-keyout", str(key), "-out", str(cert)]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, timeout=60, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"openssl could not make a certificate: {done.stderr.decode(errors='replace')[-500:]}")
    return cert, key


class Nginx(_Component):
    """nginx in the foreground, one process, on a free loopback port; ``tls``: HTTPS with a self-signed
    certificate (a client must be told to accept it), and HTTP/2 unless ``http2`` is False."""

    def __init__(self, routes: list[Route], *, tls: bool = False, http2: bool = True, startup_s: float = 10.0):
        binary = program("nginx")
        self.routes = {r.name: r for r in routes}
        self._tmp = tempfile.TemporaryDirectory(prefix="labkit-nginx-")
        self.folder, self.port, self.tls = Path(self._tmp.name), free_port(), tls
        listen = f"127.0.0.1:{self.port}"
        if tls:
            cert, key = self_signed(self.folder)
            listen += " ssl http2" if http2 else " ssl"
            listen += f";\n        ssl_certificate {cert};\n        ssl_certificate_key {key}"
        conf = self.folder / "nginx.conf"
        conf.write_text(self._config(listen))
        argv = [binary, "-p", str(self.folder), "-e", str(self.folder / "error.log"), "-c", str(conf)]
        quiet = {"stdin": subprocess.DEVNULL, "stdout": subprocess.DEVNULL}
        self.process = subprocess.Popen(argv, stderr=subprocess.PIPE, **quiet)  # type: ignore[call-overload]
        try:
            wait_for(self._accepting, timeout=startup_s, what=f"nginx to accept on port {self.port}")
        except BaseException:
            self.close()
            raise

    def _config(self, listen: str) -> str:
        f = self.folder
        temp = "".join(f"    {k}_temp_path {f / k};\n" for k in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
        locations = "".join(f"        {line}\n" for r in self.routes.values() for line in r.location().splitlines())
        return (
            f"daemon off;\nmaster_process off;\nworker_processes 1;\npid {f / 'nginx.pid'};\n"
            f"error_log {f / 'error.log'} info;\nevents {{ worker_connections 1024; }}\nhttp {{\n"
            f"    log_format lab '$msec $status $request_uri';\n    access_log {f / 'access.log'} lab;\n{temp}"
            f"    server {{\n        listen {listen};\n{locations}    }}\n}}\n"
        )

    def _accepting(self) -> bool:
        if self.process.poll() is not None:
            said = self.process.stderr.read().decode(errors="replace") if self.process.stderr else ""
            log = (self.folder / "error.log").read_text(errors="replace")[-2000:]
            raise RuntimeError(f"nginx exited with {self.process.returncode} at start: {said.strip() or log}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
            return True
        return False

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

    def base(self, route: str) -> str:
        if route not in self.routes:
            raise KeyError(f"no route {route!r}; routes: {', '.join(self.routes)}")
        return f"{self.url}/{route}"

    def access_log(self) -> list[tuple[float, int, str]]:
        """Every request nginx finished so far: (Unix time, status, path with query)."""
        path = self.folder / "access.log"
        lines = path.read_text(errors="replace").splitlines() if path.exists() else []
        return [(float(t), int(s), uri) for t, s, uri in (line.split(" ", 2) for line in lines if line.count(" ") >= 2)]

    def close(self) -> None:
        stop_process(self.process, 5.0)
        if self.process.stderr is not None:
            self.process.stderr.close()
        self._tmp.cleanup()


class Chromium(_Component):
    """Headless Chromium through chromedriver. ``insecure_tls`` accepts any certificate (the lab's
    self-signed ones); ``script`` (JavaScript, or its file) is injected into every page :meth:`open` opens."""

    def __init__(self, *, insecure_tls: bool = False, script: str | Path = "") -> None:
        for path, package in ((CHROMIUM, "chromium"), (CHROMEDRIVER, "chromium-driver")):
            if not Path(path).exists():
                raise NotMeasurable(Path(path).name, f"{path} is not installed (apt-get install {package})")
        try:
            from selenium import webdriver
            from selenium.webdriver.chrome.service import Service
        except ImportError:
            raise NotMeasurable("selenium", "selenium is not installed (pip install selenium)") from None
        options = webdriver.ChromeOptions()
        options.binary_location = CHROMIUM
        flags = ["--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--no-first-run",
                 "--disable-extensions", "--disable-background-networking", "--window-size=800,600"]  # fmt: skip
        for flag in flags + (["--ignore-certificate-errors"] if insecure_tls else []):
            options.add_argument(flag)
        options.accept_insecure_certs = insecure_tls
        service = Service(executable_path=CHROMEDRIVER, log_output=subprocess.DEVNULL)
        self.driver = webdriver.Chrome(service=service, options=options)
        self.script = script.read_text(encoding="utf-8") if isinstance(script, Path) else script
        self.main = self.driver.current_window_handle

    def open(self, url: str) -> None:
        """Load ``url`` (any page of the origin the script should run in) and inject the script."""
        self.driver.get(url)
        if self.script:
            self.driver.execute_script(self.script)

    def call(self, function: str, argument: Any = None, timeout: float = 60.0) -> Any:
        """``await function(argument)`` in the page; its value (JSON-like), or ``{"error": ...}``."""
        self.driver.set_script_timeout(timeout)
        done = "arguments[arguments.length - 1]"
        script = f"{function}(arguments[0]).then({done}, (e) => {done}({{error: String(e)}}));"
        return self.driver.execute_async_script(script, argument)

    def value(self, expression: str) -> Any:
        return self.driver.execute_script(f"return {expression};")

    def new_tab(self, url: str) -> None:
        """Open ``url`` in a new tab (the script injected) and switch to it."""
        self.driver.switch_to.new_window("tab")
        self.open(url)

    def close_tab(self) -> float:
        """Close the current tab as a user would; when the close began, on labkit's records' clock."""
        closed = time.perf_counter()
        self.driver.close()
        self.driver.switch_to.window(self.main)
        return closed

    def close(self) -> None:
        with contextlib.suppress(Exception):  # a browser that already died has nothing to quit
            self.driver.quit()


class Redis(_Component):
    """A throwaway redis-server on a free loopback port (``url``); nothing persisted."""

    def __init__(self) -> None:
        from labkit.server import local_redis

        program("redis-server")
        self._context = local_redis()
        self.url: str = self._context.__enter__()

    def close(self) -> None:
        self._context.__exit__(None, None, None)
