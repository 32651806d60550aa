"""Planning cost, for the issue note: ``python3 tests/measure_planner.py`` (not a test).

1. A rank of ~1 M frames (3,448 episodes of 100–480 frames) in 4 workers, default limits: anchors
   per second per worker for both strategies, with and without a byte budget, and the time to
   fast-forward (``skip``) to the last anchor of each worker's epoch — the worst resume.
2. A DROID-sized selection (95,658 episodes, 27.6 M frames) on 8 ranks × 4 workers: the time
   from the frame counts to one worker's first anchor (sharding + limits + planner).
"""

from __future__ import annotations

import time

import numpy as np

from refstream.planner import Planner
from refstream.shard import rank_share, split_limits, worker_shares


def lengths(count: int, total: int, low: int, high: int) -> list[int]:
    drawn = np.random.default_rng(0).integers(low, high, size=count)
    return np.maximum(1, drawn * total // drawn.sum()).tolist()


def rank_of_a_million() -> None:
    frames = lengths(3_448, 1_000_000, 100, 480)
    ids = list(range(len(frames)))
    shares = worker_shares(ids, frames, 4)
    print(f"rank: {sum(frames)} frames, {len(ids)} episodes, 4 workers")
    for budget in (None, 512 << 20):  # 512 MiB per rank binds: ~4 episodes per worker
        limits = split_limits(4, pool_size=None, byte_budget=budget, decoder_cache=None,
                              cameras=2)
        for strategy in ("pool", "round_robin"):
            made, anchors, plan_s, skip_s = [], 0, 0.0, 0.0
            for worker, share in enumerate(shares):
                counts = [frames[e] for e in share]
                sizes = None if budget is None else [f * 120_000 for f in counts]
                kwargs = dict(seed=1, epoch=0, rank=0, worker=worker, strategy=strategy,
                              pool_size=limits.pool_size, byte_sizes=sizes,
                              byte_budget=limits.byte_budget)
                started = time.perf_counter()
                anchors += sum(1 for _ in Planner(share, counts, **kwargs))
                plan_s += time.perf_counter() - started
                planner = Planner(share, counts, **kwargs)
                started = time.perf_counter()
                planner.skip(planner.remaining - 1)
                skip_s = max(skip_s, time.perf_counter() - started)
                made.append(planner)
            label = f"{strategy:11s} budget={'none' if budget is None else '512 MiB'}"
            print(f"  {label}: {anchors / plan_s:,.0f} anchors/s per worker; "
                  f"worst resume skip {skip_s:.2f} s per worker")


def droid_first_anchor() -> None:
    frames = lengths(95_658, 27_600_000, 60, 520)
    ids = list(range(len(frames)))
    started = time.perf_counter()
    share = rank_share(ids, frames, 7, 8)
    part = worker_shares(share, [frames[e] for e in share], 4)[3]
    limits = split_limits(4, pool_size=None, byte_budget=8 << 30, decoder_cache=None, cameras=3)
    planner = Planner(part, [frames[e] for e in part], seed=None, epoch=0, rank=7, worker=3,
                      pool_size=limits.pool_size, byte_sizes=[frames[e] * 30_000 for e in part],
                      byte_budget=limits.byte_budget)
    next(planner)
    print(f"DROID-sized ({sum(frames):,} frames, 8 ranks x 4 workers): first anchor after "
          f"{time.perf_counter() - started:.2f} s")


if __name__ == "__main__":
    rank_of_a_million()
    droid_first_anchor()
