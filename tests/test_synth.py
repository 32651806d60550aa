"""refstream.synth: spans against brute force, mini-MP4 frames against decoding the source with
PyAV (bit-exact), synthesized sizes against the bytes, and the co64 switch near 4 GiB."""

from __future__ import annotations

import io
import json
import math
import subprocess
from functools import cache
from pathlib import Path
from types import SimpleNamespace

import av
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from media import parse_index_bytes

from refstream.errors import FrameNotFound, TableError, UsageError
from refstream.mp4 import SampleIndex, parse_index
from refstream.synth import (
    Span,
    episode_spans,
    nominal_spans,
    select_span,
    select_spans,
    serving_pts,
    serving_samples,
    synthesize,
    synthesize_header,
    synthesized_size,
    synthesized_sizes,
)
from refstream.tools.adapters import answer

MEDIA = Path(__file__).resolve().parents[1] / "spec" / "fixtures" / "mp4"
REAL = ["av1_g2", "av1_g30", "h264_nob", "h264_intra", "h264_b", "h264_negcts", "h264_opengop",
        "h264_offset", "h264_vfr", "h265_b", "h264_audio", "mpeg4", "lerobot_av1",
        "lerobot_h264", "h264_b_co64"]


@cache
def source(name: str) -> tuple[bytes, SampleIndex]:
    data = (MEDIA / f"{name}.mp4").read_bytes()
    return data, parse_index_bytes(data, name)


def decode(data: bytes) -> dict[int, np.ndarray]:
    """pts → raw planes of every frame PyAV decodes from ``data`` (a whole MP4)."""
    frames = {}
    with av.open(io.BytesIO(data)) as container:
        for frame in container.decode(container.streams.video[0]):
            assert frame.pts not in frames
            frames[frame.pts] = frame.to_ndarray()
    return frames


@cache
def source_frames(name: str) -> dict[int, np.ndarray]:
    return decode(source(name)[0])


def mini_for(name: str, span: Span) -> bytes:
    data, index = source(name)
    return synthesize(index, span, data[span.byte_offset : span.byte_offset + span.byte_length])


def check_span_decodes(name: str, span: Span, needed_pts: np.ndarray) -> None:
    """Every frame of the mini-MP4 is the source frame at the same time; none is missing."""
    _, index = source(name)
    mini = mini_for(name, span)
    assert len(mini) == synthesized_size(index, span)
    frames = decode(mini)
    reference = source_frames(name)
    for local_pts, picture in frames.items():
        np.testing.assert_array_equal(picture, reference[local_pts + span.start_pts])
    assert set((needed_pts - span.start_pts).tolist()) <= set(frames)
    # the mini-MP4 holds exactly the span's samples, with their bytes, in decode order, and
    # FFmpeg shows each at its source time minus start_pts (leading pictures of an open-GOP
    # keyframe are marked discard)
    with av.open(io.BytesIO(mini)) as container:
        packets = [(p.pts, p.pos, p.size, p.is_discard)
                   for p in container.demux(container.streams.video[0]) if p.size]
    lo, hi = span.sample_lo, span.sample_hi
    assert len(packets) == hi - lo + 1
    source_bytes = source(name)[0]
    for k, (pts, pos, size, discard) in enumerate(packets):
        i = lo + k
        assert size == index.size[i]
        assert mini[pos : pos + size] == source_bytes[index.offset[i] : index.offset[i] + size]
        assert discard == (index.pts[i] < span.start_pts)
        if not discard:
            assert pts == index.pts[i] - span.start_pts


@settings(max_examples=300, deadline=None)
@given(timescale=st.sampled_from([1, 30, 1000, 1024, 15360, 90000]),
       pts=st.lists(st.integers(-10**6, 10**9), max_size=12),
       picks=st.lists(st.tuples(st.integers(0, 11), st.sampled_from([-1, 0, 1]),
                                st.integers(-2, 2)), max_size=12),
       tolerance_s=st.sampled_from([0.0, 2.0**-10, 1e-4, 0.01, 0.5]))
def test_serving_samples_is_the_rule_over_every_pair(timescale, pts, picks, tolerance_s):
    """Oracle: |pts / timescale - t| <= tol in plain Python floats over every (time, sample)
    pair; times sit on frames, at frame ± tol, and a few ulps around those edges."""
    times = []
    for position, side, ulps in picks:
        t = (pts[position % len(pts)] / timescale if pts else 0.0) + side * tolerance_s
        for _ in range(abs(ulps)):
            t = math.nextafter(t, math.copysign(math.inf, ulps))
        times.append(t)
    matches = serving_samples(np.array(pts, np.int64), timescale, np.array(times), tolerance_s)
    expected = sorted((r, i) for r, t in enumerate(times) for i, p in enumerate(pts)
                      if abs(p / timescale - t) <= tolerance_s)
    pairs = zip(matches.request.tolist(), matches.sample.tolist(), strict=True)
    assert sorted(pairs) == expected
    assert list(matches.request) == sorted(matches.request)
    for r, i, d in zip(matches.request, matches.sample, matches.distance_s, strict=True):
        assert d == abs(pts[i] / timescale - times[r])
    assert matches.unserved(len(times)).tolist() == sorted(
        set(range(len(times))) - {r for r, _ in expected})


def brute_span(index: SampleIndex, times_s: list[float], tol: float) -> tuple[int, int]:
    """The span rule written as plain loops over samples."""
    n = len(index)
    needed = [i for i in range(n)
              if any(abs(index.pts[i] / index.timescale - t) <= tol for t in times_s)]
    earliest = min(index.pts[i] for i in needed)
    lo = max(k for k in range(min(needed) + 1)
             if index.keyframe[k] and index.pts[k] <= earliest)
    hi = max(needed)
    if any(index.pts[i + 1] <= index.pts[i] for i in range(n - 1)):
        hi = next((k - 1 for k in range(hi + 1, n) if index.keyframe[k]), n - 1)
    return lo, hi


@st.composite
def mapped_indexes(draw):
    """A random index as workers see it: mapped from a record, in narrow stored dtypes."""
    from refstream.sidecar import read_record, record_bytes

    n = draw(st.integers(1, 120))
    durations = draw(st.lists(st.integers(0, 3000), min_size=n, max_size=n))
    dts = np.cumsum(durations) - durations[0] + draw(st.integers(-5000, 5000))
    shifts = draw(st.lists(st.integers(-2, 3), min_size=n, max_size=n))
    pts = dts + (np.array(shifts) * draw(st.sampled_from([0, 1, 512])))
    keyframe = np.array(draw(st.lists(st.booleans(), min_size=n, max_size=n)))
    keyframe[0] = draw(st.booleans()) or keyframe[0]
    size = np.array(draw(st.lists(st.integers(1, 70_000), min_size=n, max_size=n)))
    index = SampleIndex(path="p", file_size=10**7, ftyp=b"", stsd=b"\x01", codec="avc1",
                        width=2, height=2, track_id=1,
                        timescale=draw(st.sampled_from([30, 1024, 15360, 90000])),
                        movie_timescale=1000, dts=dts, pts=pts,
                        duration=np.array(durations), size=size,
                        offset=100 + np.cumsum(size) - size, keyframe=keyframe)
    return read_record(io.BytesIO(record_bytes(index, "k")), 10**7, "k", "p"), index


@settings(max_examples=300, deadline=None)
@given(indexes=mapped_indexes(), data=st.data())
def test_spans_of_narrow_mapped_indexes_follow_the_rule(indexes, data):
    """select_span reads only a window of the (narrow) arrays: it still finds what the rule,
    written as plain loops over every sample of the int64 index, finds."""
    mapped, index = indexes
    tol = data.draw(st.sampled_from([0.0, 1e-4, 0.02, 1.0]))
    picks = data.draw(st.lists(st.integers(0, len(index) - 1), min_size=1, max_size=6))
    jitter = data.draw(st.sampled_from([0.0, tol / 2, tol * 1.5, -tol]))
    times = [index.pts[i] / index.timescale + jitter for i in picks]
    served = all(any(abs(p / index.timescale - t) <= tol for p in index.pts) for t in times)
    try:
        expected = brute_span(index, times, tol) if served else None
    except ValueError:  # no keyframe presents early enough
        expected = None
    if expected is None:
        with pytest.raises(FrameNotFound):
            select_span(mapped, min(times), max(times), tol, np.array(times))
        return
    span = select_span(mapped, min(times), max(times), tol, np.array(times))
    assert (span.sample_lo, span.sample_hi) == expected
    assert span == select_span(index, min(times), max(times), tol, np.array(times))
    assert synthesized_size(mapped, span) == synthesized_size(index, span)


@settings(max_examples=300, deadline=None)
@given(indexes=mapped_indexes(), data=st.data())
def test_the_spans_of_several_episodes_at_once_are_each_ones_own(indexes, data):
    """select_spans of episodes in one file: each episode's select_span, or the error one call
    per episode raises first (unserved, empty, out of order, no keyframe early enough)."""
    mapped, index = indexes
    tol = data.draw(st.sampled_from([0.0, 1e-4, 0.02, 1.0]))
    episodes = data.draw(st.lists(st.lists(st.integers(0, len(index) - 1), max_size=5),
                                  min_size=1, max_size=6))
    jitter = data.draw(st.sampled_from([0.0, tol / 2, tol * 1.5, -tol]))
    times = [[index.pts[i] / index.timescale + jitter for i in picks] for picks in episodes]
    from_s = [min(t, default=0.0) for t in times]
    to_s = [max(t, default=0.0) - data.draw(st.sampled_from([0.0, 0.0, 1.0])) for t in times]
    expected = []
    try:
        for a, b, t in zip(from_s, to_s, times, strict=True):
            expected.append(select_span(index, a, b, tol, np.array(t, np.float64)))
    except (FrameNotFound, UsageError) as exc:
        expected = exc
    flat = np.array([t for each in times for t in each], np.float64)
    lengths = [len(t) for t in times]
    if isinstance(expected, Exception):
        with pytest.raises(type(expected)) as caught:
            select_spans(mapped, from_s, to_s, flat, lengths, tol)
        assert str(caught.value) == str(expected)
        return
    assert select_spans(mapped, from_s, to_s, flat, lengths, tol) == expected
    assert synthesized_sizes(mapped, expected).tolist() == [synthesized_size(index, span)
                                                            for span in expected]


def files_of_episodes(names: list[str], seed: int) -> tuple[SimpleNamespace, dict]:
    """Metadata of episodes cut at random from each of ``names`` (one video file each, shared by
    two cameras: the second's episodes start a frame later), and the files' indexes."""
    rng = np.random.default_rng(seed)
    indexes, lengths, from_s, files = {}, [], [], []
    for file, name in enumerate(names):
        index = indexes[f"videos/{file}.mp4"] = source(name)[1]
        presented = np.sort(index.pts) / index.timescale
        fps = round(1 / float(np.median(np.diff(presented))))
        regular = np.abs(np.diff(presented) - 1 / fps) < 1e-6  # the next frame 1 / fps later
        first = 0
        while first + 2 < len(presented):
            length = int(min(rng.integers(1, 12), len(presented) - first - 1))
            if regular[first:first + length].all():  # a frame a row, and one more for camera b
                lengths.append(length)
                from_s.append(float(presented[first]))
                files.append(file)
            first += length
    from_s, files, lengths = np.array(from_s), np.array(files), np.array(lengths)
    return SimpleNamespace(
        fps=fps, camera_keys=["a", "b"], length=lengths, row=lambda e: e,
        frames=lambda e: int(lengths[e]),
        video_relpath=lambda e, camera: f"videos/{files[e]}.mp4",
        video_chunk={"a": 0 * files, "b": 0 * files}, video_file={"a": files, "b": files},
        video_from_s={"a": from_s, "b": from_s + 1 / fps},
        video_to_s={"a": from_s + lengths / fps, "b": from_s + (lengths + 1) / fps}), indexes


@pytest.mark.parametrize("names", [["lerobot_av1", "av1_g30"], ["h264_b", "lerobot_h264"],
                                   ["h264_opengop", "h264_negcts"], ["h265_b", "av1_g2"]])
def test_nominal_spans_are_each_episodes_and_their_sizes_the_bytes(names):
    # Oracle: each episode's own episode_spans, and the length of the mini-MP4s synthesized from
    # the source's bytes; episodes of several files of real encoders, in a shuffled order.
    meta, indexes = files_of_episodes(names, seed=len(names[0]))
    episodes = np.random.default_rng(7).permutation(len(meta.length))[:40].tolist()
    spans, sizes = nominal_spans(meta, episodes, indexes, 1e-4)
    assert list(spans) == episodes
    for episode in episodes:
        assert spans[episode] == episode_spans(meta, episode, indexes, 1e-4)
        data = source(names[int(meta.video_file["a"][episode])])[0]
        assert sizes[episode] == sum(
            len(synthesize(index, span, data[span.byte_offset:span.byte_offset
                                             + span.byte_length]))
            for index, span in spans[episode].values())


def test_nominal_spans_raise_what_the_first_failing_episode_raises():
    # Episodes of the second file come first: its failing one is the first to fail.
    meta, indexes = files_of_episodes(["lerobot_av1", "lerobot_h264"], seed=1)
    first, second = (int(np.flatnonzero(meta.video_file["a"] == f)[1]) for f in (0, 1))
    meta.video_from_s["b"][[first, second]] += 0.5 / meta.fps  # rows between two frames
    with pytest.raises(FrameNotFound) as expected:
        episode_spans(meta, second, indexes, 1e-4)
    with pytest.raises(FrameNotFound) as caught:
        nominal_spans(meta, [0, second, first], indexes, 1e-4)
    assert str(caught.value) == str(expected.value)


@pytest.mark.parametrize("name", ["lerobot_av1", "lerobot_h264"])
def test_every_episode_decodes_bit_exact(name):
    _, index = source(name)
    doc = json.loads((MEDIA / f"{name}.json").read_text())
    fps = doc["fps"]
    covered = []
    for episode in doc["episodes"]:
        times = episode["from_s"] + np.arange(episode["frames"]) / fps
        tol = 1e-4
        span = select_span(index, episode["from_s"], episode["to_s"], tol, times)
        assert (span.sample_lo, span.sample_hi) == brute_span(index, list(times), tol)
        needed = index.pts[np.abs(index.pts[:, None] / index.timescale - times).min(1) <= tol]
        assert len(needed) == episode["frames"]
        check_span_decodes(name, span, needed)
        covered.append(span)
    # each episode's span starts at its own first keyframe: no span reaches the previous episode
    for previous, span in zip(covered, covered[1:], strict=False):
        assert span.sample_lo > previous.sample_lo


@pytest.mark.parametrize("name", REAL)
def test_single_frame_spans_at_gop_edges_and_end(name):
    _, index = source(name)
    n = len(index)
    keys = np.flatnonzero(index.keyframe)
    picks = {0, n - 1, n - 2, *keys.tolist(), *(keys[1:] - 1).tolist(), *(keys + 1).tolist()}
    # B-frames: samples that present before an earlier-decoded sample
    picks |= set(np.flatnonzero(np.diff(index.pts) < 0) + 1)
    for i in sorted(p for p in picks if 0 <= p < n):
        t = index.pts[i] / index.timescale
        span = select_span(index, t, t, 1e-4, np.array([t]))
        assert (span.sample_lo, span.sample_hi) == brute_span(index, [t], 1e-4)
        check_span_decodes(name, span, index.pts[i : i + 1])


@pytest.mark.parametrize("name", ["h264_b", "h264_opengop", "h265_b", "h264_vfr"])
def test_interval_spans_match_brute_force(name):
    _, index = source(name)
    rng = np.random.default_rng(7)
    end_s = (index.pts.max() + index.duration[-1]) / index.timescale
    for _ in range(25):
        a, b = sorted(rng.uniform(0, end_s, 2))
        tol = float(rng.choice([1e-4, 0.01, 0.02]))
        pts_s = index.pts / index.timescale
        if not np.any((pts_s >= a - tol) & (pts_s < b + tol)):
            continue
        span = select_span(index, a, b, tol)
        # times the interval can request: dense grid plus the frame times inside it
        inside = [float(t) for t in pts_s if a - tol <= t < b + tol]
        assert (span.sample_lo, span.sample_hi) == brute_span(index, inside, 0.0)
        check_span_decodes(name, span, index.pts[(pts_s >= a - tol) & (pts_s < b + tol)])


def test_span_byte_range_covers_exactly_the_span():
    _, index = source("h264_audio")
    span = select_span(index, 0.4, 0.8, 1e-4)
    sl = slice(span.sample_lo, span.sample_hi + 1)
    assert span.byte_offset == index.offset[sl].min()
    assert span.byte_offset + span.byte_length == (index.offset[sl] + index.size[sl]).max()
    assert index.keyframe[span.sample_lo]


def test_request_time_without_frame_is_an_error():
    _, index = source("h264_nob")
    with pytest.raises(FrameNotFound, match="1.0005"):
        select_span(index, 0.0, 2.0, 1e-4, np.array([0.0, 1.0005]))


def test_size_equals_length_over_many_spans():
    for name in ["h264_b", "h264_opengop", "av1_g30", "h264_audio"]:
        data, index = source(name)
        n = len(index)
        keys = np.flatnonzero(index.keyframe)
        for lo in keys:
            for hi in range(lo, n, 3):
                sl = slice(lo, hi + 1)
                begin = int(index.offset[sl].min())
                end = int((index.offset[sl] + index.size[sl]).max())
                span = Span(int(lo), hi, begin, end - begin, int(index.pts[lo]))
                assert len(synthesize(index, span, data[begin:end])) == synthesized_size(index,
                                                                                         span)


def fake_index(offsets: np.ndarray, sizes: np.ndarray) -> SampleIndex:
    """A constructed index (three B-frame GOPs' worth of timing) at arbitrary byte offsets."""
    _, real = source("h264_b")
    n = len(offsets)
    return SampleIndex(
        path="fake", file_size=int((offsets + sizes).max()), ftyp=real.ftyp, stsd=real.stsd,
        codec=real.codec, width=real.width, height=real.height, track_id=1,
        timescale=real.timescale, movie_timescale=1000, dts=real.dts[:n], pts=real.pts[:n],
        duration=real.duration[:n], size=sizes, offset=offsets, keyframe=real.keyframe[:n])


def read_header_as_file(header: bytes, total: int):
    """A read_range over a virtual file: the real header, then zero payload that only the first
    (fixed-size) probe may touch."""
    def read(offset: int, length: int) -> bytes:
        assert offset == 0 or offset + length <= len(header), "the parser read payload bytes"
        assert offset + length <= total
        return (header[offset : offset + length]).ljust(length, b"\0")
    return read


@pytest.mark.parametrize("base", [0, 2**32 - 5000, 2**32 + 10**6, 2**40])
def test_header_offsets_with_huge_source_offsets(base):
    """Source offsets near/after 4 GiB rebase to small mini-MP4 offsets: stco stays exact."""
    sizes = np.full(24, 100, dtype=np.int64)
    offsets = base + np.arange(24, dtype=np.int64) * 100
    index = fake_index(offsets, sizes)
    span = Span(0, 23, base, 2400, int(index.pts[0]))
    header = synthesize_header(index, span)
    total = synthesized_size(index, span)
    assert total == len(header) + 2400
    inner = parse_index(read_header_as_file(header, total), total, "mini")
    np.testing.assert_array_equal(inner.offset, len(header) + offsets - base)
    assert b"stco" in header and b"co64" not in header


@pytest.mark.parametrize("payload_end", [2**32 - 1 - 40, 2**32 + 7, 5 * 2**32])
def test_co64_switch_near_4_gib(payload_end):
    """A payload near 4 GiB: the last sample offset decides stco vs co64, exactly."""
    sizes = np.full(24, 10, dtype=np.int64)
    offsets = np.arange(24, dtype=np.int64) * 10
    offsets[-1] = payload_end - 10  # the last sample sits at the end of a huge range
    index = fake_index(offsets, sizes)
    span = Span(0, 23, 0, payload_end, int(index.pts[0]))
    header = synthesize_header(index, span)
    total = synthesized_size(index, span)
    assert total == len(header) + payload_end
    inner = parse_index(read_header_as_file(header, total), total, "mini")
    np.testing.assert_array_equal(inner.offset, len(header) + offsets)
    wide = len(header) + offsets[-1] > 2**32 - 1
    assert (b"co64" in header) == wide and (b"stco" in header) != wide
    if payload_end + 8 > 2**32 - 1:  # a 64-bit mdat size: size field 1, then the real size
        assert header[-16:-8] == b"\0\0\0\1mdat" and int.from_bytes(header[-8:]) == total - (
            len(header) - 16)
    else:
        assert header[-4:] == b"mdat"


def test_co64_boundary_is_exact():
    """Search the payload length where the header's own growth tips stco over to co64."""
    sizes = np.full(24, 10, dtype=np.int64)

    def layout(last_offset: int) -> tuple[int, bool]:
        offsets = np.arange(24, dtype=np.int64) * 10
        offsets[-1] = last_offset
        index = fake_index(offsets, sizes)
        span = Span(0, 23, 0, last_offset + 10, int(index.pts[0]))
        header = synthesize_header(index, span)
        assert synthesized_size(index, span) == len(header) + last_offset + 10
        return len(header), b"co64" in header

    stco_header, _ = layout(1000)
    edge = 2**32 - 1 - stco_header  # largest last offset that still fits 32 bits with stco
    assert layout(edge) == (stco_header, False)
    co64_header, wide = layout(edge + 1)
    assert wide and co64_header == stco_header + 4 * 24
    # offsets just below the edge plus the co64 growth: still co64 only if they overflow
    assert layout(edge - 4 * 24)[1] is False


SPAN_CASES = sorted((MEDIA.parent / "span").glob("*.json"))
SYNTH_CASES = sorted((MEDIA.parent / "synth").glob("*.json"))


@pytest.mark.parametrize("case", SPAN_CASES, ids=[c.stem for c in SPAN_CASES])
def test_conformance_span(case):
    doc = json.loads(case.read_text())
    assert doc["kind"] == "span" and answer("span", doc["input"]) == doc["expected"]


@pytest.mark.parametrize("case", SYNTH_CASES, ids=[c.stem for c in SYNTH_CASES])
def test_conformance_synth(case):
    doc = json.loads(case.read_text())
    assert doc["kind"] == "synth" and answer("synth", doc["input"]) == doc["expected"]


def test_interval_without_frames_is_an_error():
    _, index = source("h264_nob")
    with pytest.raises(FrameNotFound):
        select_span(index, 50.0, 60.0, 1e-4)
    with pytest.raises(FrameNotFound):
        select_span(index, 0.0, 1.0, 1e-4, np.array([]))


@pytest.mark.parametrize("name", ["h264_opengop", "h265_b", "h264_negcts", "lerobot_h264"])
def test_ffprobe_reads_the_mini_mp4_on_the_local_timeline(name, tmp_path):
    """A second FFmpeg (Debian's ffprobe) agrees: every sample is there, leading pictures of an
    open-GOP start are marked discard, the others present at source pts - start_pts."""
    _, index = source(name)
    for i in np.flatnonzero(index.keyframe):
        t = index.pts[i] / index.timescale
        span = select_span(index, t, t + 0.2, 1e-4)
        path = tmp_path / "mini.mp4"
        path.write_bytes(mini_for(name, span))
        out = subprocess.run(["ffprobe", "-v", "error", "-show_entries", "packet=pts,flags",
                              "-of", "json", str(path)], check=True, capture_output=True,
                             text=True).stdout
        packets = json.loads(out)["packets"]
        assert len(packets) == span.sample_hi - span.sample_lo + 1
        for k, packet in enumerate(packets):
            source_pts = index.pts[span.sample_lo + k]
            assert ("D" in packet["flags"]) == (source_pts < span.start_pts)
            if "D" not in packet["flags"]:
                assert int(packet["pts"]) == source_pts - span.start_pts


def test_inconsistent_spans_are_usage_errors():
    data, index = source("h264_b")
    good = select_span(index, 0.5, 0.6, 1e-4)
    payload = data[good.byte_offset : good.byte_offset + good.byte_length]
    bad_spans = [
        Span(good.sample_lo + 1, good.sample_hi, good.byte_offset, good.byte_length,
             int(index.pts[good.sample_lo + 1])),  # does not start at a keyframe
        Span(good.sample_lo, good.sample_hi, good.byte_offset + 1, good.byte_length,
             good.start_pts),  # bytes do not hold the first sample
        Span(good.sample_lo, good.sample_hi, good.byte_offset, good.byte_length,
             good.start_pts + 1),  # start_pts is not pts[lo]
    ]
    for span in bad_spans:
        with pytest.raises(UsageError):
            synthesize(index, span, payload)
    with pytest.raises(UsageError):
        synthesize(index, good, payload[:-1])


def test_a_span_allocates_memory_for_its_samples_not_for_its_file():
    """A worker plans a span in every file its episodes touch (thousands at DROID's size) and
    keeps every index, so planning one must not leave an array over the whole file behind: after
    a short span near the end of a 2,000,000-sample index, far less than one int64 array of it
    stays allocated."""
    import tracemalloc

    n = 2_000_000
    ticks = np.arange(n, dtype=np.int64) * 512
    keyframe = np.zeros(n, dtype=bool)
    keyframe[::2] = True
    sizes = np.full(n, 100, dtype=np.int64)
    index = SampleIndex(path="p", file_size=100 * n + 100, ftyp=b"", stsd=b"\x01",
                        codec="av01", width=2, height=2, track_id=1, timescale=15360,
                        movie_timescale=1000, dts=ticks, pts=ticks, duration=np.full(n, 512),
                        size=sizes, offset=100 + np.arange(n, dtype=np.int64) * 100,
                        keyframe=keyframe)
    times = ticks[n - 40 : n - 10] / 15360
    tracemalloc.start()
    try:
        span = select_span(index, float(times[0]), float(times[-1]), 1e-4, times)
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert (span.sample_lo, span.sample_hi) == (n - 40, n - 11)
    assert held < n * 8 // 10, f"planning one span left {held:,} bytes allocated"


def one_episode(index: SampleIndex, first: int, frames: int, fps: int) -> SimpleNamespace:
    """What synth reads of a dataset's metadata: one episode of ``frames`` rows on one camera,
    starting at the file's ``first`` presented frame."""
    from_s = float(np.sort(index.pts)[first]) / index.timescale
    return SimpleNamespace(fps=fps, camera_keys=["cam"], frames=lambda e: frames,
                           row=lambda e: 0, data_relpath=lambda e: "data.parquet",
                           video_relpath=lambda e, camera: "video.mp4",
                           video_from_s={"cam": np.array([from_s])},
                           video_to_s={"cam": np.array([from_s + frames / fps])})


@pytest.mark.parametrize("name", ["h264_b", "av1_g30", "h264_opengop"])
def test_serving_pts_is_each_rows_nearest_frame_inside_the_planned_span(name):
    # Oracle: every frame of the file against every row, in binary64 as SPEC §7.1 writes it;
    # the nearest that serves, then the earliest. Rows 0.4 frame late with a tolerance of 0.7
    # frame: two frames serve each row.
    _, index = source(name)
    presented = np.sort(index.pts)
    fps = round(index.timescale / float(np.median(np.diff(presented))))
    rows, tolerance_s = len(index) // 2, 0.7 / fps
    meta = one_episode(index, 3, rows, fps)
    from_s = float(meta.video_from_s["cam"][0])
    timestamps = ((np.arange(rows) + 0.4) / fps).astype(np.float32)
    planned = episode_spans(meta, 0, {"video.mp4": index}, tolerance_s, timestamps)
    chosen = serving_pts(meta, 0, planned, tolerance_s, timestamps)["cam"]
    expected = []
    for t in from_s + timestamps.astype(np.float64):
        distances = [(abs(int(p) / index.timescale - t), int(p)) for p in index.pts]
        expected.append(min(d for d in distances if d[0] <= tolerance_s)[1])
    assert chosen.tolist() == expected
    # The last row asks for the file's last frame, beyond the span planned from frame_index / fps.
    nominal = episode_spans(meta, 0, {"video.mp4": index}, 1e-4)
    late = (np.arange(rows) / fps).astype(np.float32)
    late[-1] = np.float32(presented[-1] / index.timescale - from_s)
    with pytest.raises(TableError, match="outside samples"):
        serving_pts(meta, 0, nominal, 1e-4, late)
