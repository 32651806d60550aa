"""LeRobot v3.0 dataset metadata and the episode selection (SPEC §4).

Use::

    meta = load_meta(source)          # info, episodes, tasks, stats: checked (SPEC §4.1–4.4, §4.7)
    ids = select_episodes(meta, [3, 7])           # None selects every episode
    meta.frames(3), meta.data_relpath(3), meta.video_relpath(3, meta.camera_keys[0])
    meta.video_files()                            # every video file, of every camera
    meta.episode_rows(source, ids)                # those episodes' whole rows
    column_array(read_parquet(source, relpath)[name], relpath, name)   # any Parquet column
"""

from __future__ import annotations

import functools
import json
import re
import string
from collections.abc import Sequence
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from refstream.errors import (
    DatasetError,
    EpisodeSelectionError,
    MalformedDataset,
    RefstreamError,
    TableError,
    UnsafePath,
    UnsupportedDataset,
    UsageError,
    check_int,
    is_int,
)
from refstream.shard import episode_ids
from refstream.source import Source, check_relpath
from refstream.stats import STATS_PATH, parse_stats

__all__ = ["DatasetMeta", "load_meta", "select_episodes", "read_parquet", "column_array",
           "index_column", "parse_json"]

INFO_PATH = "meta/info.json"
TASKS_PATH = "meta/tasks.parquet"
# Fixed by LeRobot v3 (not a template in info.json): DEFAULT_EPISODES_PATH.
EPISODES_PATH = "meta/episodes/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
SUPPORTED_VERSION = "v3.0"
# The command LeRobot ships to upgrade a v2.1 dataset, quoted in the error for older datasets.
CONVERT_HINT = "python -m lerobot.datasets.v30.convert_dataset_v21_to_v30 --repo-id=<repo>"

# Episodes-table column -> DatasetMeta field, read for every dataset (SPEC §4.3).
EPISODE_COLUMNS = {
    "episode_index": "episode_index",
    "length": "length",
    "dataset_from_index": "from_index",
    "dataset_to_index": "to_index",
    "data/chunk_index": "data_chunk",
    "data/file_index": "data_file",
}
# Column videos/K/<name> of each camera K -> DatasetMeta field (a dict by camera).
VIDEO_COLUMNS = {
    "chunk_index": "video_chunk",
    "file_index": "video_file",
    "from_timestamp": "video_from_s",
    "to_timestamp": "video_to_s",
}

# LeRobot's annotation columns (its has_language_columns) and the flags of its depth maps.
LANGUAGE_COLUMNS = ("language_persistent", "language_events")
_DEPTH_FLAGS = ("is_depth_map", "video.is_depth_map")

# Placeholders each template may (and must) use: data_path the indices, video_path also the key.
INDEX_FIELDS = frozenset({"chunk_index", "file_index"})
VIDEO_FIELDS = INDEX_FIELDS | {"video_key"}
# The one format spec a placeholder may carry (SPEC §4.2): zero-padding an index to a width.
_ZERO_PADDED = re.compile(r"0[1-9][0-9]*d")


@dataclass(frozen=True, eq=False)
class DatasetMeta:
    """What refstream needs of one LeRobot v3.0 dataset; per-episode arrays in episode order."""

    fps: int  # frames per second of every episode and camera
    features: dict  # info.json "features", verbatim
    camera_keys: list[str]  # features with dtype "video", in info.json order
    parquet_keys: list[str]  # every other feature: the data Parquet columns a sample carries
    total_frames: int
    total_episodes: int
    episode_index: np.ndarray  # int64 episode ids, strictly increasing
    from_index: np.ndarray  # int64 dataset_from_index: global index of the first frame
    to_index: np.ndarray  # int64 dataset_to_index: one past the last frame
    length: np.ndarray  # int64 frames per episode (= to_index - from_index)
    data_chunk: np.ndarray  # int64 data/chunk_index
    data_file: np.ndarray  # int64 data/file_index
    video_chunk: dict[str, np.ndarray]  # camera -> int64 videos/K/chunk_index
    video_file: dict[str, np.ndarray]  # camera -> int64 videos/K/file_index
    video_from_s: dict[str, np.ndarray]  # camera -> float64 seconds, episode start in the file
    video_to_s: dict[str, np.ndarray]  # camera -> float64 seconds, episode end in the file
    tasks: list[str]  # task string of each task_index
    data_path: str  # info.json template, fields chunk_index and file_index
    video_path: str | None  # info.json template, fields video_key, chunk_index, file_index
    episodes_files: list[tuple[str, int]]  # each episodes file read and its row count
    stats: dict | None  # meta/stats.json as arrays (refstream.stats), None when absent
    # What a LeRobot trainer reads of LeRobotDatasetMetadata, under its names and types (fps,
    # features, camera_keys, total_*, stats above too): every key of info.json as an attribute
    # (its feature shapes tuples); the episodes table as {column: one value per row, in row
    # order} with the columns above, named as in the file, and each episode's "tasks" when every
    # episodes file has that column; LeRobot's keys by kind (image features are refused, §4.2).
    info: SimpleNamespace
    episodes: dict[str, np.ndarray | list]
    robot_type: str | None
    video_keys: list[str]
    image_keys: list[str]
    depth_keys: list[str]
    total_tasks: int
    has_language_columns: bool

    @functools.cached_property
    def _rows(self) -> dict[int, int]:
        return {episode: row for row, episode in enumerate(self.episode_index.tolist())}

    def row(self, episode: int) -> int:
        """Position of an episode id in the per-episode arrays (EpisodeSelectionError if absent)."""
        pos = self._rows.get(episode)
        if pos is None:
            raise EpisodeSelectionError(f"episode {episode} is not in the dataset")
        return pos

    def frames(self, episode: int) -> int:
        """Number of frames of an episode."""
        return int(self.length[self.row(episode)])

    def data_relpath(self, episode: int) -> str:
        """Root-relative path of the data Parquet file that holds an episode's rows."""
        row = self.row(episode)
        chunk, file = int(self.data_chunk[row]), int(self.data_file[row])
        return _format_path(self.data_path, "data_path", chunk, file)

    def video_relpath(self, episode: int, camera: str) -> str:
        """Root-relative path of the MP4 file that holds an episode's frames of one camera."""
        if camera not in self.video_chunk:
            raise UsageError(f"{camera!r} is not a camera of the dataset ({self.camera_keys})")
        row = self.row(episode)
        chunk, file = int(self.video_chunk[camera][row]), int(self.video_file[camera][row])
        return _format_path(self.video_path, "video_path", chunk, file, camera)

    def video_files(self) -> list[str]:
        """Every video file the episodes table names, of every camera, sorted."""
        return sorted(_format_path(self.video_path, "video_path", chunk, file, key)
                      for key in self.camera_keys
                      for chunk, file in _distinct_pairs(self.video_chunk[key],
                                                         self.video_file[key]))

    def episode_rows(self, source: Source, episodes: Sequence[int]) -> list[tuple[str, pa.Table]]:
        """Each episode's row of the episodes table, every column, beside the file it is in."""
        rows = [self.row(int(e)) for e in episodes]
        found: dict[int, tuple[str, pa.Table]] = {}
        first = 0
        for relpath, count in self.episodes_files:
            wanted = [row for row in rows if first <= row < first + count]
            if wanted:
                table = read_parquet(source, relpath)
                found.update((row, (relpath, table.slice(row - first, 1))) for row in wanted)
            first += count
        return [found[row] for row in rows]


def load_meta(source: Source) -> DatasetMeta:
    """The validated metadata of the dataset ``source`` reads (SPEC §4.2–4.4)."""
    info, cameras = _read_info(source)
    columns, episodes_files = _read_episodes(source, info, cameras)
    tasks = _read_tasks(source, info)
    meta = DatasetMeta(
        fps=info["fps"], features=info["features"], camera_keys=cameras,
        parquet_keys=[key for key in info["features"] if key not in cameras],
        total_frames=info["total_frames"], total_episodes=info["total_episodes"], tasks=tasks,
        data_path=info["data_path"], video_path=info["video_path"],
        episodes_files=episodes_files, stats=_read_stats(source),
        **{field: columns[name] for name, field in EPISODE_COLUMNS.items()},
        **{field: {key: columns[f"videos/{key}/{name}"] for key in cameras}
           for name, field in VIDEO_COLUMNS.items()},
        # LeRobot's view, under its names
        info=SimpleNamespace(**info), episodes=columns, robot_type=info.get("robot_type"),
        video_keys=cameras, image_keys=[], total_tasks=len(tasks),
        depth_keys=[],  # a depth map is refused (SPEC §4.2)
        has_language_columns=any(key in info["features"] for key in LANGUAGE_COLUMNS))
    _check_episodes(meta)
    return meta


def select_episodes(meta: DatasetMeta, episodes: Sequence[int] | None) -> list[int]:
    """The selected episode ids in ascending order; None selects every episode (SPEC §4.5)."""
    if episodes is None:
        return [int(e) for e in meta.episode_index]
    ids = episode_ids(episodes, EpisodeSelectionError)
    if not ids:
        raise EpisodeSelectionError("episodes=[] selects no episode")
    unknown = sorted(set(ids).difference(meta._rows))
    if unknown:
        raise EpisodeSelectionError(f"episodes not in the dataset: {unknown} "
                                    f"(it has {len(meta._rows)} episodes)")
    return sorted(ids)


# --- info.json ---------------------------------------------------------------------------------


def _read_info(source: Source) -> tuple[dict, list[str]]:
    """The ``info.json`` object and its camera keys, after SPEC §4.2's checks in their order."""
    info = parse_json(source.read_bytes(INFO_PATH), INFO_PATH)
    if not isinstance(info, dict):
        raise MalformedDataset(f"{INFO_PATH}: not a JSON object")
    _check_version(info)
    for key, least in (("fps", 1), ("total_episodes", 0), ("total_frames", 0), ("chunks_size", 1)):
        check_int(info.get(key), f"{INFO_PATH}: {key}", least, error=MalformedDataset)
    features = info.get("features")
    if not isinstance(features, dict) or not features:
        raise MalformedDataset(f"{INFO_PATH}: features must be a non-empty object")
    for key, feature in features.items():
        if not isinstance(feature, dict) or not isinstance(feature.get("dtype"), str):
            raise MalformedDataset(f"{INFO_PATH}: feature {key!r} has no string dtype")
        if isinstance(feature.get("shape"), list):  # LeRobot's type for a shape
            feature["shape"] = tuple(feature["shape"])
    for key, feature in features.items():
        if feature["dtype"] == "image":
            raise UnsupportedDataset(f"{INFO_PATH}: feature {key!r} has dtype 'image' (in "
                                     "Parquet); refstream streams only cameras stored as videos")
        if feature["dtype"] == "video" and _is_depth(feature):
            raise UnsupportedDataset(f"{INFO_PATH}: feature {key!r} is a depth map, which LeRobot "
                                     "decodes as 12-bit gray and dequantizes; refstream decodes "
                                     "RGB only: read this dataset with LeRobotDataset")
    cameras = [key for key, feature in features.items() if feature["dtype"] == "video"]
    _check_template(info.get("data_path"), "data_path", INDEX_FIELDS)
    if cameras or info.get("video_path") is not None:
        _check_template(info.get("video_path"), "video_path", VIDEO_FIELDS)
    info.setdefault("video_path", None)
    return info, cameras


def _is_depth(feature: dict) -> bool:  # whether LeRobot counts it among its depth_keys
    return any(isinstance(group, dict) and any(group.get(flag) for flag in _DEPTH_FLAGS)
               for group in (feature.get("info"), feature.get("video_info")))


# Python's json reads NaN, Infinity and -Infinity; JSON has no such tokens.
def _not_json(token: str) -> None:
    raise ValueError(f"{token} is not a JSON value")


def _check_version(info: dict) -> None:
    version = info.get("codebase_version")
    storage = info.get("storage_format", "parquet")
    if storage != "parquet":
        kind = "a Lance table's (read by lerobot-lancedb)" if storage == "lance" else "unknown"
        raise UnsupportedDataset(f"{INFO_PATH}: {kind} storage_format {storage!r}; refstream "
                                 "reads only Parquet + MP4 layouts")
    if not isinstance(version, str):
        raise MalformedDataset(f"{INFO_PATH}: codebase_version missing or not a string")
    if version != SUPPORTED_VERSION:
        hint = f"; convert it with LeRobot's `{CONVERT_HINT}`" if version.startswith("v2") else ""
        raise UnsupportedDataset(f"{INFO_PATH}: LeRobot {version} dataset; refstream reads "
                                 f"only LeRobot {SUPPORTED_VERSION}{hint}")


def _check_template(template: object, name: str, fields: frozenset[str]) -> None:
    """MalformedDataset unless ``template`` is valid over exactly ``fields`` (SPEC §4.2)."""
    if not isinstance(template, str):
        raise MalformedDataset(f"{INFO_PATH}: {name} must be a string, got {template!r}")
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise MalformedDataset(f"{INFO_PATH}: {name} {template!r} is not a template "
                               f"({exc})") from exc
    for _, field, spec, conversion in parsed:
        if field is None:
            continue
        padded = field in INDEX_FIELDS and _ZERO_PADDED.fullmatch(spec)
        if field not in fields or conversion is not None or not (spec == "" or padded):
            raise MalformedDataset(f"{INFO_PATH}: {name} {template!r}: placeholder {field!r} "
                                   f"is not allowed as written; allowed are {sorted(fields)} as "
                                   "{name}, an index also as {name:0Nd} (e.g. {chunk_index:03d})")
    missing = fields - {field for _, field, _, _ in parsed}
    if missing:
        raise MalformedDataset(f"{INFO_PATH}: {name} {template!r} lacks placeholder(s) "
                               f"{sorted(missing)}")


def _format_path(template: str, name: str, chunk: int, file: int, key: str | None = None) -> str:
    """A checked template (:func:`_check_template`) filled in; UnsafePath naming it."""
    try:  # (data_path has no video_key: format ignores it)
        return check_relpath(template.format(chunk_index=chunk, file_index=file, video_key=key))
    except UnsafePath as exc:
        raise UnsafePath(f"{INFO_PATH}: {name} {template!r} gives an unsafe {exc}") from None


# --- meta/episodes -----------------------------------------------------------------------------


def _read_episodes(source: Source, info: dict,
                   camera_keys: list[str]) -> tuple[dict[str, np.ndarray], list[tuple[str, int]]]:
    """The episode columns of every episodes file, concatenated, and each file's row count."""
    wanted = [*EPISODE_COLUMNS, *(f"videos/{k}/{n}" for k in camera_keys for n in VIDEO_COLUMNS)]
    total = info["total_episodes"]
    # Each column starts as an empty array of its type: with no episodes it is that array.
    parts = {c: [np.zeros(0, np.float64 if c.endswith("timestamp") else np.int64)] for c in wanted}
    files: list[tuple[str, int]] = []
    tasks = []  # each file's "tasks" column as lists of strings; None for a file without it
    rows, chunk, file = 0, 0, 0
    while rows < total:
        relpath = EPISODES_PATH.format(chunk_index=chunk, file_index=file)
        table = read_parquet(source, relpath, wanted, optional=["tasks"])
        tasks.append(table["tasks"].to_pylist() if "tasks" in table.column_names else None)
        if table.num_rows == 0:
            raise MalformedDataset(f"{relpath}: no episodes ({rows} of {total} read before it)")
        for column in wanted:
            parts[column].append(index_column(table, column, relpath))
        rows += table.num_rows
        files.append((relpath, table.num_rows))
        # LeRobot's rollover (SPEC §4.3)
        chunk, file = (chunk + 1, 0) if file == info["chunks_size"] - 1 else (chunk, file + 1)
    if rows != total:
        raise MalformedDataset(f"meta/episodes: {rows} episode rows, but {INFO_PATH} "
                               f"total_episodes is {total}")
    columns = {column: np.concatenate(arrays) for column, arrays in parts.items()}
    if None not in tasks:
        columns["tasks"] = [episode for part in tasks for episode in part]
    return columns, files


def read_parquet(source: Source, relpath: str, columns: list[str] | None = None,
                 optional: Sequence[str] = ()) -> pa.Table:
    """A whole Parquet file's ``columns`` (None: all) and those of ``optional`` it has;
    MalformedDataset if one of ``columns`` is missing."""
    data = source.read_bytes(relpath)
    try:
        present = set(pq.read_schema(pa.BufferReader(data)).names)
        missing = [c for c in columns or [] if c not in present]
        if missing:
            raise MalformedDataset(f"{relpath}: missing column(s) {missing}")
        if columns is not None:
            columns = columns + [c for c in optional if c in present]
        # Arrow's own reader of the bytes, on this thread: a Python file object read by Arrow's
        # thread pool can abort the interpreter at exit (apache/arrow#34314).
        return pq.read_table(pa.BufferReader(data), columns=columns, use_threads=False)
    except (pa.ArrowException, OSError) as exc:
        raise MalformedDataset(f"{relpath}: not a readable Parquet file ({exc})") from exc


def column_array(column: pa.ChunkedArray, where: str, name: str,
                 error: type[DatasetError] = TableError) -> np.ndarray:
    """Parquet column ``name`` as a numpy array, one entry per row, lists of one length as extra
    axes (``float32[6]`` → ``(rows, 6)``); else ``error`` naming ``where`` and the column."""
    if column.null_count:
        raise error(f"{where}: column {name!r} has {column.null_count} null(s)")
    array = column.combine_chunks()
    shape = [len(array)]
    while pa.types.is_fixed_size_list(array.type):
        shape.append(array.type.list_size)
        array = array.flatten()
    if pa.types.is_list(array.type) or pa.types.is_large_list(array.type):
        # Variable-length lists whose rows all have one length (how some writers store vectors).
        try:  # rows of different lengths: numpy refuses them, or keeps them as objects
            values = np.array(array.to_pylist())
        except ValueError:
            values = None
        if values is None or values.dtype == object:
            raise error(f"{where}: column {name!r} is ragged")
        return values.reshape(shape + list(values.shape[1:]))
    try:
        values = array.to_numpy(zero_copy_only=False)
    except (pa.ArrowException, ValueError) as exc:
        raise error(f"{where}: column {name!r} of type {column.type} has no numeric form") from exc
    return values.reshape(shape)


def index_column(table: pa.Table, name: str, where: str) -> np.ndarray:
    """An integer column as int64, or a ``*timestamp`` column as float64 seconds (SPEC §4.3)."""
    seconds = name.endswith("timestamp")
    kind = table[name].type
    if not (pa.types.is_integer(kind) or seconds and pa.types.is_floating(kind)):
        raise MalformedDataset(f"{where}: column {name!r} has type {kind}")
    values = column_array(table[name], where, name, MalformedDataset)
    return values.astype(np.float64 if seconds else np.int64)


def _check_episodes(meta: DatasetMeta) -> None:
    """SPEC §4.3 checks 1–6 of the episodes table: MalformedDataset, or UnsafePath (check 6)."""
    ids, frames, where = meta.episode_index, meta.to_index - meta.from_index, "meta/episodes"
    if (i := _first(ids[:1] < 0)) is not None:
        raise MalformedDataset(f"{where}: negative episode_index {int(ids[i])}")
    if (i := _first(np.diff(ids) <= 0)) is not None:
        raise MalformedDataset(f"{where}: episode_index not strictly increasing: {int(ids[i])} "
                               f"then {int(ids[i + 1])} (ids must be unique and sorted)")
    if (i := _first((frames != meta.length) | (meta.from_index < 0) | (frames < 0))) is not None:
        raise MalformedDataset(f"{where}: episode {int(ids[i])}: dataset_to_index - dataset_"
                               f"from_index = {int(meta.to_index[i])} - {int(meta.from_index[i])}"
                               f" = {int(frames[i])}, but length is {int(meta.length[i])}")
    if int(frames.sum()) != meta.total_frames:
        raise MalformedDataset(f"{where}: episodes hold {int(frames.sum())} frames, but "
                               f"{INFO_PATH} total_frames is {meta.total_frames}")
    for key in meta.camera_keys:
        start, end = meta.video_from_s[key], meta.video_to_s[key]
        # 0 <= start <= end leaves start finite unless end is infinite.
        if (i := _first(~((start >= 0) & (end >= start) & np.isfinite(end)))) is not None:
            raise MalformedDataset(f"{where}: episode {int(ids[i])}: videos/{key} from_timestamp "
                                   f"{float(start[i])!r} / to_timestamp {float(end[i])!r} is not "
                                   "0 <= from <= to")
    indices = [("data", meta.data_chunk, meta.data_file)]
    indices += [(f"videos/{k}", meta.video_chunk[k], meta.video_file[k]) for k in meta.camera_keys]
    for name, chunks, files in indices:
        if (i := _first((chunks < 0) | (files < 0))) is not None:
            raise MalformedDataset(f"{where}: episode {int(ids[i])}: {name} chunk/file index < 0")
    # Check 6: every distinct (chunk, file) pair formatted once.
    for chunk, file in _distinct_pairs(meta.data_chunk, meta.data_file):
        _format_path(meta.data_path, "data_path", chunk, file)
    meta.video_files()


def _first(bad: np.ndarray) -> int | None:
    """The first row where ``bad`` is true, None when none is."""
    rows = np.flatnonzero(bad)
    return int(rows[0]) if len(rows) else None


def _distinct_pairs(chunks: np.ndarray, files: np.ndarray) -> list[tuple[int, int]]:
    return sorted(set(zip(chunks.tolist(), files.tolist(), strict=True)))


def _read_stats(source: Source) -> dict | None:
    """``meta/stats.json`` as arrays (SPEC §4.7), None when the dataset has none."""
    data = source.read_if_present(STATS_PATH)
    if data is None:
        return None
    return parse_stats(parse_json(data, STATS_PATH, allow_nan=True))  # as LeRobot writes it


def parse_json(data: bytes, relpath: str, allow_nan: bool = False,
               error: type[RefstreamError] = MalformedDataset) -> object:
    """The JSON value of metadata file ``relpath`` (SPEC §4.2), ``NaN`` only with ``allow_nan``."""
    try:
        return json.loads(data.decode("utf-8"), parse_constant=None if allow_nan else _not_json)
    except (ValueError, RecursionError) as exc:  # (UnicodeDecodeError is a ValueError)
        raise error(f"{relpath}: not valid JSON ({exc}); it must be UTF-8 JSON "
                               "(RFC 8259) without a byte-order mark") from exc


# --- meta/tasks.parquet ------------------------------------------------------------------------


def _read_tasks(source: Source, info: dict) -> list[str]:
    """Task strings by task_index (SPEC §4.4)."""
    table = read_parquet(source, TASKS_PATH, ["task_index", "task"])
    if table["task"].null_count or table["task"].type not in (pa.string(), pa.large_string()):
        raise MalformedDataset(f"{TASKS_PATH}: column 'task' must hold strings without nulls")
    index = index_column(table, "task_index", TASKS_PATH)
    if sorted(index.tolist()) != list(range(len(index))):
        raise MalformedDataset(f"{TASKS_PATH}: task_index values {sorted(index.tolist())} are "
                               f"not 0..{len(index) - 1}")
    total = info.get("total_tasks")
    if total is not None and not (is_int(total) and total == len(index)):
        raise MalformedDataset(f"{TASKS_PATH}: {len(index)} tasks, but {INFO_PATH} total_tasks "
                               f"is {total!r} (it must be the integer {len(index)} or absent)")
    rows = sorted(zip(index.tolist(), table["task"].to_pylist(), strict=True))
    return [text for _, text in rows]  # by task_index, a permutation of 0 … n-1
