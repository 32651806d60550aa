"""PyAV decoding of an episode's mini-MP4, held in memory, to RGB frames by presentation time
(SPEC §10.8, §9.3; the camera values of SPEC §9.1). The only module that imports PyAV. Use::

    with EpisodeDecoder(mp4_bytes, "episode 3 camera top", start_pts=span.start_pts) as decoder:
        frames = decoder.frames(pts_ticks, np.float32)     # (T, 3, H, W), request order
    cache = DecoderCache(capacity, keep_bytes)   # LRU keyed (episode, camera), one thread's
    decoder = cache.decoder((3, "top"), mp4_bytes, span.start_pts, keyframes=k, demand=counts)
    decoder.frames(pts_ticks, out=batch[i], room=cache.room())   # into given memory
"""

from __future__ import annotations

import functools
import io
import math
from bisect import bisect_left, bisect_right
from collections import OrderedDict
from collections.abc import Iterable, Sequence

import av
import numpy as np
from av.video.reformatter import VideoReformatter

from refstream.errors import DecodeError, UsageError, check_at_least
from refstream.mp4 import decoder_setup

__all__ = ["EpisodeDecoder", "DecoderCache", "PIXEL_DTYPES"]

PIXEL_DTYPES = (np.dtype(np.uint8), np.dtype(np.float32))
# PyAV 17 and later scale with a thread per CPU unless told ``threads=1``; earlier releases scale
# on the calling thread and take no such option.
_ONE_THREAD = {"threads": 1} if int(av.__version__.split(".")[0]) >= 17 else {}


class EpisodeDecoder:
    """A PyAV decoder over one MP4 held in memory; frames by presentation time (see module doc)."""

    def __init__(self, mp4_bytes: bytes, label: str = "episode video", start_pts: int = 0,
                 stsd: bytes = b"", peers: Iterable[EpisodeDecoder] = (),
                 keyframes: Iterable[int] = (), demand: dict[int, int] | None = None,
                 tally: list[int] | None = None) -> None:
        self.label, self.start_pts, self._bytes = label, start_pts, mp4_bytes
        self.demand = demand  # source pts -> requests still to come (None: keep nothing)
        self._keyframes = [*sorted(int(k) - start_pts for k in keyframes), math.inf]  # local ticks
        self._demanded = sorted(int(p) - start_pts for p in demand or ())  # local ticks
        self.kept: dict[int, av.VideoFrame] = {}  # local pts -> a frame a later request wants
        self.kept_bytes = 0
        # Bytes kept by this decoder and the others sharing the one-element list (a cache's).
        self._tally = [0] if tally is None else tally
        self._container = self._open()
        self._scaler = VideoReformatter()
        stream = self._container.streams.video[0]
        # Packets go to the codec context of a peer whose sample description (``stsd``, as
        # ``SampleIndex.stsd``) sets a decoder up alike, when there is one: dozens of open
        # contexts, each with its own frames and tables, cost cache misses. The context is
        # flushed before every use.
        self.setup = decoder_setup(stsd) if stsd else None
        peer = next((p for p in peers if self.setup and p.setup == self.setup), None)
        self.codec = stream.codec_context if peer is None else peer.codec
        self.width, self.height = stream.codec_context.width, stream.codec_context.height
        # A decoded frame's bytes, padding included: the first decoded frame's (the frames of a
        # stream are alike), until then the most an 8-bit frame takes (4:4:4).
        self._frame_bytes, self._sized = 3 * self.width * self.height, False
        rate = stream.average_rate  # frames per second, None if unknown
        # One frame's duration in ticks of the stream's time base (1 if the rate is unknown).
        self._frame_ticks = max(1, round(1 / float(stream.time_base * rate))) if rate else 1

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
        self.let_go()
        self._container.close()

    def __enter__(self) -> EpisodeDecoder:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def frames(self, pts_ticks: Sequence[int] | np.ndarray, dtype: np.dtype | type = np.uint8,
               out: np.ndarray | None = None, room: int = 0) -> np.ndarray:
        """``(T, 3, H, W)`` frames presented at source ``pts_ticks`` (request order), written
        into ``out`` when given (whose dtype then rules); kept frames grow by ``room`` at most."""
        wanted = [int(p) - self.start_pts for p in pts_ticks]  # local ticks
        shape = (len(wanted), 3, self.height, self.width)
        if out is None and np.dtype(dtype) not in PIXEL_DTYPES:
            raise UsageError(f"{self.label}: frames come as uint8 or float32, not {dtype}")
        out = np.empty(shape, dtype) if out is None else out
        if out.shape != shape or out.dtype not in PIXEL_DTYPES:
            raise DecodeError(f"{self.label}: frames are {shape} but the output is {out.dtype} "
                              f"{out.shape}: every video of a camera needs one size")
        for source in map(int, pts_ticks) if self.demand is not None else ():
            self.demand[source] = self.demand.get(source, 1) - 1
        try:
            missing = set(wanted).difference(self.kept)
            decoded = (self._decode(min(missing), self._reach(missing, room), missing)
                       if missing else {})
            for i, local in enumerate(wanted):
                frame = decoded.get(local, self.kept.get(local))
                if frame is None:
                    raise DecodeError(f"{self.label}: the decoder presents no frame at source "
                                      f"pts {local + self.start_pts}")
                for plane, channel in zip(_rgb(self._scaler, frame), out[i], strict=True):
                    channel[...] = plane
                    if out.dtype == np.float32:  # float32(v) / float32(255), exactly rounded;
                        np.divide(channel, np.float32(255), out=channel)  # faster in place
        except av.FFmpegError as exc:
            raise DecodeError(f"{self.label}: PyAV failed to decode: {exc}") from exc
        self._keep(decoded, wanted, room)
        return out

    def _wanted_later(self, local: int) -> bool:
        return self.demand is not None and self.demand.get(local + self.start_pts, 0) > 0

    def _reach(self, missing: set[int], room: int) -> int:
        """The pts to decode up to: ``max(missing)`` or its GOP's last wanted later (SPEC §10.8)."""
        last = max(missing)
        next_gop = self._keyframes[bisect_right(self._keyframes, last)]  # its first frame's pts
        ahead = [p for p in self._demanded[bisect_right(self._demanded, last):
                                           bisect_left(self._demanded, next_gop)]
                 if p not in self.kept and self._wanted_later(p)]
        return max([last, *ahead[:room // self._frame_bytes]])

    def _keep(self, decoded: dict[int, av.VideoFrame], served: list[int], room: int) -> None:
        """Keep decoded frames later requests want, in ``room`` bytes; drop those served last."""
        if decoded and not self._sized:
            self._frame_bytes, self._sized = _frame_bytes(next(iter(decoded.values()))), True
        for local in served:
            if local in self.kept and not self._wanted_later(local):
                del self.kept[local]
                self._hold(-self._frame_bytes)
        for local, frame in sorted(decoded.items()):
            if local not in self.kept and self._wanted_later(local) and self._frame_bytes <= room:
                self.kept[local] = frame
                self._hold(self._frame_bytes)
                room -= self._frame_bytes

    def _hold(self, size: int) -> None:
        self.kept_bytes += size
        self._tally[0] += size

    def let_go(self) -> None:
        self.kept.clear()
        self._hold(-self.kept_bytes)

    def _decode(self, first: int, last: int, wanted: set[int]) -> dict[int, av.VideoFrame]:
        """The decoded frames of ``wanted`` (local ticks ``first`` to ``last``) or wanted later."""
        stream = self._container.streams.video[0]
        start = stream.start_time  # the earliest presentation time, None if unknown
        # The first step back is one frame: seeks go by decode time, which trails presentation
        # by the reorder depth, a few frames at most.
        target, step = first, 0
        while start is not None and target >= start:
            try:
                self._container.seek(target, stream=stream, backward=True)
            except av.FFmpegError:
                break  # e.g. no keyframe before the target: decode from the start instead
            frames, first_pts = self._forward(first, last, wanted)
            if first_pts is None or first_pts <= first:
                return frames
            # The seek landed after the first frame asked: step back twice as far.
            step = 2 * step + self._frame_ticks + (first_pts - first)
            target = first - step
        # Reopening is the one way to start at the first sample whatever the edit list says.
        self._container.close()
        self._container = self._open()
        return self._forward(first, last, wanted)[0]

    def _forward(self, first: int, last: int, wanted: set[int]) -> tuple[dict, int | None]:
        frames, first_pts = {}, None  # pts -> a wanted frame; the first frame's pts
        self.codec.flush_buffers()
        packets = self._container.demux(self._container.streams.video[0])
        for frame in (frame for packet in packets for frame in self.codec.decode(packet)):
            if frame.pts is None:
                raise DecodeError(f"{self.label}: a decoded frame has no presentation time")
            if first_pts is None:
                first_pts = frame.pts
                if first_pts > first:
                    # _decode seeks further back; after a reopen, the video has no such frame.
                    break
            if frame.pts in wanted or self._wanted_later(frame.pts):
                frames[frame.pts] = frame
            if frame.pts >= last:
                break  # frames leave the decoder in presentation order
        return frames, first_pts


def _frame_bytes(frame: av.VideoFrame) -> int:
    return sum(plane.buffer_size for plane in frame.planes)


# swscale converts to packed rgb24 and to planar gbrp (no interleaving to undo) with one kernel
# on most frame sizes, but not on every size, build and CPU: per kind of frame (pixel format,
# size, colorspace, range), whether the two give the same planes, decided on random pixels.
@functools.cache
def _planar_is_rgb24(pixel_format: str, width: int, height: int, colorspace, color_range) -> bool:
    probe = av.VideoFrame(width, height, pixel_format)
    probe.colorspace, probe.color_range = colorspace, color_range
    random = np.random.default_rng(0)
    for plane in probe.planes:
        plane.update(random.integers(0, 256, plane.buffer_size, np.uint8).tobytes())
    scaler = VideoReformatter()
    return np.array_equal(_rgb(scaler, probe, True), _rgb(scaler, probe, False))


def _rgb(scaler: VideoReformatter, frame: av.VideoFrame,
         planar: bool | None = None) -> list[np.ndarray]:
    """``frame``'s R, G and B planes ``(H, W)`` uint8 as rgb24 gives them; via gbrp if planar."""
    if planar is None:
        planar = _planar_is_rgb24(frame.format.name, frame.width, frame.height,
                                  frame.colorspace, frame.color_range)
    if not planar:
        rgb = scaler.reformat(frame, format="rgb24", **_ONE_THREAD).to_ndarray()
        return list(rgb.transpose(2, 0, 1))
    planes = scaler.reformat(frame, format="gbrp", **_ONE_THREAD).planes
    g, b, r = (np.frombuffer(plane, np.uint8).reshape(frame.height, plane.line_size)
               [:, :frame.width] for plane in planes)
    return [r, g, b]


class DecoderCache:
    """At most ``capacity`` open decoders (the least recently used closed first); one thread's."""

    def __init__(self, capacity: int, keep_bytes: int = 0) -> None:
        check_at_least(1, capacity=capacity)
        self.capacity, self.keep_bytes = capacity, keep_bytes
        self._decoders: OrderedDict[tuple[int, str], EpisodeDecoder] = OrderedDict()
        self._kept = [0]  # bytes its decoders keep, a tally they share

    def decoder(self, key: tuple[int, str], mp4_bytes: bytes, start_pts: int = 0,
                stsd: bytes = b"", keyframes: Iterable[int] = (),
                demand: dict[int, int] | None = None) -> EpisodeDecoder:
        """``key``'s decoder of ``mp4_bytes``, opened if not open (sharing a peer's codec)."""
        decoder = self._decoders.pop(key, None)
        if decoder is None:
            decoder = EpisodeDecoder(mp4_bytes, f"episode {key[0]} camera {key[1]}", start_pts,
                                     stsd, self._decoders.values(), keyframes, demand, self._kept)
        self._decoders[key] = decoder
        while len(self._decoders) > self.capacity:
            self._decoders.popitem(last=False)[1].close()
        return decoder

    def room(self) -> int:
        """Bytes of frames its decoders may keep beyond what they keep."""
        return self.keep_bytes - self._kept[0]

    def fit(self, keep_bytes: int) -> None:
        """Bound the frames kept to ``keep_bytes``: the least recently used decoders' go first."""
        self.keep_bytes = keep_bytes
        for decoder in self._decoders.values():
            if self.room() >= 0:
                break
            decoder.let_go()

    def discard(self, key: tuple[int, str]) -> None:
        """Close ``key``'s decoder if open (e.g. when its episode leaves the pool)."""
        if key in self._decoders:
            self._decoders.pop(key).close()

    def close(self) -> None:
        while self._decoders:
            self._decoders.popitem()[1].close()
