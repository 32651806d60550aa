"""One DataLoader worker's exact-coverage plan for one epoch (SPEC §3.1–3.5): an iterator of
anchors ``(episode, frame)``; the stream fetches what it admits and follows its order. Use::

    planner = Planner(share, frames, seed=s, epoch=e, rank=r, worker=w, strategy="pool",
                      pool_size=p, pool_ramp=k,              # k optional: 0, no ramp
                      byte_sizes=sizes, byte_budget=b)       # optional, both or neither
    planner.skip(offset)                        # resume: the state after `offset` anchors
    for episode, frame in planner:
        admitted, drained = planner.drain_events()   # fetch the admitted, free the drained
        planner.frontier(k)                          # the next k to admit: prefetch candidates
        planner.frames_to_come(e)                    # e's frames still to come, in order
    planner.emitted()                           # {episode: frames emitted so far}
"""

from __future__ import annotations

from bisect import bisect_right
from collections import deque
from collections.abc import Sequence
from itertools import accumulate, islice

import numpy as np

from refstream import rng
from refstream.budget import check_episode_size, fits
from refstream.errors import UsageError, check_at_least
from refstream.shard import check_episodes

__all__ = ["STRATEGIES", "DEFAULT_POOL_RAMP", "Planner"]

STRATEGIES = ("pool", "round_robin")
# A streaming dataset's pool gains an episode every this many draws until it is full: a worker's
# first batch of 32 then waits for at most 4 episodes, whatever the pool's size, and a pool of 16
# is full after 120 draws. 0 fills it at once.
DEFAULT_POOL_RAMP = 8
SKIP_BLOCK = 1 << 16  # pool draws skip makes at once


class Planner:
    """One worker's anchors in one epoch; arguments as SPEC §3.1 says, else UsageError."""

    def __init__(self, episodes: Sequence[int], frames: Sequence[int], *, seed: int | None,
                 epoch: int, rank: int, worker: int, strategy: str = "pool", pool_size: int,
                 pool_ramp: int = 0, byte_sizes: Sequence[int] | None = None,
                 byte_budget: int | None = None, delivered: Sequence[int] | None = None) -> None:
        seed = rng.resolve_seed(seed)
        episodes = check_episodes(episodes, frame_counts=frames, delivered_counts=delivered,
                                  byte_sizes=byte_sizes)
        check_at_least(0, epoch=epoch, rank=rank, worker=worker, pool_ramp=pool_ramp)
        check_at_least(1, pool_size=pool_size)
        if strategy not in STRATEGIES:
            raise UsageError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
        rest = _rest(episodes, frames, delivered)
        self._frames = {e: int(f) for e, f, r in zip(episodes, frames, rest, strict=True)
                        if r > 0}  # the whole episode: its keyed frame order
        self._rest = {e: r for e, r in zip(episodes, rest, strict=True) if r > 0}
        self._sizes = _check_budget(episodes, rest, byte_sizes, byte_budget)
        self._budget = 0 if byte_budget is None else byte_budget  # without one, every size is 0
        self._used = 0  # bytes of the residents
        self._pool_size = pool_size
        self._ramp = pool_ramp
        self._strategy = strategy
        admission = rng.permutation(rng.derive_key(seed, epoch, "admit"), list(self._frames))
        self._pending: deque[int] = deque(admission.tolist())
        self._left: dict[int, int] = {}  # resident -> frames not yet emitted, admission order
        self._orders: dict[int, list[int]] = {}  # resident -> its frame permutation (lazy)
        self._emitted = 0  # anchors emitted so far = the next draw number
        self._frames_key = rng.derive_key(seed, epoch, "frames")
        self._draw_key = rng.derive_key(seed, epoch, "draw", rank, worker)
        self._round_key = rng.derive_key(seed, epoch, "round", rank, worker)
        self._round: deque[int] = deque()  # the rest of the current round, round_robin
        self._rounds_started = 0
        self._admitted_events: list[int] = []
        self._drained_events: list[int] = []
        self._admit()

    # --- what the I/O layer reads -------------------------------------------------------------

    @property
    def resident(self) -> list[int]:
        """Admitted episodes not yet drained, in admission order (SPEC §3.4)."""
        return list(self._left)

    @property
    def remaining(self) -> int:
        """Anchors left this epoch."""
        return sum(self._rest.values()) - self._emitted

    def frontier(self, k: int) -> list[int]:
        """The next ``k`` waiting episodes in admission order; admits nothing (SPEC §3.4)."""
        return list(islice(self._pending, max(0, k)))

    def emitted(self) -> dict[int, int]:
        """Frames emitted so far of each episode that has any (the first of its keyed order)."""
        pending = set(self._pending)
        counts = {e: r - self._left.get(e, 0) for e, r in self._rest.items() if e not in pending}
        return {e: n for e, n in counts.items() if n}

    def drain_events(self) -> tuple[list[int], list[int]]:
        """``(admitted, drained)`` episodes since the last call, each in event order (SPEC §3.4)."""
        events = (self._admitted_events, self._drained_events)
        self._admitted_events, self._drained_events = [], []
        return events

    # --- iteration ----------------------------------------------------------------------------

    def __iter__(self) -> Planner:
        return self

    def __next__(self) -> tuple[int, int]:
        if not self._left:
            raise StopIteration
        episode = self._choose()
        order = self._orders.get(episode) or self._order(episode)
        frame = order[self._frames[episode] - self._left[episode]]
        self._take(episode)
        return episode, frame

    def frames_to_come(self, episode: int) -> list[int]:
        """The frames of ``episode`` this epoch has still to emit, in their order."""
        left = self._rest[episode] if episode in self._pending else self._left.get(episode, 0)
        order = (self._orders.get(episode) or self._order(episode)) if left else []
        return order[self._frames[episode] - left:]

    def _order(self, episode: int) -> list[int]:
        """The keyed order of all of ``episode``'s frames (SPEC §3.3), kept until it drains."""
        key = rng.extend_key(self._frames_key, episode)
        self._orders[episode] = rng.permutation(key, np.arange(self._frames[episode])).tolist()
        return self._orders[episode]

    def skip(self, n: int) -> None:
        """Pass the next ``n`` anchors without computing their frames (SPEC §3.4)."""
        if not 0 <= n <= self.remaining:
            raise UsageError(f"cannot skip {n} anchors: {self.remaining} remain in this epoch")
        # One at a time: round_robin, and pool draws while the pool may still grow.
        while n and (self._strategy != "pool" or self._capacity() < self._pool_size):
            self._take(self._choose())
            n -= 1
        if not n:
            return
        # Pool draws in blocks, their words made at once and the residents' frames left kept in
        # a list, written back to the dictionary before an episode drains: many times faster.
        end = self._emitted + n
        for first in range(self._emitted, end, SKIP_BLOCK):
            words = rng.u64_array(self._draw_key, np.arange(first, min(end, first + SKIP_BLOCK)))
            residents, left = list(self._left), list(self._left.values())
            for draw, word in enumerate(words.tolist(), first):
                chosen = _drawn(left, word)
                if left[chosen] > 1:
                    left[chosen] -= 1
                    continue
                self._left.update(zip(residents, left, strict=True))
                self._emitted = draw
                self._take(residents[chosen])  # its last anchor: others come in
                residents, left = list(self._left), list(self._left.values())
            self._left.update(zip(residents, left, strict=True))
            self._emitted = first + len(words)

    def _choose(self) -> int:
        """The episode the next anchor comes from (SPEC §3.3)."""
        if self._strategy == "pool":
            word = rng.u64(self._draw_key, self._emitted)
            return list(self._left)[_drawn(list(self._left.values()), word)]
        if not self._round:
            key = rng.extend_key(self._round_key, self._rounds_started)
            self._round = deque(rng.permutation(key, list(self._left)).tolist())
            self._rounds_started += 1
        return self._round.popleft()

    def _take(self, episode: int) -> None:
        """One anchor of ``episode``; after its last it drains, and others come in."""
        self._emitted += 1
        self._left[episode] -= 1
        if not self._left[episode]:
            del self._left[episode]
            self._used -= self._sizes[episode]
            self._orders.pop(episode, None)
            self._drained_events.append(episode)
            self._admit()
        elif self._ramp and self._emitted % self._ramp == 0:
            self._admit()  # the pool may have grown

    def _capacity(self) -> int:
        """The pool's size after the draws so far: full at once, or one more every ``pool_ramp``
        draws (SPEC §3.2)."""
        ramp = self._pool_size if not self._ramp else 1 + self._emitted // self._ramp
        return min(self._pool_size, ramp)

    def _admit(self) -> None:
        """Admit waiting episodes while the pool and the budget have room (SPEC §3.2)."""
        while len(self._left) < self._capacity() and self._pending:
            episode = next((e for e in self._pending
                            if fits(self._used, self._sizes[e], self._budget)), None)
            if episode is None:
                return  # wait until a drained episode frees bytes
            self._pending.remove(episode)
            self._used += self._sizes[episode]
            self._left[episode] = self._rest[episode]
            self._admitted_events.append(episode)


def _drawn(left: list[int], word: int) -> int:
    """The resident a pool draw chooses, by position in admission order (SPEC §3.3): the draw is
    t below R, the residents' frames ``left`` summed; each owns a run of its count below R."""
    ends = list(accumulate(left))  # the runs' ends; ends[-1] is R
    return bisect_right(ends, rng.below_word(word, ends[-1]))


def _rest(episodes, frames, delivered) -> list[int]:
    """Each episode's frames not yet delivered this epoch; UsageError for a bad ``delivered``."""
    delivered = [0] * len(frames) if delivered is None else delivered
    for episode, count, done in zip(episodes, frames, delivered, strict=True):
        if done > count:
            raise UsageError(f"episode {episode} has {count} frames, {done} cannot be delivered")
    return [int(f) - int(d) for f, d in zip(frames, delivered, strict=True)]


def _check_budget(episodes, frames, byte_sizes, byte_budget) -> dict[int, int]:
    """Each episode's byte size, 0 without a budget; EpisodeTooLarge per SPEC §3.1."""
    if byte_sizes is None and byte_budget is None:
        return dict.fromkeys(episodes, 0)
    if byte_sizes is None or byte_budget is None:
        raise UsageError("byte_sizes and byte_budget go together: give both or neither")
    check_at_least(1, byte_budget=byte_budget)
    for episode, count, size in zip(episodes, frames, byte_sizes, strict=True):
        if count > 0:
            check_episode_size(episode, size, byte_budget)
    return {episode: int(size) for episode, size in zip(episodes, byte_sizes, strict=True)}
