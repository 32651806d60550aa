"""One DataLoader worker's stream: its share's samples, or ready batches, in planner order
(SPEC §9.2, §9.3). ``StreamingDataset`` runs, in each worker::

    with contextlib.closing(WorkerStream(config, share, limits, workers)) as worker:  # plans
        yield from worker.stream(runs, in_worker=True)

``config`` is made once in the main process and pickled to the workers. A ready :class:`Batch`'s
camera tensors are views of one storage in shared memory: the training process receives it as
one handle (each handle costs both processes a connection), and the worker writes it again once
that process dropped every view. That process keeps the storages it received mapped until their
worker ended or replaced them (``_keep_mapped``). :class:`SharedBuffers` allocates it with
torch's private ``UntypedStorage._new_shared``, as ``default_collate`` does: the public
``share_memory_()`` copies a new tensor there, about 3.5 times as slow (65 ms more for a 73 MiB
buffer). If torch renames it, every test of ready batches (``tests/test_batches.py``) fails.
"""

from __future__ import annotations

import itertools
import math
import os
import threading
import weakref
from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from queue import SimpleQueue

import numpy as np
import torch
from torch.utils.data import default_collate

from refstream import shard, sidecar, synth
from refstream.budget import ByteBudget
from refstream.decode import DecoderCache
from refstream.errors import FetchError
from refstream.meta import DatasetMeta, column_array
from refstream.mp4 import SampleIndex
from refstream.planner import Planner
from refstream.roots import open_source
from refstream.sidecar import MappedIndex, VideoIndex
from refstream.tables import Footers, read_episode_rows
from refstream.windows import window_rows

__all__ = ["WorkerConfig", "WorkerStream", "Batch", "SharedBuffers", "plan_spans", "decode_threads",
           "hf_to_torch"]

# Fetch threads per worker: Parquet and range reads of the pool and frontier episodes. Small:
# each episode is one task, and a worker's share of a 2-core machine is small.
MAX_FETCH_THREADS = 4
# Shared storages (a group's camera tensors each) a worker keeps for reuse; past this many (a
# consumer holding hundreds of batches) a batch gets memory that is not used again.
MAX_SHARED_BUFFERS = 1024
# Tensors up to this size travel inside a batch's pickle, the rest as shared memory: for the
# small ones (indices, actions, masks) that is cheaper than a file and a descriptor each.
INLINE_BYTES = 1 << 20
# Decode threads a worker runs at most when not told (see decode_threads).
MAX_DEFAULT_DECODE_THREADS = 2
# What WorkerStream._anchors yields where the anchors it gave so far must be decoded first.
DECODE_FIRST = None


@dataclass(frozen=True)
class WorkerConfig:
    """What a worker reads of the dataset: its selection, sample layout and settings."""

    meta: DatasetMeta
    frame_counts: Mapping[int, int]  # selected episode -> its frame count
    windows: Mapping[str, np.ndarray]  # key -> frame offsets of its window (refstream.windows)
    tolerance_s: float
    dtype: torch.dtype  # of camera tensors
    image_transforms: Callable | None
    root: str  # opened by each worker: a Hub branch pinned to the commit the metadata came from
    video_index: VideoIndex | None  # None without cameras
    decode_threads: int | None  # None: decode_threads' default
    prefetch_episodes: int
    group: int  # samples made and decoded together: a batch when batched
    batched: bool
    pool_size: int | None  # per worker; the two below per rank (SPEC §2.3)
    pool_ramp: int
    byte_budget: int | None
    decoder_cache: int | None


@dataclass(frozen=True)
class _Video:
    """One camera's synthesized episode video."""

    mp4: bytes
    start_pts: int  # source ticks of the mini-MP4's local time 0 (the span's start_pts)
    serving_pts: np.ndarray  # int64 source ticks of the frame serving each row's time
    stsd: bytes  # the source's sample description: videos with the same one share a decoder
    keyframes: np.ndarray  # source ticks of the span's keyframes
    demand: dict[int, int]  # source ticks -> requests of the episode's anchors not yet decoded


@dataclass
class _Group:
    """Samples made together: their values, frame requests not yet decoded, frames' tensors."""

    frames: dict[str, torch.Tensor]  # camera -> (size, T, 3, H, W)
    storage: torch.UntypedStorage | None  # shared, that the frames view (see SharedBuffers)
    anchors: list[tuple[int, int]] = field(default_factory=list)
    values: dict[str, list] = field(default_factory=lambda: defaultdict(list))  # key -> values
    requests: list[tuple] = field(default_factory=list)  # (slot, episode, camera, video, pts)
    done: int = 0  # anchors gathered and decoded


class Batch(dict):
    """A ready batch (SPEC §9.2). Pickled in a worker, it carries its small tensors inside and
    its camera tensors as one handle to the shared storage they view (:class:`SharedBuffers`),
    whose in-use flag the receiver clears once it dropped every view."""

    __slots__ = ("storage", "owner")

    def __init__(self, values=(), storage: torch.UntypedStorage | None = None,
                 owner: tuple[int, int] | None = None) -> None:  # owner: SharedBuffers.owner
        super().__init__(values)
        self.storage, self.owner = storage, owner

    def __copy__(self) -> Batch:  # the DataLoader's default_convert and pin_memory copy it
        return Batch(self, self.storage, self.owner)

    def __reduce__(self):
        values, views, dtype = {}, {}, None  # views: key -> (offset, size, stride) of a view
        address = None if self.storage is None else self.storage.data_ptr()
        for key, value in self.items():
            if isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr() == address:
                views[key] = (value.storage_offset(), value.shape, value.stride())
                value, dtype = None, value.dtype  # None: its place in the key order
            elif isinstance(value, torch.Tensor) and value.nbytes <= INLINE_BYTES:
                value = value.numpy()
            values[key] = value
        return _received, (values, self.storage, dtype, views, self.owner)


def _received(values: dict, storage: torch.UntypedStorage | None, dtype: torch.dtype | None,
              views: dict, owner: tuple[int, int] | None = None) -> Batch:
    """A batch where it is used: its views of ``storage`` clear its in-use flag once dropped."""
    values = {key: torch.from_numpy(value) if isinstance(value, np.ndarray) else value
              for key, value in values.items()}
    if views:
        if owner is not None and owner[0] != os.getpid() and os.name == "posix":
            _keep_mapped(owner, storage)
        # Every view holds the one array, so the flag clears when the last view is dropped.
        pixels, flag = SharedBuffers.arrays(storage, dtype)
        weakref.finalize(pixels, _released, flag).atexit = False
        whole = torch.from_numpy(pixels)
        for key, (offset, size, stride) in views.items():
            values[key] = whole.as_strided(size, stride, offset)
    return Batch(values)


# Storages of ready batches received from other processes, by owner (SharedBuffers.owner). A
# worker sends each of its storages again and again, and torch maps a storage it receives anew
# unless this process still holds one of the same file: mapping and unmapping cost about as much
# CPU as reading the batch (a 177 MB float32 batch: 44 ms to read, 23 ms when kept mapped).
# Dropped once their owner was replaced or its process ended: seen when a batch arrives or one
# is dropped (as when a loop moves on from an epoch's last batch).
_mapped: dict[tuple[int, int], dict[int, torch.UntypedStorage]] = {}
# Pin-memory threads receive batches too; re-entrant, as a drop may run inside _keep_mapped.
_mapped_lock = threading.RLock()


def _released(flag: np.ndarray) -> None:
    """The last view of a received batch was dropped: its storage is free, and owners that
    ended are let go."""
    flag[0] = 0
    _let_go()


def _keep_mapped(owner: tuple[int, int], storage: torch.UntypedStorage) -> None:
    """Keep ``storage`` of ``owner`` mapped, letting go of the owners that ended or it replaced."""
    with _mapped_lock:
        _let_go(owner)
        kept = _mapped.setdefault(owner, {})
        if len(kept) < MAX_SHARED_BUFFERS:  # as many as the owner reuses
            kept[storage.data_ptr()] = storage


def _let_go(current: tuple[int, int] | None = None) -> None:
    """Drop the storages of owners whose process ended, or that ``current`` replaced (an owner
    of the same process: its buffers of a later epoch)."""
    with _mapped_lock:
        for owner in list(_mapped):
            replaced = current is not None and owner[0] == current[0] and owner != current
            if replaced or (owner != current and not _alive(owner[0])):
                _mapped.pop(owner, None)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # no signal: whether the process exists (POSIX)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


class SharedBuffers:
    """A worker's groups of camera tensors in shared memory: a group's tensors are views of one
    storage, whose last byte is its in-use flag (set by take, cleared where the batch is used)."""

    def __init__(self) -> None:
        self._buffers: list[tuple[tuple, torch.UntypedStorage, dict, np.ndarray]] = []
        # Whose storages a batch carries: this process, and these buffers in it.
        self.owner = (os.getpid(), int.from_bytes(os.urandom(8), "little"))

    def take(self, shapes: Mapping[str, tuple[int, ...]], dtype: torch.dtype
             ) -> tuple[dict[str, torch.Tensor], torch.UntypedStorage]:
        """Free tensors of ``shapes`` (key -> shape), views of one storage, marked in use."""
        layout = (tuple(shapes.items()), dtype)
        free = next((b for b in self._buffers if b[0] == layout and not b[3][0]), None)
        if free is None:
            sizes = [math.prod(shape) for shape in shapes.values()]
            storage = torch.UntypedStorage._new_shared(sum(sizes) * dtype.itemsize + 1)
            parts = torch.empty(0, dtype=dtype).set_(storage, 0, (sum(sizes),)).split(sizes)
            free = (layout, storage, {key: part.view(shape) for key, part, shape
                                      in zip(shapes, parts, shapes.values(), strict=True)},
                    self.arrays(storage, dtype)[1])
            if len(self._buffers) < MAX_SHARED_BUFFERS:
                self._buffers.append(free)
        _, storage, tensors, flag = free
        flag[0] = 1
        return tensors, storage

    @staticmethod
    def arrays(storage: torch.UntypedStorage, dtype: torch.dtype) -> tuple[np.ndarray, np.ndarray]:
        """A storage's values before its flag (1-D, ``dtype``) and its flag, as arrays."""
        count = (storage.nbytes() - 1) // dtype.itemsize
        pixels = torch.empty(0, dtype=dtype).set_(storage, 0, (count,)).numpy()
        flag = torch.empty(0, dtype=torch.uint8).set_(storage, storage.nbytes() - 1, (1,))
        return pixels, flag.numpy()


def plan_spans(config: WorkerConfig, episodes: Sequence[int],
               index: Mapping[str, SampleIndex]) -> tuple[dict[int, dict], dict[int, int]]:
    """Each episode's spans (camera -> (index, span)) at its nominal request times, and its
    exact byte size (SPEC §9.2); ``index`` maps a video relpath to its sample index."""
    return synth.nominal_spans(config.meta, episodes, index, config.tolerance_s)


def decode_threads(configured: int | None, workers: int) -> int:
    """A worker's decode threads, the yielding one included: ``configured``, else the CPUs this
    process may use shared among the DataLoader's ``workers`` (1: the training process alone),
    1 to MAX_DEFAULT_DECODE_THREADS each. Measured on 2 CPUs (ready batches of 32): one decoding
    process delivers 11-18% more samples/s with 2 threads than with 1, as PyAV releases the GIL
    while it decodes; 2 workers deliver about 22% more with 1 thread each than with 2, which
    contend for the CPUs."""
    if configured is not None:
        return configured
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(MAX_DEFAULT_DECODE_THREADS, (cpus or 1) // workers))


class WorkerStream:
    """One worker's resources and its streaming loop (runs in the worker process)."""

    def __init__(self, config: WorkerConfig, share: list[int], limits: shard.WorkerLimits,
                 workers: int = 1) -> None:  # workers: the DataLoader's (1: none)
        self.config, self.meta = config, config.meta
        self.cameras, self.columns = list(self.meta.camera_keys), list(self.meta.parquet_keys)
        self.windows = config.windows
        # A sample's keys in the order of LeRobot's items: cameras, columns, pad masks, task.
        self.keys = [*self.cameras, *self.columns, *(f"{key}_is_pad" for key in self.windows),
                     "task"]
        # Planned first, so a failure leaves nothing to close. Without cameras an episode weighs
        # nothing, and one path reserves, fetches and frees.
        self.spans, self.byte_sizes = plan_spans(config, share, MappedIndex(config.video_index))
        self.frame_sizes = {camera: (index.height, index.width)  # checked by every decode
                            for camera, (index, _) in self.spans[share[0]].items()}
        self.source = open_source(config.root)
        self.footers = Footers()
        threads = decode_threads(config.decode_threads, workers)  # each with its own decoders
        self.decoders = [DecoderCache(max(1, shard.ceil_div(limits.decoder_cache, threads)))
                         for _ in range(threads)]
        self.fetch_pool = ThreadPoolExecutor(  # threads start when used
            max(1, min(MAX_FETCH_THREADS, limits.pool_size + config.prefetch_episodes)),
            thread_name_prefix="refstream-fetch")
        self.decode_pool = ThreadPoolExecutor(max(1, threads - 1),
                                              thread_name_prefix="refstream-decode")
        self.budget, self.buffers = ByteBudget(limits.byte_budget or 1), SharedBuffers()
        self.payloads: dict[int, Future[tuple[dict, dict[str, _Video]]]] = {}  # see _fetch
        self.in_flight: dict[int, int] = {}  # episode -> anchors taken, not yet decoded
        self.drained: set[int] = set()  # drained by the planner, anchors still in flight
        if self.cameras:  # payloads must come from the files as indexed (else PayloadChanged)
            sidecar.pin_identities(self.source, config.video_index.records)

    # --- the loop -----------------------------------------------------------------------------

    def stream(self, runs: Iterator[tuple[Planner, int, int | None]],
               in_worker: bool) -> Iterator[dict]:
        """The runs' samples, or Batches of ``config.group`` (``in_worker``: to be pickled)."""
        group, batched = self.config.group, self.config.batched
        shared = batched and self.config.image_transforms is None
        made = self._group(group, shared)
        for planner, offset, stop in runs:
            for anchor in self._anchors(planner, offset, stop):
                if anchor is not DECODE_FIRST:
                    made.anchors.append(anchor)
                    if len(made.anchors) < group:
                        continue
                self._decode(made, planner)
                if len(made.anchors) == group:
                    yield from self._emit(made, batched, in_worker)
                    made = self._group(group, shared)
        if made.anchors:  # decoded at the last run's end
            yield from self._emit(made, batched, in_worker)

    def _group(self, size: int, shared: bool) -> _Group:
        """An empty group whose frames go to new tensors, or reused shared ones."""
        shapes = {camera: (size, len(self.windows.get(camera, [0])), 3, height, width)
                  for camera, (height, width) in self.frame_sizes.items()}
        if shared and shapes:
            return _Group(*self.buffers.take(shapes, self.config.dtype))
        return _Group({camera: torch.empty(shape, dtype=self.config.dtype)
                       for camera, shape in shapes.items()}, None)

    def _anchors(self, planner: Planner, offset: int, stop: int | None) -> Iterator[tuple | None]:
        """The run's anchors in order, each after its episode's admission, and DECODE_FIRST while
        an admission waits for the room the anchors given so far free, and at the run's end."""
        planner.skip(offset)
        planner.drain_events()
        anchors = planner.remaining if stop is None else max(0, stop - offset)
        to_admit = deque(planner.resident)
        for _ in range(anchors):
            while to_admit:
                while not self._admit(to_admit[0], wait=not any(self.in_flight.values())):
                    yield DECODE_FIRST
                to_admit.popleft()
            episode, frame = next(planner)
            admitted, drained = planner.drain_events()
            to_admit.extend(admitted)
            self.drained.update(drained)
            self.in_flight[episode] = self.in_flight.get(episode, 0) + 1
            self._start_fetch(episode, planner, (frame,))  # in the order anchors need them
            yield episode, frame
        yield DECODE_FIRST  # the next run admits the same episodes again

    def _decode(self, made: _Group, planner: Planner) -> None:
        """Decode the group's new anchors; free the episodes they finish; fetch and prefetch."""
        # Decoders keep frames for later anchors in the bytes not reserved (SPEC §9.3).
        room = max(0, self.budget.budget_bytes - self.budget.reserved_bytes)
        for decoders in self.decoders:
            decoders.fit(room // len(self.decoders))
        queues = [SimpleQueue() for _ in self.decoders]  # of lists of requests, then None
        futures = [self.decode_pool.submit(self._decode_part, made, t, iter(queues[t].get, None))
                   for t in range(1, len(queues))]
        try:
            for slot, (episode, _) in enumerate(made.anchors[made.done:], made.done):
                if not self.payloads[episode].done():
                    self._hand_out(made, queues)
                self._gather(made, slot)
                self.in_flight[episode] -= 1
            self._hand_out(made, queues)
        finally:
            for queue in queues[1:]:
                queue.put(None)
        for future in futures:  # after this thread's error, as when it decoded its part first
            future.result()
        made.done = len(made.anchors)
        # Drained, its last anchor decoded: free its bytes and decoders.
        for episode in [e for e in self.drained if not self.in_flight.get(e)]:
            self._discard(episode)
            self.drained.discard(episode)
            self.budget.release(episode)
            self.budget.forget(episode)
        self._prefetch(planner)  # after the decode, so the first group waits for no prefetch

    def _gather(self, made: _Group, slot: int) -> None:
        """The row values, pad masks, task and frame requests of one anchor."""
        episode, frame = made.anchors[slot]
        columns, videos = self.payloads[episode].result()
        for key in self.columns + self.cameras:
            rows = frame
            if key in self.windows:
                rows, pad = window_rows(self.windows[key], frame, self.config.frame_counts[episode])
                made.values[f"{key}_is_pad"].append(pad)
            if key in columns:
                made.values[key].append(columns[key][rows])
            else:
                pts = videos[key].serving_pts[np.atleast_1d(rows)]
                made.requests.append((slot, episode, key, videos[key], pts))
        made.values["task"].append(self.meta.tasks[int(columns["task_index"][frame])])

    def _hand_out(self, made: _Group, queues: list[SimpleQueue]) -> None:
        """Give the requests gathered to the threads of their decoders (this one's decoded now)."""
        parts = [[] for _ in queues]
        for request in made.requests:  # (slot, episode, camera, video, pts)
            parts[(request[1] + self.cameras.index(request[2])) % len(parts)].append(request)
        made.requests.clear()
        for queue, part in zip(queues[1:], parts[1:], strict=True):
            queue.put(part)
        self._decode_part(made, 0, parts[:1])

    def _decode_part(self, made: _Group, thread: int, parts: Iterable[list[tuple]]) -> None:
        """Decode the group's requests of ``parts``, all going to the decoders of ``thread``."""
        decoders = self.decoders[thread]
        pixels = {camera: frames.numpy() for camera, frames in made.frames.items()}  # views
        for slot, episode, camera, video, pts in itertools.chain.from_iterable(parts):
            decoder = decoders.decoder((episode, camera), video.mp4, video.start_pts,
                                       video.stsd, video.keyframes, video.demand)
            decoder.frames(pts, out=pixels[camera][slot], room=decoders.room())

    def _emit(self, made: _Group, batched: bool, in_worker: bool) -> Iterator[dict]:
        """The group's samples, or its Batch, image transforms applied in sample order."""
        count = len(made.anchors)
        values = {key: hf_to_torch(np.stack(v)) for key, v in made.values.items()}
        for camera, frames in made.frames.items():  # one-frame windows: LeRobot's squeeze(0)
            values[camera] = frames[:count] if camera in self.windows else frames[:count, 0]
        if self.config.image_transforms is not None:
            for camera in self.cameras:
                values[camera] = list(values[camera])
            for i, camera in itertools.product(range(count), self.cameras):  # LeRobot's call order
                values[camera][i] = self.config.image_transforms(values[camera][i])
        if not batched:
            for i in range(count):
                yield {key: values[key][i] for key in self.keys}
            return
        batch = {key: values[key] if isinstance(values[key], torch.Tensor)
                 else default_collate(values[key]) for key in self.keys}
        batch = Batch(batch, made.storage, self.buffers.owner)
        yield batch if in_worker else _received(*batch.__reduce__()[1])  # as if it crossed

    # --- admission, prefetch and release ------------------------------------------------------

    def _admit(self, episode: int, wait: bool) -> bool:
        """Reserve ``episode`` (fetched when needed); False if it must wait (only if not wait)."""
        admitted = self.budget.acquire(episode, self.byte_sizes[episode],
                                       timeout_s=None if wait else 0)
        for evicted in self.budget.take_evicted():  # none when it must wait
            self._discard(evicted)
        return admitted

    def _prefetch(self, planner: Planner) -> None:
        """Reserve and fetch the residents no anchor asked for yet, then frontier episodes, while
        they fit without evicting (SPEC §9.3): a prefetch never takes a resident's room."""
        frontier, residents = planner.frontier(self.config.prefetch_episodes), planner.resident
        for episode in [*residents, *frontier]:  # one reserved already passes
            if not self.budget.reserve_in_room(episode, self.byte_sizes[episode]):
                break  # full: keep the order, retry after the next release
            self._start_fetch(episode, planner)
        # An admission that must evict drops the least recently used prefetch: touched from the
        # frontier's far end, that is the one needed last; the residents' are needed first.
        self.budget.touch([*reversed(frontier), *residents])

    def _start_fetch(self, episode: int, planner: Planner, drawn: tuple[int, ...] = ()) -> None:
        """Fetch ``episode`` for its anchors ``drawn`` and to come, once per reservation."""
        if self.budget.claim_fetch(episode):
            anchors = np.array([*drawn, *planner.frames_to_come(episode)], dtype=np.int64)
            self.payloads[episode] = self.fetch_pool.submit(self._fetch, episode, anchors)

    def _discard(self, episode: int) -> None:
        self.payloads.pop(episode, None)
        for decoders, camera in itertools.product(self.decoders, self.cameras):
            decoders.discard((episode, camera))

    # --- fetch threads ------------------------------------------------------------------------

    def _fetch(self, episode: int, anchors: np.ndarray
               ) -> tuple[dict[str, np.ndarray], dict[str, _Video]]:
        """An episode's rows (column -> a value per frame) and videos for ``anchors`` to come."""
        try:
            relpath = self.meta.data_relpath(episode)
            table = read_episode_rows(
                self.source, relpath, episode, self.config.frame_counts[episode], self.columns,
                self.footers, first_index=int(self.meta.from_index[self.meta.row(episode)]))
            rows = {name: column_array(table[name], f"{relpath}: episode {episode}", name)
                    for name in self.columns}
            videos = self._videos(episode, rows["timestamp"], anchors) if self.cameras else {}
            return rows, videos
        except FetchError as exc:
            # The source names the URL and byte range; only here is the episode known.
            raise type(exc)(f"episode {episode}: {exc}") from exc
        finally:
            self.budget.mark_fetched(episode)

    def _videos(self, episode: int, timestamps: np.ndarray,
                anchors: np.ndarray) -> dict[str, _Video]:
        """Each camera's mini-MP4 and the frame serving each row, from the planned spans."""
        spans = self.spans[episode]
        chosen = synth.serving_pts(self.meta, episode, spans, self.config.tolerance_s, timestamps)
        videos = {}
        for camera, (sample_index, span) in spans.items():
            payload = self.source.read_range(self.meta.video_relpath(episode, camera),
                                             span.byte_offset, span.byte_length)
            mp4 = synth.synthesize(sample_index, span, payload)
            self.budget.mark_resident(episode, len(mp4))
            samples = slice(span.sample_lo, span.sample_hi + 1)
            keyframes = sample_index.pts[samples][sample_index.keyframe[samples]].astype(np.int64)
            requested = window_rows(self.windows.get(camera, [0]), anchors, len(timestamps))[0]
            served, counts = np.unique(chosen[camera][requested], return_counts=True)
            videos[camera] = _Video(mp4, span.start_pts, chosen[camera], sample_index.stsd,
                                    keyframes,
                                    dict(zip(served.tolist(), counts.tolist(), strict=True)))
        return videos

    def close(self) -> None:
        self.budget.close()
        for pool in (self.fetch_pool, self.decode_pool):
            pool.shutdown(wait=True, cancel_futures=True)
        self.payloads.clear()
        for decoders in self.decoders:
            decoders.close()
        self.source.close()


def hf_to_torch(values: np.ndarray) -> torch.Tensor | object:
    """What LeRobot's ``hf_transform_to_torch`` makes of row values (SPEC §9.1, ``V``)."""
    array = np.asarray(values)
    dtype = {"f": np.float32, "i": np.int64, "u": np.int64, "b": np.bool_}.get(array.dtype.kind)
    return array.tolist() if dtype is None else torch.from_numpy(array.astype(dtype))
