"""Which samples an episode needs, the one byte span that holds them, the frame serving each
request, and the mini-MP4 that makes those bytes decodable (SPEC §7, §10.8), without I/O, on a
:class:`refstream.mp4.SampleIndex`; ``meta`` is a :class:`refstream.meta.DatasetMeta`, which it
does not import. Calls, in the order a loader makes them::

    spans = episode_spans(meta, episode, indexes, tolerance_s)   # camera -> (index, Span)
    size = synthesized_size(index, span)         # exact mini-MP4 bytes, before any fetch
    pts = serving_pts(meta, episode, spans, tolerance_s, timestamps_s)  # camera -> pts per row
    mp4 = synthesize(index, span, payload)       # payload: the span's bytes of the source
"""

from __future__ import annotations

import math
import struct
from bisect import bisect_left, bisect_right
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from refstream.errors import FrameNotFound, MalformedDataset, TableError, UsageError
from refstream.mp4 import SampleIndex
from refstream.windows import check_tolerance

__all__ = ["Matches", "serving_samples", "served", "select_frames", "check_frame_rate", "Span",
           "select_span", "span_of", "episode_spans", "serving_pts",
           "synthesized_size", "synthesize_header", "synthesize", "DEFAULT_FTYP"]

UINT32_MAX = 0xFFFFFFFF
# Keyframes are looked for this many samples at a time (a GOP or more), so that finding one
# touches a few pages of the mapped index instead of a whole-file array per file.
SCAN_SAMPLES = 256
# ftyp for a source without one: major 'isom', minor version 0x200, brands isom iso2 mp41.
DEFAULT_FTYP = struct.pack(">I4s4sI4s4s4s", 28, b"ftyp", b"isom", 0x200, b"isom", b"iso2", b"mp41")
IDENTITY_MATRIX = struct.pack(">9I", 0x10000, 0, 0, 0, 0x10000, 0, 0, 0, 0x40000000)
HANDLER_NAME = b"VideoHandler\0"
FIXED_MOOV_BYTES = 541  # the bytes of moov no span changes (SPEC §7.2, size without building)
FRAME_RATE_SAMPLES = 64  # a file's frame spacing is read from its first samples (SPEC §9.2)


# --- which frame serves which time -----------------------------------------------------------


@dataclass(frozen=True)
class Matches:
    """Every (request, sample) pair in which the sample serves the request, by request."""

    request: np.ndarray  # int64 positions in times_s, ascending
    sample: np.ndarray  # int64 positions in pts_ticks
    distance_s: np.ndarray  # float64 |pts_ticks / timescale - t|, as the rule computes it

    def unserved(self, count: int) -> np.ndarray:
        """Positions (int64, ascending) of the ``count`` requests no sample serves."""
        served = np.zeros(count, bool)
        served[self.request] = True
        return np.flatnonzero(~served)


def serving_samples(pts_ticks: np.ndarray, timescale: int, times_s: np.ndarray,
                    tolerance_s: float) -> Matches:
    """The samples (``pts_ticks`` in any order) serving each of ``times_s`` by SPEC §7.1's rule."""
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


def served(pts_ticks: np.ndarray, timescale: int, times_s: np.ndarray, tolerance_s: float,
           label: str) -> Matches:
    """:func:`serving_samples`, or ``FrameNotFound`` naming ``label`` if a time is unserved."""
    matches = serving_samples(pts_ticks, timescale, times_s, tolerance_s)
    unserved = matches.unserved(len(times_s))
    if len(unserved):
        raise FrameNotFound(f"{label}: {len(unserved)} of {len(times_s)} request times have no "
                            f"frame within {tolerance_s} s (first {times_s[unserved[0]]:.6f} s)")
    return matches


def select_frames(pts_ticks: np.ndarray, timescale: int, times_s: np.ndarray,
                  tolerance_s: float, label: str = "video") -> np.ndarray:
    """Position in ``pts_ticks`` (int64) of the frame serving each of ``times_s`` (SPEC §10.8)."""
    pts_ticks, times_s = np.asarray(pts_ticks, np.int64), np.asarray(times_s, np.float64)
    matches = served(pts_ticks, timescale, times_s, tolerance_s, label)
    order = np.lexsort((pts_ticks[matches.sample], matches.distance_s, matches.request))
    best = order[np.flatnonzero(np.diff(matches.request[order], prepend=-1))]
    return matches.sample[best]


def check_frame_rate(pts_ticks: np.ndarray, timescale: int, fps: float, relpath: str) -> float:
    """SPEC §9.2's frame spacing (ticks; NaN under two samples); MalformedDataset if not fps's."""
    pts = np.sort(np.asarray(pts_ticks[:FRAME_RATE_SAMPLES]).astype(np.int64))
    spacing = float(np.median(np.diff(pts))) if len(pts) > 1 else math.nan
    if not abs(spacing - timescale / fps) >= 1:  # within a tick, or nothing to compare
        return spacing
    rate = timescale / spacing if spacing > 0 else math.inf
    raise MalformedDataset(
        f"{relpath}: the video's frame times disagree with meta/info.json's fps {fps:g}: frames "
        f"{spacing / timescale:.6g} s apart ({rate:.6g} fps); set fps to the videos' frame rate, "
        f"or re-encode the videos at {fps:g} fps")


# --- spans -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Span:
    """One (episode, camera) byte span: decode-order samples and the bytes that hold them."""

    sample_lo: int  # first sample, decode order (a keyframe)
    sample_hi: int  # last sample, inclusive
    byte_offset: int  # the one byte range to fetch from the source file
    byte_length: int
    start_pts: int  # ticks: pts of the span's first presented sample (local time 0) = pts[lo]


def select_span(index: SampleIndex, from_s: float, to_s: float, tolerance_s: float,
                request_times_s: np.ndarray | None = None) -> Span:
    """The minimal span serving every time the episode can request (SPEC §7.1)."""
    tolerance_s = check_tolerance(tolerance_s)
    if not to_s >= from_s:
        raise UsageError(f"{index.path}: a span's to_s={to_s} s is before its from_s={from_s} s")
    times_s = None if request_times_s is None else np.asarray(request_times_s, np.float64)
    window = _window(index, [from_s, to_s] if times_s is None else times_s, tolerance_s)
    pts = index.pts[window].astype(np.int64)
    if times_s is None:
        pts_s = pts / index.timescale
        needed = np.flatnonzero((pts_s >= from_s - tolerance_s) & (pts_s < to_s + tolerance_s))
    else:
        needed = served(pts, index.timescale, times_s, tolerance_s, index.path).sample
    if not len(needed):
        raise FrameNotFound(f"{index.path}: no frame within {tolerance_s} s of"
                            f" [{from_s}, {to_s}) s")
    first_needed = window.start + int(needed.min())
    last_needed = window.start + int(needed.max())
    start = _keyframe_before(index, first_needed, int(pts[needed].min()))
    if index.reordered:  # B-frames: the span runs to the end of the last needed GOP (§7.1)
        return span_of(index, start, _keyframe_from(index, last_needed + 1) - 1)
    return span_of(index, start, last_needed)


def _window(index: SampleIndex, times_s, tolerance_s: float) -> slice:
    """The decode-order samples whose pts can lie within the tolerance (and two ticks) of times."""
    finite = np.asarray(times_s, np.float64)
    finite = finite[np.isfinite(finite)]
    if not len(finite):
        return slice(0, 0)
    clamp = 2.0**62  # seconds × timescale may overflow: clamp to ticks no file reaches
    low_ticks = max(-clamp, min(clamp, (float(finite.min()) - tolerance_s) * index.timescale))
    high_ticks = max(-clamp, min(clamp, (float(finite.max()) + tolerance_s) * index.timescale))
    low, high = index.composition_range  # dts rises, and pts − dts stays in this range
    # bisect reads a few elements; np.searchsorted copies a narrow or unaligned array (as the
    # mapped records hold them) to compare it with a Python int, on every call.
    return slice(bisect_left(index.dts, math.floor(low_ticks) - 2 - high),
                 bisect_right(index.dts, math.ceil(high_ticks) + 2 - low))


def _keyframe_before(index: SampleIndex, sample: int, pts: int) -> int:
    """The last keyframe at or before ``sample`` that presents at or before ``pts``."""
    for stop in range(sample + 1, 0, -SCAN_SAMPLES):
        start = max(0, stop - SCAN_SAMPLES)
        found = np.flatnonzero(index.keyframe[start:stop] & (index.pts[start:stop] <= pts))
        if len(found):
            return start + int(found[-1])
    raise FrameNotFound(f"{index.path}: no keyframe at or before sample {sample} presents at"
                        f" or before pts {pts}")


def _keyframe_from(index: SampleIndex, sample: int) -> int:
    """The first keyframe at or after ``sample``; the sample count when there is none."""
    for start in range(sample, len(index), SCAN_SAMPLES):
        found = np.flatnonzero(index.keyframe[start : start + SCAN_SAMPLES])
        if len(found):
            return start + int(found[0])
    return len(index)


def span_of(index: SampleIndex, sample_lo: int, sample_hi: int) -> Span:
    """The span of decode-order samples ``sample_lo..sample_hi``: their one byte range."""
    samples = slice(sample_lo, sample_hi + 1)
    offset = index.offset[samples].astype(np.int64)
    begin, end = int(offset.min()), int((offset + index.size[samples]).max())
    return Span(sample_lo, sample_hi, begin, end - begin, int(index.pts[sample_lo]))


def _camera_span(meta, episode: int, camera: str, index: SampleIndex, tolerance_s: float,
                 timestamps_s: np.ndarray) -> tuple[np.ndarray, Span]:
    """The source seconds at which ``timestamps_s`` query ``camera`` (SPEC §9.1), and their span."""
    row = meta.row(episode)
    from_s, to_s = float(meta.video_from_s[camera][row]), float(meta.video_to_s[camera][row])
    times_s = from_s + np.asarray(timestamps_s).astype(np.float64)
    return times_s, select_span(index, from_s, to_s, tolerance_s, times_s)


def episode_spans(meta, episode: int, indexes: Mapping[str, SampleIndex],
                  tolerance_s: float, timestamps_s: np.ndarray | None = None,
                  cameras: Sequence[str] | None = None) -> dict[str, tuple[SampleIndex, Span]]:
    """camera -> (its file's index in ``indexes``, by relpath; its span) for ``cameras`` (default:
    all) at the times of ``timestamps_s`` (default: the nominal ones, SPEC §9.2)."""
    if timestamps_s is None:
        timestamps_s = (np.arange(meta.frames(episode)) / meta.fps).astype(np.float32)
    spans = {}
    for camera in meta.camera_keys if cameras is None else cameras:
        index = indexes[meta.video_relpath(episode, camera)]
        spans[camera] = index, _camera_span(meta, episode, camera, index, tolerance_s,
                                            timestamps_s)[1]
    return spans


def serving_pts(meta, episode: int, planned: Mapping[str, tuple[SampleIndex, Span]],
                tolerance_s: float, timestamps_s: np.ndarray) -> dict[str, np.ndarray]:
    """camera -> source pts (int64) of the frame serving each row of ``timestamps_s``, among the
    samples of its ``planned`` span (SPEC §9.1, §10.8); ``TableError`` if they need others."""
    chosen = {}
    for camera, (index, span) in planned.items():
        times_s, needed = _camera_span(meta, episode, camera, index, tolerance_s, timestamps_s)
        if not (span.sample_lo <= needed.sample_lo and needed.sample_hi <= span.sample_hi):
            raise TableError(
                f"{meta.data_relpath(episode)}: episode {episode}: its timestamps need samples "
                f"{needed.sample_lo}..{needed.sample_hi} of {index.path} ({camera}), outside "
                f"samples {span.sample_lo}..{span.sample_hi} planned from frame_index / fps")
        pts = index.pts[span.sample_lo : span.sample_hi + 1].astype(np.int64)
        chosen[camera] = pts[select_frames(pts, index.timescale, times_s, tolerance_s,
                                           f"episode {episode} camera {camera}")]
    return chosen


# --- the mini-MP4 ----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Layout:
    """Everything the mini-MP4 header needs, derived from the index and the span (SPEC §7.2)."""

    durations: np.ndarray  # int64 ticks per sample
    composition: np.ndarray  # int64 ticks c = pts − dts shifted to ≥ 0 (ctts; not bytes)
    sizes: np.ndarray  # int64 bytes
    relative: np.ndarray  # int64 byte offset of each sample from the start of the payload
    sync: np.ndarray  # int64 1-based numbers of the kept sync samples
    media_time: int  # M
    edit_duration: int  # D


def _runs(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(counts, values) of the runs of equal consecutive values."""
    starts = np.flatnonzero(np.append(True, values[1:] != values[:-1]))
    return np.diff(np.append(starts, len(values))), values[starts]


def _layout(index: SampleIndex, span: Span) -> _Layout:
    """The layout of ``span``; UsageError for a span that is not one of ``index``."""
    lo, hi = span.sample_lo, span.sample_hi
    if not (0 <= lo <= hi < len(index)) or not index.keyframe[lo]:
        raise UsageError(f"{index.path}: span samples [{lo}, {hi}] are not a range of"
                         f" 0..{len(index) - 1} starting at a keyframe")
    samples = slice(lo, hi + 1)
    # The index's arrays may be narrow views (refstream.sidecar): widen the span's slice.
    dts, pts, durations, sizes = (getattr(index, name)[samples].astype(np.int64)
                                  for name in ("dts", "pts", "duration", "size"))
    relative = index.offset[samples].astype(np.int64) - span.byte_offset
    if relative.min() < 0 or (relative + sizes).max() > span.byte_length:
        raise UsageError(f"{index.path}: samples [{lo}, {hi}] are not inside bytes"
                         f" [{span.byte_offset}, {span.byte_offset + span.byte_length})")
    if span.start_pts != index.pts[lo]:
        raise UsageError(f"{index.path}: span start_pts {span.start_pts} is not the pts"
                         f" {index.pts[lo]} of sample {lo}")
    composition = pts - dts
    composition += max(0, -int(composition.min()))
    presentation = dts - dts[0] + composition
    media_time = int(presentation[0])
    shown = presentation >= media_time
    edit_end = int((presentation + np.maximum(durations, 1))[shown].max())
    keyframes = np.flatnonzero(index.keyframe[samples])
    clean = np.minimum.reduceat(presentation, keyframes) >= presentation[keyframes]
    clean[0] = True
    return _Layout(durations, composition, sizes, relative, keyframes[clean] + 1, media_time,
                   edit_end - media_time)


def _geometry(index: SampleIndex, span: Span, layout: _Layout) -> tuple[int, int, int]:
    """(chunk offset width 4 or 8, bytes before the payload, mdat header size), by SPEC §7.2."""
    samples = len(layout.sizes)
    moov = FIXED_MOOV_BYTES + len(index.stsd) + 8 * len(_runs(layout.durations)[0]) + 4 * samples
    if layout.composition.any():
        moov += 16 + 8 * len(_runs(layout.composition)[0])
    if len(layout.sync) < samples:
        moov += 16 + 4 * len(layout.sync)
    mdat_header = 16 if span.byte_length + 8 > UINT32_MAX else 8
    before_payload = len(index.ftyp or DEFAULT_FTYP) + moov + 4 * samples + mdat_header
    # co64 only makes the header longer, so one switch settles the width.
    width = 8 if before_payload + int(layout.relative.max()) > UINT32_MAX else 4
    return width, before_payload + (width - 4) * samples, mdat_header  # counted 4-byte offsets


def synthesized_size(index: SampleIndex, span: Span) -> int:
    """``len(synthesize(index, span, payload))``, computed from the index alone."""
    return _geometry(index, span, _layout(index, span))[1] + span.byte_length


def box(kind: bytes, *parts: bytes) -> bytes:
    body = b"".join(parts)
    return struct.pack(">I4s", 8 + len(body), kind) + body


def full_box(kind: bytes, version: int, flags: int, *parts: bytes) -> bytes:
    return box(kind, struct.pack(">I", version << 24 | flags), *parts)


def table_box(kind: bytes, dtype: str, *columns: np.ndarray) -> bytes:
    """A full box holding a row count, then the rows of ``columns`` in ``dtype``."""
    rows = np.column_stack(columns).astype(dtype)
    return full_box(kind, 0, 0, struct.pack(">I", len(rows)), rows.tobytes())


def synthesize_header(index: SampleIndex, span: Span) -> bytes:
    """``ftyp | moov | mdat header``: the mini-MP4 up to where the payload starts."""
    layout = _layout(index, span)
    width, payload_at, mdat_header = _geometry(index, span, layout)
    ftyp = index.ftyp or DEFAULT_FTYP
    timescale, duration = index.timescale, layout.edit_duration

    mvhd = full_box(b"mvhd", 1, 0, struct.pack(">QQIQ", 0, 0, timescale, duration),
                 struct.pack(">IH10x", 0x10000, 0x100), IDENTITY_MATRIX, bytes(24),
                 struct.pack(">I", index.track_id + 1))
    tkhd = full_box(b"tkhd", 1, 3, struct.pack(">QQI4xQ8x", 0, 0, index.track_id, duration),
                 struct.pack(">hhh2x", 0, 0, 0), IDENTITY_MATRIX,
                 struct.pack(">II", index.width << 16, index.height << 16))
    elst = full_box(b"elst", 1, 0, struct.pack(">IQqhh", 1, duration, layout.media_time, 1, 0))
    mdhd = full_box(b"mdhd", 1, 0, struct.pack(">QQIQHH", 0, 0, timescale, duration, 0x55C4, 0))
    hdlr = full_box(b"hdlr", 0, 0, struct.pack(">I4s12x", 0, b"vide"), HANDLER_NAME)
    vmhd = full_box(b"vmhd", 0, 1, bytes(8))
    dinf = box(b"dinf", full_box(b"dref", 0, 0, struct.pack(">I", 1), full_box(b"url ", 0, 1)))

    # ctts and stss are left out (empty) when every composition offset is 0, every sample sync.
    stts = table_box(b"stts", ">u4", *_runs(layout.durations))
    ctts = (table_box(b"ctts", ">u4", *_runs(layout.composition)) if layout.composition.any()
            else b"")
    stss = table_box(b"stss", ">u4", layout.sync) if len(layout.sync) < len(layout.sizes) else b""
    stsc = full_box(b"stsc", 0, 0, struct.pack(">IIII", 1, 1, 1, 1))
    stsz = full_box(b"stsz", 0, 0, struct.pack(">II", 0, len(layout.sizes)),
                    layout.sizes.astype(">u4").tobytes())
    stco = table_box(b"stco" if width == 4 else b"co64", f">u{width}", payload_at + layout.relative)

    stbl = box(b"stbl", box(b"stsd", index.stsd), stts, ctts, stss, stsc, stsz, stco)
    minf = box(b"minf", vmhd, dinf, stbl)
    trak = box(b"trak", tkhd, box(b"edts", elst), box(b"mdia", mdhd, hdlr, minf))
    moov = box(b"moov", mvhd, trak)
    assert len(ftyp) + len(moov) + mdat_header == payload_at, "synthesized_size disagrees"
    if mdat_header == 8:
        return ftyp + moov + struct.pack(">I4s", 8 + span.byte_length, b"mdat")
    return ftyp + moov + struct.pack(">I4sQ", 1, b"mdat", 16 + span.byte_length)


def synthesize(index: SampleIndex, span: Span, payload: bytes) -> bytes:
    """The mini-MP4 of ``span``; ``payload`` is exactly the span's byte range of the source."""
    if len(payload) != span.byte_length:
        raise UsageError(f"{index.path}: payload of {len(payload)} bytes for a span of"
                         f" {span.byte_length} bytes at offset {span.byte_offset}")
    return synthesize_header(index, span) + bytes(payload)
