"""The ways people load LeRobot video data today, written here as ``refstream bench``'s
baselines: PyAV, no refstream streaming; rows become tensors by the one LeRobot rule
(``refstream.worker.hf_to_torch``).
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import av
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from av.video.reformatter import VideoReformatter

from refstream import errors, source, windows, worker
from refstream.meta import DatasetMeta, column_array, load_meta

__all__ = ["MapStyleVideoDataset", "decode_like_lerobot", "decode_ceiling", "cpu_seconds"]

TOLERANCE_S = 1e-4  # LeRobot's default tolerance_s


def cpu_seconds() -> float:
    """User + system CPU of this process and its reaped children."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


# --- the map-style baseline -------------------------------------------------------------------


def decode_like_lerobot(path: str, times_s: np.ndarray,
                        tolerance_s: float) -> tuple[np.ndarray, int]:
    """float32 ``(T, 3, H, W)`` frames at source-file ``times_s`` and the frames decoded, as
    LeRobot's ``decode_video_frames`` with the ``pyav`` backend decodes them: every frame from
    the keyframe before the first time to the last time converted to RGB, the nearest kept."""
    with av.open(path) as container:
        stream = container.streams.video[0]
        first_s, last_s = float(times_s.min()), float(times_s.max())
        container.seek(int(first_s / stream.time_base), stream=stream, backward=True,
                       any_frame=False)
        pictures, stamps = [], []
        for frame in container.decode(stream):
            pictures.append(frame.to_ndarray(format="rgb24"))
            stamps.append(float(frame.time))
            if stamps[-1] >= last_s:
                break
    distances = np.abs(times_s[:, None] - np.array(stamps)[None, :])
    nearest = distances.argmin(axis=1)
    worst = float(distances[np.arange(len(times_s)), nearest].max())
    if worst > tolerance_s:
        raise errors.UsageError(f"{path}: no frame within {tolerance_s} s of {times_s.tolist()}")
    chosen = np.stack([pictures[i] for i in nearest]).transpose(0, 3, 1, 2)
    return chosen.astype(np.float32) / np.float32(255), len(pictures)


class MapStyleVideoDataset:
    """Reads like LeRobot's ``LeRobotDataset`` with the ``pyav`` video backend: every data
    Parquet file read into numpy arrays up front (as LeRobot loads its Arrow tables); per item,
    the anchor's rows and windows by LeRobot's rule (``refstream.windows``) and, per camera,
    :func:`decode_like_lerobot`. Items carry ``bench.decoded_frames`` (int64) so the bench can
    count decodes."""

    def __init__(self, root: str | os.PathLike, delta_timestamps: dict[str, list[float]]) -> None:
        self.root = Path(root)
        self.meta = load_meta(source.LocalSource(self.root))
        self.windows = windows.make_windows(delta_timestamps, self.meta.fps, TOLERANCE_S,
                                            feature_keys=self.meta.features)
        relpaths = sorted({self.meta.data_relpath(int(e)) for e in self.meta.episode_index})
        table = pa.concat_tables([pq.read_table(self.root / r) for r in relpaths]).sort_by("index")
        self.columns = {name: column_array(table[name], str(self.root / "data"), name)
                        for name in self.meta.parquet_keys}
        self.global_index = self.columns["index"]

    def __len__(self) -> int:
        return len(self.global_index)

    def __getitem__(self, position: int) -> dict:
        meta = self.meta
        row = int(np.searchsorted(meta.from_index, int(self.global_index[position]),
                                  side="right")) - 1
        episode, first = int(meta.episode_index[row]), int(meta.from_index[row])
        frame, length = int(self.global_index[position]) - first, int(meta.length[row])
        item: dict = {}
        for key, values in self.columns.items():
            offsets = self.windows.get(key)
            if offsets is None:
                item[key] = worker.hf_to_torch(values[first + frame])
            else:
                rows, is_pad = windows.window_rows(offsets, frame, length)
                item[key] = worker.hf_to_torch(values[first + rows])
                item[f"{key}_is_pad"] = torch.from_numpy(is_pad)
        decoded = 0
        for camera in meta.camera_keys:
            offsets = self.windows.get(camera, np.zeros(1, np.int64))
            rows, is_pad = windows.window_rows(offsets, frame, length)
            times_s = float(meta.video_from_s[camera][row]) + self.columns["timestamp"][
                first + rows].astype(np.float64)
            pixels, count = decode_like_lerobot(
                str(self.root / meta.video_relpath(episode, camera)), times_s, TOLERANCE_S)
            decoded += count
            item[camera] = torch.from_numpy(pixels if len(rows) > 1 else pixels[0])
            if camera in self.windows:
                item[f"{camera}_is_pad"] = torch.from_numpy(is_pad)
        item["task"] = meta.tasks[int(self.columns["task_index"][first + frame])]
        item["bench.decoded_frames"] = torch.tensor(decoded)
        return item


# --- the decode ceiling -----------------------------------------------------------------------


def _decode_jobs(jobs: list[tuple[str, float, float]]) -> tuple[int, int, float, float]:
    """Decode and convert each ``(path, from_s, to_s)`` episode as :func:`decode_ceiling` does:
    (episode frames, decoded frames, decode seconds, RGB conversion seconds)."""
    episode_frames = decoded = 0
    decode_s = rgb_s = 0.0
    converter = VideoReformatter()
    containers: dict[str, av.container.InputContainer] = {}
    try:
        for path, from_s, to_s in jobs:
            container = containers.get(path) or containers.setdefault(path, av.open(path))
            stream = container.streams.video[0]
            container.seek(int(from_s / stream.time_base), stream=stream, backward=True)
            frames = container.decode(stream)
            while True:
                started = time.perf_counter()
                frame = next(frames, None)
                decode_s += time.perf_counter() - started
                if frame is None or frame.time >= to_s - TOLERANCE_S:
                    break
                decoded += 1
                if frame.time < from_s - TOLERANCE_S:
                    continue  # before the episode: decoded from the keyframe, not delivered
                started = time.perf_counter()
                converter.reformat(frame, format="rgb24", threads=1).to_ndarray()
                rgb_s += time.perf_counter() - started
                episode_frames += 1
    finally:
        for container in containers.values():
            container.close()
    return episode_frames, decoded, decode_s, rgb_s


@dataclass(frozen=True)
class Ceiling:
    processes: int
    episode_frames: int  # frames of the episodes, decoded and converted to RGB
    decoded_frames: int
    wall_s: float
    decode_s: float  # summed over processes: time inside PyAV's decode
    rgb_s: float  # summed over processes: time converting to RGB
    cpu_s: float

    @property
    def frames_per_s(self) -> float:
        return self.episode_frames / self.wall_s


def decode_ceiling(root: Path, meta: DatasetMeta, processes: int) -> Ceiling:
    """What decoding alone costs, no loader around it: every episode of every camera decoded
    with PyAV and each frame converted to FFmpeg's rgb24 (one reused single-threaded converter;
    ``refstream.decode``'s frames equal it), episodes dealt round-robin to ``processes``
    processes (the DataLoader's worker count; at least one)."""
    jobs = [(str(root / meta.video_relpath(int(e), camera)),
             float(meta.video_from_s[camera][i]), float(meta.video_to_s[camera][i]))
            for camera in meta.camera_keys for i, e in enumerate(meta.episode_index)]
    processes = max(1, processes)
    shares = [jobs[p::processes] for p in range(processes)]
    with ProcessPoolExecutor(processes) as pool:
        list(pool.map(int, range(processes)))  # start the processes before the clock
        cpu_before = cpu_seconds()
        started = time.perf_counter()
        results = list(pool.map(_decode_jobs, shares))
        wall = time.perf_counter() - started
    cpu = cpu_seconds() - cpu_before
    return Ceiling(processes, sum(r[0] for r in results), sum(r[1] for r in results), wall,
                   sum(r[2] for r in results), sum(r[3] for r in results), cpu)
