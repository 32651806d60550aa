"""A small, real LeRobot v3 dataset and a loopback HTTP server to stream it from; for
``refstream demo``, the bench and the tests, not the streaming path.

``write_demo_dataset(root, ...)`` writes what LeRobot's recorder writes (``meta/``, data Parquet
with one row group per episode, videos); like LeRobot, it encodes each episode as its own video
and concatenates the episodes of a file packet by packet, each at the previous ``to_timestamp``.

Every frame carries its label (:func:`frame_picture`, flat grey blocks laid out as the
``LABEL_*`` constants say): the top row the episode id, the middle row the frame index. Flat
blocks survive lossy coding; :func:`read_frame_label` reads them back or refuses the frame. Rows
follow the LeRobot oracle's convention:
``observation.state[0] = episode``, ``observation.state[1] = frame``, ``action = episode +
frame / 1000`` (float32), task ``TASKS[episode % 2]``.

``serve_directory(root)`` serves a folder on ``127.0.0.1`` (HTTP/1.1 keep-alive, ``HEAD``/``GET``,
one ``Range`` per request, a strong ``ETag``) and yields a :class:`LoopbackServer` that logs every
request; :func:`consume` measures ``refstream stream``, :func:`run_demo` is ``refstream demo``.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from unittest import mock
from urllib.parse import unquote, urlsplit

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from refstream.meta import EPISODES_PATH

__all__ = ["write_demo_dataset", "read_frame_label", "serve_directory", "consume", "run_demo"]

TASKS = ("pick the cube", "place the cube")
CHUNKS_SIZE = 1000  # LeRobot's DEFAULT_CHUNK_SIZE: files per chunk directory
DATA_PATH = "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
VIDEO_PATH = "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"
STATE_NAMES = ["j0", "j1", "j2", "j3", "j4", "j5"]
QUANTILES = {"q01": 0.01, "q10": 0.10, "q50": 0.50, "q90": 0.90, "q99": 0.99}  # LeRobot's stats

# Frame label geometry: 4 columns × 3 rows of blocks, four base-8 digits per row, then a marker row.
LABEL_COLUMNS = 4
LABEL_ROWS = 3
LABEL_BASE = 8
LABEL_LEVEL0 = 24  # grey level of digit 0; digit d is LABEL_LEVEL0 + LABEL_STEP * d (max 220)
LABEL_STEP = 28
LABEL_TOLERANCE = 10  # grey levels a block centre may drift under lossy coding and still read back
LABEL_MAX = LABEL_BASE**LABEL_COLUMNS  # episodes and frames must stay below this
# Odd frames are drawn inverted (255 - level) with a bright marker row, so consecutive frames differ
# in every block: fast encoder presets otherwise skip a block whose grey level moved one step.
MARKER_EVEN = 16
MARKER_ODD = 240

# Camera statistics are estimated on at most this many frames, drawn this small (pixels, longer
# side), as LeRobot estimates image statistics on sampled, downsampled frames.
IMAGE_STAT_FRAMES = 8
IMAGE_STAT_PIXELS = 80
# Encoder settings per codec: LeRobot's defaults for SVT-AV1; H.264 gets B-frames for tests.
ENCODER_NAMES = {"libsvtav1": "av1", "libx264": "h264"}
ENCODER_CRF = {"libsvtav1": 30, "libx264": 23}
SVT_PRESET = 12


# --- frame labels ---------------------------------------------------------------------------


def _digits(value: int) -> list[int]:
    if not 0 <= value < LABEL_MAX:
        raise ValueError(f"label value {value} outside [0, {LABEL_MAX})")
    return [(value // LABEL_BASE**p) % LABEL_BASE for p in reversed(range(LABEL_COLUMNS))]


def _block_bounds(width: int, height: int, row: int, column: int) -> tuple[int, int, int, int]:
    block_w, block_h = width // LABEL_COLUMNS, height // LABEL_ROWS
    return row * block_h, (row + 1) * block_h, column * block_w, (column + 1) * block_w


def frame_picture(episode: int, frame: int, width: int, height: int) -> np.ndarray:
    """The uint8 RGB picture ``(height, width, 3)`` that labels ``(episode, frame)``."""
    picture = np.zeros((height, width, 3), dtype=np.uint8)
    odd = frame % 2 == 1
    for row, value in enumerate((episode, frame)):
        for column, digit in enumerate(_digits(value)):
            y0, y1, x0, x1 = _block_bounds(width, height, row, column)
            level = LABEL_LEVEL0 + LABEL_STEP * digit
            picture[y0:y1, x0:x1, :] = 255 - level if odd else level
    y0, y1, _, _ = _block_bounds(width, height, LABEL_ROWS - 1, 0)
    picture[y0:y1, : (width // LABEL_COLUMNS) * LABEL_COLUMNS, :] = (
        MARKER_ODD if odd else MARKER_EVEN)
    return picture


def _centre_level(picture: np.ndarray, row: int, column: int) -> float:
    y0, y1, x0, x1 = _block_bounds(picture.shape[1], picture.shape[0], row, column)
    # The centre half of the block: edges ring under lossy coding, centres stay flat.
    dy, dx = (y1 - y0) // 4, (x1 - x0) // 4
    return float(picture[y0 + dy : y1 - dy, x0 + dx : x1 - dx].astype(np.float64).mean())


def read_frame_label(frame: np.ndarray) -> tuple[int, int]:
    """``(episode, frame)`` drawn in a uint8 ``(C, H, W)`` or ``(H, W, C)`` picture; ValueError
    when a block is not within ``LABEL_TOLERANCE`` of a digit or the parity marker disagrees."""
    picture = np.asarray(frame)
    if picture.ndim != 3:
        raise ValueError(f"expected a 3-D picture, got shape {picture.shape}")
    if picture.shape[0] in (1, 3) and picture.shape[2] not in (1, 3):
        picture = picture.transpose(1, 2, 0)
    markers = [_centre_level(picture, LABEL_ROWS - 1, c) for c in range(LABEL_COLUMNS)]
    odd = min(markers) > (MARKER_EVEN + MARKER_ODD) / 2
    if not odd and max(markers) > (MARKER_EVEN + MARKER_ODD) / 2:
        raise ValueError(f"parity marker blocks disagree: grey levels {markers}")
    values = []
    for row in range(2):
        value = 0
        for column in range(LABEL_COLUMNS):
            level = _centre_level(picture, row, column)
            level = 255 - level if odd else level
            digit = int(round((level - LABEL_LEVEL0) / LABEL_STEP))
            expected = LABEL_LEVEL0 + LABEL_STEP * digit
            if not 0 <= digit < LABEL_BASE or abs(level - expected) > LABEL_TOLERANCE:
                raise ValueError(f"block (row {row}, column {column}) has grey level "
                                 f"{level:.1f}, not within {LABEL_TOLERANCE} of a label digit")
            value = value * LABEL_BASE + digit
        values.append(value)
    if values[1] % 2 != odd:
        raise ValueError(f"parity marker says {'odd' if odd else 'even'}, frame reads {values[1]}")
    return values[0], values[1]


# --- statistics (the shape LeRobot stores; values need not match LeRobot's sampling) -----------


def _stats(values: np.ndarray, keep_axes: tuple[int, ...] = ()) -> dict[str, np.ndarray]:
    """min/max/mean/std/count/quantiles over axis 0 (and the image axes LeRobot reduces)."""
    data = values.astype(np.float64)
    axes = (0, *keep_axes)
    keep = bool(keep_axes)
    reductions = {"min": np.min, "max": np.max, "mean": np.mean, "std": np.std}
    out = {name: reduce(data, axis=axes, keepdims=keep) for name, reduce in reductions.items()}
    out["count"] = np.array([values.shape[0]], dtype=np.int64)
    out |= {name: np.quantile(data, q, axis=axes, keepdims=keep) for name, q in QUANTILES.items()}
    if keep:  # images: (1, C, 1, 1) -> (C, 1, 1)
        out = {k: (v[0] if k != "count" else v) for k, v in out.items()}
    return out


# --- video encoding -------------------------------------------------------------------------


def _encoder_options(codec: str, gop: int, bframes: int) -> dict[str, str]:
    options = {"g": gop, "crf": ENCODER_CRF[codec],
               **({"preset": SVT_PRESET} if codec == "libsvtav1" else {"bf": bframes})}
    return {name: str(value) for name, value in options.items()}


@contextlib.contextmanager
def keep_scheduling() -> Iterator[None]:
    """Restore the calling thread's scheduling policy after encoding.

    SVT-AV1, run as root, switches the thread that opens the encoder to ``SCHED_FIFO`` priority
    99 and never switches it back. Every process forked afterwards (DataLoader workers, servers)
    inherits that real-time policy, and one busy thread then starves the whole machine.
    """
    policy, param = os.sched_getscheduler(0), os.sched_getparam(0)
    try:
        yield
    finally:
        if (os.sched_getscheduler(0), os.sched_getparam(0)) != (policy, param):
            os.sched_setscheduler(0, policy, param)


def _encode_episode(pictures: Sequence[np.ndarray], fps: int, options: dict[str, str],
                    codec: str) -> bytes:
    """One episode as its own MP4 in memory (LeRobot encodes each episode, then concatenates)."""
    import av

    # SVT-AV1 prints a banner and its whole configuration to stderr for every encoder it opens;
    # level 1 keeps its errors only.
    os.environ.setdefault("SVT_LOG", "1")
    buffer = io.BytesIO()
    with keep_scheduling(), av.open(buffer, "w", format="mp4") as container:
        stream = container.add_stream(codec, rate=fps, options=options)
        stream.height, stream.width = pictures[0].shape[:2]
        stream.pix_fmt = "yuv420p"
        for picture in pictures:
            frame = av.VideoFrame.from_ndarray(picture, format="rgb24")
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    return buffer.getvalue()


def _concatenate(episode_videos: Sequence[bytes], lengths: Sequence[int], fps: int,
                 path: Path) -> None:
    """Remux episode videos into one faststart MP4, each shifted by the preceding durations."""
    import av

    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), "w", format="mp4", options={"movflags": "faststart"}) as output:
        out_stream = None
        offset_frames = 0
        for video, length in zip(episode_videos, lengths, strict=True):
            with av.open(io.BytesIO(video)) as source:
                in_stream = source.streams.video[0]
                if out_stream is None:
                    out_stream = output.add_stream_from_template(in_stream, opaque=True)
                # Shift by the episode's start in ticks: offset_frames / fps seconds.
                shift = offset_frames * in_stream.time_base.denominator // (
                    fps * in_stream.time_base.numerator)
                for packet in source.demux(in_stream):
                    if packet.dts is None:  # the demuxer's end-of-stream marker
                        continue
                    packet.pts += shift
                    packet.dts += shift
                    packet.stream = out_stream
                    output.mux(packet)
            offset_frames += length


# --- Parquet writers ------------------------------------------------------------------------


def _data_schema(features: dict) -> pa.Schema:
    """The data files' columns: every non-video feature, with the ``huggingface`` schema
    metadata HF ``datasets`` stores."""
    fields, described = [], {}
    for name, feature in features.items():
        if feature["dtype"] == "video":
            continue
        value_type = pa.from_numpy_dtype(np.dtype(feature["dtype"]))
        value = {"dtype": feature["dtype"], "_type": "Value"}
        if feature["shape"] == [1]:
            fields.append(pa.field(name, value_type))
            described[name] = value
        else:
            length = feature["shape"][0]
            fields.append(pa.field(name, pa.list_(value_type, length)))
            described[name] = {"feature": value, "length": length, "_type": "List"}
    metadata = {"info": {"features": described}}
    return pa.schema(fields, metadata={b"huggingface": json.dumps(metadata).encode()})


def _episode_rows(episode: int, length: int, first_index: int, fps: int) -> dict[str, np.ndarray]:
    frame = np.arange(length, dtype=np.int64)
    state = np.zeros((length, 6), dtype=np.float32)
    state[:, 0] = episode
    state[:, 1] = frame
    action = np.repeat((episode + frame / 1000).astype(np.float32)[:, None], 6, axis=1)
    return {"observation.state": state, "action": action,
            "timestamp": (frame / fps).astype(np.float32), "frame_index": frame,
            "episode_index": np.full(length, episode, dtype=np.int64), "index": first_index + frame,
            "task_index": np.full(length, episode % len(TASKS), dtype=np.int64)}


def fixed_size_lists(values: np.ndarray) -> pa.Array:
    """Each row of ``values`` as a (nested) fixed-size list; 1-D values as they are."""
    array = pa.array(values.reshape(-1))
    for size in reversed(values.shape[1:]):
        array = pa.FixedSizeListArray.from_arrays(array, size)
    return array


def _tasks_table() -> pa.Table:
    """``meta/tasks.parquet`` as pandas writes a frame indexed by ``task`` (LeRobot's shape): the
    schema's pandas metadata names the index column, which is all pandas reads back."""
    index = {"name": "task", "field_name": "task", "pandas_type": "unicode",
             "numpy_type": "object", "metadata": None}
    pandas_metadata = {"index_columns": ["task"], "column_indexes": [], "columns": [index]}
    schema = pa.schema([pa.field("task_index", pa.int64()), pa.field("task", pa.string())],
                       metadata={b"pandas": json.dumps(pandas_metadata).encode()})
    return pa.table([list(range(len(TASKS))), list(TASKS)], schema=schema)


def file_place(numbers, key: str = "") -> dict:
    """``chunk_index`` and ``file_index`` of file ``numbers`` (counted over every chunk, as
    LeRobot rolls files over), prefixed by ``key/`` when given (episodes table columns)."""
    prefix = f"{key}/" if key else ""
    return {f"{prefix}chunk_index": numbers // CHUNKS_SIZE,
            f"{prefix}file_index": numbers % CHUNKS_SIZE}


# --- the dataset ----------------------------------------------------------------------------


def write_demo_dataset(root: str | os.PathLike, *,
                       episode_lengths: Sequence[int] = (24, 31, 18, 40, 27, 35),
                       cameras: Sequence[str] = ("observation.images.front",
                                                 "observation.images.wrist"),
                       size: tuple[int, int] | Mapping[str, tuple[int, int]] = (64, 48),
                       fps: int = 30, codec: str = "libsvtav1", gop: int = 2, bframes: int = 0,
                       episodes_per_video_file: int = 4, episodes_per_data_file: int = 3,
                       episodes_per_meta_file: int | None = None) -> None:
    """Write a LeRobot v3.0 dataset of labelled frames under ``root`` (created if missing).
    ``size``: (width, height) of every camera, or a mapping camera → (width, height) (cameras
    of different sizes cannot be mixed up unnoticed); ``codec``: ``"libsvtav1"`` (LeRobot's
    default, ``gop`` 2) or ``"libx264"`` (``gop=30, bframes=2`` for reordered video);
    ``episodes_per_meta_file``: rows per ``meta/episodes`` file (None: one file)."""
    if codec not in ENCODER_NAMES:
        raise ValueError(f"codec must be one of {sorted(ENCODER_NAMES)}, got {codec!r}")
    lengths = [int(n) for n in episode_lengths]
    if not lengths or min(lengths) < 1 or len(lengths) > LABEL_MAX or max(lengths) > LABEL_MAX:
        raise ValueError(f"episode lengths must be 1..{LABEL_MAX}, at most {LABEL_MAX} episodes")
    sizes = {c: tuple(size[c]) if isinstance(size, Mapping) else tuple(size) for c in cameras}
    root = Path(root)
    features = _features(sizes, fps, codec, gop, bframes)
    first_index = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    # Each episode's file number: the episodes fill files in order, so many to a file.
    data_files = np.arange(len(lengths)) // episodes_per_data_file
    video_files = np.arange(len(lengths)) // episodes_per_video_file
    meta_files = np.arange(len(lengths)) // (episodes_per_meta_file or len(lengths))
    rows = [_episode_rows(e, n, int(first_index[e]), fps) for e, n in enumerate(lengths)]

    _write_data(root, rows, data_files, features)
    _write_videos(root, lengths, sizes, fps, codec, _encoder_options(codec, gop, bframes),
                  video_files)
    _write_episodes(root, lengths, fps, first_index, rows, data_files, video_files, meta_files,
                    sizes)
    pq.write_table(_tasks_table(), root / "meta" / "tasks.parquet")
    _write_info_and_stats(root, features, fps, lengths, rows, sizes)


def _features(sizes: dict[str, tuple[int, int]], fps: int, codec: str, gop: int,
              bframes: int) -> dict:
    features: dict = {}
    for camera, (width, height) in sizes.items():
        info = {"video.height": height, "video.width": width, "video.codec": ENCODER_NAMES[codec],
                "video.pix_fmt": "yuv420p", "video.fps": fps, "video.channels": 3,
                "has_audio": False, "video.g": gop, "video.crf": ENCODER_CRF[codec],
                "video.preset": SVT_PRESET if codec == "libsvtav1" else None,
                "video.fast_decode": 0, "video.video_backend": "pyav",
                "video.extra_options": {} if codec == "libsvtav1" else {"bf": bframes},
                "is_depth_map": False}
        features[camera] = {"dtype": "video", "shape": [height, width, 3],
                            "names": ["height", "width", "channels"], "info": info}
    for name in ("observation.state", "action"):
        features[name] = {"dtype": "float32", "shape": [6], "names": STATE_NAMES}
    features["timestamp"] = {"dtype": "float32", "shape": [1], "names": None}
    for name in ("frame_index", "episode_index", "index", "task_index"):
        features[name] = {"dtype": "int64", "shape": [1], "names": None}
    return features


def _write_data(root: Path, rows: list[dict], data_files: np.ndarray, features: dict) -> None:
    schema = _data_schema(features)
    for number in sorted(set(data_files.tolist())):
        path = root / DATA_PATH.format(**file_place(number))
        path.parent.mkdir(parents=True, exist_ok=True)
        # One write_table per episode: one row group per episode, like LeRobot's recorder.
        with pq.ParquetWriter(path, schema, compression="snappy") as writer:
            for episode in np.flatnonzero(data_files == number).tolist():
                columns = [fixed_size_lists(rows[episode][name]) for name in schema.names]
                writer.write_table(pa.Table.from_arrays(columns, schema=schema))


def _write_videos(root: Path, lengths: list[int], sizes: dict[str, tuple[int, int]], fps: int,
                  codec: str, options: dict[str, str], video_files: np.ndarray) -> None:
    for camera, (width, height) in sizes.items():
        for number in sorted(set(video_files.tolist())):
            members = np.flatnonzero(video_files == number).tolist()
            videos = [
                _encode_episode([frame_picture(e, f, width, height) for f in range(lengths[e])],
                                fps, options, codec)
                for e in members
            ]
            path = root / VIDEO_PATH.format(video_key=camera, **file_place(number))
            _concatenate(videos, [lengths[e] for e in members], fps, path)


def _write_episodes(root: Path, lengths: list[int], fps: int, first_index: np.ndarray,
                    rows: list[dict], data_files: np.ndarray, video_files: np.ndarray,
                    meta_files: np.ndarray, sizes: dict[str, tuple[int, int]]) -> None:
    # Each episode's (from_s, to_s) in its video file: it starts where the previous one ended.
    times = []
    for e, placed in enumerate(video_files):
        from_s = times[-1][1] if e and video_files[e - 1] == placed else 0.0
        times.append((from_s, from_s + lengths[e] / fps))
    columns: dict[str, list] = {
        "episode_index": list(range(len(lengths))),
        "tasks": [[TASKS[e % len(TASKS)]] for e in range(len(lengths))], "length": lengths,
        **file_place(data_files, "data"), "dataset_from_index": first_index[:-1].tolist(),
        "dataset_to_index": first_index[1:].tolist(),
    }
    for camera in sizes:
        columns |= file_place(video_files, f"videos/{camera}")
        columns[f"videos/{camera}/from_timestamp"] = [t[0] for t in times]
        columns[f"videos/{camera}/to_timestamp"] = [t[1] for t in times]
    per_episode = [_episode_stats(r, sizes) for r in rows]
    for name in per_episode[0]:
        for stat in per_episode[0][name]:
            columns[f"stats/{name}/{stat}"] = [s[name][stat].tolist() for s in per_episode]
    columns |= file_place(meta_files, "meta/episodes")
    types = {"tasks": pa.list_(pa.string())}
    table = pa.table({k: pa.array(v, type=types.get(k)) for k, v in columns.items()})
    for number in sorted(set(meta_files.tolist())):
        path = root / EPISODES_PATH.format(**file_place(number))
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table.take(np.flatnonzero(meta_files == number)), path)


def _episode_stats(rows: dict[str, np.ndarray],
                   sizes: dict[str, tuple[int, int]]) -> dict[str, dict]:
    """Statistics like LeRobot's: exact for row features; for cameras estimated, as LeRobot
    does, on a few small frames (refstream never reads them)."""
    stats = {}
    step = max(1, -(-len(rows["frame_index"]) // IMAGE_STAT_FRAMES))
    labels = list(zip(rows["episode_index"][::step].tolist(), rows["frame_index"][::step].tolist(),
                      strict=True))
    for camera, (width, height) in sizes.items():
        shrink = max(1, -(-max(width, height) // IMAGE_STAT_PIXELS))
        small = max(8, width // shrink), max(8, height // shrink)
        pictures = np.stack([frame_picture(e, f, *small) for e, f in labels])
        images = pictures.transpose(0, 3, 1, 2) / 255.0  # (N, C, H, W) in [0, 1] as LeRobot's
        stats[camera] = _stats(images, keep_axes=(2, 3))
    for name, values in rows.items():
        stats[name] = _stats(values if values.ndim == 2 else values[:, None])
    return stats


def info_document(features: dict, fps: int, episodes: int, frames: int, robot_type: str,
                  video_files_size_in_mb: int = 200) -> dict:
    """``meta/info.json`` of a dataset of ``TASKS`` with these features and totals."""
    has_video = any(f["dtype"] == "video" for f in features.values())
    return {"codebase_version": "v3.0", "fps": fps, "features": features,
            "total_episodes": episodes, "total_frames": frames, "total_tasks": len(TASKS),
            "chunks_size": CHUNKS_SIZE, "data_files_size_in_mb": 100,
            "video_files_size_in_mb": video_files_size_in_mb, "data_path": DATA_PATH,
            "video_path": VIDEO_PATH if has_video else None, "robot_type": robot_type,
            "splits": {"train": f"0:{episodes}"}}


def _write_info_and_stats(root: Path, features: dict, fps: int, lengths: list[int],
                          rows: list[dict], sizes: dict[str, tuple[int, int]]) -> None:
    info = info_document(features, fps, len(lengths), int(sum(lengths)), "refstream_demo")
    (root / "meta" / "info.json").write_text(json.dumps(info, indent=4))
    merged = {k: np.concatenate([r[k] for r in rows]) for k in rows[0]}
    stats = {feature: {name: value.tolist() for name, value in values.items()}
             for feature, values in _episode_stats(merged, sizes).items()}
    (root / "meta" / "stats.json").write_text(json.dumps(stats, indent=4))


# --- loopback HTTP server -------------------------------------------------------------------


def file_route(target: str) -> str:
    """The default route: a request target names the file at that path under the root."""
    return unquote(urlsplit(target).path).lstrip("/")


@dataclass
class LoopbackServer:
    """A running :func:`serve_directory` server and what it has served so far."""

    root: Path
    url: str = ""
    body_bytes: int = 0  # response body bytes answered (counted as the answer starts)
    # (method, path, Range header or None, status), one per request
    log: list[tuple[str, str, str | None, int]] = field(default_factory=list)
    # Called with (path, client address) before each request is answered; may block to hold it.
    hold: Callable[[str, tuple], None] | None = None
    # The request target -> the relpath of a file to serve, or an answer: (body, headers), a
    # 302 when the headers have a Location.
    route: Callable[[str], str | tuple[bytes, dict[str, str]]] = file_route
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)


_RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")


def _parse_range(header: str, size: int) -> tuple[int, int] | None:
    """Inclusive (first, last) of a single byte range, or None if unsatisfiable/malformed."""
    match = _RANGE.match(header.strip())
    if match is None:
        return None
    first_text, last_text = match.groups()
    if not first_text:  # suffix range: the last N bytes
        count = int(last_text or 0)
        return (max(0, size - count), size - 1) if count and size else None
    first = int(first_text)
    last = min(int(last_text), size - 1) if last_text else size - 1
    return (first, last) if first <= last else None


def _handler_class(server_state: LoopbackServer) -> type[BaseHTTPRequestHandler]:
    root = server_state.root.resolve()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive: clients reuse the connection
        # Headers and body leave in two writes: with Nagle's algorithm the body waits for the
        # client's delayed ACK, 40 ms per request on a kept-alive connection.
        disable_nagle_algorithm = True

        def log_message(self, format, *args):  # noqa: A002 - the base class's name
            pass  # quiet: the counters are the log

        def do_HEAD(self):
            self._respond(send_body=False)

        def do_GET(self):
            self._respond(send_body=True)

        def _finish(self, status: int, headers: dict[str, str], body: bytes,
                    send_body: bool) -> None:
            # Counted before the answer leaves: a client that has read the answer must find
            # its request in the counters.
            with server_state._lock:
                server_state.body_bytes += len(body) if send_body else 0
                server_state.log.append((self.command, self.path, self.headers.get("Range"),
                                         status))
            self.send_response(status)
            headers.setdefault("Content-Length", str(len(body)))
            for name, value in headers.items():
                self.send_header(name, value)
            self.end_headers()
            if send_body:
                self.wfile.write(body)

        def _respond(self, send_body: bool) -> None:
            if server_state.hold is not None:
                server_state.hold(self.path, self.client_address)
            routed = server_state.route(self.path)
            if isinstance(routed, tuple):  # an answer; a redirect when it has a Location
                status = HTTPStatus.FOUND if "Location" in routed[1] else HTTPStatus.OK
                self._finish(status, dict(routed[1]), routed[0], send_body)
                return
            path = (root / routed).resolve()
            if root not in path.parents or not path.is_file():
                self._finish(HTTPStatus.NOT_FOUND, {}, b"not found\n", send_body)
                return
            stat = path.stat()
            size = stat.st_size
            headers = {"ETag": f'"{size:x}-{stat.st_mtime_ns:x}"', "Accept-Ranges": "bytes",
                       "Content-Type": "application/octet-stream"}
            status, first, last = HTTPStatus.OK, 0, size - 1
            range_header = self.headers.get("Range")
            # No range, or several: RFC 9110 lets a server ignore Range and send it all.
            if range_header is not None and "," not in range_header:
                bounds = _parse_range(range_header, size)
                if bounds is None:
                    headers["Content-Range"] = f"bytes */{size}"
                    self._finish(HTTPStatus.REQUESTED_RANGE_NOT_SATISFIABLE, headers, b"",
                                 send_body)
                    return
                status, (first, last) = HTTPStatus.PARTIAL_CONTENT, bounds
                headers["Content-Range"] = f"bytes {first}-{last}/{size}"
            headers["Content-Length"] = str(last - first + 1)
            body = b""
            if send_body:
                with path.open("rb") as handle:
                    handle.seek(first)
                    body = handle.read(last - first + 1)
            self._finish(status, headers, body, send_body)

    return Handler


class _LoopbackHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    # The default listen backlog of 5 drops the SYNs of a burst of new connections (several
    # workers' threads at once), which the client resends only after a second.
    request_queue_size = 128

    def handle_error(self, request, client_address) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):  # not a client that went away
            super().handle_error(request, client_address)


@contextlib.contextmanager
def serve_directory(root: str | os.PathLike) -> Iterator[LoopbackServer]:
    """Serve ``root`` on ``http://127.0.0.1:<ephemeral port>`` until the block exits."""
    state = LoopbackServer(root=Path(root))
    server = _LoopbackHTTPServer(("127.0.0.1", 0), _handler_class(state))
    state.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, name="refstream-loopback", daemon=True)
    thread.start()
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


# --- measuring a stream ---------------------------------------------------------------------


@dataclass(frozen=True)
class StreamMeasurement:
    """What one :func:`consume` run saw (times in seconds)."""

    samples: int
    batches: int
    seconds: float  # from creating the first DataLoader iterator to the last batch
    first_sample_s: float  # from creating the first DataLoader iterator to the first batch

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else 0.0


def consume(dataset, *, num_workers: int, batch_size: int, epochs: int = 1,
            max_samples: int | None = None, progress: bool = True,
            on_batch: Callable[[dict], None] | None = None) -> StreamMeasurement:
    """Stream ``epochs`` epochs (``set_epoch`` before each) through a DataLoader (of a batched
    dataset's ready batches: ``batch_size=None``), stopping after exactly ``max_samples`` samples
    if given (the last batch counted in part); ``on_batch`` sees every batch."""
    import torch
    from tqdm import tqdm

    loader = torch.utils.data.DataLoader(dataset, batch_size=None if dataset.batched else
                                         batch_size, num_workers=num_workers)
    limit = float("inf") if max_samples is None else max_samples
    samples = batches = 0
    first_s = None
    start = time.perf_counter()
    with tqdm(total=min(dataset.rank_frames * epochs, limit), unit="sample",
              disable=not progress, dynamic_ncols=True) as bar:
        for epoch in range(epochs):
            dataset.set_epoch(epoch)
            batches_of_epoch = iter(loader)
            for batch in batches_of_epoch:
                if first_s is None:
                    first_s = time.perf_counter() - start
                count = min(len(batch["index"]) if "index" in batch else batch_size,
                            limit - samples)
                samples += count
                batches += 1
                bar.update(count)
                if on_batch is not None:
                    on_batch(batch)
                if samples >= limit:
                    break
            del batches_of_epoch  # shuts the workers down
            if samples >= limit:
                break
    seconds = time.perf_counter() - start
    return StreamMeasurement(samples, batches, seconds, first_s or 0.0)


# --- the demo -------------------------------------------------------------------------------

DEMO_EPISODE_LENGTHS = (45, 30, 60, 38, 52, 41, 33, 57, 48, 36, 29, 50)  # 519 frames
DEMO_EPISODES_PER_VIDEO_FILE = 5  # 12 episodes -> 3 files per camera
DEMO_EPISODES_PER_DATA_FILE = 6
DEMO_BUDGET_FRACTION = 0.5  # the byte budget: half the video bytes, so it bounds admission


@dataclass(frozen=True)
class DemoReport:
    """What ``refstream demo`` verified and measured."""

    root: Path  # where the dataset was written
    kept: bool  # whether it stays there after the demo
    episodes: int
    frames: int
    cameras: int
    video_files: int
    dataset_bytes: int  # every file of the dataset
    video_bytes: int
    measurement: StreamMeasurement
    requests: int  # HTTP requests the server answered (metadata, index, Parquet, video spans)
    setup_requests: int  # of which before streaming: metadata and building the sidecar index
    video_span_requests: int  # video range requests while streaming
    body_bytes: int  # response body bytes sent by the server
    checked_frames: int  # camera frames whose label was read back
    problems: list[str]  # empty when every check passed

    def lines(self) -> list[str]:
        m = self.measurement
        verdict = "OK" if not self.problems else f"FAILED ({len(self.problems)} problems)"
        where = "kept" if self.kept else "removed at the end; --keep DIR keeps it"
        out = [
            f"dataset: {self.root} ({where})",
            f"dataset: {self.episodes} episodes, {self.frames} frames, {self.cameras} cameras "
            f"in {self.video_files} AV1 files ({self.dataset_bytes:,} bytes, video "
            f"{self.video_bytes:,})",
            f"verified: {verdict}: every frame exactly once ({m.samples} samples); rows and "
            f"{self.checked_frames} decoded camera frames belong to their anchor",
            f"throughput: {m.samples_per_s:,.0f} samples/s over {m.seconds:.2f} s; first "
            f"sample after {m.first_sample_s:.2f} s",
            f"fetched: {self.requests} HTTP requests ({self.setup_requests} for metadata and the "
            f"index, {self.video_span_requests} video spans for {self.episodes} episodes x "
            f"{self.cameras} cameras), {self.body_bytes:,} bytes = "
            f"{self.body_bytes / self.dataset_bytes:.2f} x the dataset",
        ]
        out += [f"problem: {p}" for p in self.problems[:10]]
        return out


def run_demo(workdir: str | os.PathLike | None = None, *, num_workers: int = 2,
             batch_size: int = 8, progress: bool = True) -> DemoReport:
    """Generate, serve and stream the demo dataset; verify every sample (``refstream demo``)."""
    kept = workdir is not None
    with contextlib.ExitStack() as stack:
        if workdir is None:
            workdir = stack.enter_context(tempfile.TemporaryDirectory(prefix="refstream-demo-"))
        root = Path(workdir) / "dataset"
        write_demo_dataset(root, episode_lengths=DEMO_EPISODE_LENGTHS,
                           episodes_per_video_file=DEMO_EPISODES_PER_VIDEO_FILE,
                           episodes_per_data_file=DEMO_EPISODES_PER_DATA_FILE)
        # The sidecar cache goes with the demo's files: the loopback URL changes on every run.
        stack.enter_context(environment("REFSTREAM_CACHE", str(Path(workdir) / "cache")))
        server = stack.enter_context(serve_directory(root))
        return _stream_and_check(root, kept, server, num_workers, batch_size, progress)


def environment(name: str, value: str) -> contextlib.AbstractContextManager:
    return mock.patch.dict(os.environ, {name: value})


def _stream_and_check(root: Path, kept: bool, server: LoopbackServer, num_workers: int,
                      batch_size: int, progress: bool) -> DemoReport:
    from refstream.stream import GIB, StreamingDataset

    files = [p for p in root.rglob("*") if p.is_file()]
    video_bytes = sum(p.stat().st_size for p in files if p.suffix == ".mp4")
    lengths = DEMO_EPISODE_LENGTHS
    starts = np.concatenate([[0], np.cumsum(lengths)])
    budget_gb = DEMO_BUDGET_FRACTION * video_bytes / GIB
    dataset = StreamingDataset(server.url, byte_budget_gb=budget_gb, seed=0, return_uint8=True)
    setup_requests = len(server.log)
    cameras = dataset.meta.camera_keys
    seen: list[tuple[int, int]] = []
    problems: list[str] = []

    def check(batch: dict) -> None:
        for i in range(len(batch["index"])):
            e, f = int(batch["episode_index"][i]), int(batch["frame_index"][i])
            seen.append((e, f))
            state = batch["observation.state"][i]
            if int(batch["index"][i]) != starts[e] + f or state[0] != e or state[1] != f:
                problems.append(f"rows of episode {e} frame {f} belong to another anchor")
            for camera in cameras:
                label = read_frame_label(batch[camera][i].numpy())
                if label != (e, f):
                    problems.append(f"{camera} of episode {e} frame {f} shows {label}")

    measurement = consume(dataset, num_workers=num_workers, batch_size=batch_size,
                          progress=progress, on_batch=check)
    expected = [(e, f) for e, n in enumerate(lengths) for f in range(n)]
    if sorted(seen) != expected:
        missing = len(set(expected) - set(seen))
        problems.append(f"{len(seen)} samples, {missing} frames missing, "
                        f"{len(seen) - len(set(seen))} repeated")
    video_spans = sum(1 for method, path, rng, _ in server.log[setup_requests:]
                      if method == "GET" and rng and path.endswith(".mp4"))
    return DemoReport(
        root=root, kept=kept, episodes=len(lengths), frames=int(sum(lengths)), cameras=len(cameras),
        video_files=sum(1 for p in files if p.suffix == ".mp4"),
        dataset_bytes=sum(p.stat().st_size for p in files), video_bytes=video_bytes,
        measurement=measurement, requests=len(server.log), setup_requests=setup_requests,
        video_span_requests=video_spans, body_bytes=server.body_bytes,
        checked_frames=len(seen) * len(cameras), problems=problems)
