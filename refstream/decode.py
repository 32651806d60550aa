"""Decode frames of an episode's mini-MP4, held in memory, at exact presentation times.

The only module that imports PyAV. Two pieces:

``EpisodeDecoder(mp4_bytes, label)``
    One open PyAV container over the bytes of a synthesized episode video (or any MP4 held in
    memory). ``frames_at(local_times_s, tolerance_s, dtype)`` returns the frames presented at the
    requested times, which are *local* seconds: the episode video's presentation timeline, on which
    the span's first presented frame is at 0 (``synth`` writes an edit list that puts it there, and
    FFmpeg reports timestamps after the edit list). Requests may repeat and come in any order.
    ``decoded_frames`` counts the frames the decoder has produced (decode amplification).

``DecoderCache(capacity)``
    A bounded LRU of open decoders keyed ``(episode, camera)``, safe to share between threads:
    ``frames_at(key, mp4_bytes, local_times_s, tolerance_s, dtype)`` opens the key's decoder on
    first use (``mp4_bytes`` may be a callable so the bytes are only produced when needed) and
    decodes under that decoder's own lock; ``discard(key)`` closes one; ``close()`` closes all;
    ``decoded_frames`` sums the frames decoded by every decoder it opened.

Output: arrays of shape ``(T, 3, H, W)`` (RGB, channels first, request order) — the layout
LeRobot's map-style items use for cameras — of ``dtype`` ``uint8`` (the RGB values) or
``float32`` (value / 255, rounded once as float32, as LeRobot's ``float32(frames) / 255``).
The RGB values are FFmpeg's ``rgb24`` conversion of the decoded picture, the same as PyAV's
``frame.to_ndarray(format="rgb24")``; each decoder keeps one single-threaded converter (building
and freeing a converter per frame, with its thread pool, cost 4x the conversion itself).

Selection rule (normative: spec §9.8; ``select_frames`` is step 2 alone), ``tb`` the time base:

1. Decode every frame whose pts lies in ``[floor((min(t) − tol) / tb), ceil((max(t) + tol) / tb)]``:
   seek backward to the keyframe at or before the window start, then decode forward in
   presentation order until a frame lies past the window end. FFmpeg seeks by decode time, so with
   B-frames (or the leading pictures of an open GOP) the first frame decoded after the seek can
   lie past the window start; then seek further back — one frame duration, then doubling — and
   once the target is at or before the stream's first presentation time, decode from the first
   sample instead.
2. For each request ``t`` choose the decoded frame minimising ``|pts·tb − t|``, compared exactly
   (``select_frames``; ties: the earlier pts). If that distance exceeds ``tolerance_s``, raise
   ``FrameNotFound`` naming the label (the episode and camera) and the time — never a nearest
   guess beyond tolerance.

Each call is served by one seek (a few more only in the B-frame case above) and one forward
decode, converting to RGB only the frames chosen; decoding is not resumed across calls.
PyAV errors become ``DecodeError`` with the PyAV exception as cause.
"""

from __future__ import annotations

import io
import math
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from fractions import Fraction

import av
import numpy as np
from av.video.reformatter import VideoReformatter

from refstream.errors import DecodeError, FrameNotFound, UsageError

__all__ = [
    "EpisodeDecoder",
    "DecoderCache",
    "default_decoder_capacity",
    "select_frames",
    "PIXEL_DTYPES",
]


PIXEL_DTYPES = (np.dtype(np.uint8), np.dtype(np.float32))


class EpisodeDecoder:
    """A PyAV decoder over one MP4 held in memory; frames by presentation time (see module doc)."""

    def __init__(self, mp4_bytes: bytes, label: str = "episode video") -> None:
        self.label = label
        self._bytes = mp4_bytes
        self._container = self._open()
        self._converter = VideoReformatter()
        self.decoded_frames = 0
        stream = self._container.streams.video[0]
        self.time_base: Fraction = stream.time_base
        self.width: int = stream.codec_context.width
        self.height: int = stream.codec_context.height
        rate = stream.average_rate  # frames per second, None if unknown
        self._frame_ticks = max(1, round(1 / (rate * self.time_base))) if rate else 1

    def _open(self):
        try:
            container = av.open(io.BytesIO(self._bytes), "r")
        except av.FFmpegError as exc:
            raise DecodeError(f"{self.label}: PyAV cannot open the video: {exc}") from exc
        if not container.streams.video:
            container.close()
            raise DecodeError(f"{self.label}: the video holds no video stream")
        # One decoding thread: a request decodes a handful of frames, the loader's parallelism
        # is its workers and decode threads, and FFmpeg's own threads cost their start-up on
        # every open and contend for the same cores (single-threaded dav1d was ~1.7x faster
        # per frame at 320x240 on the 2-core bench machine).
        container.streams.video[0].thread_count = 1
        return container

    def close(self) -> None:
        self._container.close()

    def __enter__(self) -> EpisodeDecoder:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def frames_at(
        self, local_times_s: Sequence[float] | np.ndarray, tolerance_s: float,
        dtype: np.dtype | type = np.uint8,
    ) -> np.ndarray:
        """``(T, 3, H, W)`` frames presented at ``local_times_s`` (seconds, request order), as
        ``uint8`` RGB or ``float32`` RGB / 255 (module docstring)."""
        times_s = np.asarray(local_times_s, dtype=np.float64).reshape(-1)
        if not (tolerance_s >= 0 and np.all(np.isfinite(times_s))):
            raise UsageError(f"{self.label}: times must be finite and tolerance_s >= 0")
        if np.dtype(dtype) not in PIXEL_DTYPES:
            raise UsageError(f"{self.label}: frames come as uint8 or float32, not {dtype}")
        if times_s.size == 0:
            return np.empty((0, 3, self.height, self.width), dtype)
        # Exact rational arithmetic, so the window never loses a frame to rounding.
        tolerance = Fraction(tolerance_s)
        lo_ticks = math.floor((Fraction(float(times_s.min())) - tolerance) / self.time_base)
        hi_ticks = math.ceil((Fraction(float(times_s.max())) + tolerance) / self.time_base)
        # Where frames are more than 2·tolerance apart, at most one frame lies within tolerance
        # of a time, so a frame before the last one at or before min(t) + tol, or after the first
        # one at or after max(t) - tol, can never be chosen: decode only from the one to the
        # other. (Otherwise the whole window, which is always exact.)
        slack = tolerance if self._frame_ticks * self.time_base > 2 * tolerance else -tolerance
        start_ticks = math.floor((Fraction(float(times_s.min())) + slack) / self.time_base)
        stop_ticks = math.ceil((Fraction(float(times_s.max())) - slack) / self.time_base)
        decoded = self._decode_window(lo_ticks, hi_ticks, start_ticks, stop_ticks)
        pts_ticks = np.array(sorted(decoded), dtype=np.int64)
        chosen = select_frames(pts_ticks, self.time_base, times_s, tolerance_s, self.label)
        # Only the chosen frames are converted to RGB, each once however often it is requested,
        # straight into the output (the assignment casts to float32 where asked).
        out = np.empty((times_s.size, 3, self.height, self.width), dtype)
        first_request: dict[int, int] = {}
        for i, position in enumerate(chosen.tolist()):
            if position in first_request:
                out[i] = out[first_request[position]]
                continue
            first_request[position] = i
            out[i] = self._rgb(decoded[int(pts_ticks[position])]).transpose(2, 0, 1)
        if out.dtype == np.float32:
            np.divide(out, np.float32(255), out=out)  # float32(v) / float32(255), exactly rounded
        return out

    def _rgb(self, frame: av.VideoFrame) -> np.ndarray:
        """``(H, W, 3)`` uint8: FFmpeg's rgb24 conversion, as ``to_ndarray(format="rgb24")``."""
        try:
            return self._converter.reformat(frame, format="rgb24", threads=1).to_ndarray()
        except av.FFmpegError as exc:
            raise DecodeError(f"{self.label}: PyAV cannot convert a frame to RGB: {exc}") from exc

    def _decode_window(self, lo_ticks: int, hi_ticks: int, start_ticks: int,
                       stop_ticks: int) -> dict[int, av.VideoFrame]:
        """Decoded frames with ``lo_ticks <= pts <= hi_ticks``, keyed by pts, from the last
        frame at or before ``start_ticks`` to the first at or after ``stop_ticks``."""
        stream = self._container.streams.video[0]
        first_ticks = stream.start_time  # the earliest presentation time, None if unknown
        # The first step back is one frame: seeks go by decode time, which trails presentation
        # by the reorder depth, a few frames at most.
        frame_ticks = self._frame_ticks
        target_ticks, step_ticks = start_ticks, 0
        try:
            while first_ticks is not None and target_ticks > first_ticks:
                try:
                    self._container.seek(target_ticks, stream=stream, backward=True)
                except av.FFmpegError:
                    break  # e.g. no keyframe before the target: decode from the start instead
                frames, first_pts = self._decode_forward(stream, lo_ticks, hi_ticks,
                                                         start_ticks, stop_ticks)
                if first_pts is None or first_pts <= start_ticks:
                    return frames
                # The seek landed after the window start: step back twice as far as last time.
                step_ticks = 2 * step_ticks + frame_ticks + (first_pts - start_ticks)
                target_ticks = start_ticks - step_ticks
            # Reopening is the one way to start at the first sample whatever the edit list says.
            self._container.close()
            self._container = self._open()
            stream = self._container.streams.video[0]
            return self._decode_forward(stream, lo_ticks, hi_ticks, start_ticks, stop_ticks,
                                        stop_early=False)[0]
        except av.FFmpegError as exc:
            raise DecodeError(f"{self.label}: PyAV failed to decode: {exc}") from exc

    def _decode_forward(self, stream, lo_ticks: int, hi_ticks: int, start_ticks: int,
                        stop_ticks: int, stop_early: bool = True):
        frames: dict[int, av.VideoFrame] = {}
        first_pts = None
        for frame in self._container.decode(stream):
            self.decoded_frames += 1
            if frame.pts is None:
                raise DecodeError(f"{self.label}: a decoded frame has no presentation time")
            if first_pts is None:
                first_pts = frame.pts
                if stop_early and first_pts > start_ticks:
                    break  # the caller seeks further back
            if frame.pts > hi_ticks:
                break  # frames leave the decoder in presentation order
            if frame.pts >= lo_ticks:
                frames[frame.pts] = frame
            if frame.pts >= stop_ticks:
                break  # every later frame is farther from every requested time
        return frames, first_pts


def select_frames(
    pts_ticks: np.ndarray,
    time_base: Fraction,
    times_s: np.ndarray,
    tolerance_s: float,
    label: str = "video",
) -> np.ndarray:
    """Position in ``pts_ticks`` (sorted, distinct, int64) of the frame serving each request.

    The frame minimising ``|pts·time_base − t|``, compared exactly (rationals of the float64
    inputs), ties to the earlier pts; ``FrameNotFound`` if that distance exceeds ``tolerance_s``.
    """
    tolerance = Fraction(tolerance_s)
    # float64 seconds only narrow the search: rounding is far smaller than a frame interval.
    pts_s = pts_ticks * (time_base.numerator / time_base.denominator)
    chosen = np.empty(len(times_s), dtype=np.int64)
    for i, t in enumerate(np.asarray(times_s, dtype=np.float64)):
        at = int(np.searchsorted(pts_s, t))
        near = range(max(0, at - 2), min(len(pts_ticks), at + 2))
        exact_t = Fraction(float(t))
        distances = [(abs(int(pts_ticks[j]) * time_base - exact_t), j) for j in near]
        if not distances:
            raise FrameNotFound(f"{label}: no frame decoded near local time {t!r} s")
        distance, best = min(distances)  # ties: the smaller position, i.e. the earlier pts
        if distance > tolerance:
            raise FrameNotFound(
                f"{label}: no frame within tolerance {tolerance_s} s of local time {t!r} s "
                f"(nearest frame at {float(int(pts_ticks[best]) * time_base)!r} s)"
            )
        chosen[i] = best
    return chosen


def default_decoder_capacity(pool_size: int, cameras: int) -> int:
    """One open decoder per camera of every episode in the pool."""
    return max(1, pool_size * cameras)


@dataclass(eq=False)
class _Entry:
    # The lock lives with the entry, not the cache slot: a thread still decoding on an entry that
    # was evicted keeps it, and the eviction's close waits for it.
    lock: threading.Lock = field(default_factory=threading.Lock)
    decoder: EpisodeDecoder | None = None
    closed: bool = False

    def retire(self) -> None:
        with self.lock:
            self.closed = True
            if self.decoder is not None:
                self.decoder.close()
                self.decoder = None


class DecoderCache:
    """Bounded LRU of ``EpisodeDecoder``s keyed ``(episode, camera)``; thread-safe."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise UsageError(f"decoder cache capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._entries: OrderedDict[Hashable, _Entry] = OrderedDict()
        self._lock = threading.Lock()
        self._closed = False
        self.decoded_frames = 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def keys(self) -> list:
        """Keys from least to most recently used."""
        with self._lock:
            return list(self._entries)

    def frames_at(
        self,
        key: tuple[int, str],
        mp4_bytes: bytes | Callable[[], bytes],
        local_times_s: Sequence[float] | np.ndarray,
        tolerance_s: float,
        dtype: np.dtype | type = np.uint8,
    ) -> np.ndarray:
        """Frames of ``key``'s video at ``local_times_s`` (see ``EpisodeDecoder.frames_at``)."""
        episode, camera = key
        while True:
            entry = self._checkout(key)
            with entry.lock:
                if entry.closed:
                    continue  # evicted between lookup and lock: take the fresh entry
                if entry.decoder is None:
                    data = mp4_bytes() if callable(mp4_bytes) else mp4_bytes
                    entry.decoder = EpisodeDecoder(data, f"episode {episode} camera {camera}")
                before = entry.decoder.decoded_frames
                try:
                    return entry.decoder.frames_at(local_times_s, tolerance_s, dtype)
                finally:
                    with self._lock:
                        self.decoded_frames += entry.decoder.decoded_frames - before

    def _checkout(self, key: Hashable) -> _Entry:
        with self._lock:
            if self._closed:
                raise UsageError("the decoder cache is closed")
            entry = self._entries.get(key)
            if entry is None:
                entry = self._entries[key] = _Entry()
            self._entries.move_to_end(key)
            evicted = []
            while len(self._entries) > self.capacity:
                evicted.append(self._entries.popitem(last=False)[1])
        for old in evicted:  # outside the cache lock: closing waits for a decode in progress
            old.retire()
        return entry

    def discard(self, key: Hashable) -> None:
        """Close ``key``'s decoder if open (e.g. when its episode leaves the pool)."""
        with self._lock:
            entry = self._entries.pop(key, None)
        if entry is not None:
            entry.retire()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            entries = list(self._entries.values())
            self._entries.clear()
        for entry in entries:
            entry.retire()
