"""``refstream doctor``: is a dataset safe to train on? Checked before anyone trains (SPEC §11).

``check_dataset(source, root=root)`` only reads the dataset and returns a :class:`Report` (a
broken dataset gives failed checks, no raise): one :class:`Check` row per check, in
:data:`CHECK_NAMES` order, each the rule of its section of SPEC §11. The checks use streaming's
own rules: the rows are converted as streaming converts them, a video frame serves a time by the
one rule of :mod:`refstream.synth`, and decoding is refstream's decoder on mini-MP4s made as
streaming makes them. A check lists its first :data:`MAX_LISTED_PROBLEMS` problems and counts all.
"""

from __future__ import annotations

import io
import sys
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from refstream import errors, sidecar, synth, windows
from refstream.decode import EpisodeDecoder
from refstream.meta import DatasetMeta, column_array, index_column, load_meta
from refstream.mp4 import SampleIndex, parse_index
from refstream.source import RangeFile, Source

__all__ = ["check_dataset", "Report", "Check", "episode_tiling"]

MAX_LISTED_PROBLEMS = 20  # enough to see a pattern; the count says how many more there are
CHECK_NAMES = ("metadata", "episode boundaries", "data rows", "videos", "sidecar", "decoding")
DECODE_MODES = ("keyframes", "all")  # what the decoding check decodes (SPEC §11.7)
# info.json's video.codec (FFmpeg's canonical name, as LeRobot writes it) of a sample entry.
CODECS = {"av01": "av1", "avc1": "h264", "avc3": "h264", "hvc1": "hevc", "hev1": "hevc",
          "vp09": "vp9", "mp4v": "mpeg4"}
# Data columns read by the rows check; task_index only when the file has it.
ROW_COLUMNS = ("episode_index", "frame_index", "index", "timestamp")
TASK_COLUMN = "task_index"

Tick = Callable[[str], None]  # called once per file read, with its relpath


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str
    problems: list[str] = field(default_factory=list)  # the first MAX_LISTED_PROBLEMS found
    problem_count: int = 0  # every problem found (>= len(problems))
    skipped: bool = False  # not run because the metadata could not be loaded (ok is False)

    @property
    def status(self) -> str:
        return "skipped" if self.skipped else "ok" if self.ok else "FAIL"


@dataclass(frozen=True)
class Report:
    """Every check of one dataset, in :data:`CHECK_NAMES` order."""

    root: str
    checks: list[Check]
    not_checked: list[str] = field(default_factory=list)  # what the checks did not cover

    @property
    def ok(self) -> bool:
        """True when every check passed (safe to train if ``not_checked`` is empty too)."""
        return all(check.ok for check in self.checks)

    def as_dict(self) -> dict:
        """JSON-ready, the shape of SPEC §11.1."""
        checks = [{"name": c.name, "status": c.status, "ok": c.ok, "detail": c.detail,
                   "problems": list(c.problems), "problem_count": c.problem_count}
                  for c in self.checks]
        return {"root": self.root, "ok": self.ok, "checks": checks,
                "not_checked": list(self.not_checked)}

    def table(self) -> str:
        """A plain-text table (check, status, detail) with each check's problems under it."""
        name_width = max(len("check"), *(len(c.name) for c in self.checks))
        lines = [f"{'check':<{name_width}}  status   detail"]
        for c in self.checks:
            lines.append(f"{c.name:<{name_width}}  {c.status:<7}  {c.detail}")
            lines += [f"{'':<{name_width}}    - {problem}" for problem in c.problems]
            if c.problem_count > len(c.problems):
                lines.append(f"{'':<{name_width}}    … and {c.problem_count - len(c.problems)} "
                             "more")
        lines += [f"not checked: {what}" for what in self.not_checked]
        verdict = ("NOT safe to train" if not self.ok else "safe to train" if not
                   self.not_checked else "no problem found, but not everything was checked")
        lines.append(f"{self.root}: {verdict}")
        return "\n".join(lines)


class _Problems:
    """Collects problems: keeps the first MAX_LISTED_PROBLEMS, counts them all."""

    def __init__(self) -> None:
        self.listed: list[str] = []
        self.count = 0

    def add(self, message: str) -> None:
        self.count += 1
        if len(self.listed) < MAX_LISTED_PROBLEMS:
            self.listed.append(message)

    def check(self, name: str, detail: str) -> Check:
        return Check(name, self.count == 0, detail, self.listed, self.count)


def check_dataset(source: Source, *, root: str | Path | None = None, tolerance_s: float = 1e-4,
                  progress: bool | None = None, cache_root: str | Path | None = None,
                  decode: str = "keyframes") -> Report:
    """The report of every check on ``source``, named by ``root`` (as training is given it);
    ``progress``: a bar on stderr (None: if it is a terminal); ``cache_root`` as
    :func:`refstream.sidecar.cache_folder` takes it; ``decode``: one of :data:`DECODE_MODES`."""
    tolerance_s = windows.check_tolerance(tolerance_s)
    if decode not in DECODE_MODES:
        raise errors.UsageError(f"decode must be one of {DECODE_MODES}, got {decode!r}")
    label = str(root) if root is not None else repr(source)
    try:
        meta = load_meta(source)
    except errors.RefstreamError as exc:
        return unreadable(label, exc)
    video_relpaths = meta.video_files()
    files = len(set(meta.data_relpath(int(e)) for e in meta.episode_index))
    not_checked: list[str] = []
    with _progress_bar(files + 2 * len(video_relpaths), progress) as tick:
        checks = [_check_metadata(meta), _check_boundaries(meta)]
        rows_check, timestamps = _check_rows(source, meta, tick)
        videos_check, indexes = _check_videos(source, meta, timestamps, tolerance_s, tick,
                                              not_checked)
        decoding = _check_decoding(source, meta, indexes, timestamps, tolerance_s, decode, tick,
                                   not_checked)
    checks += [rows_check, videos_check,
               _check_sidecar(source, video_relpaths, cache_root, indexes), decoding]
    return Report(label, checks, list(dict.fromkeys(not_checked)))


def unreadable(label: str, exc: errors.RefstreamError) -> Report:
    """The report on a dataset whose metadata cannot be read (or whose root cannot be opened):
    the metadata check fails with the error, every other check is skipped."""
    failed = Check("metadata", False, "cannot load the metadata",
                   [f"{type(exc).__name__}: {exc}"], 1)
    skipped = [Check(name, False, "skipped: needs the metadata", skipped=True)
               for name in CHECK_NAMES[1:]]
    return Report(label, [failed, *skipped])


@contextmanager
def _progress_bar(total: int, show: bool | None) -> Iterator[Tick]:
    from tqdm import tqdm

    show = sys.stderr.isatty() if show is None else show
    with tqdm(total=total, unit="file", desc="refstream doctor", file=sys.stderr,
              disable=not show) as bar:
        def tick(relpath: str) -> None:
            bar.set_postfix_str(relpath, refresh=False)
            bar.update(1)

        yield tick


# --- 1. metadata and 2. boundaries -----------------------------------------------------------


def _check_metadata(meta: DatasetMeta) -> Check:
    problems = _Problems()
    if meta.total_episodes == 0:
        problems.add("meta/info.json: total_episodes is 0: nothing to train on")
    cameras = ", ".join(meta.camera_keys) or "none"
    return problems.check("metadata", f"v3.0, {meta.total_episodes} episodes, "
                          f"{meta.total_frames} frames, fps {meta.fps}, cameras: {cameras}")


@dataclass(frozen=True)
class Tiling:
    """How the episodes cover the frames; they tile ``[0, total_frames)`` iff ``gaps`` and
    ``overlaps`` are empty and ``covered_to == total_frames``."""

    # (start, end, episode before or None, episode after or None): frames [start, end) that no
    # episode holds, in frame order; a trailing gap [covered_to, total_frames) has no after.
    gaps: list[tuple[int, int, int | None, int | None]]
    # (episode, earlier episode, start, end): frames [start, end) of `episode` that the earlier
    # episode (the one reaching furthest so far) also holds; start == end for an empty episode
    # lying inside the earlier one.
    overlaps: list[tuple[int, int, int, int]]
    covered_to: int  # one past the last frame any episode holds (0 without episodes)


def episode_tiling(episode_index: np.ndarray, from_index: np.ndarray, to_index: np.ndarray,
                   total_frames: int) -> Tiling:
    """Walk the episodes by (start, end, id) and record where they leave gaps or overlap."""
    gaps, overlaps = [], []
    # By start, then end: an empty episode sorts before a non-empty one starting with it.
    order = np.lexsort((episode_index, to_index, from_index))
    covered_to, last = 0, None  # frames [0, covered_to) are held; `last` reaches furthest
    for row in order.tolist():
        episode, start, end = int(episode_index[row]), int(from_index[row]), int(to_index[row])
        if start > covered_to:
            gaps.append((covered_to, start, last, episode))
        elif start < covered_to:
            overlaps.append((episode, last, start, min(end, covered_to)))
        if end > covered_to or last is None:
            covered_to, last = max(end, covered_to), episode
    if covered_to < total_frames:
        gaps.append((covered_to, total_frames, last, None))
    return Tiling(gaps, overlaps, covered_to)


def _check_boundaries(meta: DatasetMeta) -> Check:
    problems = _Problems()
    tiling = episode_tiling(meta.episode_index, meta.from_index, meta.to_index, meta.total_frames)
    faults = [(start, f"gap: frames [{start}, {end}) belong to no episode ("
               + (f"after episode {before}" if before is not None else "at the start")
               + (f", before episode {after})" if after is not None else ", at the end)"))
              for start, end, before, after in tiling.gaps]
    for episode, other, start, end in tiling.overlaps:
        row, other_row = meta.row(episode), meta.row(other)
        span = f"[{int(meta.from_index[row])}, {int(meta.to_index[row])})"
        other_span = f"[{int(meta.from_index[other_row])}, {int(meta.to_index[other_row])})"
        shared = f"share frames [{start}, {end})" if end > start else (
            f"the empty one lies inside the other at frame {start}")
        faults.append((start, f"overlap: episode {episode} {span} and episode {other} "
                              f"{other_span}: {shared}"))
    for _, message in sorted(faults, key=lambda fault: fault[0]):
        problems.add(message)
    if tiling.covered_to > meta.total_frames:
        problems.add(f"the episodes reach frame {tiling.covered_to}, past total_frames "
                     f"{meta.total_frames}")
    return problems.check("episode boundaries",
                          f"{meta.total_episodes} episodes over [0, {meta.total_frames})")


# --- 3. data rows ----------------------------------------------------------------------------


def _check_rows(source: Source, meta: DatasetMeta,
                tick: Tick) -> tuple[Check, dict[int, np.ndarray]]:
    """The rows check, and each episode's float64 timestamps in frame order where readable."""
    problems = _Problems()
    home = {episode: meta.data_relpath(episode) for episode in meta.episode_index.tolist()}
    placed: dict[str, list[int]] = {}
    for episode, relpath in home.items():
        placed.setdefault(relpath, []).append(episode)
    timestamps: dict[int, np.ndarray] = {}
    rows_read = 0
    for relpath, episodes in placed.items():
        columns = _read_row_columns(source, relpath, meta.parquet_keys, problems)
        tick(relpath)
        if columns is None:
            continue
        rows_read += len(columns["episode_index"])
        _check_file_rows(meta, relpath, episodes, home, columns, problems, timestamps)
    return problems.check(
        "data rows", f"{len(placed)} data files, {rows_read} rows read"), timestamps


def _read_row_columns(source: Source, relpath: str, features: list[str],
                      problems: _Problems) -> dict[str, np.ndarray] | None:
    """The row columns of one data file as numpy arrays, or None after adding a problem; every
    feature column is converted as streaming converts it (``meta.column_array``)."""
    try:
        parquet = pq.ParquetFile(RangeFile(source, relpath))
        names = parquet.schema_arrow.names
        absent_features = [key for key in features if key not in names]
        if absent_features:
            problems.add(f"{relpath}: feature column(s) {absent_features} of meta/info.json "
                         "are not in the file")
        missing = [c for c in ROW_COLUMNS if c not in names]
        if missing:
            problems.add(f"{relpath}: missing column(s) {missing}")
            return None
        wanted = [*ROW_COLUMNS, *([TASK_COLUMN] if TASK_COLUMN in names else [])]
        wanted += [key for key in features if key in names and key not in wanted]
    except errors.RefstreamError as exc:
        problems.add(f"{relpath}: {type(exc).__name__}: {exc}")
        return None
    except (pa.ArrowException, OSError) as exc:
        problems.add(f"{relpath}: not a readable Parquet file ({exc})")
        return None
    columns = {}
    for name in wanted:
        try:
            # One thread: reads go through a Python file object, and Arrow's thread pool can
            # abort or hang the interpreter at exit after such reads (apache/arrow#34314).
            table = parquet.read(columns=[name], use_threads=False)
            if name in ROW_COLUMNS or name == TASK_COLUMN:
                columns[name] = index_column(table, name, relpath)
            else:
                column_array(table[name], relpath, name)
        except errors.RefstreamError as exc:
            problems.add(str(exc) if isinstance(exc, errors.DatasetError) else
                         f"{relpath}: column {name!r}: {type(exc).__name__}: {exc}")
        except (pa.ArrowException, OSError) as exc:
            problems.add(f"{relpath}: column {name!r} does not decode ({exc})")
    return columns if set(ROW_COLUMNS) <= set(columns) else None


def _check_file_rows(meta: DatasetMeta, relpath: str, episodes: list[int],
                     home: dict[int, str], columns: dict[str, np.ndarray],
                     problems: _Problems, timestamps: dict[int, np.ndarray]) -> None:
    ids = columns["episode_index"]
    order = np.argsort(ids, kind="stable")  # stable: each episode's rows stay in file order
    present, starts, counts = np.unique(ids[order], return_index=True, return_counts=True)
    rows_of = {int(e): order[s : s + n] for e, s, n in zip(present, starts, counts, strict=True)}
    for episode in sorted(set(rows_of) - set(episodes)):
        where = (f"which meta/episodes places in {home[episode]}" if episode in home
                 else "which is not in meta/episodes")
        problems.add(f"{relpath}: {len(rows_of[episode])} row(s) of episode {episode}, {where}")
    for episode in episodes:
        rows = rows_of.get(episode, np.zeros(0, np.int64))
        length = meta.frames(episode)
        where = f"{relpath}: episode {episode}"
        if len(rows) != length:
            what = "missing" if len(rows) < length else "extra"
            problems.add(f"{where}: {len(rows)} rows, meta/episodes length is {length} "
                         f"({abs(length - len(rows))} {what})")
        frames = columns["frame_index"][rows]
        bad = np.flatnonzero(frames != np.arange(len(rows)))
        if len(bad):
            k = int(bad[0])
            problems.add(f"{where}: frame_index not contiguous 0..{len(rows) - 1} in file order: "
                         f"row {k} of the episode has frame_index {int(frames[k])}")
        first_index = int(meta.from_index[meta.row(episode)])
        bad = np.flatnonzero(columns["index"][rows] != first_index + frames)
        if len(bad):
            k = int(bad[0])
            problems.add(f"{where}: index {int(columns['index'][rows[k]])} at frame_index "
                         f"{int(frames[k])}, expected dataset_from_index {first_index} + "
                         f"frame_index = {first_index + int(frames[k])}")
        seconds = columns["timestamp"][rows]
        bad = np.flatnonzero(~np.isfinite(seconds))
        if len(bad):
            problems.add(f"{where}: timestamp {seconds[bad[0]]} at row {int(bad[0])} of the "
                         "episode is not finite")
        if TASK_COLUMN in columns:
            tasks = columns[TASK_COLUMN][rows]
            bad = np.flatnonzero((tasks < 0) | (tasks >= len(meta.tasks)))
            if len(bad):
                problems.add(f"{where}: task_index {int(tasks[bad[0]])} is not one of the "
                             f"{len(meta.tasks)} tasks of meta/tasks.parquet")
        if len(rows):
            timestamps[episode] = seconds


# --- 4. videos -------------------------------------------------------------------------------


def _video_users(meta: DatasetMeta) -> dict[str, list[tuple[int, str]]]:
    users: dict[str, list[tuple[int, str]]] = {}
    for episode in meta.episode_index.tolist():
        for camera in meta.camera_keys:
            users.setdefault(meta.video_relpath(episode, camera), []).append((episode, camera))
    return users


def _check_videos(source: Source, meta: DatasetMeta, timestamps: dict[int, np.ndarray],
                  tolerance_s: float, tick: Tick,
                  not_checked: list[str]) -> tuple[Check, dict[str, SampleIndex]]:
    """The videos check, and the index of every video file that parsed."""
    problems = _Problems()
    users = _video_users(meta)
    indexes: dict[str, SampleIndex] = {}
    requests = 0
    for relpath in sorted(users):
        _check_windows_disjoint(meta, relpath, users[relpath], tolerance_s, problems)
        try:
            size = source.size(relpath)
            indexes[relpath] = parse_index(
                lambda offset, length, p=relpath: source.read_range(p, offset, length),
                size, relpath)
        except errors.RefstreamError as exc:
            episodes = sorted({episode for episode, _ in users[relpath]})
            problems.add(f"{relpath} ({_ids(episodes)}): {type(exc).__name__}: {exc}")
            continue
        finally:
            tick(relpath)
        for problem in _track_problems(meta, users[relpath][0][1], indexes[relpath],
                                       not_checked):
            problems.add(f"{relpath}: {problem}")
        try:
            synth.check_frame_rate(indexes[relpath].pts, indexes[relpath].timescale, meta.fps,
                                   relpath)
        except errors.MalformedDataset as exc:
            problems.add(str(exc))
            continue  # every request time of the file is off its frames
        for episode, camera in users[relpath]:
            seconds = timestamps.get(episode)
            if seconds is None:
                seconds = np.arange(meta.frames(episode), dtype=np.float64) / meta.fps
            requests += len(seconds)
            problem = _episode_video_problem(meta, indexes, episode, camera, seconds, tolerance_s)
            if problem is not None:
                problems.add(f"episode {episode}, camera {camera}, {relpath}: {problem}")
    return problems.check("videos", f"{len(users)} video files, {requests} request times, "
                          f"tolerance {tolerance_s} s"), indexes


def _track_problems(meta: DatasetMeta, camera: str, index: SampleIndex,
                    not_checked: list[str]) -> list[str]:
    """Where meta/info.json disagrees with a video track of ``camera``: height and width, codec."""
    problems = []
    feature = meta.features[camera]
    info, shape, names = feature.get("info") or {}, feature.get("shape"), feature.get("names")
    sizes = {}  # where info.json says it -> (height, width)
    if isinstance(shape, list) and isinstance(names, list) and len(shape) == len(names) \
            and {"height", "width"} <= set(names):
        sizes["shape"] = (shape[names.index("height")], shape[names.index("width")])
    if "video.height" in info and "video.width" in info:
        sizes["video.height/width"] = (info["video.height"], info["video.width"])
    if not sizes:
        not_checked.append(f"meta/info.json gives no height and width of {camera}")
    if any(size != (index.height, index.width) for size in sizes.values()):
        said = " and ".join(f"{h}x{w} in {where}" for where, (h, w) in sizes.items())
        problems.append(f"meta/info.json says camera {camera} is {said} (height x width), the "
                        f"video track is {index.height}x{index.width}")
    declared = info.get("video.codec")
    if declared is not None and index.codec not in CODECS:
        not_checked.append(f"the codec of {camera} ({index.codec}) against info.json's {declared}")
    elif declared is not None and CODECS[index.codec] != declared:
        problems.append(f"meta/info.json says camera {camera} is {declared}, the video track is "
                        f"{index.codec} ({CODECS[index.codec]})")
    return problems


def _check_windows_disjoint(meta: DatasetMeta, relpath: str, users: list[tuple[int, str]],
                            tolerance_s: float, problems: _Problems) -> None:
    """Episodes sharing a video file must claim disjoint ``[from_timestamp, to_timestamp)``
    windows (beyond ``tolerance_s``): else one is served the other's frames, silently."""
    claimed = sorted((float(meta.video_from_s[camera][meta.row(episode)]),
                      float(meta.video_to_s[camera][meta.row(episode)]), episode)
                     for episode, camera in users)
    furthest = None  # the window reaching furthest so far, as in the episode tiling
    for window in claimed:
        if furthest is not None and window[0] < furthest[1] - tolerance_s:
            problems.add(f"{relpath}: episodes {furthest[2]} [{furthest[0]}, {furthest[1]}) s "
                         f"and {window[2]} [{window[0]}, {window[1]}) s overlap: one would be "
                         "served the other's frames")
        if furthest is None or window[1] > furthest[1]:
            furthest = window


def _episode_video_problem(meta: DatasetMeta, indexes: dict[str, SampleIndex], episode: int,
                           camera: str, seconds: np.ndarray, tolerance_s: float) -> str | None:
    """What keeps one episode's frames of one camera from being served (SPEC §11.5), or None:
    an unserved request time, or one outside the span streaming plans from nominal times."""
    try:
        synth.episode_spans(meta, episode, indexes, tolerance_s, seconds, [camera])
    except errors.FrameNotFound as exc:
        return str(exc).removeprefix(f"{meta.video_relpath(episode, camera)}: ")
    try:
        planned = synth.episode_spans(meta, episode, indexes, tolerance_s, cameras=[camera])
    except errors.FrameNotFound as exc:
        return (f"the nominal times from_timestamp + frame_index / fps that streaming plans "
                f"with are not all served ({exc})")
    try:
        synth.serving_pts(meta, episode, planned, tolerance_s, seconds)
    except errors.TableError as exc:
        return str(exc)
    return None


def _ids(episodes: list[int], shown: int = 10) -> str:
    """``episode 3`` or ``episodes 0, 1, …`` (the first ``shown`` of them, then the count)."""
    text = ", ".join(str(e) for e in episodes[:shown])
    more = f", … ({len(episodes)} in all)" if len(episodes) > shown else ""
    return f"episode{'s' if len(episodes) > 1 else ''} {text}{more}"


# --- 5. sidecar ------------------------------------------------------------------------------


def _check_sidecar(source: Source, relpaths: list[str], cache_root: str | Path | None,
                   indexes: dict[str, SampleIndex]) -> Check:
    if not relpaths:
        return Check("sidecar", True, "no video files: nothing to index")
    try:
        identities = source.content_identities(relpaths)
    except errors.RefstreamError as exc:
        return Check("sidecar", False, f"skipped: the video files' sizes and identities cannot "
                     f"be read ({type(exc).__name__}: {exc})", skipped=True)
    problems, notes, found = _Problems(), [], set()
    try:
        for label, relpath, record in _sidecar_records(source, identities, cache_root):
            size, identity = identities[relpath]
            try:
                stored = sidecar.read_record(record, size, identity, relpath, verify=True)
            except errors.SidecarInvalid as exc:
                notes.append(f"{label} is not valid, so training ignores it and indexes "
                             f"{relpath} again ({exc})")
                continue
            found.add(relpath)
            if relpath in indexes:
                _compare_record(f"{label}: {relpath}", stored, indexes[relpath], problems)
    except (errors.RefstreamError, *sidecar.CORRUPT_ZIP) as exc:
        notes.append(f"{sidecar.PUBLISHED_RELPATH} is not readable, so training ignores it "
                     f"({type(exc).__name__}: {exc})")
    notes.append(f"{len(found)} of {len(identities)} video files have a valid index record, "
                 "compared with the files")
    if len(found) < len(identities):
        notes.append("training indexes the others when it first opens the dataset")
    return problems.check("sidecar", "; ".join(notes))


def _sidecar_records(source: Source, identities: dict[str, tuple[int, str]],
                     cache_root: str | Path | None) -> Iterator[tuple[str, str, object]]:
    """(label, relpath, record file or bytes) of every record training could use: the cache's,
    then the published index's."""
    folder = sidecar.cache_folder(cache_root)
    stable = {relpath: sidecar.record_name(size, identity)
              for relpath, (size, identity) in identities.items() if identity}
    for relpath, name in stable.items():
        if (folder / name).exists():
            yield f"cache {folder / name}", relpath, folder / name
    size = source.size_if_present(sidecar.PUBLISHED_RELPATH)
    if size is None:
        return
    with zipfile.ZipFile(RangeFile(source, sidecar.PUBLISHED_RELPATH, size)) as archive:
        members = set(archive.namelist())
        for relpath, name in stable.items():
            if name in members:
                yield f"{sidecar.PUBLISHED_RELPATH} {name}", relpath, io.BytesIO(archive.read(name))


def _compare_record(where: str, stored: SampleIndex, parsed: SampleIndex,
                    problems: _Problems) -> None:
    """Every field a record holds must equal what parse_index reads from the file now."""
    for name in ("file_size", "ftyp", "stsd", *sidecar.SCALAR_FIELDS):
        if getattr(stored, name) != getattr(parsed, name):
            problems.add(f"{where}: {name} is {getattr(stored, name)!r}, the file has "
                         f"{getattr(parsed, name)!r}")
    if len(stored) != len(parsed):
        problems.add(f"{where}: {len(stored)} samples, the file has {len(parsed)}")
        return
    for name in sidecar.ARRAY_FIELDS:
        values, actual = getattr(stored, name), getattr(parsed, name)
        bad = np.flatnonzero(values != actual)
        if len(bad):
            k = int(bad[0])
            problems.add(f"{where}: {name}[{k}] is {values[k]!r}, the file has {actual[k]!r} "
                         f"({len(bad)} samples differ)")


# --- 6. decoding -----------------------------------------------------------------------------


def _check_decoding(source: Source, meta: DatasetMeta, indexes: dict[str, SampleIndex],
                    timestamps: dict[int, np.ndarray], tolerance_s: float, decode: str,
                    tick: Tick, not_checked: list[str]) -> Check:
    """Decode, with refstream's own decoder, mini-MP4s made as streaming makes them: each
    keyframe of every indexed file alone, or every frame the episodes' rows request."""
    problems, tried, samples = _Problems(), 0, 0  # tried: frames asked of the decoder
    pyav = f"PyAV {version('av')}"
    users = _video_users(meta)
    for relpath, index in sorted(indexes.items()):
        samples += len(index)
        jobs = (_keyframe_jobs(relpath, index) if decode == "keyframes" else
                _request_jobs(meta, relpath, index, users[relpath], timestamps, tolerance_s))
        for label, span, pts in jobs:
            tried += len(pts)
            try:
                payload = source.read_range(relpath, span.byte_offset, span.byte_length)
                with EpisodeDecoder(synth.synthesize(index, span, payload), label,
                                    span.start_pts) as decoder:
                    decoder.frames(pts)
            except errors.RefstreamError as exc:
                problems.add(f"{label}: {type(exc).__name__}: "
                             f"{str(exc).removeprefix(f'{label}: ')}")
            except Exception as exc:  # not the data's fault: the decoder itself fails
                problems.add(f"refstream cannot decode with the installed {pyav}: "
                             f"{type(exc).__name__}: {exc} (at {label}); decoding stopped there")
                not_checked.append("decoding: stopped at the first failure of the decoder")
                return problems.check("decoding", f"stopped where the decoder failed ({pyav})")
        tick(relpath)
    if decode == "keyframes":
        not_checked.append(f"decoding: {samples - tried} of {samples} frames, those that are "
                           "not keyframes (--decode all decodes every frame the rows request)")
        what = f"every keyframe, each alone: {tried} of {samples} frames"
    else:
        what = f"every frame the rows request: {tried} frames, from their episodes' spans"
    return problems.check("decoding", f"{what} of {len(indexes)} video files ({pyav})")


Job = tuple[str, synth.Span, np.ndarray]  # label, the span made a mini-MP4, the pts to decode


def _keyframe_jobs(relpath: str, index: SampleIndex) -> Iterator[Job]:
    for sample in np.flatnonzero(index.keyframe).tolist():
        yield (f"{relpath} keyframe (sample {sample})", synth.span_of(index, sample, sample),
               index.pts[sample : sample + 1])


def _request_jobs(meta: DatasetMeta, relpath: str, index: SampleIndex,
                  users: list[tuple[int, str]], timestamps: dict[int, np.ndarray],
                  tolerance_s: float) -> Iterator[Job]:
    """Each episode's span and the frames serving its rows (the episodes the videos check
    passed: the others fail there)."""
    for episode, camera in users:
        seconds = timestamps.get(episode)
        if seconds is None:
            continue  # its rows failed the rows check
        try:
            spans = synth.episode_spans(meta, episode, {relpath: index}, tolerance_s, seconds,
                                        [camera])
        except errors.RefstreamError:
            continue
        pts = synth.serving_pts(meta, episode, spans, tolerance_s, seconds)[camera]
        yield f"episode {episode}, camera {camera}, {relpath}", spans[camera][1], np.unique(pts)
