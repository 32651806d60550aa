"""``refstream bench --scale droid``: the index side of refstream on a DROID-sized simulation,
measured by :func:`run_scale`.

The simulation (:func:`write_simulation`, made once under ``$REFSTREAM_CACHE/bench``) is DROID in
LeRobot v3: ``bench.droid_lengths`` episodes at 15 fps, three 320×180 cameras, video files rolled
over at 200 MB as LeRobot's writer rolls them, the episodes table in files of about 100 MB, sparse
videos (:func:`write_sparse_mp4`: a real ``moov``, an ``mdat`` hole) and no data Parquet: **no
sample can be fetched or decoded from it**.

It is measured from the folder, over plain HTTP (one ``HEAD`` per file for its identity) and from
the Hub that :func:`hub_route` emulates on the same loopback server: ``refstream index ROOT`` in
a child, then ``StreamingDataset(ROOT)`` twice in a new process, the index cached (cold, warm).
Then the memory of DataLoader workers while the server holds their data Parquet requests (a
worker makes one once it planned its spans; the request's TCP port names it); a worker's share of
the index is the private pages of its mapped records plus the heap of the index objects over them
(:func:`_index_heap_bytes`). Measured processes offer themselves to the OOM killer first.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import struct
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from urllib.parse import parse_qs, quote, unquote, urlsplit

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from refstream import sidecar
from refstream.errors import RefstreamError, UsageError
from refstream.meta import EPISODES_PATH, INFO_PATH, TASKS_PATH
from refstream.stats import STATS_PATH
from refstream.synth import HANDLER_NAME, IDENTITY_MATRIX, box, full_box, table_box
from refstream.tools import bench, demo
from refstream.tools.bench import MB, Target, droid_lengths, kib_fields

__all__ = ["ScaleConfig", "run_scale", "write_simulation", "write_sparse_mp4", "hub_route"]

CAMERAS = ("observation.images.exterior_1_left", "observation.images.exterior_2_left",
           "observation.images.wrist_left")  # DROID's three cameras
WIDTH, HEIGHT, FPS = 320, 180, 15  # DROID's cameras in LeRobot's DROID 1.0.1
GOP = 2  # LeRobot's default keyframe interval
MIB = 1024 * 1024  # LeRobot's file sizes are in MiB ("size_in_mb" = bytes / 1024**2)
# Sample sizes (bytes, uniform within +-50 %): keyframes every other frame at g=2, ~1.7 x an
# inter frame; the mean sample, ~4.45 KB, is DROID's 369 GB of video over its 82.8 M samples.
KEY_SAMPLE_BYTES, INTER_SAMPLE_BYTES = 5_600, 3_300
DATA_ROW_BYTES = 200  # assumed data Parquet bytes per frame: rolls the (absent) data files
MIN_TIMESCALE = 10_000  # FFmpeg's mov muxer doubles a video time base 1/fps until it reaches this
CHUNK_LIMIT = 1 << 20  # FFmpeg's mov muxer starts a new chunk before one would reach 1 MiB
MOVIE_TIMESCALE = 1000  # FFmpeg's mvhd timescale
# av1C of SVT-AV1's main-profile 8-bit 4:2:0 320x180 stream (version/profile bytes + the
# sequence header OBU), as FFmpeg writes it into the av01 sample entry.
AV1C_320X180 = bytes.fromhex("81000c000a0b000000043cfecc02f80040")
FACTS = "simulation.json"  # write_simulation's facts, beside meta/
HELD_WAIT_S = 900.0  # how long the workers may take to reach their first fetch
SMAPS_FIELDS = ("Rss", "Pss", "Private_Clean", "Private_Dirty")  # what a memory figure sums
TRACED_FRAMES = 64  # deep enough that numpy's allocations still show the sidecar frame calling
HUB_REPO = "refstream/droid-sim"  # the emulated Hub's dataset: hf://datasets/HUB_REPO
HUB_COMMIT = hashlib.sha1(b"refstream droid simulation").hexdigest()  # its one commit
HUB_PAGE_ENTRIES = 1000  # entries per page of the emulated tree listing
TARGETS = {  # key: (text, the most the measured value may be)
    "index_rss": ("refstream index peak RSS <= 1 GB (MB; any place)", 1000),
    "construct_local": ("construction, index cached <= 5 s (folder; cold or warm)", 5),
    "construct_http": ("construction, index cached <= 10 s (loopback HTTP or emulated Hub; "
                       "cold or warm)", 10),
    "identity_requests": ("requests for file identities per 1,000 video files <= 10 with a "
                          "listing (emulated Hub, cold construction)", 10),
    "worker_private": ("private memory per worker for the index <= 64 MB (private pages of the "
                       "mapped records + heap of the index objects)", 64),
    "index_disk": ("index on disk <= 20 bytes per sample", 20),
}
AT_DROID_SIZE = ("identity_requests", "index_disk")  # rates that --quick's few files skew


# --- the sparse MP4 ---------------------------------------------------------------------------


def _moov(sizes: np.ndarray, keyframe: np.ndarray, payload_at: int, fps: int) -> bytes:
    ticks = 1  # per frame
    while fps * ticks < MIN_TIMESCALE:
        ticks *= 2
    count, ends = len(sizes), np.cumsum(sizes)
    at = ends - sizes  # each sample's offset in the payload
    movie_ticks = -(-count * ticks * MOVIE_TIMESCALE // (fps * ticks))  # rounded up
    chunks = [0]  # first sample of each chunk: samples follow while the chunk stays below limit
    while chunks[-1] < count:
        chunks.append(max(chunks[-1] + 1, int(np.searchsorted(ends, at[chunks[-1]] + CHUNK_LIMIT))))
    per_chunk = np.diff(chunks)
    changes = np.flatnonzero(np.diff(per_chunk, prepend=0))  # stsc: where the count changes
    entry = box(b"av01", struct.pack(">6xH16xHHII4xH32xHh", 1, WIDTH, HEIGHT, 0x480000,
                                     0x480000, 1, 0x18, -1), box(b"av1C", AV1C_320X180))
    stbl = box(b"stbl", full_box(b"stsd", 0, 0, struct.pack(">I", 1), entry),
               table_box(b"stts", ">u4", [count], [ticks]),
               table_box(b"stss", ">u4", np.flatnonzero(keyframe) + 1),
               table_box(b"stsc", ">u4", changes + 1, per_chunk[changes], changes * 0 + 1),
               full_box(b"stsz", 0, 0, struct.pack(">II", 0, count), sizes.astype(">u4").tobytes()),
               table_box(b"stco", ">u4", payload_at + at[chunks[:-1]]))
    dinf = box(b"dinf", full_box(b"dref", 0, 0, struct.pack(">I", 1), full_box(b"url ", 0, 1)))
    mdia = box(b"mdia", full_box(b"mdhd", 0, 0, struct.pack(">4IHH", 0, 0, fps * ticks,
                                                            count * ticks, 0x55C4, 0)),
               full_box(b"hdlr", 0, 0, struct.pack(">I4s12x", 0, b"vide"), HANDLER_NAME),
               box(b"minf", full_box(b"vmhd", 0, 1, bytes(8)), dinf, stbl))
    tkhd = full_box(b"tkhd", 0, 3, struct.pack(">5I8x4H", 0, 0, 1, 0, movie_ticks, 0, 0, 0, 0),
                    IDENTITY_MATRIX, struct.pack(">II", WIDTH << 16, HEIGHT << 16))
    edts = box(b"edts", table_box(b"elst", ">u4", [movie_ticks], [0], [0x10000]))
    mvhd = full_box(b"mvhd", 0, 0, struct.pack(">5IH10x", 0, 0, MOVIE_TIMESCALE, movie_ticks,
                                               0x10000, 0x100), IDENTITY_MATRIX,
                    struct.pack(">24xI", 2))
    return box(b"moov", mvhd, box(b"trak", tkhd, edts, mdia))


def write_sparse_mp4(path: Path, sizes: np.ndarray, keyframe: np.ndarray, fps: int) -> np.ndarray:
    """An AV1 MP4 at ``path`` whose moov describes samples of ``sizes`` bytes (flags
    ``keyframe``, one frame each at ``fps``) and whose mdat payload is a hole; returns each
    sample's absolute file offset."""
    sizes = np.asarray(sizes, np.int64)
    ftyp = box(b"ftyp", b"isom", struct.pack(">I", 0x200), b"isomav01iso2mp41")
    payload_at = len(ftyp) + len(_moov(sizes, keyframe, 0, fps)) + 8  # moov's size: any offsets
    with open(path, "wb") as out:
        out.write(ftyp + _moov(sizes, keyframe, payload_at, fps)
                  + struct.pack(">I4s", 8 + int(sizes.sum()), b"mdat"))
        out.truncate(payload_at + int(sizes.sum()))
    return payload_at + np.cumsum(sizes) - sizes


# --- the simulated dataset --------------------------------------------------------------------


@dataclass(frozen=True)
class ScaleConfig:
    """The simulation's shape (DROID's by default) and the workers of the memory figure."""

    episodes: int = bench.DROID_EPISODES
    video_file_mb: int = 200  # LeRobot's video_files_size_in_mb
    workers: int = 4
    seed: int = 0

    @classmethod
    def quick(cls, **overrides) -> ScaleConfig:
        return cls(**{"episodes": 40, "video_file_mb": 2, "workers": 2, **overrides})


def _rollover(item_bytes: np.ndarray, limit: int) -> np.ndarray:
    """Each item's file number, a new file whenever the next item would bring the current one
    to ``limit`` bytes (LeRobot's rule for video and data files)."""
    numbers, number, filled = np.empty(len(item_bytes), np.int64), 0, 0
    for position, size in enumerate(item_bytes.tolist()):
        if filled and filled + size >= limit:
            number, filled = number + 1, 0
        numbers[position], filled = number, filled + size
    return numbers


def write_simulation(root: Path, config: ScaleConfig, progress: bool = True) -> dict:
    """Write the simulation of ``config`` under ``root`` (module docstring); return its facts,
    also kept in ``root/simulation.json``."""
    from tqdm import tqdm

    started = time.perf_counter()
    lengths = np.asarray(droid_lengths(config.episodes, config.seed), np.int64)
    first = np.concatenate([[0], np.cumsum(lengths)])
    frames = int(first[-1])
    keyframe = (np.arange(frames) - np.repeat(first[:-1], lengths)) % GOP == 0
    rng = np.random.default_rng(config.seed)
    columns = {"episode_index": np.arange(config.episodes), "length": lengths,
               "tasks": pa.array([[demo.TASKS[e % 2]] for e in range(config.episodes)]),
               **demo.file_place(_rollover(lengths * DATA_ROW_BYTES, 100 * MIB), "data"),
               "dataset_from_index": first[:-1], "dataset_to_index": first[1:]}
    videos = []
    for camera in CAMERAS:
        sizes = (np.where(keyframe, KEY_SAMPLE_BYTES, INTER_SAMPLE_BYTES)
                 * rng.uniform(0.5, 1.5, frames)).astype(np.int32)
        file_of = _rollover(np.add.reduceat(sizes, first[:-1], dtype=np.int64),
                            config.video_file_mb * MIB)
        opens = first[:-1][np.flatnonzero(np.diff(file_of, prepend=-1))]  # each file's 1st frame
        columns |= {**demo.file_place(file_of, f"videos/{camera}"),
                    f"videos/{camera}/from_timestamp": (first[:-1] - opens[file_of]) / FPS,
                    f"videos/{camera}/to_timestamp": (first[1:] - opens[file_of]) / FPS}
        videos += [(camera, n, sizes[a:b], keyframe[a:b])
                   for n, (a, b) in enumerate(zip(opens, [*opens[1:], frames], strict=True))]
    features = demo._features({c: (WIDTH, HEIGHT) for c in CAMERAS}, FPS, "libsvtav1", GOP, 0)
    stats = {}  # of the right shapes; the values mean nothing
    for name, feature in features.items():
        shape = (3, 1, 1) if feature["dtype"] == "video" else tuple(feature["shape"])
        parts = {s: rng.random((config.episodes, *shape)) for s in ("min", "max", "mean", "std",
                                                                    *demo.QUANTILES)}
        columns |= {f"stats/{name}/{s}": demo.fixed_size_lists(v) for s, v in parts.items()}
        columns[f"stats/{name}/count"] = demo.fixed_size_lists(lengths[:, None])
        stats[name] = {s: v.mean(0).tolist() for s, v in parts.items()} | {"count": [frames]}
    table = pa.table(columns)
    per_file = max(1, 100 * MIB * table.num_rows // table.nbytes)  # ~100 MB files, as LeRobot
    numbers = np.arange(table.num_rows) // per_file
    for key, values in demo.file_place(numbers, "meta/episodes").items():
        table = table.append_column(key, pa.array(values))
    parts = [(EPISODES_PATH.format(**demo.file_place(n)), table.slice(n * per_file, per_file))
             for n in range(int(numbers[-1]) + 1)] + [(TASKS_PATH, demo._tasks_table())]
    for relpath, part in parts:
        (root / relpath).parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(part, root / relpath)
    (root / STATS_PATH).write_text(json.dumps(stats))
    (root / INFO_PATH).write_text(json.dumps(demo.info_document(
        features, FPS, config.episodes, frames, "refstream_droid_simulation",
        config.video_file_mb)))
    for camera, number, sizes, flags in tqdm(videos, unit="file", disable=not progress):
        path = root / demo.VIDEO_PATH.format(video_key=camera, **demo.file_place(number))
        path.parent.mkdir(parents=True, exist_ok=True)
        write_sparse_mp4(path, sizes, flags, FPS)
    facts = {"episodes": config.episodes, "frames": frames, "cameras": len(CAMERAS),
             "video_files": len(videos), "samples": frames * len(CAMERAS),
             "video_bytes": int(sum(v[2].sum(dtype=np.int64) for v in videos)),
             "seconds": round(time.perf_counter() - started, 1)}
    (root / FACTS).write_text(json.dumps(facts))
    return facts


# --- the emulated Hub -------------------------------------------------------------------------


def hub_route(root: Path, url: str) -> Callable[[str], str | tuple[bytes, dict[str, str]]]:
    """A :class:`demo.LoopbackServer` route that also serves ``root`` as the Hub at ``url``
    serves the dataset ``HUB_REPO`` at commit ``HUB_COMMIT`` (what :mod:`refstream.hub` asks,
    SPEC §8.4, §10.1); other paths are the folder's files. A file's ``lfs.oid`` is the SHA-256
    of its relpath and size: a stable content identity is all the index needs (hashing 370 GB of
    holes would tell no more). A ``/resolve/`` request is a 302 to the file's path with an hour's
    S3-style signature, as the Hub redirects to its CDN (the signature is not checked)."""
    api = f"/api/datasets/{HUB_REPO}/"
    tree = f"{api}tree/{HUB_COMMIT}"
    files = f"/datasets/{HUB_REPO}/resolve/{HUB_COMMIT}/"

    @functools.cache
    def listing(folder: str) -> list[dict]:
        entries = []
        for path in sorted((root / folder).rglob("*")):
            relpath = str(path.relative_to(root))
            if path.is_dir():
                entries.append({"type": "directory", "oid": "0" * 40, "size": 0, "path": relpath})
                continue
            size = path.stat().st_size
            oid = hashlib.sha256(f"{relpath} {size}".encode()).hexdigest()
            entries.append({"type": "file", "oid": oid[:40], "size": size, "path": relpath,
                            "lfs": {"oid": oid, "size": size, "pointerSize": 134}})
        return entries

    def route(target: str) -> str | tuple[bytes, dict[str, str]]:
        split = urlsplit(target)
        path = unquote(split.path)
        if path.startswith(f"{api}revision/"):
            return json.dumps({"sha": HUB_COMMIT}).encode(), {}
        if path == tree or path.startswith(f"{tree}/"):
            entries = listing(path.removeprefix(tree).strip("/"))
            start = int(parse_qs(split.query).get("cursor", ["0"])[0])
            headers = {"Content-Type": "application/json"}
            if start + HUB_PAGE_ENTRIES < len(entries):
                after = f"{split.path}?recursive=true&cursor={start + HUB_PAGE_ENTRIES}"
                headers["Link"] = f'<{url}{after}>; rel="next"'
            page = entries[start : start + HUB_PAGE_ENTRIES]
            return json.dumps(page).encode(), headers
        if path.startswith(files):
            signed = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
            return b"", {"Location": f"{url}/{quote(path.removeprefix(files))}?X-Amz-Date="
                                     f"{signed}&X-Amz-Expires=3600&X-Amz-Signature={'0' * 64}"}
        return path.lstrip("/")

    return route


# --- measuring --------------------------------------------------------------------------------

# Child processes: each first offers itself to the OOM killer (module docstring).
_OOM_FIRST = "open('/proc/self/oom_score_adj', 'w').write('1000')\n"
# Its last line is its own peak RSS in kB: VmHWM starts again at exec, while ru_maxrss starts at
# the RSS of the process that spawned it.
INDEX_CHILD = _OOM_FIRST + """import sys
from refstream.tools.cli import main
code = main(['index', *sys.argv[1:]])
print(open('/proc/self/status').read().partition('VmHWM:')[2].split()[0], flush=True)
sys.exit(code)
"""
# One StreamingDataset(argv[1]) per line read; prints the seconds each took.
CONSTRUCT_CHILD = _OOM_FIRST + """import json, sys, time
from refstream.stream import StreamingDataset
for _ in sys.stdin:
    started = time.perf_counter()
    StreamingDataset(sys.argv[1])
    print(json.dumps(time.perf_counter() - started), flush=True)
"""


@dataclass(frozen=True)
class Place:
    """The figures from one place: the folder, plain HTTP or the emulated Hub (seconds, bytes)."""

    index_s: float  # `refstream index ROOT`, the whole child process
    index_peak_rss_bytes: int
    index_requests: int
    index_served_bytes: int  # response bytes, the moovs that were read
    index_disk_bytes: int  # every file of the sidecar cache after the build
    cold_s: float  # the first StreamingDataset(ROOT) of a new process, the index cached
    cold_requests: int
    cold_identity_requests: int  # of which asking for file identities: HEADs, listing pages
    warm_s: float  # the second one in that process
    warm_requests: int
    warm_identity_requests: int


@dataclass(frozen=True)
class WorkerMemory:
    """One DataLoader worker once it planned its first pool (bytes)."""

    rss_bytes: int
    pss_bytes: int
    private_bytes: int  # Private_Clean + Private_Dirty, everything
    private_gained_bytes: int  # since its worker_init_fn: index, spans, planner, copy-on-write
    index_records: int  # record files it maps
    index_rss_bytes: int  # their pages in its memory
    index_pss_bytes: int
    index_private_bytes: int  # their pages no other process maps
    index_heap_bytes: int  # the index objects over those records


def _measure_place(root: str, cache: Path, server: demo.LoopbackServer) -> Place:
    env = {**os.environ, sidecar.CACHE_ENV: str(cache), "HF_ENDPOINT": server.url}
    env.pop("HF_TOKEN", None)  # the emulated Hub needs none
    mark, served, started = len(server.log), server.body_bytes, time.perf_counter()
    child = subprocess.Popen([sys.executable, "-c", INDEX_CHILD, root], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    with child.stdout:
        output = child.stdout.read()
    if child.wait():
        raise RefstreamError(f"refstream index {root} failed ({child.returncode}): {output}")
    peak_kb = int(output.split()[-1])
    figures = [time.perf_counter() - started, peak_kb * 1024, len(server.log) - mark,
               server.body_bytes - served,
               sum(p.stat().st_size for p in cache.rglob("*") if p.is_file())]
    with subprocess.Popen([sys.executable, "-c", CONSTRUCT_CHILD, root], env=env, text=True,
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE) as child:
        for _ in ("cold", "warm"):
            mark = len(server.log)
            child.stdin.write("\n")
            child.stdin.flush()
            line = child.stdout.readline()
            if not line:
                raise RefstreamError(f"StreamingDataset({root!r}) failed in a child process")
            asked = sum(method == "HEAD" or path.startswith(f"/api/datasets/{HUB_REPO}/tree/")
                        for method, path, *_ in server.log[mark:])
            figures += [float(line), len(server.log) - mark, asked]
        child.stdin.close()
    return Place(*figures)


def _memory(fields: dict[str, int]) -> tuple[int, int, int]:
    """RSS, PSS and private bytes (``Private_Clean + Private_Dirty``) of smaps ``fields``."""
    private = fields.get("Private_Clean", 0) + fields.get("Private_Dirty", 0)
    return fields.get("Rss", 0), fields.get("Pss", 0), private


def _rollup(pid: int) -> tuple[int, int, int]:
    return _memory(kib_fields(f"/proc/{pid}/smaps_rollup", SMAPS_FIELDS) or {})


def _note_start(start, worker_id: int) -> None:
    """``worker_init_fn``: offer this worker to the OOM killer first; record its private bytes
    and pid in row ``worker_id`` of the shared tensor ``start``."""
    Path("/proc/self/oom_score_adj").write_text("1000")
    start[worker_id, 1] = _rollup(os.getpid())[2]
    start[worker_id, 0] = os.getpid()


def _tcp_ports(pid: int) -> set[int]:
    """Local ports of the IPv4 TCP sockets ``pid`` has open."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):  # closed meanwhile
            inodes.add(os.readlink(f"/proc/{pid}/fd/{fd}").removeprefix("socket:[")[:-1])
    rows = [line.split() for line in Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]]
    return {int(row[1].rpartition(":")[2], 16) for row in rows if row[9] in inodes}


def _mapped_records(pid: int, folder: str) -> dict[str, dict[str, int]]:
    """Each file under ``folder`` that ``pid`` maps, with its mappings' smaps fields (bytes)."""
    files, current = {}, None
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        words = line.split()
        if not words[0].endswith(":"):  # a mapping: range, perms, offset, dev, inode[, path]
            inside = len(words) > 5 and words[5].startswith(folder)
            current = files.setdefault(words[5], {}) if inside else None
        elif current is not None and len(words) == 3 and words[2] == "kB":
            current[words[0][:-1]] = current.get(words[0][:-1], 0) + int(words[1]) * 1024
    return files


def _index_heap_bytes(video_index: sidecar.VideoIndex, paths: frozenset[str]) -> int:
    """The heap that the index objects of the records at ``paths`` take: what tracemalloc finds
    allocated in :mod:`refstream.sidecar` and still held by the :class:`MappedIndex` entries a
    worker mapping those records holds (their pages are not heap)."""
    relpaths = [relpath for relpath, record in video_index.records.items()
                if os.path.realpath(record.path) in paths]
    tracemalloc.start(TRACED_FRAMES)
    try:
        mapped = sidecar.MappedIndex(video_index)
        for relpath in relpaths:
            mapped[relpath]
        in_sidecar = tracemalloc.Filter(True, sidecar.__file__, all_frames=True)
        return sum(trace.size for trace in
                   tracemalloc.take_snapshot().filter_traces([in_sidecar]).traces)
    finally:
        tracemalloc.stop()


def _worker(pid: int, private_at_start: int, folder: Path) -> tuple[WorkerMemory, frozenset]:
    """``pid``'s memory and that of the index records (in ``folder``) it maps, their heap not
    yet measured (0); and the paths of those records."""
    records = _mapped_records(pid, os.path.realpath(folder) + os.sep)
    index = {name: sum(fields.get(name, 0) for fields in records.values()) for name in SMAPS_FIELDS}
    rss, pss, private = _rollup(pid)
    return WorkerMemory(rss, pss, private, private - private_at_start, len(records),
                        *_memory(index), 0), frozenset(records)


def _worker_memory(server: demo.LoopbackServer, cache: Path, workers: int) -> list[WorkerMemory]:
    """Each worker's memory once every worker has a data Parquet request held (module doc)."""
    import torch

    from refstream.stream import StreamingDataset

    held, measured, lock, release = set(), [], threading.Lock(), threading.Event()
    start = torch.zeros((workers, 2), dtype=torch.int64).share_memory_()  # pid, private bytes
    with demo.environment(sidecar.CACHE_ENV, str(cache)):
        dataset = StreamingDataset(server.url)

    def hold(path: str, client: tuple) -> None:  # on the server's threads
        if path.startswith("/data/"):
            with lock:
                held.add(client[1])  # the port the request came from
                pids = start[:, 0].tolist()
                if not release.is_set() and all(pids) and all(_tcp_ports(p) & held for p in pids):
                    measured.extend(_worker(pid, at_start, sidecar.cache_folder(cache))
                                    for pid, at_start in start.tolist())
                    release.set()
            release.wait()

    loader = torch.utils.data.DataLoader(dataset, num_workers=workers, timeout=HELD_WAIT_S,
                                         worker_init_fn=functools.partial(_note_start, start))
    server.hold = hold
    try:  # no batch can come: the data requests are held, then answered 404
        next(iter(loader))
    except Exception as exc:  # noqa: BLE001 - what ended the workers' first fetch
        if not measured:
            raise RefstreamError("the workers did not all reach their first fetch") from exc
    finally:
        release.set()
        server.hold = None
    # Measured once the workers are released, once per set of records mapped.
    heap = functools.cache(functools.partial(_index_heap_bytes, dataset.video_index))
    return [replace(memory, index_heap_bytes=heap(paths)) for memory, paths in measured]


# --- the report -------------------------------------------------------------------------------


@dataclass(frozen=True)
class ScaleReport:
    """Everything one run measured (seconds, bytes)."""

    config: ScaleConfig
    root: str
    simulation: dict  # write_simulation's facts
    disk_bytes: int  # what the simulation's files take on disk
    apparent_bytes: int  # their sizes
    folder: Place
    http: Place
    hub: Place
    workers: list[WorkerMemory]
    targets: list[Target]
    seconds: float

    def as_dict(self) -> dict:
        return asdict(self)

    def lines(self) -> list[str]:
        s = self.simulation
        out = [f"simulated DROID: {s['episodes']:,} episodes, {s['frames']:,} frames at {FPS} "
               f"fps, {s['cameras']} cameras {WIDTH}x{HEIGHT}, {s['samples']:,} samples in "
               f"{s['video_files']:,} sparse video files ({s['video_bytes'] / MB:,.0f} MB); "
               f"generated in {s['seconds']:.0f} s, {self.disk_bytes / MB:,.0f} MB on disk, "
               f"{self.apparent_bytes / MB:,.0f} MB apparent: {self.root}"]
        groups = [("folder", self.folder), ("loopback HTTP", self.http),
                  (f"emulated Hub (hf://datasets/{HUB_REPO})", self.hub),
                  *((f"worker {n} (HTTP)", w) for n, w in enumerate(self.workers))]
        out += [f"{label}: " + ", ".join(f"{k} {_shown(k, v)}" for k, v in asdict(g).items())
                for label, g in groups]
        out += [f"[{t.verdict}] {t.text}: {t.measured}" for t in self.targets]
        return [*out, f"scale took {self.seconds:.0f} s"]


def _shown(name: str, value: float) -> str:
    """A figure as printed: bytes in MB, seconds to the hundredth, counts with separators."""
    if name.endswith("_bytes"):
        return f"{value / MB:,.1f} MB"
    return f"{value:.2f} s" if name.endswith("_s") else f"{value:,}"


def evaluate_targets(report: ScaleReport) -> list[Target]:
    places, s = (report.folder, report.http, report.hub), report.simulation
    measured = {
        "index_rss": max(p.index_peak_rss_bytes for p in places) / MB,
        "construct_local": max(report.folder.cold_s, report.folder.warm_s),
        "construct_http": max(max(p.cold_s, p.warm_s) for p in places[1:]),
        "identity_requests": 1000 * report.hub.cold_identity_requests / s["video_files"],
        "worker_private": max(w.index_private_bytes + w.index_heap_bytes
                              for w in report.workers) / MB,
        "index_disk": max(p.index_disk_bytes for p in places) / s["samples"],
    }
    small = (f"{report.config.episodes:,} episodes are too few files and samples for a rate "
             "made at DROID's size")
    return [Target(key, text, f"n/a: {small}; {measured[key]:,.2f}", None)
            if report.config.episodes < bench.DROID_EPISODES and key in AT_DROID_SIZE else
            Target(key, text, f"{measured[key]:,.2f}", measured[key] <= most)
            for key, (text, most) in TARGETS.items()]


def run_scale(config: ScaleConfig, progress: Callable[[str], None] | None = None) -> ScaleReport:
    if min(config.episodes, config.workers) < 1 or not 1 <= config.video_file_mb <= 2048:
        raise UsageError(f"{config}: episodes, workers >= 1; video_file_mb 1..2048 (32-bit stco)")
    say = progress or (lambda _message: None)
    started = time.perf_counter()
    shape = {**asdict(config), "layout": 1}
    del shape["workers"]
    root = bench.cached_build("droid-sim", shape, "a DROID-sized simulation",
                              lambda folder: write_simulation(folder, config, bool(progress)), say)
    files = [p.stat() for p in root.rglob("*") if p.is_file()]
    with tempfile.TemporaryDirectory(prefix="refstream-scale-") as scratch, \
            demo.serve_directory(root) as server:
        server.route = hub_route(root, server.url)
        places = {}
        for name, where in (("folder", str(root)), ("http", server.url),
                            ("hub", f"hf://datasets/{HUB_REPO}")):
            say(f"refstream index and StreamingDataset from {where}")
            places[name] = _measure_place(where, Path(scratch) / name, server)
        say(f"memory of {config.workers} workers")
        workers = _worker_memory(server, Path(scratch) / "http", config.workers)
    report = ScaleReport(config, str(root), json.loads((root / FACTS).read_text()),
                         sum(f.st_blocks * 512 for f in files), sum(f.st_size for f in files),
                         **places, workers=workers, targets=[], seconds=0.0)
    return replace(report, targets=evaluate_targets(report), seconds=time.perf_counter() - started)
