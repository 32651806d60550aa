"""Which samples an episode needs, the one byte span that holds them, and the mini-MP4 that
makes those bytes decodable: SPEC §7, without I/O, on a :class:`refstream.mp4.SampleIndex`.

Calls, in the order a loader makes them::

    spans = episode_spans(meta, episode, indexes, tolerance_s)   # camera -> (index, Span)
    size = synthesized_size(index, span)         # exact mini-MP4 bytes, before any fetch
    mp4 = synthesize(index, span, payload)       # payload: the span's bytes of the source

:func:`serving_samples` is the one rule (SPEC §7.1) deciding whether a frame serves a requested
time: span selection, the decoder's choice of frame (SPEC §10.8) and the doctor all call it.
:func:`episode_spans` applies :func:`select_span` to each camera at the episode's request times
(:func:`request_times_s`, SPEC §9.1), or before its rows are read at the nominal ones (§9.2).
:func:`synthesized_size` equals ``len(synthesize(...))`` without building anything, also across a
``stco`` → ``co64`` switch. Decoding the mini-MP4 (SPEC §7.2) gives every frame of the span at
``source pts − start_pts``, bit-identical to decoding the source.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from refstream.errors import FrameNotFound, UsageError
from refstream.meta import DatasetMeta
from refstream.mp4 import SampleIndex

__all__ = [
    "Matches",
    "serving_samples",
    "Span",
    "select_span",
    "span_of",
    "request_times_s",
    "episode_spans",
    "synthesized_size",
    "synthesize_header",
    "synthesize",
    "DEFAULT_FTYP",
]

UINT32_MAX = 0xFFFFFFFF
SCAN_SAMPLES = 256  # keyframes are looked for this many samples at a time (a GOP or more)
# ftyp for a source without one: major 'isom', minor version 0x200, brands isom iso2 mp41.
DEFAULT_FTYP = struct.pack(">I4s4sI4s4s4s", 28, b"ftyp", b"isom", 0x200, b"isom", b"iso2", b"mp41")
IDENTITY_MATRIX = struct.pack(">9I", 0x10000, 0, 0, 0, 0x10000, 0, 0, 0, 0x40000000)
HANDLER_NAME = b"VideoHandler\0"
# Bytes of moov that do not depend on the span: moov 8, mvhd 120, trak 8, tkhd 104, edts 44,
# mdia 8, mdhd 44, hdlr 45, minf 8, vmhd 20, dinf 36, stbl 8, stsd header 8, stsc 28, and the
# fixed 16/20/16-byte parts of stts, stsz and stco/co64.
FIXED_MOOV_BYTES = 8 + 120 + 8 + 104 + 44 + 8 + 44 + 45 + 8 + 20 + 36 + 8 + 8 + 28 + 16 + 20 + 16


# --- which frame serves which time -----------------------------------------------------------


@dataclass(frozen=True)
class Matches:
    """Every (request, sample) pair in which the sample serves the request, by request."""

    request: np.ndarray  # int64 positions in times_s, ascending
    sample: np.ndarray  # int64 positions in pts_ticks
    distance_s: np.ndarray  # float64 |pts_ticks / timescale - t|, as the rule computes it

    def unserved(self, count: int) -> np.ndarray:
        """Positions (int64, ascending) of the ``count`` requests no sample serves."""
        return np.setdiff1d(np.arange(count), self.request).astype(np.int64)


def serving_samples(pts_ticks: np.ndarray, timescale: int, times_s: np.ndarray,
                    tolerance_s: float) -> Matches:
    """The samples that serve each requested time: ``|pts_ticks / timescale − t| ≤ tolerance_s``
    in binary64, exactly as SPEC §7.1 writes it (``pts_ticks`` any order; a NaN time is served
    by nothing)."""
    pts_s = np.asarray(pts_ticks).astype(np.float64) / timescale
    times_s = np.asarray(times_s, np.float64)
    order = np.argsort(pts_s, kind="stable")
    # Candidates reach one tick past the tolerance, far more than any rounding of the
    # seconds; the rule below decides which of them serve.
    reach_s = tolerance_s + 1 / timescale
    sorted_s = pts_s[order]
    first = np.searchsorted(sorted_s, times_s - reach_s, side="left")
    counts = np.searchsorted(sorted_s, times_s + reach_s, side="right") - first
    request = np.repeat(np.arange(len(times_s)), counts)
    step = np.arange(len(request)) - np.repeat(np.cumsum(counts) - counts, counts)
    sample = order[np.repeat(first, counts) + step]
    distance_s = np.abs(pts_s[sample] - times_s[request])
    served = distance_s <= tolerance_s
    return Matches(request[served], sample[served].astype(np.int64), distance_s[served])


# --- spans -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Span:
    """One (episode, camera) byte span: decode-order samples and the bytes that hold them."""

    sample_lo: int  # first sample, decode order (a keyframe)
    sample_hi: int  # last sample, inclusive
    byte_offset: int  # the one byte range to fetch from the source file
    byte_length: int
    start_pts: int  # ticks: pts of the span's first presented sample (local time 0) = pts[lo]

    def covers(self, other: Span) -> bool:
        """True when every sample of ``other`` is a sample of this span."""
        return self.sample_lo <= other.sample_lo and other.sample_hi <= self.sample_hi


def select_span(index: SampleIndex, from_s: float, to_s: float, tolerance_s: float,
                request_times_s: np.ndarray | None = None) -> Span:
    """The minimal span whose frames serve every time the episode can request (SPEC §7.1).
    Only the samples that can present near those times are read and widened."""
    if not (to_s >= from_s and tolerance_s >= 0):
        raise UsageError(f"{index.path}: bad span request from_s={from_s} to_s={to_s}"
                         f" tolerance_s={tolerance_s}")
    times_s = None if request_times_s is None else np.asarray(request_times_s, np.float64)
    window = _window(index, [from_s, to_s] if times_s is None else times_s, tolerance_s)
    pts = index.pts[window].astype(np.int64)
    if times_s is None:
        pts_s = pts / index.timescale
        needed = (pts_s >= from_s - tolerance_s) & (pts_s < to_s + tolerance_s)
    else:
        matches = serving_samples(pts, index.timescale, times_s, tolerance_s)
        unserved = matches.unserved(len(times_s))
        if len(unserved):
            raise FrameNotFound(f"{index.path}: no frame within {tolerance_s} s of requested"
                                f" time {float(times_s[unserved[0]])} s")
        needed = np.isin(np.arange(len(pts)), matches.sample)
    if not needed.any():
        raise FrameNotFound(f"{index.path}: no frame within {tolerance_s} s of"
                            f" [{from_s}, {to_s}) s")
    first_needed = window.start + int(np.argmax(needed))
    last_needed = window.start + len(needed) - 1 - int(np.argmax(needed[::-1]))
    start = _keyframe_before(index, first_needed, int(pts[needed].min()))
    if index.reordered:  # finish the GOP
        return span_of(index, start, _keyframe_from(index, last_needed + 1) - 1)
    return span_of(index, start, last_needed)


def _window(index: SampleIndex, times_s, tolerance_s: float) -> slice:
    """The decode-order samples whose pts can lie within the tolerance (and two ticks) of
    ``times_s``: dts rises, and pts − dts stays within the file's composition range."""
    finite = np.asarray(times_s, np.float64)
    finite = finite[np.isfinite(finite)]
    if not len(finite):
        return slice(0, 0)
    bounds = []
    for seconds, rounding, margin in ((finite.min() - tolerance_s, math.floor, -2),
                                      (finite.max() + tolerance_s, math.ceil, 2)):
        ticks = seconds * index.timescale
        ticks = rounding(ticks) + margin if math.isfinite(ticks) else ticks
        bounds.append(int(min(max(ticks, -(2**62)), 2**62)))
    low, high = index.composition_range
    return slice(int(np.searchsorted(index.dts, bounds[0] - high, "left")),
                 int(np.searchsorted(index.dts, bounds[1] - low, "right")))


def _keyframe_before(index: SampleIndex, sample: int, pts: int) -> int:
    """The last keyframe at or before ``sample`` that presents at or before ``pts``."""
    end = sample + 1
    while end > 0:
        begin = max(0, end - SCAN_SAMPLES)
        found = np.flatnonzero(index.keyframe[begin:end] & (index.pts[begin:end] <= pts))
        if len(found):
            return begin + int(found[-1])
        end = begin
    raise FrameNotFound(f"{index.path}: no keyframe at or before sample {sample} presents at"
                        f" or before pts {pts}")


def _keyframe_from(index: SampleIndex, sample: int) -> int:
    """The first keyframe at or after ``sample``; the sample count when there is none."""
    for begin in range(sample, len(index), SCAN_SAMPLES):
        found = np.flatnonzero(index.keyframe[begin : begin + SCAN_SAMPLES])
        if len(found):
            return begin + int(found[0])
    return len(index)


def span_of(index: SampleIndex, sample_lo: int, sample_hi: int) -> Span:
    """The span of decode-order samples ``sample_lo..sample_hi``: their one byte range."""
    sl = slice(sample_lo, sample_hi + 1)
    offset = index.offset[sl].astype(np.int64)
    begin, end = int(offset.min()), int((offset + index.size[sl]).max())
    return Span(sample_lo, sample_hi, begin, end - begin, int(index.pts[sample_lo]))


def request_times_s(meta: DatasetMeta, episode: int, camera: str,
                    timestamps_s: np.ndarray) -> np.ndarray:
    """float64 source-file seconds at which rows with ``timestamps_s`` query ``camera``:
    ``from_timestamp + timestamp`` (SPEC §9.1)."""
    from_s = float(meta.video_from_s[camera][meta.row(episode)])
    return from_s + np.asarray(timestamps_s).astype(np.float64)


def episode_spans(meta: DatasetMeta, episode: int, indexes: Mapping[str, SampleIndex],
                  tolerance_s: float, timestamps_s: np.ndarray | None = None,
                  cameras: Sequence[str] | None = None) -> dict[str, tuple[SampleIndex, Span]]:
    """camera -> (its file's index, the episode's span in it), for ``cameras`` (default every
    camera) at the request times of ``timestamps_s``; ``indexes`` maps a video relpath to its
    index. Without timestamps, the nominal ones ``float32(k / fps)`` that LeRobot's recorder
    writes stand in (SPEC §9.2)."""
    if timestamps_s is None:
        timestamps_s = (np.arange(meta.frames(episode)) / meta.fps).astype(np.float32)
    row = meta.row(episode)
    spans = {}
    for camera in meta.camera_keys if cameras is None else cameras:
        index = indexes[meta.video_relpath(episode, camera)]
        times_s = request_times_s(meta, episode, camera, timestamps_s)
        spans[camera] = index, select_span(index, float(meta.video_from_s[camera][row]),
                                           float(meta.video_to_s[camera][row]), tolerance_s,
                                           times_s)
    return spans


# --- the mini-MP4 ----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Layout:
    """Everything the mini-MP4 header needs, derived from the index and the span alone."""

    durations: np.ndarray  # int64 ticks per sample
    offsets: np.ndarray  # int64 composition offsets, ≥ 0
    sizes: np.ndarray  # int64 bytes
    relative: np.ndarray  # int64 sample offsets from the start of the payload
    sync: np.ndarray  # int64 1-based sample numbers kept as sync samples
    media_time: int  # M
    edit_duration: int  # D


def _runs(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(counts, values) of the runs of equal consecutive values."""
    starts = np.flatnonzero(np.append(True, values[1:] != values[:-1]))
    return np.diff(np.append(starts, len(values))), values[starts]


def _layout(index: SampleIndex, span: Span) -> _Layout:
    lo, hi = span.sample_lo, span.sample_hi
    if not (0 <= lo <= hi < len(index)) or not index.keyframe[lo]:
        raise UsageError(f"{index.path}: span samples [{lo}, {hi}] are not a range of"
                         f" 0..{len(index) - 1} starting at a keyframe")
    sl = slice(lo, hi + 1)
    # The index's arrays may be narrow views (refstream.sidecar): widen the span's slice.
    dts, pts, durations, sizes = (getattr(index, name)[sl].astype(np.int64)
                                  for name in ("dts", "pts", "duration", "size"))
    relative = index.offset[sl].astype(np.int64) - span.byte_offset
    if relative.min() < 0 or (relative + sizes).max() > span.byte_length:
        raise UsageError(f"{index.path}: samples [{lo}, {hi}] are not inside bytes"
                         f" [{span.byte_offset}, {span.byte_offset + span.byte_length})")
    if span.start_pts != index.pts[lo]:
        raise UsageError(f"{index.path}: span start_pts {span.start_pts} is not the pts"
                         f" {index.pts[lo]} of sample {lo}")
    composition = pts - dts
    offsets = composition + max(0, -int(composition.min()))
    presentation = dts - dts[0] + offsets
    media_time = int(presentation[0])
    shown = presentation >= media_time
    edit_end = int((presentation + np.maximum(durations, 1))[shown].max())

    keyframes = np.flatnonzero(index.keyframe[sl])
    # earliest presentation in each GOP: a keyframe is kept if none of its GOP precedes it
    gop_min = np.minimum.reduceat(presentation, keyframes)
    clean = gop_min >= presentation[keyframes]
    clean[0] = True
    sync = keyframes[clean] + 1
    return _Layout(durations, offsets, sizes, relative, sync, media_time,
                   edit_end - media_time)


def _moov_size(index: SampleIndex, layout: _Layout, offset_width: int) -> int:
    n = len(layout.sizes)
    size = FIXED_MOOV_BYTES + len(index.stsd)
    size += 8 * len(_runs(layout.durations)[0]) + 4 * n + offset_width * n
    if np.any(layout.offsets != 0):
        size += 16 + 8 * len(_runs(layout.offsets)[0])
    if len(layout.sync) < n:
        size += 16 + 4 * len(layout.sync)
    return size


def _geometry(index: SampleIndex, span: Span, layout: _Layout) -> tuple[int, int, int]:
    """(offset width 4 or 8, moov size, mdat header size), iterated until stable."""
    ftyp = len(index.ftyp or DEFAULT_FTYP)
    mdat_header = 16 if span.byte_length + 8 > UINT32_MAX else 8
    last = int(layout.relative.max())
    width = 4
    while True:
        moov = _moov_size(index, layout, width)
        needed = 8 if ftyp + moov + mdat_header + last > UINT32_MAX else 4
        if needed == width:
            return width, moov, mdat_header
        width = needed  # only ever grows 4 → 8, so this loop runs at most twice


def synthesized_size(index: SampleIndex, span: Span) -> int:
    """len(synthesize(index, span, payload)), computed without building anything."""
    layout = _layout(index, span)
    _, moov, mdat_header = _geometry(index, span, layout)
    return len(index.ftyp or DEFAULT_FTYP) + moov + mdat_header + span.byte_length


def _box(kind: bytes, *parts: bytes) -> bytes:
    body = b"".join(parts)
    return struct.pack(">I4s", 8 + len(body), kind) + body


def _full(kind: bytes, version: int, flags: int, *parts: bytes) -> bytes:
    return _box(kind, struct.pack(">I", version << 24 | flags), *parts)


def _table(kind: bytes, columns: list[np.ndarray], dtypes: list[str], version: int = 0) -> bytes:
    rows = np.empty(len(columns[0]), dtype=[(f"c{i}", d) for i, d in enumerate(dtypes)])
    for i, column in enumerate(columns):
        rows[f"c{i}"] = column
    return _full(kind, version, 0, struct.pack(">I", len(rows)), rows.tobytes())


def synthesize_header(index: SampleIndex, span: Span) -> bytes:
    """``ftyp | moov | mdat header``: the mini-MP4 up to where the payload starts."""
    layout = _layout(index, span)
    width, moov_size, mdat_header = _geometry(index, span, layout)
    ftyp = index.ftyp or DEFAULT_FTYP
    payload_at = len(ftyp) + moov_size + mdat_header
    n = len(layout.sizes)
    timescale, duration = index.timescale, layout.edit_duration

    mvhd = _full(b"mvhd", 1, 0, struct.pack(">QQIQ", 0, 0, timescale, duration),
                 struct.pack(">IH10x", 0x10000, 0x100), IDENTITY_MATRIX, bytes(24),
                 struct.pack(">I", index.track_id + 1))
    tkhd = _full(b"tkhd", 1, 3, struct.pack(">QQI4xQ8x", 0, 0, index.track_id, duration),
                 struct.pack(">hhh2x", 0, 0, 0), IDENTITY_MATRIX,
                 struct.pack(">II", index.width << 16, index.height << 16))
    elst = _full(b"elst", 1, 0, struct.pack(">IQqhh", 1, duration, layout.media_time, 1, 0))
    mdhd = _full(b"mdhd", 1, 0, struct.pack(">QQIQHH", 0, 0, timescale, duration, 0x55C4, 0))
    hdlr = _full(b"hdlr", 0, 0, struct.pack(">I4s12x", 0, b"vide"), HANDLER_NAME)
    vmhd = _full(b"vmhd", 0, 1, bytes(8))
    dinf = _box(b"dinf", _full(b"dref", 0, 0, struct.pack(">I", 1), _full(b"url ", 0, 1)))

    counts, values = _runs(layout.durations)
    tables = [_box(b"stsd", index.stsd), _table(b"stts", [counts, values], [">u4", ">u4"])]
    if np.any(layout.offsets != 0):
        counts, values = _runs(layout.offsets)
        tables.append(_table(b"ctts", [counts, values], [">u4", ">u4"]))
    if len(layout.sync) < n:
        tables.append(_table(b"stss", [layout.sync], [">u4"]))
    tables.append(_full(b"stsc", 0, 0, struct.pack(">IIII", 1, 1, 1, 1)))
    tables.append(_full(b"stsz", 0, 0, struct.pack(">II", 0, n),
                        layout.sizes.astype(">u4").tobytes()))
    chunk_offsets = payload_at + layout.relative
    if width == 4:
        tables.append(_table(b"stco", [chunk_offsets], [">u4"]))
    else:
        tables.append(_table(b"co64", [chunk_offsets], [">u8"]))

    minf = _box(b"minf", vmhd, dinf, _box(b"stbl", *tables))
    trak = _box(b"trak", tkhd, _box(b"edts", elst), _box(b"mdia", mdhd, hdlr, minf))
    moov = _box(b"moov", mvhd, trak)
    assert len(moov) == moov_size, "synthesized_size and synthesize disagree"
    if mdat_header == 8:
        mdat = struct.pack(">I4s", 8 + span.byte_length, b"mdat")
    else:
        mdat = struct.pack(">I4sQ", 1, b"mdat", 16 + span.byte_length)
    return ftyp + moov + mdat


def synthesize(index: SampleIndex, span: Span, payload: bytes) -> bytes:
    """The mini-MP4 of ``span``; ``payload`` is exactly the span's byte range of the source."""
    if len(payload) != span.byte_length:
        raise UsageError(f"{index.path}: payload of {len(payload)} bytes for a span of"
                         f" {span.byte_length} bytes at offset {span.byte_offset}")
    return synthesize_header(index, span) + bytes(payload)
