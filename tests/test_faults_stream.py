"""A real dataset streamed through the fault-injecting server (tests/rangeserver.py).

Every survivable fault mode, alone and mixed, must still deliver every frame of the epoch exactly
once, each sample equal to an independent oracle (pyarrow rows + whole-file PyAV decoding, and the
label drawn in the pixels), with retries within ``RetryPolicy.max_attempts`` per request. The
unsurvivable modes must stop the stream with the specific ``refstream.errors`` class, naming the
URL, the byte range and the episode, within a bounded time, and leave no thread or file
descriptor behind.

What refstream does with each mode (the expectations below):

====================  ========================================================================
mode                  expected outcome
====================  ========================================================================
reset / short         retried (``ShortRead`` is transient), epoch complete
500/502/503 bursts    retried while the burst is shorter than ``max_attempts``, epoch complete
429 + Retry-After     waits ``Retry-After`` seconds, retried, epoch complete
slow first byte       read timeout, retried, epoch complete
ignore_range          a 200 with the whole (< 1 MiB) file is sliced, epoch complete, no retry
redirect              followed to the second host, epoch complete, no retry
403 (persistent)      ``HTTPStatusError`` at once
416 / wrong_range /   ``BadRangeResponse`` at once
200_content_range
5xx (persistent)      ``RetriesExhausted`` after ``max_attempts``, the 5xx chained
slow (persistent)     ``RetriesExhausted`` after ``max_attempts`` timeouts
file replaced         ``PayloadChanged`` (new ETag, same size) on the first read after it
====================  ========================================================================
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import av
import numpy as np
import pyarrow.parquet as pq
import pytest
from leaks import Baseline
from rangeserver import Faults, HubConfig, RangeServer, second_loopback_host
from torch.utils.data import DataLoader

import refstream.stream
import refstream.worker
from refstream import errors
from refstream.http import RetryPolicy
from refstream.roots import open_source
from refstream.stream import StreamingDataset
from refstream.tools.demo import read_frame_label, write_demo_dataset

LENGTHS = (20, 20, 20, 20, 20, 20)
# Different sizes per camera: a camera mix-up changes the shape, not only the pixels.
SIZES = {"observation.images.front": (64, 48), "observation.images.wrist": (80, 48)}
EPISODES_PER_FILE = 3  # two video files and two data files per camera: cross-file spans
TOLERANCE_S = 1e-4
MAX_ATTEMPTS = RetryPolicy().max_attempts  # the default users get; the tests keep it
TRANSIENT_MODES = {"reset", "short", "500", "502", "503", "429", "slow"}
# For the slow modes only: a slow answer never comes in time (Faults.slow_s), so this is how long
# each one costs. Every other test keeps the library's read timeout: a loaded machine may stall a
# normal answer, and an unplanned timeout would be an unplanned retry.
READ_TIMEOUT_S = 1.0
SURVIVE_BOUND_S = 60.0  # hang guard: wall time of one faulty epoch (a clean one takes ~0.3 s)
# Hang guard from the first fetch to the error: 5 attempts, each at most one read timeout, with
# full-jitter backoff ≤ 3.75 s in between: ≤ 8.75 s, far below a retry loop without end.
STOP_BOUND_S = 30.0


@pytest.fixture(scope="module")
def dataset_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("faults_dataset")
    write_demo_dataset(root, episode_lengths=LENGTHS, size=SIZES,
                       episodes_per_video_file=EPISODES_PER_FILE,
                       episodes_per_data_file=EPISODES_PER_FILE)
    return root


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    # a fresh sidecar cache: every test also builds the index through the faulty server
    monkeypatch.setenv("REFSTREAM_CACHE", str(tmp_path / "cache"))


# --- the oracle ----------------------------------------------------------------------------


class Oracle:
    """Expected rows and pictures of every (episode, frame), from pyarrow and whole-file PyAV."""

    def __init__(self, root: Path) -> None:
        episodes = pq.read_table(root / "meta/episodes/chunk-000/file-000.parquet").to_pydict()
        tasks = pq.read_table(root / "meta/tasks.parquet").to_pydict()
        task_of = dict(zip(tasks["task_index"], tasks["task"], strict=True))
        self.rows: dict[tuple[int, int], dict] = {}
        for path in sorted((root / "data").rglob("*.parquet")):
            table = pq.read_table(path).to_pydict()
            for i, (e, f) in enumerate(zip(table["episode_index"], table["frame_index"],
                                           strict=True)):
                row = {k: np.asarray(v[i]) for k, v in table.items()}
                row["task"] = task_of[int(row["task_index"])]
                self.rows[int(e), int(f)] = row
        self.pictures: dict[tuple[int, int, str], np.ndarray] = {}
        for camera in SIZES:
            decoded: dict[int, dict[float, np.ndarray]] = {}
            for path in sorted((root / "videos" / camera).rglob("*.mp4")):
                with av.open(str(path)) as container:
                    decoded[int(path.stem.split("-")[1])] = {
                        float(frame.pts * frame.time_base):
                            frame.to_ndarray(format="rgb24").transpose(2, 0, 1)
                        for frame in container.decode(video=0)}
            for (e, f), row in self.rows.items():
                frames = decoded[episodes[f"videos/{camera}/file_index"][e]]
                query = episodes[f"videos/{camera}/from_timestamp"][e] + float(row["timestamp"])
                nearest = min(frames, key=lambda t: abs(t - query))
                assert abs(nearest - query) <= TOLERANCE_S
                self.pictures[e, f, camera] = frames[nearest]
        self.data_file_episodes = self._episodes_by_file(episodes, "data")
        self.video_file_episodes = {
            c: self._episodes_by_file(episodes, f"videos/{c}") for c in SIZES}

    @staticmethod
    def _episodes_by_file(episodes: dict, prefix: str) -> dict[int, set[int]]:
        by_file: dict[int, set[int]] = {}
        for e, file_index in zip(episodes["episode_index"], episodes[f"{prefix}/file_index"],
                                 strict=True):
            by_file.setdefault(file_index, set()).add(e)
        return by_file

    def episodes_of(self, url_path: str) -> set[int]:
        """The episodes stored in the dataset file at ``url_path`` (``/data/...`` or
        ``/videos/<camera>/...``)."""
        file_index = int(re.search(r"file-(\d+)\.", url_path)[1])
        if url_path.startswith("/data/"):
            return self.data_file_episodes[file_index]
        camera = url_path.split("/")[2]
        return self.video_file_episodes[camera][file_index]

    def check(self, item: dict) -> tuple[int, int]:
        """Assert one uint8 sample equals the oracle; returns its (episode, frame)."""
        key = int(item["episode_index"]), int(item["frame_index"])
        expected = self.rows[key]
        for name, value in expected.items():
            if name == "task":
                assert item["task"] == value
            else:
                np.testing.assert_array_equal(item[name].numpy(), value, err_msg=f"{key} {name}")
        for camera in SIZES:
            picture = item[camera].numpy()
            assert np.array_equal(picture, self.pictures[(*key, camera)]), (key, camera)
            assert read_frame_label(picture) == key
        return key


@pytest.fixture(scope="module")
def oracle(dataset_root) -> Oracle:
    return Oracle(dataset_root)


# --- harness ---------------------------------------------------------------------------------


@dataclass
class Run:
    delivered: list[tuple[int, int]]
    error: type | None
    message: str
    causes: list[type]  # the __cause__ chain's types, nearest first
    seconds: float


def consume(dataset: StreamingDataset, oracle: Oracle, *, num_workers: int = 0,
            on_item=None) -> Run:
    """Stream one epoch, checking every sample; a RefstreamError ends the run and is recorded
    (only its type and text: the traceback would keep the stream's objects alive)."""
    delivered: list[tuple[int, int]] = []
    started = time.monotonic()
    error, message, causes = None, "", []
    loader = (dataset if num_workers == 0
              else DataLoader(dataset, batch_size=None, num_workers=num_workers))
    iterator = iter(loader)
    try:
        for item in iterator:
            delivered.append(oracle.check(item))
            if on_item is not None:
                on_item(delivered)
    except errors.RefstreamError as exc:
        error, message = type(exc), str(exc)
        link = exc.__cause__
        while link is not None:
            causes.append(type(link))
            link = link.__cause__
    finally:
        del iterator, loader
    return Run(delivered, error, message, causes, time.monotonic() - started)


class Recorder:
    """Opens every source StreamingDataset opens in this process with ``options`` added, and
    counts their retries from the log (each retry is one WARNING on ``refstream.http``)."""

    def __init__(self, caplog) -> None:
        self.options: dict = {}
        self._caplog = caplog

    def open(self, root, **http_options):
        return open_source(root, **{**self.options, **http_options})

    def retries(self) -> int:
        return sum(r.name == "refstream.http" and r.levelno == logging.WARNING
                   for r in self._caplog.records)


@pytest.fixture
def sources(monkeypatch, caplog) -> Recorder:
    caplog.set_level(logging.WARNING, "refstream.http")
    recorder = Recorder(caplog)
    monkeypatch.setattr(refstream.stream, "open_source", recorder.open)
    monkeypatch.setattr(refstream.worker, "open_source", recorder.open)
    return recorder


def faulty(log) -> list:
    return [r for r in log if r.mode in TRANSIENT_MODES]


def longest_fault_run(log) -> int:
    """The most consecutive transient faults any one (method, path, range) request met before
    it succeeded: each is one retry, so it must stay below max_attempts."""
    runs: Counter = Counter()
    longest = 0
    for record in log:
        key = record.method, record.path, record.range
        runs[key] = runs[key] + 1 if record.mode in TRANSIENT_MODES else 0
        longest = max(longest, runs[key])
    return longest


def assert_complete(run: Run) -> None:
    assert run.error is None, f"{run.error.__name__}: {run.message}"
    expected = [(e, f) for e, n in enumerate(LENGTHS) for f in range(n)]
    assert sorted(run.delivered) == expected  # every frame, exactly once


def streaming(url: str, **options) -> StreamingDataset:
    return StreamingDataset(url, seed=0, return_uint8=True, tolerance_s=TOLERANCE_S, **options)


# --- faults that must be survived ----------------------------------------------------------

SURVIVABLE = {
    "reset": Faults(reset=0.25, seed=1, max_run=MAX_ATTEMPTS - 1),
    "5xx_burst": Faults(status_5xx=0.15, burst=MAX_ATTEMPTS - 1, seed=2,
                        max_run=MAX_ATTEMPTS - 1),
    "429_retry_after": Faults(too_many=0.1, retry_after="1", seed=3, max_run=MAX_ATTEMPTS - 1),
    "short": Faults(short=0.25, seed=4, max_run=MAX_ATTEMPTS - 1),
    "slow": Faults(slow=0.15, seed=5, max_run=MAX_ATTEMPTS - 1),
    "ignore_range": Faults(ignore_range=0.3, seed=6),
}


@pytest.mark.parametrize("mode", SURVIVABLE)
def test_survivable_fault_mode_delivers_the_epoch_exactly(mode, dataset_root, oracle, sources):
    if mode == "slow":
        sources.options["read_timeout_s"] = READ_TIMEOUT_S
    with RangeServer(dataset_root, faults=SURVIVABLE[mode]) as server:
        dataset = streaming(server.url)
        run = consume(dataset, oracle)
    hit = [r for r in server.log if r.mode]
    print(f"{mode}: {len(hit)} faults, {sources.retries()} retries, {run.seconds:.2f} s")
    assert_complete(run)
    assert run.seconds < SURVIVE_BOUND_S
    assert len(hit) >= 2, f"the mode {mode} was never applied"
    assert not server.overflowed
    assert longest_fault_run(server.log) < MAX_ATTEMPTS
    if mode == "ignore_range":
        assert sources.retries() == 0 and all(r.status == 200 for r in hit)
    elif mode == "slow":  # a loaded machine may time out a normal request too
        assert sources.retries() >= len(faulty(server.log))
    else:
        assert sources.retries() == len(faulty(server.log))  # one retry per fault, no more
    if mode == "429_retry_after":
        assert run.seconds >= 1.0  # Retry-After: 1 was waited, not the ~0.1 s jittered backoff


def test_redirect_to_a_second_host_delivers_the_epoch_exactly(dataset_root, oracle, sources,
                                                              second_host):
    with RangeServer(dataset_root, host=second_host) as target, \
            RangeServer(dataset_root, redirect_to=target) as server:
        run = consume(streaming(server.url), oracle)
    assert_complete(run)
    ranged = [r for r in target.log if r.range]
    assert ranged and all(r.status == 206 for r in ranged)
    assert all(r.status == 302 for r in server.log if r.range)
    redirected = [r for r in server.log if r.status == 302]
    assert len(redirected) >= len(ranged)
    assert len(target.log) == len(redirected)  # each redirect followed once
    assert sources.retries() == 0


@pytest.fixture
def second_host() -> str:
    """127.0.0.2 when it binds (Linux loopback is a /8), else 127.0.0.1 on another port."""
    return second_loopback_host()


MIX = Faults(reset=0.08, status_5xx=0.08, short=0.03, too_many=0.01, seed=11,
             max_run=MAX_ATTEMPTS - 1)
MIX_EPOCHS = 4  # ~90 range GETs, so the 20 % mix hits about 18 of them


@pytest.mark.parametrize("num_workers", [0, 2])
def test_fault_mix_over_four_epochs(num_workers, dataset_root, oracle, sources):
    faults = Faults(**{**MIX.__dict__, "seed": MIX.seed + num_workers})
    with RangeServer(dataset_root, faults=faults) as server:
        dataset = streaming(server.url)
        runs = []
        for epoch in range(MIX_EPOCHS):
            dataset.set_epoch(epoch)
            runs.append(consume(dataset, oracle, num_workers=num_workers))
    for run in runs:
        assert_complete(run)
        assert run.seconds < SURVIVE_BOUND_S
    assert runs[0].delivered != runs[1].delivered  # epochs differ in order: really streamed
    ranged = [r for r in server.log if r.range]
    print(f"mix, {num_workers} workers: {len(ranged)} range GETs, "
          f"{Counter(r.mode for r in faulty(server.log))}, {[round(r.seconds, 2) for r in runs]} s")
    assert len(faulty(server.log)) >= 5 and len({r.mode for r in faulty(server.log)}) >= 2
    assert longest_fault_run(server.log) < MAX_ATTEMPTS
    if num_workers == 0:
        assert sources.retries() == len(faulty(server.log))


# --- faults that must stop the stream -----------------------------------------------------------


def _script(*modes):
    return lambda server: server.script(*modes)


def _always(**faults):
    return lambda server: server.faults.__dict__.update(faults)


# mode -> (how to apply it once the dataset is open, error class, a class the cause chain must
# hold, or None).
# Scripted modes start with "" so the Parquet HEAD passes and the fault hits a range GET.
UNSURVIVABLE = {
    "403_persistent": (_script("", *["403"] * 20), errors.HTTPStatusError, None),
    "416": (_script("", "416"), errors.BadRangeResponse, None),
    "200_content_range": (_script("", "200_content_range"), errors.BadRangeResponse, None),
    "wrong_range": (_always(wrong_range=1.0), errors.BadRangeResponse, None),
    "5xx_persistent": (_always(status_5xx=1.0), errors.RetriesExhausted, errors.HTTPStatusError),
    "slow_persistent": (_always(slow=1.0), errors.RetriesExhausted,
                        errors.FetchError),
}

# `bytes a-b`, or `bytes -n` for a tail read (HTTP's suffix range: the last n bytes)
NAMED = re.compile(r"(http://127\.0\.0\.1:\d+)(/\S+) bytes (\d*)-(\d+)")


def assert_names_url_range_and_episode(run: Run, server: RangeServer, oracle: Oracle) -> None:
    message = run.message
    assert "\n" not in message, message  # also from a DataLoader worker
    found = NAMED.search(message)
    assert found, f"no URL and byte range in: {run.message}"
    base, path, first, last = found.groups()
    assert base == server.url
    assert any(r.path == path and r.range == f"bytes={first}-{last}" for r in server.log), \
        "the named range was never requested"
    episode = re.search(r"episode (\d+)", message)
    assert episode, f"no episode named in: {message}"
    assert int(episode[1]) in oracle.episodes_of(path), (path, message)


@pytest.mark.parametrize("mode", UNSURVIVABLE)
def test_unsurvivable_mode_stops_with_a_named_error(mode, dataset_root, oracle, sources):
    apply, error, cause = UNSURVIVABLE[mode]
    if mode == "slow_persistent":
        sources.options["read_timeout_s"] = READ_TIMEOUT_S
    with RangeServer(dataset_root) as server:
        baseline = Baseline()
        # one episode fetched at a time, so the fault meets one known request
        dataset = streaming(server.url, episode_pool_size=1, prefetch_episodes=0)
        apply(server)
        run = consume(dataset, oracle)
        del dataset
        baseline.assert_back()
    print(f"{mode}: {run.error and run.error.__name__} after {run.seconds:.2f} s, "
          f"{len(run.delivered)} samples: {run.message}")
    assert run.error is error, f"{run.error}: {run.message}"
    if cause is not None:
        assert any(issubclass(link, cause) for link in run.causes), run.causes
    assert run.seconds < STOP_BOUND_S
    assert_names_url_range_and_episode(run, server, oracle)
    if error is errors.RetriesExhausted:
        assert f"failed {MAX_ATTEMPTS} times" in run.message
    else:
        assert len(faulty(server.log)) == 0  # stopped at once, nothing retried


def test_file_replaced_mid_run_stops_with_payload_changed(dataset_root, oracle, sources):
    camera = "observation.images.front"
    replaced: list[str] = []

    def replace_another_file(delivered: list[tuple[int, int]]) -> None:
        if len(delivered) != 5:
            return
        current = delivered[-1][0]
        files = oracle.video_file_episodes[camera]
        index = next(i for i, episodes in files.items() if current not in episodes)
        relpath = f"videos/{camera}/chunk-000/file-{index:03d}.mp4"
        size = (dataset_root / relpath).stat().st_size
        server.replace_file(relpath, os.urandom(size))  # same size, new ETag
        replaced.append(relpath)

    with RangeServer(dataset_root) as server:
        baseline = Baseline()
        dataset = streaming(server.url, episode_pool_size=1, prefetch_episodes=0)
        run = consume(dataset, oracle, on_item=replace_another_file)
        del dataset
        baseline.assert_back()
    assert replaced, "the stream ended before the file could be replaced"
    assert run.error is errors.PayloadChanged, f"{run.error}: {run.message}"
    assert f"/{replaced[0]} bytes" in run.message and "file changed" in run.message
    assert run.seconds < STOP_BOUND_S
    assert_names_url_range_and_episode(run, server, oracle)
    assert len(run.delivered) >= 5 and len(set(run.delivered)) == len(run.delivered)


def test_persistent_5xx_with_two_workers_stops_and_names_the_request(dataset_root, oracle,
                                                                     sources):
    with RangeServer(dataset_root) as server:
        baseline = Baseline()
        dataset = streaming(server.url, prefetch_episodes=0)
        server.faults.status_5xx = 1.0
        run = consume(dataset, oracle, num_workers=2)
        del dataset
        baseline.assert_back()
    assert run.error is errors.RetriesExhausted, f"{run.error}: {run.message}"
    assert run.seconds < STOP_BOUND_S + 5  # + worker start-up
    assert_names_url_range_and_episode(run, server, oracle)


# --- the Hub's resolver quota ------------------------------------------------------------------

HUB_COMMIT = "0123456789abcdef0123456789abcdef01234567"
# Fewer /resolve/ answers per window than the dataset has files, and a window longer than the
# jittered backoff of every attempt together (<= 3.75 s): only waiting for the reset survives it.
RESOLVER_QUOTA, QUOTA_WINDOW_S = 3, 5


def test_an_epoch_with_two_workers_waits_out_the_hub_resolver_quota(dataset_root, oracle, sources,
                                                                    second_host, monkeypatch,
                                                                    tmp_path):
    waits = tmp_path / "waits.log"  # every process's waits: DataLoader workers log there too
    handler = logging.FileHandler(waits)
    handler.setFormatter(logging.Formatter("%(process)d %(message)s"))
    logging.getLogger("refstream.http").addHandler(handler)
    config = HubConfig(revisions={"main": HUB_COMMIT}, resolver_quota=RESOLVER_QUOTA,
                       quota_window_s=QUOTA_WINDOW_S, signed_s=3600)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    try:
        with RangeServer(dataset_root, host=second_host) as cdn, \
                RangeServer(dataset_root, hub=config, redirect_to=cdn) as hub:
            monkeypatch.setenv("HF_ENDPOINT", hub.url)
            run = consume(streaming("hf://datasets/owner/name"), oracle, num_workers=2)
    finally:
        logging.getLogger("refstream.http").removeHandler(handler)
        handler.close()
    assert_complete(run)
    resolves = [r for r in hub.log if "/resolve/" in r.path]
    limited = [r for r in resolves if r.status == 429]
    assert limited, "the quota was never reached"
    lines = waits.read_text().splitlines()
    assert len(lines) == len(limited)  # one WARNING per wait, in whichever process waited
    assert all(re.search(r'HTTP 429: rate limited \(quota "resolvers", resets in [1-5] s\); '
                         "waiting$", line) for line in lines), lines
    assert len({line.split()[0] for line in lines}) >= 2, "no DataLoader worker met the quota"
    resolved = Counter(r.path for r in resolves if r.status == 302)
    assert max(resolved.values()) <= 3  # at most once per process (main + 2 workers) per file
    assert all(r.status in (200, 206) and "X-Amz-Signature=" in r.path for r in cdn.log)
