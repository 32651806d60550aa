"""Whole-episode sharding: a selection over ranks, then a rank's share over its workers (SPEC §2).

Use::

    ranks = rank_shares(ids, frames, world_size)                # every rank's episodes
    share = rank_share(ids, frames, rank, world_size)           # this rank's: ranks[rank]
    parts = worker_shares(share, share_frames, num_workers)     # part w: logical worker w's
    limits = split_limits(num_workers, pool_size=…, byte_budget=…, decoder_cache=…, cameras=…)
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from refstream.errors import ShardingError, UsageError, check_at_least, is_int

__all__ = ["WorkerLimits", "episode_ids", "check_episodes", "lpt_partition", "rank_shares",
           "rank_share", "check_rank", "worker_shares", "split_limits", "ceil_div"]

# Episodes resident per rank when the user sets no pool size (LeRobot's streaming default).
DEFAULT_RANK_POOL_SIZE = 32


@dataclass(frozen=True)
class WorkerLimits:
    """One DataLoader worker's share of the per-rank limits."""

    pool_size: int  # episodes resident at once
    byte_budget: int | None  # bytes of synthesized video reserved at once; None = unbounded
    decoder_cache: int  # open decoders kept


def episode_ids(ids: Iterable[object], error: type[UsageError] = UsageError) -> list[int]:
    """The one check of episode ids (SPEC §2.1, §4.5): ``ids`` as ints, else ``error``."""
    ids = list(ids)
    bad = [e for e in ids if not is_int(e)]
    if bad:
        raise error(f"episode ids must be integers, got {bad!r}")
    ids = [int(e) for e in ids]
    duplicates = sorted(e for e, n in Counter(ids).items() if n > 1)
    if duplicates:
        raise error(f"episode ids must be distinct: duplicate episode ids {duplicates}")
    if ids and min(ids) < 0:
        raise error(f"episode ids must be non-negative, got {sorted(e for e in ids if e < 0)}")
    return ids


def check_episodes(ids: Sequence[object], **counts: Sequence[int] | None) -> list[int]:
    """:func:`episode_ids` of ``ids``, each with one count ``≥ 0`` in each of ``counts`` given."""
    ids = episode_ids(ids)
    # A keyword names its counts in the errors: frame_counts=frames says "frame counts".
    given = {name.replace("_", " "): seq for name, seq in counts.items() if seq is not None}
    for what, seq in given.items():
        if len(ids) != len(seq):
            raise UsageError(f"{len(ids)} episode ids but {len(seq)} {what}")
        for episode, count in zip(ids, seq, strict=True):
            if count < 0:
                raise UsageError(f"{what} must be non-negative: episode {episode} has {count}")
    return ids


def lpt_partition(ids: Sequence[int], frames: Sequence[int], parts: int) -> list[list[int]]:
    """``parts`` lists of episode ids, the LPT partition of SPEC §2.1."""
    if parts < 1:
        raise UsageError(f"cannot split episodes into {parts} parts (world_size and num_workers "
                         "must be at least 1)")
    ids = check_episodes(ids, frame_counts=frames)
    shards: list[list[int]] = [[] for _ in range(parts)]
    # The heap's smallest (load, part) is the least-loaded part, ties to the lowest index.
    loads = [(0, part) for part in range(parts)]
    for count, episode in sorted((-f, e) for e, f in zip(ids, frames, strict=True) if f > 0):
        load, part = heapq.heappop(loads)
        shards[part].append(episode)
        heapq.heappush(loads, (load - count, part))
    return shards


def rank_shares(ids: Sequence[int], frames: Sequence[int], world_size: int) -> list[list[int]]:
    """Every rank's episodes, in rank order (SPEC §2.2); ShardingError if one has none."""
    ranks = lpt_partition(ids, frames, world_size)
    _check_owns_episodes(ranks, world_size - 1)  # LPT fills the parts in order: the last one last
    return ranks


def rank_share(ids: Sequence[int], frames: Sequence[int], rank: int, world_size: int) -> list[int]:
    """The episodes rank ``rank`` of ``world_size`` streams (SPEC §2.2)."""
    check_rank(rank, world_size)
    ranks = lpt_partition(ids, frames, world_size)
    _check_owns_episodes(ranks, rank)
    return ranks[rank]


def check_rank(rank: int, world_size: int) -> None:
    """UsageError unless ``rank`` is one of ``world_size`` ranks (SPEC §2.2)."""
    if not 0 <= rank < world_size:
        raise UsageError(f"rank {rank} is not in a world of size {world_size}")


def _check_owns_episodes(ranks: list[list[int]], rank: int) -> None:
    if not ranks[rank]:
        with_frames = sum(map(len, ranks))
        raise ShardingError(f"rank {rank} of world size {len(ranks)} owns no episodes: the "
                            f"selection has {with_frames} episodes with frames; use a world "
                            f"size of at most {with_frames}")


def worker_shares(ids: Sequence[int], frames: Sequence[int], num_workers: int) -> list[list[int]]:
    """A rank's episodes split over ``num_workers`` DataLoader workers (SPEC §2.2)."""
    shares = lpt_partition(ids, frames, num_workers)
    with_frames = sum(len(share) for share in shares)
    if with_frames < num_workers:
        raise ShardingError(
            f"this rank owns {with_frames} episodes with frames, fewer than its {num_workers} "
            f"DataLoader workers; use num_workers of at most {max(1, with_frames)}"
            + (" (or a smaller world size)" if with_frames == 0 else ""))
    return shares


def ceil_div(count: int, size: int) -> int:
    """The parts of at most ``size`` that ``count`` fills, the last one possibly short."""
    return -(-count // size)


def split_limits(num_workers: int, *, pool_size: int | None, byte_budget: int | None,
                 decoder_cache: int | None, cameras: int) -> WorkerLimits:
    """One worker's limits from the per-rank settings (SPEC §2.3)."""
    check_at_least(1, num_workers=num_workers, pool_size=pool_size, decoder_cache=decoder_cache)
    check_at_least(0, cameras=cameras)
    check_at_least(num_workers, byte_budget=byte_budget)  # bytes per rank: one for each worker
    if pool_size is None:
        # round(32 / N) in integers, halves up (SPEC §2.3 says why that equals LeRobot's).
        pool_size = max(1, (2 * DEFAULT_RANK_POOL_SIZE + num_workers) // (2 * num_workers))
    budget = None if byte_budget is None else byte_budget // num_workers
    decoders = pool_size * cameras if decoder_cache is None else decoder_cache // num_workers
    return WorkerLimits(pool_size=pool_size, byte_budget=budget, decoder_cache=max(1, decoders))
