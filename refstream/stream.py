"""``StreamingDataset``: LeRobot v3 samples streamed episode by episode into a torch DataLoader
(SPEC §9). Use (ready batches, the fastest path: each frame is decoded once, straight into the
shared memory the training process receives)::

    dataset = StreamingDataset("hf://datasets/OWNER/NAME", delta_timestamps={...}, seed=0,
                               batch_size=B, batched=True)
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=N)
    for epoch in range(epochs):
        dataset.set_epoch(epoch)
        for batch in loader: ...
    state = dataset.state_dict(samples=steps * B, batch_size=B, num_workers=N)  # a checkpoint
    dataset.load_state_dict(state)  # before iter(loader): continue from it (SPEC §9.4, §3.9)

The position lives in shared memory, so persistent workers see it.

Importing this module adds :class:`Batch` to torch's ``default_collate_fn_map``, the documented
way to extend ``default_collate``, so a DataLoader batching ready batches raises UsageError. The
map lives in the private ``torch.utils.data._utils.collate``: if torch moves it, this import
fails; if torch stops reading it, ``test_a_dataloader_batching_ready_batches_is_refused`` fails.
"""


from __future__ import annotations

import contextlib
import hashlib
import os
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence

import torch
from torch.utils.data import IterableDataset, get_worker_info
from torch.utils.data._utils.collate import default_collate_fn_map

from refstream import errors, resume, shard
from refstream.budget import check_episode_size
from refstream.errors import IterableOnly, TopologyChanged, UsageError
from refstream.hub import pinned_root
from refstream.meta import INFO_PATH, DatasetMeta, load_meta, select_episodes
from refstream.mp4 import SampleIndex
from refstream.planner import DEFAULT_POOL_RAMP, STRATEGIES
from refstream.rng import MASK64, resolve_seed
from refstream.roots import open_source
from refstream.sidecar import MappedIndex, VideoIndex, ensure_index, lock_timeout
from refstream.stats import selection_stats
from refstream.synth import check_frame_rate
from refstream.windows import check_tolerance, make_windows
from refstream.worker import Batch, WorkerConfig, WorkerStream, plan_spans

__all__ = ["StreamingDataset", "Batch", "GIB"]

GIB = 1024**3  # byte_budget_gb is in GiB, like LeRobot's int(gb · 1024³)
# The position, a shared int64 tensor of six words: the epoch and samples every new iterator
# starts from; the DataLoader worker count a loaded checkpoint is for (0: any); the seed's 64
# bits; the digest of the earlier topologies the checkpoint resumes after (0: none); and the
# iterators started since the position was set: the last one's key in the high 32 bits of _PASS,
# their count in its low 32 bits (_LOW).
_EPOCH, _SAMPLES, _RESUME_WORKERS, _SEED, _HISTORY, _PASS = range(6)
_LOW = (1 << 32) - 1


def _refuse_batches(batch, *, collate_fn_map=None):
    raise UsageError("the dataset yields ready batches (batched=True): give the DataLoader "
                     "batch_size=None, or let the DataLoader batch samples without batched")


default_collate_fn_map[Batch] = _refuse_batches  # see the module docstring


class StreamingDataset(IterableDataset):
    """A LeRobot v3 dataset streamed episode by episode. ``root``: a folder, an ``http(s)://``
    base URL or ``hf://datasets/OWNER/NAME[@REV]``. ``episode_pool_size`` and
    ``prefetch_episodes`` are per worker, ``byte_budget_gb`` (GiB) and
    ``video_decoder_cache_size`` per rank (SPEC §2.3); a worker's pool gains an episode every
    ``episode_pool_ramp`` anchors until it is full (SPEC §3.2; 0: full from the start).
    ``batch_size``: the DataLoader's, or with ``batched`` the dataset's own (SPEC §9.4, §9.5).
    ``decode_threads`` per worker decode each group of ``decoded_queue_size`` samples
    (``batch_size`` when batched); by default the CPUs shared among the DataLoader's workers, 1
    or 2 each (``refstream.worker.decode_threads``).
    ``sidecar_lock_timeout_s``: the wait for another process building the video index (SPEC
    §10.6)."""

    def __init__(self, root: str | os.PathLike, *, episodes: Sequence[int] | None = None,
                 delta_timestamps: Mapping[str, Sequence[float]] | None = None,
                 tolerance_s: float = 1e-4, seed: int | None = None,
                 sampling_strategy: str = "pool", episode_pool_size: int | None = None,
                 episode_pool_ramp: int = DEFAULT_POOL_RAMP,
                 prefetch_episodes: int = 8, byte_budget_gb: float = 8.0,
                 decode_threads: int | None = None,
                 decoded_queue_size: int = 8, video_decoder_cache_size: int | None = None,
                 return_uint8: bool = False, image_transforms: Callable | None = None,
                 repeat: bool = False, rank: int | None = None, world_size: int | None = None,
                 batch_size: int | None = None, batched: bool = False,
                 num_workers: int | None = None,
                 sidecar_lock_timeout_s: float | None = None) -> None:
        super().__init__()
        # 1. The arguments, checked and kept.
        if sampling_strategy not in STRATEGIES:
            raise UsageError(f"sampling_strategy must be one of {STRATEGIES}, "
                             f"got {sampling_strategy!r}")
        if not byte_budget_gb > 0:
            raise UsageError(f"byte_budget_gb must be positive, got {byte_budget_gb}")
        errors.check_at_least(0, prefetch_episodes=prefetch_episodes, num_workers=num_workers,
                              episode_pool_ramp=episode_pool_ramp)
        errors.check_at_least(1, decode_threads=decode_threads,
                              decoded_queue_size=decoded_queue_size, batch_size=batch_size)
        if batched and not batch_size:
            raise UsageError("batched=True yields batches of batch_size: give batch_size=B")
        self.root = str(root)
        self.tolerance_s = check_tolerance(tolerance_s)
        self.seed = resolve_seed(seed)
        self._seed_given = seed is not None  # else a checkpoint's seed is taken
        self.sampling_strategy = sampling_strategy
        self.delta_timestamps = delta_timestamps  # as given, like LeRobotDataset's
        self.repeat = repeat
        self.batch_size = batch_size
        self.batched = batched
        self.num_workers = num_workers
        self.sidecar_lock_timeout_s = lock_timeout(sidecar_lock_timeout_s)
        self.rank, self.world_size = _resolve_rank(rank, world_size)
        if not (repeat or self.world_size <= 1 or batch_size):
            raise UsageError(f"world_size {self.world_size} without repeat: pass batch_size so "
                             "every rank stops after the same number of batches, or repeat=True")

        # 2. I/O: the metadata, the selection and its shares, the video index (SPEC §9.2).
        with contextlib.closing(open_source(self.root)) as source:
            self.meta: DatasetMeta = load_meta(source)
            self.episodes = select_episodes(self.meta, episodes)
            self._frames = [self.meta.frames(e) for e in self.episodes]
            windows = make_windows(delta_timestamps, self.meta.fps, self.tolerance_s,
                                   feature_keys=self.meta.features)
            ranks = shard.rank_shares(self.episodes, self._frames, self.world_size)
            self.video_index = _video_index(source, self.meta, self.sidecar_lock_timeout_s)
            # Workers open their own sources; a Hub branch stays pinned to the commit seen here.
            worker_root = pinned_root(self.root, source.identity(INFO_PATH))
        # 3. What every worker receives, then what the dataset is and where it starts.
        self.config = WorkerConfig(
            meta=self.meta, frame_counts=dict(zip(self.episodes, self._frames, strict=True)),
            windows=windows, tolerance_s=self.tolerance_s,
            dtype=torch.uint8 if return_uint8 else torch.float32,
            image_transforms=image_transforms, root=worker_root, video_index=self.video_index,
            decode_threads=decode_threads, prefetch_episodes=prefetch_episodes,
            group=batch_size if batched else decoded_queue_size, batched=batched,
            pool_size=episode_pool_size, pool_ramp=episode_pool_ramp,
            decoder_cache=video_decoder_cache_size,
            # The rank's byte budget; None without cameras (nothing to reserve).
            byte_budget=int(byte_budget_gb * GIB) if self.meta.camera_keys else None)
        # What the dataset is, in LeRobotDataset's names (the selected episodes, every rank).
        self.fps, self.features = self.meta.fps, self.meta.features
        self.camera_keys = self.meta.camera_keys
        self.num_episodes, self.num_frames = len(self.episodes), sum(self._frames)
        self.rank_frames = sum(self.config.frame_counts[e] for e in ranks[self.rank])
        self._most_workers = min(map(len, ranks))  # SPEC §2.2, Idle workers
        # The position (see _EPOCH…). set_epoch and load_state_dict keep the earlier topologies
        # of a resume and what they delivered (workers get them).
        self._position = torch.zeros(6, dtype=torch.int64).share_memory_()
        self._resumes_into: int | None = None  # the epoch a loaded checkpoint continues
        self._iterators = 0  # started in this process (see _enter)
        self.set_epoch(0)
        if num_workers and num_workers > self._most_workers:
            _warn_idle(num_workers, self._most_workers)

    def __len__(self) -> int:
        """What an epoch of this rank yields: batches with ``batched``, else samples, or batches ×
        ``batch_size`` with ``batch_size`` and no ``repeat``; batches need ``num_workers``."""
        if not self.batched and (self.repeat or not self.batch_size):
            return self.rank_frames
        if self.num_workers is None:
            raise IterableOnly("len() counts batches, which depend on the DataLoader's worker "
                               "count (each one's last may be short): give num_workers=N")
        course = self._course(self._setup(self.batch_size, max(1, self.num_workers)),
                              resume.Delivered(0))
        stops = course.positions(self.rank, 0).stops
        if self.repeat:  # endless: an epoch is every frame of each worker's share
            stops = [sum(self.config.frame_counts[e] for e in course.episodes_from(self.rank, w, 0))
                     for w in range(course.setup.num_workers)]
        batches = sum(shard.ceil_div(stop, self.batch_size) for stop in stops)
        return batches if self.batched else batches * self.batch_size

    def __getitem__(self, index):
        raise IterableOnly(f"StreamingDataset is an iterable dataset, it has no item {index!r}: "
                           "iterate it (a DataLoader, or iter(dataset)) instead")

    def selection_stats(self) -> dict:
        """The selected episodes' own statistics, combined as LeRobot combines them (SPEC §4.7)."""
        with contextlib.closing(open_source(self.config.root)) as source:
            return selection_stats(source, self.meta, self.episodes)

    # --- position: epochs and resume ----------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """Start the next iterator at the beginning of ``epoch`` (SPEC §9.4)."""
        errors.check_int(epoch, "epoch", 0)
        if epoch == self._resumes_into and not int(self._position[_PASS]):
            return
        self._history, self._delivered, self._resumes_into = (), None, None
        self._set_position(epoch, 0, 0)

    def _set_position(self, epoch: int, samples: int, num_workers: int) -> None:
        seed = self.seed - (1 << 64) if self.seed >= 1 << 63 else self.seed  # int64 bits
        self._position.copy_(torch.tensor([epoch, samples, num_workers, seed,
                                           _digest(self._history), 0]))

    def state_dict(self, samples: int, *, batch_size: int, num_workers: int) -> dict:
        """A checkpoint after the rank consumed ``samples`` since the position was set (§9.4)."""
        epoch = int(self._position[_EPOCH])
        course, base = self._start(batch_size, max(1, num_workers))
        start = course.positions(self.rank, base)
        end = course.positions(self.rank, base + samples)  # ResumeError: not whole batches
        started = max(1, int(self._position[_PASS]) & _LOW)  # iterators since the position
        past = (end.epochs[0] - start.epochs[0], any(end.offsets)) > (started, False)
        if past and not self.repeat:
            raise UsageError(
                f"state_dict(samples={samples}): this rank cannot have yielded that many since "
                f"its position was set (epoch {epoch}, sample {base}): the {started} iterator(s) "
                f"started since end with epoch {start.epochs[0] + started - 1}. samples counts "
                "what was consumed since construction, set_epoch or load_state_dict")
        if not (self.repeat or self._history):  # name the epoch in progress
            epoch = end.epochs[0]
            base = sum(shard.ceil_div(a, batch_size) for a in end.offsets) * batch_size
            samples = 0
        return resume.ResumeState(epoch, base + samples, course.setup, self._history).to_dict()

    def load_state_dict(self, state: Mapping, *, num_workers: int | None = None) -> None:
        """Start every following iterator where ``state`` left off (SPEC §9.4)."""
        if self.batch_size is None:
            raise UsageError("load_state_dict needs the batch size to place every worker: "
                             "build the dataset with batch_size=B")
        parsed = resume.ResumeState.from_dict(dict(state))
        if not self._seed_given:
            self.seed = parsed.setup.seed
        workers = parsed.setup.num_workers if num_workers is None else max(1, num_workers)
        resumed = parsed.resume_with(self._setup(self.batch_size, workers))
        self._history, self._delivered = resumed.history, None
        if resumed.history:
            _, sizes = plan_spans(self.config, self.episodes, MappedIndex(self.video_index))
            self._delivered = resume.delivered_by(resumed, self.episodes, self._frames, sizes)
        self._set_position(resumed.epoch, resumed.samples, workers)
        course, samples = self._start(self.batch_size, workers)
        self._resumes_into = min(course.positions(self.rank, samples).epochs)

    def _start(self, batch_size: int, num_workers: int) -> tuple[resume.Course, int]:
        """The plans from the position on, and the samples of the rank consumed in them."""
        epoch, samples, _, seed, history, _ = (int(v) for v in self._position)
        delivered = self._delivered if history else resume.Delivered(epoch)
        return self._course(self._setup(batch_size, num_workers, seed & MASK64), delivered), samples

    def _course(self, setup: resume.ResumeSetup, delivered: resume.Delivered) -> resume.Course:
        return resume.Course(setup, self.episodes, self._frames, delivered,
                             decoder_cache=self.config.decoder_cache, cameras=len(self.camera_keys))

    def _setup(self, batch_size: int, num_workers: int,
               seed: int | None = None) -> resume.ResumeSetup:
        """The setup of this dataset (``seed``: the position's, in a worker)."""
        if self.batch_size is not None and batch_size != self.batch_size:
            raise TopologyChanged(f"batch size {batch_size} differs from the dataset's "
                                  f"batch_size {self.batch_size}")
        errors.check_int(batch_size, "batch_size", 1)  # state_dict's, without the dataset's
        return resume.ResumeSetup(
            seed=self.seed if seed is None else seed, strategy=self.sampling_strategy,
            pool_size=self.config.pool_size, pool_ramp=self.config.pool_ramp,
            byte_budget=self.config.byte_budget,
            world_size=self.world_size,
            num_workers=min(num_workers, self._most_workers), batch_size=batch_size,
            repeat=self.repeat, selection=resume.selection_digest(self.episodes, self._frames))

    # --- iteration ----------------------------------------------------------------------------

    def __iter__(self) -> Iterator[dict]:
        info = get_worker_info()
        num_workers, worker = (1, 0) if info is None else (info.num_workers, info.id)
        self._check_loader(num_workers, info)
        plan = self._worker_plan(worker, num_workers, later=self._enter(info))
        if plan is None:  # an idle worker: the DataLoader goes on with the others
            return
        limits = plan.course.limits
        with contextlib.closing(WorkerStream(self.config, plan.episodes, limits,
                                             num_workers)) as stream:
            self._check_episode_sizes(plan, stream.byte_sizes)
            yield from stream.stream(plan.runs(stream.byte_sizes), in_worker=info is not None)

    def _check_loader(self, num_workers: int, info) -> None:
        """The DataLoader's worker count against the dataset's and a loaded checkpoint's."""
        _, _, resume_workers, _, history, _ = (int(v) for v in self._position)
        if history and history != _digest(self._history):
            raise UsageError("a checkpoint of another topology was loaded after the persistent "
                             "workers started: load it before the first iter(loader)")
        if resume_workers and resume_workers != num_workers:
            raise TopologyChanged(f"the checkpoint was loaded for {resume_workers} DataLoader "
                                  f"worker(s), this DataLoader has {num_workers}: pass "
                                  f"num_workers={num_workers} to load_state_dict")
        if self.num_workers is not None and max(1, self.num_workers) != num_workers:
            raise UsageError(f"the dataset was made with num_workers={self.num_workers}, the "
                             f"DataLoader with {0 if info is None else num_workers}: give both "
                             "the same count")

    def _worker_plan(self, worker: int, num_workers: int, later: int) -> resume.WorkerPlan | None:
        """What DataLoader worker ``worker`` plays, None if it is idle (``later``: SPEC §9.4)."""
        course, samples = self._start(self.batch_size or 1, num_workers)
        if later and not self.repeat:
            epoch = min(course.positions(self.rank, samples).epochs) + later
            course, samples = self._course(course.setup, resume.Delivered(epoch)), 0
        playing = course.setup.num_workers
        if worker == playing and self.num_workers is None:
            _warn_idle(num_workers, playing)
        return course.worker_plan(self.rank, worker, samples) if worker < playing else None

    def _check_episode_sizes(self, plan: resume.WorkerPlan, byte_sizes: dict[int, int]) -> None:
        """EpisodeTooLarge, saying what to change, when an episode exceeds a worker's budget."""
        budget, workers = plan.course.limits.byte_budget, plan.course.setup.num_workers
        if budget is None:
            return
        episode = max(byte_sizes, key=byte_sizes.get)
        need = byte_sizes[episode]
        check_episode_size(episode, need, budget, (
            f": each of the {workers} DataLoader worker(s) gets byte_budget_gb="
            f"{self.config.byte_budget / GIB:.4g} / {workers} = {budget:,} bytes; raise "
            f"byte_budget_gb to at least {need * workers / GIB:.4g} or use fewer workers"))

    def _enter(self, info) -> int:
        """How many iterators started before this one since the position was set."""
        self._iterators += 1
        # Every worker of one DataLoader iterator computes the same key (from the iterator's base
        # seed and, for persistent workers, their own iterator count); the first to arrive counts
        # the iterator.
        base = os.getpid() if info is None else info.seed - info.id
        key = hash((base, self._iterators)) % (1 << 30) + 1  # never 0, the word's initial key
        word = int(self._position[_PASS])
        if word >> 32 == key:  # another worker of this iterator counted it
            return (word & _LOW) - 1
        self._position[_PASS] = key << 32 | (word & _LOW) + 1
        return word & _LOW


# --- helpers ----------------------------------------------------------------------------------


def _digest(history: tuple[resume.Segment, ...]) -> int:
    """A positive 62-bit digest of a resume history; 0 for none."""
    if not history:
        return 0
    text = repr([tuple(vars(segment).values()) for segment in history]).encode("ascii")
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "little") >> 2 | 1


def _warn_idle(num_workers: int, playing: int) -> None:
    warnings.warn(f"{num_workers} DataLoader workers, but a rank has only {playing} episodes: "
                  f"workers {playing} to {num_workers - 1} stay idle (num_workers={playing} "
                  "gives the same batches)", stacklevel=3)


def _resolve_rank(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """Arguments, else as SPEC §9.5 says; UsageError unless the rank is in the world."""
    if rank is None or world_size is None:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            found = torch.distributed.get_rank(), torch.distributed.get_world_size()
        else:
            found = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        rank = found[0] if rank is None else rank
        world_size = found[1] if world_size is None else world_size
    shard.check_rank(rank, world_size)
    return rank, world_size


def _video_index(source, meta: DatasetMeta, lock_timeout_s: float) -> VideoIndex | None:
    """The video index (SPEC §10.6), every frame rate checked (§9.2); None without cameras."""
    if not meta.camera_keys:
        return None
    def check(relpath: str, samples: SampleIndex) -> None:
        check_frame_rate(samples.pts, samples.timescale, meta.fps, relpath)

    return ensure_index(source, meta.video_files(), lock_timeout_s=lock_timeout_s, check=check)
