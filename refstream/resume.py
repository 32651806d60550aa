"""A rank's position in its stream, checkpoints, and the DataLoader replay that restores it.

The order of a rank's stream is a pure function of its setup, so a checkpoint is a few integers:
a :class:`ResumeState` holds the epoch, the samples the rank consumed since that epoch began (a
whole number of batches) and the :class:`ResumeSetup` that fixed the order. Everything else is
recomputed; no planner runs here. Use::

    setup = ResumeSetup(seed=…, strategy=…, …, selection=selection_digest(episodes, frames))
    saved = ResumeState(epoch, samples, setup).to_dict()          # a plain dict for the checkpoint
    state = ResumeState.from_dict(saved)                           # ResumeError names a bad field
    state.require_setup(setup)                                     # TopologyChanged names changes
    end = epoch_batches(world_worker_frames, batch_size)           # finite distributed epochs
    start = resume_positions(worker_frames, batch_size, epoch=state.epoch,
                             samples=state.samples, repeat=repeat, rank_batches=end)

DataLoader worker ``p`` then plays logical worker ``w = (p + start.rotation) mod N``: it plans
epoch ``start.epochs[w]`` of share ``w``, skips ``start.offsets[w]`` anchors
(:meth:`~refstream.planner.Planner.skip`) and stops after ``start.stops[w]``.
:func:`batches_per_worker` is the replay underneath: the DataLoader's in-order round robin over
workers whose streams end. Invariants: ``from_dict(to_dict())`` gives the state back; resuming
yields exactly the batches the uninterrupted run would have yielded next; what the rank delivered
before a checkpoint is a function of the checkpoint alone (each logical worker's anchors before
its position); a checkpoint of another setup (seed, strategy, limits, topology or selection) is
refused, never reinterpreted.

Implements SPEC §3.6 (replay, checkpoints, worker positions), §3.7 (the distributed end of an
epoch) and the checkpoint fields of §9.4.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields

from refstream.errors import ResumeError, TopologyChanged, UsageError
from refstream.planner import STRATEGIES

__all__ = [
    "ResumeSetup",
    "ResumeState",
    "ResumePositions",
    "selection_digest",
    "batches_per_worker",
    "epoch_batches",
    "resume_positions",
]


@dataclass(frozen=True)
class ResumeSetup:
    """Everything that fixes the order of a rank's stream besides the position in it (the
    checkpoint fields of SPEC §3.6 and §9.4)."""

    seed: int
    strategy: str
    pool_size: int | None  # the per-worker pool size as configured; None = the per-rank default
    byte_budget: int | None  # per rank, bytes
    world_size: int
    num_workers: int
    batch_size: int
    repeat: bool
    selection: str  # selection_digest of the selected episodes and their frame counts


@dataclass(frozen=True)
class ResumeState:
    """A checkpoint: ``samples`` the rank consumed (whole batches) since ``epoch`` began."""

    epoch: int
    samples: int
    setup: ResumeSetup

    def to_dict(self) -> dict:
        """The flat JSON-ready dict of SPEC §3.6 that :meth:`from_dict` reads back."""
        return {"epoch": self.epoch, "samples": self.samples, **asdict(self.setup)}

    @classmethod
    def from_dict(cls, state: dict) -> ResumeState:
        """The state a checkpoint dict holds; ResumeError naming the field that breaks SPEC
        §3.6 ("Resume state")."""
        if not isinstance(state, dict):
            raise ResumeError(f"a resume state is a dict, not {type(state).__name__}")
        setup_names = [f.name for f in fields(ResumeSetup)]
        missing = sorted({"epoch", "samples", *setup_names} - set(state))
        if missing:
            raise ResumeError(f"resume state lacks {missing}")
        for name in ("epoch", "samples", "seed", "world_size", "num_workers", "batch_size"):
            value = state[name]
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ResumeError(f"resume state field {name} must be a non-negative integer")
        for name in ("world_size", "num_workers", "batch_size"):
            if state[name] < 1:
                raise ResumeError(f"resume state field {name} must be positive")
        for name in ("pool_size", "byte_budget"):
            value = state[name]
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ResumeError(f"resume state field {name} must be null or a positive integer")
        if state["strategy"] not in STRATEGIES or not isinstance(state["repeat"], bool):
            raise ResumeError("resume state has an unknown strategy or a non-boolean repeat")
        _check_whole_batches(state["samples"], state["batch_size"])
        if not isinstance(state["selection"], str):
            raise ResumeError("resume state field selection must be a string digest")
        setup = ResumeSetup(**{name: state[name] for name in setup_names})
        return cls(epoch=state["epoch"], samples=state["samples"], setup=setup)

    def require_setup(self, current: ResumeSetup) -> None:
        """Return if the checkpoint's setup is ``current``; else TopologyChanged naming every
        field that differs as ``name old -> new``."""
        changes = [
            f"{f.name} {getattr(self.setup, f.name)!r} -> {getattr(current, f.name)!r}"
            for f in fields(ResumeSetup)
            if getattr(self.setup, f.name) != getattr(current, f.name)
        ]
        if changes:
            raise TopologyChanged(
                "cannot resume sample-exactly, the checkpoint was taken with another setup: "
                + ", ".join(changes)
            )


def selection_digest(episodes: Sequence[int], frames: Sequence[int]) -> str:
    """The ``selection`` field of a checkpoint: a SHA-256 of the selected episodes and their
    frame counts (SPEC §3.6)."""
    lines = "".join(f"{e} {f}\n" for e, f in sorted(zip(episodes, frames, strict=True)))
    return hashlib.sha256(lines.encode("ascii")).hexdigest()


def batches_per_worker(batches: int, limits: list[int | None]) -> tuple[list[int], int]:
    """``(counts, next)``: how many of an in-order DataLoader's first ``batches`` batches each
    worker produced, and whose turn is next, when worker ``w`` has ``limits[w]`` batches
    (``None``: never ends) — SPEC §3.6 "Replay"."""
    if batches < 0:
        raise UsageError(f"batches must be non-negative, got {batches}")
    workers = len(limits)
    if workers == 0:
        raise UsageError("batches_per_worker needs at least one worker")
    if all(limit is None for limit in limits):
        full, extra = divmod(batches, workers)
        return [full + (w < extra) for w in range(workers)], extra
    counts = [0] * workers
    active = [w for w, limit in enumerate(limits) if limit is None or limit > 0]
    turn = 0
    for _ in range(batches):
        if not active:
            break
        worker = active[turn]
        counts[worker] += 1
        if limits[worker] is not None and counts[worker] >= limits[worker]:
            active.pop(turn)
        else:
            turn += 1
        turn = turn % len(active) if active else 0
    return counts, (active[turn] if active else 0)


def epoch_batches(world_worker_frames: Sequence[Sequence[int]], batch_size: int) -> int:
    """The batches every rank yields in a finite distributed epoch (SPEC §3.7), given the frame
    total of every worker share of every rank."""
    if batch_size < 1:
        raise UsageError(f"batch_size must be positive, got {batch_size}")
    if not world_worker_frames:
        raise UsageError("epoch_batches needs at least one rank")
    return min(sum(_batches(f, batch_size) for f in rank) for rank in world_worker_frames)


@dataclass(frozen=True)
class ResumePositions:
    """Where each logical worker of a rank starts, and which logical worker goes first."""

    epochs: tuple[int, ...]  # the epoch each logical worker's planner starts in
    offsets: tuple[int, ...]  # anchors of that epoch to skip
    stops: tuple[int | None, ...]  # anchor count of that epoch after which it stops; None = never
    rotation: int  # DataLoader worker p plays logical worker (p + rotation) mod N


def resume_positions(
    worker_frames: Sequence[int],
    batch_size: int,
    *,
    epoch: int,
    samples: int,
    repeat: bool,
    rank_batches: int | None = None,
) -> ResumePositions:
    """Where every logical worker starts after the rank consumed ``samples`` since ``epoch``
    began (SPEC §3.6 "Worker positions"); ``worker_frames[w]`` is the frame total of logical
    worker ``w``'s share and ``rank_batches`` the :func:`epoch_batches` of a finite distributed
    epoch (default: all the rank's batches). ResumeError for a position that is not whole
    batches."""
    if batch_size < 1:
        raise UsageError(f"batch_size must be positive, got {batch_size}")
    if epoch < 0 or samples < 0:
        raise ResumeError(f"resume epoch {epoch} and offset {samples} must be non-negative")
    _check_whole_batches(samples, batch_size)
    if not worker_frames or min(worker_frames) < 1:
        raise UsageError(f"every worker share needs frames, got {list(worker_frames)}")
    batches = samples // batch_size
    if repeat:
        counts, rotation = batches_per_worker(batches, [None] * len(worker_frames))
        rolled = [divmod(c * batch_size, f) for c, f in zip(counts, worker_frames, strict=True)]
        return ResumePositions(
            epochs=tuple(epoch + q for q, _ in rolled),
            offsets=tuple(r for _, r in rolled),
            stops=(None,) * len(worker_frames),
            rotation=rotation,
        )
    limits: list[int | None] = [_batches(f, batch_size) for f in worker_frames]
    per_epoch = sum(limits) if rank_batches is None else rank_batches
    if not 1 <= per_epoch <= sum(limits):
        raise UsageError(f"rank_batches {rank_batches} is not in [1, {sum(limits)}]")
    whole_epochs, batches = divmod(batches, per_epoch)
    counts, rotation = batches_per_worker(batches, limits)
    ends, _ = batches_per_worker(per_epoch, limits)
    return ResumePositions(
        epochs=(epoch + whole_epochs,) * len(worker_frames),
        offsets=tuple(min(c * batch_size, f) for c, f in zip(counts, worker_frames, strict=True)),
        stops=tuple(min(c * batch_size, f) for c, f in zip(ends, worker_frames, strict=True)),
        rotation=rotation,
    )


def _check_whole_batches(samples: int, batch_size: int) -> None:
    if samples % batch_size:
        raise ResumeError(
            f"a resume offset of {samples} samples is not a whole number of batches of "
            f"{batch_size}"
        )


def _batches(frames: int, batch_size: int) -> int:
    """The batches a worker fills from ``frames`` anchors: ⌈frames / batch_size⌉, the last one
    possibly short."""
    return -(-frames // batch_size)
