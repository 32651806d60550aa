"""HTTP answers that must be retried or not, the retry log, and roots that are not folders:
against the fault-injecting loopback server (tests/rangeserver.py)."""

from __future__ import annotations

import http.client
import logging
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from rangeserver import RangeServer

from refstream.errors import HTTPStatusError, MalformedDataset, PayloadChanged, UsageError
from refstream.http import HTTPSource, RetryPolicy
from refstream.roots import open_source
from refstream.source import LocalSource

FILE_BYTES = 300_000
TOKEN = "hf_refstreamSecretToken0123456789"
FAST = RetryPolicy(max_attempts=4, backoff_base_s=0.01, backoff_cap_s=0.05,
                   rate_limit_wait_s=5.0)


@pytest.fixture
def folder(tmp_path) -> Path:
    root = tmp_path / "root"
    (root / "data").mkdir(parents=True)
    (root / "data" / "blob.bin").write_bytes(os.urandom(FILE_BYTES))
    return root


@pytest.fixture
def server(folder):
    with RangeServer(folder) as srv:
        yield srv


def blob(folder: Path) -> bytes:
    return (folder / "data" / "blob.bin").read_bytes()


# --- a short body whose framing agrees with it --------------------------------------------------


@pytest.mark.parametrize("mode", ["short_framed", "short_chunked"])
def test_a_range_answered_by_a_short_but_well_framed_body_is_retried(folder, server, mode):
    source = HTTPSource(server.url, retry=FAST)
    server.script(mode)
    assert source.read_range("data/blob.bin", 5000, 100_000) == blob(folder)[5000:105_000]
    assert [(r.mode, r.status) for r in server.log] == [(mode, 206), ("", 206)]


@pytest.mark.parametrize("mode", ["short_framed", "short_chunked"])
def test_a_tail_answered_by_a_short_but_well_framed_body_is_retried(folder, server, mode):
    source = HTTPSource(server.url, retry=FAST)
    server.script(mode)
    assert source.read_tail("data/blob.bin", 4096) == (blob(folder)[-4096:], FILE_BYTES)
    assert [(r.mode, r.range) for r in server.log] == [(mode, "bytes=-4096"), ("", "bytes=-4096")]


# --- statuses -----------------------------------------------------------------------------------

# SPEC §8.2 rule 3: 408, 425, 429 and 500-599 are retried.
RETRIED = [408, 425, 429, 500, 501, 502, 503, 504, 599]
# Rule 4: not retried, each with its error.
NOT_RETRIED = {400: HTTPStatusError, 401: HTTPStatusError, 403: HTTPStatusError,
               404: MalformedDataset, 410: MalformedDataset, 412: PayloadChanged}


@pytest.mark.parametrize("status", RETRIED)
def test_a_retried_status_is_retried_to_success(folder, server, status):
    source = HTTPSource(server.url, retry=FAST)
    server.script(str(status))
    assert source.read_range("data/blob.bin", 10, 20) == blob(folder)[10:30]
    assert [r.status for r in server.log] == [status, 206]


@pytest.mark.parametrize("status", NOT_RETRIED)
def test_any_other_status_ends_the_request_at_once(server, status):
    source = HTTPSource(server.url, retry=FAST)
    server.script(str(status))
    with pytest.raises(NOT_RETRIED[status], match=rf"blob.bin bytes 10-29: .*{status}"):
        source.read_range("data/blob.bin", 10, 20)
    assert [r.status for r in server.log] == [status]


# --- the retry log ------------------------------------------------------------------------------


def test_each_retry_is_logged_with_url_range_and_attempt_but_no_token(folder, server, caplog):
    caplog.set_level(logging.DEBUG)
    source = HTTPSource(server.url, token=TOKEN, retry=FAST)
    server.script("503", "short_framed")
    assert source.read_range("data/blob.bin", 1000, 5000) == blob(folder)[1000:6000]
    assert all(r.authorization for r in server.log)  # the token was sent with every attempt
    retries = [r for r in caplog.records
               if r.name == "refstream.http" and r.levelno == logging.WARNING]
    for attempt, (record, reason) in enumerate(zip(retries, ["HTTP 503", "body has 2500 of 5000"],
                                                   strict=True), start=1):
        message = record.getMessage()
        assert f"{server.url}/data/blob.bin bytes 1000-5999: {reason}" in message
        assert f"attempt {attempt} of {FAST.max_attempts} failed, retrying in" in message
    for text in [caplog.text, *(str(r.args) for r in caplog.records)]:
        assert TOKEN not in text and "Authorization" not in text and "Bearer" not in text


def test_netrc_credentials_are_never_sent(folder, server, tmp_path, monkeypatch):
    netrc = tmp_path / "netrc"
    netrc.write_text("machine 127.0.0.1 login someone password secret\n")
    netrc.chmod(0o600)
    monkeypatch.setenv("NETRC", str(netrc))
    source = HTTPSource(server.url, retry=FAST)
    assert source.read_range("data/blob.bin", 0, 10) == blob(folder)[:10]
    assert [r.authorization for r in server.log] == [False]


# --- connections ---------------------------------------------------------------------------------


def test_answers_without_a_wanted_body_keep_their_connection(folder):
    """A HEAD's answer, a redirect, a 404 and a 503 leave their connection open for the next
    request: over TLS each new one would cost a handshake."""
    with RangeServer(folder) as target, RangeServer(folder, redirect_to=target) as server:
        source = HTTPSource(server.url, retry=FAST)
        server.script("503")
        assert source.identity("data/blob.bin").startswith("etag:")
        assert source.size_if_present("data/missing.bin") is None
        assert source.read_range("data/blob.bin", 10, 20) == blob(folder)[10:30]
        assert source.read_range("data/blob.bin", 500, 20) == blob(folder)[500:520]
        assert [(r.method, r.status) for r in server.log] == [
            ("HEAD", 503), ("HEAD", 302), ("HEAD", 404), ("GET", 302), ("GET", 302)]
        assert [(r.method, r.status) for r in target.log] == [
            ("HEAD", 200), ("GET", 206), ("GET", 206)]
        assert (server.connections_accepted, target.connections_accepted) == (1, 1)


# --- the environment's proxies -------------------------------------------------------------------


class Forwarder(ThreadingHTTPServer):
    """An HTTP proxy on loopback: records each absolute URL asked and relays the origin's answer
    unchanged (redirects included)."""

    def __init__(self) -> None:
        self.seen: list[str] = []
        forwarder = self

        class Relay(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def relay(self) -> None:
                forwarder.seen.append(self.path)
                parts = urlsplit(self.path)
                connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
                headers = {k: v for k, v in self.headers.items()
                           if k.lower() in ("range", "accept-encoding", "if-match")}
                connection.request(self.command, parts.path, headers=headers)
                answer = connection.getresponse()
                body = answer.read()
                self.send_response(answer.status)
                for key, value in answer.getheaders():
                    if key.lower() not in ("connection", "transfer-encoding", "keep-alive"):
                        self.send_header(key, value)
                self.end_headers()
                self.wfile.write(body)
                connection.close()

            do_GET = do_HEAD = relay

            def log_message(self, *args) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Relay)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


def test_requests_follow_the_environments_proxy_and_no_proxy_per_origin(folder, monkeypatch):
    """HTTP_PROXY carries requests to every origin NO_PROXY does not name: here the base URL's
    (``localhost``), which redirects, and not the origin it redirects to (``127.0.0.1``). A
    source reads the environment once per origin, so a source made after NO_PROXY changed
    follows the new value."""
    for name in ("http_proxy", "https_proxy", "all_proxy", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.upper(), raising=False)
    with RangeServer(folder) as target, RangeServer(folder, redirect_to=target) as server, \
            Forwarder() as proxy:
        base = server.url.replace("127.0.0.1", "localhost")
        monkeypatch.setenv("HTTP_PROXY", proxy.url)
        monkeypatch.setenv("NO_PROXY", "127.0.0.1")
        source = HTTPSource(base, retry=FAST)
        for at in (10, 500):
            assert source.read_range("data/blob.bin", at, 20) == blob(folder)[at:at + 20]
        assert proxy.seen == [f"{base}/data/blob.bin"] * 2  # the target answered directly
        assert [(r.method, r.status) for r in target.log] == [("GET", 206)] * 2
        monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
        direct = HTTPSource(base, retry=FAST)
        assert direct.read_range("data/blob.bin", 0, 20) == blob(folder)[:20]
        assert len(proxy.seen) == 2 and len(server.log) == 3
        proxy.shutdown()


# --- roots that are not folders -----------------------------------------------------------------


def test_a_bare_hub_id_is_refused_with_the_hf_form(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UsageError, match=r"'lerobot/pusht'.*hf://datasets/lerobot/pusht"):
        open_source("lerobot/pusht")
    from refstream.stream import StreamingDataset

    with pytest.raises(UsageError, match=r"hf://datasets/lerobot/pusht"):
        StreamingDataset("lerobot/pusht")
    (tmp_path / "lerobot" / "pusht").mkdir(parents=True)  # a folder of that name is a folder
    assert isinstance(open_source("lerobot/pusht"), LocalSource)


# --- one session for every thread ---------------------------------------------------------------


def test_no_cookie_is_kept_between_requests():
    """Threads share one session, so it keeps no state a response could change: no cookie."""
    seen = []

    class SetsCookies(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            seen.append(self.headers.get("Cookie"))
            self.send_response(200)
            self.send_header("Set-Cookie", "visit=1; Path=/")
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, *args) -> None:
            pass

    with ThreadingHTTPServer(("127.0.0.1", 0), SetsCookies) as httpd:
        serving = threading.Thread(target=httpd.serve_forever, daemon=True)
        serving.start()
        source = HTTPSource(f"http://127.0.0.1:{httpd.server_address[1]}", retry=FAST)
        assert [source.read_bytes("a.json") for _ in range(3)] == [b"ok"] * 3
        source.close()
        httpd.shutdown()
        serving.join()
    assert seen == [None, None, None]
