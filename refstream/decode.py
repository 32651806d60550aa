"""PyAV decoding of an episode's mini-MP4, held in memory, to RGB frames by presentation time:
SPEC §10.8, giving the camera values of SPEC §9.1.

Use::

    with EpisodeDecoder(mp4_bytes, "episode 3 camera top", start_pts=span.start_pts) as decoder:
        frames = decoder.frames_at(times_s, tolerance_s, np.float32)    # (T, 3, H, W)

    cache = DecoderCache(capacity)          # bounded LRU keyed (episode, camera), thread-safe
    cache.frames_at((3, "top"), make_bytes, times_s, tolerance_s, np.uint8, start_pts)
    cache.discard((3, "top")); cache.close()

``times_s`` are seconds of the source file and ``start_pts`` is the source pts (ticks of the
track's timescale) that the video's local time 0 stands for: a span's ``start_pts``, 0 for a whole
file. So the frame serving a time is decided by :func:`refstream.synth.serving_samples` on the
same numbers span selection used; :func:`select_frames` is that choice on its own (the nearest
serving frame, ties to the earlier pts). Requests may repeat and come in any order; frames come
in request order as ``uint8`` RGB (FFmpeg's ``rgb24``, as PyAV's ``to_ndarray``) or ``float32``
RGB / 255 (LeRobot's division). ``make_bytes`` may be the bytes or a callable producing them on
the key's first use; ``decoded_frames`` counts the frames decoders produced.

Invariants: this is the only module that imports PyAV. A decoder uses one FFmpeg thread and one
``rgb24`` converter; each call seeks once (a few more times when a seek lands past the window,
as with B-frames) and decodes forward, converting only the chosen frames. A cached decoder is
used by one thread at a time, and an evicted one is closed only after the decode in progress on
it. PyAV errors become :class:`DecodeError` with the cause chained; a time no frame serves is
:class:`FrameNotFound` naming the label (episode and camera) and the time.
"""

from __future__ import annotations

import io
import math
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

import av
import numpy as np
from av.video.reformatter import VideoReformatter

from refstream.errors import DecodeError, FrameNotFound, UsageError
from refstream.synth import serving_samples

__all__ = ["EpisodeDecoder", "DecoderCache", "select_frames", "PIXEL_DTYPES"]


PIXEL_DTYPES = (np.dtype(np.uint8), np.dtype(np.float32))


class EpisodeDecoder:
    """A PyAV decoder over one MP4 held in memory; frames by presentation time (see module doc)."""

    def __init__(self, mp4_bytes: bytes, label: str = "episode video", start_pts: int = 0) -> None:
        self.label = label
        self.start_pts = start_pts
        self._bytes = mp4_bytes
        self._container = self._open()
        self._converter = VideoReformatter()
        self.decoded_frames = 0
        stream = self._container.streams.video[0]
        self.time_base = stream.time_base  # PyAV's Fraction: 1 / the track's timescale
        if self.time_base.numerator != 1:
            self.close()
            raise DecodeError(f"{self.label}: time base {self.time_base} is not 1/timescale")
        self.timescale: int = self.time_base.denominator
        self.width: int = stream.codec_context.width
        self.height: int = stream.codec_context.height
        rate = stream.average_rate  # frames per second, None if unknown
        self._frame_ticks = max(1, round(self.timescale / float(rate))) if rate else 1

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
        # per frame at 320x240).
        container.streams.video[0].thread_count = 1
        return container

    def close(self) -> None:
        self._container.close()

    def __enter__(self) -> EpisodeDecoder:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def frames_at(
        self, times_s: Sequence[float] | np.ndarray, tolerance_s: float,
        dtype: np.dtype | type = np.uint8,
    ) -> np.ndarray:
        """``(T, 3, H, W)`` frames serving ``times_s`` (source seconds, request order), as
        ``uint8`` RGB or ``float32`` RGB / 255 (module docstring)."""
        times_s = np.asarray(times_s, dtype=np.float64).reshape(-1)
        if not (tolerance_s >= 0 and np.all(np.isfinite(times_s))):
            raise UsageError(f"{self.label}: times must be finite and tolerance_s >= 0")
        if np.dtype(dtype) not in PIXEL_DTYPES:
            raise UsageError(f"{self.label}: frames come as uint8 or float32, not {dtype}")
        if times_s.size == 0:
            return np.empty((0, 3, self.height, self.width), dtype)
        # Source ticks one tick past the tolerance: more than any rounding of the seconds, so
        # every frame that can serve a time is decoded; serving_samples decides which do.
        reach = tolerance_s * self.timescale + 1
        first_t, last_t = times_s.min() * self.timescale, times_s.max() * self.timescale
        lo_ticks = math.floor(first_t - reach) - self.start_pts
        hi_ticks = math.ceil(last_t + reach) - self.start_pts
        # Where frames are more than 2·reach apart, at most one frame can serve a time, so a
        # frame before the last one at or before first_t + reach, or after the first one at or
        # after last_t - reach, is never chosen: decode only from the one to the other.
        # (Otherwise the whole window.)
        inner = reach if self._frame_ticks > 2 * reach else -reach
        start_ticks = math.floor(first_t + inner) - self.start_pts
        stop_ticks = math.ceil(last_t - inner) - self.start_pts
        decoded = self._decode_window(lo_ticks, hi_ticks, start_ticks, stop_ticks)
        pts_ticks = np.array(sorted(decoded), dtype=np.int64)
        chosen = select_frames(pts_ticks + self.start_pts, self.timescale, times_s, tolerance_s,
                               self.label)
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


def select_frames(pts_ticks: np.ndarray, timescale: int, times_s: np.ndarray,
                  tolerance_s: float, label: str = "video") -> np.ndarray:
    """Position in ``pts_ticks`` (int64, distinct) of the frame serving each request: of the
    frames :func:`refstream.synth.serving_samples` finds, the nearest, ties to the earlier pts;
    ``FrameNotFound`` when none serves (SPEC §10.8)."""
    pts_ticks, times_s = np.asarray(pts_ticks, np.int64), np.asarray(times_s, np.float64)
    matches = serving_samples(pts_ticks, timescale, times_s, tolerance_s)
    unserved = matches.unserved(len(times_s))
    if len(unserved):
        t = float(times_s[unserved[0]])
        pts_s = pts_ticks.astype(np.float64) / timescale
        nearest = (f"nearest frame at {float(pts_s[np.argmin(np.abs(pts_s - t))])!r} s"
                   if len(pts_s) else "no frame decoded")
        raise FrameNotFound(f"{label}: no frame within tolerance {tolerance_s} s of time "
                            f"{t!r} s ({nearest})")
    order = np.lexsort((pts_ticks[matches.sample], matches.distance_s, matches.request))
    best = order[np.flatnonzero(np.diff(matches.request[order], prepend=-1))]
    return matches.sample[best]


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

    def frames_at(
        self,
        key: tuple[int, str],
        mp4_bytes: bytes | Callable[[], bytes],
        times_s: Sequence[float] | np.ndarray,
        tolerance_s: float,
        dtype: np.dtype | type = np.uint8,
        start_pts: int = 0,
    ) -> np.ndarray:
        """Frames of ``key``'s video serving ``times_s`` (see ``EpisodeDecoder``)."""
        episode, camera = key
        while True:
            entry = self._checkout(key)
            with entry.lock:
                if entry.closed:
                    continue  # evicted between lookup and lock: take the fresh entry
                if entry.decoder is None:
                    data = mp4_bytes() if callable(mp4_bytes) else mp4_bytes
                    entry.decoder = EpisodeDecoder(data, f"episode {episode} camera {camera}",
                                                   start_pts)
                before = entry.decoder.decoded_frames
                try:
                    return entry.decoder.frames_at(times_s, tolerance_s, dtype)
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
