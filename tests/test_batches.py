"""Ready batches (``batched=True`` with ``DataLoader(batch_size=None)``) against the plain idiom.

The oracle is the DataLoader itself: the same dataset without ``batched``, collated by
``DataLoader(dataset, batch_size=B)``. Every batch must be identical — same keys in the same
order, same dtypes, shapes and values, same order of batches — with one worker or several (the
DataLoader's round-robin, each worker's last batch short), across an epoch boundary with
``repeat``, after a resume mid-epoch, after a resume on another topology and on each rank of a
distributed epoch. The shared camera
buffers are checked on their own: one held by the consumer is never written again, one dropped
is reused.
"""

from __future__ import annotations

import gc
import json
import pickle
from itertools import islice
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import pytest
import torch
import torch.multiprocessing  # registers the reductions that pickle tensors as handles
from lerobot_layout import write_layout
from torch.multiprocessing import reductions
from torch.utils.data import DataLoader

from refstream import worker
from refstream.errors import UsageError
from refstream.stream import Batch, StreamingDataset
from refstream.tools.demo import write_demo_dataset
from refstream.worker import SharedBuffers

FPS = 30
LENGTHS = (5, 8, 3, 7, 6, 4, 9)  # 42 frames: batches of 4 leave short ones on every worker
BATCH = 4
WINDOWS = {
    "observation.images.front": [-2 / FPS, 0.0],  # a window; the wrist camera has none
    "observation.state": [-1 / FPS, 0.0],
    "action": [0.0, 1 / FPS, 2 / FPS],
}


pytestmark = pytest.mark.usefixtures("session_index_cache")


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("batches")
    write_demo_dataset(root, episode_lengths=LENGTHS,
                       size={"observation.images.front": (32, 24),
                             "observation.images.wrist": (48, 32)},
                       episodes_per_video_file=4, episodes_per_data_file=3)
    return root


def _plain(root, workers: int, limit: int | None = None, state=None, **options) -> list:
    dataset = StreamingDataset(root, batch_size=BATCH, **options)
    if state is not None:
        dataset.load_state_dict(state, num_workers=workers)
    return list(islice(DataLoader(dataset, batch_size=BATCH, num_workers=workers), limit))


def _ready(root, workers: int, limit: int | None = None, state=None, **options) -> list:
    dataset = StreamingDataset(root, batch_size=BATCH, batched=True, **options)
    if state is not None:
        dataset.load_state_dict(state, num_workers=workers)
    return list(islice(DataLoader(dataset, batch_size=None, num_workers=workers), limit))


def assert_same_batches(got: list, want: list) -> None:
    assert len(got) == len(want)
    for number, (batch, expected) in enumerate(zip(got, want, strict=True)):
        assert isinstance(batch, Batch), number
        assert list(batch) == list(expected), number
        for key, value in expected.items():
            if isinstance(value, torch.Tensor):
                assert batch[key].dtype == value.dtype, (number, key)
                assert batch[key].shape == value.shape, (number, key)
                assert torch.equal(batch[key], value), (number, key)
            else:
                assert batch[key] == value, (number, key)


@pytest.mark.filterwarnings("ignore:This DataLoader will create 3 worker processes")
@pytest.mark.parametrize("num_workers", [0, 1, 3])
@pytest.mark.parametrize("return_uint8", [False, True])
def test_ready_batches_are_the_dataloaders_batches(root, num_workers, return_uint8):
    options = {"seed": 5, "delta_timestamps": WINDOWS, "episode_pool_size": 2,
               "return_uint8": return_uint8}
    want = _plain(root, num_workers, **options)
    assert {len(b["index"]) for b in want} > {BATCH}  # short batches are part of the check
    assert_same_batches(_ready(root, num_workers, **options), want)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_dataset_without_cameras_streams_every_frame_once_both_ways(tmp_path, num_workers):
    # Episodes without video weigh nothing in the byte budget, through the same admission path.
    write_layout(tmp_path, list(LENGTHS), cameras=())
    options = {"seed": 2, "delta_timestamps": {"action": [0.0, 1 / FPS]}, "episode_pool_size": 2}
    want = _plain(tmp_path, num_workers, **options)
    assert sorted(int(i) for b in want for i in b["index"]) == list(range(sum(LENGTHS)))
    assert_same_batches(_ready(tmp_path, num_workers, **options), want)


def test_a_dataset_without_cameras_needs_no_timestamp_feature(tmp_path):
    # Timestamps place camera frames; without cameras a dataset need not declare one.
    write_layout(tmp_path, list(LENGTHS), cameras=())
    info_path = tmp_path / "meta" / "info.json"
    info = json.loads(info_path.read_text())
    del info["features"]["timestamp"]
    info_path.write_text(json.dumps(info))
    got = _plain(tmp_path, 0, seed=3)
    assert sorted(int(i) for b in got for i in b["index"]) == list(range(sum(LENGTHS)))
    assert all("timestamp" not in batch for batch in got)


def test_ready_batches_cross_the_epoch_boundary_like_the_dataloaders(root):
    options = {"seed": 2, "delta_timestamps": WINDOWS, "repeat": True, "episode_pool_size": 3,
               "decode_threads": 3}
    horizon = sum(LENGTHS) * 3 // 2 // BATCH  # past the end of epoch 0 on both workers
    want = _plain(root, 2, horizon, **options)
    assert_same_batches(_ready(root, 2, horizon, **options), want)
    one_thread = _ready(root, 2, horizon, **{**options, "decode_threads": 1})
    assert_same_batches(one_thread, want)


@pytest.mark.parametrize("repeat", [False, True])
def test_ready_batches_resume_mid_epoch_like_the_dataloaders(root, repeat):
    options = {"seed": 7, "episode_pool_size": 2, "return_uint8": True, "repeat": repeat,
               "delta_timestamps": WINDOWS}
    horizon = 12 if repeat else None
    full = _plain(root, 2, horizon, **options)
    first = StreamingDataset(root, batch_size=BATCH, batched=True, **options)
    before = list(islice(DataLoader(first, batch_size=None, num_workers=2), 3))
    assert_same_batches(before, full[:3])
    state = first.state_dict(3 * BATCH, batch_size=BATCH, num_workers=2)
    rest = _ready(root, 2, None if horizon is None else horizon - 3, state=state, **options)
    assert_same_batches(rest, full[3:])
    assert_same_batches(rest, _plain(root, 2, None if horizon is None else horizon - 3,
                                     state=state, **options))


@pytest.mark.filterwarnings("ignore:This DataLoader will create 3 worker processes")
def test_ready_batches_resume_on_another_topology_like_the_dataloaders(root):
    # A checkpoint of 2 ranks of 2 workers after 2 batches of 4 each, resumed on one rank of 3
    # workers with batches of 3: every old rank is replayed and the rest planned anew.
    options = {"seed": 8, "episode_pool_size": 2, "return_uint8": True,
               "delta_timestamps": WINDOWS}
    old = StreamingDataset(root, batch_size=BATCH, rank=0, world_size=2, **options)
    state = old.state_dict(2 * BATCH, batch_size=BATCH, num_workers=2)

    def resumed(batched: bool) -> list:
        dataset = StreamingDataset(root, batch_size=3, batched=batched, num_workers=3,
                                   **options)
        dataset.load_state_dict(state, num_workers=3)
        return list(DataLoader(dataset, batch_size=None if batched else 3, num_workers=3))

    want = resumed(False)
    assert sum(len(b["index"]) for b in want) == sum(LENGTHS) - 2 * 2 * BATCH
    assert_same_batches(resumed(True), want)


@pytest.mark.parametrize("rank", [0, 1, 2])
def test_ready_batches_of_each_rank_end_with_the_dataloaders(root, rank):
    options = {"seed": 3, "rank": rank, "world_size": 3, "return_uint8": True,
               "num_workers": 2}
    want = _plain(root, 2, **options)
    got = _ready(root, 2, **options)
    assert_same_batches(got, want)
    ready = StreamingDataset(root, batch_size=BATCH, batched=True, **options)
    assert len(ready) == len(got) == 4  # batches, every rank the same number (SPEC §9.5)
    samples = sum(len(b["index"]) for b in want)
    plain = StreamingDataset(root, batch_size=BATCH, **options)  # batches × BATCH: the loader's
    assert len(plain) == len(want) * BATCH and len(DataLoader(plain, batch_size=BATCH)) == 4
    if rank == 0:  # 16 frames would make 5 batches: the end rule cuts the last one
        assert samples < ready.rank_frames


def test_image_transforms_see_ready_batches_samples_in_order(root):
    def options():
        calls = []

        def transform(frames):
            calls.append(len(calls))
            return frames * 0 + len(calls)

        return {"seed": 4, "image_transforms": transform, "delta_timestamps": WINDOWS}

    assert_same_batches(_ready(root, 0, **options()), _plain(root, 0, **options()))


@pytest.mark.filterwarnings("ignore:This DataLoader will create 3 worker processes")
def test_len_of_ready_batches_is_the_batches_of_an_epoch(root):
    for workers in (1, 3):
        yielded = len(_ready(root, workers))
        for repeat in (False, True):  # an endless stream: the batches of each epoch's share
            dataset = StreamingDataset(root, batch_size=BATCH, batched=True, repeat=repeat,
                                       num_workers=workers)
            assert len(dataset) == len(DataLoader(dataset, batch_size=None)) == yielded


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_dataloader_batching_ready_batches_is_refused(root, num_workers):
    dataset = StreamingDataset(root, batch_size=BATCH, batched=True)
    loader = DataLoader(dataset, batch_size=BATCH, num_workers=num_workers)
    with pytest.raises(UsageError, match="batch_size=None"):
        next(iter(loader))
    with pytest.raises(UsageError, match="batch_size=B"):
        StreamingDataset(root, batched=True)
    with pytest.raises(UsageError, match="num_workers=N"):
        len(dataset)


def test_a_held_batch_keeps_its_memory_and_a_dropped_one_is_reused(root):
    options = {"seed": 6, "delta_timestamps": WINDOWS}
    camera = "observation.images.front"
    held = _ready(root, 0, **options)  # every batch kept: none may be written over
    assert_same_batches(held, _plain(root, 0, **options))
    assert len({b[camera].data_ptr() for b in held}) == len(held)
    dataset = StreamingDataset(root, batch_size=BATCH, batched=True, **options)
    addresses = []
    for batch in DataLoader(dataset, batch_size=None):
        addresses.append(batch[camera].data_ptr())
        del batch
    assert len(set(addresses)) <= 2 < len(addresses)  # dropped, then written again


@pytest.mark.parametrize("persistent", [False, True])
def test_the_training_process_maps_each_storage_a_worker_sends_once(root, monkeypatch,
                                                                     persistent):
    # A worker sends each of its shared storages again and again. Mapping one anew costs the
    # receiving process about as much CPU as reading the batch, so one sent again arrives mapped
    # already; a worker's storages are let go once it ended or made new ones (a new epoch with
    # persistent workers). The oracle: torch's own calls that map a storage from a descriptor.
    maps = []
    map_fd = torch.UntypedStorage._new_shared_fd_cpu
    monkeypatch.setattr(torch.UntypedStorage, "_new_shared_fd_cpu", classmethod(
        lambda cls, fd, size: maps.append(size) or map_fd(fd, size)))
    monkeypatch.setattr(worker, "_mapped", {})
    dataset = StreamingDataset(root, batch_size=BATCH, batched=True, seed=6,
                               delta_timestamps=WINDOWS)
    loader = DataLoader(dataset, batch_size=None, num_workers=1, persistent_workers=persistent)
    owners, addresses = [], set()
    for _ in range(2):
        for batch in loader:  # each batch held until the next arrives, as a training loop does
            owners.append(list(worker._mapped))
            addresses.add(batch["observation.images.front"].data_ptr())
    per_epoch = len(owners) // 2  # one owner at a time: the first epoch's, then the second's
    assert owners == [owners[0]] * per_epoch + [owners[-1]] * per_epoch
    assert len(owners[0]) == len(owners[-1]) == 1 and owners[0] != owners[-1]
    # At most 4 storages a worker cycles through (2 batches fetched ahead, one held, one made).
    assert len(addresses) <= len(maps) <= 2 * 4 < len(owners)
    del batch  # moving on from the last batch: an ended worker's storages go with it
    gc.collect()
    assert list(worker._mapped) == (owners[-1] if persistent else [])


def test_an_in_use_flag_clears_when_the_receiving_process_drops_the_last_view():
    buffers = SharedBuffers()
    shapes = {"a": (2, 3), "b": (1, 2)}
    tensors, storage = buffers.take(shapes, torch.float32)
    tensors["a"].copy_(torch.arange(6.0).reshape(2, 3))
    tensors["b"].copy_(torch.tensor([[7.0, 8.0]]))
    batch = Batch({"a": tensors["a"], "i": torch.arange(2), "b": tensors["b"][0]}, storage)
    # What the DataLoader's result queue does: pickle in the worker, unpickle in the trainer.
    received = pickle.loads(ForkingPickler.dumps(batch))
    assert list(received) == ["a", "i", "b"]
    assert torch.equal(received["a"], torch.arange(6.0).reshape(2, 3))
    assert torch.equal(received["b"], torch.tensor([7.0, 8.0]))
    views = [received["a"][1:], received["b"][1:]]
    del received
    for _ in range(2):  # each view alone keeps the storage in use
        gc.collect()
        other, _ = buffers.take(shapes, torch.float32)
        assert other["a"].data_ptr() != tensors["a"].data_ptr()
        views.pop()
    gc.collect()
    again, _ = buffers.take(shapes, torch.float32)
    assert again["a"].data_ptr() == tensors["a"].data_ptr()


def test_small_values_cross_inside_the_pickle_and_camera_buffers_as_one_shared_storage(
        monkeypatch):
    buffers = SharedBuffers()
    tensors, storage = buffers.take({"a": (2, 1 << 18), "b": (2, 1 << 18)}, torch.float32)
    index = torch.arange(BATCH)
    batch = Batch({"index": index, **tensors}, storage)
    pickled = ForkingPickler.dumps(batch)  # as the DataLoader's queue does
    handles = []  # storages received through a file descriptor (a connection each)
    rebuild = reductions.rebuild_storage_fd
    monkeypatch.setattr(reductions, "rebuild_storage_fd",
                        lambda *args: handles.append(args) or rebuild(*args))
    received = pickle.loads(pickled)
    assert len(handles) == 1  # both cameras'
    tensors["a"][0, 0], tensors["b"][1, 5], index[0] = 7.0, 3.0, 99  # written after crossing
    assert received["a"][0, 0] == 7.0 and received["b"][1, 5] == 3.0  # the same memory
    assert received["index"].tolist() == list(range(BATCH))  # a copy of small values
