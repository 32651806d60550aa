"""``refstream doctor`` on healthy datasets (ours and LeRobot's) and on one broken dataset per
check, each broken by file surgery; expectations come from PyAV's demuxer, pyarrow reads of the
files and brute-force coverage counting, never from the doctor's own earlier output."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from lerobot_layout import write_layout
from sidecar_helpers import ensure_with

from refstream import sidecar
from refstream.errors import DecodeError, MalformedDataset, UsageError
from refstream.meta import load_meta
from refstream.mp4 import parse_index
from refstream.roots import open_source
from refstream.tools import adapters
from refstream.tools.cli import export_index, main
from refstream.tools.demo import serve_directory, write_demo_dataset
from refstream.tools.doctor import (
    CHECK_NAMES,
    MAX_LISTED_PROBLEMS,
    check_dataset,
    episode_tiling,
)

REPO = Path(__file__).resolve().parent.parent
LEROBOT_ROOT = REPO / "spec" / "fixtures" / "lerobot" / "lr_av1"
FIXTURES = REPO / "spec" / "fixtures" / "doctor"
ADAPTERS = {"doctor_tiling": adapters.kind_doctor_tiling,
            "doctor_requests": adapters.kind_doctor_requests,
            "frame_rate": adapters.kind_frame_rate}
FRONT, WRIST = "observation.images.front", "observation.images.wrist"
# Four episodes, two per video file and per data file: file-000 holds episodes 0 and 1,
# file-001 holds 2 and 3 (videos and data alike).
LENGTHS = (6, 5, 7, 4)
EPISODES_FILE = "meta/episodes/chunk-000/file-000.parquet"


def video(camera: str, file: int) -> str:
    return f"videos/{camera}/chunk-000/file-{file:03d}.mp4"


def data(file: int) -> str:
    return f"data/chunk-000/file-{file:03d}.parquet"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("doctor_demo") / "dataset"
    write_demo_dataset(root, episode_lengths=LENGTHS, cameras=(FRONT, WRIST),
                       size={FRONT: (32, 32), WRIST: (48, 32)}, episodes_per_video_file=2,
                       episodes_per_data_file=2)
    return root


@pytest.fixture
def dataset(pristine, tmp_path, monkeypatch) -> Path:
    """A fresh copy of the demo dataset that a test may break; the sidecar cache of the doctor
    and of streaming is private to the test."""
    monkeypatch.setenv(sidecar.CACHE_ENV, str(tmp_path / "cache"))
    return Path(shutil.copytree(pristine, tmp_path / "dataset"))


def doctor(root: Path, **options) -> dict:
    """check_dataset on a folder, with an empty private sidecar cache; checks by name."""
    options.setdefault("cache_root", root.parent / "cache")
    report = check_dataset(open_source(root), root=root, progress=False, **options)
    assert [c.name for c in report.checks] == list(CHECK_NAMES)
    checks = {c.name: c for c in report.checks}
    assert report.ok == all(c.ok for c in checks.values())
    return checks


def failing(checks: dict) -> set[str]:
    return {name for name, c in checks.items() if not c.ok}


def rewrite_column(path: Path, name: str, change) -> None:
    """Replace one Parquet column by ``change(numpy values)``, keeping its type."""
    table = pq.read_table(path)
    position = table.column_names.index(name)
    values = change(table[name].to_numpy().copy())
    table = table.set_column(position, name, pa.array(values, table[name].type))
    pq.write_table(table, path)


def frame_times_s(path: Path) -> list[Fraction]:
    """Presentation time of every packet, exact, as PyAV's demuxer reports it (the oracle)."""
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        return [packet.pts * stream.time_base for packet in container.demux(stream)
                if packet.pts is not None]


def unserved_times(root: Path, episode: int, camera: str, tolerance_s: float) -> list[float]:
    """Brute force in plain binary64 (SPEC §7.1): the episode's request times with no PyAV
    frame within tolerance."""
    episodes = pq.read_table(root / EPISODES_FILE).to_pydict()
    row = episodes["episode_index"].index(episode)
    file = episodes[f"videos/{camera}/file_index"][row]
    from_s = episodes[f"videos/{camera}/from_timestamp"][row]
    rows = pq.read_table(root / data(episodes["data/file_index"][row])).to_pydict()
    stamps = [t for e, t in zip(rows["episode_index"], rows["timestamp"], strict=True)
              if e == episode]
    frames = [float(f) for f in frame_times_s(root / video(camera, file))]  # pts / timescale
    return [from_s + float(t) for t in stamps
            if min(abs(f - (from_s + float(t))) for f in frames) > tolerance_s]


def stream_failure(root: Path) -> Exception | None:
    """Stream one epoch in this process (the real consumer, as oracle); the error or None."""
    from refstream.stream import StreamingDataset

    try:
        for _ in StreamingDataset(root, seed=0):
            pass
    except Exception as exc:  # whatever the stream raises is what we compare against
        return exc
    return None


# --- healthy datasets ------------------------------------------------------------------------


def test_healthy_demo_dataset_passes_every_check(dataset):
    checks = doctor(dataset)
    assert failing(checks) == set()
    assert all(c.problem_count == 0 and c.problems == [] for c in checks.values())
    # Every request time of every episode and camera really has a frame (oracle: PyAV).
    for episode in range(len(LENGTHS)):
        for camera in (FRONT, WRIST):
            assert unserved_times(dataset, episode, camera, 1e-4) == []
    assert f"{2 * sum(LENGTHS)} request times" in checks["videos"].detail
    assert stream_failure(dataset) is None  # and training on it works


def test_dataset_written_by_lerobot_passes_every_check(tmp_path):
    assert (LEROBOT_ROOT / "meta/info.json").exists(), "LeRobot-written fixture is missing"
    checks = doctor(LEROBOT_ROOT, cache_root=tmp_path / "cache")
    assert failing(checks) == set(), {n: c.problems for n, c in checks.items()}


def test_progress_goes_to_stderr(dataset, capsys):
    files = 2 + 2 * 2 * 2  # data files + video files of both cameras, checked and decoded
    check_dataset(open_source(dataset), root=dataset, progress=True)
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "refstream doctor" in captured.err and f"{files}/{files}" in captured.err


# --- 1. metadata -----------------------------------------------------------------------------


def test_inconsistent_totals_fail_metadata_and_skip_the_rest(dataset):
    info = json.loads((dataset / "meta/info.json").read_text())
    info["total_frames"] += 1
    (dataset / "meta/info.json").write_text(json.dumps(info))
    checks = doctor(dataset)
    assert failing(checks) == set(CHECK_NAMES)
    assert "total_frames" in checks["metadata"].problems[0]
    assert all(checks[name].skipped and checks[name].status == "skipped"
               for name in CHECK_NAMES[1:])


def test_invalid_template_fails_metadata(dataset):
    info = json.loads((dataset / "meta/info.json").read_text())
    info["data_path"] = "data/chunk-{chunk_index:03d}/file.parquet"  # lacks {file_index}
    (dataset / "meta/info.json").write_text(json.dumps(info))
    checks = doctor(dataset)
    assert not checks["metadata"].ok
    assert "data_path" in checks["metadata"].problems[0]


# --- 2. episode boundaries -------------------------------------------------------------------


def test_episode_overlap_and_gap_are_named(tmp_path):
    # Lengths still equal to - from and sum to total_frames, so the metadata loads.
    layout = write_layout(tmp_path / "ds", [10, 10, 10], cameras=(), episode_overrides={
        "dataset_from_index": [0, 8, 20], "dataset_to_index": [10, 18, 30]})
    checks = doctor(layout.root)
    assert checks["metadata"].ok
    boundaries = checks["episode boundaries"]
    assert not boundaries.ok and boundaries.problem_count == 2
    overlap, gap = boundaries.problems
    assert "episode 1 [8, 18)" in overlap and "episode 0 [0, 10)" in overlap
    assert "[8, 10)" in overlap
    assert "[18, 20)" in gap and "episode 1" in gap and "episode 2" in gap
    # The data rows were written for the true boundaries, so their index disagrees too.
    assert not checks["data rows"].ok
    assert "episode 1" in checks["data rows"].problems[0]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 12), st.integers(0, 6)), min_size=1, max_size=6),
       st.integers(0, 40))
def test_tiling_agrees_with_brute_force_coverage(intervals, total):
    """Gaps are exactly the frames no episode holds, overlaps exactly those held twice or more;
    tiled iff every frame of [0, total) is held once, none outside it, and each empty episode
    sits on a boundary (0 or the end of a non-empty episode), not inside one."""
    starts = np.array([s for s, _ in intervals], np.int64)
    ends = starts + np.array([n for _, n in intervals], np.int64)
    tiling = episode_tiling(np.arange(len(intervals)), starts, ends, total)
    coverage = np.zeros(max(total, int(ends.max())), np.int64)
    for s, e in zip(starts, ends, strict=True):
        coverage[s:e] += 1
    in_gaps = np.zeros(len(coverage), bool)
    for s, e, _, _ in tiling.gaps:
        in_gaps[s:e] = True
    in_overlaps = np.zeros(len(coverage), bool)
    for _, _, s, e in tiling.overlaps:
        in_overlaps[s:e] = True
    assert np.array_equal(in_gaps, coverage == 0)
    assert np.array_equal(in_overlaps, coverage >= 2)
    assert tiling.covered_to == int(ends.max())
    boundaries = {0} | {int(e) for s, e in zip(starts, ends, strict=True) if e > s}
    tiled = bool(np.all(coverage[:total] == 1) and np.all(coverage[total:] == 0)) and all(
        int(s) in boundaries for s, e in zip(starts, ends, strict=True) if e == s)
    assert tiled == (not tiling.gaps and not tiling.overlaps and tiling.covered_to == total)


@pytest.mark.parametrize("path", sorted(FIXTURES.glob("*.json")), ids=lambda p: p.stem)
def test_conformance_fixtures(path):
    """The hand-derived cases of spec/fixtures/doctor, through a JSON round trip."""
    case = json.loads(path.read_text())
    assert case["kind"] in ADAPTERS
    answer = json.loads(json.dumps(adapters.answer(case["kind"], case["input"])))
    assert answer == case["expected"]


def test_request_cases_are_the_rule_in_plain_binary64():
    """Every doctor_requests expectation, recomputed with Python floats: a time is served iff
    some pts has |pts / timescale - t| <= tolerance_s (SPEC §7.1)."""
    cases = [json.loads(p.read_text()) for p in sorted(FIXTURES.glob("*.json"))]
    cases = [c for c in cases if c["kind"] == "doctor_requests"]
    assert len(cases) >= 7
    for case in cases:
        c = case["input"]
        unserved = [k for k, t in enumerate(c["times_s"])
                    if not any(abs(p / c["timescale"] - t) <= c["tolerance_s"] for p in c["pts"])]
        assert case["expected"] == {"unserved": unserved}, case["description"]


def test_frame_rate_cases_are_the_rule_in_exact_arithmetic():
    """Every frame_rate expectation, recomputed with fractions: the median gap between the
    sorted presentation times of the first 64 samples, refused unless within one tick of
    timescale / fps (SPEC §9.2)."""
    cases = [json.loads(p.read_text()) for p in sorted(FIXTURES.glob("frame-rate-*.json"))]
    assert len(cases) >= 8 and all(c["kind"] == "frame_rate" for c in cases)
    for case in cases:
        c = case["input"]
        pts = sorted(c["pts"][:64])
        gaps = sorted(Fraction(b - a) for a, b in zip(pts[:-1], pts[1:], strict=True))
        middle = len(gaps) // 2
        if not gaps:
            spacing = None
        elif len(gaps) % 2:
            spacing = gaps[middle]
        else:
            spacing = (gaps[middle - 1] + gaps[middle]) / 2
        agrees = spacing is None or abs(spacing - Fraction(c["timescale"], c["fps"])) < 1
        expected = {"spacing_ticks": None if spacing is None else float(spacing)}
        assert case["expected"] == (expected if agrees else {"error": "MalformedDataset"}), \
            case["description"]


def test_there_are_fixtures_of_both_kinds():
    kinds = {json.loads(p.read_text())["kind"] for p in FIXTURES.glob("*.json")}
    assert kinds == set(ADAPTERS)


# --- 3. data rows ----------------------------------------------------------------------------


def test_missing_rows_are_named(dataset):
    table = pq.read_table(dataset / data(0))
    episode = table["episode_index"].to_numpy()
    frame = table["frame_index"].to_numpy()
    keep = ~((episode == 1) & (frame >= LENGTHS[1] - 2))  # drop the last 2 rows of episode 1
    pq.write_table(table.filter(pa.array(keep)), dataset / data(0))
    checks = doctor(dataset)
    assert failing(checks) == {"data rows"}
    rows = checks["data rows"]
    assert rows.problem_count == 1
    assert data(0) in rows.problems[0] and "episode 1" in rows.problems[0]
    assert f"{LENGTHS[1] - 2} rows" in rows.problems[0] and "2 missing" in rows.problems[0]
    assert stream_failure(dataset) is not None  # training fails on it as well


def test_non_contiguous_frame_index_is_named(dataset):
    def skip_frame_3_of_episode_2(frames: np.ndarray) -> np.ndarray:
        first = int(np.flatnonzero(pq.read_table(dataset / data(1))["episode_index"]
                                   .to_numpy() == 2)[0])
        frames[first + 3 :] += np.where(np.arange(len(frames) - first - 3) < LENGTHS[2] - 3,
                                        1, 0)
        return frames

    rewrite_column(dataset / data(1), "frame_index", skip_frame_3_of_episode_2)
    checks = doctor(dataset)
    assert "data rows" in failing(checks)
    problems = " | ".join(checks["data rows"].problems)
    assert f"{data(1)}: episode 2: frame_index not contiguous" in problems
    assert "row 3 of the episode has frame_index 4" in problems
    assert "episode 3" not in problems
    assert stream_failure(dataset) is not None  # training fails on it as well


def test_feature_column_missing_from_a_data_file_is_named(dataset):
    table = pq.read_table(dataset / data(1))
    pq.write_table(table.drop_columns(["action"]), dataset / data(1))
    checks = doctor(dataset)
    assert failing(checks) == {"data rows"}
    assert checks["data rows"].problem_count == 1
    problem = checks["data rows"].problems[0]
    assert data(1) in problem and "'action'" in problem
    assert stream_failure(dataset) is not None  # training fails on it as well


def corrupt_column_page(path: Path, name: str) -> None:
    """Overwrite the middle of the first data page of column ``name`` (row group 0) with bytes
    that no codec decodes, leaving the file's footer and every other column intact."""
    metadata = pq.ParquetFile(path).metadata
    leaves = [i for i in range(metadata.num_columns)
              if metadata.schema.column(i).path in (name, f"{name}.list.element")]
    assert len(leaves) == 1
    chunk = metadata.row_group(0).column(leaves[0])
    start = chunk.data_page_offset + chunk.total_compressed_size // 2
    data = bytearray(path.read_bytes())
    data[start : start + 16] = b"\xff" * 16
    path.write_bytes(bytes(data))


def test_a_corrupt_feature_page_fails_like_streaming_does(dataset):
    corrupt_column_page(dataset / data(1), "observation.state")
    failure = stream_failure(dataset)
    assert failure is not None  # the oracle: training cannot stream these rows
    checks = doctor(dataset)
    assert failing(checks) == {"data rows"}
    problem = " ".join(checks["data rows"].problems)
    assert data(1) in problem and "observation.state" in problem


def test_rows_of_an_unknown_episode_are_named(tmp_path):
    layout = write_layout(tmp_path / "ds", [5, 5], cameras=())
    rewrite_column(layout.root / data(0), "episode_index",
                   lambda ids: np.where(ids == 1, 7, ids))
    checks = doctor(layout.root)
    problems = " | ".join(checks["data rows"].problems)
    assert "5 row(s) of episode 7, which is not in meta/episodes" in problems
    assert "episode 1: 0 rows, meta/episodes length is 5 (5 missing)" in problems


def test_problem_list_is_capped_but_counted(tmp_path):
    layout = write_layout(tmp_path / "ds", [3] * 30, cameras=())
    rewrite_column(layout.root / data(0), "frame_index", lambda frames: frames + 1)
    rows = doctor(layout.root)["data rows"]
    # Each episode: frame_index starts at 1, and index = from + frame_index - 1 disagrees.
    assert rows.problem_count == 2 * 30
    assert len(rows.problems) == MAX_LISTED_PROBLEMS


# --- 4. videos -------------------------------------------------------------------------------


def test_missing_video_names_file_and_episodes(dataset):
    os.remove(dataset / video(WRIST, 1))
    checks = doctor(dataset)
    assert "videos" in failing(checks)
    videos = checks["videos"]
    assert videos.problem_count == 1
    assert video(WRIST, 1) in videos.problems[0] and "episodes 2, 3" in videos.problems[0]
    assert "missing" in videos.problems[0]
    assert stream_failure(dataset) is not None  # training fails on it as well


def decodable_frames(path: Path) -> int | None:
    """Frames PyAV decodes from a file, None if it gives up with an error (the oracle)."""
    try:
        with av.open(str(path)) as container:
            return sum(1 for _ in container.decode(video=0))
    except av.error.FFmpegError:
        return None


@pytest.mark.parametrize("cut_bytes", [1, 200])
def test_truncated_video_is_reported(dataset, cut_bytes):
    path = dataset / video(FRONT, 0)
    path.write_bytes(path.read_bytes()[:-cut_bytes])
    assert decodable_frames(path) != LENGTHS[0] + LENGTHS[1], "PyAV still decodes every frame"
    checks = doctor(dataset)
    assert "videos" in failing(checks)
    problem = checks["videos"].problems[0]
    assert video(FRONT, 0) in problem and "episodes 0, 1" in problem
    assert "MalformedMp4" in problem
    assert stream_failure(dataset) is not None  # training fails on it as well


def test_requests_past_the_video_end_are_named(dataset):
    # Episode 1 is the last of its video file; moving its start half a second later makes its
    # requests run past the file's last frame (to_timestamp moves with it).
    shift = 0.5
    rewrite_column(dataset / EPISODES_FILE, f"videos/{FRONT}/from_timestamp",
                   lambda s: s + np.where(np.arange(len(s)) == 1, shift, 0.0))
    rewrite_column(dataset / EPISODES_FILE, f"videos/{FRONT}/to_timestamp",
                   lambda s: s + np.where(np.arange(len(s)) == 1, shift, 0.0))
    expected = unserved_times(dataset, 1, FRONT, 1e-4)
    assert expected, "the surgery must push requests past the last frame"
    checks = doctor(dataset)
    assert failing(checks) == {"videos"}
    videos = checks["videos"]
    assert videos.problem_count == 1
    problem = videos.problems[0]
    assert f"episode 1, camera {FRONT}, {video(FRONT, 0)}" in problem
    assert f"{len(expected)} of {LENGTHS[1]} request times" in problem
    assert f"first {expected[0]:.6f} s" in problem
    assert stream_failure(dataset) is not None  # training fails on it as well


def test_timestamp_column_past_the_video_end_is_named(dataset):
    # The last row of episode 3 (the last of data file 1 and of video file 1) asks 1 s later.
    rewrite_column(dataset / data(1), "timestamp",
                   lambda t: t + np.where(np.arange(len(t)) == len(t) - 1, 1.0, 0.0))
    checks = doctor(dataset)
    assert failing(checks) == {"videos"}
    problems = checks["videos"].problems
    assert len(problems) == 2  # both cameras
    for camera, problem in zip((FRONT, WRIST), sorted(problems), strict=True):
        expected = unserved_times(dataset, 3, camera, 1e-4)
        assert len(expected) == 1
        assert f"episode 3, camera {camera}" in problem
        assert f"1 of {LENGTHS[3]} request times" in problem
        assert f"first {expected[0]:.6f} s" in problem
    assert stream_failure(dataset) is not None  # training fails on it as well


def test_timestamps_off_the_frame_grid_fail_like_streaming_does(dataset):
    """Episode 0's timestamps one frame late: every time still has a frame in the file (episode
    1's first frame serves the last one), but streaming plans the span from frame_index / fps
    and refuses the episode; the doctor must say so too."""
    assert doctor(dataset)["videos"].ok
    one_frame = np.float32(1 / 30)
    episode = pq.read_table(dataset / data(0))["episode_index"].to_numpy()
    rewrite_column(dataset / data(0), "timestamp", lambda t: t + np.where(episode == 0,
                                                                          one_frame, 0))
    assert unserved_times(dataset, 0, FRONT, 1e-4) == []  # the plain rule is satisfied
    failure = stream_failure(dataset)
    assert failure is not None and "episode 0" in str(failure)
    checks = doctor(dataset)
    assert failing(checks) == {"videos"}
    assert checks["videos"].problem_count == 2  # both cameras
    for problem in checks["videos"].problems:
        assert problem.startswith("episode 0, camera ")
        assert "outside samples" in problem and "frame_index / fps" in problem


def test_episodes_claiming_the_same_video_window_are_named(dataset):
    """Episode 1 of the front camera claims episode 0's window: every request has a frame, and
    streaming does not fail — it silently serves episode 0's pictures (read from their labels);
    only the doctor catches it."""
    from refstream.stream import StreamingDataset
    from refstream.tools.demo import read_frame_label

    for column in ("from_timestamp", "to_timestamp"):
        rewrite_column(dataset / EPISODES_FILE, f"videos/{FRONT}/{column}",
                       lambda s: np.where(np.arange(len(s)) == 1, s[0], s))
    assert unserved_times(dataset, 1, FRONT, 1e-4) == []
    labels = {(int(item["episode_index"]), int(item["frame_index"])):
              read_frame_label(item[FRONT].numpy())
              for item in StreamingDataset(dataset, seed=0, return_uint8=True)}
    assert labels[1, 2] == (0, 2) and labels[0, 2] == (0, 2)  # the oracle: wrong pictures
    checks = doctor(dataset)
    assert failing(checks) == {"videos"}
    assert checks["videos"].problem_count == 1
    problem = checks["videos"].problems[0]
    assert video(FRONT, 0) in problem and "episodes 0 [0.0, 0.2) s and 1 [0.0, " in problem


def test_tolerance_decides_between_frames(dataset):
    # Episode 2 starts half a frame late (its window shrinks, so it overlaps no other one):
    # every request misses a frame by 1/60 s.
    half_frame = 1 / 60
    rewrite_column(dataset / EPISODES_FILE, f"videos/{WRIST}/from_timestamp",
                   lambda s: s + np.where(np.arange(len(s)) == 2, half_frame, 0.0))
    for tolerance_s in (1e-4, 0.016, 0.017, 0.02):
        expected = unserved_times(dataset, 2, WRIST, tolerance_s)
        checks = doctor(dataset, tolerance_s=tolerance_s)
        assert checks["videos"].ok == (not expected), tolerance_s
        if expected:
            assert f"{len(expected)} of {LENGTHS[2]} request times" in \
                checks["videos"].problems[0]
    assert unserved_times(dataset, 2, WRIST, 1e-4) and not unserved_times(dataset, 2, WRIST, 0.02)


def change_info(root: Path, change) -> None:
    info = json.loads((root / "meta/info.json").read_text())
    change(info)
    (root / "meta/info.json").write_text(json.dumps(info))


@pytest.mark.parametrize("index", ["built", "cached"])
def test_the_fps_is_checked_against_every_video_whether_its_index_is_built_or_cached(dataset,
                                                                                      index):
    from refstream.stream import StreamingDataset

    if index == "cached":
        StreamingDataset(dataset)  # every record cached, at the right fps
    change_info(dataset, lambda info: info.update(fps=25))
    with pytest.raises(MalformedDataset, match="frame times disagree with meta/info.json's fps"):
        StreamingDataset(dataset)


def test_an_fps_the_videos_disagree_with_is_named_by_streaming_and_the_doctor(dataset):
    """info.json's fps 25 over 30 fps videos: the dataset refuses it when it is made (in the
    main process, before any worker), and the doctor says it once per video file; both show
    both numbers."""
    from refstream.stream import StreamingDataset

    times = frame_times_s(dataset / video(FRONT, 0))
    video_fps = 1 / (times[1] - times[0])  # PyAV's demuxer
    assert video_fps == 30
    change_info(dataset, lambda info: info.update(fps=25))
    with pytest.raises(MalformedDataset) as raised:
        StreamingDataset(dataset)
    for message in [str(raised.value), *doctor(dataset)["videos"].problems]:
        assert "frame times disagree with meta/info.json's fps 25" in message, message
        assert f"({video_fps} fps)" in message and "1/30" not in message
    checks = doctor(dataset)
    assert failing(checks) == {"videos"}
    assert checks["videos"].problem_count == 4  # one per video file, not one per episode
    assert {p.split(":")[0] for p in checks["videos"].problems} == {
        video(camera, file) for camera in (FRONT, WRIST) for file in (0, 1)}


def test_a_camera_size_the_videos_disagree_with_is_named(dataset):
    """info.json declares 100x100 for a 32x32 video: streaming yields 32x32 frames (what the
    decoder makes), not the declared size a model is built for."""
    from refstream.stream import StreamingDataset

    with av.open(str(dataset / video(FRONT, 0))) as container:  # the oracle: PyAV's stream
        height, width = (container.streams.video[0].height, container.streams.video[0].width)
    def declare(info):
        feature = info["features"][FRONT]
        feature["shape"] = [100, 100, 3]
        feature["info"].update({"video.height": 100, "video.width": 100})
    change_info(dataset, declare)
    sample = next(iter(StreamingDataset(dataset, seed=0)))
    assert tuple(sample[FRONT].shape) == (3, height, width) != (3, 100, 100)
    checks = doctor(dataset)
    assert failing(checks) == {"videos"}
    assert checks["videos"].problem_count == 2  # the camera's two files
    for problem in checks["videos"].problems:
        assert f"camera {FRONT} is 100x100" in problem
        assert f"the video track is {height}x{width}" in problem


def test_a_codec_the_videos_disagree_with_is_named(dataset):
    with av.open(str(dataset / video(WRIST, 1))) as container:
        codec = container.streams.video[0].codec_context.codec.canonical_name  # av1
    change_info(dataset, lambda info: info["features"][WRIST]["info"].update(
        {"video.codec": "h264"}))
    checks = doctor(dataset)
    assert failing(checks) == {"videos"}
    assert [p.split(":")[0] for p in checks["videos"].problems] == [video(WRIST, 0),
                                                                   video(WRIST, 1)]
    assert all(f"is h264, the video track is av01 ({codec})" in p
               for p in checks["videos"].problems)


def test_tolerance_must_be_a_finite_non_negative_number(dataset):
    for bad in (-1e-4, math.nan, math.inf, True, "1e-4"):  # the check StreamingDataset makes
        with pytest.raises(UsageError, match="tolerance_s"):
            check_dataset(open_source(dataset), tolerance_s=bad)


# --- 6. decoding ----------------------------------------------------------------------------


def packets(path: Path) -> list:
    """(byte offset, size, is keyframe) of every packet, as PyAV's demuxer reads them."""
    with av.open(str(path)) as container:
        return [(p.pos, p.size, p.is_keyframe) for p in container.demux(video=0) if p.size]


def spoil(path: Path, keyframe: bool) -> None:
    """Overwrite the second keyframe's (or non-keyframe's) payload with 0xff bytes, inside the
    mdat: the MP4 index stays valid and PyAV can no longer decode the file."""
    offset, size, _ = [p for p in packets(path) if p[2] == keyframe][1]
    data = bytearray(path.read_bytes())
    data[offset : offset + size] = b"\xff" * size
    path.write_bytes(bytes(data))
    assert decodable_frames(path) is None  # the oracle: a full PyAV decode fails


def keyframe_count(root: Path) -> int:
    return sum(p[2] for camera in (FRONT, WRIST) for f in (0, 1)
               for p in packets(root / video(camera, f)))


def test_the_healthy_dataset_is_safe_to_train_only_when_every_frame_was_decoded(dataset):
    keyframes = keyframe_count(dataset)
    frames = 2 * sum(LENGTHS)
    assert 0 < keyframes < frames
    report = check_dataset(open_source(dataset), root=dataset, progress=False)
    assert report.ok and f"{keyframes} of {frames} frames" in report.checks[-1].detail
    assert report.not_checked == [f"decoding: {frames - keyframes} of {frames} frames, those "
                                  "that are not keyframes (--decode all decodes every frame the "
                                  "rows request)"]
    assert "safe to train" not in report.table() and "not checked: decoding" in report.table()
    report = check_dataset(open_source(dataset), root=dataset, progress=False, decode="all")
    assert report.ok and report.not_checked == []
    assert f"{frames} frames" in report.checks[-1].detail
    assert report.table().endswith(f"{dataset}: safe to train")
    assert report.as_dict()["not_checked"] == []


def test_a_corrupt_keyframe_fails_decoding_as_it_fails_streaming(dataset):
    keyframes = keyframe_count(dataset)
    spoil(dataset / video(WRIST, 1), keyframe=True)
    assert isinstance(stream_failure(dataset), DecodeError)  # the oracle: training fails
    for mode in ("keyframes", "all"):
        checks = doctor(dataset, decode=mode)
        assert failing(checks) == {"decoding"}, mode
        assert checks["decoding"].problem_count == 1
        assert video(WRIST, 1) in checks["decoding"].problems[0]
        assert "DecodeError" in checks["decoding"].problems[0]
    # The keyframe that failed was checked: it counts with the others, not as unchecked.
    report = check_dataset(open_source(dataset), root=dataset, progress=False)
    frames = 2 * sum(LENGTHS)
    assert f"{keyframes} of {frames} frames" in report.checks[-1].detail
    assert report.not_checked[0].startswith(f"decoding: {frames - keyframes} of {frames} ")


def test_a_corrupt_frame_between_keyframes_is_found_by_decoding_every_frame(dataset):
    spoil(dataset / video(FRONT, 0), keyframe=False)
    assert isinstance(stream_failure(dataset), DecodeError)  # the oracle: training fails
    report = check_dataset(open_source(dataset), root=dataset, progress=False)
    assert report.ok and report.not_checked  # every keyframe decodes; the rest is unchecked
    assert "safe to train" not in report.table()
    checks = doctor(dataset, decode="all")
    assert failing(checks) == {"decoding"}
    problem = checks["decoding"].problems[0]
    assert f"camera {FRONT}, {video(FRONT, 0)}" in problem and "DecodeError" in problem


def test_a_pyav_refstream_cannot_decode_with_fails_decoding(dataset, monkeypatch):
    """PyAV 15's reformat takes no threads option: a refstream passing it cannot decode any
    frame there; the doctor must say so, not "safe to train"."""
    from refstream import decode

    class Pyav15Reformatter:  # PyAV's reformatter as PyAV 15 has it
        def __init__(self):
            self.reformatter = av.video.reformatter.VideoReformatter()

        def reformat(self, frame, **options):
            if "threads" in options:
                raise TypeError("reformat() got an unexpected keyword argument 'threads'")
            return self.reformatter.reformat(frame, **options)

    monkeypatch.setattr(decode, "VideoReformatter", Pyav15Reformatter)
    monkeypatch.setattr(decode, "_ONE_THREAD", {"threads": 1})
    assert isinstance(stream_failure(dataset), TypeError)  # the oracle: training fails
    report = check_dataset(open_source(dataset), root=dataset, progress=False,
                           cache_root=dataset.parent / "cache")
    assert [c.name for c in report.checks if not c.ok] == ["decoding"]
    decoding = report.checks[-1]
    assert decoding.problem_count == 1
    assert decoding.problems[0].startswith(f"refstream cannot decode with the installed PyAV "
                                           f"{av.__version__}: TypeError: reformat() got an "
                                           "unexpected keyword argument 'threads'")
    assert "NOT safe to train" in report.table()


def test_decode_mode_must_be_known(dataset):
    with pytest.raises(UsageError, match="decode must be one of"):
        check_dataset(open_source(dataset), decode="some")


# --- 5. sidecar ------------------------------------------------------------------------------


def build_sidecar(root: Path, cache_root: Path, indexer=parse_index) -> sidecar.VideoIndex:
    source = open_source(root)
    relpaths = load_meta(source).video_files()
    return ensure_with(indexer, source, relpaths, cache_root=cache_root, workers=1)


def test_valid_sidecar_is_compared_with_the_files(dataset):
    build_sidecar(dataset, dataset.parent / "cache")
    checks = doctor(dataset)
    assert failing(checks) == set()
    assert "4 of 4 video files have a valid index record" in checks["sidecar"].detail


def test_no_sidecar_is_a_note(dataset):
    check = doctor(dataset)["sidecar"]
    assert check.ok and "0 of 4 video files" in check.detail
    assert "training indexes the others" in check.detail


def test_a_changed_video_is_a_note_because_training_indexes_it(dataset):
    build_sidecar(dataset, dataset.parent / "cache")
    path = dataset / video(FRONT, 1)
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # new identity
    check = doctor(dataset)["sidecar"]
    assert check.ok and "3 of 4 video files" in check.detail


def test_a_corrupt_record_is_a_note_because_training_indexes_it_again(dataset):
    index = build_sidecar(dataset, dataset.parent / "cache")
    record = Path(index.records[video(WRIST, 0)].path)
    data = bytearray(record.read_bytes())
    data[-1] ^= 0xFF  # in the arrays: the digest fails
    record.write_bytes(bytes(data))
    check = doctor(dataset)["sidecar"]
    assert check.ok and "not valid" in check.detail and video(WRIST, 0) in check.detail
    assert "digest" in check.detail


def test_sidecar_that_disagrees_with_the_files_fails(dataset):
    """A record valid for the file's size and identity but with wrong sample times would be
    trusted by training: the doctor compares it field by field with the parsed file."""

    def late_indexer(read_range, size, relpath):
        index = parse_index(read_range, size, relpath)
        return dataclasses.replace(index, pts=index.pts + 1) if relpath == video(WRIST, 0) \
            else index

    build_sidecar(dataset, dataset.parent / "cache", late_indexer)
    checks = doctor(dataset)
    assert failing(checks) == {"sidecar"}
    problem = checks["sidecar"].problems[0]
    assert "cache" in problem and video(WRIST, 0) in problem and "pts[0]" in problem


def test_published_sidecar_is_checked(dataset):
    def late_indexer(read_range, size, relpath):
        index = parse_index(read_range, size, relpath)
        return dataclasses.replace(index, width=index.width + 2)

    index = build_sidecar(dataset, dataset.parent / "elsewhere", late_indexer)
    export_index(index, dataset / sidecar.PUBLISHED_RELPATH)
    check = doctor(dataset)["sidecar"]
    assert not check.ok and check.problem_count == 4 and "4 of 4 video files" in check.detail
    assert all(p.startswith(sidecar.PUBLISHED_RELPATH) and "width" in p for p in check.problems)


def test_an_unreadable_published_sidecar_is_a_note(dataset):
    (dataset / sidecar.PUBLISHED_RELPATH).write_bytes(b"PK\x03\x04 not really a ZIP archive")
    check = doctor(dataset)["sidecar"]
    assert check.ok and f"{sidecar.PUBLISHED_RELPATH} is not readable" in check.detail


# --- the command -----------------------------------------------------------------------------


def test_cli_exit_status_and_json(dataset, capsys):
    assert main(["doctor", str(dataset), "--json", "--no-progress"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is True and report["root"] == str(dataset)
    assert [c["name"] for c in report["checks"]] == list(CHECK_NAMES)
    assert {c["status"] for c in report["checks"]} == {"ok"}

    os.remove(dataset / video(FRONT, 0))
    assert main(["doctor", str(dataset), "--no-progress"]) == 1
    table = capsys.readouterr().out
    assert "NOT safe to train" in table and video(FRONT, 0) in table
    assert any(line.startswith("videos") and "FAIL" in line for line in table.splitlines())


def test_cli_over_http(dataset, capsys):
    with serve_directory(dataset) as server:
        assert main(["doctor", server.url, "--json", "--no-progress"]) == 0
        assert json.loads(capsys.readouterr().out)["ok"] is True
        os.remove(dataset / video(WRIST, 0))
        assert main(["doctor", server.url, "--json", "--no-progress"]) == 1
        report = json.loads(capsys.readouterr().out)
    videos = next(c for c in report["checks"] if c["name"] == "videos")
    assert videos["status"] == "FAIL" and video(WRIST, 0) in videos["problems"][0]
    assert any(status == 404 for *_, status in server.log)


def test_cli_decodes_every_frame_when_asked(dataset, capsys):
    assert main(["doctor", str(dataset), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "not checked: decoding" in out and "safe to train" not in out
    assert main(["doctor", str(dataset), "--no-progress", "--decode", "all", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is True and report["not_checked"] == []


def test_cli_refuses_a_bad_tolerance_with_status_2(dataset, capsys):
    assert main(["doctor", str(dataset), "--tolerance-s", "-1", "--no-progress"]) == 2
    assert "UsageError" in capsys.readouterr().err


def test_cli_as_a_process(dataset, tmp_path):
    env = {**os.environ, sidecar.CACHE_ENV: str(tmp_path / "cache"),
           "PYTHONPATH": str(REPO)}
    healthy = subprocess.run([sys.executable, "-m", "refstream", "doctor", str(dataset),
                              "--json"], capture_output=True, text=True, env=env, timeout=60)
    assert healthy.returncode == 0, healthy.stderr
    assert json.loads(healthy.stdout)["ok"] is True
    (dataset / "meta/info.json").write_text("{")
    broken = subprocess.run([sys.executable, "-m", "refstream", "doctor", str(dataset),
                             "--json"], capture_output=True, text=True, env=env, timeout=60)
    assert broken.returncode == 1
    assert json.loads(broken.stdout)["checks"][0]["status"] == "FAIL"


def test_a_hub_root_that_cannot_be_opened_gets_the_report(dataset, monkeypatch, capsys):
    from rangeserver import HubConfig, RangeServer

    with RangeServer(dataset, hub=HubConfig(revisions={"main": "a" * 40})) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        assert main(["doctor", "hf://datasets/o/n@no-such-branch", "--no-progress"]) == 1
    out = capsys.readouterr().out
    assert "metadata" in out and "no-such-branch" in out
    assert "skipped" in out
