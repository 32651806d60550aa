"""refstream's samples equal LeRobot 0.6.1's own map-style items on a dataset LeRobot wrote.

``lr_av1`` was recorded by LeRobot's recorder (AV1, g=2, two cameras, 5 episodes) and
``lr_av1.items.npz`` holds what ``LeRobotDataset(..., video_backend="pyav")[i]`` returned for
every index with the windows in its ``keys.json`` (see the oracle's README). Every sample must
match key for key (in LeRobot's order), dtype for dtype, shape for shape and value for value —
camera frames bit for bit — whether it comes alone or as a row of a ready batch (``batched=True``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from refstream.stream import StreamingDataset

PROJECT_FIXTURE = Path(__file__).parents[1] / "spec/fixtures/lerobot"
SHARED_ORACLE = Path("/work/shared/lerobot-oracle")


@pytest.fixture(scope="module")
def oracle(tmp_path_factory) -> tuple[Path, dict]:
    """The dataset (copied so nothing writes next to the original) and the items."""
    base = PROJECT_FIXTURE if (PROJECT_FIXTURE / "lr_av1.items.npz").exists() else SHARED_ORACLE
    root = tmp_path_factory.mktemp("oracle") / "lr_av1"
    shutil.copytree(base / "lr_av1", root)
    with np.load(base / "lr_av1.items.npz") as npz:
        items = {name: npz[name] for name in npz.files}
    return root, items


pytestmark = pytest.mark.usefixtures("session_index_cache")


def _expected(items: dict, keys: dict, tasks: list[str], index: int) -> dict:
    out = {}
    for key, (dtype, shape) in keys.items():
        if f"frames/{key}" in items:
            frames = items[f"frames/{key}"][items[f"window_source/{key}"][index]]
            value = frames.astype(np.float32) / np.float32(255)
        else:
            value = items[key][index]
        assert value.dtype == np.dtype(dtype) and list(value.shape) == shape, key
        out[key] = value
    out["task"] = tasks[index]
    return out


def _rows(batch: dict) -> list[dict]:
    """The samples of a ready batch: row ``i`` of every key."""
    return [{key: value[i] for key, value in batch.items()} for i in range(len(batch["index"]))]


@pytest.mark.parametrize("batched", [False, True])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_every_sample_equals_lerobots_item(oracle, num_workers, batched):
    root, items = oracle
    spec = json.loads(bytes(items["keys.json"]))
    tasks = json.loads(bytes(items["tasks.json"]))
    # Batches of 7: every worker's last batch of its share is short. (A batched dataset's
    # len(), which list() asks for, needs the worker count.)
    dataset = StreamingDataset(root, delta_timestamps=spec["DT"], seed=0, episode_pool_size=2,
                               batch_size=7 if batched else None, batched=batched,
                               num_workers=num_workers)
    samples = list(DataLoader(dataset, batch_size=None, num_workers=num_workers))
    if batched:
        samples = [row for batch in samples for row in _rows(batch)]
    assert sorted(int(s["index"]) for s in samples) == list(range(len(tasks)))
    for sample in samples:
        index = int(sample["index"])
        expected = _expected(items, spec["keys"], tasks, index)
        assert list(sample) == list(expected), index  # LeRobot's keys, in LeRobot's order
        for key, value in expected.items():
            if key == "task":
                assert sample[key] == value
                continue
            got = sample[key]
            assert isinstance(got, torch.Tensor), key
            assert got.dtype == torch.from_numpy(np.asarray(value)).dtype, (index, key)
            assert tuple(got.shape) == value.shape, (index, key)
            assert np.array_equal(got.numpy(), value), (index, key)
