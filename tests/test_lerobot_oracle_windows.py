"""meta.py + windows.py rebuild LeRobot 0.6.1's own map-style items, for every index.

``spec/fixtures/lerobot/lr_av1.items.npz`` holds what ``LeRobotDataset(...)[i]`` returned for
every ``i`` of the dataset LeRobot wrote in ``spec/fixtures/lerobot/lr_av1`` (README there). Here
the non-image values are rebuilt from the data Parquet with refstream's metadata and window rows
and must equal LeRobot's exactly, dtypes included; for the cameras, the global frame index each
window position shows (``window_source``) must equal the episode's first index plus the clamped
row.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from refstream.meta import load_meta
from refstream.source import LocalSource
from refstream.windows import make_windows, window_rows

LEROBOT = Path(__file__).resolve().parent.parent / "spec" / "fixtures" / "lerobot"
TOLERANCE_S = 1e-4  # LeRobot's default, used when the items were made


@pytest.fixture(scope="module")
def oracle():
    with np.load(LEROBOT / "lr_av1.items.npz") as items:
        arrays = {name: items[name] for name in items.files}
    keys = json.loads(bytes(arrays.pop("keys.json")))
    tasks = json.loads(bytes(arrays.pop("tasks.json")))
    return keys, tasks, arrays


def episode_columns(meta, episode: int) -> dict[str, np.ndarray]:
    """Every Parquet feature of one episode, rows in frame order, as numpy arrays."""
    table = pq.read_table(LEROBOT / "lr_av1" / meta.data_relpath(episode))
    rows = table.filter(pc.equal(table["episode_index"], episode))
    assert rows.num_rows == meta.frames(episode)
    columns = {}
    for key in meta.parquet_keys:
        column = rows[key].combine_chunks()
        shape = meta.features[key]["shape"]
        if shape == (1,):
            columns[key] = column.to_numpy()
        else:
            columns[key] = column.flatten().to_numpy().reshape(len(column), *shape)
    return columns


def rebuild(meta, delta_timestamps: dict) -> dict[str, np.ndarray]:
    """Items for every global index in order: Parquet keys, *_is_pad, and window sources."""
    windows = make_windows(delta_timestamps, meta.fps, TOLERANCE_S, feature_keys=meta.features)
    items: dict[str, list] = {}
    for episode in meta.episode_index.tolist():
        columns = episode_columns(meta, episode)
        length = meta.frames(episode)
        first = int(meta.from_index[meta.row(episode)])
        for frame in range(length):
            for key in meta.parquet_keys:
                value = columns[key][frame]
                if key in windows:
                    rows, _ = window_rows(windows[key], frame, length)
                    value = columns[key][rows]
                items.setdefault(key, []).append(value)
            for key, offsets in windows.items():
                rows, is_pad = window_rows(offsets, frame, length)
                items.setdefault(f"{key}_is_pad", []).append(is_pad)
                if key in meta.camera_keys:
                    items.setdefault(f"window_source/{key}", []).append(first + rows)
    return {key: np.stack(values) for key, values in items.items()}


def test_every_non_image_value_equals_lerobots_item(oracle):
    keys, _, arrays = oracle
    meta = load_meta(LocalSource(LEROBOT / "lr_av1"))
    rebuilt = rebuild(meta, keys["DT"])
    image_keys = set(meta.camera_keys)
    compared = [key for key in keys["keys"] if key not in image_keys]
    assert len(compared) == 11
    for key in compared:
        dtype, shape = keys["keys"][key]
        assert rebuilt[key].dtype == np.dtype(dtype), key
        assert rebuilt[key].shape == (meta.total_frames, *shape), key
        assert arrays[key].dtype == rebuilt[key].dtype, key
        np.testing.assert_array_equal(rebuilt[key], arrays[key], err_msg=key)


def test_every_camera_window_shows_the_frames_lerobot_showed(oracle):
    keys, _, arrays = oracle
    meta = load_meta(LocalSource(LEROBOT / "lr_av1"))
    rebuilt = rebuild(meta, keys["DT"])
    for camera in meta.camera_keys:
        source = f"window_source/{camera}"
        assert rebuilt[source].dtype == arrays[source].dtype == np.int64
        np.testing.assert_array_equal(rebuilt[source], arrays[source], err_msg=camera)


def test_task_strings_follow_task_index(oracle):
    _, tasks, arrays = oracle
    meta = load_meta(LocalSource(LEROBOT / "lr_av1"))
    assert [meta.tasks[i] for i in arrays["task_index"].tolist()] == tasks


def test_the_oracle_distinguishes_windows(oracle):
    # The comparison is sensitive: a window one frame off changes LeRobot's values.
    keys, _, arrays = oracle
    meta = load_meta(LocalSource(LEROBOT / "lr_av1"))
    shifted = dict(keys["DT"], action=[d + 1 / 30 for d in keys["DT"]["action"]])
    assert not np.array_equal(rebuild(meta, shifted)["action"], arrays["action"])
