"""A rank's position in its stream, its checkpoint, and the DataLoader replay that restores it
(SPEC §3.6, §3.7, §3.9 and the checkpoint fields of §9.4).

The order of a rank's stream is a pure function of its setup, so a checkpoint is a few integers
(a :class:`ResumeState`); everything else is recomputed. Use::

    setup = ResumeSetup(seed=…, strategy=…, …, selection=selection_digest(episodes, frames))
    saved = ResumeState(epoch, samples, setup).to_dict()          # a plain dict for the checkpoint
    state = ResumeState.from_dict(saved).resume_with(setup)       # ResumeError, TopologyChanged
    delivered = delivered_by(state, episodes, frames, byte_sizes)  # byte_sizes: under a budget
    course = Course(state.setup, episodes, frames, delivered)
    start = course.positions(rank, state.samples)
    planner = course.planner(rank, w, start.epochs[w], byte_sizes)   # then skip(start.offsets[w])

DataLoader worker ``p`` plays logical worker ``(p + start.rotation) mod N`` (SPEC §3.6).
"""

from __future__ import annotations

import hashlib
import itertools
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, astuple, dataclass, fields, replace

import numpy as np

from refstream.errors import ResumeError, TopologyChanged, UsageError, check_int, is_int
from refstream.planner import STRATEGIES, Planner
from refstream.shard import ceil_div, lpt_partition, rank_shares, split_limits, worker_shares

__all__ = ["TOPOLOGY", "ResumeSetup", "Segment", "ResumeState", "ResumePositions", "Delivered",
           "Course", "WorkerPlan", "delivered_by", "selection_digest", "batches_per_worker",
           "epoch_batches", "resume_positions"]


@dataclass(frozen=True)
class ResumeSetup:
    """Everything that fixes the order of a rank's stream besides the position in it."""

    seed: int
    strategy: str
    pool_size: int | None  # the per-worker pool size as configured; None = the per-rank default
    byte_budget: int | None  # per rank, bytes
    world_size: int
    num_workers: int
    batch_size: int
    repeat: bool
    selection: str  # selection_digest of the selected episodes and their frame counts
    pool_ramp: int = 0  # absent from a checkpoint: 0


# The setup fields a resume may change (SPEC §3.9); every other one must match.
TOPOLOGY = ("world_size", "num_workers", "batch_size")


@dataclass(frozen=True)
class Segment:
    """An earlier topology of a position and the samples every rank consumed under it."""

    world_size: int
    num_workers: int
    batch_size: int
    samples: int


@dataclass(frozen=True)
class ResumeState:
    """A checkpoint (SPEC §3.6, Resume state; §3.9, History)."""

    epoch: int
    samples: int
    setup: ResumeSetup
    history: tuple[Segment, ...] = ()

    def to_dict(self) -> dict:
        """The flat JSON-ready dict that :meth:`from_dict` reads back."""
        return {"epoch": self.epoch, "samples": self.samples, **asdict(self.setup),
                "history": [list(astuple(segment)) for segment in self.history]}

    @classmethod
    def from_dict(cls, state: dict) -> ResumeState:
        """The state in a checkpoint dict; ResumeError names a field that breaks SPEC §3.6."""
        state = {"pool_ramp": ResumeSetup.pool_ramp, **state}  # absent: the default
        setup_names = [f.name for f in fields(ResumeSetup)]
        missing = sorted({"epoch", "samples", *setup_names} - set(state))
        if missing:
            raise ResumeError(f"resume state lacks {missing}")
        for name in ("epoch", "samples", "seed", "pool_ramp", *TOPOLOGY):
            check_int(state[name], f"resume state field {name}", 1 if name in TOPOLOGY else 0,
                      error=ResumeError)
        for name in ("pool_size", "byte_budget"):  # null, or an integer
            if state[name] is not None:
                check_int(state[name], f"resume state field {name}", 1, error=ResumeError)
        if state["strategy"] not in STRATEGIES or not isinstance(state["repeat"], bool):
            raise ResumeError("resume state has an unknown strategy or a non-boolean repeat")
        if not isinstance(state["selection"], str):
            raise ResumeError("resume state field selection must be a string digest")
        _check_whole_batches(state["samples"], state["batch_size"])
        setup = ResumeSetup(**{name: state[name] for name in setup_names})
        return cls(state["epoch"], state["samples"], setup, _history(state.get("history", [])))

    def resume_with(self, current: ResumeSetup) -> ResumeState:
        """The state to resume from with ``current`` (SPEC §3.9, History), else TopologyChanged."""
        old, new = asdict(self.setup), asdict(current)
        changes = [f"{name} {old[name]!r} -> {new[name]!r}" for name in old
                   if name not in TOPOLOGY and old[name] != new[name]]
        if changes:
            raise TopologyChanged(
                f"cannot resume this checkpoint, its setup differs: {', '.join(changes)} (only "
                "the world size, worker count and batch size may change)")
        if self.setup == current:  # the same topology: the same position
            return self
        segment = Segment(*(old[name] for name in TOPOLOGY), self.samples)
        return ResumeState(self.epoch, 0, current, (*self.history, segment))


def _history(entries: object) -> tuple[Segment, ...]:
    """A checkpoint's ``history``; ResumeError naming the entry that breaks SPEC §3.6."""
    if not isinstance(entries, list):
        raise ResumeError("resume state field history must be a list")
    for item in entries:
        if not (isinstance(item, list) and len(item) == 4
                and all(is_int(size, 1) for size in item[:3]) and is_int(item[3], 0)):
            raise ResumeError(f"resume state history entry {item!r} is not [world_size, "
                              "num_workers, batch_size, samples] with positive sizes")
        _check_whole_batches(item[3], item[2])
    return tuple(Segment(*item) for item in entries)


def selection_digest(episodes: Sequence[int], frames: Sequence[int]) -> str:
    """The ``selection`` field of a checkpoint (SPEC §3.6)."""
    lines = "".join(f"{e} {f}\n" for e, f in sorted(zip(episodes, frames, strict=True)))
    return hashlib.sha256(lines.encode("ascii")).hexdigest()


def batches_per_worker(batches: int, limits: list[int | None]) -> tuple[list[int], int]:
    """``(counts, next)`` after ``batches`` batches of workers with ``limits`` (SPEC §3.6)."""
    workers = len(limits)
    if all(limit is None for limit in limits):
        full, extra = divmod(batches, workers)
        return [full + (w < extra) for w in range(workers)], extra
    counts = [0] * workers
    turns = deque(w for w, limit in enumerate(limits) if limit is None or limit > 0)
    for _ in range(batches):
        if not turns:
            break
        worker = turns.popleft()
        counts[worker] += 1
        if limits[worker] is None or counts[worker] < limits[worker]:
            turns.append(worker)  # a worker not yet ended takes its next turn after the others
    return counts, (turns[0] if turns else 0)


def epoch_batches(world_worker_frames: Sequence[Sequence[int]], batch_size: int) -> int:
    """The batches every rank yields in a finite distributed epoch (SPEC §3.7)."""
    return min(sum(ceil_div(f, batch_size) for f in rank) for rank in world_worker_frames)


@dataclass(frozen=True)
class ResumePositions:
    """Where each logical worker of a rank starts, and which logical worker goes first."""

    epochs: tuple[int, ...]  # the epoch each logical worker's planner starts in
    offsets: tuple[int, ...]  # anchors of that epoch to skip
    stops: tuple[int | None, ...]  # anchor count of that epoch after which it stops; None = never
    rotation: int  # DataLoader worker p plays logical worker (p + rotation) mod N


def resume_positions(
    worker_frames: Sequence[int], batch_size: int, *, epoch: int, samples: int, repeat: bool,
    rank_batches: int | None = None, remainders: Sequence[tuple[Sequence[int], int | None]] = (),
) -> ResumePositions:
    """SPEC §3.6, Worker positions (``rank_batches``: §3.7); ``remainders[i]`` are each worker's
    anchors and the rank's batches of epoch ``epoch + i``, a rest (SPEC §3.9, Positions)."""
    if epoch < 0 or samples < 0:
        raise ResumeError(f"resume epoch {epoch} and offset {samples} must be non-negative")
    _check_whole_batches(samples, batch_size)
    # One plan per epoch from ``epoch`` on: each worker's anchors and the rank's batches. The
    # rests of the epochs in progress come first; the ordinary plan, last, holds for every later
    # epoch.
    plans = [*remainders, (worker_frames, rank_batches)]
    place = _endless_positions if repeat else _finite_positions
    return place(plans, batch_size, epoch, samples // batch_size)


def _endless_positions(plans: list, batch_size: int, epoch: int, batches: int) -> ResumePositions:
    """With repeat, each worker goes on through its own plans after its turns of ``batches``."""
    *rests, (frames, _) = plans
    counts, rotation = batches_per_worker(batches, [None] * len(frames))
    starts = [_walk(count * batch_size, [lengths[w] for lengths, _ in rests], frames[w])
              for w, count in enumerate(counts)]
    return ResumePositions(tuple(epoch + passed for passed, _ in starts),
                           tuple(offset for _, offset in starts), (None,) * len(frames), rotation)


def _finite_positions(plans: list, batch_size: int, epoch: int, batches: int) -> ResumePositions:
    """Without repeat, the rank passes whole epochs of batches (SPEC §3.9, Positions)."""
    limits = [[ceil_div(f, batch_size) for f in lengths] for lengths, _ in plans]
    per_epoch = [sum(limits[i]) if rest is None else rest for i, (_, rest) in enumerate(plans)]
    passed, batches = _walk(batches, per_epoch[:-1], per_epoch[-1])
    plan = min(passed, len(plans) - 1)
    counts, rotation = batches_per_worker(batches, limits[plan])
    ends, _ = batches_per_worker(per_epoch[plan], limits[plan])
    frames = plans[plan][0]
    return ResumePositions(
        epochs=(epoch + passed,) * len(frames),
        offsets=tuple(min(c * batch_size, f) for c, f in zip(counts, frames, strict=True)),
        stops=tuple(min(c * batch_size, f) for c, f in zip(ends, frames, strict=True)),
        rotation=rotation)


def _walk(consumed: int, rests: Sequence[int], ordinary: int) -> tuple[int, int]:
    """``(epochs passed, consumed in the epoch reached)`` after ``consumed`` anchors or batches
    of epochs holding ``rests[0]``, ``rests[1]``, … then ``ordinary`` each."""
    for passed, length in enumerate(rests):
        if consumed < length:
            return passed, consumed
        consumed -= length
    whole, consumed = divmod(consumed, ordinary)
    return len(rests) + whole, consumed


# --- another topology: what was delivered, and the rest of the epochs in progress -------------


@dataclass(frozen=True)
class Delivered:
    """SPEC §3.9, Delivered frames: ``counts[i][k]`` = ``d`` of the selection's ``k``-th episode in
    epoch ``first + i``."""

    first: int
    counts: tuple[np.ndarray, ...] = ()


@dataclass(frozen=True)
class _Epoch:
    """One epoch under one topology: its shares, their anchors, the rank's batches."""

    delivered: np.ndarray  # frames delivered before, per episode (all 0: an ordinary epoch)
    shares: list[list[list[int]]]  # [rank][worker] -> episodes
    lengths: list[list[int]]  # [rank][worker] -> anchors of the plan
    rank_batches: int | None  # None with repeat


class Course:
    """Every rank's and worker's plans under ``setup`` (SPEC §3.9, Plans). ``decoder_cache`` and
    ``cameras`` complete one worker's ``limits`` (SPEC §2.3); they do not change the order."""

    def __init__(self, setup: ResumeSetup, episodes: Sequence[int], frames: Sequence[int],
                 delivered: Delivered, *, decoder_cache: int | None = None,
                 cameras: int = 0) -> None:
        self.setup, self.episodes, self.delivered = setup, list(episodes), delivered
        self._index = {e: i for i, e in enumerate(self.episodes)}
        self._frames = np.asarray(frames, dtype=np.int64)
        self.limits = split_limits(setup.num_workers, pool_size=setup.pool_size,
                                   byte_budget=setup.byte_budget, decoder_cache=decoder_cache,
                                   cameras=cameras)
        self._ordinary = self._plan(np.zeros_like(self._frames))
        self._open = [self._plan(counts) for counts in delivered.counts]

    def _plan(self, delivered: np.ndarray) -> _Epoch:
        setup, episodes = self.setup, self.episodes
        counts = (self._frames - delivered).tolist()  # frames the epoch plans, per episode
        left = dict(zip(episodes, counts, strict=True))
        # An ordinary epoch refuses an empty share (ShardingError); the rest of one may have any.
        ordinary = not delivered.any()
        ranks = (rank_shares if ordinary else lpt_partition)(episodes, counts, setup.world_size)
        split = worker_shares if ordinary else lpt_partition
        shares = [split(ids, [left[e] for e in ids], setup.num_workers) for ids in ranks]
        lengths = [[sum(left[e] for e in part) for part in parts] for parts in shares]
        batches = None if setup.repeat else epoch_batches(lengths, setup.batch_size)
        return _Epoch(delivered, shares, lengths, batches)

    def _epoch(self, epoch: int) -> _Epoch:
        i = epoch - self.delivered.first
        return self._open[i] if 0 <= i < len(self._open) else self._ordinary

    def episodes_from(self, rank: int, worker: int, epoch: int) -> list[int]:
        """The episodes logical worker ``worker`` of ``rank`` plans from ``epoch`` on (in
        ``epoch`` only without repeat), by id."""
        i = max(0, epoch - self.delivered.first)
        plans = [*self._open[i:], self._ordinary] if self.setup.repeat else [self._epoch(epoch)]
        return sorted(set().union(*(plan.shares[rank][worker] for plan in plans)))

    def worker_plan(self, rank: int, worker: int, samples: int) -> WorkerPlan:
        """What DataLoader worker ``worker`` of ``rank`` plays after ``samples`` (SPEC §3.6)."""
        start = self.positions(rank, samples)
        logical = (worker + start.rotation) % self.setup.num_workers
        epoch = start.epochs[logical]
        return WorkerPlan(self, rank, logical, epoch, start.offsets[logical],
                          start.stops[logical], self.episodes_from(rank, logical, epoch))

    def positions(self, rank: int, samples: int) -> ResumePositions:
        """Where each logical worker of ``rank`` starts after ``samples`` with this topology."""
        return resume_positions(
            self._ordinary.lengths[rank], self.setup.batch_size, epoch=self.delivered.first,
            samples=samples, repeat=self.setup.repeat, rank_batches=self._ordinary.rank_batches,
            remainders=[(e.lengths[rank], e.rank_batches) for e in self._open])

    def planner(self, rank: int, worker: int, epoch: int,
                byte_sizes: Mapping[int, int] | None) -> Planner:
        """The plan of ``worker`` of ``rank`` in ``epoch`` (``byte_sizes`` None: no budget)."""
        plan = self._epoch(epoch)
        share = plan.shares[rank][worker]
        at = [self._index[e] for e in share]
        budget = None if byte_sizes is None else self.limits.byte_budget
        return Planner(
            share, self._frames[at].tolist(), seed=self.setup.seed, epoch=epoch, rank=rank,
            worker=worker, strategy=self.setup.strategy, pool_size=self.limits.pool_size,
            byte_sizes=None if budget is None else [byte_sizes[e] for e in share],
            byte_budget=budget, delivered=plan.delivered[at].tolist(),
            pool_ramp=self.setup.pool_ramp)

    def after(self, samples: int, byte_sizes: Mapping[int, int] | None) -> Delivered:
        """What has been delivered once every rank consumed ``samples`` with this topology."""
        starts = [self.positions(rank, samples) for rank in range(self.setup.world_size)]
        first = min(min(start.epochs) for start in starts)
        last = max([*(max(start.epochs) for start in starts),
                    self.delivered.first + len(self.delivered.counts) - 1])
        counts = [self._epoch(epoch).delivered.copy() for epoch in range(first, last + 1)]
        for rank, start in enumerate(starts):
            for worker, (epoch, offset) in enumerate(zip(start.epochs, start.offsets, strict=True)):
                for done in range(first, epoch):  # whole plans: a repeat worker ran ahead
                    at = [self._index[e] for e in self._epoch(done).shares[rank][worker]]
                    counts[done - first][at] = self._frames[at]
                if offset:
                    planner = self.planner(rank, worker, epoch, byte_sizes)
                    planner.skip(offset)
                    for episode, n in planner.emitted().items():
                        counts[epoch - first][self._index[episode]] += n
        while counts and not counts[-1].any():
            counts.pop()
        return Delivered(first, tuple(counts))


@dataclass(frozen=True)
class WorkerPlan:
    """What one DataLoader worker plays: logical worker ``worker`` of ``rank`` in ``course``,
    from anchor ``offset`` of ``epoch`` to anchor ``stop`` (None: never) of each epoch."""

    course: Course
    rank: int
    worker: int
    epoch: int
    offset: int
    stop: int | None
    episodes: list[int]  # every episode its plans hold

    def runs(self, byte_sizes: Mapping[int, int] | None
             ) -> Iterator[tuple[Planner, int, int | None]]:
        """``(planner, offset, stop)`` of each epoch it plays: ``epoch``, then on with repeat."""
        epochs = itertools.count(self.epoch) if self.course.setup.repeat else [self.epoch]
        for epoch in epochs:
            planner = self.course.planner(self.rank, self.worker, epoch, byte_sizes)
            yield planner, self.offset if epoch == self.epoch else 0, self.stop


def delivered_by(state: ResumeState, episodes: Sequence[int], frames: Sequence[int],
                 byte_sizes: Mapping[int, int] | None = None) -> Delivered:
    """What the segments of ``state.history`` delivered in turn from ``state.epoch`` on (§3.9)."""
    if state.setup.byte_budget is not None and byte_sizes is None:
        raise UsageError("replaying workers under a byte budget needs every episode's byte sizes")
    delivered = Delivered(state.epoch)
    for segment in state.history:
        topology = {name: getattr(segment, name) for name in TOPOLOGY}
        course = Course(replace(state.setup, **topology), episodes, frames, delivered)
        delivered = course.after(segment.samples, byte_sizes)
    return delivered


def _check_whole_batches(samples: int, batch_size: int) -> None:
    if samples % batch_size:
        raise ResumeError(f"a resume offset of {samples} samples is not a whole number of "
                          f"batches of {batch_size}")
