"""A fault-injecting loopback HTTP range server for tests (stdlib only).

Usage::

    with RangeServer(folder, faults=Faults(reset=0.05, seed=1)) as server:
        url = server.url                       # http://127.0.0.1:PORT
        server.script("503", "503")            # the next two requests fail with 503, in order
        server.replace_file("a.bin", data)     # new content, new ETag (same size if you like)
        server.log                             # list of RequestRecord, one per request

It serves the files under ``folder`` at ``/<relpath>`` with ``GET`` / ``HEAD``, ``Range:
bytes=a-b`` or ``bytes=-n`` (one range), a strong ``ETag`` (hash of the content) and
``Content-Length``. As a
fake Hugging Face Hub (``hub=HubConfig(...)``) it also answers
``/api/datasets/OWNER/NAME/revision/REV`` with ``{"sha": ...}``, lists
``/api/datasets/OWNER/NAME/tree/REV[/PATH]?recursive=true`` as the Hub does (``HubConfig.page_size``
entries a page, the next page's URL in a ``Link: <…>; rel="next"`` header; ``.mp4``, ``.parquet``
and ``.npz`` files carry their ``lfs.oid``, the SHA-256 of the content) and serves
``/datasets/OWNER/NAME/resolve/REV/<relpath>`` and ``/buckets/OWNER/NAME/resolve/<relpath>``;
with ``redirect_to=<other server>`` every file request gets a ``302`` to the same file on the
other server (carrying ``X-Linked-Etag`` / ``X-Linked-Size`` like the Hub's).

Like the real Hub (its "Rate limits" docs and ``huggingface_hub.utils._http``), the fake one
answers what it refuses with ``X-Error-Code`` / ``X-Error-Message``: no token for a repository
that needs one, or an unknown repository without a token: 401 ``RepoNotFound``; a wrong token:
401 "Invalid credentials in Authorization header"; an unknown repository with a token: 404
``RepoNotFound``; an unknown revision: 404 ``RevisionNotFound``; a missing file: 404
``EntryNotFound``. ``HubConfig.resolver_quota`` counts ``/resolve/`` answers in fixed windows of
``quota_window_s``: each carries ``RateLimit: "resolvers";r=<left>;t=<seconds to reset>`` and
``RateLimit-Policy``, and one past the quota is a 429. ``HubConfig.signed_s`` signs redirect
targets as S3 does (``X-Amz-Date`` + ``X-Amz-Expires``); any server answers a signed URL past
its expiry with 403, as S3 does.

Fault modes (names accepted by :meth:`RangeServer.script`, probabilities in :class:`Faults`):

====================  ==========================================================================
``reset``             headers and half the body, then a TCP reset
``500/502/503``       that status (a burst: ``Faults.burst`` consecutive requests)
``429``               429 with ``Retry-After: Faults.retry_after``
``short``             full ``Content-Length``, half the body, then the connection closes
``short_framed``      the asked range's headers but half its body, with a ``Content-Length`` that
                      agrees: the framing is consistent, only the length is wrong
``short_chunked``     the same, chunked: half the body, then a valid last chunk
``ignore_range``      200 with the whole file
``200_content_range`` 200 with a ``Content-Range`` and the asked slice
``wrong_range``       206 whose ``Content-Range`` and body are shifted by one byte
``416``               416 with ``Content-Range: bytes */size``
``403``               403, as a CDN answers an expired signed URL
``slow``              waits ``Faults.slow_s`` before the status line, or less: until the
                      client hangs up (it timed out) or the server stops
``redirect``          302 to the same path on ``redirect_to``
``4xx`` / ``5xx``     any other such status (e.g. ``425``, ``412``) with a short body
====================  ==========================================================================

Random faults hit only range GETs; scripted ones hit the next requests whatever they are. The
status faults (4xx, 5xx) apply to every path, the Hub API included; the others to file
answers.

Bounded: daemon threads, at most ``max_requests`` served (later requests get a 503 and
``overflowed`` is set), waits end at :meth:`stop`. A handler thread ends once its client closes
the connection, so joining the threads a test started the server's work with is how a test
waits until every connection is closed on both sides. :meth:`stop` closes the server's side of
every connection still open and waits for its thread: nothing of a stopped server is left to
close later, whenever its clients are collected.
"""

from __future__ import annotations

import calendar
import contextlib
import hashlib
import json
import math
import random
import re
import select
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, quote, unquote, urlsplit

FAULT_MODES = ("reset", "500", "502", "503", "429", "short", "ignore_range", "200_content_range",
               "wrong_range", "416", "slow", "redirect", "403", "short_framed", "short_chunked")
_STATUS_MODE = re.compile(r"[45]\d\d")  # any other status a script may name
_RANGE = re.compile(r"bytes=(\d*)-(\d*)")
_HUB_RESOLVE = re.compile(r"/datasets/([^/]+)/([^/]+)/resolve/([^/]+)/(.+)")
_BUCKET_RESOLVE = re.compile(r"/buckets/([^/]+)/([^/]+)/resolve/(.+)")
_HUB_REVISION = re.compile(r"/api/datasets/([^/]+)/([^/]+)/revision/([^/]+)")
_HUB_TREE = re.compile(r"/api/datasets/([^/]+)/([^/]+)/tree/([^/]+)(?:/(.*))?")
_LFS_SUFFIXES = (".mp4", ".parquet", ".npz")  # what the Hub's default .gitattributes keeps in LFS


@dataclass
class Faults:
    """Per-request fault probabilities (0..1) for range GETs, drawn from a seeded RNG."""

    reset: float = 0.0
    status_5xx: float = 0.0  # starts a burst of 500/502/503
    burst: int = 1  # requests per 5xx burst
    too_many: float = 0.0  # 429
    short: float = 0.0
    ignore_range: float = 0.0
    wrong_range: float = 0.0
    slow: float = 0.0
    retry_after: str = "0"
    # Far longer than any read timeout a test sets: a slow answer is never in time, and its
    # thread ends as soon as the client gives up (so nothing depends on how long it waits).
    slow_s: float = 60.0
    seed: int = 0
    # At most this many faults in a row (random or of a 5xx burst) for one (path, range), 0 for
    # no limit: a test of survival must not depend on how threads interleave the seeded draws.
    max_run: int = 0


@dataclass
class HubConfig:
    """The fake Hub's repository: revisions it knows and the token it requires (if any)."""

    revisions: dict[str, str] = field(default_factory=dict)  # branch/tag -> 40-hex commit
    token: str | None = None  # if set, resolve and API calls without it get 401
    page_size: int = 1000  # entries per page of a tree listing
    repo: str | None = None  # the one OWNER/NAME it serves; None: any
    resolver_quota: int = 0  # /resolve/ answers per window; 0: no quota
    quota_window_s: int = 300
    signed_s: int | None = None  # lifetime of signed redirect targets; None: plain targets


@dataclass
class RequestRecord:
    """One request, logged on arrival (``status`` is filled in when the answer starts)."""

    method: str
    path: str
    range: str | None
    authorization: bool  # whether an Authorization header arrived
    headers: dict[str, str]
    mode: str  # fault mode applied, "" for a normal answer
    status: int = 0


class RangeServer:
    """One loopback server (see the module docstring)."""

    def __init__(
        self,
        folder: Path,
        *,
        host: str = "127.0.0.1",
        faults: Faults | None = None,
        hub: HubConfig | None = None,
        redirect_to: RangeServer | None = None,
        max_requests: int = 5000,
    ) -> None:
        self.folder = Path(folder)
        self.faults = faults or Faults()
        self.hub = hub
        self.redirect_to = redirect_to
        self.max_requests = max_requests
        self.log: list[RequestRecord] = []
        self.overflowed = False
        self.gate: threading.Event | None = None  # when set: /resolve/ answers wait for it
        self._rng = random.Random(self.faults.seed)
        self._script: list[str] = []
        self._burst_left = 0
        self._burst_status = ""
        self._runs: dict[tuple[str, str | None], int] = {}  # random faults in a row per request
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._overrides: dict[str, bytes] = {}  # relpath -> replaced content
        self._window = (0.0, 0)  # the resolver quota's window: when it started, answers in it
        self._httpd = _QuietServer((host, 0), _make_handler(self))
        self._thread = threading.Thread(target=self._httpd.serve_forever, args=(0.05,),
                                        daemon=True)

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> RangeServer:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        self._stopping.set()
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(5)
        self._httpd.close_connections(timeout_s=5)

    def script(self, *modes: str) -> None:
        """Apply these modes to the next requests, in order (before any random fault)."""
        unknown = [m for m in modes
                   if m not in FAULT_MODES and m != "" and not _STATUS_MODE.fullmatch(m)]
        assert not unknown, f"unknown fault modes {unknown}"
        with self._lock:
            self._script.extend(modes)

    def replace_file(self, relpath: str, content: bytes) -> None:
        with self._lock:
            self._overrides[relpath] = content

    def tree(self, folder: str) -> list[dict]:
        """The Hub's recursive listing of ``folder`` ("" for the top): directories and files."""
        base = self.folder / folder
        with self._lock:
            overrides = [r for r in self._overrides if r.startswith(folder)]
        paths = set()
        if base.is_dir():
            paths = {str(p.relative_to(self.folder)) for p in base.rglob("*")}
        entries = []
        for relpath in sorted(paths | set(overrides)):
            content = self.content(relpath)
            if content is None:
                entries.append({"type": "directory", "oid": "0" * 40, "size": 0, "path": relpath})
                continue
            blob = hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()
            entry = {"type": "file", "oid": blob, "size": len(content), "path": relpath}
            if relpath.endswith(_LFS_SUFFIXES):
                entry["lfs"] = {"oid": hashlib.sha256(content).hexdigest(), "size": len(content),
                                "pointerSize": 134}
            entries.append(entry)
        return entries

    def content(self, relpath: str) -> bytes | None:
        with self._lock:
            if relpath in self._overrides:
                return self._overrides[relpath]
        path = self.folder / relpath
        if ".." in Path(relpath).parts or not path.is_file():
            return None
        return path.read_bytes()

    @property
    def connections_accepted(self) -> int:
        return self._httpd.accepted

    def modes_seen(self) -> list[str]:
        with self._lock:
            return [r.mode for r in self.log]

    # --- called by the handler -----------------------------------------------------------

    def _choose_mode(self, is_range: bool, key: tuple[str, str | None]) -> str | None:
        """The fault for this request; None means the request budget is spent."""
        with self._lock:
            if len(self.log) >= self.max_requests:
                self.overflowed = True
                return None
            if self._script:
                return self._script.pop(0)
            runs = self._runs.get(key, 0)
            capped = bool(self.faults.max_run) and runs >= self.faults.max_run
            if self._burst_left and not capped:
                self._burst_left -= 1
                self._runs[key] = runs + 1
                return self._burst_status
            if not is_range:
                return ""
            mode = "" if capped else self._random_mode()
            self._runs[key] = runs + 1 if mode else 0
            return mode

    def _random_mode(self) -> str:
        """One seeded draw (the lock is held)."""
        f, draw = self.faults, self._rng.random()
        for mode, p in (("reset", f.reset), ("5xx", f.status_5xx), ("429", f.too_many),
                        ("short", f.short), ("ignore_range", f.ignore_range),
                        ("wrong_range", f.wrong_range), ("slow", f.slow)):
            if draw < p:
                if mode == "5xx":
                    self._burst_status = self._rng.choice(("500", "502", "503"))
                    self._burst_left = f.burst - 1
                    return self._burst_status
                return mode
            draw -= p
        return ""

    def _resolver_quota(self) -> tuple[bool, dict[str, str]]:
        """Whether one more ``/resolve/`` answer fits the quota, and the RateLimit headers."""
        hub, now = self.hub, time.monotonic()
        with self._lock:
            started, used = self._window
            if now >= started + hub.quota_window_s:
                started, used = now, 0
            allowed = used < hub.resolver_quota
            self._window = started, used + allowed
        reset = math.ceil(started + hub.quota_window_s - now)
        return allowed, {"RateLimit": f'"resolvers";r={hub.resolver_quota - used - allowed};'
                                      f't={reset}',
                         "RateLimit-Policy": f'"fixed window";"resolvers";'
                                             f'q={hub.resolver_quota};w={hub.quota_window_s}'}

    def _record(self, record: RequestRecord) -> None:
        with self._lock:
            self.log.append(record)


class _QuietServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128  # the default 5 drops bursts of SYNs: a 1 s resend each

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.connections: list[tuple[socket.socket, threading.Thread]] = []  # with their threads
        self.accepted = 0  # connections accepted so far

    def process_request(self, request, client_address) -> None:
        """Serve the connection on a thread of its own, kept with it for close_connections."""
        thread = threading.Thread(target=self.process_request_thread,
                                  args=(request, client_address), daemon=True)
        self.connections = [(r, t) for r, t in self.connections if t.is_alive()]
        self.connections.append((request, thread))
        self.accepted += 1
        thread.start()

    def close_connections(self, timeout_s: float) -> None:
        """Once nothing is accepted any more: shut every connection still open, so its handler
        reads the end of the stream, and wait until its thread has closed it."""
        for request, _ in self.connections:
            with contextlib.suppress(OSError):  # already closed by its handler
                request.shutdown(socket.SHUT_RDWR)
        for _, thread in self.connections:
            thread.join(timeout_s)

    def handle_error(self, request, client_address) -> None:
        """A client that gave up (timeout, retry) breaks the pipe: expected here, not news."""


def etag_of(content: bytes) -> str:
    return '"' + hashlib.sha256(content).hexdigest()[:32] + '"'


def _make_handler(server: RangeServer):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, so pooled connections are exercised
        disable_nagle_algorithm = True  # else each body waits 40 ms for a delayed ACK

        def setup(self) -> None:
            super().setup()
            # headers and body leave in separate writes: without NODELAY, Nagle + delayed ACK
            # add ~40 ms to every keep-alive request
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def log_message(self, *args) -> None:
            pass

        def do_HEAD(self) -> None:
            self._serve(head=True)

        def do_GET(self) -> None:
            self._serve(head=False)

        # --- routing ---------------------------------------------------------------------

        def _serve(self, head: bool) -> None:
            path = unquote(urlsplit(self.path).path)
            range_header = self.headers.get("Range")
            mode = server._choose_mode(range_header is not None and not head,
                                       (path, range_header))
            self._entry = RequestRecord(
                method=self.command, path=self.path, range=range_header,
                authorization="Authorization" in self.headers, headers=dict(self.headers),
                mode=mode or "",
            )
            server._record(self._entry)
            if mode is None:
                return self._reply(503, b"request limit reached")
            hub = server.hub
            if hub is not None and path.startswith(("/api/", "/datasets/", "/buckets/")):
                refused = self._refusal(hub, path)
                if refused:
                    return self._reply(refused[0], b"refused", extra=refused[1])
            if "X-Amz-Date" in (query := parse_qs(urlsplit(self.path).query)):
                signed = time.strptime(query["X-Amz-Date"][0] + "UTC", "%Y%m%dT%H%M%SZ%Z")
                if calendar.timegm(signed) + int(query["X-Amz-Expires"][0]) < time.time():
                    return self._reply(403, b"<Error><Code>AccessDenied</Code>"
                                            b"<Message>Request has expired</Message></Error>")
            if mode == "429":
                return self._reply(429, b"slow down",
                                   extra={"Retry-After": server.faults.retry_after})
            if _STATUS_MODE.fullmatch(mode) and mode != "416":  # 416 answers a file, below
                return self._reply(int(mode), b"fault")
            if hub is not None and (m := _HUB_REVISION.fullmatch(path)):
                sha = hub.revisions.get(m[3], m[3] if re.fullmatch("[0-9a-f]{40}", m[3]) else "")
                if not sha:
                    return self._reply(404, b"no such revision", extra={
                        "X-Error-Code": "RevisionNotFound",
                        "X-Error-Message": f"Invalid rev id: {m[3]}"})
                return self._reply(200, json.dumps({"sha": sha}).encode(), head=head)
            if hub is not None and (m := _HUB_TREE.fullmatch(path)):
                return self._serve_tree(hub, m[4] or "", head)
            relpath, limits = path.lstrip("/"), {}
            if hub is not None and (m := _HUB_RESOLVE.fullmatch(path)):
                relpath = m[4]
                while server.gate is not None and not server.gate.wait(0.05):
                    if server._stopping.is_set():
                        return None
                if hub.resolver_quota:
                    allowed, limits = server._resolver_quota()
                    if not allowed:
                        return self._reply(429, b"rate limited", extra=limits)
            elif hub is not None and (m := _BUCKET_RESOLVE.fullmatch(path)):
                relpath = m[3]
            content = server.content(relpath)
            if content is None:
                code = {"X-Error-Code": "EntryNotFound", "X-Error-Message": "Entry not found"}
                return self._reply(404, b"not found", extra=code if hub else None)
            if server.redirect_to is not None or mode == "redirect":
                target, signature = server.redirect_to or server, ""
                if hub is not None and hub.signed_s is not None:
                    signature = (f"?X-Amz-Date={time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
                                 f"&X-Amz-Expires={hub.signed_s}&X-Amz-Signature={'0' * 64}")
                return self._reply(302, b"", extra={
                    "Location": f"{target.url}/{quote(relpath)}{signature}",
                    "X-Linked-Etag": etag_of(content),
                    "X-Linked-Size": str(len(content)), **limits,
                })
            self._serve_file(content, range_header, mode, head)

        def _refusal(self, hub: HubConfig, path: str) -> tuple[int, dict[str, str]] | None:
            """The Hub's 401 or 404 for a request it refuses (module docstring), else None."""
            sent = self.headers.get("Authorization")
            if hub.token is not None and sent is not None and sent != f"Bearer {hub.token}":
                return 401, {"X-Error-Message": "Invalid credentials in Authorization header"}
            repo = re.match(r"/(?:api/)?(?:datasets|buckets)/([^/]+/[^/]+)", path)
            unknown = hub.repo is not None and repo is not None and repo[1] != hub.repo
            if (hub.token is not None or unknown) and sent is None:
                return 401, {"X-Error-Code": "RepoNotFound",
                             "X-Error-Message": "Repository not found"}
            if unknown:
                return 404, {"X-Error-Code": "RepoNotFound",
                             "X-Error-Message": "Repository not found"}
            return None

        def _serve_tree(self, hub: HubConfig, folder: str, head: bool) -> None:
            """One page of the listing; the query's ``cursor`` is where the page starts."""
            query = parse_qs(urlsplit(self.path).query)
            start = int(query.get("cursor", ["0"])[0])
            entries = server.tree(folder)
            extra = {"Content-Type": "application/json"}
            if start + hub.page_size < len(entries):
                after = urlsplit(self.path)._replace(
                    query=f"recursive=true&cursor={start + hub.page_size}")
                extra["Link"] = f'<{server.url}{after.geturl()}>; rel="next"'
            page = entries[start : start + hub.page_size]
            return self._reply(200, json.dumps(page).encode(), extra=extra, head=head)

        def _serve_file(self, content: bytes, range_header: str | None, mode: str,
                        head: bool) -> None:
            size, tag = len(content), etag_of(content)
            common = {"ETag": tag, "Accept-Ranges": "bytes"}
            if mode == "416":
                return self._reply(416, b"", extra={"Content-Range": f"bytes */{size}"})
            if mode == "slow" and not self._late_answer_wanted():
                self.close_connection = True
                return
            m = _RANGE.fullmatch(range_header or "")
            if m is None or not (m[1] or m[2]) or mode == "ignore_range" or head:
                return self._reply(200, content, extra=common, head=head, mode=mode)
            if m[1]:
                first = int(m[1])
                last = min(int(m[2]) if m[2] else size - 1, size - 1)
            else:  # a suffix: the last N bytes
                first, last = max(0, size - int(m[2])), size - 1
            if first >= size:
                return self._reply(416, b"", extra={"Content-Range": f"bytes */{size}"})
            if mode == "wrong_range":
                first, last = first + 1, min(last + 1, size - 1)
            headers = dict(common, **{"Content-Range": f"bytes {first}-{last}/{size}"})
            status = 200 if mode == "200_content_range" else 206
            self._reply(status, content[first : last + 1], extra=headers, mode=mode)

        def _late_answer_wanted(self) -> bool:
            """Wait ``Faults.slow_s``; False when the client hung up first or the server stops."""
            deadline = time.monotonic() + server.faults.slow_s
            while not server._stopping.is_set():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return True
                # readable while waiting for our answer: the client closed the connection
                if select.select([self.connection], [], [], min(remaining, 0.05))[0]:
                    return False
            return False

        def _reply(self, status: int, body: bytes, *, extra: dict | None = None,
                   head: bool = False, mode: str = "") -> None:
            self._entry.status = status
            self.send_response(status)
            for name, value in (extra or {}).items():
                self.send_header(name, value)
            if mode in ("short_framed", "short_chunked"):
                body = body[: len(body) // 2]  # and the framing below says that is all of it
            if mode == "short_chunked":
                self.send_header("Transfer-Encoding", "chunked")
            else:
                self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if head or self.command == "HEAD":  # an answer to a HEAD has no body, whatever it is
                return
            if mode == "short_chunked":
                self.wfile.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body))
                return
            if mode in ("reset", "short"):
                self.wfile.write(body[: len(body) // 2])
                self.wfile.flush()
                if mode == "reset":  # SO_LINGER 0: close sends RST instead of FIN
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                               struct.pack("ii", 1, 0))
                else:
                    self.connection.shutdown(socket.SHUT_RDWR)
                self.close_connection = True
                self.connection.close()
                return
            self.wfile.write(body)

    return Handler


def second_loopback_host() -> str:
    """127.0.0.2 when it binds (Linux loopback is a /8), else 127.0.0.1 on another port."""
    try:
        with socket.socket() as sock:
            sock.bind(("127.0.0.2", 0))
        return "127.0.0.2"
    except OSError:
        return "127.0.0.1"
