"""The byte-budget reservation table: rules one by one, a model check, and a thread stress test."""

from __future__ import annotations

import logging
import random
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from refstream.budget import ByteBudget
from refstream.errors import BudgetClosed, BudgetError, EpisodeTooLarge, UsageError
from refstream.tools.conformance import first_difference, in_process, load_cases

HANG_GUARD_S = 30.0  # waits that end in microseconds; the bound only turns a hang into a failure


class Waiters:
    """The threads waiting inside ``budget`` right now (white box: the budget's condition
    variable is swapped for one that reports). A thread is reported while it holds the budget's
    lock, just before ``wait`` releases it, so a budget call the test makes next runs after the
    thread is really waiting and its notification reaches it."""

    def __init__(self, budget: ByteBudget) -> None:
        self._changed = threading.Condition()
        self._waiting: set[int] = set()
        waiters = self

        class Reporting(threading.Condition):
            def wait(self, timeout=None):
                waiters._report(threading.get_ident(), True)
                try:
                    return super().wait(timeout)
                finally:
                    waiters._report(threading.get_ident(), False)

        budget._cond = Reporting(threading.Lock())

    def _report(self, thread: int, waiting: bool) -> None:
        with self._changed:
            (self._waiting.add if waiting else self._waiting.discard)(thread)
            self._changed.notify_all()

    def until(self, count: int) -> None:
        """Return once ``count`` threads are waiting."""
        with self._changed:
            assert self._changed.wait_for(lambda: len(self._waiting) == count, HANG_GUARD_S)


def fetched(budget: ByteBudget, episode: int, size: int, *, resident: int | None = None) -> None:
    """Reserve and complete a prefetch of ``episode`` (asserting each step succeeds)."""
    assert budget.try_reserve(episode, size)
    assert budget.claim_fetch(episode)
    assert budget.mark_resident(episode, size if resident is None else resident)
    assert budget.mark_fetched(episode)


def test_reserve_counts_exact_sizes_and_refuses_too_large():
    budget = ByteBudget(100)
    assert budget.try_reserve(1, 30)
    assert budget.try_reserve(2, 70)
    assert budget.reserved_bytes == 100 and budget.snapshot().resident_bytes == 0
    with pytest.raises(EpisodeTooLarge, match="episode 3 needs 101 bytes"):
        budget.try_reserve(3, 101)
    # exactly the budget is allowed (once the room is free)
    budget.forget(1)
    budget.forget(2)
    assert budget.try_reserve(3, 100)


def test_reserving_twice_is_one_reservation_and_size_must_match():
    budget = ByteBudget(10)
    assert budget.try_reserve(7, 10)
    assert budget.try_reserve(7, 10)
    assert budget.acquire(7, 10, timeout_s=0)
    assert budget.reserved_bytes == 10
    with pytest.raises(UsageError, match="episode 7"):
        budget.try_reserve(7, 9)


def test_two_cameras_share_one_reservation():
    budget = ByteBudget(10)
    assert budget.try_reserve(0, 10) and budget.claim_fetch(0)
    assert not budget.claim_fetch(0)  # the second camera's caller does not fetch again
    assert budget.mark_resident(0, 4) and budget.mark_resident(0, 6)
    assert budget.snapshot().resident_bytes == budget.reserved_bytes == 10
    with pytest.raises(BudgetError, match="over its reservation of 10 bytes"):
        budget.mark_resident(0, 1)


def test_full_budget_refuses_prefetch_while_fetch_in_flight_or_leased():
    budget = ByteBudget(100)
    assert budget.try_reserve(1, 60) and budget.claim_fetch(1)  # in flight
    assert not budget.try_reserve(2, 50)
    budget.mark_fetched(1)
    assert budget.acquire(1, 60)  # leased
    assert not budget.try_reserve(2, 50)
    assert budget.take_evicted() == []
    budget.release(1)
    assert budget.try_reserve(2, 50)  # now 1 is fetched and unleased: evicted
    assert budget.take_evicted() == [1]
    assert 1 not in budget.lru_order() and budget.reserved_bytes == 50


def test_eviction_is_lru_and_all_or_nothing():
    budget = ByteBudget(100)
    for episode in (1, 2, 3):
        fetched(budget, episode, 30)
    assert budget.try_reserve(1, 30)  # touch: 1 becomes most recently used
    assert budget.lru_order() == [2, 3, 1]
    assert budget.try_reserve(4, 40)  # needs 30 more: evicts 2 only
    assert budget.take_evicted() == [2]
    assert budget.lru_order() == [3, 1, 4]
    # 4 is still in flight; evicting 3 and 1 frees 60 < 70 needed: nothing may be evicted
    assert not budget.try_reserve(5, 70)
    assert budget.take_evicted() == [] and budget.lru_order() == [3, 1, 4]
    assert budget.snapshot().resident_bytes == 60


def test_reserve_in_room_never_evicts_and_touch_reorders():
    budget = ByteBudget(100)
    for episode in (1, 2, 3):
        fetched(budget, episode, 30)
    assert not budget.reserve_in_room(4, 20)  # evicting 1 would make room: it is not evicted
    assert budget.take_evicted() == [] and budget.lru_order() == [1, 2, 3]
    assert budget.reserve_in_room(5, 10)  # exactly the room left
    budget.touch([9, 3, 1])  # 9 is not reserved: skipped
    assert budget.lru_order() == [2, 5, 3, 1]


def test_late_payload_of_a_forgotten_episode_is_refused():
    budget = ByteBudget(10)
    fetched(budget, 1, 5)
    budget.forget(1)
    assert not budget.mark_resident(1, 5)
    assert not budget.mark_fetched(1)
    assert budget.snapshot().resident_bytes == 0 and budget.reserved_bytes == 0


def test_forget_refuses_leased_or_in_flight_episodes():
    budget = ByteBudget(10)
    assert budget.acquire(1, 5)
    with pytest.raises(UsageError, match="lease"):
        budget.forget(1)
    budget.release(1)
    assert budget.claim_fetch(1)
    with pytest.raises(UsageError, match="in flight"):
        budget.forget(1)
    budget.mark_fetched(1)
    budget.forget(1)
    with pytest.raises(UsageError, match="release without a lease"):
        budget.release(1)


def test_admission_waits_and_is_woken_by_the_last_release():
    budget = ByteBudget(100)
    waiters = Waiters(budget)
    fetched(budget, 1, 80)
    assert budget.acquire(1, 80)
    assert budget.acquire(1, 80)  # two decodes in flight
    admitted = []

    def admit():
        admitted.append(budget.acquire(2, 50, timeout_s=HANG_GUARD_S))

    thread = threading.Thread(target=admit, daemon=True)
    thread.start()
    waiters.until(1)  # the admission is waiting for room
    budget.release(1)
    thread.join(0.1)  # may wake and look again: it must go on waiting
    assert thread.is_alive() and not admitted  # one decode still holds episode 1
    budget.release(1)
    thread.join(HANG_GUARD_S)
    assert not thread.is_alive() and admitted == [True]
    assert budget.take_evicted() == [1]


def test_a_wait_is_logged_once_at_debug(caplog):
    budget = ByteBudget(100)
    waiters = Waiters(budget)
    fetched(budget, 1, 80)
    assert budget.acquire(1, 80)  # a decode holds episode 1
    thread = threading.Thread(target=budget.acquire, args=(2, 50), daemon=True)
    with caplog.at_level(logging.DEBUG, logger="refstream.budget"):
        thread.start()
        waiters.until(1)
        budget.release(1)
        thread.join(HANG_GUARD_S)
        assert budget.acquire(3, 10, timeout_s=0)  # fits at once: nothing logged
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.DEBUG, "episode 2 waits for 50 bytes of the byte budget (80 of 100 reserved)")]


def test_timeout_returns_false_and_changes_nothing():
    budget = ByteBudget(10)
    assert budget.acquire(1, 10)
    started = time.monotonic()
    assert not budget.acquire(2, 1, timeout_s=0.05)
    assert not budget.acquire(2, 1, timeout_s=0)
    assert 0.05 <= time.monotonic() - started < HANG_GUARD_S  # waited the timeout, then gave up
    assert budget.lru_order() == [1]


def test_close_wakes_every_waiter_with_budget_closed():
    budget = ByteBudget(10)
    waiters = Waiters(budget)
    assert budget.acquire(0, 10)
    errors: list[BaseException] = []

    def wait_forever(episode):
        try:
            budget.acquire(episode, 5)
        except BaseException as exc:  # noqa: BLE001 - collected for the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=wait_forever, args=(e,), daemon=True) for e in (1, 2, 3)]
    for thread in threads:
        thread.start()
    waiters.until(len(threads))  # every one is waiting for room
    budget.close()
    for thread in threads:
        thread.join(HANG_GUARD_S)
    assert not any(thread.is_alive() for thread in threads)
    assert len(errors) == 3 and all(isinstance(e, BudgetClosed) for e in errors)
    with pytest.raises(BudgetClosed):
        budget.try_reserve(4, 1)
    budget.release(0)  # cleanup after close never raises
    budget.forget(0)


def test_invalid_budget_and_sizes():
    with pytest.raises(UsageError):
        ByteBudget(0)
    with pytest.raises(UsageError):
        ByteBudget(5).try_reserve(1, -1)


# --- model check against a brute-force table -------------------------------------------------


class ModelBudget:
    """An independent, deliberately naive model of the rules in the module docstring."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.rows: list[dict] = []  # LRU first: {"e", "size", "leases", "fetched", "resident"}

    def row(self, e):
        return next((r for r in self.rows if r["e"] == e), None)

    def reserve(self, e, size):
        if (r := self.row(e)) is not None:
            self.rows.remove(r)
            self.rows.append(r)
            return True, []
        if size > self.budget:
            return "too-large", []
        used = sum(r["size"] for r in self.rows)
        # try every prefix length of the evictable rows, smallest first
        evictable = [r for r in self.rows if r["leases"] == 0 and r["fetched"]]
        for k in range(len(evictable) + 1):
            if used - sum(r["size"] for r in evictable[:k]) + size <= self.budget:
                for r in evictable[:k]:
                    self.rows.remove(r)
                self.rows.append({"e": e, "size": size, "leases": 0, "fetched": False,
                                  "resident": 0})
                return True, [r["e"] for r in evictable[:k]]
        return False, []


ops = st.lists(
    st.tuples(st.sampled_from(["reserve", "lease", "release", "fetch", "forget"]),
              st.integers(0, 5)),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(ops)
def test_table_matches_a_brute_force_model(sequence):
    sizes = {e: 7 + 5 * e for e in range(6)}  # 7..32 bytes against a 40-byte budget
    budget, model = ByteBudget(40), ModelBudget(40)
    for op, e in sequence:
        row = model.row(e)
        if op in ("reserve", "lease"):
            result, evicted = model.reserve(e, sizes[e])
            if op == "lease" and result is True:
                model.row(e)["leases"] += 1
            call = budget.try_reserve if op == "reserve" else (
                lambda ep, size: budget.acquire(ep, size, timeout_s=0))
            if result == "too-large":
                with pytest.raises(EpisodeTooLarge):
                    call(e, sizes[e])
            else:
                assert call(e, sizes[e]) is result
            assert budget.take_evicted() == evicted
        elif op == "release" and row is not None and row["leases"]:
            row["leases"] -= 1
            budget.release(e)
        elif op == "fetch" and row is not None and not row["fetched"]:
            row["fetched"], row["resident"] = True, sizes[e]
            assert budget.claim_fetch(e)
            assert budget.mark_resident(e, sizes[e]) and budget.mark_fetched(e)
        elif op == "forget" and row is not None and row["leases"] == 0 and row["fetched"]:
            model.rows.remove(row)
            budget.forget(e)
        assert budget.lru_order() == [r["e"] for r in model.rows]
        snap = budget.snapshot()
        assert snap.reserved_bytes == sum(r["size"] for r in model.rows) <= 40
        assert snap.resident_bytes == sum(r["resident"] for r in model.rows)
        assert snap.leases == sum(r["leases"] for r in model.rows)


# --- stress --------------------------------------------------------------------------------

STRESS_ACQUIRES, STRESS_PREFETCHES = 1000, 200  # about 1 s of work on an idle machine


def test_stress_many_threads_keep_the_invariants_and_close_unblocks_everyone():
    budget_bytes = 1000
    budget = ByteBudget(budget_bytes)
    rng = random.Random(12345)
    sizes = {e: rng.randint(1, 400) for e in range(60)}
    stop = threading.Event()
    failures: list[str] = []
    progress = {"acquired": 0, "prefetched": 0}
    progress_lock = threading.Condition()

    def check():
        snap = budget.snapshot()
        if not 0 <= snap.resident_bytes <= snap.reserved_bytes <= budget_bytes:
            failures.append(f"invariant broken: {snap}")

    def fetch(episode):
        if budget.claim_fetch(episode):
            budget.mark_resident(episode, sizes[episode])
            budget.mark_fetched(episode)

    def decoder(seed, owned):
        r = random.Random(seed)
        try:
            while not stop.is_set():
                episode = r.choice(owned)
                # no hold-and-wait: a decoder holds at most one lease while it waits
                # close() wakes every waiter, so only a waiter that close() failed to wake (or
                # one starved for the whole hang guard) can reach this timeout
                if not budget.acquire(episode, sizes[episode], timeout_s=HANG_GUARD_S):
                    failures.append(f"acquire of episode {episode} timed out: lost wake-up?")
                    return
                fetch(episode)
                check()
                time.sleep(r.random() * 0.001)
                budget.release(episode)
                if r.random() < 0.3:
                    try:
                        budget.forget(episode)
                    except UsageError:
                        pass  # another path still holds it or fetches it: allowed
                with progress_lock:
                    progress["acquired"] += 1
                    progress_lock.notify_all()
                time.sleep(r.random() * 0.001)  # unleased for a while, so waiters get room
        except BudgetClosed:
            pass

    def prefetcher(seed):
        r = random.Random(seed)
        try:
            while not stop.is_set():
                episode = r.randrange(60)
                if budget.try_reserve(episode, sizes[episode]):
                    fetch(episode)
                    with progress_lock:
                        progress["prefetched"] += 1
                        progress_lock.notify_all()
                budget.take_evicted()
                check()
        except BudgetClosed:
            pass

    # decoders own disjoint episodes (a worker's resident pool); prefetchers touch all of them
    threads = [threading.Thread(target=decoder, args=(i, list(range(i * 10, i * 10 + 10))),
                                daemon=True) for i in range(6)]
    threads += [threading.Thread(target=prefetcher, args=(100 + i,), daemon=True)
                for i in range(3)]
    for thread in threads:
        thread.start()
    # The run lasts until enough work was done, however slowly a loaded machine does it; this
    # thread checks the invariants meanwhile, as a third kind of caller.
    deadline = time.monotonic() + HANG_GUARD_S
    with progress_lock:
        while (progress["acquired"] < STRESS_ACQUIRES or progress["prefetched"] < STRESS_PREFETCHES
               ) and not failures and time.monotonic() < deadline:
            check()
            progress_lock.wait(0.005)
    budget.close()  # wakes anyone blocked in acquire
    stop.set()
    for thread in threads:
        thread.join(HANG_GUARD_S)
    assert not [t for t in threads if t.is_alive()], "a thread is still alive: deadlock"
    assert failures == []
    assert progress["acquired"] >= STRESS_ACQUIRES and progress["prefetched"] >= STRESS_PREFETCHES
    assert budget.snapshot().peak_reserved_bytes <= budget_bytes


# --- conformance cases (hand-derived expectations in spec/fixtures/budget) ----------------------

CASES = load_cases(kind="budget_ops")


@pytest.mark.parametrize("case", CASES, ids=[c.path.stem for c in CASES])
def test_conformance_cases(case):
    answer = in_process(case)
    assert first_difference(case.expected, answer) is None, (case.expected, answer)
    assert len(CASES) >= 3
