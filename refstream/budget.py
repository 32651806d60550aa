"""The byte budget: a reservation table for episode payloads (no I/O, thread-safe).

Every episode is reserved whole, at its exact synthesized size (the sum over cameras of the
mini-MP4 sizes computed from the index), *before* any of its bytes is fetched. The table only
counts bytes; the payloads themselves live with the caller (``stream.py``), which drops the
payloads of every episode this table evicts or forgets.

Public calls, in the order a worker makes them::

    budget = ByteBudget(budget_bytes)
    budget.try_reserve(e, size)          # speculative prefetch: never waits, False when full
    budget.acquire(e, size)              # a decode: reserve (waiting) and take a lease, atomically
    if budget.claim_fetch(e): ...        # True once per reservation: the caller fetches, then
    budget.mark_resident(e, nbytes)      #   counts each payload that arrived,
    budget.mark_fetched(e)               #   and says no more bytes are coming (also on failure)
    budget.release(e)                    # a decode finished with the episode
    budget.forget(e)                     # the episode is drained: drop its reservation
    budget.take_evicted()                # episodes evicted since the last call (drop payloads)
    budget.close()                       # every waiter wakes with BudgetClosed

Rules (the state machine lives here and nowhere else):

* ``reserved_bytes`` is the sum of the sizes of all reservations; it never exceeds
  ``budget_bytes``. ``resident_bytes`` is the sum of payload bytes marked resident; an
  episode's resident bytes never exceed its reserved size.
* An episode larger than the whole budget raises :class:`EpisodeTooLarge` at once.
* Reserving an episode that is already reserved succeeds at once and makes it the most recently
  used; its size must be the same.
* When a new episode does not fit, reservations that are *evictable* — no lease, and fetched
  (``mark_fetched`` was called) — are evicted in least-recently-used order, but only if evicting
  them makes the new episode fit; otherwise nothing is evicted. A reservation whose fetch is in
  flight, or that is leased, is never evicted. Reserving and acquiring make an episode the most
  recently used.
* ``try_reserve`` never waits: at a full budget it returns False. ``reserve`` and ``acquire``
  wait, woken by every change that can free room (``release`` of the last lease, ``forget``,
  ``mark_fetched``), and return False only when ``timeout_s`` runs out.
* ``forget`` requires no lease and no fetch in flight (a caller waits for its fetches first), so
  a late payload can never be counted against a newer reservation of the same episode.
* ``mark_resident`` / ``mark_fetched`` of an episode that is no longer reserved return False:
  the caller drops that payload.
* After ``close()`` every reserving call raises :class:`BudgetClosed` (also in threads already
  waiting); releasing calls become no-ops so cleanup paths never raise.

A caller that wants an admitted episode kept between decodes holds a lease on it from admission
until it is drained; the table itself has no notion of the pool.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from refstream.errors import BudgetClosed, BudgetError, EpisodeTooLarge, UsageError

__all__ = ["ByteBudget", "BudgetSnapshot"]


@dataclass(frozen=True)
class BudgetSnapshot:
    """The table's counters, read together under its lock (all sizes in bytes)."""

    budget_bytes: int
    reserved_bytes: int
    resident_bytes: int
    peak_reserved_bytes: int
    leases: int  # total lease count over all episodes
    evictions: int  # episodes evicted since construction


class _Reservation:
    """One reserved episode (mutable; only touched under the table's lock)."""

    __slots__ = ("size_bytes", "resident_bytes", "leases", "claimed", "fetched")

    def __init__(self, size_bytes: int) -> None:
        self.size_bytes = size_bytes
        self.resident_bytes = 0
        self.leases = 0
        self.claimed = False  # a caller took the fetch (claim_fetch returned True)
        self.fetched = False  # mark_fetched was called: no more bytes will arrive

    @property
    def evictable(self) -> bool:
        return self.leases == 0 and self.fetched


class ByteBudget:
    """A thread-safe table of whole-episode byte reservations bounded by ``budget_bytes``."""

    def __init__(self, budget_bytes: int) -> None:
        if budget_bytes <= 0:
            raise UsageError(f"byte budget must be > 0 bytes, got {budget_bytes}")
        self.budget_bytes = int(budget_bytes)
        self._cond = threading.Condition(threading.Lock())
        self._table: OrderedDict[int, _Reservation] = OrderedDict()  # LRU first
        self._reserved_bytes = 0
        self._resident_bytes = 0
        self._peak_reserved_bytes = 0
        self._evicted: list[int] = []
        self._evictions = 0
        self._closed = False

    # --- counters -------------------------------------------------------------------------

    @property
    def reserved_bytes(self) -> int:
        with self._cond:
            return self._reserved_bytes

    def snapshot(self) -> BudgetSnapshot:
        """All counters at one instant."""
        with self._cond:
            return BudgetSnapshot(
                budget_bytes=self.budget_bytes,
                reserved_bytes=self._reserved_bytes,
                resident_bytes=self._resident_bytes,
                peak_reserved_bytes=self._peak_reserved_bytes,
                leases=sum(r.leases for r in self._table.values()),
                evictions=self._evictions,
            )

    def is_reserved(self, episode: int) -> bool:
        with self._cond:
            return episode in self._table

    def lru_order(self) -> list[int]:
        """Reserved episodes, least recently used first."""
        with self._cond:
            return list(self._table)

    # --- reserving ------------------------------------------------------------------------

    def try_reserve(self, episode: int, size_bytes: int) -> bool:
        """Reserve for a speculative prefetch; never waits. False when it does not fit."""
        with self._cond:
            return self._reserve_locked(episode, size_bytes)

    def acquire(self, episode: int, size_bytes: int, *, timeout_s: float | None = None) -> bool:
        """Reserve (waiting) and take one lease, atomically. False only on timeout."""
        with self._cond:
            if not self._wait_reserve_locked(episode, size_bytes, timeout_s):
                return False
            self._table[episode].leases += 1
            return True

    def release(self, episode: int) -> None:
        """Drop one lease taken by :meth:`acquire`."""
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
        """Drop a drained episode's reservation (no lease, no fetch in flight); absent is fine."""
        with self._cond:
            if self._closed:
                return
            entry = self._table.get(episode)
            if entry is None:
                return
            if entry.leases:
                raise UsageError(f"episode {episode}: forget while {entry.leases} lease(s) held")
            if entry.claimed and not entry.fetched:
                raise UsageError(f"episode {episode}: forget while its fetch is in flight")
            self._drop_locked(episode)
            self._cond.notify_all()

    def take_evicted(self) -> list[int]:
        """Episodes evicted since the last call, in eviction order; their payloads must go."""
        with self._cond:
            evicted, self._evicted = self._evicted, []
            return evicted

    def close(self) -> None:
        """Refuse every further reservation and wake all waiters with :class:`BudgetClosed`."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    # --- fetch bookkeeping ----------------------------------------------------------------

    def claim_fetch(self, episode: int) -> bool:
        """True exactly once per reservation: the caller that gets it fetches the payloads."""
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
                raise BudgetError(
                    f"episode {episode}: payload of {nbytes} bytes would make "
                    f"{entry.resident_bytes + nbytes} resident bytes, over its reservation of "
                    f"{entry.size_bytes} bytes"
                )
            entry.resident_bytes += nbytes
            self._resident_bytes += nbytes
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

    def _wait_reserve_locked(self, episode: int, size_bytes: int, timeout_s: float | None) -> bool:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self._reserve_locked(episode, size_bytes):
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return False
            self._cond.wait(remaining)
        return True

    def _reserve_locked(self, episode: int, size_bytes: int) -> bool:
        if self._closed:
            raise BudgetClosed(f"episode {episode}: the byte budget is closed")
        if size_bytes < 0:
            raise UsageError(f"episode {episode}: negative size {size_bytes} bytes")
        entry = self._table.get(episode)
        if entry is not None:
            if entry.size_bytes != size_bytes:
                raise UsageError(
                    f"episode {episode}: reserved at {entry.size_bytes} bytes, asked again at "
                    f"{size_bytes} bytes"
                )
            self._table.move_to_end(episode)
            return True
        if size_bytes > self.budget_bytes:
            raise EpisodeTooLarge(
                f"episode {episode}: {size_bytes} bytes exceed the byte budget of "
                f"{self.budget_bytes} bytes"
            )
        shortfall = self._reserved_bytes + size_bytes - self.budget_bytes
        if shortfall > 0:
            victims = self._victims_locked(shortfall)
            if victims is None:
                return False
            for victim in victims:
                self._drop_locked(victim)
                self._evicted.append(victim)
                self._evictions += 1
        self._table[episode] = _Reservation(size_bytes)
        self._reserved_bytes += size_bytes
        self._peak_reserved_bytes = max(self._peak_reserved_bytes, self._reserved_bytes)
        return True

    def _victims_locked(self, shortfall: int) -> list[int] | None:
        """The LRU-first evictable episodes that free ``shortfall`` bytes, or None if impossible."""
        victims: list[int] = []
        freed = 0
        for episode, entry in self._table.items():
            if freed >= shortfall:
                break
            if entry.evictable:
                victims.append(episode)
                freed += entry.size_bytes
        return victims if freed >= shortfall else None

    def _drop_locked(self, episode: int) -> None:
        entry = self._table.pop(episode)
        self._reserved_bytes -= entry.size_bytes
        self._resident_bytes -= entry.resident_bytes
