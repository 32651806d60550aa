"""The exact-coverage plan of one DataLoader worker for one epoch, and how to resume it.

A :class:`Planner` is an iterator of *anchors* ``(episode, frame)``: every frame of every episode
of the worker's share exactly once, then ``StopIteration``. It never waits and does no I/O; the
stream layer follows it. Use::

    planner = Planner(share, frames, seed=s, epoch=e, rank=r, worker=w, pool_size=p,
                      byte_sizes=sizes, byte_budget=b)
    planner.skip(offset)                      # resume: fast-forward, no I/O
    admitted, evicted = planner.drain_events()
    for episode, frame in planner: ...        # planner.resident, planner.frontier(k) meanwhile

The rules (normative text: ``spec/SPEC.md`` §3):

* Episodes with zero frames are dropped. The rest wait in the *admission order*, the keyed
  permutation of their ids with key ``(seed, epoch, "admit")``.
* Admission: while fewer than ``pool_size`` episodes are resident, admit the first waiting episode
  whose byte size fits in what the budget has left (skipped episodes keep their place); stop when
  none fits. An episode larger than the whole budget is :class:`EpisodeTooLarge` at construction.
* Emission, ``pool``: draw number ``n`` (0, 1, … over the epoch) picks
  ``t = below(R, (seed, epoch, "draw", rank, worker), n)`` where ``R`` is the number of frames
  the residents have left; walking residents in admission order, the one where ``t`` falls among
  its left frames is chosen — an episode is chosen with probability proportional to its left
  frames. ``round_robin``: round ``k`` visits the episodes resident at its start, in the keyed
  permutation ``(seed, epoch, "round", rank, worker, k)``, one frame each; episodes admitted during
  a round join the next.
* An episode's frames come in the keyed permutation ``(seed, epoch, "frames", episode)`` of
  ``0 … frames−1``. An episode is evicted right after its last frame, then admission runs.

Resume (the DataLoader side): :class:`ResumeState` is what a checkpoint stores (epoch, samples
consumed by the rank, and the :class:`ResumeSetup` that must not change);
:func:`batches_per_worker` replays the DataLoader's in-order round-robin batch assignment;
:func:`resume_positions` turns a rank's offset into every worker's ``(epoch, offset, stop)`` and
the rotation of logical workers; :func:`epoch_batches` is the distributed end-of-epoch rule.
"""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from itertools import islice

import numpy as np

from refstream.errors import EpisodeTooLarge, ResumeError, TopologyChanged, UsageError
from refstream.rng import derive_key, extend_key, permutation, permutation_list, u64_array

__all__ = [
    "DEFAULT_SEED",
    "STRATEGIES",
    "Planner",
    "ResumeSetup",
    "ResumeState",
    "ResumePositions",
    "selection_digest",
    "batches_per_worker",
    "epoch_batches",
    "resume_positions",
]

# The seed used when none is given (LeRobot's DEFAULT_STREAMING_SEED).
DEFAULT_SEED = 42
STRATEGIES = ("pool", "round_robin")
# Draw words are computed this many at a time with numpy (one vectorised call per block).
_DRAW_BLOCK = 4096


class Planner:
    """One worker's exact-coverage plan for one epoch; an iterator of ``(episode, frame)``."""

    def __init__(
        self,
        episodes: Sequence[int],
        frames: Sequence[int],
        *,
        seed: int | None,
        epoch: int,
        rank: int,
        worker: int,
        strategy: str = "pool",
        pool_size: int,
        byte_sizes: Sequence[int] | None = None,
        byte_budget: int | None = None,
    ) -> None:
        seed = DEFAULT_SEED if seed is None else seed
        _check_inputs(episodes, frames, epoch, rank, worker, strategy, pool_size)
        self._frames = {int(e): int(f) for e, f in zip(episodes, frames, strict=True) if f > 0}
        self._sizes = _check_budget(episodes, frames, byte_sizes, byte_budget)
        self._budget = byte_budget
        self._pool_size = pool_size
        self._strategy = strategy
        admission = permutation(derive_key(seed, epoch, "admit"), list(self._frames))
        self._pending: deque[int] = deque(admission.tolist())
        self._left: dict[int, int] = {}  # resident -> frames not yet emitted, admission order
        self._orders: dict[int, list[int]] = {}  # resident -> its frame permutation (lazy)
        self._pool_frames_left = 0  # R: sum of self._left
        self._resident_bytes = 0
        self._emitted = 0  # anchors emitted so far = the next draw number
        self._total = sum(self._frames.values())
        self._frames_key = derive_key(seed, epoch, "frames")
        self._draw_key = derive_key(seed, epoch, "draw", rank, worker)
        self._round_key = derive_key(seed, epoch, "round", rank, worker)
        self._round: list[int] = []
        self._round_pos = 0
        self._rounds_started = 0
        self._draw_words: list[int] = []
        self._draw_words_start = 0
        self._admitted_events: list[int] = []
        self._evicted_events: list[int] = []
        self._admit()

    # --- what the I/O layer reads -------------------------------------------------------------

    @property
    def resident(self) -> list[int]:
        """Admitted episodes not yet drained, in admission order."""
        return list(self._left)

    @property
    def resident_bytes(self) -> int:
        """Sum of the byte sizes of the residents (0 without a budget)."""
        return self._resident_bytes

    @property
    def remaining(self) -> int:
        """Anchors left this epoch."""
        return self._total - self._emitted

    def frontier(self, k: int) -> list[int]:
        """The next ``k`` waiting episodes in admission order; admits nothing."""
        return list(islice(self._pending, max(0, k)))

    def drain_events(self) -> tuple[list[int], list[int]]:
        """``(admitted, evicted)`` episodes since the last call, each in event order."""
        events = (self._admitted_events, self._evicted_events)
        self._admitted_events, self._evicted_events = [], []
        return events

    # --- iteration ----------------------------------------------------------------------------

    def __iter__(self) -> Planner:
        return self

    def __next__(self) -> tuple[int, int]:
        if self._pool_frames_left == 0:
            raise StopIteration
        episode = self._choose()
        order = self._orders.get(episode)
        if order is None:
            key = extend_key(self._frames_key, episode)
            order = permutation(key, np.arange(self._frames[episode])).tolist()
            self._orders[episode] = order
        frame = order[self._frames[episode] - self._left[episode]]
        self._take(episode)
        return episode, frame

    def skip(self, n: int) -> None:
        """Fast-forward ``n`` anchors exactly as ``n`` calls of ``next`` would, without
        computing their frames; events are recorded as usual."""
        if not 0 <= n <= self.remaining:
            raise UsageError(f"cannot skip {n} anchors: {self.remaining} remain in this epoch")
        choose, take = self._choose, self._take
        for _ in range(n):
            take(choose())

    def _choose(self) -> int:
        if self._strategy == "pool":
            draw = self._emitted - self._draw_words_start
            if not 0 <= draw < len(self._draw_words):
                start = self._emitted
                indices = np.arange(start, start + _DRAW_BLOCK, dtype=np.uint64)
                self._draw_words = u64_array(self._draw_key, indices).tolist()
                self._draw_words_start, draw = start, 0
            # below(R, draw key, n) = (u64 · R) >> 64, then the walk over residents.
            t = (self._draw_words[draw] * self._pool_frames_left) >> 64
            for episode, left in self._left.items():
                if t < left:
                    return episode
                t -= left
            raise AssertionError("draw beyond the pool's frames")  # R is the sum of _left
        if self._round_pos == len(self._round):
            key = extend_key(self._round_key, self._rounds_started)
            self._round = permutation_list(key, list(self._left))
            self._round_pos = 0
            self._rounds_started += 1
        self._round_pos += 1
        return self._round[self._round_pos - 1]

    def _take(self, episode: int) -> None:
        self._emitted += 1
        self._pool_frames_left -= 1
        left = self._left[episode] - 1
        if left:
            self._left[episode] = left
            return
        del self._left[episode]
        self._orders.pop(episode, None)
        if self._sizes is not None:
            self._resident_bytes -= self._sizes[episode]
        self._evicted_events.append(episode)
        self._admit()

    def _admit(self) -> None:
        pending, sizes = self._pending, self._sizes
        while len(self._left) < self._pool_size and pending:
            if sizes is None:
                episode = pending.popleft()
            else:
                room = self._budget - self._resident_bytes
                place = next((i for i, e in enumerate(pending) if sizes[e] <= room), None)
                if place is None:
                    return  # wait for an eviction to free bytes
                episode = pending[place]
                del pending[place]
                self._resident_bytes += sizes[episode]
            self._left[episode] = self._frames[episode]
            self._pool_frames_left += self._frames[episode]
            self._admitted_events.append(episode)


def _check_inputs(episodes, frames, epoch, rank, worker, strategy, pool_size) -> None:
    if len(episodes) != len(frames):
        raise UsageError(f"{len(episodes)} episode ids but {len(frames)} frame counts")
    if len(set(episodes)) != len(episodes):
        raise UsageError("the planner's episode ids must be distinct")
    if any(e < 0 for e in episodes):
        raise UsageError(f"episode ids must be non-negative, got {min(episodes)}")
    if any(f < 0 for f in frames):
        raise UsageError(f"frame counts must be non-negative, got {min(frames)}")
    for name, value in (("epoch", epoch), ("rank", rank), ("worker", worker)):
        if value < 0:
            raise UsageError(f"{name} must be non-negative, got {value}")
    if strategy not in STRATEGIES:
        raise UsageError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    if pool_size < 1:
        raise UsageError(f"pool_size must be at least 1, got {pool_size}")


def _check_budget(episodes, frames, byte_sizes, byte_budget) -> dict[int, int] | None:
    if byte_sizes is None and byte_budget is None:
        return None
    if byte_sizes is None or byte_budget is None:
        raise UsageError("byte_sizes and byte_budget go together: give both or neither")
    if byte_budget < 1:
        raise UsageError(f"byte_budget must be positive, got {byte_budget}")
    if len(byte_sizes) != len(episodes):
        raise UsageError(f"{len(episodes)} episode ids but {len(byte_sizes)} byte sizes")
    sizes = {}
    for episode, count, size in zip(episodes, frames, byte_sizes, strict=True):
        if size < 0:
            raise UsageError(f"episode {episode} has a negative byte size {size}")
        if count > 0 and size > byte_budget:
            raise EpisodeTooLarge(
                f"episode {episode} needs {size} bytes, more than the whole byte budget of "
                f"{byte_budget} bytes"
            )
        sizes[int(episode)] = int(size)
    return sizes


# --- resume -----------------------------------------------------------------------------------


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


@dataclass(frozen=True)
class ResumeState:
    """A rank's position: ``samples`` consumed (whole batches) since the start of ``epoch``."""

    epoch: int
    samples: int
    setup: ResumeSetup

    def to_dict(self) -> dict:
        return {"epoch": self.epoch, "samples": self.samples, **asdict(self.setup)}

    @classmethod
    def from_dict(cls, state: dict) -> ResumeState:
        """Parse and validate a state dict (:class:`ResumeError` names the bad field)."""
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
        if state["samples"] % state["batch_size"]:
            raise ResumeError(
                f"a resume offset of {state['samples']} samples is not a whole number of batches "
                f"of {state['batch_size']}"
            )
        if not isinstance(state["selection"], str):
            raise ResumeError("resume state field selection must be a string digest")
        setup = ResumeSetup(**{name: state[name] for name in setup_names})
        return cls(epoch=state["epoch"], samples=state["samples"], setup=setup)

    def require_setup(self, current: ResumeSetup) -> None:
        """:class:`TopologyChanged` naming every setting that differs from ``current``."""
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
    """SHA-256 (hex) of the ASCII lines ``"<episode> <frames>\\n"`` sorted by episode id."""
    lines = "".join(f"{e} {f}\n" for e, f in sorted(zip(episodes, frames, strict=True)))
    return hashlib.sha256(lines.encode("ascii")).hexdigest()


def batches_per_worker(batches: int, limits: list[int | None]) -> tuple[list[int], int]:
    """Replay an in-order DataLoader handing out ``batches`` batches: workers take turns from
    worker 0, a worker is skipped after its last batch (``limits[w]`` batches; ``None`` never
    ends). Returns the batches each worker produced and the worker whose turn is next."""
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
    """The distributed end of a finite epoch: every rank yields this many batches, the fewest any
    rank's DataLoader can fill, ``min over ranks of Σ_w ⌈frames[r][w] / batch_size⌉``."""
    if batch_size < 1:
        raise UsageError(f"batch_size must be positive, got {batch_size}")
    if not world_worker_frames:
        raise UsageError("epoch_batches needs at least one rank")
    return min(sum(-(-f // batch_size) for f in rank) for rank in world_worker_frames)


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
    """Every logical worker's start after a rank consumed ``samples`` since ``epoch`` began.

    ``worker_frames[w]`` is the frame total of logical worker ``w``'s share. With ``repeat`` the
    workers stream epoch after epoch and worker ``w``'s ``counts[w] · batch_size`` samples roll
    over its own epochs. Without it an epoch is ``rank_batches`` batches (the value of
    :func:`epoch_batches`; default: all the rank's batches), whole epochs roll the epoch number,
    and each worker stops where the rank's epoch ends."""
    if batch_size < 1:
        raise UsageError(f"batch_size must be positive, got {batch_size}")
    if epoch < 0 or samples < 0:
        raise ResumeError(f"resume epoch {epoch} and offset {samples} must be non-negative")
    if samples % batch_size:
        raise ResumeError(
            f"a resume offset of {samples} samples is not a whole number of batches of "
            f"{batch_size}"
        )
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
    limits: list[int | None] = [-(-f // batch_size) for f in worker_frames]
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
