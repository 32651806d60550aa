"""Planner figures on a DROID-sized rank for ``refstream bench``: anchors/s, the worst resume
fast-forward, an elastic resume and batch mixing, on synthetic episode lengths
(:func:`droid_lengths`) without any video; and the Hub resolves a DROID-sized run would make
(:func:`hub_resolves`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from refstream import hub, resume, shard
from refstream.planner import DEFAULT_POOL_RAMP, Planner
from refstream.stream import GIB

if TYPE_CHECKING:
    from refstream.tools.bench import BenchConfig

__all__ = ["droid_lengths", "planner_figures", "batch_mixing", "hub_resolves"]

DROID_EPISODES = 95_658  # DROID 1.0.1: episodes
DROID_FRAME_RANGE = (60, 520)  # synthetic lengths, uniform; mean ~290 like DROID's 27.6 M frames
PLANNER_TIMED_ANCHORS = 300_000  # anchors emitted to time the planner (a worker has ~1.7 M)
MIXING_BATCHES = 2_000  # batches per worker compared for mixing on the DROID-sized rank
# The Hub run projected: ranks on one machine (one IP address, one cache folder), DataLoader
# workers per rank, samples/s per rank; the Hub's resolver quota window ("Rate limits" docs).
HUB_RANKS, HUB_WORKERS, HUB_SAMPLES_PER_S, QUOTA_WINDOW_S = 8, 4, 500, 300
DROID_CAMERAS = 3
# File sizes as LeRobot rolls DROID's files, and the bytes a frame adds to each: the mean video
# sample (DROID's 369 GB over its 82.8 M samples) and a data Parquet row (refstream.tools.scale).
VIDEO_FILE_BYTES, DATA_FILE_BYTES = 200 << 20, 100 << 20
SAMPLE_BYTES, DATA_ROW_BYTES = 4_450, 200


def droid_lengths(count: int, seed: int) -> list[int]:
    low, high = DROID_FRAME_RANGE
    return np.random.default_rng(seed).integers(low, high + 1, size=count).tolist()


@dataclass(frozen=True)
class PlannerFigures:
    rank_episodes: int
    worker_anchors: int
    setup_s: float  # rank share + worker shares + limits + the planner
    anchors_per_s: float
    resume_skip_s: float  # fast-forward to the worker's last anchor (the worst resume)
    skip_anchors_per_s: float
    elastic_ranks: tuple[int, int]  # resuming with another world size: old -> new
    elastic_s: float  # replay of every old rank + planning the rest + one new worker's start
    elastic_anchors: int  # anchors the old ranks delivered, all replayed


def planner_figures(config: BenchConfig, bytes_per_frame: float) -> PlannerFigures:
    """The planner of worker 0 of rank 0 of a DROID-sized dataset, and its elastic resume."""
    frames = droid_lengths(config.droid_episodes, config.seed)
    started = time.perf_counter()
    workers = max(1, config.num_workers)
    rank = shard.rank_share(list(range(len(frames))), frames, 0, config.droid_ranks)
    part = shard.worker_shares(rank, [frames[e] for e in rank], workers)[0]
    limits = shard.split_limits(workers, pool_size=config.pool_size, decoder_cache=None,
                                byte_budget=int(config.budget_gb * GIB), cameras=config.cameras)
    counts = [frames[e] for e in part]

    def make() -> Planner:
        return Planner(part, counts, seed=config.seed, epoch=0, rank=0, worker=0,
                       pool_size=limits.pool_size, byte_budget=limits.byte_budget,
                       byte_sizes=[int(n * bytes_per_frame) for n in counts])

    planner = make()
    setup_s = time.perf_counter() - started
    timed = min(PLANNER_TIMED_ANCHORS, planner.remaining)
    started = time.perf_counter()
    for _ in range(timed):
        next(planner)
    emit_s = time.perf_counter() - started
    planner = make()
    skipped = planner.remaining - 1
    started = time.perf_counter()
    planner.skip(skipped)
    skip_s = time.perf_counter() - started
    elastic = elastic_figures(frames, config, bytes_per_frame)
    return PlannerFigures(len(rank), sum(counts), setup_s, timed / emit_s, skip_s,
                          skipped / skip_s if skip_s else 0.0, *elastic)


def elastic_figures(frames: list[int], config: BenchConfig,
                    bytes_per_frame: float) -> tuple[tuple[int, int], float, int]:
    """Resume a checkpoint taken halfway through a finite epoch of ``droid_ranks`` ranks on
    3/4 of them: the time a new rank needs before its first worker's first anchor."""
    workers, batch = max(1, config.num_workers), config.batch_size
    old, new = config.droid_ranks, max(1, config.droid_ranks * 3 // 4)
    ids = list(range(len(frames)))
    sizes = {e: int(f * bytes_per_frame) for e, f in zip(ids, frames, strict=True)}
    setup = resume.ResumeSetup(
        seed=config.seed, strategy="pool", pool_size=config.pool_size,
        pool_ramp=DEFAULT_POOL_RAMP, byte_budget=int(config.budget_gb * GIB), world_size=new,
        num_workers=workers, batch_size=batch, repeat=False,
        selection=resume.selection_digest(ids, frames))
    samples = sum(frames) // old // 2 // batch * batch
    resumed = resume.ResumeState(0, 0, setup, (resume.Segment(old, workers, batch, samples),))
    started = time.perf_counter()
    course = resume.Course(setup, ids, frames, resume.delivered_by(resumed, ids, frames, sizes))
    start = course.positions(0, 0)
    planner = course.planner(0, 0, start.epochs[0], sizes)
    planner.skip(start.offsets[0])
    next(planner)
    return (old, new), time.perf_counter() - started, samples * old


@dataclass(frozen=True)
class HubResolves:
    """The Hub resolves of a run whose processes share live targets (SPEC §8.4)."""

    ranks: int
    workers: int  # per rank
    samples_per_s: int  # per rank
    files: int  # video files (every camera) and data files of the dataset
    first_window: int  # files the run touches in its first quota window: its resolves there
    window_average: float  # the files touched per target lifetime, per quota window

    def line(self) -> str:
        return (f"Hub resolves (DROID-sized, {self.ranks} ranks x {self.workers} workers on one "
                f"machine, {self.samples_per_s} samples/s per rank, targets shared): "
                f"{self.window_average:,.0f} per {QUOTA_WINDOW_S // 60} minutes over a target's "
                f"{hub.TARGET_LIFETIME_S / 3600:.0f} h; {self.first_window:,} in the first "
                f"{QUOTA_WINDOW_S // 60} minutes (every file touched once; {self.files:,} files)")


def hub_resolves(config: BenchConfig) -> HubResolves:
    """Play each worker's plan of a DROID-sized run for one quota window at its share of the
    rate; a file is resolved once per target lifetime for the whole machine, so the first window
    resolves every file touched in it, and each lifetime at most every file of the dataset.
    Files: episodes in index order rolled over by size, the same for every camera."""
    frames = droid_lengths(config.droid_episodes, config.seed)
    ids, lengths = list(range(len(frames))), np.asarray(frames, np.int64)
    video = (np.cumsum(lengths * SAMPLE_BYTES) - lengths * SAMPLE_BYTES) // VIDEO_FILE_BYTES
    data = (np.cumsum(lengths * DATA_ROW_BYTES) - lengths * DATA_ROW_BYTES) // DATA_FILE_BYTES
    pool = shard.split_limits(HUB_WORKERS, pool_size=config.pool_size, byte_budget=None,
                              decoder_cache=None, cameras=DROID_CAMERAS).pool_size
    anchors, touched = HUB_SAMPLES_PER_S * QUOTA_WINDOW_S // HUB_WORKERS, set()
    for rank in range(HUB_RANKS):
        share = shard.rank_share(ids, frames, rank, HUB_RANKS)
        parts = shard.worker_shares(share, [frames[e] for e in share], HUB_WORKERS)
        for worker, part in enumerate(parts):
            planner = Planner(part, [frames[e] for e in part], seed=config.seed, epoch=0,
                              rank=rank, worker=worker, pool_size=pool,
                              pool_ramp=DEFAULT_POOL_RAMP)
            touched.update(next(planner)[0] for _ in range(min(anchors, planner.remaining)))
    first = sorted(touched)
    files = DROID_CAMERAS * (int(video[-1]) + 1) + int(data[-1]) + 1
    return HubResolves(HUB_RANKS, HUB_WORKERS, HUB_SAMPLES_PER_S, files,
                       DROID_CAMERAS * len(set(video[first])) + len(set(data[first])),
                       files * QUOTA_WINDOW_S / hub.TARGET_LIFETIME_S)


@dataclass(frozen=True)
class Mixing:
    strategy: str
    batch_size: int
    batches: int
    mean_distinct: float  # distinct episodes per batch, refstream's plan
    uniform_mean_distinct: float  # the same frames globally shuffled, same batch size


def batch_mixing(episodes: list[int], frames: list[int], config: BenchConfig, strategy: str,
                 max_batches: int | None) -> Mixing:
    """Mean distinct episodes per DataLoader batch (every batch is one worker's ``batch_size``
    consecutive anchors, no byte budget) vs a uniform shuffle of the same frames; full batches
    only."""
    workers = max(1, config.num_workers)
    pool = shard.split_limits(workers, pool_size=config.pool_size, byte_budget=None,
                              decoder_cache=None, cameras=config.cameras).pool_size
    frames_of = dict(zip(episodes, frames, strict=True))
    distinct: list[int] = []
    for worker, share in enumerate(shard.worker_shares(episodes, frames, workers)):
        planner = Planner(share, [frames_of[e] for e in share], seed=config.seed, epoch=0,
                          rank=0, worker=worker, strategy=strategy, pool_size=pool,
                          pool_ramp=DEFAULT_POOL_RAMP)
        full = planner.remaining // config.batch_size
        for _ in range(full if max_batches is None else min(full, max_batches)):
            batch = {next(planner)[0] for _ in range(config.batch_size)}
            distinct.append(len(batch))
    labels = np.repeat(np.asarray(episodes), np.asarray(frames))
    shuffled = np.random.default_rng(config.seed).permutation(labels)
    count = len(distinct)
    usable = shuffled[: count * config.batch_size].reshape(count, config.batch_size)
    uniform = [len(np.unique(b)) for b in usable]
    return Mixing(strategy, config.batch_size, count, float(np.mean(distinct)),
                  float(np.mean(uniform)))
