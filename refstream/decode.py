"""PyAV decoding of an episode's mini-MP4, held in memory, to RGB frames by presentation time
(SPEC §10.8; the camera values of SPEC §9.1).

Use::

    chosen = select_frames(pts_ticks, timescale, times_s, tolerance_s)   # the frame of each time
    with EpisodeDecoder(mp4_bytes, "episode 3 camera top", start_pts=span.start_pts) as decoder:
        frames = decoder.frames(pts_ticks[chosen], np.float32)            # (T, 3, H, W)
        decoder.frames(pts_ticks[chosen], out=batch[i])                   # or into given memory
    cache = DecoderCache(capacity)     # LRU keyed (episode, camera), for one thread at a time

Times are source pts in ticks of the track's timescale; ``start_pts`` is the source pts of the
video's local time 0. A decoder decodes exactly the frames asked (any order, repeats allowed),
converting each once into its place: ``uint8`` RGB (FFmpeg's ``rgb24``, as PyAV's
``to_ndarray``) or ``float32`` RGB / 255 (LeRobot's division). The only module that imports
PyAV: its errors become :class:`DecodeError`, cause chained; a time no frame serves is
:class:`FrameNotFound` naming the episode, camera and time.
"""

from __future__ import annotations

import io
from collections import OrderedDict
from collections.abc import Sequence

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
        self.label, self.start_pts, self._bytes = label, start_pts, mp4_bytes
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

    def frames(self, pts_ticks: Sequence[int] | np.ndarray, dtype: np.dtype | type = np.uint8,
               out: np.ndarray | None = None) -> np.ndarray:
        """``(T, 3, H, W)`` frames presented at source ``pts_ticks`` (request order), written
        into ``out`` when given (whose dtype then rules)."""
        wanted = [int(p) - self.start_pts for p in pts_ticks]  # local ticks
        shape = (len(wanted), 3, self.height, self.width)
        if out is None and np.dtype(dtype) not in PIXEL_DTYPES:
            raise UsageError(f"{self.label}: frames come as uint8 or float32, not {dtype}")
        out = np.empty(shape, dtype) if out is None else out
        if out.shape != shape or out.dtype not in PIXEL_DTYPES:
            raise DecodeError(f"{self.label}: frames are {shape} but the output is {out.dtype} "
                              f"{out.shape}: every video of a camera needs one size")
        decoded = self._decode(min(wanted), max(wanted), set(wanted)) if wanted else {}
        first_request: dict[int, int] = {}
        for i, local in enumerate(wanted):
            if local in first_request:
                out[i] = out[first_request[local]]
            elif local not in decoded:
                raise DecodeError(f"{self.label}: the decoder presents no frame at source pts "
                                  f"{local + self.start_pts}")
            elif out.dtype == np.float32:  # float32(v) / float32(255), exactly rounded
                np.divide(self._rgb(decoded[local]), np.float32(255), out=out[i])
            else:
                out[i] = self._rgb(decoded[local])
            first_request.setdefault(local, i)
        return out

    def _rgb(self, frame: av.VideoFrame) -> np.ndarray:
        """``(3, H, W)`` uint8: FFmpeg's rgb24 conversion, as ``to_ndarray(format="rgb24")``."""
        try:
            rgb = self._converter.reformat(frame, format="rgb24", threads=1).to_ndarray()
        except av.FFmpegError as exc:
            raise DecodeError(f"{self.label}: PyAV cannot convert a frame to RGB: {exc}") from exc
        return rgb.transpose(2, 0, 1)

    def _decode(self, first: int, last: int, wanted: set[int]) -> dict[int, av.VideoFrame]:
        """The decoded frames of ``wanted`` (local ticks, ``first`` to ``last``), keyed by pts."""
        stream = self._container.streams.video[0]
        start = stream.start_time  # the earliest presentation time, None if unknown
        # The first step back is one frame: seeks go by decode time, which trails presentation
        # by the reorder depth, a few frames at most.
        target, step = first, 0
        try:
            while start is not None and target > start:
                try:
                    self._container.seek(target, stream=stream, backward=True)
                except av.FFmpegError:
                    break  # e.g. no keyframe before the target: decode from the start instead
                frames, first_pts = self._forward(stream, first, last, wanted)
                if first_pts is None or first_pts <= first:
                    return frames
                # The seek landed after the first frame asked: step back twice as far.
                step = 2 * step + self._frame_ticks + (first_pts - first)
                target = first - step
            # Reopening is the one way to start at the first sample whatever the edit list says.
            self._container.close()
            self._container = self._open()
            stream = self._container.streams.video[0]
            return self._forward(stream, first, last, wanted, stop_early=False)[0]
        except av.FFmpegError as exc:
            raise DecodeError(f"{self.label}: PyAV failed to decode: {exc}") from exc

    def _forward(self, stream, first: int, last: int, wanted: set[int], stop_early: bool = True):
        frames: dict[int, av.VideoFrame] = {}
        first_pts = None
        for frame in self._container.decode(stream):
            self.decoded_frames += 1
            if frame.pts is None:
                raise DecodeError(f"{self.label}: a decoded frame has no presentation time")
            if first_pts is None:
                first_pts = frame.pts
                if stop_early and first_pts > first:
                    break  # the caller seeks further back
            if frame.pts in wanted:
                frames[frame.pts] = frame
            if frame.pts >= last:
                break  # frames leave the decoder in presentation order
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


class DecoderCache:
    """At most ``capacity`` open ``EpisodeDecoder``s keyed ``(episode, camera)``, the least
    recently used closed first; for one thread at a time (a worker gives each decode thread
    its own)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise UsageError(f"decoder cache capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._decoders: OrderedDict[tuple[int, str], EpisodeDecoder] = OrderedDict()

    def __len__(self) -> int:
        return len(self._decoders)

    def frames(self, key: tuple[int, str], mp4_bytes: bytes, pts_ticks: Sequence[int],
               dtype: np.dtype | type = np.uint8, start_pts: int = 0,
               out: np.ndarray | None = None) -> np.ndarray:
        """Frames of ``key``'s video (``mp4_bytes``) presented at ``pts_ticks``."""
        decoder = self._decoders.pop(key, None)
        if decoder is None:
            decoder = EpisodeDecoder(mp4_bytes, f"episode {key[0]} camera {key[1]}", start_pts)
        self._decoders[key] = decoder
        while len(self._decoders) > self.capacity:
            self._decoders.popitem(last=False)[1].close()
        return decoder.frames(pts_ticks, dtype, out)

    def discard(self, key: tuple[int, str]) -> None:
        """Close ``key``'s decoder if open (e.g. when its episode leaves the pool)."""
        decoder = self._decoders.pop(key, None)
        if decoder is not None:
            decoder.close()

    def close(self) -> None:
        while self._decoders:
            self._decoders.popitem()[1].close()
