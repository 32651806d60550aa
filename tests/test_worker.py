"""One worker's stream (``refstream.worker.WorkerStream``) on its own, driven by its planners.

Its configuration is the one ``StreamingDataset`` makes, sent through pickle as to a DataLoader
worker. Oracles: a brute-force list of every (episode, frame) of the share, the same planner's
anchors played on their own, the frame labels drawn in the demo videos, and the samples the
dataset itself yields.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pickle
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from refstream.planner import Planner
from refstream.shard import WorkerLimits, split_limits
from refstream.stream import StreamingDataset
from refstream.tools.demo import read_frame_label, write_demo_dataset
from refstream.worker import WorkerConfig, WorkerStream

FPS = 30
LENGTHS = (5, 8, 3, 7, 6, 4, 9)
CAMERAS = ("observation.images.front", "observation.images.wrist")
WINDOWS = {CAMERAS[0]: [-2 / FPS, 0.0], "action": [0.0, 1 / FPS]}
SHARE = [0, 2, 3, 5, 6]


pytestmark = pytest.mark.usefixtures("session_index_cache")


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("worker")
    write_demo_dataset(root, episode_lengths=LENGTHS, cameras=CAMERAS, size=(32, 24),
                       episodes_per_video_file=3, episodes_per_data_file=2)
    return root


def _config(root, **changes) -> WorkerConfig:
    dataset = StreamingDataset(root, delta_timestamps=WINDOWS, return_uint8=True, seed=3)
    config = pickle.loads(pickle.dumps(dataset.config))  # as a DataLoader worker receives it
    return dataclasses.replace(config, **changes)


def _planner(byte_sizes: dict[int, int], budget: int, epoch: int = 0, pool_ramp: int = 0):
    return Planner(SHARE, [LENGTHS[e] for e in SHARE], seed=3, epoch=epoch, rank=0, worker=1,
                   pool_size=2, pool_ramp=pool_ramp, byte_sizes=[byte_sizes[e] for e in SHARE],
                   byte_budget=budget)


def _limits(config: WorkerConfig) -> WorkerLimits:
    return split_limits(2, pool_size=config.pool_size, byte_budget=config.byte_budget,
                        decoder_cache=config.decoder_cache, cameras=len(CAMERAS))


def _play(config: WorkerConfig, runs: list[tuple[int, int, int | None]]) -> tuple[list, list]:
    """The worker's samples over ``runs`` of (epoch, offset, stop), and the anchors the same
    planners give on their own."""
    limits = _limits(config)
    with contextlib.closing(WorkerStream(config, SHARE, limits)) as stream:
        sizes, budget = stream.byte_sizes, limits.byte_budget
        plans = [(_planner(sizes, budget, epoch), offset, stop)
                 for epoch, offset, stop in runs]
        samples = list(stream.stream(iter(plans), in_worker=False))
    expected = []
    for epoch, offset, stop in runs:
        anchors = list(_planner(sizes, budget, epoch))
        expected += anchors[offset:stop]
    return samples, expected


def _anchor(sample: dict) -> tuple[int, int]:
    return int(sample["episode_index"]), int(sample["frame_index"])


@pytest.mark.parametrize("group", [1, 3, 8])
def test_a_worker_yields_each_anchor_of_its_share_once_in_its_planners_order(root, group):
    config = _config(root, group=group)
    samples, expected = _play(config, [(0, 0, None)])
    every = sorted((e, f) for e in SHARE for f in range(LENGTHS[e]))  # brute force
    assert sorted(map(_anchor, samples)) == every
    assert [_anchor(s) for s in samples] == expected
    for sample in samples:
        episode, frame = _anchor(sample)
        wanted = np.clip(frame + np.array([-2, 0]), 0, LENGTHS[episode] - 1)
        assert [read_frame_label(f.numpy()) for f in sample[CAMERAS[0]]] == [
            (episode, int(f)) for f in wanted]
        assert read_frame_label(sample[CAMERAS[1]].numpy()) == (episode, frame)
        assert sample[f"{CAMERAS[0]}_is_pad"].tolist() == [frame < 2, False]


def test_a_worker_plays_each_run_from_its_offset_to_its_stop(root):
    # As StreamingDataset runs it: epochs in turn (repeat), the first from a resume offset; or
    # one epoch up to the stop that ends a finite distributed epoch.
    total = sum(LENGTHS[e] for e in SHARE)
    for runs, count in [([(0, 5, None), (1, 0, None)], 2 * total - 5), ([(2, 9, 20)], 11)]:
        samples, expected = _play(_config(root, group=4), runs)
        assert [_anchor(s) for s in samples] == expected
        assert len(expected) == count


def test_a_workers_samples_and_batches_equal_the_datasets(root):
    dataset = StreamingDataset(root, delta_timestamps=WINDOWS, return_uint8=True, seed=3)
    items = {_anchor(item): item for item in dataset}
    samples, _ = _play(_config(root), [(0, 0, None)])
    assert len(samples) == sum(LENGTHS[e] for e in SHARE)
    for sample in samples:
        item = items[_anchor(sample)]
        assert list(sample) == list(item)
        for key, value in item.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(sample[key], value), key
            else:
                assert sample[key] == value, key
    batches, _ = _play(_config(root, group=4, batched=True), [(0, 0, None)])
    assert [len(b["index"]) for b in batches] == [4] * 7
    for at, batch in enumerate(batches):
        for key in batch:
            stacked = samples[4 * at:4 * at + 4]
            if isinstance(batch[key], torch.Tensor):
                assert torch.equal(batch[key], torch.stack([s[key] for s in stacked])), key
            else:
                assert batch[key] == [s[key] for s in stacked], key


def test_the_kept_frame_demand_counts_only_the_anchors_still_to_come(root):
    # After a resume offset, the anchors the planner emitted before it never come: the frames
    # they request must not be counted (they would be kept until the episode drains).
    config = _config(root)
    with contextlib.closing(WorkerStream(config, SHARE, _limits(config))) as stream:
        budget = _limits(config).byte_budget
        planner = _planner(stream.byte_sizes, budget)
        planner.skip(6)
        episode = next(e for e in planner.resident if planner.emitted().get(e))
        rest = list(_planner(stream.byte_sizes, budget))[6:]  # every anchor, then the rest
        to_come = [f for e, f in rest if e == episode]
        assert stream.budget.try_reserve(episode, stream.byte_sizes[episode])
        stream._start_fetch(episode, planner)
        _, videos = stream.payloads[episode].result()
    for camera, window in ((CAMERAS[0], [-2, 0]), (CAMERAS[1], [0])):
        rows = np.clip(np.add.outer(to_come, window), 0, LENGTHS[episode] - 1).ravel()
        served = videos[camera].serving_pts[rows]
        assert videos[camera].demand == dict(Counter(served.tolist()))


@pytest.mark.parametrize(("cpus", "workers", "configured", "threads"), [
    (2, None, None, 2), (2, 1, None, 2), (2, 2, None, 1), (2, 4, None, 1), (1, None, None, 1),
    (8, 4, None, 2), (16, 2, None, 2), (2, 2, 3, 3), (16, 1, 1, 1)])
def test_a_worker_decodes_on_its_share_of_the_cpus_unless_told(root, monkeypatch, cpus, workers,
                                                               configured, threads):
    """Without decode_threads, the CPUs this process may use shared among the DataLoader's
    workers (none: the training process alone decodes), 1 or 2 threads each."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cpus)), raising=False)
    config = _config(root, decode_threads=configured)
    given = {} if workers is None else {"workers": workers}  # none: the training process
    with contextlib.closing(WorkerStream(config, SHARE, _limits(config), **given)) as stream:
        assert len(stream.decoders) == threads
        samples = list(stream.stream(iter([(_planner(stream.byte_sizes,
                                                     _limits(config).byte_budget), 0, None)]),
                                     in_worker=False))
    assert len(samples) == sum(LENGTHS[e] for e in SHARE)


@pytest.mark.parametrize("pool_ramp", [0, 2])
@pytest.mark.parametrize("room", [1.0, 1.5, 2.5])
def test_a_prefetch_never_takes_the_room_of_an_admitted_episode(root, room, pool_ramp):
    # The planner admits an episode when another drains, and the worker reserves it at the next
    # anchor; a prefetch in between must leave it its room, else that admission evicts the
    # prefetched episode, whose spans are then fetched twice. Each (episode, camera) span is
    # read once when the budget holds the pool and `room` more of the largest episode.
    config = _config(root, group=1, prefetch_episodes=4)
    with contextlib.closing(WorkerStream(config, SHARE, _limits(config))) as stream:
        sizes = stream.byte_sizes
    largest = sorted(sizes[e] for e in SHARE)[-2:]
    budget = sum(largest) + int(room * largest[-1])
    reads = Counter()
    limits = dataclasses.replace(_limits(config), byte_budget=budget)
    with contextlib.closing(WorkerStream(config, SHARE, limits)) as stream:
        read_range = stream.source.read_range

        def counted(relpath, offset, length):
            reads[relpath, offset, length] += relpath.endswith(".mp4")
            return read_range(relpath, offset, length)

        stream.source.read_range = counted
        plans = [(_planner(sizes, budget, pool_ramp=pool_ramp), 0, None)]
        samples = list(stream.stream(iter(plans), in_worker=False))
    assert [_anchor(s) for s in samples] == list(_planner(sizes, budget, pool_ramp=pool_ramp))
    spans = {key: count for key, count in reads.items() if count}
    assert len(spans) == len(SHARE) * len(CAMERAS)  # every span was read
    assert set(spans.values()) == {1}, spans
