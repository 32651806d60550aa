"""Which samples an episode needs, the one byte span that holds them, the frame serving each
request, and the mini-MP4 that makes those bytes decodable (SPEC §7, §10.8), without I/O, on a
:class:`refstream.mp4.SampleIndex`; ``meta`` is a :class:`refstream.meta.DatasetMeta`, which it
does not import. ``episode_spans``, ``select_span`` and ``synthesized_size`` are the one-episode
forms. Calls, in the order a loader makes them::

    spans, sizes = nominal_spans(meta, episodes, indexes, tolerance_s)  # the episodes of a
    # file at once: episode -> camera -> (index, Span), and episode -> exact mini-MP4 bytes
    pts = serving_pts(meta, episode, spans[episode], tolerance_s, timestamps_s)  # camera -> pts
    mp4 = synthesize(index, span, payload)       # payload: the span's bytes of the source
"""

from __future__ import annotations

import math
import struct
from bisect import bisect_left, bisect_right
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from refstream.errors import (
    FrameNotFound,
    MalformedDataset,
    RefstreamError,
    TableError,
    UsageError,
)
from refstream.mp4 import SampleIndex
from refstream.windows import check_tolerance

__all__ = ["Matches", "serving_samples", "served", "select_frames", "check_frame_rate", "Span",
           "select_span", "select_spans", "span_of", "spans_of", "episode_spans", "nominal_spans",
           "serving_pts",
           "synthesized_size", "synthesized_sizes", "synthesize_header", "synthesize",
           "DEFAULT_FTYP"]

UINT32_MAX = 0xFFFFFFFF
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
           label: str, matches: Matches | None = None) -> Matches:
    """:func:`serving_samples` (its ``matches`` if given already), or ``FrameNotFound`` naming
    ``label`` if a time is unserved."""
    if matches is None:
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
    if request_times_s is not None:
        times_s = np.asarray(request_times_s, np.float64)
        return select_spans(index, [from_s], [to_s], times_s, [len(times_s)], tolerance_s)[0]
    tolerance_s = check_tolerance(tolerance_s)
    _check_order(index, from_s, to_s)
    bounds = np.array([[from_s, to_s]], np.float64)
    bounds[~np.isfinite(bounds)] = np.nan  # the window is around the finite ones
    low, high = np.fmin.reduce(bounds, axis=1), np.fmax.reduce(bounds, axis=1)
    start, stop = (int(side[0]) for side in _windows(index, low, high, tolerance_s))
    pts_s = index.pts[start:stop].astype(np.int64) / index.timescale
    needed = np.flatnonzero((pts_s >= from_s - tolerance_s) & (pts_s < to_s + tolerance_s))
    if not len(needed):
        raise FrameNotFound(f"{index.path}: no frame within {tolerance_s} s of"
                            f" [{from_s}, {to_s}) s")
    first_pts = index.pts[start + needed].astype(np.int64).min(keepdims=True)
    return _spans(index, start + needed[:1], start + needed[-1:], first_pts)[0]


def select_spans(index: SampleIndex, from_s: Sequence[float], to_s: Sequence[float],
                 times_s: np.ndarray, lengths: Sequence[int], tolerance_s: float) -> list[Span]:
    """:func:`select_span` of episodes in one file at once: episode ``i`` spans ``from_s[i]`` to
    ``to_s[i]`` and requests the next ``lengths[i]`` of ``times_s``; the error is the first
    episode's that has one, as one call per episode would raise."""
    tolerance_s = check_tolerance(tolerance_s)
    lengths = np.asarray(lengths, np.int64)
    times_s = np.asarray(times_s, np.float64)
    if not len(lengths):
        return []
    # Each episode's window of samples, all of them side by side (windows may overlap).
    finite, firsts = np.where(np.isfinite(times_s), times_s, np.nan), np.cumsum(lengths) - lengths
    low, high, some = np.full(len(lengths), np.nan), np.full(len(lengths), np.nan), lengths > 0
    low[some] = np.fmin.reduceat(finite, firsts[some])
    high[some] = np.fmax.reduceat(finite, firsts[some])
    start, stop = _windows(index, low, high, tolerance_s)
    counts = stop - start
    positions = np.repeat(start - np.cumsum(counts) + counts, counts) + np.arange(counts.sum())
    pts = index.pts[positions].astype(np.int64)
    matches = serving_samples(pts, index.timescale, times_s, tolerance_s)
    if len(lengths) > 1 and (len(matches.unserved(len(times_s))) or not lengths.all()
                             or not np.all(np.asarray(to_s) >= np.asarray(from_s))):
        for i, first in enumerate(firsts):  # some episode fails: find which, one at a time
            select_spans(index, from_s[i:i + 1], to_s[i:i + 1],
                         times_s[first:first + lengths[i]], lengths[i:i + 1], tolerance_s)
    if len(lengths) == 1:
        _check_order(index, from_s[0], to_s[0])
        served(pts, index.timescale, times_s, tolerance_s, index.path, matches)
        if not len(matches.sample):
            raise FrameNotFound(f"{index.path}: no frame within {tolerance_s} s of"
                                f" [{from_s[0]}, {to_s[0]}) s")
    owner = np.repeat(np.arange(len(lengths)), lengths)[matches.request]
    by_episode = np.searchsorted(owner, np.arange(len(lengths)))
    samples = positions[matches.sample]
    return _spans(index, np.minimum.reduceat(samples, by_episode),
                  np.maximum.reduceat(samples, by_episode),
                  np.minimum.reduceat(pts[matches.sample], by_episode))


def _windows(index: SampleIndex, low_s: np.ndarray, high_s: np.ndarray, tolerance_s: float
             ) -> tuple[np.ndarray, np.ndarray]:
    """(start, stop) of the decode-order samples whose pts can lie within the tolerance (and two
    ticks) of times from ``low_s[i]`` to ``high_s[i]`` (NaN: no time, an empty window)."""
    clamp = 2.0**62  # seconds × timescale may overflow: clamp to ticks no file reaches
    low, high = index.composition_range  # dts rises, and pts − dts stays in this range
    some = ~np.isnan(low_s)
    low_ticks = np.floor(np.clip((low_s[some] - tolerance_s) * index.timescale, -clamp, clamp))
    high_ticks = np.ceil(np.clip((high_s[some] + tolerance_s) * index.timescale, -clamp, clamp))
    firsts, lasts = low_ticks.astype(np.int64) - 2 - high, high_ticks.astype(np.int64) + 2 - low
    start, stop = np.zeros(len(low_s), np.int64), np.zeros(len(low_s), np.int64)
    if some.any():
        # np.searchsorted copies a narrow or unaligned array (as mapped records hold them) to
        # compare it: it searches only between the outermost answers, which bisect finds
        # reading a few elements.
        begin = bisect_left(index.dts, int(firsts.min()))
        dts = index.dts[begin:bisect_right(index.dts, int(lasts.max()))]
        start[some] = begin + np.searchsorted(dts, firsts)
        stop[some] = begin + np.searchsorted(dts, lasts, "right")
    return start, stop


def _check_order(index: SampleIndex, from_s: float, to_s: float) -> None:
    if not to_s >= from_s:
        raise UsageError(f"{index.path}: a span's to_s={to_s} s is before its from_s={from_s} s")


def _spans(index: SampleIndex, first_needed: np.ndarray, last_needed: np.ndarray,
           first_pts: np.ndarray) -> list[Span]:
    """The spans from the last keyframe at or before each first needed sample that presents at
    or before its first needed pts, to its last needed sample (to the end of that sample's GOP
    when B-frames reorder, SPEC §7.1)."""
    keyframes = np.flatnonzero(index.keyframe)
    at = np.searchsorted(keyframes, first_needed, side="right") - 1
    while True:  # step back past keyframes that present too late (open GOPs)
        late = at >= 0
        late[late] = index.pts[keyframes[at[late]]] > first_pts[late]
        if not late.any():
            break
        at[late] -= 1
    if (at < 0).any():
        i = int(np.argmax(at < 0))
        raise FrameNotFound(f"{index.path}: no keyframe at or before sample {first_needed[i]} "
                            f"presents at or before pts {first_pts[i]}")
    lo, hi = keyframes[at], np.asarray(last_needed, np.int64)
    if index.reordered:
        after = np.searchsorted(keyframes, hi + 1)
        hi = np.append(keyframes, len(index))[after] - 1
    return spans_of(index, lo, hi)


def span_of(index: SampleIndex, sample_lo: int, sample_hi: int) -> Span:
    """The span of decode-order samples ``sample_lo..sample_hi``: their one byte range."""
    return spans_of(index, np.array([sample_lo]), np.array([sample_hi]))[0]


def spans_of(index: SampleIndex, lo: np.ndarray, hi: np.ndarray) -> list[Span]:
    """:func:`span_of` of each ``lo[i]..hi[i]``."""
    part, first, last = _part(index, lo, hi, ("offset", "size", "pts"))
    begin, end = _byte_ranges(part, first, last)
    return [Span(*values) for values in zip(np.asarray(lo).tolist(), np.asarray(hi).tolist(),
                                            begin.tolist(), (end - begin).tolist(),
                                            part["pts"][first].tolist(), strict=True)]


def _part(index: SampleIndex, lo: np.ndarray, hi: np.ndarray, names: Sequence[str]
          ) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
    """The index's arrays ``names`` (int64; the keyframe flags as bool) over the samples of each
    range ``lo[i]..hi[i]``, the ranges side by side and then one more sample (no keyframe), and
    where each range lies in them."""
    counts = np.asarray(hi, np.int64) - lo + 1
    first = np.cumsum(counts) - counts
    samples = np.repeat(lo - first, counts) + np.arange(counts.sum())
    samples = np.append(samples, samples[-1])  # the one more: a range's end + 1 is a position
    part = {name: getattr(index, name)[samples].astype(bool if name == "keyframe" else np.int64)
            for name in names}
    if "keyframe" in part:
        part["keyframe"][-1] = False
    return part, first, first + counts - 1


def _byte_ranges(part: dict[str, np.ndarray], first: np.ndarray, last: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray]:
    """(begin, end) of the bytes that hold each range of :func:`_part`'s samples."""
    return (_reduce_ranges(np.minimum, part["offset"], first, last),
            _reduce_ranges(np.maximum, part["offset"] + part["size"], first, last))


def _reduce_ranges(ufunc: np.ufunc, values: np.ndarray, lo: np.ndarray, hi: np.ndarray
                   ) -> np.ndarray:
    """``ufunc.reduce(values[lo[i]:hi[i] + 1])`` for each i (``hi[i] + 1`` < ``len(values)``)."""
    return ufunc.reduceat(values, np.column_stack([lo, hi + 1]).ravel())[::2]


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
        timestamps_s = _nominal_s(meta.fps, [meta.frames(episode)])
    spans = {}
    for camera in meta.camera_keys if cameras is None else cameras:
        index = indexes[meta.video_relpath(episode, camera)]
        spans[camera] = index, _camera_span(meta, episode, camera, index, tolerance_s,
                                            timestamps_s)[1]
    return spans


def nominal_spans(meta, episodes: Sequence[int], indexes: Mapping[str, SampleIndex],
                  tolerance_s: float) -> tuple[dict[int, dict], dict[int, int]]:
    """:func:`episode_spans` of each episode at its nominal times, and its exact byte size (its
    mini-MP4s' sizes summed), the episodes of each video file at once; the error is the first
    episode's, as one call per episode would raise."""
    spans, sizes = {e: {} for e in episodes}, dict.fromkeys(episodes, 0)
    if not spans:
        return spans, sizes
    try:
        rows = np.array([meta.row(e) for e in episodes], np.int64).reshape(-1)
        for camera in meta.camera_keys:
            files = np.stack([meta.video_chunk[camera][rows], meta.video_file[camera][rows]], 1)
            group = np.unique(files, axis=0, return_inverse=True)[1].reshape(-1)
            order = np.argsort(group, kind="stable")
            for members in np.split(order, np.cumsum(np.bincount(group))[:-1]):
                index = indexes[meta.video_relpath(episodes[members[0]], camera)]
                from_s = meta.video_from_s[camera][rows[members]]
                counts = meta.length[rows[members]]
                times_s = np.repeat(from_s, counts) + _nominal_s(meta.fps, counts)
                found = select_spans(index, from_s, meta.video_to_s[camera][rows[members]],
                                     times_s, counts, tolerance_s)
                for member, span, size in zip(members.tolist(), found,
                                              synthesized_sizes(index, found).tolist(),
                                              strict=True):
                    spans[episodes[member]][camera] = index, span
                    sizes[episodes[member]] += size
    except RefstreamError:
        for episode in episodes:  # which episode fails first, as one at a time
            episode_spans(meta, episode, indexes, tolerance_s)
        raise
    return spans, sizes


def _nominal_s(fps: float, counts: Sequence[int]) -> np.ndarray:
    """Episodes' nominal request times, side by side: each row / fps, in float32 (SPEC §9.2)."""
    counts = np.asarray(counts, np.int64)
    rows = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
    return (rows / fps).astype(np.float32)


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
    """The layout of ``span``, one that :func:`_geometry` accepted."""
    samples = slice(span.sample_lo, span.sample_hi + 1)
    # The index's arrays may be narrow views (refstream.sidecar): widen the span's slice.
    dts, pts, durations, sizes = (getattr(index, name)[samples].astype(np.int64)
                                  for name in ("dts", "pts", "duration", "size"))
    relative = index.offset[samples].astype(np.int64) - span.byte_offset
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


def _geometry(index: SampleIndex, spans: Sequence[Span]
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Of each span: (chunk offset width 4 or 8, bytes before the payload, mdat header size), by
    SPEC §7.2's arithmetic; UsageError for a span that is not one of ``index``."""
    lo, hi, byte_offset, byte_length, start_pts = np.array(
        [(s.sample_lo, s.sample_hi, s.byte_offset, s.byte_length, s.start_pts) for s in spans],
        np.int64).reshape(-1, 5).T
    part, lo, hi = _check_spans(index, lo, hi, byte_offset, byte_length, start_pts)
    samples = hi - lo + 1
    moov = FIXED_MOOV_BYTES + len(index.stsd) + 8 * _run_counts(part["duration"], lo, hi)
    moov += 4 * samples
    composition = part["pts"] - part["dts"]
    shift = np.maximum(0, -_reduce_ranges(np.minimum, composition, lo, hi))
    offsets = _reduce_ranges(np.maximum, composition, lo, hi) + shift > 0  # else no ctts
    moov += np.where(offsets, 16 + 8 * _run_counts(composition, lo, hi), 0)
    sync = _sync_counts(part, lo, hi)
    moov += np.where(sync < samples, 16 + 4 * sync, 0)  # else no stss
    mdat_header = np.where(byte_length + 8 > UINT32_MAX, 16, 8)
    before_payload = len(index.ftyp or DEFAULT_FTYP) + moov + 4 * samples + mdat_header
    # co64 only makes the header longer, so one switch settles the width.
    last = _reduce_ranges(np.maximum, part["offset"], lo, hi) - byte_offset
    width = np.where(before_payload + last > UINT32_MAX, 8, 4)
    return width, before_payload + (width - 4) * samples, mdat_header  # counted 4-byte offsets


def _check_spans(index: SampleIndex, lo: np.ndarray, hi: np.ndarray, byte_offset: np.ndarray,
                 byte_length: np.ndarray, start_pts: np.ndarray
                 ) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
    """UsageError naming the first span that is not one of ``index``; else its :func:`_part`."""
    bad = ~((lo >= 0) & (lo <= hi) & (hi < len(index)))
    bad[~bad] = ~index.keyframe[lo[~bad]]
    if bad.any():
        i = int(np.argmax(bad))
        raise UsageError(f"{index.path}: span samples [{lo[i]}, {hi[i]}] are not a range of"
                         f" 0..{len(index) - 1} starting at a keyframe")
    part, first, last = _part(index, lo, hi, ("dts", "pts", "duration", "size", "offset",
                                              "keyframe"))
    begin, end = _byte_ranges(part, first, last)
    if (bad := (begin < byte_offset) | (end - byte_offset > byte_length)).any():
        i = int(np.argmax(bad))
        raise UsageError(f"{index.path}: samples [{lo[i]}, {hi[i]}] are not inside bytes"
                         f" [{byte_offset[i]}, {byte_offset[i] + byte_length[i]})")
    if (bad := part["pts"][first] != start_pts).any():
        i = int(np.argmax(bad))
        raise UsageError(f"{index.path}: span start_pts {start_pts[i]} is not the pts"
                         f" {index.pts[lo[i]]} of sample {lo[i]}")
    return part, first, last


def _run_counts(values: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """The runs of equal consecutive values (one stts or ctts entry each) in each range."""
    changes = np.append(0, np.cumsum(values[1:] != values[:-1]))
    return changes[hi] - changes[lo] + 1


def _sync_counts(part: dict, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """The sync samples (stss) of each range: its first keyframe, and each other keyframe that no
    later sample of its GOP in the range presents before."""
    keyframes, pts = np.flatnonzero(part["keyframe"]), part["pts"]
    clean = np.minimum.reduceat(pts, keyframes) >= pts[keyframes]  # whole GOPs
    cleans_before = np.append(0, np.cumsum(clean))
    first = np.searchsorted(keyframes, lo)
    last = np.searchsorted(keyframes, hi, side="right") - 1
    tail = _reduce_ranges(np.minimum, pts, keyframes[last], hi) >= pts[keyframes[last]]
    return 1 + np.where(last > first, cleans_before[last] - cleans_before[first + 1] + tail, 0)


def synthesized_sizes(index: SampleIndex, spans: Sequence[Span]) -> np.ndarray:
    """``len(synthesize(index, span, payload))`` of each span (int64), from the index alone."""
    return _geometry(index, spans)[1] + [span.byte_length for span in spans]


def synthesized_size(index: SampleIndex, span: Span) -> int:
    """``len(synthesize(index, span, payload))``, computed from the index alone."""
    return int(synthesized_sizes(index, [span])[0])


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
    width, payload_at, mdat_header = (int(value[0]) for value in _geometry(index, [span]))
    layout = _layout(index, span)
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
