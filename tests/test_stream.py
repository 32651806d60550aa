"""StreamingDataset end to end, against an independent map-style reference.

The reference reads the data Parquet files with pyarrow and decodes every video file whole with
PyAV, then applies LeRobot's documented map-style rules (clamped windows, ``*_is_pad``, query
time = ``from_timestamp`` + the ``timestamp`` column at the window rows, nearest frame within
tolerance). Nothing of refstream is used to build it.
"""

from __future__ import annotations

import io
import multiprocessing
import shutil
import subprocess
import sys
import threading
from collections import Counter
from itertools import islice
from pathlib import Path

import av
import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from media import CountingCodec
from torch.utils.data import DataLoader
from tqdm import tqdm

import refstream.decode
import refstream.worker
from refstream.budget import ByteBudget
from refstream.errors import EpisodeTooLarge, IterableOnly, TableError, TopologyChanged, UsageError
from refstream.sidecar import MappedIndex
from refstream.stream import GIB, StreamingDataset
from refstream.tools.demo import read_frame_label, serve_directory, write_demo_dataset
from refstream.worker import plan_spans

FPS = 30
TOLERANCE_S = 1e-4
SIZES = {"observation.images.front": (64, 48), "observation.images.wrist": (96, 64)}
LENGTHS = (9, 14, 6, 12, 10, 7)
WINDOWS = {
    "observation.images.front": [-2 / FPS, 0.0],
    "observation.images.wrist": [0.0, 1 / FPS],
    "observation.state": [-1 / FPS, 0.0],
    "action": [0.0, 1 / FPS, 2 / FPS, 3 / FPS],
}


pytestmark = pytest.mark.usefixtures("session_index_cache")


@pytest.fixture(scope="module", params=["av1", "h264"])
def dataset_root(request, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp(f"stream_{request.param}")
    options = {"codec": "libx264", "gop": 30, "bframes": 2} if request.param == "h264" else {}
    write_demo_dataset(root, episode_lengths=LENGTHS, size=SIZES, episodes_per_video_file=4,
                       episodes_per_data_file=4, **options)
    return root


# --- the independent reference ------------------------------------------------------------


class Reference:
    """LeRobot's map-style items, from pyarrow and whole-file PyAV decoding."""

    def __init__(self, root: Path, windows: dict | None) -> None:
        self.windows = windows or {}
        episodes = pq.read_table(root / "meta/episodes/chunk-000/file-000.parquet").to_pydict()
        self.episodes = episodes
        tasks = pq.read_table(root / "meta/tasks.parquet").to_pydict()
        self.tasks = dict(zip(tasks["task_index"], tasks["task"], strict=True))
        self.rows: dict[int, dict[str, np.ndarray]] = {}
        for path in sorted((root / "data").rglob("*.parquet")):
            table = pq.read_table(path).to_pydict()
            for e in sorted(set(table["episode_index"])):
                mask = np.array(table["episode_index"]) == e
                self.rows[e] = {k: np.array(v)[mask] for k, v in table.items()}
        self.frames: dict[tuple[str, str], dict[int, np.ndarray]] = {}
        self.cameras = [k[len("videos/"):-len("/chunk_index")] for k in episodes
                        if k.startswith("videos/") and k.endswith("/chunk_index")]
        for camera in self.cameras:
            for path in sorted((root / "videos" / camera).rglob("*.mp4")):
                with av.open(str(path)) as container:
                    decoded = {}
                    for frame in container.decode(video=0):
                        decoded[float(frame.pts * frame.time_base)] = frame.to_ndarray(
                            format="rgb24").transpose(2, 0, 1)
                self.frames[camera, path.name] = decoded

    def item(self, episode: int, frame: int) -> dict:
        rows = self.rows[episode]
        length = len(rows["frame_index"])
        out = {}
        for key, values in rows.items():
            if key in self.windows:
                target = frame + np.array([round(d * FPS) for d in self.windows[key]])
                out[key] = values[np.clip(target, 0, length - 1)]
                out[f"{key}_is_pad"] = (target < 0) | (target >= length)
            else:
                out[key] = values[frame]
        for camera in self.cameras:
            if camera in self.windows:
                target = frame + np.array([round(d * FPS) for d in self.windows[camera]])
                out[f"{camera}_is_pad"] = (target < 0) | (target >= length)
                idx = np.clip(target, 0, length - 1)
            else:
                idx = np.array([frame])
            file_index = self.episodes[f"videos/{camera}/file_index"][episode]
            decoded = self.frames[camera, f"file-{file_index:03d}.mp4"]
            times = np.array(sorted(decoded))
            pictures = []
            for t in rows["timestamp"][idx]:
                query = self.episodes[f"videos/{camera}/from_timestamp"][episode] + float(t)
                nearest = times[np.argmin(np.abs(times - query))]
                assert abs(nearest - query) <= TOLERANCE_S
                pictures.append(decoded[nearest])
            stacked = np.stack(pictures).astype(np.float32) / 255
            out[camera] = stacked[0] if len(idx) == 1 else stacked
        out["task"] = self.tasks[int(rows["task_index"][frame])]
        return out


def _expected_dtype(value) -> torch.dtype:
    kind = np.asarray(value).dtype.kind
    return {"f": torch.float32, "i": torch.int64, "u": torch.int64, "b": torch.bool}[kind]


def assert_item_equal(item: dict, expected: dict) -> None:
    assert item.keys() == expected.keys()
    for key, value in expected.items():
        if key == "task":
            assert item[key] == value
            continue
        got = item[key]
        assert isinstance(got, torch.Tensor), key
        assert got.dtype == _expected_dtype(value), (key, got.dtype)
        assert tuple(got.shape) == np.shape(value), (key, got.shape, np.shape(value))
        want = torch.from_numpy(np.asarray(value).astype(got.numpy().dtype))
        assert torch.equal(got, want), key


@pytest.fixture
def budgets(monkeypatch):
    """Every worker's byte budget as ``(peak reserved, budget)`` bytes, recorded when it closes
    (DataLoader workers fork after the patch, so theirs are recorded too)."""
    seen = torch.zeros((16, 2), dtype=torch.int64).share_memory_()
    count = multiprocessing.Value("i", 0)

    class Recorded(ByteBudget):
        peak_reserved_bytes = 0

        def _reserve_locked(self, *args, **kwargs) -> bool:  # runs under the table's lock
            reserved = super()._reserve_locked(*args, **kwargs)
            self.peak_reserved_bytes = max(self.peak_reserved_bytes, self._reserved_locked())
            return reserved

        def close(self) -> None:
            with count.get_lock():
                seen[count.value] = torch.tensor([self.peak_reserved_bytes, self.budget_bytes])
                count.value += 1
            super().close()

    monkeypatch.setattr(refstream.worker, "ByteBudget", Recorded)
    return lambda: [tuple(row) for row in seen[:count.value].tolist()]


def _items(dataset, num_workers: int, **loader_options) -> list[dict]:
    loader = DataLoader(dataset, batch_size=None, num_workers=num_workers, **loader_options)
    return list(loader)


def _labels(batches) -> list[list[tuple[int, int]]]:
    return [list(zip(b["episode_index"].tolist(), b["frame_index"].tolist(), strict=True))
            for b in batches]


# --- coverage and equality ----------------------------------------------------------------


def test_two_workers_local_equal_reference(dataset_root):
    reference = Reference(dataset_root, WINDOWS)
    dataset = StreamingDataset(dataset_root, delta_timestamps=WINDOWS, seed=3,
                               episode_pool_size=2, prefetch_episodes=2)
    items = _items(dataset, num_workers=2)
    seen = [(int(i["episode_index"]), int(i["frame_index"])) for i in items]
    assert sorted(seen) == [(e, f) for e, n in enumerate(LENGTHS) for f in range(n)]
    for item, (e, f) in zip(items, seen, strict=True):
        assert_item_equal(item, reference.item(e, f))
        # The labels drawn into the pixels agree with the rows (lossy coding tolerated).
        anchor = item["observation.images.wrist"][0]
        assert read_frame_label((anchor * 255).round().to(torch.uint8).numpy()) == (e, f)


def test_loopback_http_one_range_per_span(dataset_root):
    with serve_directory(dataset_root) as server:
        dataset = StreamingDataset(server.url, seed=5, return_uint8=True,
                                   episode_pool_size=3)
        setup = len(server.log)
        items = _items(dataset, num_workers=2)
        log = server.log[setup:]
    reference = Reference(dataset_root, None)
    seen = Counter((int(i["episode_index"]), int(i["frame_index"])) for i in items)
    assert set(seen.values()) == {1} and len(seen) == sum(LENGTHS)
    for item in items:
        e, f = int(item["episode_index"]), int(item["frame_index"])
        expected = reference.item(e, f)
        for camera in SIZES:
            assert item[camera].dtype == torch.uint8
            want = torch.from_numpy((expected[camera] * 255).round().astype(np.uint8))
            assert torch.equal(item[camera], want)
    video = [(path, rng) for method, path, rng, _ in log if path.endswith(".mp4")]
    assert all(rng is not None for _, rng in video)
    for path, rng in video:  # a span, never the whole video file
        first, last = (int(x) for x in rng.removeprefix("bytes=").split("-"))
        assert last - first + 1 < (dataset_root / path.lstrip("/")).stat().st_size / 2
    assert len(video) == len(LENGTHS) * len(SIZES)  # one range per (episode, camera)
    assert len(set(video)) == len(video)


def test_nginx_ranges_are_spans_and_parquet_reads(dataset_root, budgets):
    from nginx import NginxServer

    reference = Reference(dataset_root, WINDOWS)
    with NginxServer(dataset_root) as server:
        dataset = StreamingDataset(server.url, delta_timestamps=WINDOWS, seed=6,
                                   episode_pool_size=2)
        setup = server.mark()
        items = _items(dataset, num_workers=2)
        log = server.access_log()[setup:]
    seen = sorted((int(i["episode_index"]), int(i["frame_index"])) for i in items)
    assert seen == [(e, f) for e, n in enumerate(LENGTHS) for f in range(n)]
    for item in items:
        assert_item_equal(item, reference.item(int(item["episode_index"]),
                                               int(item["frame_index"])))
    video = [r for r in log if r.path.endswith(".mp4")]
    assert all(r.range is not None and r.status == 206 for r in video)
    assert len(video) == len(LENGTHS) * len(SIZES)
    for record in video:
        assert record.body_bytes < (dataset_root / record.path.lstrip("/")).stat().st_size / 2
    others = [r for r in log if not r.path.endswith(".mp4")]
    assert all(r.path.startswith("/data/") and r.path.endswith(".parquet") for r in others)
    assert len(budgets()) == 2 and all(peak <= budget for peak, budget in budgets())


def test_main_process_equals_one_worker_and_order_is_deterministic(dataset_root):
    def order(num_workers):
        dataset = StreamingDataset(dataset_root, seed=11, episode_pool_size=2,
                                   decode_threads=3, return_uint8=True)
        return [(int(i["episode_index"]), int(i["frame_index"]))
                for i in _items(dataset, num_workers)]

    in_process = order(0)
    assert in_process == order(1)
    assert in_process != sorted(in_process)  # shuffled


@pytest.mark.parametrize("num_workers", [0, 2])
def test_each_frame_is_decoded_once_in_an_epoch(dataset_root, monkeypatch, num_workers):
    # Every frame is some anchor's (windows clamp at the edges), so keeping the frames later
    # anchors want decodes each GOP once: as many frames as the cameras hold, long GOPs too.
    decoded = multiprocessing.Value("q", 0)

    def count(frames: int) -> None:
        with decoded.get_lock():
            decoded.value += frames

    class Counted(refstream.decode.EpisodeDecoder):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            if not isinstance(self.codec, CountingCodec):  # a peer's context counts already
                self.codec = CountingCodec(self.codec, count)

    monkeypatch.setattr(refstream.decode, "EpisodeDecoder", Counted)
    dataset = StreamingDataset(dataset_root, delta_timestamps=WINDOWS, seed=4, batch_size=4,
                               batched=True, num_workers=num_workers)
    batches = _items(dataset, num_workers=num_workers)
    assert sum(len(b["index"]) for b in batches) == sum(LENGTHS)
    assert decoded.value == sum(LENGTHS) * len(SIZES)


@pytest.mark.parametrize(("pool_ramp", "needed_episodes"), [(0, 2), (8, 1)])
def test_the_first_batch_waits_for_no_frontier_episode(dataset_root, monkeypatch, pool_ramp,
                                                       needed_episodes):
    # The first group's episodes are fetched as its anchors need them and decoded as they
    # arrive; the other residents and the frontier are fetched once the group is decoded. A
    # pool filled at once gives the first batch 2 of its 3 residents; one that grows over its
    # first 8 anchors gives it one.
    events = []
    stream = refstream.worker.WorkerStream
    fetch, decode_part, emit = stream._fetch, stream._decode_part, stream._emit

    def fetched(self, episode, anchors):
        events.append(episode)
        return fetch(self, episode, anchors)

    def decoded(self, made, thread, parts):
        events.append("decode")
        decode_part(self, made, thread, parts)

    def emitted(self, *arguments):
        events.append("emit")
        return emit(self, *arguments)

    monkeypatch.setattr(stream, "_fetch", fetched)
    monkeypatch.setattr(stream, "_decode_part", decoded)
    monkeypatch.setattr(stream, "_emit", emitted)
    dataset = StreamingDataset(dataset_root, seed=1, episode_pool_size=3, prefetch_episodes=3,
                               episode_pool_ramp=pool_ramp, batch_size=4, batched=True)
    batches = iter(DataLoader(dataset, batch_size=None, num_workers=0))
    first = next(batches)
    needed = set(first["episode_index"].tolist())
    assert len(needed) == needed_episodes  # the other residents wait, and so does the frontier
    head = events[:events.index("emit")]
    last_decode = max(i for i, event in enumerate(head) if event == "decode")
    assert {e for e in head[:last_decode] if e != "decode"} == needed
    assert sum(len(b["index"]) for b in batches) + len(first["index"]) == sum(LENGTHS)
    assert len([e for e in events if e not in ("decode", "emit")]) == len(LENGTHS)  # once each


def test_budget_is_respected_and_sampled(dataset_root, budgets):
    files = list((dataset_root / "videos").rglob("*.mp4"))
    budget = sum(p.stat().st_size for p in files) // 2  # about three episodes of six
    dataset = StreamingDataset(dataset_root, seed=1, byte_budget_gb=budget / GIB,
                               prefetch_episodes=4, return_uint8=True)
    items = _items(dataset, num_workers=0)
    assert len(items) == sum(LENGTHS)
    ((peak, worker_budget),) = budgets()
    assert budget // 2 < peak <= worker_budget == budget


def test_episode_larger_than_budget_fails_before_any_fetch(dataset_root):
    with serve_directory(dataset_root) as server:
        dataset = StreamingDataset(server.url, byte_budget_gb=1000 / GIB)
        setup = len(server.log)
        with pytest.raises(EpisodeTooLarge, match="byte budget"):
            _items(dataset, num_workers=0)
        assert server.log[setup:] == []


# --- threads, transforms, errors, early exit ----------------------------------------------


def test_transforms_run_on_the_yielding_thread_in_order(dataset_root):
    calls = []

    def transform(frames):
        calls.append(threading.current_thread())
        return frames * 0 + len(calls)

    dataset = StreamingDataset(dataset_root, seed=2, decode_threads=4, decoded_queue_size=6,
                               image_transforms=transform)
    items = list(dataset)
    assert set(calls) == {threading.current_thread()}
    # Two cameras per sample, transformed in planner order: the k-th sample saw calls 2k+1, 2k+2.
    for k, item in enumerate(items):
        assert float(item["observation.images.front"].flatten()[0]) == 2 * k + 1
        assert float(item["observation.images.wrist"].flatten()[0]) == 2 * k + 2


def started_since(before: set[threading.Thread]) -> list[threading.Thread]:
    """Threads alive now that were not in ``before`` (a count would also see a thread an earlier
    test left, such as a loopback server's, end meanwhile)."""
    return [t for t in threading.enumerate() if t not in before]


def test_early_exit_closes_threads(dataset_root):
    before = set(threading.enumerate())
    dataset = StreamingDataset(dataset_root, seed=4, decode_threads=3)
    iterator = iter(dataset)
    next(iterator)
    assert started_since(before)
    iterator.close()
    assert started_since(before) == []


def copy_dataset(root: Path, to: Path) -> Path:
    """A copy of the dataset at ``root`` to change without touching the shared fixture."""
    shutil.copytree(root, to)
    return to


def test_error_in_fetch_thread_reaches_consumer(dataset_root, tmp_path):
    broken = copy_dataset(dataset_root, tmp_path / "broken")
    data = sorted((broken / "data").rglob("*.parquet"))[0]
    data.write_bytes(data.read_bytes()[: len(data.read_bytes()) // 2])  # cut in half
    dataset = StreamingDataset(broken, seed=0, decode_threads=2)
    before = set(threading.enumerate())
    # Iterated in this process: a DataLoader worker forwards the same exception, but torch then
    # keeps its iterator in a reference cycle until garbage collection, which stalls 5 s a worker.
    with pytest.raises(TableError, match="Parquet") as info:
        list(dataset)
    assert "file-000.parquet" in str(info.value)
    assert info.value.__cause__ is not None  # pyarrow's own error, chained
    assert started_since(before) == []  # every thread of the stream was shut down


def test_timestamps_outside_the_planned_span_are_refused(dataset_root, tmp_path):
    import pyarrow as pa

    moved = copy_dataset(dataset_root, tmp_path / "moved")
    data = moved / "data/chunk-000/file-000.parquet"
    table = pq.read_table(data)
    timestamps = table["timestamp"].to_numpy().copy()
    # Episode 0's last row asks for the frame two steps later: episode 1's second frame.
    timestamps[LENGTHS[0] - 1] += np.float32(2 / FPS)
    column = table.schema.get_field_index("timestamp")
    pq.write_table(table.set_column(column, "timestamp", pa.array(timestamps)), data)
    dataset = StreamingDataset(moved, episodes=[0], seed=0)
    with pytest.raises(TableError, match="episode 0: its timestamps need samples"):
        list(dataset)


def test_settings_are_checked(dataset_root):
    with pytest.raises(UsageError):
        StreamingDataset(dataset_root, sampling_strategy="random")
    with pytest.raises(UsageError):
        StreamingDataset(dataset_root, decode_threads=0)
    with pytest.raises(UsageError):
        StreamingDataset(dataset_root, rank=2, world_size=2)
    with pytest.raises(UsageError, match="batch_size"):  # at once, not in a worker
        StreamingDataset(dataset_root, rank=0, world_size=2)
    for tolerance_s in (True, "1e-4", -1e-4, float("nan")):  # the check windows and doctor use
        with pytest.raises(UsageError, match="tolerance_s"):
            StreamingDataset(dataset_root, tolerance_s=tolerance_s)


@pytest.mark.parametrize("world_size, num_workers, batch_size, repeat",
                         [(1, 2, 4, False), (2, 2, 4, False), (3, 1, 5, False), (2, 2, 3, True)])
def test_len_is_what_a_rank_yields_in_an_epoch(resume_root, world_size, num_workers,
                                               batch_size, repeat):
    for rank in range(world_size):
        dataset = StreamingDataset(resume_root, rank=rank, world_size=world_size,
                                   batch_size=batch_size, num_workers=num_workers, repeat=repeat)
        loader = DataLoader(dataset, batch_size=batch_size, num_workers=num_workers)
        if repeat:  # endless: an epoch is every frame of the rank
            assert len(dataset) == dataset.rank_frames
            continue
        batches = len(list(loader))  # each worker's last batch may be short
        assert len(loader) == batches and len(dataset) == batches * batch_size, rank


def test_len_of_a_distributed_epoch_needs_the_worker_count(resume_root):
    dataset = StreamingDataset(resume_root, rank=0, world_size=2, batch_size=4)
    with pytest.raises(IterableOnly, match="worker count .* give num_workers=N"):
        len(dataset)
    dataset = StreamingDataset(resume_root, batch_size=4, num_workers=2)
    with pytest.raises(UsageError, match="num_workers=2"):
        next(iter(DataLoader(dataset, batch_size=4, num_workers=1)))


def test_an_episode_over_a_workers_share_of_the_budget_says_what_to_change(resume_root):
    probe = StreamingDataset(resume_root)
    _, sizes = plan_spans(probe.config, probe.episodes, MappedIndex(probe.video_index))
    largest = max(sizes.values())
    budget_gb = 1.5 * largest / GIB  # holds every episode, but half of it does not
    one = DataLoader(StreamingDataset(resume_root, byte_budget_gb=budget_gb), batch_size=4)
    assert sum(len(batch["index"]) for batch in one) == sum(RESUME_LENGTHS)
    two = DataLoader(StreamingDataset(resume_root, byte_budget_gb=budget_gb), batch_size=4,
                     num_workers=2)
    with pytest.raises(EpisodeTooLarge) as raised:
        for _ in two:
            pass
    message = str(raised.value)
    assert f"byte_budget_gb={budget_gb:.4g} / 2" in message, message
    assert "each of the 2 DataLoader worker(s)" in message and "or use fewer workers" in message
    advice_gb = float(message.split("raise byte_budget_gb to at least ")[1].split()[0])
    # twice the worker's largest episode, which is over half the budget: (1.5, 2] x largest
    assert 1.5 * largest < advice_gb * GIB <= 2.001 * largest
    assert "\n" not in message


def test_rank_from_environment(dataset_root, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    dataset = StreamingDataset(dataset_root, repeat=True)
    assert (dataset.rank, dataset.world_size) == (1, 3)


# --- resume ---------------------------------------------------------------------------------

RESUME_LENGTHS = (5, 8, 3, 7, 6, 4, 9)
BATCH = 4


@pytest.fixture(scope="module")
def resume_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("resume")
    write_demo_dataset(root, episode_lengths=RESUME_LENGTHS, cameras=("observation.images.front",),
                       size=(32, 24), episodes_per_video_file=4, episodes_per_data_file=7)
    return root


def _batches(dataset, num_workers: int, limit: int | None) -> list[list[tuple[int, int]]]:
    loader = DataLoader(dataset, batch_size=BATCH, num_workers=num_workers)
    out = []
    for batch in loader:
        out.append(batch)
        if limit is not None and len(out) == limit:
            break
    return _labels(out)


@pytest.mark.filterwarnings("ignore:This DataLoader will create 3 worker processes")
@pytest.mark.parametrize("num_workers", [1, 3])
@pytest.mark.parametrize("strategy", ["pool", "round_robin"])
@pytest.mark.parametrize("repeat", [False, True])
def test_resume_yields_the_uninterrupted_remainder(resume_root, num_workers, strategy, repeat):
    options = {"seed": 7, "sampling_strategy": strategy, "episode_pool_size": 2,
               "repeat": repeat, "return_uint8": True, "batch_size": BATCH}
    total = sum(RESUME_LENGTHS)
    # With repeat, cover a bit more than one epoch so batches straddle the epoch boundary.
    horizon = (total * 3 // 2) // BATCH if repeat else None
    full = _batches(StreamingDataset(resume_root, **options), num_workers, horizon)
    if not repeat:
        assert sorted(x for b in full for x in b) == sorted(
            (e, f) for e, n in enumerate(RESUME_LENGTHS) for f in range(n))
    for stop in (1, len(full) // 2, len(full) - 1):
        first = StreamingDataset(resume_root, **options)
        assert _batches(first, num_workers, stop) == full[:stop]
        state = first.state_dict(stop * BATCH, batch_size=BATCH, num_workers=num_workers)
        resumed = StreamingDataset(resume_root, **options)
        resumed.load_state_dict(state)
        rest = _batches(resumed, num_workers, None if horizon is None else horizon - stop)
        assert rest == full[stop:], (stop, state)


def test_resume_refuses_another_order_and_a_loader_it_was_not_loaded_for(resume_root):
    dataset = StreamingDataset(resume_root, seed=7)
    state = dataset.state_dict(8, batch_size=BATCH, num_workers=2)
    with pytest.raises(TopologyChanged, match="seed 7 -> 8"):
        StreamingDataset(resume_root, seed=8, batch_size=BATCH).load_state_dict(state)
    with pytest.raises(UsageError, match="batch_size=B"):  # the workers' offsets need it
        StreamingDataset(resume_root, seed=7).load_state_dict(state)
    other = StreamingDataset(resume_root, seed=7, batch_size=BATCH)
    other.load_state_dict(state)
    with pytest.raises(TopologyChanged, match="pass num_workers=1 to load_state_dict"):
        _batches(other, 0, None)
    # The pool's ramp changes the order too. A checkpoint without it was made with none (0).
    ramped = StreamingDataset(resume_root, seed=7, episode_pool_ramp=3)
    state = ramped.state_dict(8, batch_size=BATCH, num_workers=2)
    assert state["pool_ramp"] == 3
    with pytest.raises(TopologyChanged, match="pool_ramp 3 -> 8"):
        StreamingDataset(resume_root, seed=7, batch_size=BATCH).load_state_dict(state)
    del state["pool_ramp"]
    with pytest.raises(TopologyChanged, match="pool_ramp 0 -> 8"):
        StreamingDataset(resume_root, seed=7, batch_size=BATCH).load_state_dict(state)
    StreamingDataset(resume_root, seed=7, batch_size=BATCH, episode_pool_ramp=0).load_state_dict(
        state)


def test_a_dataset_without_a_seed_takes_the_checkpoints(resume_root):
    full = _batches(StreamingDataset(resume_root, seed=7, return_uint8=True), 0, None)
    first = StreamingDataset(resume_root, seed=7, batch_size=BATCH)
    state = first.state_dict(2 * BATCH, batch_size=BATCH, num_workers=1)
    resumed = StreamingDataset(resume_root, batch_size=BATCH, return_uint8=True)
    resumed.load_state_dict(state)
    assert resumed.seed == 7
    assert _batches(resumed, 0, None) == full[2:]


def _run(dataset, num_workers: int, batch: int, limit: int | None = None):
    loader = DataLoader(dataset, batch_size=batch, num_workers=num_workers)
    return _labels(islice(loader, limit))


@pytest.mark.filterwarnings("ignore:This DataLoader will create 3 worker processes")
@pytest.mark.parametrize("strategy", ["pool", "round_robin"])
def test_resume_with_other_workers_and_batch_size_delivers_the_rest_once(resume_root, strategy):
    """2 workers, batch 4 -> 3 workers, batch 3 -> (a checkpoint of the rest) 1 worker, batch
    5: across the three runs every frame of the epoch comes exactly once."""
    options = {"seed": 7, "sampling_strategy": strategy, "episode_pool_size": 2,
               "return_uint8": True}
    first = StreamingDataset(resume_root, batch_size=4, **options)
    before = _run(first, 2, 4, 3)
    state = first.state_dict(3 * 4, batch_size=4, num_workers=2)
    middle = StreamingDataset(resume_root, batch_size=3, **options)
    middle.load_state_dict(state, num_workers=3)
    rest = _run(middle, 3, 3)
    everything = Counter((e, f) for e, n in enumerate(RESUME_LENGTHS) for f in range(n))
    assert Counter(x for b in before + rest for x in b) == everything
    during = middle.state_dict(2 * 3, batch_size=3, num_workers=3)
    assert during["history"] == [[1, 2, 4, 12]] and during["samples"] == 6
    again = StreamingDataset(resume_root, batch_size=3, **options)  # the same topology
    again.load_state_dict(during)
    assert _run(again, 3, 3) == rest[2:]
    last = StreamingDataset(resume_root, batch_size=5, **options)  # another one
    last.load_state_dict(during, num_workers=1)
    final = _run(last, 0, 5)
    assert Counter(x for b in before + rest[:2] + final for x in b) == everything


@pytest.mark.filterwarnings("ignore:This DataLoader will create 3 worker processes")
def test_resume_with_other_workers_follows_the_planned_rest_with_repeat(resume_root):
    from test_elastic import rank_batches

    from refstream.resume import Course

    options = {"seed": 3, "episode_pool_size": 2, "repeat": True, "return_uint8": True}
    first = StreamingDataset(resume_root, batch_size=4, **options)
    _run(first, 2, 4, 9)
    resumed = StreamingDataset(resume_root, batch_size=2, **options)
    resumed.load_state_dict(first.state_dict(9 * 4, batch_size=4, num_workers=2), num_workers=3)
    assert len(resumed._delivered.counts) >= 1  # the rest of an epoch in progress
    course = Course(resumed._setup(2, 3), resumed.episodes, resumed._frames, resumed._delivered)
    planned = rank_batches(course, None, 0, 0, 40)
    assert _run(resumed, 3, 2, 40) == [[(e, f) for _, e, f in b] for b in planned]


@pytest.mark.filterwarnings("ignore:'pin_memory' argument is set as true")
def test_an_elastic_checkpoint_loaded_after_persistent_workers_started_is_refused(resume_root):
    first = StreamingDataset(resume_root, seed=7, batch_size=BATCH)
    state = first.state_dict(BATCH, batch_size=BATCH, num_workers=1)
    dataset = StreamingDataset(resume_root, seed=7, batch_size=BATCH, return_uint8=True)
    loader = DataLoader(dataset, batch_size=BATCH, num_workers=2, persistent_workers=True)
    assert len(list(loader)) > 0  # the workers start with no resume
    dataset.load_state_dict(state, num_workers=2)
    with pytest.raises(UsageError, match="persistent workers started"):
        list(loader)


@pytest.mark.filterwarnings("ignore:'pin_memory' argument is set as true")
def test_set_epoch_changes_order_and_reaches_persistent_workers(resume_root):
    dataset = StreamingDataset(resume_root, seed=7, return_uint8=True)
    loader = DataLoader(dataset, batch_size=BATCH, num_workers=2, persistent_workers=True,
                        pin_memory=True)
    epoch0 = _labels(list(loader))
    dataset.set_epoch(1)
    epoch1 = _labels(list(loader))
    dataset.set_epoch(0)
    again = _labels(list(loader))
    assert epoch0 == again != epoch1
    assert sorted(x for b in epoch1 for x in b) == sorted(x for b in epoch0 for x in b)


def test_stream_command_summary(dataset_root, capsys):
    import json

    from refstream.tools.cli import main

    windows = json.dumps({"action": [0.0, 1 / FPS]})
    assert main(["stream", str(dataset_root), "--episodes", "1,3", "--num-workers", "2",
                 "--batch-size", "4", "--epochs", "2", "--delta-timestamps", windows,
                 "--json", "--no-progress"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["episodes"] == 2 and summary["frames"] == LENGTHS[1] + LENGTHS[3]
    assert summary["samples"] == 2 * summary["frames"]
    # One episode per worker: each worker's last batch of an epoch is short.
    assert summary["batches"] == 2 * (-(-LENGTHS[1] // 4) + -(-LENGTHS[3] // 4))
    assert main(["stream", str(dataset_root), "--episodes", "99", "--no-progress"]) == 2


def test_hub_roots_are_pinned_to_the_commit_for_workers():
    from refstream.hub import pinned_root

    sha = "a" * 40
    assert pinned_root("hf://datasets/o/n", f"commit:{sha}") == f"hf://datasets/o/n@{sha}"
    assert pinned_root("hf://datasets/o/n@main/sub/dir", f"commit:{sha}") == (
        f"hf://datasets/o/n@{sha}/sub/dir")
    assert pinned_root("http://host/data", 'etag:"x"') == "http://host/data"


class _AccelerateLoader:
    """What accelerate's ``DataLoaderShard.__iter__`` does (accelerate/data_loader.py): call
    ``set_epoch(self.iteration)`` on the dataset, iterate the DataLoader, count the pass."""

    def __init__(self, loader: DataLoader) -> None:
        self.loader, self.iteration = loader, 0

    def __iter__(self):
        self.loader.dataset.set_epoch(self.iteration)
        yield from self.loader
        self.iteration += 1


def test_set_epoch_of_the_epoch_a_checkpoint_resumes_into_keeps_it(resume_root):
    options = {"seed": 7, "batch_size": BATCH, "return_uint8": True}
    fresh = StreamingDataset(resume_root, **options)
    epoch0 = _run(fresh, 2, BATCH)
    fresh.set_epoch(1)
    epoch1 = _run(fresh, 2, BATCH)
    state = StreamingDataset(resume_root, **options).state_dict(
        3 * BATCH, batch_size=BATCH, num_workers=2)
    resumed = StreamingDataset(resume_root, **options)
    resumed.load_state_dict(state)
    loader = _AccelerateLoader(DataLoader(resumed, batch_size=BATCH, num_workers=2))
    assert _labels(loader) == epoch0[3:]  # set_epoch(0) kept the checkpoint
    assert _labels(loader) == epoch1  # set_epoch(1) moved on
    resumed.load_state_dict(state)
    assert _run(resumed, 2, BATCH, 1) == epoch0[3:4]
    resumed.set_epoch(0)  # an iterator started since the load: epoch 0 from its beginning
    assert _run(resumed, 2, BATCH) == epoch0


def test_an_item_by_index_says_the_dataset_is_iterable(resume_root):
    dataset = StreamingDataset(resume_root)
    with pytest.raises(IterableOnly, match=r"iterable dataset, it has no item 3: iterate it"):
        dataset[3]
    with pytest.raises(TypeError):  # what Python code expects of an object without items
        dataset[0]


def _cycle(loader):
    """lerobot-train's ``cycle(loader)``: a new iterator whenever one ends."""
    while True:
        yield from loader


@pytest.mark.parametrize("num_workers, persistent", [(0, False), (2, False), (2, True)])
def test_a_loop_that_never_sets_the_epoch_moves_to_the_next_one(resume_root, num_workers,
                                                                  persistent):
    options = {"seed": 7, "batch_size": BATCH, "return_uint8": True}
    reference = StreamingDataset(resume_root, **options)
    epochs = []
    for epoch in range(3):
        reference.set_epoch(epoch)
        epochs.append(_run(reference, num_workers, BATCH))
    everything = sorted((e, f) for e, n in enumerate(RESUME_LENGTHS) for f in range(n))
    assert all(sorted(x for b in batches for x in b) == everything for batches in epochs)
    assert epochs[0] != epochs[1] != epochs[2] != epochs[0]
    flat = [b for batches in epochs for b in batches]

    def loop(dataset):
        return _cycle(DataLoader(dataset, batch_size=BATCH, num_workers=num_workers,
                                 persistent_workers=persistent))

    assert _labels(islice(loop(StreamingDataset(resume_root, **options)), len(flat))) == flat
    # A checkpoint in epoch 1, its samples counted from the start of training, resumes exactly.
    steps = len(epochs[0]) + 3
    first = StreamingDataset(resume_root, **options)
    assert _labels(islice(loop(first), steps)) == flat[:steps]
    state = first.state_dict(steps * BATCH, batch_size=BATCH, num_workers=num_workers)
    assert (state["epoch"], state["samples"]) == (1, 3 * BATCH)  # the epoch in progress
    resumed = StreamingDataset(resume_root, **options)
    resumed.load_state_dict(state)
    assert _labels(islice(loop(resumed), len(flat) - steps)) == flat[steps:]


def test_a_checkpoint_past_what_the_rank_can_have_yielded_is_refused(resume_root, tmp_path):
    write_demo_dataset(tmp_path, episode_lengths=(60,) * 5, cameras=())  # 300 frames
    dataset = StreamingDataset(tmp_path, seed=1, batch_size=4)
    with pytest.raises(UsageError, match=r"state_dict\(samples=100000\): this rank cannot have "
                       r"yielded that many .* since construction, set_epoch or load_state_dict"):
        dataset.state_dict(100000, batch_size=4, num_workers=2)
    whole = dataset.state_dict(300, batch_size=4, num_workers=2)  # the whole epoch: 75 batches
    assert (whole["epoch"], whole["samples"]) == (1, 0)
    for repeat in (False, True):  # a dataset without a batch size takes the checkpoint's
        with pytest.raises(UsageError, match="batch_size must be an integer >= 1, got 0"):
            StreamingDataset(tmp_path, repeat=repeat).state_dict(0, batch_size=0, num_workers=2)
    # An epoch loop that counts samples from the start of training.
    options = {"seed": 7, "batch_size": BATCH, "return_uint8": True}
    dataset = StreamingDataset(resume_root, **options)
    loader = DataLoader(dataset, batch_size=BATCH, num_workers=2)
    epochs, steps = [], 0
    for epoch in range(2):
        dataset.set_epoch(epoch)
        epochs.append(_labels(loader))
        steps += len(epochs[0]) if epoch == 0 else 3
    with pytest.raises(UsageError, match="samples counts what was consumed since construction"):
        dataset.state_dict(steps * BATCH, batch_size=BATCH, num_workers=2)
    # README's recipe: the samples of the epoch in progress, set_epoch on resume.
    state = dataset.state_dict(3 * BATCH, batch_size=BATCH, num_workers=2)
    resumed = StreamingDataset(resume_root, **options)
    resumed.load_state_dict(state)
    resumed.set_epoch(state["epoch"])
    assert _run(resumed, 2, BATCH) == epochs[1][3:]


@pytest.mark.parametrize("batched", [False, True])
def test_len_tqdm_and_list_of_the_readme_loaders(resume_root, batched):
    """README's two idioms with 2 workers: len(loader) is the batches that arrive, though each
    worker's last batch is short (15 batches of 3 from 42 frames, not 14)."""
    loader_batch = None if batched else 3
    options = {"seed": 0, "batch_size": 3, "batched": batched, "return_uint8": True}
    dataset = StreamingDataset(resume_root, num_workers=2, **options)
    loader = DataLoader(dataset, batch_size=loader_batch, num_workers=2)
    arrived = list(loader)
    assert len(arrived) == 15 > -(-sum(RESUME_LENGTHS) // 3)
    assert len(loader) == len(arrived) == len(dataset) // (1 if batched else 3)
    bar = tqdm(loader, file=io.StringIO())
    assert bar.total == sum(1 for _ in bar) == 15
    # Without the worker count, len() says what it needs, and tqdm and list go on without it.
    dataset = StreamingDataset(resume_root, **options)
    loader = DataLoader(dataset, batch_size=loader_batch, num_workers=2)
    with pytest.raises(IterableOnly, match="worker count"):
        len(loader)
    bar = tqdm(loader, file=io.StringIO())
    assert bar.total is None and len(list(bar)) == len(list(loader)) == 15


IDLE_SCRIPT = """
import sys
from torch.utils.data import DataLoader
from refstream import StreamingDataset
dataset = StreamingDataset(sys.argv[1], seed=3, batch_size=2)
print(sum(len(b["index"]) for b in DataLoader(dataset, batch_size=2, num_workers=5)))
"""


@pytest.mark.filterwarnings("ignore:This DataLoader will create [35] worker processes")
def test_workers_beyond_the_episodes_stay_idle(tmp_path):
    write_demo_dataset(tmp_path, episode_lengths=(7, 5, 9), cameras=())
    options = {"seed": 3, "batch_size": 2}
    three = _run(StreamingDataset(tmp_path, **options), 3, 2)
    # The count known at construction: one warning there, the batches of 3 workers.
    with pytest.warns(UserWarning, match=r"^5 DataLoader workers, but a rank has only 3 "
                      r"episodes: workers 3 to 4 stay idle \(num_workers=3 gives the same"):
        told = StreamingDataset(tmp_path, num_workers=5, **options)
    assert _run(told, 5, 2) == three and len(told) == 2 * len(three)
    state = told.state_dict(4 * 2, batch_size=2, num_workers=5)
    with pytest.warns(UserWarning, match="stay idle"):
        resumed = StreamingDataset(tmp_path, num_workers=5, **options)
    resumed.load_state_dict(state, num_workers=5)
    assert _run(resumed, 5, 2) == three[4:]
    # Known only to the workers: the first idle one warns, once, and the others go on.
    done = subprocess.run([sys.executable, "-c", IDLE_SCRIPT, str(tmp_path)], check=True,
                          capture_output=True, text=True)
    assert done.stdout.split() == ["21"]
    assert done.stderr.count("stay idle") == 1, done.stderr


def test_accelerates_own_loader_resumes_exactly(resume_root):
    """The test above with accelerate's DataLoaderShard, where accelerate is installed (the
    LeRobot environment)."""
    shard_loader = pytest.importorskip("accelerate.data_loader").DataLoaderShard
    options = {"seed": 7, "batch_size": BATCH, "return_uint8": True}
    loader = shard_loader(StreamingDataset(resume_root, **options), batch_size=BATCH,
                          num_workers=2)
    epoch0, epoch1 = _labels(loader), _labels(loader)
    resumed = StreamingDataset(resume_root, **options)
    resumed.load_state_dict(resumed.state_dict(3 * BATCH, batch_size=BATCH, num_workers=2))
    loader = shard_loader(resumed, batch_size=BATCH, num_workers=2)
    assert (_labels(loader), _labels(loader)) == (epoch0[3:], epoch1)
