"""A real nginx on 127.0.0.1 serving a folder, for tests that need a production Range server.

Usage (a context manager, or the ``nginx_server`` pytest fixture factory)::

    with NginxServer(folder) as server:
        server.url                  # http://127.0.0.1:PORT
        server.access_log()         # list of AccessRecord(method, path, status, range, bytes)
        server.mark()               # the log's length, every request answered so far in it

nginx must be installed (CI's ``.ci/run`` installs it): when it is missing the test fails with a
message saying so, it is never skipped. Everything nginx writes (config, pid, logs, temp dirs)
lives in a private temporary directory; the access log records the ``Range`` header of every
request. ``stop()`` terminates the master process and waits for it.

nginx writes a request's log line just after the answer's last byte has left, so a client can
read an answer before its line exists. ``access_log()`` therefore first asks for a marker path and
waits until the marker's line is written: the one worker process handles requests in turn, so
every answer the caller has already read is in the log by then (markers are left out).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

_START_TIMEOUT_S = 30.0  # hang guards: nginx starts in milliseconds
_STOP_TIMEOUT_S = 10.0
_START_ATTEMPTS = 5  # another process may take the free port before nginx binds it
_MARKER = "/.refstream-log-marker/"
# One field per tab so paths with spaces stay parseable; "-" is nginx's empty value.
_LOG_FORMAT = "$request_method\\t$uri\\t$status\\t$http_range\\t$body_bytes_sent"


@dataclass(frozen=True)
class AccessRecord:
    method: str
    path: str  # decoded URI path
    status: int
    range: str | None  # the Range request header, None when absent
    body_bytes: int  # body bytes sent


def find_nginx() -> str | None:
    """The nginx binary: on PATH, or in the sbin directories PATH often lacks."""
    candidates = ("/usr/sbin/nginx", "/usr/local/sbin/nginx")
    return shutil.which("nginx") or next((p for p in candidates if os.path.exists(p)), None)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _config(folder: Path, work: Path, port: int) -> str:
    # As root, workers would default to "nobody", who cannot read pytest's 0700 temp dirs.
    user = "user root;\n" if os.geteuid() == 0 else ""
    temp = "\n".join(f"    {kind}_temp_path {work / kind};"
                     for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    return f"""{user}worker_processes 1;
pid {work / "nginx.pid"};
error_log {work / "error.log"} warn;
events {{ worker_connections 64; }}
http {{
    default_type application/octet-stream;
    log_format ranges "{_LOG_FORMAT}";
    access_log {work / "access.log"} ranges;
{temp}
    server {{
        listen 127.0.0.1:{port};
        root {folder};
        location / {{ }}
        location ^~ {_MARKER} {{ return 204; }}
    }}
}}
"""


class NginxServer:
    """nginx serving ``folder`` read-only on a free loopback port."""

    def __init__(self, folder: Path) -> None:
        binary = find_nginx()
        if binary is None:
            pytest.fail("nginx is not installed: install it (apt-get install nginx-light; "
                        ".ci/run does) — these tests need a real Range server", pytrace=False)
        self.folder = Path(folder).resolve()
        self._markers = 0
        for _ in range(_START_ATTEMPTS):
            self._work = Path(tempfile.mkdtemp(prefix="refstream-nginx-"))
            self.port = _free_port()
            self.url = f"http://127.0.0.1:{self.port}"
            config = self._work / "nginx.conf"
            config.write_text(_config(self.folder, self._work, self.port))
            self._process = subprocess.Popen(
                [binary, "-p", str(self._work), "-c", str(config), "-g", "daemon off;"],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            )
            errors = self._wait_ready()
            if errors is None:
                return
            self._cleanup()
            if "Address already in use" not in errors:
                break
        pytest.fail(f"nginx exited at start: {errors.strip()}", pytrace=False)

    def _wait_ready(self) -> str | None:
        """None once nginx accepts connections; its error output if it exited instead."""
        deadline = time.monotonic() + _START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                return self._process.stderr.read().decode(errors="replace")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return None
            except OSError:
                time.sleep(0.05)
        self.stop()
        pytest.fail(f"nginx did not listen on port {self.port} within {_START_TIMEOUT_S} s")

    def access_log(self) -> list[AccessRecord]:
        """Every request answered so far (module docstring: complete up to this call)."""
        self._markers += 1
        marker = f"{_MARKER}{self._markers}"
        with socket.create_connection(("127.0.0.1", self.port), timeout=_START_TIMEOUT_S) as sock:
            sock.sendall(f"GET {marker} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
                         .encode())
            while sock.recv(4096):  # until nginx closes: the answer has left
                pass
        deadline = time.monotonic() + _START_TIMEOUT_S
        while True:
            records = self._read_log()
            if any(r.path == marker for r in records):
                return [r for r in records if not r.path.startswith(_MARKER)]
            assert time.monotonic() < deadline, f"nginx never logged {marker}"
            time.sleep(0.01)

    def _read_log(self) -> list[AccessRecord]:
        path = self._work / "access.log"
        records = []
        # nginx writes whole lines; the text after the last newline may be one half written
        for line in path.read_text().split("\n")[:-1] if path.exists() else []:
            method, uri, status, range_header, sent = line.split("\t")
            records.append(AccessRecord(method, uri, int(status),
                                        None if range_header == "-" else range_header, int(sent)))
        return records

    def mark(self) -> int:
        """The access log's length once every request answered so far is in it: nginx writes a
        request's line after its answer left, so a marker request is sent and waited for."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=5) as sock:
            sock.sendall(b"HEAD /refstream-test-mark HTTP/1.0\r\n\r\n")
            while sock.recv(4096):
                pass
        deadline = time.monotonic() + _START_TIMEOUT_S
        while time.monotonic() < deadline:
            log = self.access_log()
            if any(r.path == "/refstream-test-mark" for r in log):
                return len(log)
            time.sleep(0.01)
        pytest.fail("nginx did not log the marker request")

    def stop(self) -> None:
        if self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait(_STOP_TIMEOUT_S)
        self._cleanup()

    def _cleanup(self) -> None:
        if self._process.stderr is not None:
            self._process.stderr.close()
        shutil.rmtree(self._work, ignore_errors=True)

    def __enter__(self) -> NginxServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


@pytest.fixture
def nginx_server():
    """Factory fixture: ``nginx_server(folder)`` starts nginx; all are stopped at teardown."""
    started: list[NginxServer] = []

    def start(folder: Path) -> NginxServer:
        server = NginxServer(folder)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()
