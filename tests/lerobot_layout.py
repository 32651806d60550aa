"""Write a minimal, valid LeRobot v3.0 layout (metadata + data Parquet, no videos) for tests.

Usage::

    from tests.lerobot_layout import write_layout      # or `from lerobot_layout import …`
    layout = write_layout(tmp_path, [30, 45, 60], cameras=["observation.images.front"])
    meta = load_meta(LocalSource(layout.root))

What is written under ``root`` (the layout LeRobot's recorder produces, with the same column
names and Parquet types):

* ``meta/info.json`` — ``codebase_version "v3.0"``, ``fps``, ``features`` (each camera as a
  ``video`` feature of ``camera_shape``, ``observation.state`` and ``action`` float32
  ``[state_dim]``, and the five default features), totals, ``chunks_size``, the default
  ``data_path`` / ``video_path`` templates. ``info_overrides`` replaces or adds top-level keys
  (a value of ``None`` is written as JSON ``null``; :data:`DELETE` removes the key).
* ``meta/episodes/chunk-CCC/file-FFF.parquet`` — ``episodes_per_meta_file`` rows per file, files
  numbered with LeRobot's rollover (``chunks_size`` files per chunk). Columns: ``episode_index``,
  ``tasks`` (list of strings), ``length``, ``data/chunk_index``, ``data/file_index``,
  ``dataset_from_index``, ``dataset_to_index``, per camera ``videos/K/chunk_index``,
  ``videos/K/file_index``, ``videos/K/from_timestamp``, ``videos/K/to_timestamp``, a few
  ``stats/<feature>/<stat>`` columns, ``meta/episodes/chunk_index`` and
  ``meta/episodes/file_index``.
  ``episode_overrides`` replaces whole columns (one value per episode) before writing.
* ``meta/tasks.parquet`` — columns ``task_index`` (int64) and ``task`` (string), as pandas writes
  a frame indexed by the task string.
* ``data/chunk-CCC/file-FFF.parquet`` — ``episodes_per_data_file`` episodes per file, one row
  group per episode, columns ``observation.state`` (float32[state_dim], ``[e, f, 0, …]``),
  ``action`` (float32[state_dim], all ``e + f/1000``), ``timestamp`` (float32 ``f/fps``),
  ``frame_index``, ``episode_index``, ``index``, ``task_index`` (int64). ``write_data=False``
  skips these files (metadata-only layouts, e.g. DROID-sized episode tables for planning tests).

Episode ``e`` gets task ``e % len(tasks)``. Videos are not written (the MP4 tests make their own);
their placement is recorded as if ``episodes_per_video_file`` episodes were concatenated per
file: ``from_timestamp`` = frames of the earlier episodes in that file / fps, ``to_timestamp`` =
``from_timestamp + length / fps``. :func:`corrupt_columns` overwrites the bytes of chosen columns
so a test can prove they are never read.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

DATA_PATH = "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
VIDEO_PATH = "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"
EPISODES_PATH = "meta/episodes/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
DELETE = object()  # an info_overrides value that removes the key from info.json


@dataclass(frozen=True)
class Layout:
    """What :func:`write_layout` wrote; per-episode lists are in episode order."""

    root: Path
    fps: int
    lengths: list[int]
    cameras: list[str]
    tasks: list[str]
    from_index: list[int]
    to_index: list[int]
    data_files: list[tuple[int, int]]  # (chunk, file) of each episode's data Parquet
    video_files: list[tuple[int, int]]  # (chunk, file) of each episode's MP4, every camera
    video_from_s: list[float]
    video_to_s: list[float]
    meta_files: list[str]  # relpaths of the episodes Parquet files written


def file_indices(count: int, per_file: int, chunks_size: int) -> list[tuple[int, int]]:
    """(chunk, file) of ``count`` consecutive items, ``per_file`` to a file, LeRobot rollover."""
    pairs, chunk, file = [], 0, 0
    for i in range(count):
        if i and i % per_file == 0:
            chunk, file = (chunk + 1, 0) if file == chunks_size - 1 else (chunk, file + 1)
        pairs.append((chunk, file))
    return pairs


def write_layout(
    root: Path,
    lengths: Sequence[int],
    *,
    fps: int = 30,
    cameras: Sequence[str] = ("observation.images.front",),
    camera_shape: tuple[int, int, int] = (48, 64, 3),
    tasks: Sequence[str] = ("pick the cube", "place the cube"),
    state_dim: int = 6,
    episodes_per_data_file: int | None = None,
    episodes_per_video_file: int | None = None,
    episodes_per_meta_file: int | None = None,
    chunks_size: int = 1000,
    info_overrides: dict | None = None,
    episode_overrides: dict[str, list] | None = None,
    write_data: bool = True,
) -> Layout:
    """Write the layout described in the module docstring and return what was written."""
    root = Path(root)
    count = len(lengths)
    everything = max(count, 1)
    ends = np.cumsum(lengths, dtype=np.int64).tolist()
    starts = [0] + ends[:-1]
    data_files = file_indices(count, episodes_per_data_file or everything, chunks_size)
    video_files = file_indices(count, episodes_per_video_file or everything, chunks_size)
    video_from, video_to, frames_before = [], [], 0
    for e in range(count):
        if e and video_files[e] != video_files[e - 1]:
            frames_before = 0
        video_from.append(frames_before / fps)
        video_to.append(frames_before / fps + lengths[e] / fps)
        frames_before += lengths[e]
    layout = Layout(
        root=root,
        fps=fps,
        lengths=list(lengths),
        cameras=list(cameras),
        tasks=list(tasks),
        from_index=starts,
        to_index=ends,
        data_files=data_files,
        video_files=video_files,
        video_from_s=video_from,
        video_to_s=video_to,
        meta_files=[],
    )
    _write_info(layout, camera_shape, state_dim, chunks_size, info_overrides or {})
    _write_tasks(layout)
    if write_data:
        _write_data(layout, state_dim)
    meta_files = file_indices(count, episodes_per_meta_file or everything, chunks_size)
    layout.meta_files.extend(_write_episodes(layout, meta_files, episode_overrides or {}))
    return layout


def corrupt_columns(path: Path, prefix: str) -> int:
    """Overwrite with 0xFF every column chunk whose name starts with ``prefix``; return how many.

    The footer stays intact, so a reader that projects other columns still works, while any read
    of a corrupted column fails or returns garbage.
    """
    metadata = pq.ParquetFile(path).metadata
    data = bytearray(path.read_bytes())
    corrupted = 0
    for g in range(metadata.num_row_groups):
        group = metadata.row_group(g)
        for c in range(group.num_columns):
            column = group.column(c)
            if not column.path_in_schema.startswith(prefix):
                continue
            start = column.data_page_offset
            if column.has_dictionary_page and column.dictionary_page_offset:
                start = min(start, column.dictionary_page_offset)
            data[start : start + column.total_compressed_size] = b"\xff" * (
                column.total_compressed_size
            )
            corrupted += 1
    path.write_bytes(bytes(data))
    return corrupted


def _write_info(
    layout: Layout, camera_shape: tuple, state_dim: int, chunks_size: int, overrides: dict
) -> None:
    features = {}
    for key in layout.cameras:
        features[key] = {
            "dtype": "video",
            "shape": list(camera_shape),
            "names": ["height", "width", "channels"],
            "info": {"video.fps": layout.fps, "video.codec": "av1", "video.pix_fmt": "yuv420p"},
        }
    names = [f"j{i}" for i in range(state_dim)]
    features["observation.state"] = {"dtype": "float32", "shape": [state_dim], "names": names}
    features["action"] = {"dtype": "float32", "shape": [state_dim], "names": names}
    features["timestamp"] = {"dtype": "float32", "shape": [1], "names": None}
    for key in ("frame_index", "episode_index", "index", "task_index"):
        features[key] = {"dtype": "int64", "shape": [1], "names": None}
    info = {
        "codebase_version": "v3.0",
        "fps": layout.fps,
        "features": features,
        "total_episodes": len(layout.lengths),
        "total_frames": int(sum(layout.lengths)),
        "total_tasks": len(layout.tasks),
        "chunks_size": chunks_size,
        "data_files_size_in_mb": 100,
        "video_files_size_in_mb": 200,
        "data_path": DATA_PATH,
        "video_path": VIDEO_PATH if layout.cameras else None,
        "robot_type": "test_bot",
        "splits": {"train": f"0:{len(layout.lengths)}"},
    }
    for key, value in overrides.items():
        if value is DELETE:
            info.pop(key, None)
        else:
            info[key] = value
    path = layout.root / "meta" / "info.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(info, indent=4))


def _write_tasks(layout: Layout) -> None:
    table = pa.table(
        {
            "task_index": pa.array(range(len(layout.tasks)), pa.int64()),
            "task": pa.array(layout.tasks, pa.string()),
        }
    )
    pq.write_table(table, layout.root / "meta" / "tasks.parquet")


def _write_data(layout: Layout, state_dim: int) -> None:
    writers: dict[tuple[int, int], pq.ParquetWriter] = {}
    try:
        for e, length in enumerate(layout.lengths):
            table = _episode_rows(layout, e, length, state_dim)
            chunk, file = layout.data_files[e]
            if (chunk, file) not in writers:
                path = layout.root / DATA_PATH.format(chunk_index=chunk, file_index=file)
                path.parent.mkdir(parents=True, exist_ok=True)
                writers[(chunk, file)] = pq.ParquetWriter(path, table.schema)
            writers[(chunk, file)].write_table(table)  # one row group per episode, as recorded
    finally:
        for writer in writers.values():
            writer.close()


def _episode_rows(layout: Layout, e: int, length: int, state_dim: int) -> pa.Table:
    frame = np.arange(length, dtype=np.int64)
    state = np.zeros((length, state_dim), np.float32)
    state[:, 0] = e
    if state_dim > 1:
        state[:, 1] = frame
    action = np.repeat((e + frame / 1000).astype(np.float32)[:, None], state_dim, axis=1)
    vector = pa.list_(pa.float32(), state_dim)
    return pa.table(
        {
            "observation.state": pa.FixedSizeListArray.from_arrays(state.ravel(), state_dim)
            if length
            else pa.array([], vector),
            "action": pa.FixedSizeListArray.from_arrays(action.ravel(), state_dim)
            if length
            else pa.array([], vector),
            "timestamp": pa.array((frame / layout.fps).astype(np.float32)),
            "frame_index": pa.array(frame),
            "episode_index": pa.array(np.full(length, e, np.int64)),
            "index": pa.array(layout.from_index[e] + frame),
            "task_index": pa.array(np.full(length, e % len(layout.tasks), np.int64)),
        }
    )


def _write_episodes(
    layout: Layout, meta_files: list[tuple[int, int]], overrides: dict[str, list]
) -> list[str]:
    count = len(layout.lengths)
    columns: dict[str, list] = {
        "episode_index": list(range(count)),
        "tasks": [[layout.tasks[e % len(layout.tasks)]] for e in range(count)],
        "length": list(layout.lengths),
        "data/chunk_index": [c for c, _ in layout.data_files],
        "data/file_index": [f for _, f in layout.data_files],
        "dataset_from_index": list(layout.from_index),
        "dataset_to_index": list(layout.to_index),
    }
    for key in layout.cameras:
        columns[f"videos/{key}/chunk_index"] = [c for c, _ in layout.video_files]
        columns[f"videos/{key}/file_index"] = [f for _, f in layout.video_files]
        columns[f"videos/{key}/from_timestamp"] = list(layout.video_from_s)
        columns[f"videos/{key}/to_timestamp"] = list(layout.video_to_s)
    # Stats columns exist in every real episodes file; refstream must never read them.
    for feature in ("observation.state", "action"):
        for stat in ("min", "max", "mean"):
            columns[f"stats/{feature}/{stat}"] = [[float(e)] * 6 for e in range(count)]
        columns[f"stats/{feature}/count"] = [[n] for n in layout.lengths]
    columns["meta/episodes/chunk_index"] = [c for c, _ in meta_files]
    columns["meta/episodes/file_index"] = [f for _, f in meta_files]
    columns.update(overrides)
    written = []
    for pair in sorted(set(meta_files)):
        rows = [e for e in range(count) if meta_files[e] == pair]
        relpath = EPISODES_PATH.format(chunk_index=pair[0], file_index=pair[1])
        path = layout.root / relpath
        path.parent.mkdir(parents=True, exist_ok=True)
        table = pa.table(
            {
                name: _column(name, [values[e] for e in rows], infer=name in overrides)
                for name, values in columns.items()
            }
        )
        pq.write_table(table, path)
        written.append(relpath)
    return written


def _column(name: str, values: list, infer: bool) -> pa.Array:
    """The Parquet type LeRobot uses for an episodes column (timestamps float64, ids int64);
    overridden columns get the type pyarrow infers from the given values."""
    if infer or name.startswith("stats/"):
        return pa.array(values)
    if name.endswith("_timestamp"):
        return pa.array(values, pa.float64())
    if name == "tasks":
        return pa.array(values, pa.list_(pa.string()))
    return pa.array(values, pa.int64())
