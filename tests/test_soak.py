"""Soak: many epochs with two workers and ``repeat=True`` leak no memory, threads or descriptors.

One DataLoader iterator over ``StreamingDataset(repeat=True)`` runs ``EPOCHS`` epochs of a small
real dataset served over HTTP by ``refstream.tools.demo.serve_directory`` in a *separate
process* (so the server's own bookkeeping does not count against this process). Every sample's
pixels must show its (episode, frame) label, and after each epoch (``total_frames`` samples) the
test samples, from ``/proc``: RSS of this process and of each worker, and each worker's thread
and descriptor counts.

Tolerances, stated honestly:

* RSS: the mean of the last 5 epochs may exceed the mean of epochs 3-7 (after warm-up:
  allocator arenas, decoder pools and the mapped sidecar settle in the first epochs) by at most
  ``RSS_TOLERANCE_MB`` per process. Measured noise on this machine is ~1 MB; one epoch streams
  ~0.3 MB of video and decodes ~1.4 MB of pixels per worker, so a leak of a payload, a decoder or
  the decoded frames of every epoch (≥ 1.4 MB × 13 epochs) is caught, a leak of a few KB per
  epoch is not.
* Worker threads and descriptors (``/proc/<pid>/task`` and ``fd``): the median of the last 5
  epochs is not above the median of epochs 3-7; any per-epoch leak raises it, a helper thread
  that PyArrow or dav1d starts for a moment does not.
* After the loader is closed, this process's threads and descriptors return to the count before
  the loader was made (once every thread started since has ended: ``tests/leaks.py``).

The CI run is ``EPOCHS`` epochs (~30 s on 2 idle cores); ``--run-slow`` runs ``LONG_EPOCHS``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from leaks import Baseline
from torch.utils.data import DataLoader

from refstream.stream import StreamingDataset
from refstream.tools.demo import read_frame_label, write_demo_dataset

LENGTHS = (20, 20, 20, 20)  # equal shares: each worker yields half of every epoch
CAMERAS = ("observation.images.front", "observation.images.wrist")
EPOCHS = 20
LONG_EPOCHS = 200
RSS_TOLERANCE_MB = 8.0
WARM_EPOCHS = slice(2, 7)  # epochs 3-7 (1-based)
POOL_SLACK = 2  # threads or descriptors a lazily grown pool may add after the warm epochs

SERVER_SCRIPT = """
import sys
from refstream.tools.demo import serve_directory
with serve_directory(sys.argv[1]) as server:
    print(server.url, flush=True)
    sys.stdin.read()  # serve until the test closes our stdin
"""


@pytest.fixture(scope="module")
def served_dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("soak_dataset")
    write_demo_dataset(root, episode_lengths=LENGTHS, cameras=CAMERAS, size=(64, 48),
                       episodes_per_video_file=2, episodes_per_data_file=2)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    server = subprocess.Popen([sys.executable, "-c", SERVER_SCRIPT, str(root)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        url = server.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:"), url
        yield url, server.pid
    finally:
        server.stdin.close()
        server.wait(10)
        server.stdout.close()


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("REFSTREAM_CACHE", str(tmp_path / "cache"))


# --- /proc ------------------------------------------------------------------------------------


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


def thread_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def children(exclude: int) -> list[int]:
    """Live child processes of this process, but ``exclude``."""
    me, found = os.getpid(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == exclude:
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "(comm)": state, ppid, ...
        if int(fields[1]) == me and fields[0] != "Z":
            found.append(int(entry))
    return sorted(found)


# --- the soak ---------------------------------------------------------------------------------


def growth_mb(series: list[float]) -> float:
    """Mean of the last 5 samples minus the mean of epochs 3-7."""
    return float(np.mean(series[-5:]) - np.mean(series[WARM_EPOCHS]))


def grew(counts: list[int]) -> bool:
    """Whether a count kept rising: the median of the last 5 epochs above the highest of epochs
    3-7 by more than ``POOL_SLACK`` (a median, because PyArrow and dav1d start helper threads for
    a moment now and then; a slack, because thread and session pools grow lazily to their bound
    when a later epoch first needs one more). A leak of one per epoch exceeds it by ~10."""
    return float(np.median(counts[-5:])) > max(counts[WARM_EPOCHS]) + POOL_SLACK


def soak(url: str, server_pid: int, epochs: int) -> None:
    dataset = StreamingDataset(url, seed=0, return_uint8=True, repeat=True)
    per_epoch = sum(LENGTHS)
    baseline = Baseline()
    others = set(children(exclude=server_pid))  # e.g. a resource tracker left by earlier tests
    loader = DataLoader(dataset, batch_size=None, num_workers=2)
    iterator = iter(loader)
    main_rss: list[float] = []
    worker_rss: dict[int, list[float]] = {}
    worker_threads: dict[int, list[int]] = {}
    worker_fds: dict[int, list[int]] = {}
    seen: dict[tuple[int, int], int] = {}
    started = time.monotonic()
    for _ in range(epochs):
        for _ in range(per_epoch):
            item = next(iterator)
            key = int(item["episode_index"]), int(item["frame_index"])
            for camera in CAMERAS:
                assert read_frame_label(item[camera].numpy()) == key
            seen[key] = seen.get(key, 0) + 1
        main_rss.append(rss_mb(os.getpid()))
        for pid in set(children(exclude=server_pid)) - others:
            worker_rss.setdefault(pid, []).append(rss_mb(pid))
            worker_threads.setdefault(pid, []).append(thread_count(pid))
            worker_fds.setdefault(pid, []).append(fd_count(pid))
    seconds = time.monotonic() - started
    del iterator, loader, item
    report = {"main": growth_mb(main_rss),
              **{f"worker {pid}": growth_mb(s) for pid, s in worker_rss.items()}}
    print(f"soak: {epochs} epochs in {seconds:.1f} s; RSS growth MB {report}; main RSS "
          f"{[round(v, 1) for v in main_rss]}; worker threads {worker_threads}; "
          f"worker fds { {pid: (min(v), max(v)) for pid, v in worker_fds.items()} }")

    # every frame, the same number of times: the shares are equal, the loader alternates workers
    assert set(seen.values()) == {epochs} and len(seen) == per_epoch
    assert len(worker_rss) == 2 and all(len(s) == epochs for s in worker_rss.values())
    for name, growth in report.items():
        assert growth <= RSS_TOLERANCE_MB, f"{name}: RSS grew {growth:.1f} MB"
    for pid in worker_threads:
        assert not grew(worker_threads[pid]), f"worker threads {worker_threads[pid]}"
        assert not grew(worker_fds[pid]), f"worker descriptors {worker_fds[pid]}"
    baseline.assert_back()


def test_soak_two_workers_repeat(served_dataset):
    soak(*served_dataset, epochs=EPOCHS)


@pytest.mark.slow
def test_soak_two_workers_repeat_long(served_dataset):
    soak(*served_dataset, epochs=LONG_EPOCHS)
