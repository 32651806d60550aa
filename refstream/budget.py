"""The byte budget: a thread-safe table of whole-episode reservations (SPEC §8.6, §9.3).

The table counts bytes and never holds payloads: the caller drops the payloads of the episodes it
evicts. The calls of one worker, in the order it makes them::

    budget = ByteBudget(budget_bytes)
    budget.reserve_in_room(e, size)      # prefetch: reserve only if it fits without evicting
    budget.touch(episodes)               # make these the most recently used, the last one last
    budget.acquire(e, size)              # admission: reserve, evicting or waiting, + one lease
    if budget.claim_fetch(e):            # True once per reservation: this caller fetches,
        budget.mark_resident(e, nbytes)  #   counts each payload that arrived,
        budget.mark_fetched(e)           #   and says no more is coming (also after a failure)
    budget.release(e)                    # one lease fewer
    budget.forget(e)                     # the episode is drained: drop its reservation
    budget.take_evicted()                # evicted since the last call: drop their payloads
    budget.close()                       # every waiter wakes with BudgetClosed

The one rule of what fits (:func:`fits`, :func:`check_episode_size`) serves the planner too.
Releasing calls do nothing after ``close()``, so cleanup paths never raise.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, replace

from refstream.errors import BudgetClosed, BudgetError, EpisodeTooLarge, UsageError, check_at_least

__all__ = ["ByteBudget", "Reservation", "fits", "check_episode_size"]

log = logging.getLogger(__name__)


def fits(reserved_bytes: int, size_bytes: int, budget_bytes: int) -> bool:
    """Whether ``size_bytes`` more fit beside ``reserved_bytes`` in a budget of ``budget_bytes``."""
    return reserved_bytes + size_bytes <= budget_bytes


def check_episode_size(episode: int, size_bytes: int, budget_bytes: int, advice: str = "") -> None:
    """EpisodeTooLarge, ending with ``advice``, when ``episode`` alone does not fit the budget."""
    if not fits(0, size_bytes, budget_bytes):
        raise EpisodeTooLarge(f"episode {episode} needs {size_bytes:,} bytes, more than the whole "
                              f"byte budget of {budget_bytes:,} bytes{advice}")


@dataclass(slots=True)
class Reservation:
    """One reserved episode (mutable; the table touches its own only under its lock)."""

    size_bytes: int
    resident_bytes: int = 0
    leases: int = 0
    claimed: bool = False  # a caller took the fetch (claim_fetch returned True)
    fetched: bool = False  # mark_fetched was called: no more bytes will arrive


class ByteBudget:
    """A thread-safe table of whole-episode byte reservations bounded by ``budget_bytes``."""

    def __init__(self, budget_bytes: int) -> None:
        check_at_least(1, budget_bytes=budget_bytes)
        self.budget_bytes = int(budget_bytes)
        self._cond = threading.Condition(threading.Lock())
        self._table: OrderedDict[int, Reservation] = OrderedDict()  # LRU first
        self._evicted: list[int] = []
        self._closed = False

    # --- counters -------------------------------------------------------------------------

    @property
    def reserved_bytes(self) -> int:
        with self._cond:
            return self._reserved_locked()

    def reservations(self) -> dict[int, Reservation]:
        """A copy of the table, least recently used first."""
        with self._cond:
            return {episode: replace(entry) for episode, entry in self._table.items()}

    # --- reserving ------------------------------------------------------------------------

    def try_reserve(self, episode: int, size_bytes: int) -> bool:
        with self._cond:
            return self._reserve_locked(episode, size_bytes)

    def reserve_in_room(self, episode: int, size_bytes: int) -> bool:
        """Reserve ``episode`` only if it fits beside the others, evicting nothing; never waits."""
        with self._cond:
            return self._reserve_locked(episode, size_bytes, evict=False)

    def touch(self, episodes: Iterable[int]) -> None:
        """Move each reserved one of ``episodes`` in turn to the most recent end; skip others."""
        with self._cond:
            for episode in episodes:
                if episode in self._table:
                    self._table.move_to_end(episode)

    def acquire(self, episode: int, size_bytes: int, *, timeout_s: float | None = None) -> bool:
        """Reserve, waiting until it fits, and take one lease, atomically; False on timeout."""
        with self._cond:
            fits = self._reserve_locked(episode, size_bytes)
            if not fits and (timeout_s is None or timeout_s > 0):
                log.debug("episode %d waits for %d bytes of the byte budget (%d of %d reserved)",
                          episode, size_bytes, self._reserved_locked(), self.budget_bytes)
                fits = self._cond.wait_for(lambda: self._reserve_locked(episode, size_bytes),
                                           timeout_s)
            if fits:
                self._table[episode].leases += 1
            return fits

    def release(self, episode: int) -> None:
        """Drop one lease taken by :meth:`acquire`; UsageError without one."""
        with self._cond:
            if self._closed:
                return
            entry = self._table.get(episode)
            if entry is None or entry.leases == 0:
                raise UsageError(f"episode {episode}: release without a lease")
            entry.leases -= 1
            if entry.leases == 0:
                self._cond.notify_all()

    def forget(self, episode: int) -> None:
        """Drop a drained episode's reservation; UsageError while leased or its fetch in flight."""
        with self._cond:
            entry = self._table.get(episode)
            if entry is None or self._closed:
                return
            if entry.leases:
                raise UsageError(f"episode {episode}: forget while {entry.leases} lease(s) held")
            if entry.claimed and not entry.fetched:
                raise UsageError(f"episode {episode}: forget while its fetch is in flight")
            del self._table[episode]
            self._cond.notify_all()

    def take_evicted(self) -> list[int]:
        with self._cond:
            evicted, self._evicted = self._evicted, []
            return evicted

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    # --- fetch bookkeeping ----------------------------------------------------------------

    def claim_fetch(self, episode: int) -> bool:
        with self._cond:
            entry = self._table.get(episode)
            if entry is None or entry.claimed:
                return False
            entry.claimed = True
            return True

    def mark_resident(self, episode: int, nbytes: int) -> bool:
        """Count ``nbytes`` of arrived payload; False when the episode is no longer reserved."""
        with self._cond:
            entry = self._table.get(episode)
            if entry is None or self._closed:
                return False
            if nbytes < 0 or entry.resident_bytes + nbytes > entry.size_bytes:
                raise BudgetError(f"episode {episode}: payload of {nbytes} bytes would make "
                                  f"{entry.resident_bytes + nbytes} resident bytes, over its "
                                  f"reservation of {entry.size_bytes} bytes")
            entry.resident_bytes += nbytes
            return True

    def mark_fetched(self, episode: int) -> bool:
        """No more bytes will arrive (success or failure): unleased, it becomes evictable."""
        with self._cond:
            entry = self._table.get(episode)
            if entry is None or self._closed:
                return False
            entry.claimed = True
            entry.fetched = True
            self._cond.notify_all()
            return True

    # --- internals (caller holds the lock) --------------------------------------------------

    def _reserved_locked(self) -> int:
        return sum(entry.size_bytes for entry in self._table.values())

    def _reserve_locked(self, episode: int, size_bytes: int, evict: bool = True) -> bool:
        if self._closed:
            raise BudgetClosed(f"episode {episode}: the byte budget is closed")
        if size_bytes < 0:
            raise UsageError(f"episode {episode}: negative size {size_bytes} bytes")
        entry = self._table.get(episode)
        if entry is not None:
            if entry.size_bytes != size_bytes:
                raise UsageError(f"episode {episode}: reserved at {entry.size_bytes} bytes, "
                                 f"asked again at {size_bytes} bytes")
            self._table.move_to_end(episode)
            return True
        check_episode_size(episode, size_bytes, self.budget_bytes)
        kept = self._reserved_locked()  # bytes reserved once the victims are evicted
        victims: list[int] = []
        for victim, other in self._table.items():  # LRU first, the evictable until it fits
            if not evict or fits(kept, size_bytes, self.budget_bytes):
                break
            if other.leases == 0 and other.fetched:
                victims.append(victim)
                kept -= other.size_bytes
        if not fits(kept, size_bytes, self.budget_bytes):
            return False
        for victim in victims:
            del self._table[victim]
        self._evicted += victims
        self._table[episode] = Reservation(size_bytes)
        return True
