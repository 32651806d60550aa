"""Tiny real videos for tests, and their per-sample index as PyAV's demuxer reports it.

``encode_video`` writes a small MP4 with a real encoder (libx264 or libsvtav1 through PyAV);
``index_from_pyav`` builds a ``SampleIndex`` from the demuxer's packet table (pts, dts, size,
pos, keyframe, duration) — an oracle independent of ``refstream.mp4``; ``decode_all`` decodes a
whole file with plain PyAV, keyed by pts. The few header fields PyAV does not expose (ftyp, stsd,
mvhd timescale) are read by scanning the bytes for the box type, which is enough for the files
made here.
"""

from __future__ import annotations

import io
import os
import struct
from pathlib import Path

import av
import numpy as np

from refstream.mp4 import SampleIndex, parse_index
from refstream.tools.demo import keep_scheduling

# SVT-AV1 prints its configuration on every open unless told to log errors only.
os.environ.setdefault("SVT_LOG", "1")

FPS = 30


def pattern_frames(count: int, height: int = 48, width: int = 64) -> np.ndarray:
    """uint8 (count, H, W, 3) frames that all differ: a red ramp and a moving white square."""
    frames = np.zeros((count, height, width, 3), np.uint8)
    for i in range(count):
        frames[i, :, :, 0] = (i * 8) % 256
        frames[i, :, :, 2] = np.arange(width, dtype=np.uint8)[None, :] * 3
        y, x = (i * 3) % (height - 8), (i * 5) % (width - 8)
        frames[i, y : y + 8, x : x + 8] = 255
    return frames


def encode_video(
    path: Path,
    frames: np.ndarray,
    codec: str = "libx264",
    gop: int = 10,
    bframes: int = 0,
    open_gop: bool = False,
    x264_params: str = "",
) -> Path:
    """Encode uint8 (T, H, W, 3) RGB ``frames`` at 30 fps into an MP4 at ``path``.

    x264 runs without scene-cut detection, so keyframes come every ``gop`` frames only: an
    intra frame it would insert at a cut is flagged a keyframe by FFmpeg's H.264 parser but is
    not in ``stss``, and the tests here compare with both. ``x264_params`` adds x264 settings
    (``key=value:...``).
    """
    with keep_scheduling():
        return _encode(path, frames, codec, gop, bframes, open_gop, x264_params)


def _encode(path, frames, codec, gop, bframes, open_gop, x264_params) -> Path:
    container = av.open(str(path), "w")
    stream = container.add_stream(codec, rate=FPS)
    stream.height, stream.width = frames.shape[1:3]
    stream.pix_fmt = "yuv420p"
    stream.codec_context.gop_size = gop
    if codec == "libx264":
        stream.codec_context.max_b_frames = bframes
        params = ":".join(["scenecut=0", *(["open-gop=1"] if open_gop else []),
                           *([x264_params] if x264_params else [])])
        stream.codec_context.options = {"preset": "veryfast", "x264-params": params}
    elif codec == "libsvtav1":
        stream.codec_context.options = {"preset": "12"}
    for i, image in enumerate(frames):
        frame = av.VideoFrame.from_ndarray(image, format="rgb24")
        frame.pts = i
        container.mux(stream.encode(frame))
    container.mux(stream.encode())
    container.close()
    return path


def _box_payload(data: bytes, box_type: bytes) -> bytes:
    """Payload of the first box of ``box_type`` found by scanning (32-bit sizes only)."""
    at = data.find(box_type)
    if at < 4:
        return b""
    (size,) = struct.unpack(">I", data[at - 4 : at])
    return data[at + 4 : at - 4 + size]


def index_from_pyav(source: Path | bytes, path: str | None = None) -> SampleIndex:
    """The first video track's packets as PyAV's demuxer reports them, in decode order.

    ``source`` is a file or its bytes; ``path`` (default: the file name) labels the index.
    """
    data = source if isinstance(source, bytes) else Path(source).read_bytes()
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        rows = [
            (p.dts, p.pts, p.duration, p.size, p.pos, p.is_keyframe)
            for p in container.demux(stream)
            if p.size > 0
        ]
        timescale = stream.time_base.denominator
        assert stream.time_base.numerator == 1
        width, height, track_id = stream.width, stream.height, stream.id
    columns = list(zip(*rows, strict=True))
    ftyp_size = struct.unpack(">I", data[:4])[0] if data[4:8] == b"ftyp" else 0
    mvhd = _box_payload(data, b"mvhd")
    movie_timescale = struct.unpack(">I", mvhd[12:16] if mvhd[0] == 0 else mvhd[20:24])[0]
    stsd = _box_payload(data, b"stsd")
    return SampleIndex(
        path=path or str(source),
        file_size=len(data),
        ftyp=data[:ftyp_size],
        stsd=stsd,
        codec=stsd[12:16].decode("ascii"),
        width=width,
        height=height,
        track_id=track_id,
        timescale=timescale,
        movie_timescale=movie_timescale,
        dts=np.array(columns[0], np.int64),
        pts=np.array(columns[1], np.int64),
        duration=np.array(columns[2], np.int64),
        size=np.array(columns[3], np.int64),
        offset=np.array(columns[4], np.int64),
        keyframe=np.array(columns[5], bool),
    )


def parse_index_bytes(data: bytes, path: str) -> SampleIndex:
    """``refstream.mp4.parse_index`` of a whole file held in memory."""
    view = memoryview(data)
    return parse_index(lambda offset, length: bytes(view[offset : offset + length]),
                       len(data), path)


def decode_all(source: Path | bytes) -> dict[int, np.ndarray]:
    """Every frame of a file decoded with plain PyAV: pts ticks -> uint8 (H, W, 3) RGB."""
    handle = io.BytesIO(source) if isinstance(source, bytes) else str(source)
    with av.open(handle) as container:
        return {
            frame.pts: frame.to_ndarray(format="rgb24")
            for frame in container.decode(container.streams.video[0])
        }


def assert_same_index(actual: SampleIndex, expected: SampleIndex) -> None:
    """Every field of two indexes is equal (arrays by value and int64/bool semantics)."""
    for name in ("file_size", "ftyp", "stsd", "codec", "width", "height", "track_id",
                 "timescale", "movie_timescale"):
        assert getattr(actual, name) == getattr(expected, name), name
    for name in ("dts", "pts", "duration", "size", "offset", "keyframe"):
        got, want = getattr(actual, name), getattr(expected, name)
        assert got.dtype == want.dtype, (name, got.dtype)
        np.testing.assert_array_equal(got, want, err_msg=name)


class CountingCodec:
    """A decoder's codec context that calls ``count(n)`` with the number of frames each packet
    decodes to: set as an ``EpisodeDecoder``'s ``codec``, it counts what the decoder decodes."""

    def __init__(self, codec, count) -> None:
        self.codec, self.count = codec, count

    def decode(self, packet):
        frames = self.codec.decode(packet)
        self.count(len(frames))
        return frames

    def flush_buffers(self) -> None:
        self.codec.flush_buffers()


def counted(decoder) -> list[int]:
    """``decoder`` counting what it decodes: the sum of the list returned is that count."""
    counts: list[int] = []
    decoder.codec = CountingCodec(decoder.codec, counts.append)
    return counts
