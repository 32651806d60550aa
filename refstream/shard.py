"""Whole-episode sharding of a selection over ranks, and of a rank's share over its workers.

``lpt_partition(ids, frames, parts)``
    Longest-processing-time first: episodes in order of (−frames, id), each to the part with the
    least frames so far, ties to the lowest part index. Episodes with zero frames have nothing to
    emit and take part in no partition. The frame totals of any two parts differ by at most the
    longest episode.
``rank_share(ids, frames, rank, world_size)``
    The episodes of one rank: part ``rank`` of the LPT partition over ``world_size`` parts.
``worker_shares(ids, frames, num_workers)``
    A rank's episodes split over its DataLoader workers by the same rule.
``split_limits(num_workers, pool_size=…, byte_budget=…, decoder_cache=…, cameras=…)``
    The per-worker pool size, byte budget and decoder cache from the per-rank settings.

Every part is listed in sharding order (longest episode first); planners re-order episodes with
their own keys, so this order carries no meaning. A rank or worker left without episodes is a
:class:`~refstream.errors.ShardingError` that names the numbers and what to use instead.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from numbers import Integral

from refstream.errors import ShardingError, UsageError

__all__ = [
    "DEFAULT_RANK_POOL_SIZE",
    "WorkerLimits",
    "episode_ids",
    "check_episodes",
    "lpt_partition",
    "rank_share",
    "worker_shares",
    "split_limits",
]

# Episodes resident per rank when the user sets no pool size (LeRobot's streaming default).
DEFAULT_RANK_POOL_SIZE = 32


@dataclass(frozen=True)
class WorkerLimits:
    """One DataLoader worker's share of the per-rank limits."""

    pool_size: int  # episodes resident at once
    byte_budget: int | None  # bytes of synthesized video reserved at once; None = unbounded
    decoder_cache: int  # open decoders kept


def episode_ids(ids: Iterable[object], error: type[UsageError] = UsageError) -> list[int]:
    """``ids`` as a list of ints; raises ``error`` naming the non-integers, else the duplicates,
    else the negative ids."""
    ids = list(ids)
    bad = [e for e in ids if isinstance(e, bool) or not isinstance(e, Integral)]
    if bad:
        raise error(f"episode ids must be integers, got {bad!r}")
    ids = [int(e) for e in ids]
    duplicates = sorted(e for e, n in Counter(ids).items() if n > 1)
    if duplicates:
        raise error(f"episode ids must be distinct: duplicate episode ids {duplicates}")
    if ids and min(ids) < 0:
        raise error(f"episode ids must be non-negative, got {sorted(e for e in ids if e < 0)}")
    return ids


def check_episodes(ids: Sequence[object], frames: Sequence[int]) -> list[int]:
    """:func:`episode_ids` of ``ids``, each with one frame count ``≥ 0`` in ``frames``;
    UsageError otherwise."""
    if len(ids) != len(frames):
        raise UsageError(f"{len(ids)} episode ids but {len(frames)} frame counts")
    ids = episode_ids(ids)
    for episode, count in zip(ids, frames, strict=True):
        if count < 0:
            raise UsageError(f"frame counts must be non-negative: episode {episode} has {count}")
    return ids


def lpt_partition(ids: Sequence[int], frames: Sequence[int], parts: int) -> list[list[int]]:
    """Split episodes into ``parts`` lists by LPT; zero-frame episodes are left out."""
    if parts < 1:
        raise UsageError(f"cannot partition into {parts} parts")
    ids = check_episodes(ids, frames)
    shards: list[list[int]] = [[] for _ in range(parts)]
    # The heap's smallest (load, part) is the least-loaded part, ties to the lowest index.
    loads = [(0, part) for part in range(parts)]
    for count, episode in sorted((-f, e) for e, f in zip(ids, frames, strict=True) if f > 0):
        load, part = heapq.heappop(loads)
        shards[part].append(episode)
        heapq.heappush(loads, (load - count, part))
    return shards


def rank_share(ids: Sequence[int], frames: Sequence[int], rank: int, world_size: int) -> list[int]:
    """The episodes rank ``rank`` of ``world_size`` streams; it must own at least one."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise UsageError(f"rank {rank} is not in a world of size {world_size}")
    share = lpt_partition(ids, frames, world_size)[rank]
    if not share:
        with_frames = sum(1 for f in frames if f > 0)
        raise ShardingError(
            f"rank {rank} of world size {world_size} owns no episodes: the selection has "
            f"{with_frames} episodes with frames; use a world size of at most {with_frames}"
        )
    return share


def worker_shares(ids: Sequence[int], frames: Sequence[int], num_workers: int) -> list[list[int]]:
    """A rank's episodes split over ``num_workers`` DataLoader workers, each owning at least one."""
    if num_workers < 1:
        raise UsageError(f"num_workers must be at least 1 for sharding, got {num_workers}")
    shares = lpt_partition(ids, frames, num_workers)
    with_frames = sum(len(share) for share in shares)
    if with_frames < num_workers:
        raise ShardingError(
            f"this rank owns {with_frames} episodes with frames, fewer than its {num_workers} "
            f"DataLoader workers; use num_workers of at most {max(1, with_frames)}"
            + (" (or a smaller world size)" if with_frames == 0 else "")
        )
    return shares


def split_limits(
    num_workers: int,
    *,
    pool_size: int | None,
    byte_budget: int | None,
    decoder_cache: int | None,
    cameras: int,
) -> WorkerLimits:
    """Per-worker limits. ``pool_size`` is per worker when given, else the per-rank default 32
    split as ``max(1, round(32 / N))``; ``byte_budget`` and ``decoder_cache`` are per rank and
    each worker gets ``⌊· / N⌋``; the decoder cache defaults to ``pool × cameras`` (at least 1)."""
    if num_workers < 1:
        raise UsageError(f"num_workers must be at least 1, got {num_workers}")
    if cameras < 0:
        raise UsageError(f"cameras must be non-negative, got {cameras}")
    if pool_size is None:
        # round(32 / N) in integers: ⌊(2·32 + N) / 2N⌋ (halves round up; 32/N = k + ½ only at
        # N = 64, where max(1, ·) gives 1 either way).
        pool = max(1, (2 * DEFAULT_RANK_POOL_SIZE + num_workers) // (2 * num_workers))
    elif pool_size < 1:
        raise UsageError(f"pool_size must be at least 1, got {pool_size}")
    else:
        pool = pool_size
    budget = None
    if byte_budget is not None:
        if byte_budget < num_workers:
            raise UsageError(
                f"a byte budget of {byte_budget} bytes per rank cannot be split over "
                f"{num_workers} workers (each needs at least 1 byte)"
            )
        budget = byte_budget // num_workers
    if decoder_cache is None:
        decoders = max(1, pool * cameras)
    elif decoder_cache < 1:
        raise UsageError(f"decoder_cache must be at least 1, got {decoder_cache}")
    else:
        decoders = max(1, decoder_cache // num_workers)
    return WorkerLimits(pool_size=pool, byte_budget=budget, decoder_cache=decoders)
