"""Byte sources against independent oracles: the file's own bytes, a fault-injecting loopback
server (tests/rangeserver.py), a real nginx (tests/nginx.py) and a fake Hugging Face Hub."""

from __future__ import annotations

import os
import threading
import time
from datetime import datetime, timedelta, timezone
from email.utils import format_datetime
from pathlib import Path

import nginx as nginx_helper
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import requests
from leaks import Baseline, open_fds
from nginx import nginx_server  # noqa: F401 - pytest fixture
from rangeserver import Faults, HubConfig, RangeServer, etag_of, second_loopback_host

from refstream.errors import (
    BadRangeResponse,
    HTTPStatusError,
    HubAuthError,
    HubRevisionNotFound,
    MalformedDataset,
    PayloadChanged,
    RateLimited,
    RetriesExhausted,
    ShortRead,
    UnsafePath,
    UsageError,
)
from refstream.http import (
    WHOLE_BODY_CAP_BYTES,
    HTTPSource,
    RetryPolicy,
    judge_response,
    parse_retry_after,
)
from refstream.hub import open_hf_source
from refstream.roots import open_source
from refstream.source import LocalSource, RangeFile
from refstream.tools.conformance import first_difference, in_process, load_cases

FILE_BYTES = 300_000
COMMIT = "0123456789abcdef0123456789abcdef01234567"
TOKEN = "hf_secretTOKENvalue123"
FAST = RetryPolicy(max_attempts=4, backoff_base_s=0.01, backoff_cap_s=0.05,
                   rate_limit_wait_s=5.0)
# Read timeouts. A loopback answer takes milliseconds, but a loaded machine can stall a thread for
# a while: a normal request must never time out (that would be an unplanned retry), so tests read
# with NORMAL; a "slow" fault never answers in time (Faults.slow_s), so SLOW_FAULT only decides
# how long a test waits for it.
NORMAL_READ_TIMEOUT_S = 10.0
SLOW_FAULT_READ_TIMEOUT_S = 1.0
HANG_GUARD_S = 30.0  # an upper bound on a wall time that only catches a hang


@pytest.fixture
def folder(tmp_path) -> Path:
    root = tmp_path / "root"
    (root / "data").mkdir(parents=True)
    (root / "data" / "blob.bin").write_bytes(os.urandom(FILE_BYTES))
    (root / "small.bin").write_bytes(os.urandom(5000))
    return root


@pytest.fixture
def server(folder):
    with RangeServer(folder) as srv:
        yield srv


def http(url: str, **options) -> HTTPSource:
    options.setdefault("retry", FAST)
    options.setdefault("read_timeout_s", NORMAL_READ_TIMEOUT_S)
    return HTTPSource(url, **options)


def blob(folder: Path) -> bytes:
    return (folder / "data" / "blob.bin").read_bytes()


def big_file(folder: Path) -> bytes:
    """A file one byte over the whole-body cap: a server that ignores Range sends it whole."""
    data = os.urandom(WHOLE_BODY_CAP_BYTES + 1)
    (folder / "big.bin").write_bytes(data)
    return data


def counted_reads(source) -> list[tuple[str, int, int]]:
    """The ``(relpath, offset, length)`` of every ``read_range`` call on ``source`` from now on."""
    reads = []
    read_range = source.read_range

    def counted(relpath: str, offset: int, length: int) -> bytes:
        reads.append((relpath, offset, length))
        return read_range(relpath, offset, length)

    source.read_range = counted
    return reads


@pytest.fixture
def received(monkeypatch) -> list[int]:
    """The size of every body chunk an HTTP source reads from now on."""
    sizes = []
    iter_content = requests.Response.iter_content

    def counted(response, *args, **kwargs):
        for chunk in iter_content(response, *args, **kwargs):
            sizes.append(len(chunk))
            yield chunk

    monkeypatch.setattr(requests.Response, "iter_content", counted)
    return sizes



# --- local ------------------------------------------------------------------------------------


def test_local_ranges_equal_the_file_bytes(folder):
    source, data = LocalSource(folder), blob(folder)
    for offset, length in [(0, 1), (0, FILE_BYTES), (12345, 6789), (FILE_BYTES - 1, 1), (7, 0)]:
        assert source.read_range("data/blob.bin", offset, length) == data[offset:offset + length]
    assert source.read_bytes("small.bin") == (folder / "small.bin").read_bytes()
    assert source.size("data/blob.bin") == FILE_BYTES


def test_local_tail_is_the_last_bytes_and_the_size_in_one_read(folder):
    source, data = LocalSource(folder), blob(folder)
    reads = counted_reads(source)
    assert source.read_tail("data/blob.bin", 1000) == (data[-1000:], FILE_BYTES)
    small = (folder / "small.bin").read_bytes()
    assert source.read_tail("small.bin", 65536) == (small, 5000)  # shorter than asked: all
    assert reads == [("data/blob.bin", FILE_BYTES - 1000, 1000), ("small.bin", 0, 5000)]
    with pytest.raises(UsageError):
        source.read_tail("small.bin", 0)


def test_local_errors_name_the_path_and_range(folder):
    source = LocalSource(folder)
    with pytest.raises(ShortRead, match=r"blob.bin bytes 299990-300009: got 10 of 20"):
        source.read_range("data/blob.bin", FILE_BYTES - 10, 20)
    with pytest.raises(MalformedDataset, match="data/none.bin"):
        source.read_range("data/none.bin", 0, 1)
    for bad in ("../secret", "/etc/passwd", "data/../../x", "", "a\\b", "c:/x"):
        with pytest.raises(UnsafePath):
            source.read_bytes(bad)


def test_local_identity_detects_a_replaced_file(folder):
    source = LocalSource(folder)
    source.expect_identity("small.bin", source.identity("small.bin"))
    source.read_range("small.bin", 0, 10)
    replacement = folder / "small.new"
    replacement.write_bytes(os.urandom(5000))
    os.utime(replacement, ns=(1, 1))  # a different mtime even on coarse clocks
    os.replace(replacement, folder / "small.bin")
    with pytest.raises(PayloadChanged, match="small.bin bytes 0-9"):
        source.read_range("small.bin", 0, 10)


def test_open_source_chooses_by_root_kind(folder, server):
    assert isinstance(open_source(str(folder)), LocalSource)
    assert isinstance(open_source(f"file://{folder}"), LocalSource)
    assert isinstance(open_source(server.url), HTTPSource)
    with pytest.raises(UsageError):
        open_source("s3://bucket/x")
    with pytest.raises(UsageError, match="credentials"):
        HTTPSource("http://user:pw@127.0.0.1:1/")


# --- RangeFile + pyarrow -----------------------------------------------------------------------


def test_pyarrow_reads_parquet_through_range_file(folder, server):
    table = pa.table({"episode_index": pa.array([0] * 50 + [1] * 50, pa.int64()),
                      "x": pa.array(range(100), pa.float32())})
    pq.write_table(table, folder / "t.parquet", row_group_size=50)
    for source in (LocalSource(folder), http(server.url)):
        reads = counted_reads(source)
        view = RangeFile(source, "t.parquet")
        read = pq.ParquetFile(view).read_row_group(1)
        assert read.equals(table.slice(50, 50))
        read_bytes = sum(length for _, _, length in reads)
        assert 0 < read_bytes < (folder / "t.parquet").stat().st_size * 2
        view.seek(-4, os.SEEK_END)
        assert view.read() == b"PAR1"


# --- HTTP: the normal path ---------------------------------------------------------------------


def test_http_range_is_one_request_with_the_exact_range_header(folder, server):
    source, data = http(server.url), blob(folder)
    assert source.read_range("data/blob.bin", 1000, 2000) == data[1000:3000]
    assert source.read_range("data/blob.bin", 0, 0) == b""  # no request for nothing
    assert [(r.method, r.range) for r in server.log] == [("GET", "bytes=1000-2999")]
    assert server.log[0].headers["Accept-Encoding"] == "identity"
    assert source.size("data/blob.bin") == FILE_BYTES
    assert source.identity("data/blob.bin") == f"etag:{etag_of(data)}"


def test_concurrent_threads_share_one_source(folder, server):
    source, data = http(server.url), blob(folder)
    errors = []

    def work(k):
        try:
            for i in range(10):
                offset = (k * 10 + i) * 1000
                assert source.read_range("data/blob.bin", offset, 777) == data[offset:offset + 777]
        except Exception as exc:  # collected for the main thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert not errors and not any(t.is_alive() for t in threads)
    assert len(server.log) == 40  # one request a read: none retried
    source.close()


def test_close_releases_every_connection(folder, server):
    # the server runs in this process too: its side of a connection closes when ours does, and
    # the thread that served the connection ends then
    baseline = Baseline()
    source = http(server.url)
    threads = [threading.Thread(target=source.read_range, args=("data/blob.bin", k, 10))
               for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    server.script("reset", "short")
    source.read_range("data/blob.bin", 0, 10)
    assert open_fds() > baseline.fds
    source.close()
    baseline.assert_back()
    assert open_fds() == baseline.fds


# --- HTTP: faults that must be survived -------------------------------------------------------


@pytest.mark.parametrize("modes", [["reset"], ["500"], ["502", "503", "503"], ["429"],
                                   ["short"], ["short", "reset", "503"], ["slow"]])
def test_transient_faults_are_retried_to_success(folder, server, modes):
    timeout_s = SLOW_FAULT_READ_TIMEOUT_S if "slow" in modes else NORMAL_READ_TIMEOUT_S
    source, data = http(server.url, read_timeout_s=timeout_s), blob(folder)
    server.script(*modes)
    started = time.monotonic()
    assert source.read_range("data/blob.bin", 5000, 100_000) == data[5000:105_000]
    assert time.monotonic() - started < HANG_GUARD_S
    assert [r.mode for r in server.log] == [*modes, ""]


def test_retry_after_is_waited_without_using_an_attempt(folder, caplog):
    with RangeServer(folder, faults=Faults(retry_after="1")) as srv:
        source = http(srv.url)
        srv.script(*["429"] * FAST.max_attempts)  # as many as the attempts: none is used
        started = time.monotonic()
        assert source.read_range("small.bin", 0, 10) == (folder / "small.bin").read_bytes()[:10]
        elapsed = time.monotonic() - started
    assert elapsed >= FAST.max_attempts * 1.0  # each Retry-After: 1 waited in full
    waits = [r.getMessage() for r in caplog.records if r.name == "refstream.http"]
    assert len(waits) == FAST.max_attempts
    assert all("HTTP 429: rate limited (Retry-After, resets in 1 s); waiting" in w for w in waits)


def test_a_rate_limit_past_the_bound_fails_at_once_naming_quota_reset_and_setting(folder):
    with RangeServer(folder, faults=Faults(retry_after="30")) as srv:
        source = http(srv.url)
        srv.script("429")
        started = time.monotonic()
        with pytest.raises(RateLimited) as info:
            source.read_range("small.bin", 0, 10)
        assert time.monotonic() - started < 10  # no wait: 30 s is past the 5 s bound
    message = str(info.value)
    assert "bytes 0-9: HTTP 429: rate limited (Retry-After, resets in 30 s)" in message
    assert "past the 5 s a request may wait; raise REFSTREAM_RATE_LIMIT_WAIT_S" in message
    assert len(srv.log) == 1


def test_the_rate_limit_bound_is_read_from_the_environment(monkeypatch):
    monkeypatch.setenv("REFSTREAM_RATE_LIMIT_WAIT_S", "12.5")
    assert RetryPolicy().rate_limit_wait_s == 12.5
    monkeypatch.delenv("REFSTREAM_RATE_LIMIT_WAIT_S")
    assert RetryPolicy().rate_limit_wait_s == 360.0  # a 5-minute quota window and more


def test_parse_retry_after_seconds_and_http_date():
    now = datetime(2026, 1, 1, tzinfo=timezone.utc)
    assert parse_retry_after("7") == 7.0
    assert parse_retry_after(format_datetime(now + timedelta(seconds=90), usegmt=True),
                             now) == 90.0
    assert parse_retry_after(format_datetime(now - timedelta(seconds=5), usegmt=True), now) == 0.0
    assert parse_retry_after("soon") is None and parse_retry_after(None) is None


def test_decimals_are_ascii_digits_only():
    assert parse_retry_after("\u0663") is None  # ARABIC-INDIC DIGIT THREE: not a decimal
    with pytest.raises(BadRangeResponse, match="no Content-Length"):
        judge_response(200, {"Content-Length": "\u0661\u0660"}, first_last=(0, 9))
    with pytest.raises(BadRangeResponse, match="206"):
        judge_response(206, {"Content-Range": "bytes 0-\u0669/10"}, first_last=(0, 9))


def test_backoff_is_full_jitter_under_the_cap():
    policy = RetryPolicy(backoff_base_s=1.0, backoff_cap_s=3.0)
    delays = [policy.delay_s(retry) for retry in (1, 2, 3, 4) for _ in range(200)]
    assert all(0 <= d <= 3.0 for d in delays)
    assert max(policy.delay_s(1) for _ in range(200)) <= 1.0
    assert max(delays) > 2.5  # the cap is reached by later retries


@pytest.mark.parametrize("length", [1, 4096, FILE_BYTES, FILE_BYTES + 1])
def test_http_tail_is_one_suffix_request_with_the_size(folder, server, length):
    source, data = http(server.url), blob(folder)
    assert source.read_tail("data/blob.bin", length) == (data[-length:], FILE_BYTES)
    assert [(r.method, r.range) for r in server.log] == [("GET", f"bytes=-{length}")]
    assert source.size("data/blob.bin") == FILE_BYTES  # remembered: no HEAD
    assert len(server.log) == 1


@pytest.mark.parametrize("mode", ["ignore_range", "reset", "short", "503"])
def test_http_tail_survives_ignored_range_and_transient_faults(folder, server, mode):
    source = http(server.url)
    server.script(mode)
    small = (folder / "small.bin").read_bytes()
    assert source.read_tail("small.bin", 100) == (small[-100:], 5000)


@pytest.mark.parametrize("mode", ["wrong_range", "200_content_range"])
def test_http_tail_refuses_inconsistent_answers(folder, server, mode):
    server.script(mode)
    with pytest.raises(BadRangeResponse, match=r"small.bin bytes -100"):
        http(server.url).read_tail("small.bin", 100)


@pytest.mark.parametrize("mode", ["416", "ignore_range"])
def test_http_tail_without_suffix_support_falls_back_to_head_and_a_range(folder, server, mode,
                                                                         received):
    # 416, or the whole file over the whole-body cap (its body is never read).
    source, data = http(server.url), big_file(folder)
    server.script(mode)
    assert source.read_tail("big.bin", 1000) == (data[-1000:], len(data))
    assert [(r.method, r.range) for r in server.log] == [
        ("GET", "bytes=-1000"), ("HEAD", None),
        ("GET", f"bytes={len(data) - 1000}-{len(data) - 1}")]
    assert sum(received) == 1000  # the answer's bytes only


def test_http_tail_of_a_file_that_changed_size_is_payload_changed(folder, server):
    source = http(server.url)
    assert source.size("small.bin") == 5000
    server.replace_file("small.bin", b"x" * 4000)
    with pytest.raises(PayloadChanged, match="from 5000 to 4000"):
        source.read_tail("small.bin", 100)


def test_range_file_serves_reads_inside_the_tail_without_a_request(folder):
    source, data = LocalSource(folder), blob(folder)
    reads = counted_reads(source)
    tail, size = source.read_tail("data/blob.bin", 1000)
    view = RangeFile(source, "data/blob.bin", size, tail)
    view.seek(FILE_BYTES - 600)
    assert view.read(100) == data[-600:-500] and len(reads) == 1  # the tail's
    view.seek(FILE_BYTES - 1100)
    assert view.read(200) == data[-1100:-900] and len(reads) == 2  # fetched
    assert view.read() == data[-900:] and len(reads) == 2  # inside the tail
    with pytest.raises(UsageError):
        RangeFile(source, "small.bin", 10, b"x" * 11)


def test_ignored_range_on_a_small_file_is_sliced(folder, server):
    source = http(server.url)
    server.script("ignore_range")
    data = (folder / "small.bin").read_bytes()
    assert source.read_range("small.bin", 100, 50) == data[100:150]


@pytest.mark.parametrize("past_end", [1, 2])
def test_ignored_range_ending_past_the_end_is_a_short_read(folder, server, past_end):
    """The whole 5,000-byte file for bytes 4990-(4999 + past_end): not one byte fewer, accepted."""
    source = http(server.url)
    server.script("ignore_range")
    with pytest.raises(ShortRead, match=f"bytes 4990-{4999 + past_end}: file has only 5000"):
        source.read_range("small.bin", 4990, 10 + past_end)
    assert [(r.mode, r.status) for r in server.log] == [("ignore_range", 200)]


def test_fault_mix_delivers_every_byte(folder):
    data = blob(folder)
    faults = Faults(reset=0.05, status_5xx=0.05, burst=2, short=0.02, too_many=0.01, seed=7)
    with RangeServer(folder, faults=faults) as srv:
        source = http(srv.url, retry=RetryPolicy(max_attempts=10, backoff_base_s=0.005,
                                                  backoff_cap_s=0.02))
        for i in range(150):
            offset = (i * 1997) % (FILE_BYTES - 1000)
            assert source.read_range("data/blob.bin", offset, 1000) == data[offset:offset + 1000]
        faulty = [r for r in srv.log if r.mode]
    assert len(faulty) >= 5  # the mix really happened
    assert len(faulty) == len(srv.log) - 150  # each fault retried once, no more


# --- HTTP: faults that must stop with a specific error ------------------------------------------


@pytest.mark.parametrize("mode", ["200_content_range", "wrong_range", "416"])
def test_inconsistent_range_answers_fail_at_once(folder, server, mode):
    source = http(server.url)
    server.script(mode)
    with pytest.raises(BadRangeResponse, match=r"/data/blob.bin bytes 10-1009"):
        source.read_range("data/blob.bin", 10, 1000)
    assert len(server.log) == 1


def test_ignored_range_on_a_large_file_is_refused_without_downloading(folder, server, received):
    source, data = http(server.url), big_file(folder)
    server.script("ignore_range")
    with pytest.raises(BadRangeResponse, match=rf"bytes 0-99: server ignored Range.*{len(data)} "):
        source.read_range("big.bin", 0, 100)
    assert received == []


def test_persistent_failure_exhausts_retries_with_the_cause_chained(folder, server):
    source = http(server.url)
    server.script(*["503"] * 10)
    started = time.monotonic()
    with pytest.raises(RetriesExhausted, match=r"blob.bin bytes 0-9: failed 4 times") as info:
        source.read_range("data/blob.bin", 0, 10)
    assert time.monotonic() - started < HANG_GUARD_S
    assert isinstance(info.value.__cause__, HTTPStatusError)
    assert len(server.log) == FAST.max_attempts


def test_slow_first_byte_past_the_timeout_exhausts_quickly(folder):
    faults = Faults(slow=1.0)
    with RangeServer(folder, faults=faults) as srv:
        source = http(srv.url, read_timeout_s=SLOW_FAULT_READ_TIMEOUT_S,
                      retry=RetryPolicy(max_attempts=2, backoff_base_s=0.01))
        started = time.monotonic()
        with pytest.raises(RetriesExhausted, match="bytes 0-9"):
            source.read_range("small.bin", 0, 10)
        # two read timeouts, not the server's delay: a lower bound, and far below that delay
        assert 2 * SLOW_FAULT_READ_TIMEOUT_S <= time.monotonic() - started < faults.slow_s / 2


def test_replaced_file_raises_payload_changed(folder, server):
    source = http(server.url)
    relpath = "data/blob.bin"
    source.expect_identity(relpath, source.identity(relpath))
    assert source.read_range(relpath, 0, 10) == blob(folder)[:10]
    server.replace_file(relpath, os.urandom(FILE_BYTES))  # same size, new ETag
    with pytest.raises(PayloadChanged, match=r"blob.bin bytes 0-9: file changed"):
        source.read_range(relpath, 0, 10)
    server.replace_file(relpath, os.urandom(FILE_BYTES + 1))  # a new size is caught as well
    with pytest.raises(PayloadChanged, match="size changed from 300000 to 300001"):
        source.read_range(relpath, 0, 10)


def test_range_past_the_end_and_missing_files(folder, server):
    source = http(server.url)
    with pytest.raises(ShortRead, match=r"bytes 4990-5009: file has only 5000 bytes"):
        source.read_range("small.bin", 4990, 20)
    with pytest.raises(MalformedDataset, match="nothing.bin"):
        source.read_range("nothing.bin", 0, 1)
    assert len(server.log) == 2  # neither was retried


# --- nginx ------------------------------------------------------------------------------------


def test_nginx_serves_exact_ranges_and_logs_them(folder, nginx_server):  # noqa: F811
    nginx = nginx_server(folder)
    source, data = http(nginx.url), blob(folder)
    spans = [(0, 1), (4096, 65536), (FILE_BYTES - 100, 100)]
    for offset, length in spans:
        assert source.read_range("data/blob.bin", offset, length) == data[offset:offset + length]
    assert source.size("data/blob.bin") == FILE_BYTES
    source.expect_identity("data/blob.bin", source.identity("data/blob.bin"))
    source.read_range("data/blob.bin", 0, 1)
    gets = [r for r in nginx.access_log() if r.method == "GET"]
    assert [(r.range, r.status, r.body_bytes) for r in gets] == [
        (f"bytes={o}-{o + n - 1}", 206, n) for o, n in [*spans, (0, 1)]]
    with pytest.raises(ShortRead):
        source.read_range("data/blob.bin", FILE_BYTES - 5, 10)
    table = pa.table({"x": pa.array(range(1000), pa.int64())})
    pq.write_table(table, folder / "t.parquet", row_group_size=100)
    assert pq.ParquetFile(RangeFile(source, "t.parquet")).read_row_group(7).equals(
        table.slice(700, 100))
    assert all(r.range is not None for r in nginx.access_log() if r.path == "/t.parquet"
               and r.method == "GET")
    # a suffix range: the last bytes and the size, in one request nginx answers with 206
    assert source.read_tail("small.bin", 300) == ((folder / "small.bin").read_bytes()[-300:],
                                                 5000)
    assert source.read_tail("small.bin", 65536)[1] == 5000
    assert [(r.range, r.status, r.body_bytes) for r in nginx.access_log()[-2:]] == [
        ("bytes=-300", 206, 300), ("bytes=-65536", 206, 5000)]


def test_nginx_helper_fails_loudly_when_nginx_is_missing(tmp_path, monkeypatch):
    monkeypatch.setattr(nginx_helper, "find_nginx", lambda: None)
    with pytest.raises(pytest.fail.Exception, match="nginx is not installed"):
        nginx_helper.NginxServer(tmp_path)


def test_the_test_server_is_bounded_in_requests(folder):
    with RangeServer(folder, max_requests=3) as srv:
        source = http(srv.url, retry=RetryPolicy(max_attempts=2, backoff_base_s=0.001))
        for _ in range(3):
            source.read_range("small.bin", 0, 1)
        with pytest.raises(RetriesExhausted, match="HTTP 503"):
            source.read_range("small.bin", 0, 1)
        assert srv.overflowed


# --- hf:// ------------------------------------------------------------------------------------


@pytest.fixture
def hub(folder, tmp_path, monkeypatch):
    """A fake Hub on 127.0.0.1 that redirects file requests to a second loopback host; redirect
    targets are shared through a cache folder of the test's own."""
    monkeypatch.setenv("REFSTREAM_CACHE", str(tmp_path / "cache"))
    with RangeServer(folder, host=second_loopback_host()) as cdn:
        config = HubConfig(revisions={"main": COMMIT, "v1.0": COMMIT}, token=TOKEN)
        with RangeServer(folder, hub=config, redirect_to=cdn) as hub_server:
            yield hub_server, cdn


def test_hf_dataset_pins_the_commit_and_keeps_the_token_on_the_hub(folder, hub, monkeypatch):
    hub_server, cdn = hub
    monkeypatch.setenv("HF_ENDPOINT", hub_server.url)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    source = open_source("hf://datasets/owner/name@v1.0", retry=FAST)
    data = blob(folder)
    assert source.read_range("data/blob.bin", 10, 20) == data[10:30]
    assert source.size("data/blob.bin") == FILE_BYTES
    assert source.identity("data/blob.bin") == f"commit:{COMMIT}"
    api, *files = hub_server.log
    assert api.path == "/api/datasets/owner/name/revision/v1.0" and api.authorization
    assert all(r.authorization and f"/resolve/{COMMIT}/" in r.path for r in files)
    assert cdn.log and not any(r.authorization for r in cdn.log)
    assert not any(TOKEN in str(v) for r in cdn.log for v in r.headers.values())
    assert TOKEN not in repr(source)
    with pytest.raises(MalformedDataset) as info:
        source.read_range("missing.bin", 0, 1)
    assert TOKEN not in str(info.value) and TOKEN not in repr(info.value)


def test_hf_dataset_errors_never_show_the_token(folder, hub):
    hub_server, cdn = hub
    with pytest.raises(HubRevisionNotFound) as info:  # unknown revision: the API answers 404
        open_hf_source("hf://datasets/owner/name@nope", endpoint=hub_server.url, token=TOKEN,
                       retry=FAST)
    assert TOKEN not in str(info.value)
    with pytest.raises(HubAuthError, match="HTTP 401") as info:  # wrong token
        open_hf_source("hf://datasets/owner/name", endpoint=hub_server.url, token="hf_wrong",
                       retry=FAST)
    assert "hf_wrong" not in str(info.value)


def test_hf_redirect_targets_are_remembered_and_refreshed_when_expired(folder, hub):
    hub_server, cdn = hub
    source = open_hf_source(f"hf://datasets/owner/name@{COMMIT}", endpoint=hub_server.url,
                            token=TOKEN, retry=FAST)
    data = blob(folder)
    for offset in (0, 1000, 2000):
        assert source.read_range("data/blob.bin", offset, 10) == data[offset:offset + 10]
    assert len(hub_server.log) == 1 and len(cdn.log) == 3  # resolved once
    cdn.script("403")  # the signed URL expired
    assert source.read_range("data/blob.bin", 5, 10) == data[5:15]
    assert len(hub_server.log) == 2 and [r.status for r in cdn.log[3:]] == [403, 206]
    assert not any(r.authorization for r in cdn.log)


def test_hub_and_cdn_faults_are_retried_like_any_server(folder, hub):
    hub_server, cdn = hub
    hub_server.script("503", "429")
    source = open_hf_source("hf://datasets/owner/name", endpoint=hub_server.url, token=TOKEN,
                            retry=FAST)
    assert [r.status for r in hub_server.log] == [503, 429, 200]
    cdn.script("reset")
    assert source.read_range("data/blob.bin", 100, 50) == blob(folder)[100:150]
    assert [r.mode for r in cdn.log] == ["reset", ""]


def test_hf_commit_revision_needs_no_api_call(folder, hub):
    hub_server, _ = hub
    source = open_hf_source(f"hf://datasets/owner/name@{COMMIT}/data", endpoint=hub_server.url,
                            token=TOKEN, retry=FAST)
    assert source.read_range("blob.bin", 0, 5) == blob(folder)[:5]
    assert [r.path for r in hub_server.log] == [
        f"/datasets/owner/name/resolve/{COMMIT}/data/blob.bin"]


def test_hf_bucket_uses_the_linked_etag_as_identity(folder, hub):
    hub_server, cdn = hub
    source = open_hf_source("hf://buckets/owner/name/data", endpoint=hub_server.url, token=TOKEN,
                            retry=FAST)
    relpath = "blob.bin"
    assert source.identity(relpath) == f"etag:{etag_of(blob(folder))}"
    source.expect_identity(relpath, source.identity(relpath))
    assert source.read_range(relpath, 7, 3) == blob(folder)[7:10]
    assert hub_server.log[-1].path == "/buckets/owner/name/resolve/data/blob.bin"
    assert not any(r.authorization for r in cdn.log)
    hub_server.replace_file("data/blob.bin", os.urandom(FILE_BYTES))
    with pytest.raises(PayloadChanged, match="blob.bin bytes 7-9"):
        source.read_range(relpath, 7, 3)


def test_hf_root_syntax_is_checked():
    for bad in ("hf://models/a/b", "hf://datasets/a", "hf://buckets/a/b@main", "hf://datasets//b"):
        with pytest.raises(UsageError):
            open_hf_source(bad, endpoint="http://127.0.0.1:9")


# --- conformance cases (hand-derived expectations in spec/fixtures/fetch) -----------------------

CASES = [c for kind in ("range_response", "suffix_response", "hf_url", "hub_target")
         for c in load_cases(kind=kind)]


@pytest.mark.parametrize("case", CASES, ids=[c.path.stem for c in CASES])
def test_conformance_cases(case):
    answer = in_process(case)
    assert first_difference(case.expected, answer) is None, (case.expected, answer)


def test_there_are_conformance_cases():
    assert len(CASES) >= 25


@pytest.mark.parametrize("kind", ["local", "http"])
def test_an_optional_file_is_none_when_absent_and_its_bytes_when_present(folder, server, kind):
    source = LocalSource(folder) if kind == "local" else http(server.url)
    assert source.read_if_present("small.bin") == (folder / "small.bin").read_bytes()
    assert source.size_if_present("data/blob.bin") == FILE_BYTES
    assert source.read_if_present("meta/stats.json") is None
    with pytest.raises(MalformedDataset, match="stats.json"):
        source.read_bytes("meta/stats.json")  # a file that must be there
