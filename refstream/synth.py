"""An episode's byte span in a source MP4, and the mini-MP4 that makes those bytes decodable.

Three calls, in this order, all on a :class:`refstream.mp4.SampleIndex` and without I/O:

1. :func:`select_span` — the decode-order samples an episode needs, as one :class:`Span` with the
   one byte range to fetch from the source file.
2. :func:`synthesized_size` — the exact size of the mini-MP4, from the index alone (for the byte
   budget, before anything is fetched).
3. :func:`synthesize` — ``ftyp | moov | mdat`` around the fetched payload (``synthesize_header``
   is everything before the payload).

Span selection (exact, no padding constant). A sample is *needed* when its presentation time
``pts / timescale`` lies within ``tolerance_s`` of a time the episode can request: each of
``request_times_s`` when given, else any ``t`` with ``from_s ≤ t < to_s`` (so
``from_s - tol ≤ pts_s < to_s + tol``). Every request time must match a sample
(:class:`FrameNotFound` otherwise). The span then runs in decode order from ``lo`` to ``hi``:

* ``lo`` is the last keyframe at or before the first needed sample (decode order) that presents
  at or before the earliest needed presentation time;
* ``hi`` is the last needed sample, or — when the file is reordered (some pts is not greater
  than the pts before it in decode order) — the sample before the next keyframe after it (the
  end of its GOP), or the last sample.

``start_pts = pts[lo]`` is local time 0. Samples of the span that present before it are the
leading pictures of an open-GOP keyframe: the mini-MP4's edit hides them (FFmpeg marks them
discard and drops their frames), so every frame decoded from the mini-MP4 has
``local pts = source pts - start_pts``. The byte range is ``min(offset)`` to
``max(offset + size)`` over the span; it may hold bytes of other tracks, carried unreferenced.

Mini-MP4 layout (big-endian, one video track, one sample per chunk; sizes in bytes)::

    ftyp     the source ftyp verbatim, or DEFAULT_FTYP (28)
    moov     8
      mvhd   v1 (120): timescale = media timescale, duration = edit duration, next track id
      trak   8
        tkhd v1 flags 3 (104): track id, duration, width/height (16.16) from the sample entry
        edts 8 + elst v1 (36): one entry (D, M, rate 1.0)
        mdia 8
          mdhd v1 (44), language 'und'
          hdlr (45): 'vide', name "VideoHandler"
          minf 8
            vmhd (20) flags 1
            dinf 8 + dref (28) with one self-contained 'url ' entry
            stbl 8
              stsd 8 + the source stsd payload verbatim
              stts 16 + 8 per run of equal durations
              ctts v0 16 + 8 per run of equal offsets — omitted when every offset is 0
              stss 16 + 4 per kept sync sample — omitted when every sample is kept as sync
              stsc (28): one entry (1, 1, 1)
              stsz 20 + 4 per sample
              stco 16 + 4 per sample, or co64 16 + 8 per sample when an offset exceeds 2^32 - 1
    mdat     8-byte header, or 16 (64-bit size) when 8 + payload exceeds 2^32 - 1; the payload

Local timeline: ``dts_local[i] = dts[i] - dts[lo]``; composition offset
``c[i] = pts[i] - dts[i] + K`` with ``K = max(0, -min(pts - dts))`` over the span, so ``c ≥ 0``;
``p[i] = dts_local[i] + c[i]``. The edit starts at ``M = p[lo]`` and lasts
``D = max(p[i] + max(duration[i], 1)) - M`` over the samples with ``p[i] ≥ M``. Kept sync
samples: ``lo``, and each later keyframe ``s`` of the span none of whose GOP (``s`` up to the
next keyframe or ``hi``) presents before it — an open-GOP keyframe with leading pictures is not
a place a decoder may start. Sample offsets are ``mdat payload start + offset[i] -
byte_offset``. The moov size depends on the offset width, which depends on the moov size, so
:func:`synthesized_size` iterates from 32-bit offsets until the layout is stable.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from refstream.errors import FrameNotFound, UsageError
from refstream.mp4 import SampleIndex

__all__ = [
    "Span",
    "select_span",
    "synthesized_size",
    "synthesize_header",
    "synthesize",
    "DEFAULT_FTYP",
]

UINT32_MAX = 0xFFFFFFFF
# ftyp for a source without one: major 'isom', minor version 0x200, brands isom iso2 mp41.
DEFAULT_FTYP = struct.pack(">I4s4sI4s4s4s", 28, b"ftyp", b"isom", 0x200, b"isom", b"iso2", b"mp41")
IDENTITY_MATRIX = struct.pack(">9I", 0x10000, 0, 0, 0, 0x10000, 0, 0, 0, 0x40000000)
HANDLER_NAME = b"VideoHandler\0"
# Bytes of moov that do not depend on the span: moov 8, mvhd 120, trak 8, tkhd 104, edts 44,
# mdia 8, mdhd 44, hdlr 45, minf 8, vmhd 20, dinf 36, stbl 8, stsd header 8, stsc 28, and the
# fixed 16/20/16-byte parts of stts, stsz and stco/co64.
FIXED_MOOV_BYTES = 8 + 120 + 8 + 104 + 44 + 8 + 44 + 45 + 8 + 20 + 36 + 8 + 8 + 28 + 16 + 20 + 16


@dataclass(frozen=True)
class Span:
    """One (episode, camera) byte span: decode-order samples and the bytes that hold them."""

    sample_lo: int  # first sample, decode order (a keyframe)
    sample_hi: int  # last sample, inclusive
    byte_offset: int  # the one byte range to fetch from the source file
    byte_length: int
    start_pts: int  # ticks: pts of the span's first presented sample (local time 0) = pts[lo]


def select_span(index: SampleIndex, from_s: float, to_s: float, tolerance_s: float,
                request_times_s: np.ndarray | None = None) -> Span:
    """The minimal span whose frames cover every time the episode can request."""
    if not (to_s >= from_s and tolerance_s >= 0):
        raise UsageError(f"{index.path}: bad span request from_s={from_s} to_s={to_s}"
                         f" tolerance_s={tolerance_s}")
    pts_s = index.pts / index.timescale
    if request_times_s is None:
        needed = (pts_s >= from_s - tolerance_s) & (pts_s < to_s + tolerance_s)
    else:
        needed = _needed_by_times(index, pts_s, np.asarray(request_times_s, float), tolerance_s)
    if not needed.any():
        raise FrameNotFound(f"{index.path}: no frame within {tolerance_s} s of"
                            f" [{from_s}, {to_s}) s")
    first_needed = int(np.argmax(needed))
    last_needed = len(needed) - 1 - int(np.argmax(needed[::-1]))
    earliest_pts = int(index.pts[needed].min())

    candidates = np.flatnonzero(index.keyframe[: first_needed + 1]
                                & (index.pts[: first_needed + 1] <= earliest_pts))
    if not len(candidates):
        raise FrameNotFound(f"{index.path}: no keyframe at or before sample {first_needed}"
                            f" presents at or before pts {earliest_pts}")
    lo = int(candidates[-1])
    hi = last_needed
    if np.any(np.diff(index.pts) <= 0):  # reordered: finish the GOP
        later = np.flatnonzero(index.keyframe[last_needed + 1 :])
        hi = last_needed + int(later[0]) if len(later) else len(index) - 1
    begin = int(index.offset[lo : hi + 1].min())
    end = int((index.offset[lo : hi + 1] + index.size[lo : hi + 1]).max())
    return Span(lo, hi, begin, end - begin, int(index.pts[lo]))


def _needed_by_times(index: SampleIndex, pts_s: np.ndarray, times_s: np.ndarray,
                     tolerance_s: float) -> np.ndarray:
    """Samples within tolerance of one of ``times_s``; every time must match one."""
    order = np.argsort(pts_s, kind="stable")
    sorted_s = pts_s[order]
    first = np.searchsorted(sorted_s, times_s - tolerance_s, side="left")
    stop = np.searchsorted(sorted_s, times_s + tolerance_s, side="right")
    missing = stop <= first
    if missing.any():
        raise FrameNotFound(f"{index.path}: no frame within {tolerance_s} s of requested time"
                            f" {float(times_s[np.argmax(missing)])} s")
    marks = np.zeros(len(sorted_s) + 1, dtype=np.int64)  # +1 at each start, -1 after each end
    np.add.at(marks, first, 1)
    np.add.at(marks, stop, -1)
    needed = np.zeros(len(sorted_s), dtype=bool)
    needed[order] = np.cumsum(marks[:-1]) > 0
    return needed


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
    relative = index.offset[sl] - span.byte_offset
    if relative.min() < 0 or (relative + index.size[sl]).max() > span.byte_length:
        raise UsageError(f"{index.path}: samples [{lo}, {hi}] are not inside bytes"
                         f" [{span.byte_offset}, {span.byte_offset + span.byte_length})")
    if span.start_pts != index.pts[lo]:
        raise UsageError(f"{index.path}: span start_pts {span.start_pts} is not the pts"
                         f" {index.pts[lo]} of sample {lo}")
    dts, pts = index.dts[sl], index.pts[sl]
    composition = pts - dts
    offsets = composition + max(0, -int(composition.min()))
    presentation = dts - dts[0] + offsets
    media_time = int(presentation[0])
    shown = presentation >= media_time
    durations = index.duration[sl]
    edit_end = int((presentation + np.maximum(durations, 1))[shown].max())

    keyframes = np.flatnonzero(index.keyframe[sl])
    # earliest presentation in each GOP: a keyframe is kept if none of its GOP precedes it
    gop_min = np.minimum.reduceat(presentation, keyframes)
    clean = gop_min >= presentation[keyframes]
    clean[0] = True
    sync = keyframes[clean] + 1
    return _Layout(durations, offsets, index.size[sl], relative, sync, media_time,
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
