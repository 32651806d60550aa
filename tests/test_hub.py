"""The Hugging Face Hub at training scale, against the fake Hub of tests/rangeserver.py (which
answers as the real one does: X-Error-Code, a resolver quota, signed targets on another host).

Redirect targets: one resolve per file per target lifetime for every thread of a source, shared
through the cache folder with every other source (process) of the machine, expiry read from the
signature; the Hub's refusals as errors that say what to change; the token never leaves the
Hub's origin, not even for another port or scheme of the same host.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import requests
from rangeserver import HubConfig, RangeServer, second_loopback_host

from refstream import hub as hub_module
from refstream.errors import (
    FetchError,
    HubAuthError,
    HubRepoNotFound,
    HubRevisionNotFound,
    MalformedDataset,
)
from refstream.http import HTTPSource, RetryPolicy
from refstream.hub import TARGET_MARGIN_S, HubSource, open_hf_source, parse_hf_root, target_expiry
from refstream.stream import StreamingDataset

COMMIT = "0123456789abcdef0123456789abcdef01234567"
TOKEN = "hf_secretTOKENvalue123"
FAST = RetryPolicy(max_attempts=4, backoff_base_s=0.01, backoff_cap_s=0.05, rate_limit_wait_s=5)
SIGNED_S = 600  # not the hour a target without expiry is kept: the signature decides
THREADS = 8


@pytest.fixture
def folder(tmp_path) -> Path:
    root = tmp_path / "root"
    (root / "data").mkdir(parents=True)
    for n in range(3):
        (root / "data" / f"blob{n}.bin").write_bytes(os.urandom(50_000))
    return root


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("REFSTREAM_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def hub(folder):
    """A fake Hub with a private dataset owner/name, signing its targets on a second host."""
    with RangeServer(folder, host=second_loopback_host()) as cdn:
        config = HubConfig(revisions={"main": COMMIT}, token=TOKEN, repo="owner/name",
                           signed_s=SIGNED_S)
        with RangeServer(folder, hub=config, redirect_to=cdn) as hub_server:
            yield hub_server, cdn


def source_on(hub_server, **options):
    return open_hf_source(f"hf://datasets/owner/name@{COMMIT}", endpoint=hub_server.url,
                          token=TOKEN, retry=FAST, **options)


def resolves(hub_server) -> Counter:
    return Counter(r.path.rpartition("/")[2] for r in hub_server.log if r.status == 302)


# --- one resolve per file per target lifetime ---------------------------------------------------


def test_threads_asking_for_one_file_at_once_make_one_resolve(folder, hub, cache):
    hub_server, cdn = hub
    source = source_on(hub_server)
    data = (folder / "data" / "blob0.bin").read_bytes()
    start, answers = threading.Barrier(THREADS), [None] * THREADS

    def read(n: int) -> None:
        start.wait()
        answers[n] = source.read_range("data/blob0.bin", 100 * n, 100)

    threads = [threading.Thread(target=read, args=(n,)) for n in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert answers == [data[100 * n : 100 * n + 100] for n in range(THREADS)]
    assert resolves(hub_server) == {"blob0.bin": 1}
    assert len(cdn.log) == THREADS and not any(r.authorization for r in cdn.log)


def test_another_process_reads_the_live_targets_from_the_cache_folder(folder, hub, cache):
    hub_server, _ = hub
    first = source_on(hub_server)
    for n in range(3):
        first.read_range(f"data/blob{n}.bin", 0, 10)
    second = source_on(hub_server)  # a new source knows nothing in memory, like a new process
    for n in range(3):
        assert second.read_range(f"data/blob{n}.bin", 5, 10) == \
            (folder / "data" / f"blob{n}.bin").read_bytes()[5:15]
    assert resolves(hub_server) == {f"blob{n}.bin": 1 for n in range(3)}
    shared = sorted(p for p in (cache / "hub-targets").iterdir() if p.suffix != ".lock")
    assert len(shared) == 3
    assert (cache / "hub-targets").stat().st_mode & 0o077 == 0  # its owner's only
    for path in shared:  # the expiry and the signed target: never the token
        expiry, target = path.read_text().split("\n")
        assert "X-Amz-Signature=" in target and TOKEN not in path.read_text()
        assert float(expiry) == target_expiry(target, 0.0)


READER = """import sys
from refstream.hub import open_hf_source
source = open_hf_source(sys.argv[1], endpoint=sys.argv[2], token=sys.argv[3])
sys.stdout.buffer.write(source.read_range("data/blob0.bin", 0, 100))
"""


def waits_for_a_flock(pid: int) -> bool:
    """Whether process ``pid`` waits for a flock now (``/proc/locks`` marks such lines ``->``)."""
    return any("->" in line and line.split()[5] == str(pid)
               for line in Path("/proc/locks").read_text().splitlines())


def test_two_processes_asking_for_one_file_at_once_make_one_resolve(folder, hub, cache):
    hub_server, _ = hub
    hub_server.gate = threading.Event()  # the first resolve waits until the second process does
    args = [sys.executable, "-c", READER, f"hf://datasets/owner/name@{COMMIT}", hub_server.url,
            TOKEN]
    first = subprocess.Popen(args, stdout=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while not any("/resolve/" in r.path for r in hub_server.log):  # its resolve is held
        assert time.monotonic() < deadline and first.poll() is None
        time.sleep(0.01)
    second = subprocess.Popen(args, stdout=subprocess.PIPE)
    while not waits_for_a_flock(second.pid):  # the second process waits for the first's resolve
        assert time.monotonic() < deadline and second.poll() is None
        time.sleep(0.01)
    hub_server.gate.set()
    expected = (folder / "data" / "blob0.bin").read_bytes()[:100]
    assert [p.communicate(timeout=60)[0] for p in (first, second)] == [expected, expected]
    assert resolves(hub_server) == {"blob0.bin": 1}


def test_a_target_is_resolved_again_once_its_signature_expires(folder, hub, cache, monkeypatch):
    hub_server, cdn = hub
    source = source_on(hub_server)
    for offset in (0, 10, 20):
        source.read_range("data/blob1.bin", offset, 10)
    assert resolves(hub_server) == {"blob1.bin": 1}
    later = time.time() + SIGNED_S - TARGET_MARGIN_S + 5  # within the margin of its expiry
    clock = SimpleNamespace(time=lambda: later, strptime=time.strptime)
    monkeypatch.setattr(hub_module, "time", clock)
    hub_server.hub.signed_s = 2 * SIGNED_S  # the next signature lives long past `later`
    source.read_range("data/blob1.bin", 30, 10)
    source.read_range("data/blob1.bin", 40, 10)
    assert resolves(hub_server) == {"blob1.bin": 2}
    assert [r.status for r in cdn.log] == [206] * 5


def test_the_cdn_refuses_an_expired_signature_and_the_source_resolves_again(folder, hub, cache):
    hub_server, cdn = hub
    source = source_on(hub_server)
    source.read_range("data/blob2.bin", 0, 10)
    expired = "?X-Amz-Date=20200101T000000Z&X-Amz-Expires=3600&X-Amz-Signature=0"
    answer = requests.get(f"{cdn.url}/data/blob2.bin{expired}", timeout=10)
    assert answer.status_code == 403 and b"Request has expired" in answer.content
    path = next(p for p in (cache / "hub-targets").iterdir() if p.suffix != ".lock")
    # another process stored an expired target
    path.write_text(f"{time.time() + 600}\n{cdn.url}/data/blob2.bin{expired}")
    fresh = source_on(hub_server)
    assert fresh.read_range("data/blob2.bin", 0, 10) == \
        (folder / "data" / "blob2.bin").read_bytes()[:10]
    assert resolves(hub_server) == {"blob2.bin": 2}
    assert [r.status for r in cdn.log[-2:]] == [403, 206]


# --- what a person can act on -------------------------------------------------------------------

ERRORS = {  # root, token -> the error, and what its message must say
    "no token": ("hf://datasets/owner/name", None, HubAuthError,
                 "dataset owner/name is private, gated or absent, and no token was given: set "
                 "HF_TOKEN to a token that can read it"),
    "refused token": ("hf://datasets/owner/name", "hf_wrong", HubAuthError,
                      "the Hub refused the token (HTTP 401: Invalid credentials in Authorization "
                      "header); set HF_TOKEN to a valid token"),
    "no such revision": ("hf://datasets/owner/name@nope", TOKEN, HubRevisionNotFound,
                         "dataset owner/name has no revision 'nope'"),
    "no such repo": ("hf://datasets/owner/other", TOKEN, HubRepoNotFound,
                     "dataset owner/other does not exist, or the token cannot read it"),
    "no such file": (f"hf://datasets/owner/name@{COMMIT}", TOKEN, MalformedDataset,
                     f"meta/info.json: dataset owner/name has no such file at revision {COMMIT}"),
}


@pytest.mark.parametrize("case", ERRORS)
def test_hub_refusals_say_what_to_change_before_any_worker_starts(case, hub, monkeypatch, cache):
    hub_server, _ = hub
    root, token, error, says = ERRORS[case]
    monkeypatch.setenv("HF_ENDPOINT", hub_server.url)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    if token is not None:
        monkeypatch.setenv("HF_TOKEN", token)
    with pytest.raises(error) as info:
        StreamingDataset(root)  # the main process, before any DataLoader worker
    message = str(info.value)
    print(f"{case}: {type(info.value).__name__}: {message}")
    assert says in message and "\n" not in message
    assert TOKEN not in message and "hf_wrong" not in message
    assert len([r for r in hub_server.log if r.status in (401, 404)]) == 1  # none retried


# --- the token stays on the Hub's origin --------------------------------------------------------


class Recording(requests.Session):
    """Stands for the network: the first answer redirects to ``target``, later ones are 200."""

    def __init__(self, target: str) -> None:
        super().__init__()
        self.target, self.sent = target, []

    def send(self, request, **options) -> requests.Response:
        self.sent.append((request.url, "Authorization" in request.headers))
        response = requests.Response()
        response.status_code, response.url = (302, request.url) if len(self.sent) == 1 else \
            (200, request.url)
        response.headers["Location" if len(self.sent) == 1 else "Content-Length"] = \
            self.target if len(self.sent) == 1 else "2"
        response.raw = io.BytesIO(b"" if len(self.sent) == 1 else b"ok")
        return response


@pytest.mark.parametrize("target", ["http://127.0.0.1:8001/file", "https://127.0.0.1:8000/file",
                                    "http://localhost:8000/file"])
def test_the_token_never_follows_a_redirect_to_another_port_scheme_or_host(target):
    source = HTTPSource("http://127.0.0.1:8000/root", token=TOKEN, retry=FAST)
    source._session = network = Recording(target)
    assert source.read_bytes("file") == b"ok"
    assert network.sent == [("http://127.0.0.1:8000/root/file", True), (target, False)]


def test_the_token_follows_a_redirect_on_its_own_origin():
    source = HTTPSource("http://127.0.0.1:8000/root", token=TOKEN, retry=FAST)
    source._session = network = Recording("/other/file")
    assert source.read_bytes("file") == b"ok"
    assert network.sent == [("http://127.0.0.1:8000/root/file", True),
                            ("http://127.0.0.1:8000/other/file", True)]


def test_an_absent_file_is_none_but_an_absent_repository_is_its_error(hub, cache):
    hub_server, _ = hub
    source = source_on(hub_server)
    assert source.size_if_present("data/blob0.bin") == 50_000
    assert source.read_if_present("meta/stats.json") is None  # EntryNotFound: no such file
    other = HubSource(parse_hf_root("hf://datasets/owner/other"), hub_server.url, COMMIT,
                      token=TOKEN, retry=FAST)
    with pytest.raises(HubRepoNotFound, match="owner/other does not exist"):
        other.read_if_present("meta/stats.json")  # RepoNotFound is not an absent file


@pytest.mark.parametrize("body", [b"not json", b"[1]", b'{"path": "a"}',
                                  b'[{"type": "file", "path": "a", "size": "3", "oid": "x"}]',
                                  b'[{"type": "file", "path": "a", "size": 3, "lfs": [1]}]',
                                  b'[{"type": "file", "path": "a", "size": 3}]'])
def test_a_listing_that_is_not_one_is_a_fetch_error_naming_the_url(body):
    source = HubSource(parse_hf_root("hf://datasets/o/n"), "http://127.0.0.1:9", COMMIT)
    with pytest.raises(FetchError, match="http://x/tree: not"):
        source._listed("http://x/tree", body)
    directory = b'[{"type": "directory", "path": "d", "oid": "1"}, '
    listing = directory + b'{"type": "file", "path": "d/a", "size": 3, "lfs": {"oid": "f"}}]'
    assert source._listed("http://x/tree", listing) == {"d/a": (3, "sha256:f")}
