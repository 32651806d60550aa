"""``refstream bench``: refstream side by side with the ways people load LeRobot data today.

Use (``refstream bench [--quick] [--json] [--plot PATH] ...`` does the same from the shell)::

    report = run_bench(BenchConfig())          # or BenchConfig.quick(); root=... for your data
    print("\\n".join(report.lines()))          # the table, the other figures, the targets

Every pass uses the same DataLoader settings and windows and makes its dataset inside the timed
region. Datasets (``demo.write_demo_dataset``, cached under ``$REFSTREAM_CACHE/bench``): the
configured shape, ``ttfs_scale`` × its episodes (time to first sample) and long GOPs (H.264,
g=30, 2 B-frames); ``root=`` measures that folder alone. Methods: refstream over a loopback
server, ready batches (``batched=True``) or ``-plain`` (``DataLoader(batch_size=B)`` collates),
float32 or ``uint8``, and on the long-GOP dataset (``h264-g30``); ``map-style`` reads as
LeRobot's map-style dataset with PyAV (``refstream.tools.baselines``); ``decode-ceiling``
decodes and converts every episode in ``num_workers`` processes, no loader; one such decode lasts
a fraction of a second, so it is repeated until the repeats last ``ceiling_s`` (an odd count, at
least ``repeats``) and each of its figures is the median over them. Figures, over each pass
after every worker's first batch, medians over repeats: samples/s; CPU ms per sample of the
consuming thread and the workers, split into ``decode+RGB`` (the ceiling's), ``loader`` (the
rest) and ``collate`` (the DataLoader's collation, part of the loader's); decoding scales with
the amplification in that window, RGB conversion with the frames delivered; time to the first
batch; peak RSS (sampled through the pass) and PSS (at its first batch and end) above the main
process's; decode amplification (decoded ÷ delivered frames); the server's requests and bytes
against the minimal spans. The write floor: CPU per sample to write its camera values into a ready
batch from decoded planes, float32 and uint8 (``write_floor``), which bounds what the float32 row
can reach beside its decode limit. The memory table: for each worker count, byte budget and pool
size of ``BenchConfig``, the peak total PSS of a new training process streaming one epoch and its
workers. One epoch through the Hub that ``refstream.tools.scale`` emulates counts the ``/resolve/``
requests per file the main process and the workers made (each file's signed target shared for its
lifetime). Then planner figures for a DROID-sized rank, the Hub resolves of a DROID-sized run
(``droid.hub_resolves``), and the targets (n/a where made for another run). The machine's other work
shows in every figure.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import multiprocessing
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from unittest import mock
from urllib.parse import unquote, urlsplit

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from refstream import decode, shard, synth
from refstream.errors import UsageError
from refstream.meta import DatasetMeta, index_column, load_meta
from refstream.sidecar import CACHE_ENV, MappedIndex, VideoIndex, default_cache_root
from refstream.source import LocalSource
from refstream.stream import GIB, StreamingDataset
from refstream.tools import baselines, demo
from refstream.tools.baselines import Ceiling, decode_ceiling
from refstream.tools.droid import (
    DROID_EPISODES,
    MIXING_BATCHES,
    HubResolves,
    Mixing,
    PlannerFigures,
    batch_mixing,
    droid_lengths,
    hub_resolves,
    planner_figures,
)

__all__ = ["BenchConfig", "BenchReport", "run_bench", "run_first_batch", "TARGET_TEXT"]

CODECS = {"av1": "libsvtav1", "h264": "libx264"}
# RSS read interval. RSS is read from /proc/<pid>/status (no cost to speak of); PSS needs
# smaps_rollup, which walks every mapped page (~10 ms per process holding a worker's shared
# buffers, a CPU the loader under test would otherwise have), so it is read at the first batch
# and at the end of a pass only.
MEMORY_INTERVAL_S = 0.2
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")  # units of /proc/<pid>/stat times
MB = 1_000_000
LONG_GOP = "h264-g30"  # the long-GOP dataset's method names end so
# The configuration the README names for a small machine, the memory table's last row: uint8
# items (made float on the accelerator), as float32 ones take 4x the shared batch memory.
MEMORY_WORKERS, MEMORY_BUDGET_GB, MEMORY_POOL = 2, 0.25, 8
MEMORY_NAMED = (f"{MEMORY_WORKERS} workers, byte_budget_gb {MEMORY_BUDGET_GB}, "
                f"episode_pool_size {MEMORY_POOL}, return_uint8")
# Targets: the text shown with each check.
TARGET_TEXT = {
    "loader_cpu": "refstream over HTTP (float32): CPU per sample minus the decode ceiling's "
                  "<= 3 ms (after every worker's first batch)",
    "http_vs_map": "refstream over HTTP >= 4x the map-style baseline's samples/s",
    "float32_limit": "refstream over HTTP (float32) >= 0.9 x its decode limit (the decode "
                     "ceiling at its amplification in the same window)",
    "uint8_limit": "uint8 items over HTTP >= 0.95 x their decode limit",
    "uint8": "uint8 items over HTTP at least as fast as float32 ones (ready batches)",
    "amplification": "decode amplification <= 1.6 (at g=2)",
    "span_bytes": "video bytes fetched <= 1.05 x minimal span bytes (HTTP, one epoch)",
    "requests": "HTTP requests streaming one epoch <= 1.1 x (episodes x cameras) + data "
                "Parquet reads",
    "memory": "peak PSS above baseline <= byte budget + 300 MB per worker (HTTP)",
    "ttfs": "time to first sample over HTTP <= 3 s (sidecar built), at x1 and xN episodes",
    "ttfs_flat": "time to first sample flat in dataset size: xN <= 1.3 x the x1 time",
    "long_gop_amplification": "decode amplification <= 1.5 at h264 g=30 with 2 B-frames "
                              "(long-GOP row)",
    "long_gop_speed": "long-GOP row's samples/s >= 0.6 x the g=2 row's (refstream over HTTP)",
    "memory_table": f"total PSS of the training process and its workers <= 1 GiB at "
                    f"{MEMORY_NAMED}",
    "elastic": "resuming a DROID-sized rank's checkpoint on 3/4 of the ranks <= 30 s per rank",
    "hub_resolves": "Hub epoch (emulated): resolves per file per process <= 1 (each target lives "
                    "an hour, shared by the main process and every worker)",
    "hub_droid": "Hub resolves per 5 minutes of a DROID-sized run (8 ranks x 4 workers, 500 "
                 "samples/s per rank), over a target's hour <= 1,500 (half the anonymous quota)",
}
# --- configuration ----------------------------------------------------------------------------


@dataclass(frozen=True)
class BenchConfig:
    """What to generate and how to load it. The defaults are sized so that a whole run,
    dataset generation included, fits in ten minutes on two cores."""

    episodes: int = 16
    frames_per_episode: int = 64
    cameras: int = 3
    width: int = 320
    height: int = 240
    codec: str = "av1"  # "av1" (SVT-AV1, LeRobot's default) or "h264" (x264)
    gop: int = 2
    bframes: int = 0  # H.264 only
    fps: int = 30
    episodes_per_file: int = 16  # per video and data file
    pool_size: int | None = None  # per worker; None: refstream's default (32 per rank, split)
    budget_gb: float = 1.0  # byte budget per rank, GiB
    num_workers: int = 2
    batch_size: int = 32
    repeats: int = 3
    # Wall seconds the decode ceiling's repeats last at least: one decode of the default dataset
    # takes ~0.2 s, and alone it varied by a quarter between runs as other work came and went.
    ceiling_s: float = 3.0
    camera_window: int = 2  # frames ending at the anchor, every camera
    action_window: int = 16  # steps starting at the anchor
    baseline_batches: int = 24  # map-style batches per repeat
    ttfs_scale: int = 8  # the larger dataset for time to first sample: episodes x this
    droid_episodes: int = DROID_EPISODES
    droid_ranks: int = 8
    seed: int = 0
    root: str | None = None  # measure this dataset folder instead of generating one
    smoke: bool = False  # --quick: the targets made for the default shape do not apply
    # The memory table: each worker count x byte budget (GiB per rank) x pool (None: default),
    # float32 items, then the named configuration.
    memory_workers: tuple[int, ...] = (1, 2, 4)
    memory_budgets_gb: tuple[float, ...] = (0.25, 1.0)
    memory_pools: tuple[int | None, ...] = (None, MEMORY_POOL)

    @classmethod
    def quick(cls, **overrides) -> BenchConfig:
        """A tiny configuration that runs in seconds (smoke tests, ``--quick``)."""
        tiny = dict(episodes=4, frames_per_episode=12, cameras=2, width=64, height=48,
                    episodes_per_file=2, num_workers=1, batch_size=4, repeats=1, ceiling_s=0,
                    action_window=4, baseline_batches=2,
                    ttfs_scale=2, droid_episodes=2_000, droid_ranks=2, smoke=True,
                    memory_workers=())
        return cls(**{**tiny, **overrides})

    def check(self) -> None:
        if self.codec not in CODECS:
            raise UsageError(f"codec must be one of {sorted(CODECS)}, got {self.codec!r}")
        positive = ("episodes", "frames_per_episode", "cameras", "width", "height", "gop", "fps",
                    "episodes_per_file", "batch_size", "repeats", "camera_window",
                    "action_window", "baseline_batches", "ttfs_scale",
                    "droid_episodes", "droid_ranks")
        for name in positive:
            if getattr(self, name) < 1:
                raise UsageError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_workers < 0 or self.bframes < 0 or not self.budget_gb > 0:
            raise UsageError("num_workers and bframes must be >= 0 and budget_gb > 0")
        if self.width % 2 or self.height % 2:
            raise UsageError(f"resolution {self.width}x{self.height}: yuv420p needs even sizes")

    def delta_timestamps(self, cameras: list[str], fps: int,
                         features: dict | None = None) -> dict[str, list[float]]:
        """The windows every loader of the run uses (seconds, LeRobot's ``delta_timestamps``);
        the action window only if ``features`` (when given) has an ``action``."""
        windows = {c: [-k / fps for k in range(self.camera_window - 1, -1, -1)] for c in cameras}
        if features is None or "action" in features:
            windows["action"] = [k / fps for k in range(self.action_window)]
        return windows


# --- the dataset ------------------------------------------------------------------------------


def bench_cache() -> Path:
    """``$REFSTREAM_CACHE/bench`` (default ``~/.cache/refstream/bench``)."""
    return default_cache_root() / "bench"


def camera_names(count: int) -> list[str]:
    return [f"observation.images.cam{i}" for i in range(count)]


def cached_dataset(config: BenchConfig, episodes: int, progress: Callable[[str], None]) -> Path:
    """The generated dataset of ``config``'s shape with ``episodes`` episodes (made once)."""
    shape = {"episodes": episodes, "frames": config.frames_per_episode,
             "cameras": config.cameras, "size": [config.width, config.height],
             "codec": config.codec, "gop": config.gop, "bframes": config.bframes,
             "fps": config.fps, "per_file": config.episodes_per_file, "layout": 1}
    what = (f"{episodes} episodes x {config.frames_per_episode} frames x {config.cameras} "
            f"cameras ({config.codec}, g={config.gop})")
    return cached_build(f"{episodes}ep", shape, what, lambda building: demo.write_demo_dataset(
        building, episode_lengths=[config.frames_per_episode] * episodes,
        cameras=camera_names(config.cameras), size=(config.width, config.height),
        fps=config.fps, codec=CODECS[config.codec], gop=config.gop,
        bframes=config.bframes, episodes_per_video_file=config.episodes_per_file,
        episodes_per_data_file=config.episodes_per_file), progress)


def cached_build(name: str, shape: dict, what: str, write: Callable[[Path], object],
                 progress: Callable[[str], None]) -> Path:
    """``bench_cache()/<name>-<digest of shape>``, written once by ``write(folder)`` (``what``
    it is, for ``progress``) into a temporary folder beside it, then renamed into place."""
    digest = hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:16]
    root = bench_cache() / f"{name}-{digest}"
    if (root / "meta" / "info.json").exists():
        return root
    progress(f"generating {what} into {root}")
    root.parent.mkdir(parents=True, exist_ok=True)
    building = Path(tempfile.mkdtemp(prefix=f".{root.name}.", dir=root.parent))
    try:
        write(building)
        os.replace(building, root)  # another bench made it meanwhile: keep theirs
    except OSError:
        if not (root / "meta" / "info.json").exists():
            raise
    finally:
        shutil.rmtree(building, ignore_errors=True)
    return root


def dataset_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


@dataclass(frozen=True)
class SpanTotals:
    """The minimal exact spans of every (episode, camera) of a dataset."""

    span_bytes: int  # sum of the spans' byte lengths: what must be fetched at least
    episode_bytes: dict[int, int]  # episode -> synthesized mini-MP4 bytes over its cameras


def span_totals(root: Path, meta: DatasetMeta, video_index: VideoIndex) -> SpanTotals:
    """The minimal exact spans: ``synth.episode_spans`` at the times each episode's rows
    request, read from the Parquet."""
    index = MappedIndex(video_index)
    relpaths = sorted({meta.data_relpath(int(e)) for e in meta.episode_index})
    table = pa.concat_tables([pq.read_table(root / r, columns=["episode_index", "timestamp"])
                              for r in relpaths])
    episode_of = index_column(table, "episode_index", str(root))
    timestamps_s = index_column(table, "timestamp", str(root))
    span_bytes = 0
    episode_bytes: dict[int, int] = {}
    for episode in meta.episode_index.tolist():
        spans = synth.episode_spans(meta, episode, index, baselines.TOLERANCE_S,
                                    timestamps_s[episode_of == episode])
        episode_bytes[episode] = 0
        for sample_index, span in spans.values():
            span_bytes += span.byte_length
            episode_bytes[episode] += synth.synthesized_size(sample_index, span)
    return SpanTotals(span_bytes, episode_bytes)


# --- measuring a pass -------------------------------------------------------------------------


def kib_fields(path: str, names: tuple[str, ...]) -> dict[str, int] | None:
    try:
        text = Path(path).read_text()
    except OSError:
        return None  # the process is gone
    found = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key in names:
            found[key] = int(rest.split()[0]) * 1024
    return found


def descendants(pid: int) -> list[int]:
    """Every live descendant process of ``pid`` (DataLoader workers, decode-ceiling processes)."""
    found, stack = [], [pid]
    while stack:
        parent = stack.pop()
        try:
            tids = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                children = Path(f"/proc/{parent}/task/{tid}/children").read_text().split()
            except OSError:
                continue
            found += [int(c) for c in children]
            stack += [int(c) for c in children]
    return found


def memory_of(pids: list[int], pss: bool = True) -> tuple[int, int | None]:
    """Summed RSS and PSS (bytes) of live ``pids``; without ``pss``, RSS alone (PSS None)."""
    rss = total_pss = 0
    for pid in pids:
        if not pss:
            rss += (kib_fields(f"/proc/{pid}/status", ("VmRSS",)) or {}).get("VmRSS", 0)
            continue
        fields = kib_fields(f"/proc/{pid}/smaps_rollup", ("Rss", "Pss")) or {}
        rss += fields.get("Rss", 0)
        total_pss += fields.get("Pss", 0)
    return rss, total_pss if pss else None


class MemorySampler:
    """Samples the RSS of this process and its descendants on a background thread, and their
    PSS too when asked (see MEMORY_INTERVAL_S)."""

    def __init__(self, interval_s: float = MEMORY_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self.baseline_rss, self.baseline_pss = memory_of([os.getpid()])
        self.series: list[tuple[float, int, int | None]] = []  # (s since start, rss, pss)
        self._stop = threading.Event()
        self._started = time.perf_counter()
        self._thread = threading.Thread(target=self._run, name="bench-memory", daemon=True)
        self._thread.start()

    def sample(self, pss: bool = False) -> None:
        """Read RSS (and PSS) once now (also at the end of a pass, while its workers live)."""
        me = os.getpid()
        rss, total_pss = memory_of([me, *descendants(me)], pss)
        self.series.append((time.perf_counter() - self._started, rss, total_pss))

    def _run(self) -> None:
        while True:
            self.sample()
            if self._stop.wait(self.interval_s):
                return

    def stop(self) -> tuple[int, int]:
        """Peak RSS and PSS above the baseline (bytes)."""
        self._stop.set()
        self._thread.join()
        peak_rss = max((r for _, r, _ in self.series), default=self.baseline_rss)
        peak_pss = max((p for _, _, p in self.series if p is not None),
                       default=self.baseline_pss)
        return peak_rss - self.baseline_rss, peak_pss - self.baseline_pss


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a live process (``/proc/<pid>/stat``; 0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime


# Frames decoded by refstream's decoders, in every process (counted by their codec contexts).
DECODED = multiprocessing.Value("q", 0)


class CountedDecoder(decode.EpisodeDecoder):
    """refstream's decoder, counting into :data:`DECODED` (installed by :func:`run_bench`; the
    DataLoader's workers fork with it)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if not isinstance(self.codec, CountedCodec):  # a peer's shared context counts already
            self.codec = CountedCodec(self.codec)


class CountedCodec:
    """A decoder's codec context adding the frames each packet decodes to into DECODED."""

    def __init__(self, codec) -> None:
        self.codec = codec

    def decode(self, packet):
        frames = self.codec.decode(packet)
        with DECODED.get_lock():
            DECODED.value += len(frames)
        return frames

    def flush_buffers(self) -> None:
        self.codec.flush_buffers()


class TimedCollate:
    """A DataLoader ``collate_fn`` that adds the CPU time of each call to its worker's slot of
    a shared tensor (slot 0 without workers)."""

    def __init__(self, collate: Callable) -> None:
        self.collate = collate
        self.seconds = torch.zeros(64, dtype=torch.float64).share_memory_()

    def __call__(self, batch):
        started = time.thread_time()
        try:
            return self.collate(batch)
        finally:
            info = torch.utils.data.get_worker_info()
            self.seconds[0 if info is None else info.id] += time.thread_time() - started


@dataclass(frozen=True)
class Pass:
    """One timed pass of one method (seconds, bytes)."""

    samples: int
    first_batch_s: float  # from before the dataset is made to the first batch
    steady_samples_per_s: float  # after every worker's first batch (see timed_pass)
    steady_cpu_ms: tuple[float, float, float]  # per sample, the same: main thread, workers, collate
    peak_rss_above_bytes: int
    peak_pss_above_bytes: int
    decoded_frames: int  # the map-style items' own count; refstream's decoders' (DECODED)
    steady_frames: tuple[int, int]  # (decoded frames, samples) in the same window as the rate
    batch_times_s: list[tuple[float, int]] = field(default_factory=list)  # (t, samples so far)
    memory_series: list[tuple[float, int, int | None]] = field(default_factory=list)


def timed_pass(make_loader: Callable[[], tuple[object, object]], max_batches: int | None) -> Pass:
    """Make ``(dataset, loader)`` and consume up to ``max_batches`` batches, measuring; the
    loader's collation is timed by its ``TimedCollate``."""
    sampler = MemorySampler()
    start = time.perf_counter()
    dataset, loader = make_loader()
    batches = iter(loader)
    samples, decoded = 0, -DECODED.value
    times: list[tuple[float, int]] = []
    decoded_at: list[int] = []  # frames decoded when each batch was received
    cpu: list[tuple[float, float, float]] = []  # after each batch: main thread, workers, collate
    workers: list[int] = []
    try:
        for batch in batches:
            samples += len(batch["index"])
            if "bench.decoded_frames" in batch:
                decoded += int(batch["bench.decoded_frames"].sum())
            times.append((time.perf_counter() - start, samples))
            decoded_at.append(decoded + DECODED.value)
            if len(times) == 1:  # the first batch: the workers (if any) have started
                workers = descendants(os.getpid())
                sampler.sample(pss=True)
            cpu.append((time.thread_time(), sum(process_cpu_s(p) for p in workers),
                        float(loader.collate_fn.seconds.sum())))
            if max_batches is not None and len(times) >= max_batches:
                break
        sampler.sample(pss=True)  # a pass shorter than the sampling interval is measured too
    finally:
        del batches  # joins the DataLoader workers, so their CPU time is counted below
    rss_above, pss_above = sampler.stop()
    if not times:
        raise UsageError("the loader yielded no batch: the dataset is smaller than one batch")
    # From the batch that ends the first round (each worker's first; the time before it is the
    # first batch's figure) to the last. A pass's work is uneven: with a share's episodes all
    # resident, a frame's first request decodes it and later ones reuse it, so decoding falls
    # early. The decode limit charges the frames decoded in the same window, by time: a
    # worker's frames count when it decodes them, whichever batch they are for.
    mid = min(len(times) - 1, max(0, getattr(loader, "num_workers", 0) - 1))
    (from_s, from_samples), (last_s, last_samples) = times[mid], times[-1]
    steady = (last_samples - from_samples) / (last_s - from_s) if last_s > from_s else 0.0
    # CPU: up to the batch received when the workers made their last one; the batches the
    # DataLoader fetched ahead arrive after that with no CPU spent on them.
    ahead = getattr(loader, "num_workers", 0) * (getattr(loader, "prefetch_factor", 0) or 0)
    end = min(len(times) - 1, max(mid + 1, len(times) - 1 - ahead))
    per_sample = 1000 / max(1, times[end][1] - from_samples)
    steady_cpu = tuple((b - a) * per_sample for a, b in zip(cpu[mid], cpu[end], strict=True))
    decoded += DECODED.value
    steady_frames = (decoded - decoded_at[mid], last_samples - from_samples) \
        if last_samples > from_samples else (decoded, samples)
    return Pass(samples, times[0][0], steady, steady_cpu, rss_above, pss_above,
                decoded, steady_frames, times, sampler.series)


@dataclass(frozen=True)
class HttpTraffic:
    """What the loopback server answered during one pass."""

    requests: int
    video_requests: int
    video_bytes: int  # bytes asked for by video range requests
    data_parquet_requests: int  # reads of data/… Parquet files (footers and row groups)
    other_requests: int  # metadata, HEADs for sizes and identities
    body_bytes: int  # every response body byte


def http_traffic(server: demo.LoopbackServer, log_start: int, log_end: int | None = None,
                 body_bytes: int = 0) -> HttpTraffic:
    """Classify ``server.log[log_start:log_end]``; ``body_bytes`` is what those sent."""
    entries = server.log[log_start:log_end]
    video = [e for e in entries if e[0] == "GET" and e[1].endswith(".mp4")]
    video_bytes = 0
    for _, path, range_header, _ in video:
        if range_header is None:
            video_bytes += (server.root / path.lstrip("/")).stat().st_size
            continue
        first, _, last = range_header.removeprefix("bytes=").partition("-")
        video_bytes += int(last) - int(first) + 1
    parquet = [e for e in entries if e[0] == "GET" and "/data/" in e[1]
               and e[1].endswith(".parquet")]
    return HttpTraffic(len(entries), len(video), video_bytes, len(parquet),
                       len(entries) - len(video) - len(parquet), body_bytes)


# --- planner, index, mixing -------------------------------------------------------------------


# --- the run ----------------------------------------------------------------------------------


def _streaming(root: str, config: BenchConfig, delta_timestamps: dict, epoch: int,
               batched: bool = True, return_uint8: bool = False):
    """A refstream dataset and its DataLoader: ready batches, or the DataLoader collating."""
    dataset = StreamingDataset(root, delta_timestamps=delta_timestamps,
                               seed=config.seed, episode_pool_size=config.pool_size,
                               byte_budget_gb=config.budget_gb, batch_size=config.batch_size,
                               batched=batched, return_uint8=return_uint8)
    dataset.set_epoch(epoch)
    return dataset, _loader(dataset, config, batched)


def _map_style(root: Path, config: BenchConfig, windows: dict, repeat: int):
    dataset = baselines.MapStyleVideoDataset(root, windows)
    generator = torch.Generator().manual_seed(config.seed + repeat)
    return dataset, _loader(dataset, config, False, shuffle=True, generator=generator)


def _loader(dataset, config: BenchConfig, batched: bool, **options):
    """The run's DataLoader; ``batched``: the dataset yields ready batches."""
    return torch.utils.data.DataLoader(
        dataset, batch_size=None if batched else config.batch_size,
        num_workers=config.num_workers, collate_fn=TimedCollate(
            torch.utils.data.default_convert if batched else torch.utils.data.default_collate),
        **options)


@dataclass(frozen=True)
class Method:
    """Every pass of one method and what the report derives from them."""

    name: str
    passes: list[Pass]
    amplification: float | None = None  # decoded / delivered frames
    steady_amplification: float | None = None  # the same in the passes' timed windows
    traffic: HttpTraffic | None = None  # one pass, after the dataset was made

    @property
    def samples_per_s(self) -> float:
        return statistics.median(p.steady_samples_per_s for p in self.passes)

    @property
    def first_batch_s(self) -> float:
        return statistics.median(p.first_batch_s for p in self.passes)

    @property
    def cpu_ms(self) -> tuple[float, float, float]:
        """Steady CPU ms per sample, medians over passes: main thread, workers, collation."""
        return tuple(statistics.median(p.steady_cpu_ms[i] for p in self.passes)
                     for i in range(3))

    @property
    def peak_rss_above_bytes(self) -> int:
        return max(p.peak_rss_above_bytes for p in self.passes)

    @property
    def peak_pss_above_bytes(self) -> int:
        return max(p.peak_pss_above_bytes for p in self.passes)


@dataclass(frozen=True)
class MemoryRow:
    """One configuration of the memory table: the peak total PSS over one epoch (bytes) of a
    new training process and its DataLoader workers."""

    workers: int
    budget_gb: float
    pool: int | None  # None: the default pool (32 per rank, split)
    uint8: bool
    pss_bytes: int

    @property
    def named(self) -> bool:
        return self.uint8 and (self.workers, self.budget_gb, self.pool) == (
            MEMORY_WORKERS, MEMORY_BUDGET_GB, MEMORY_POOL)


@dataclass(frozen=True)
class Target:
    key: str
    text: str
    measured: str
    passed: bool | None  # None: the target does not apply to this run (``measured`` says why)

    @property
    def verdict(self) -> str:
        return {True: "pass", False: "MISS", None: "n/a"}[self.passed]


@dataclass(frozen=True)
class HubRun:
    """One epoch from the emulated Hub: what the main process and its workers resolved."""

    processes: int  # the main process and the DataLoader workers
    files: int  # files read through the Hub
    resolves: int  # /resolve/ requests
    most_per_file: int  # the most resolves of one file
    target_requests: int  # requests straight to a remembered target

    def line(self) -> str:
        return (f"Hub epoch (emulated, {self.processes} processes): {self.resolves} resolves for "
                f"{self.files} files ({self.resolves / max(1, self.files):.2f} per file, at most "
                f"{self.most_per_file}; {self.resolves / max(1, self.files * self.processes):.2f}"
                f" per file per process), then {self.target_requests} requests straight to the "
                "signed targets")


@dataclass(frozen=True)
class BenchReport:
    config: BenchConfig
    root: str
    episodes: int
    frames: int
    cameras: int
    dataset_bytes: int
    spans: SpanTotals
    methods: list[Method]
    ceiling: Ceiling
    ceiling_samples_per_s: float  # ceiling frames/s / delivered frames per sample
    ceiling_cpu_ms: float  # the ceiling's CPU per sample: decoding and RGB alone
    long_gop: tuple[Ceiling, float, float] | None  # that dataset's ceiling, samples/s, CPU ms
    write_floor: WriteFloor
    ttfs_s: dict[str, float]  # "x1" / "xN" -> median seconds over HTTP
    gop: int  # frames per keyframe of the dataset's videos (the mean, rounded)
    memory_table: list[MemoryRow]
    planner: PlannerFigures
    droid_mixing: list[Mixing]
    hub_run: HubRun
    hub_droid: HubResolves
    targets: list[Target]
    seconds: float

    def method(self, name: str) -> Method:
        return next(m for m in self.methods if m.name == name)

    def _decode_share(self, method: Method) -> tuple[float, float, float]:
        """The ceiling of the method's dataset (samples/s, CPU ms per sample) and the share of
        it the method needs: decoding scales with its amplification in the window its samples/s
        and CPU are timed over, the RGB conversion (of each delivered frame) does not."""
        if self.long_gop is not None and method.name.endswith(LONG_GOP):
            ceiling, samples_per_s, cpu_ms = self.long_gop
        else:
            ceiling, samples_per_s, cpu_ms = self.ceiling, self.ceiling_samples_per_s, \
                self.ceiling_cpu_ms
        relative = method.steady_amplification * ceiling.episode_frames / ceiling.decoded_frames
        share = (ceiling.decode_s * relative + ceiling.rgb_s) / (ceiling.decode_s + ceiling.rgb_s)
        return samples_per_s, cpu_ms, share

    def decode_cpu_ms(self, method: Method) -> float:
        """Decoding and RGB per sample: the ceiling's CPU at the method's amplification."""
        _, cpu_ms, share = self._decode_share(method)
        return cpu_ms * share

    def decode_limit(self, method: Method) -> float:
        """Samples/s if decoding and RGB were all the method did, in the ceiling's processes."""
        samples_per_s, _, share = self._decode_share(method)
        return samples_per_s / share

    def floor_limit(self, method: Method) -> float:
        """The decode limit with the write floor of the method's items added to the CPU of
        each sample: what the method could reach at most, its loader costing nothing else."""
        floor = self.write_floor.uint8_ms if "uint8" in method.name else \
            self.write_floor.float32_ms
        decode_ms = self.decode_cpu_ms(method)
        return self.decode_limit(method) * decode_ms / (decode_ms + floor)

    def loader_cpu_ms(self, method: Method) -> float:
        """A method's CPU per sample beyond decoding and RGB: total minus the ceiling's, or 0
        where the ceiling's figure, measured apart, exceeds the total."""
        return max(0.0, sum(method.cpu_ms[:2]) - self.decode_cpu_ms(method))

    def as_dict(self) -> dict:
        out = asdict(self)
        out["spans"].pop("episode_bytes")
        for method, raw in zip(self.methods, out["methods"], strict=True):
            raw.update(samples_per_s=method.samples_per_s, first_batch_s=method.first_batch_s,
                       cpu_ms=method.cpu_ms, loader_cpu_ms=self.loader_cpu_ms(method),
                       peak_rss_above_bytes=method.peak_rss_above_bytes,
                       peak_pss_above_bytes=method.peak_pss_above_bytes)
        return out

    def lines(self) -> list[str]:
        c = self.config
        shape = (f"{self.episodes} episodes, {self.frames} frames, {self.cameras} cameras"
                 if c.root else f"{self.episodes} episodes x {c.frames_per_episode} frames = "
                 f"{self.frames} frames, {self.cameras} cameras {c.width}x{c.height} {c.codec} "
                 f"g={c.gop} bf={c.bframes}")
        out = [
            f"dataset: {self.root}: {shape}, {self.dataset_bytes:,} bytes; minimal spans "
            f"{self.spans.span_bytes:,} bytes",
            f"loader: {c.num_workers} workers, batch {c.batch_size}, camera window "
            f"{c.camera_window} frames, action window {c.action_window}, budget {c.budget_gb} GiB"
            f", pool {c.pool_size or 'default'}; {c.repeats} repeats (medians)",
            "",
            f"{'method':26s} {'samples/s':>9s} {'x map':>6s} {'1st s':>5s} {'dec/del':>7s} "
            f"{'B/span':>6s} {'B/data':>6s} {'req':>4s} {'RSS+MB':>6s} {'PSS+MB':>6s} "
            f"{'CPU ms/sample: total':>20s} {'decode+RGB':>10s} {'loader':>6s} {'collate':>7s}",
        ]
        base = self.method("map-style").samples_per_s
        for m in self.methods:
            traffic = m.traffic
            out.append(
                f"{m.name:26s} {m.samples_per_s:9.1f} {_ratio(m.samples_per_s, base):>6s} "
                f"{m.first_batch_s:5.2f} {_fmt(m.amplification, '.2f'):>7s} "
                f"{_fmt(traffic and traffic.video_bytes / self.spans.span_bytes, '.3f'):>6s} "
                f"{_fmt(traffic and traffic.body_bytes / self.dataset_bytes, '.3f'):>6s} "
                f"{_fmt(traffic and traffic.requests, 'd'):>4s} "
                f"{m.peak_rss_above_bytes / MB:6.0f} {m.peak_pss_above_bytes / MB:6.0f} "
                f"{sum(m.cpu_ms[:2]):20.2f} {self.decode_cpu_ms(m):10.2f} "
                f"{self.loader_cpu_ms(m):6.2f} {m.cpu_ms[2]:7.2f}")
        ce = self.ceiling
        out.append(
            f"{'decode-ceiling':26s} {self.ceiling_samples_per_s:9.1f} "
            f"{_ratio(self.ceiling_samples_per_s, base):>6s} {'-':>5s} "
            f"{ce.decoded_frames / ce.episode_frames:7.2f} {'-':>6s} {'-':>6s} {'-':>4s} "
            f"{'-':>6s} {'-':>6s} {self.ceiling_cpu_ms:20.2f} {self.ceiling_cpu_ms:10.2f} "
            f"{'-':>6s} {'-':>7s}")
        out += [
            "",
            f"decode ceiling: {ce.frames_per_s:,.0f} frames/s in {ce.processes} processes "
            f"(decode {ce.decode_s:.2f} s, RGB conversion {ce.rgb_s:.2f} s summed); samples/s "
            f"= frames/s / {self.cameras * c.camera_window} delivered frames per sample",
        ]
        if self.long_gop is not None:
            gop, samples_per_s, _ = self.long_gop
            out.append(f"long GOPs (h264 g=30 bf=2): decode ceiling {samples_per_s:.1f} "
                       f"samples/s ({gop.frames_per_s:,.0f} frames/s); CPU ms per sample: "
                       "total includes decoding every frame the amplification adds")
        floor = self.write_floor
        out.append(
            f"write floor (one thread, {floor.megabytes:.1f} MB of float32 camera values per "
            f"sample into a ready batch's shared memory, from a decoded frame's uint8 planes): "
            f"float32 {floor.float32_ms:.2f} ms per sample, uint8 {floor.uint8_ms:.2f} ms; the "
            f"float32 row's decode limit with it added: at most "
            f"{self.floor_limit(self.method('refstream-http')):.1f} samples/s")
        out.append(
            f"time to first batch over HTTP, sidecar built: x1 {self.ttfs_s['x1']:.2f} s, "
            + (f"x{c.ttfs_scale} {self.ttfs_s['xN']:.2f} s" if "xN" in self.ttfs_s
               else "scaled dataset not measured (--root)"))
        if self.memory_table:
            out += ["", "memory: peak total PSS of a training process and its workers over an "
                    "epoch (MB), ready batches:",
                    f"{'workers':>7s} {'budget GiB':>10s} {'pool':>7s} {'items':>7s} "
                    f"{'PSS MB':>7s}"]
            out += [f"{row.workers:7d} {row.budget_gb:10.2f} {row.pool or 'default':>7} "
                    f"{'uint8' if row.uint8 else 'float32':>7s} {row.pss_bytes / MB:7,.0f}"
                    + ("  <- the README's small machine" if row.named else "")
                    for row in self.memory_table]
            out.append("")
        p = self.planner
        out.append(
            f"planner (DROID-sized rank: {p.rank_episodes:,} episodes, one of "
            f"{max(1, c.num_workers)} workers with {p.worker_anchors:,} anchors): "
            f"{p.anchors_per_s:,.0f} anchors/s, setup {p.setup_s:.2f} s, resume fast-forward "
            f"to the last anchor {p.resume_skip_s:.2f} s ({p.skip_anchors_per_s:,.0f} anchors/s)")
        out.append(
            f"elastic resume ({p.elastic_ranks[0]} -> {p.elastic_ranks[1]} ranks, checkpoint "
            f"halfway through the epoch): {p.elastic_s:.2f} s per new rank, replaying "
            f"{p.elastic_anchors:,} delivered anchors of every old rank and worker")
        for mix in self.droid_mixing:
            out.append(
                f"batch mixing (DROID-sized rank, {mix.strategy}): {mix.mean_distinct:.2f} "
                f"distinct episodes per batch of {mix.batch_size} vs "
                f"{mix.uniform_mean_distinct:.2f} uniform ({mix.batches} batches)")
        out += [self.hub_run.line(), self.hub_droid.line(), "", "targets:"]
        for t in self.targets:
            out.append(f"  [{t.verdict}] {t.text}: {t.measured}")
        out += ["", f"bench took {self.seconds:.0f} s"]
        return out


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _ratio(value: float, base: float) -> str:
    return f"{value / base:.2f}" if base else "-"


def run_bench(config: BenchConfig, progress: Callable[[str], None] | None = None) -> BenchReport:
    """Generate (or take) the datasets, run every pass and figure; see the module docstring."""
    say = progress or (lambda _message: None)
    config.check()
    started = time.perf_counter()
    long_gop = replace(config, codec="h264", gop=30, bframes=2)
    if config.root is None:
        root = cached_dataset(config, config.episodes, say)
        scaled = cached_dataset(config, config.episodes * config.ttfs_scale, say)
        gop_root = cached_dataset(long_gop, config.episodes, say)
    else:
        root, scaled, gop_root = Path(config.root), None, None
    meta = load_meta(LocalSource(root))
    if not meta.camera_keys:
        raise UsageError(f"{root}: the dataset has no video features to benchmark")
    if config.root is not None:
        config = replace(config, cameras=len(meta.camera_keys), episodes=meta.total_episodes)
    windows = config.delta_timestamps(meta.camera_keys, meta.fps, meta.features)
    delivered_per_sample = len(meta.camera_keys) * config.camera_window

    def passes(make, batches=None) -> list[Pass]:
        return [timed_pass(lambda r=r: make(r), batches) for r in range(config.repeats)]

    with tempfile.TemporaryDirectory(prefix="refstream-bench-") as scratch, \
            demo.environment(CACHE_ENV, str(Path(scratch) / "cache")), \
            mock.patch.object(decode, "EpisodeDecoder", CountedDecoder):
        # Sidecars of loopback URLs (a new port every run) go to a scratch cache.
        methods: list[Method] = []
        with demo.serve_directory(root) as server:
            say("refstream over loopback HTTP, both idioms")
            probe, _ = _streaming(server.url, config, windows, 0)  # builds the sidecar
            spans = span_totals(root, meta, probe.video_index)
            gop = _gop(probe.video_index)
            marks: list[tuple[int, int]] = []  # server log and bytes: before, made, per pass

            def made(r: int):
                marks.append((len(server.log), server.body_bytes))
                made_loader = _streaming(server.url, config, windows, r)
                marks.append((len(server.log), server.body_bytes))
                return made_loader

            http = passes(made)
            marks.append((len(server.log), server.body_bytes))
            (streaming, sent), (end, sent_end) = marks[1], marks[2]  # the first pass
            traffic = http_traffic(server, streaming, end, sent_end - sent)
            methods.append(Method("refstream-http", http, traffic=traffic))
            methods.append(Method("refstream-http-plain", passes(lambda r: _streaming(
                server.url, config, windows, r, batched=False))))
            for batched in (True, False):
                methods.append(Method(f"refstream-http-uint8{'' if batched else '-plain'}",
                                      passes(lambda r, b=batched: _streaming(
                                          server.url, config, windows, r, batched=b,
                                          return_uint8=True))))
            say("time to first sample over HTTP at two dataset sizes")
            with contextlib.ExitStack() as servers:
                urls = {"x1": server.url}
                if scaled is not None:
                    urls["xN"] = servers.enter_context(demo.serve_directory(scaled)).url
                ttfs = first_batches(urls, config, windows)
            table = []
            if config.root is None:
                say("memory table: a new training process per configuration")
                table = memory_table(server.url, config, windows)
        gop_figures = None
        if gop_root is not None:
            say("refstream over loopback HTTP, long GOPs")
            with demo.serve_directory(gop_root) as gop_server:
                _streaming(gop_server.url, config, windows, 0)
                methods.append(Method(f"refstream-http-{LONG_GOP}", passes(
                    lambda r: _streaming(gop_server.url, config, windows, r))))
            gop_ceiling = ceiling_median(gop_root, load_meta(LocalSource(gop_root)), config)
            gop_figures = (gop_ceiling, gop_ceiling.frames_per_s / delivered_per_sample,
                           _cpu_ms(gop_ceiling, delivered_per_sample))

        say("refstream from the emulated Hub: resolves per file")
        hub_run = hub_epoch(root, config, windows)
        say("map-style baseline")
        methods.insert(0, Method("map-style", passes(
            lambda r: _map_style(root, config, windows, r), config.baseline_batches)))
        methods = [replace(m, amplification=_amplification(m.passes, delivered_per_sample),
                           steady_amplification=_amplification(m.passes, delivered_per_sample,
                                                               steady=True)) for m in methods]
        say("decode ceiling")
        ceiling = ceiling_median(root, meta, config)
        say("write floor")
        first = MappedIndex(probe.video_index)[meta.video_relpath(
            int(meta.episode_index[0]), meta.camera_keys[0])]
        floor = write_floor(config.batch_size, delivered_per_sample, first.height, first.width,
                            config.repeats)

    say("planner, batch mixing")
    video_bytes = sum(spans.episode_bytes.values())
    planner = planner_figures(config, video_bytes / max(1, meta.total_frames))
    droid = droid_lengths(config.droid_episodes, config.seed)
    rank = shard.rank_share(list(range(len(droid))), droid, 0, config.droid_ranks)
    droid_mixing = [batch_mixing(rank, [droid[e] for e in rank], config, s, MIXING_BATCHES)
                    for s in ("pool", "round_robin")]
    say("Hub resolves of a DROID-sized run")
    hub_droid = hub_resolves(config)
    report = BenchReport(
        config=config, root=str(root), episodes=int(meta.total_episodes),
        frames=int(meta.total_frames), cameras=len(meta.camera_keys),
        dataset_bytes=dataset_bytes(root), spans=spans, methods=methods, ceiling=ceiling,
        ceiling_samples_per_s=ceiling.frames_per_s / delivered_per_sample,
        ceiling_cpu_ms=_cpu_ms(ceiling, delivered_per_sample),
        long_gop=gop_figures, write_floor=floor, ttfs_s=ttfs, gop=gop, memory_table=table,
        planner=planner, droid_mixing=droid_mixing,
        hub_run=hub_run, hub_droid=hub_droid, targets=[], seconds=0.0)
    return replace(report, targets=evaluate_targets(report),
                   seconds=time.perf_counter() - started)


def _gop(video_index: VideoIndex) -> int:
    """Frames per keyframe over the dataset's videos (the mean, rounded)."""
    indexes = MappedIndex(video_index)
    keyframes = [indexes[relpath].keyframe for relpath in video_index.records]
    return round(sum(len(k) for k in keyframes) / max(1, sum(int(k.sum()) for k in keyframes)))


# A new training process for one row of the memory table: streams one epoch with the arguments
# of argv[1] (JSON) and prints the peak total PSS of itself and its workers, read every 4 batches.
MEMORY_CHILD = """import json, os, sys
import torch
from refstream.stream import StreamingDataset
from refstream.tools.bench import descendants, memory_of
arguments = json.loads(sys.argv[1])
workers = arguments.pop("num_workers")
loader = torch.utils.data.DataLoader(StreamingDataset(**arguments), batch_size=None,
                                     num_workers=workers)
peak = 0
for n, batch in enumerate(loader):
    if n % 4 == 0:
        peak = max(peak, memory_of([os.getpid(), *descendants(os.getpid())])[1])
print(json.dumps(peak))
"""


def memory_table(url: str, config: BenchConfig, windows: dict) -> list[MemoryRow]:
    """The memory table's rows over ``url`` (each a new process, so nothing of the bench's own
    memory counts)."""
    grid = [(workers, budget_gb, pool, False) for workers in config.memory_workers
            for budget_gb in config.memory_budgets_gb for pool in config.memory_pools]
    rows = []
    for workers, budget_gb, pool, uint8 in [*grid, (MEMORY_WORKERS, MEMORY_BUDGET_GB,
                                                    MEMORY_POOL, True)]:
        arguments = dict(root=url, delta_timestamps=windows, seed=config.seed,
                         batch_size=config.batch_size, batched=True, byte_budget_gb=budget_gb,
                         episode_pool_size=pool, return_uint8=uint8, num_workers=workers)
        done = subprocess.run([sys.executable, "-c", MEMORY_CHILD, json.dumps(arguments)],
                              capture_output=True, text=True)
        if done.returncode:
            raise UsageError(f"memory table: {arguments}: {done.stderr.strip()}")
        rows.append(MemoryRow(workers, budget_gb, pool, uint8, json.loads(done.stdout)))
    return rows


def hub_epoch(root: Path, config: BenchConfig, windows: dict) -> HubRun:
    """One epoch of ``root`` from the Hub that ``scale.hub_route`` emulates (no token)."""
    from refstream.tools import scale  # it imports this module

    with demo.serve_directory(root) as server, demo.environment("HF_ENDPOINT", server.url), \
            mock.patch.dict(os.environ, {"HF_TOKEN": ""}):
        server.route = scale.hub_route(root, server.url)
        _, loader = _streaming(f"hf://datasets/{scale.HUB_REPO}", config, windows, 0)
        for _ in loader:
            pass
    resolve = f"/datasets/{scale.HUB_REPO}/resolve/{scale.HUB_COMMIT}/"
    paths = [unquote(urlsplit(path).path) for method, path, _, _ in server.log
             if method == "GET" and "/api/" not in path]
    resolved = Counter(path.removeprefix(resolve) for path in paths if path.startswith(resolve))
    files = {path.removeprefix(resolve).lstrip("/") for path in paths}
    return HubRun(1 + config.num_workers, len(files), resolved.total(),
                  max(resolved.values(), default=0), len(paths) - resolved.total())


def ceiling_median(root: Path, meta: DatasetMeta, config: BenchConfig) -> Ceiling:
    """The decode ceiling repeated until the repeats last ``config.ceiling_s`` (an odd count, at
    least ``config.repeats``); wall, CPU, decode and RGB seconds are each the median."""
    runs: list[Ceiling] = []
    while (len(runs) < config.repeats or len(runs) % 2 == 0
           or sum(run.wall_s for run in runs) < config.ceiling_s):
        runs.append(decode_ceiling(root, meta, config.num_workers))
    return replace(runs[0], **{name: statistics.median(getattr(run, name) for run in runs)
                               for name in ("wall_s", "cpu_s", "decode_s", "rgb_s")})


@dataclass(frozen=True)
class WriteFloor:
    """CPU ms per sample to write a sample's camera values into a ready batch from decoded uint8
    planes (the least a worker does per sample beyond decoding and RGB conversion)."""

    float32_ms: float  # float32(v) / float32(255), as the decoder writes them
    uint8_ms: float
    megabytes: float  # float32 bytes per sample


def write_floor(batch_size: int, frames_per_sample: int, height: int, width: int,
                repeats: int) -> WriteFloor:
    """The median over ``repeats`` of writing a whole batch, one thread, into one shared
    tensor per dtype made as the worker makes them and touched once before (so page faults do
    not count), from the three planes of one decoded frame (in cache, as a decoder's output
    is). Memory bandwidth: a float32 batch of the default shape is 177 MB, past any cache."""
    planes = list(np.random.default_rng(0).integers(0, 256, (3, height, width), np.uint8))
    shape = (batch_size, frames_per_sample, 3, height, width)
    scale = np.float32(255)
    times: dict[str, float] = {}
    for dtype in (torch.float32, torch.uint8):
        storage = torch.UntypedStorage._new_shared(torch.Size(shape).numel() * dtype.itemsize)
        batch = torch.empty(0, dtype=dtype).set_(storage, 0, shape).numpy()
        batch.fill(0)
        runs = []
        for _ in range(max(1, repeats)):
            started = time.thread_time()
            for sample, frame in np.ndindex(batch_size, frames_per_sample):
                for plane, channel in zip(planes, batch[sample, frame], strict=True):
                    channel[...] = plane  # as the decoder writes them
                    if dtype == torch.float32:
                        np.divide(channel, scale, out=channel)
            runs.append(1000 * (time.thread_time() - started) / batch_size)
        times[str(dtype)] = statistics.median(runs)
    return WriteFloor(times["torch.float32"], times["torch.uint8"],
                      frames_per_sample * 3 * height * width * 4 / MB)


def _cpu_ms(ceiling: Ceiling, delivered_per_sample: int) -> float:
    """The ceiling's CPU per sample: decoding and RGB of its frames alone."""
    return 1000 * ceiling.cpu_s * delivered_per_sample / ceiling.episode_frames


def _amplification(passes: list[Pass], delivered_per_sample: int, steady: bool = False) -> float:
    """Decoded ÷ delivered frames over a method's passes; ``steady``: in their timed windows."""
    counts = [p.steady_frames if steady else (p.decoded_frames, p.samples) for p in passes]
    return sum(d for d, _ in counts) / (sum(n for _, n in counts) * delivered_per_sample)


def first_batches(urls: dict[str, str], config: BenchConfig, windows: dict) -> dict[str, float]:
    """Median seconds from making the dataset to its first batch over each of ``urls`` (sidecars
    built first), the urls taken in turn within each repeat, so that the machine's other work
    weighs on all alike."""
    for url in urls.values():
        _streaming(url, config, windows, 0)
    times: dict[str, list[float]] = {key: [] for key in urls}
    for r in range(config.repeats):
        for key, url in urls.items():
            run = timed_pass(lambda url=url, r=r: _streaming(url, config, windows, r), 1)
            times[key].append(run.first_batch_s)
    return {key: statistics.median(seconds) for key, seconds in times.items()}


def run_first_batch(config: BenchConfig, progress: Callable[[str], None] | None = None
                    ) -> list[str]:
    """The time to first batch alone (``refstream bench --first-batch``) at x1 and
    ``ttfs_scale`` x the episodes, and its targets' lines."""
    say = progress or (lambda _message: None)
    config.check()
    roots = {"x1": cached_dataset(config, config.episodes, say),
             "xN": cached_dataset(config, config.episodes * config.ttfs_scale, say)}
    meta = load_meta(LocalSource(roots["x1"]))
    windows = config.delta_timestamps(meta.camera_keys, meta.fps, meta.features)
    with tempfile.TemporaryDirectory(prefix="refstream-bench-") as scratch, \
            demo.environment(CACHE_ENV, str(Path(scratch) / "cache")), \
            contextlib.ExitStack() as servers:
        urls = {key: servers.enter_context(demo.serve_directory(root)).url
                for key, root in roots.items()}
        say(f"time to first batch, x1 and x{config.ttfs_scale} in turn, {config.repeats} repeats")
        x1, xn = first_batches(urls, config, windows).values()
    scale = f"x{config.ttfs_scale}"
    return [f"time to first batch over HTTP, sidecar built: x1 {x1:.2f} s, {scale} {xn:.2f} s "
            f"({xn / x1:.2f} x)",
            f"  [{'pass' if xn <= 1.3 * x1 else 'MISS'}] "
            f"{TARGET_TEXT['ttfs_flat'].replace('xN', scale)}: {xn:.2f} s vs 1.3 x {x1:.2f} s"]


def evaluate_targets(report: BenchReport) -> list[Target]:
    """The targets with the measured values; those made for another run, n/a (see
    :func:`_not_applying`)."""
    c = report.config
    http, base = report.method("refstream-http"), report.method("map-style")
    uint8 = report.method("refstream-http-uint8")
    amplification = http.amplification or 0.0
    limit, uint8_limit = report.decode_limit(http), report.decode_limit(uint8)
    loader_ms = report.loader_cpu_ms(http)
    traffic = http.traffic
    allowed = 1.1 * report.episodes * report.cameras + traffic.data_parquet_requests
    memory_bound = c.budget_gb * GIB + 300 * MB * max(1, c.num_workers)
    x1, xn = report.ttfs_s["x1"], report.ttfs_s.get("xN")
    worst_ttfs = max(x1, xn if xn is not None else 0.0)
    targets = [
        ("loader_cpu", f"{sum(http.cpu_ms[:2]):.2f} - {report.decode_cpu_ms(http):.2f} = "
                       f"{loader_ms:.2f} ms per sample", loader_ms <= 3.0),
        ("http_vs_map", f"{http.samples_per_s:.1f} vs {base.samples_per_s:.1f} samples/s = "
                        f"{_ratio(http.samples_per_s, base.samples_per_s)}x",
         http.samples_per_s >= 4 * base.samples_per_s),
        ("float32_limit", f"{http.samples_per_s:.1f} vs 0.9 x {limit:.1f} = "
                          f"{0.9 * limit:.1f} samples/s ({http.samples_per_s / limit:.2f} x "
                          f"at {http.steady_amplification:.2f} decoded per delivered frame; "
                          f"with the float32 write floor at most {report.floor_limit(http):.1f}"
                          f" = {report.floor_limit(http) / limit:.2f} x)",
         http.samples_per_s >= 0.9 * limit),
        ("uint8_limit", f"{uint8.samples_per_s:.1f} vs 0.95 x {uint8_limit:.1f} = "
                        f"{0.95 * uint8_limit:.1f} samples/s "
                        f"({uint8.samples_per_s / uint8_limit:.2f} x at "
                        f"{uint8.steady_amplification:.2f})",
         uint8.samples_per_s >= 0.95 * uint8_limit),
        ("uint8", f"{uint8.samples_per_s:.1f} vs {http.samples_per_s:.1f} samples/s",
         uint8.samples_per_s >= http.samples_per_s),
        ("amplification", f"{amplification:.2f} decoded per delivered frame",
         amplification <= 1.6),
        ("span_bytes", f"{traffic.video_bytes:,} vs {report.spans.span_bytes:,} bytes = "
                       f"{traffic.video_bytes / report.spans.span_bytes:.3f}x",
         traffic.video_bytes <= 1.05 * report.spans.span_bytes),
        ("requests", f"{traffic.requests} while streaming ({traffic.video_requests} video, "
                     f"{traffic.data_parquet_requests} data Parquet, {traffic.other_requests} "
                     f"other) vs {allowed:.1f}", traffic.requests <= allowed),
        ("memory", f"{http.peak_pss_above_bytes / MB:.0f} MB (RSS "
                   f"{http.peak_rss_above_bytes / MB:.0f} MB) vs {memory_bound / MB:.0f} MB",
         http.peak_pss_above_bytes <= memory_bound),
        ("ttfs", f"x1 {x1:.2f} s" + (f", x{c.ttfs_scale} {xn:.2f} s" if xn is not None else ""),
         worst_ttfs <= 3.0),
    ]
    if xn is not None:
        targets.append(("ttfs_flat", f"{xn:.2f} s vs 1.3 x {x1:.2f} s = {1.3 * x1:.2f} s",
                        xn <= 1.3 * x1))
    gop = next((m for m in report.methods if m.name.endswith(LONG_GOP)), None)
    if gop is not None:
        targets += [
            ("long_gop_amplification", f"{gop.amplification:.2f} decoded per delivered frame",
             gop.amplification <= 1.5),
            ("long_gop_speed", f"{gop.samples_per_s:.1f} vs 0.6 x {http.samples_per_s:.1f} = "
                               f"{0.6 * http.samples_per_s:.1f} samples/s",
             gop.samples_per_s >= 0.6 * http.samples_per_s)]
    named = next((row for row in report.memory_table if row.named), None)
    if named is not None:
        targets.append(("memory_table", f"{named.pss_bytes / MB:,.0f} MB vs {GIB / MB:,.0f} MB",
                        named.pss_bytes <= GIB))
    p, hub, droid = report.planner, report.hub_run, report.hub_droid
    targets.append(("elastic", f"{p.elastic_s:.2f} s for {p.elastic_ranks[0]} -> "
                               f"{p.elastic_ranks[1]} ranks", p.elastic_s <= 30.0))
    targets.append(("hub_resolves", f"{hub.resolves} resolves of {hub.files} files by "
                                    f"{hub.processes} processes, at most {hub.most_per_file} "
                                    "per file", hub.most_per_file <= 1))
    targets.append(("hub_droid", f"{droid.window_average:,.0f} (the first 5 minutes: "
                                 f"{droid.first_window:,})", droid.window_average <= 1500))
    measured = {key: (text, passed) for key, text, passed in targets}
    out = []
    for key, text in TARGET_TEXT.items():
        why = _not_applying(report, key)
        shown, passed = measured.get(key, ("not measured", None))
        if why is not None or key not in measured:
            shown, passed = (f"n/a: {why}; {shown}" if why else f"n/a: {shown}"), None
        out.append(Target(key, text.replace("xN", f"x{c.ttfs_scale}"), shown, passed))
    return out


# Targets made for the default shape (timing and its ratios, at 320x240 and DataLoader workers)
# say nothing about a smoke run's thumbnails; those about g=2 or a DROID-sized rank, nothing
# about other GOPs or a smaller rank.
_TIMED = {"loader_cpu", "http_vs_map", "float32_limit", "uint8_limit", "uint8", "ttfs",
          "ttfs_flat", "long_gop_speed", "memory_table"}


def _not_applying(report: BenchReport, key: str) -> str | None:
    """Why ``key`` does not apply to this run, or None when it does."""
    c = report.config
    if c.smoke and key in _TIMED:
        return "--quick is a smoke run; the target holds for the default shape"
    if c.smoke and key == "elastic":
        return f"--quick replays {c.droid_episodes:,} episodes, not a DROID-sized run"
    if key == "amplification" and report.gop != 2:
        return f"the dataset's GOP is {report.gop} frames, not 2"
    if c.root is not None and key in ("ttfs_flat", "long_gop_amplification", "long_gop_speed",
                                      "memory_table"):
        return "--root measures that dataset alone"
    return None


def plot(report: BenchReport, path: str | os.PathLike) -> bool:
    """Samples delivered and memory over time of one pass per method, as a PNG at ``path``;
    False (nothing written) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    for method in report.methods:
        run = method.passes[0]
        times = [0.0] + [t for t, _ in run.batch_times_s]
        counts = [0] + [n for _, n in run.batch_times_s]
        top.plot(times, counts, label=f"{method.name} ({method.samples_per_s:.0f}/s)")
        bottom.plot([t for t, _, _ in run.memory_series],
                    [r / MB for _, r, _ in run.memory_series], label=method.name)
    top.set_ylabel("samples delivered")
    top.legend()
    bottom.set_ylabel("RSS, MB (main + workers)")
    bottom.set_xlabel("seconds since the dataset was made")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return True
