"""refstream.decode against plain PyAV: every frame of small real files (H.264 with and without
B-frames, open GOP, AV1), requested by presentation time from the bytes held in memory, equals the
frame a full decode of the file yields at that pts; the frame serving a time is chosen within
tolerance, never guessed past; the decoder LRU is bounded; a frame a later request wants is kept,
within a bound in bytes, so each GOP is decoded once."""

import io
import json
import math
from pathlib import Path

import av
import numpy as np
import pytest
import torch
from make_sidecar_decode_fixtures import FIXTURES, oracle_frame_select
from media import (
    counted,
    decode_all,
    encode_video,
    index_from_pyav,
    parse_index_bytes,
    pattern_frames,
)

from refstream import decode
from refstream.decode import DecoderCache, EpisodeDecoder
from refstream.errors import DecodeError, FrameNotFound, UsageError
from refstream.synth import select_frames, select_span, synthesize
from refstream.tools import conformance

VIDEOS = {  # name: (codec, gop, bframes, open_gop)
    "h264-bframes": ("libx264", 10, 2, False),
    "h264-open-gop": ("libx264", 8, 3, True),
    "h264-ipp": ("libx264", 30, 0, False),
    "av1": ("libsvtav1", 10, 0, False),
}
FRAMES = 30


@pytest.fixture(scope="module")
def videos(tmp_path_factory) -> dict[str, tuple[bytes, dict[int, np.ndarray]]]:
    """name -> (whole-file bytes, {pts: RGB frame} from a plain PyAV decode of the file)."""
    folder = tmp_path_factory.mktemp("decode")
    made = {}
    for name, (codec, gop, bframes, open_gop) in VIDEOS.items():
        path = encode_video(folder / f"{name}.mp4", pattern_frames(FRAMES), codec, gop, bframes,
                            open_gop)
        made[name] = (Path(path).read_bytes(), decode_all(path))
    return made


def timescale(data: bytes) -> int:
    """The video's ticks per second as plain PyAV reports them (its time base is 1 / that)."""
    with av.open(io.BytesIO(data)) as container:
        return container.streams.video[0].time_base.denominator


def seconds(data: bytes, pts: int) -> float:
    return pts / timescale(data)


def chw(frame_hwc: np.ndarray) -> np.ndarray:
    return frame_hwc.transpose(2, 0, 1)


def frames_at(decoder: EpisodeDecoder, data: bytes, oracle: dict, times_s, tolerance_s: float,
              dtype=np.uint8) -> np.ndarray:
    """The frames serving ``times_s``: select_frames over every pts of the file, then decoded."""
    pts = np.array(sorted(oracle), dtype=np.int64)
    chosen = select_frames(pts, timescale(data), times_s, tolerance_s, decoder.label)
    return decoder.frames(pts[chosen], dtype)


def test_the_files_have_what_the_cases_need(videos):
    # Reordered files present frames in another order than they are decoded (B-frames).
    for name, (data, oracle) in videos.items():
        assert len(oracle) == FRAMES, name
        pts = index_from_pyav(data, name).pts
        assert bool(np.any(np.diff(pts) < 0)) == (VIDEOS[name][2] > 0), name


@pytest.mark.parametrize("name", list(VIDEOS))
def test_every_frame_one_request_at_a_time_backwards(videos, name):
    data, oracle = videos[name]
    with EpisodeDecoder(data, "episode 0 camera top") as decoder:
        for pts in sorted(oracle, reverse=True):  # every request seeks backwards
            frames = decoder.frames([pts])
            assert frames.shape == (1, 3, 48, 64) and frames.dtype == np.uint8
            np.testing.assert_array_equal(frames[0], chw(oracle[pts]), err_msg=f"pts {pts}")


@pytest.mark.parametrize("name", list(VIDEOS))
def test_repeated_and_unordered_requests_in_one_call(videos, name):
    data, oracle = videos[name]
    rng = np.random.default_rng(7)
    wanted = rng.choice(sorted(oracle), size=45)  # repeats included, shuffled
    with EpisodeDecoder(data) as decoder:
        frames = decoder.frames(wanted)
    expected = np.stack([chw(oracle[p]) for p in wanted])
    np.testing.assert_array_equal(frames, expected)


def test_a_time_within_tolerance_picks_the_nearest_frame(videos):
    data, oracle = videos["h264-bframes"]
    pts = sorted(oracle)
    with EpisodeDecoder(data) as decoder:
        step = seconds(data, pts[1]) - seconds(data, pts[0])  # one frame: 1/30 s
        late = seconds(data, pts[12]) + 0.3 * step  # nearer frame 12 than 13
        early = seconds(data, pts[12]) - 0.3 * step
        frames = frames_at(decoder, data, oracle, [late, early], tolerance_s=0.4 * step)
    np.testing.assert_array_equal(frames[0], chw(oracle[pts[12]]))
    np.testing.assert_array_equal(frames[1], chw(oracle[pts[12]]))


@pytest.mark.parametrize("where", ["between frames", "after the last", "before the first"])
def test_a_time_matching_no_frame_within_tolerance_raises(videos, where):
    data, oracle = videos["h264-bframes"]
    pts = sorted(oracle)
    with EpisodeDecoder(data, "episode 7 camera wrist") as decoder:
        step = seconds(data, pts[1]) - seconds(data, pts[0])
        time_s = {
            "between frames": seconds(data, pts[5]) + 0.5 * step,
            "after the last": seconds(data, pts[-1]) + step,
            "before the first": -step,
        }[where]
        with pytest.raises(FrameNotFound, match="episode 7 camera wrist") as caught:
            frames_at(decoder, data, oracle, [seconds(data, pts[3]), time_s], 0.25 * step)
        assert "1 of 2 request times" in str(caught.value)
        assert f"first {time_s:.6f} s" in str(caught.value)
        # The same time with a tolerance that reaches a frame is served.
        frames_at(decoder, data, oracle, [time_s], tolerance_s=1.01 * step)


@pytest.mark.parametrize("name", ["h264-bframes", "av1"])
def test_the_edges_of_the_tolerance(videos, name):
    # SPEC §7.1 in binary64: a frame exactly at t + tol serves t, one ulp of t further it does
    # not; tolerance 0 serves times equal to pts / timescale. A frame at an exact binary
    # fraction of a second (0.5 s) and a tolerance of 2^-10 make t + tol exact.
    data, oracle = videos[name]
    with EpisodeDecoder(data, "episode 2 camera top") as decoder:
        edge = [p for p in sorted(oracle) if p / timescale(data) == 0.5]
        assert edge, "the video has a frame at 0.5 s"
        frames = frames_at(decoder, data, oracle, [0.5 - 2**-10], tolerance_s=2**-10)
        np.testing.assert_array_equal(frames[0], chw(oracle[edge[0]]))
        with pytest.raises(FrameNotFound):
            frames_at(decoder, data, oracle, [math.nextafter(0.5 - 2**-10, 0.0)], 2**-10)
        wanted = sorted(oracle)[3:9]
        frames = frames_at(decoder, data, oracle, [p / timescale(data) for p in wanted], 0.0)
        np.testing.assert_array_equal(frames, np.stack([chw(oracle[p]) for p in wanted]))
        with pytest.raises(FrameNotFound):
            frames_at(decoder, data, oracle, [math.nextafter(wanted[0] / timescale(data), 1.0)],
                      0.0)


def test_no_request_gives_an_empty_batch(videos):
    with EpisodeDecoder(videos["av1"][0]) as decoder:
        assert decoder.frames([]).shape == (0, 3, 48, 64)


@pytest.mark.parametrize("name", ["av1", "h264-bframes"])
def test_float_frames_are_the_oracle_over_255_as_lerobot_divides(videos, name):
    # LeRobot: torch float32(frames) / 255 — compared bit for bit, repeats and any order.
    data, oracle = videos[name]
    with EpisodeDecoder(data) as decoder:
        pts = sorted(oracle)
        wanted = [pts[5], pts[0], pts[5], pts[-1]]
        frames = decoder.frames(wanted, np.float32)
    expected = torch.stack([torch.from_numpy(chw(oracle[p]).copy()) for p in wanted])
    expected = expected.to(torch.float32) / 255
    assert frames.dtype == np.float32
    np.testing.assert_array_equal(frames.view(np.uint32), expected.numpy().view(np.uint32))


def test_only_uint8_and_float32_frames(videos):
    with EpisodeDecoder(videos["av1"][0]) as decoder, pytest.raises(UsageError, match="float32"):
        decoder.frames([0], np.float64)


@pytest.mark.parametrize("name", ["h264-ipp", "h264-bframes"])
def test_a_request_decodes_from_its_keyframe_to_the_last_frame_asked(videos, name):
    # Oracle: frames leave the decoder in presentation order (B-frames or not).
    data, oracle = videos[name]
    pts = sorted(oracle)
    with EpisodeDecoder(data) as decoder:
        decoded = counted(decoder)
        decoder.frames([pts[0]])
        assert sum(decoded) == 1
        decoder.frames([pts[3], pts[1]])
        assert sum(decoded) == 1 + 4  # presented 0..3, from the keyframe at 0


def test_bytes_that_are_not_a_video_raise_decode_error(videos):
    data = videos["h264-ipp"][0]
    with pytest.raises(DecodeError, match="episode 1 camera top"):
        EpisodeDecoder(b"this is not an mp4" * 10, "episode 1 camera top")
    # PyAV writes moov last: the first half of the file has no index at all.
    with pytest.raises(DecodeError):
        EpisodeDecoder(data[: len(data) // 2])


# Episode windows [from_s, to_s) of the 1 s files: GOP edges, a single frame, the last frames.
SPANS_S = [(0.0, 0.2), (0.2, 0.5), (8 / 30, 9 / 30), (0.5, 1.0), (29 / 30, 1.0)]


@pytest.mark.parametrize("name", list(VIDEOS))
def test_mini_mp4s_of_episode_spans_decode_to_the_source_frames(videos, name):
    # The real path: index the source, cut the span's bytes, synthesize, decode by pts.
    data, oracle = videos[name]
    index = parse_index_bytes(data, name)
    for from_s, to_s in SPANS_S:
        span = select_span(index, from_s, to_s, 1e-4)
        payload = data[span.byte_offset : span.byte_offset + span.byte_length]
        wanted = [p for p in sorted(oracle) if from_s - 1e-4 <= p / index.timescale < to_s - 1e-4]
        assert wanted, (name, from_s, to_s)
        with EpisodeDecoder(synthesize(index, span, payload), f"{name} {from_s}-{to_s}") as dec:
            local = [p - span.start_pts for p in wanted]
            frames = dec.frames(local[::-1])  # any order
            for frame, pts in zip(frames, wanted[::-1], strict=True):
                np.testing.assert_array_equal(frame, chw(oracle[pts]), err_msg=f"{name} {pts}")
            for one, pts in zip(local, wanted, strict=True):  # one request at a time
                np.testing.assert_array_equal(dec.frames([one])[0], chw(oracle[pts]))
        # Source-file pts, with the span's start as the video's local 0 (as streaming asks).
        with EpisodeDecoder(synthesize(index, span, payload), name, span.start_pts) as dec:
            frames = dec.frames(wanted)
            np.testing.assert_array_equal(frames, np.stack([chw(oracle[p]) for p in wanted]))


# --- frames kept for later requests --------------------------------------------------------

def window_requests(oracle: dict, seed: int) -> list[list[int]]:
    """Every frame as an anchor, in a shuffled order, asking for itself and the frame before
    (the first frame twice, as a clamped window asks)."""
    pts = sorted(oracle)
    anchors = np.random.default_rng(seed).permutation(len(pts))
    return [[pts[max(0, a - 1)], pts[a]] for a in anchors]


def demand_of(requests: list[list[int]]) -> dict[int, int]:
    counts: dict[int, int] = {}
    for pts in (p for request in requests for p in request):
        counts[pts] = counts.get(pts, 0) + 1
    return counts


@pytest.mark.parametrize("name", list(VIDEOS))
def test_each_frame_is_decoded_once_while_later_requests_want_it(videos, name):
    data, oracle = videos[name]
    index = index_from_pyav(data, name)
    requests = window_requests(oracle, seed=5)
    demand = demand_of(requests)
    with EpisodeDecoder(data, name, keyframes=index.pts[index.keyframe],
                        demand=demand) as decoder:
        decoded = counted(decoder)
        for request in requests:
            frames = decoder.frames(request, room=10**9)
            np.testing.assert_array_equal(frames, np.stack([chw(oracle[p]) for p in request]))
            assert all(demand[p] > 0 for p in decoder.kept)  # only what a later request wants
        assert sum(decoded) == FRAMES  # each GOP once, every frame of it wanted
        assert decoder.kept == {} and decoder.kept_bytes == 0  # all served: nothing held
    assert set(demand.values()) == {0}


@pytest.mark.parametrize("name", ["h264-bframes", "av1"])
def test_kept_frames_stay_within_the_room(videos, name):
    data, oracle = videos[name]
    index = index_from_pyav(data, name)
    requests = window_requests(oracle, seed=6)
    with av.open(io.BytesIO(data)) as container:  # a decoded frame's bytes, padding included
        frame_bytes = sum(p.buffer_size for p in next(container.decode(video=0)).planes)
    counts = []
    for room in (0, 3 * frame_bytes):
        with EpisodeDecoder(data, name, keyframes=index.pts[index.keyframe],
                            demand=demand_of(requests)) as decoder:
            decoded = counted(decoder)
            for request in requests:
                frames = decoder.frames(request, room=room - decoder.kept_bytes)
                np.testing.assert_array_equal(frames,
                                              np.stack([chw(oracle[p]) for p in request]))
                assert decoder.kept_bytes <= room and len(decoder.kept) <= room // frame_bytes
            counts.append(sum(decoded))
    with EpisodeDecoder(data, name) as alone:  # no demand: nothing is kept
        decoded = counted(alone)
        for request in requests:
            alone.frames(request)
    assert counts[0] == sum(decoded) > counts[1] > FRAMES


def test_the_cache_bounds_kept_frames_letting_go_of_the_least_recent_first(videos):
    data, oracle = videos["h264-bframes"]
    index = index_from_pyav(data, "h264-bframes")
    pts = sorted(oracle)
    cache = DecoderCache(capacity=4, keep_bytes=10**9)
    decoders = [cache.decoder((e, "a"), data, keyframes=index.pts[index.keyframe],
                              demand=dict.fromkeys(pts, 2)) for e in (0, 1)]
    for decoder in decoders:  # (0, "a") is the least recently used
        cache.decoder((decoders.index(decoder), "a"), data).frames(pts[:2], room=cache.room())
    held = [d.kept_bytes for d in decoders]
    assert min(held) > 0 and cache.room() == 10**9 - sum(held)
    cache.fit(held[1])
    assert [d.kept_bytes for d in decoders] == [0, held[1]] and cache.room() == 0
    assert cache.decoder((1, "a"), data).frames([pts[1]], room=cache.room()).shape[0] == 1
    held = decoders[1].kept_bytes
    cache.fit(10**9)
    cache.discard((1, "a"))  # closed: what it kept is room again
    assert decoders[1].kept == {} and cache.room() == 10**9 and held > 0
    small = DecoderCache(capacity=1, keep_bytes=10**9)
    first = small.decoder((0, "a"), data, keyframes=index.pts[index.keyframe],
                          demand=dict.fromkeys(pts, 2))
    first.frames(pts[:2], room=small.room())
    assert small.room() == 10**9 - first.kept_bytes < 10**9
    small.decoder((1, "a"), data)  # past the capacity: the first one is closed
    assert first.kept == {} and small.room() == 10**9
    small.close()
    cache.close()


# --- the decoder cache ---------------------------------------------------------------------

def test_the_cache_is_bounded_and_evicts_the_least_recently_used(videos, monkeypatch):
    data, oracle = videos["av1"]
    opened, closed = [], []

    class Recorded(EpisodeDecoder):
        def __init__(self, mp4_bytes, label, *args):
            opened.append(label)
            super().__init__(mp4_bytes, label, *args)

        def close(self):
            closed.append(self.label)
            super().close()

    monkeypatch.setattr(decode, "EpisodeDecoder", Recorded)
    cache = DecoderCache(capacity=2)
    for key in [(0, "a"), (1, "a"), (0, "a"), (2, "a")]:  # (1, "a") is least recent at the end
        cache.decoder(key, data).frames([0])
        assert len(opened) - len(closed) <= 2
    names = ["episode 0 camera a", "episode 1 camera a", "episode 2 camera a"]
    assert opened == names and closed == names[1:2]  # a hit does not reopen
    frames = cache.decoder((1, "a"), data).frames([0])  # reopened after eviction
    assert opened[-1] == "episode 1 camera a" and closed[-1] == "episode 0 camera a"
    np.testing.assert_array_equal(frames[0], chw(oracle[min(oracle)]))
    cache.decoder((2, "a"), data).frames([0])  # kept: (0, "a") went instead
    assert len(opened) == 4
    cache.discard((1, "a"))
    assert len(opened) - len(closed) == 1 and closed[-1] == "episode 1 camera a"
    cache.decoder((1, "a"), data).frames([0])  # discarded: opened again
    assert opened[4:] == ["episode 1 camera a"]
    cache.close()
    assert len(opened) == len(closed)
    assert sorted(closed[-2:]) == ["episode 1 camera a", "episode 2 camera a"]


# --- RGB: read from swscale's planar output where it equals rgb24 -----------------------------

# (width, height): with the FFmpeg builds seen so far, gbrp equals rgb24 at the first size and
# not at the second (its last columns are left unconverted); the decoder must be right at both.
SIZES = [(64, 48), (100, 60)]


@pytest.fixture(scope="module")
def sized(tmp_path_factory) -> dict[tuple, Path]:
    folder = tmp_path_factory.mktemp("sized")
    return {(codec, size): encode_video(folder / f"{codec}-{size[0]}.mp4",
                                        pattern_frames(12, size[1], size[0]), codec, gop=4,
                                        bframes=2 if codec == "libx264" else 0)
            for codec in ("libx264", "libsvtav1") for size in SIZES}


@pytest.mark.parametrize("codec", ["libx264", "libsvtav1"])
@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_frames_are_pyav_rgb24_and_over_255_at_every_size(sized, codec, size):
    path = sized[codec, size]
    oracle = decode_all(path)  # PyAV: to_ndarray(format="rgb24")
    pts = sorted(oracle)
    with EpisodeDecoder(path.read_bytes()) as decoder:
        uint8 = decoder.frames(pts)
        float32 = decoder.frames(pts[::-1], np.float32)
    expected = np.stack([chw(oracle[p]) for p in pts])
    np.testing.assert_array_equal(uint8, expected)
    lerobot = torch.from_numpy(expected[::-1].copy()).to(torch.float32) / 255
    np.testing.assert_array_equal(float32.view(np.uint32), lerobot.numpy().view(np.uint32))


@pytest.mark.parametrize("codec", ["libx264", "libsvtav1"])
@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_the_planar_probe_agrees_with_every_real_frame(sized, codec, size):
    # Oracle: PyAV's own gbrp and rgb24 arrays of each decoded frame.
    with av.open(str(sized[codec, size])) as container:
        frames = list(container.decode(container.streams.video[0]))
    same = all(np.array_equal(f.to_ndarray(format="gbrp"), f.to_ndarray(format="rgb24"))
               for f in frames)
    f = frames[0]
    assert decode._planar_is_rgb24(f.format.name, f.width, f.height, f.colorspace,
                                   f.color_range) == same


# --- one codec context for the open videos of one camera ----------------------------------------

def test_videos_sharing_a_codec_context_decode_as_if_alone(tmp_path):
    # Two files of one camera (one encoder setting, B-frames: the decoder holds frames back;
    # their sample descriptions differ in the bit rate box) and a third of other settings
    # (CAVLC: another avcC), different pictures; asked in an interleaved random order through
    # one cache, each frame equals a plain decode of its own file.
    base = pattern_frames(FRAMES)
    datas = [encode_video(tmp_path / f"{i}.mp4", np.roll(base, 7 * i, axis=2), "libx264", 5, 2,
                          x264_params="cabac=0" if i == 2 else "").read_bytes()
             for i in range(3)]
    stsds = [parse_index_bytes(data, f"{i}.mp4").stsd for i, data in enumerate(datas)]
    assert stsds[0] != stsds[1] and b"btrt" in stsds[0]
    oracles = [decode_all(data) for data in datas]
    cache = DecoderCache(capacity=3)
    rng = np.random.default_rng(3)
    for _ in range(90):
        i = int(rng.integers(3))
        pts = sorted(oracles[i])
        a = int(rng.integers(len(pts) - 1))
        decoder = cache.decoder((i, "top"), datas[i], stsd=stsds[i])
        frames = decoder.frames([pts[a + 1], pts[a]], np.float32)
        expected = np.stack([chw(oracles[i][pts[a + 1]]), chw(oracles[i][pts[a]])])
        np.testing.assert_array_equal(frames, expected.astype(np.float32) / np.float32(255))
    codecs = [id(cache.decoder((i, "top"), datas[i], stsd=stsds[i]).codec) for i in range(3)]
    assert codecs[0] == codecs[1] != codecs[2]
    cache.close()


# --- conformance cases ---------------------------------------------------------------------

FRAME_SELECT_CASES = sorted((FIXTURES / "decode").glob("*.json"))


@pytest.mark.parametrize("path", FRAME_SELECT_CASES, ids=lambda p: p.stem)
def test_frame_select_cases_match_the_oracle_and_the_adapter(path):
    case = json.loads(path.read_text())
    assert case["kind"] == "frame_select"
    assert oracle_frame_select(case["input"]) == case["expected"]
    answer = conformance.answer(case["kind"], case["input"])
    assert answer == case["expected"]


def test_there_are_frame_select_cases():
    assert len(FRAME_SELECT_CASES) >= 10
