"""meta.py on the dataset LeRobot itself wrote, on layouts built by tests/lerobot_layout.py, and on
broken layouts; plus the ``meta`` conformance fixtures against an independent derivation."""

from __future__ import annotations

import json
import posixpath
import re
import tempfile
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from lerobot_layout import DELETE, corrupt_columns, write_layout

from refstream import errors
from refstream.errors import (
    EpisodeSelectionError,
    MalformedDataset,
    UnsafePath,
    UnsupportedDataset,
    UsageError,
)
from refstream.meta import load_meta, select_episodes
from refstream.source import LocalSource, check_relpath
from refstream.tools import adapters

SPEC = Path(__file__).resolve().parent.parent / "spec"
ORACLE_ROOT = SPEC / "fixtures" / "lerobot" / "lr_av1"
FIXTURES = SPEC / "fixtures" / "meta"
FRONT, WRIST = "observation.images.front", "observation.images.wrist"


# --- the dataset written by LeRobot 0.6.1 --------------------------------------------------------


def test_the_lerobot_dataset_loads_with_its_documented_shape():
    meta = load_meta(LocalSource(ORACLE_ROOT))
    assert (meta.fps, meta.total_episodes, meta.total_frames) == (30, 5, 300)
    assert meta.camera_keys == [FRONT, WRIST]
    assert meta.parquet_keys == [
        "observation.state",
        "action",
        "timestamp",
        "frame_index",
        "episode_index",
        "index",
        "task_index",
    ]
    assert meta.episode_index.tolist() == [0, 1, 2, 3, 4]
    assert [meta.frames(e) for e in range(5)] == [30, 45, 60, 75, 90]
    assert meta.tasks == ["pick the cube", "place the cube"]
    assert meta.data_relpath(2) == "data/chunk-000/file-000.parquet"
    assert meta.video_relpath(4, WRIST) == f"videos/{WRIST}/chunk-000/file-000.mp4"
    for array in (meta.episode_index, meta.from_index, meta.to_index, meta.length):
        assert array.dtype == np.int64
    assert meta.video_from_s[FRONT].dtype == np.float64


def test_the_lerobot_episodes_table_matches_a_plain_full_read():
    # Oracle: pyarrow reading the whole table, and the frame counts documented in the README.
    table = pq.read_table(ORACLE_ROOT / "meta/episodes/chunk-000/file-000.parquet").to_pydict()
    meta = load_meta(LocalSource(ORACLE_ROOT))
    assert meta.from_index.tolist() == table["dataset_from_index"]
    assert meta.to_index.tolist() == table["dataset_to_index"]
    assert meta.length.tolist() == [30, 45, 60, 75, 90]
    for key in (FRONT, WRIST):
        assert meta.video_from_s[key].tolist() == table[f"videos/{key}/from_timestamp"]
        assert meta.video_to_s[key].tolist() == table[f"videos/{key}/to_timestamp"]
    # Each episode spans length / fps seconds of its video.
    assert np.allclose(meta.video_to_s[FRONT] - meta.video_from_s[FRONT], meta.length / 30)


# --- layouts written by the helper ---------------------------------------------------------------


def test_episodes_files_are_followed_by_the_rollover_rule(tmp_path):
    lengths = [3, 0, 5, 2, 7, 4, 1]
    layout = write_layout(
        tmp_path,
        lengths,
        cameras=["cam.a", "cam.b"],
        episodes_per_data_file=3,
        episodes_per_video_file=2,
        episodes_per_meta_file=2,
        chunks_size=2,
    )
    assert layout.meta_files[2] == "meta/episodes/chunk-001/file-000.parquet"
    meta = load_meta(LocalSource(tmp_path))
    assert meta.length.tolist() == lengths
    assert meta.from_index.tolist() == layout.from_index
    assert [meta.data_relpath(e) for e in range(7)] == [
        f"data/chunk-{c:03d}/file-{f:03d}.parquet" for c, f in layout.data_files
    ]
    assert [meta.video_relpath(e, "cam.b") for e in range(7)] == [
        f"videos/cam.b/chunk-{c:03d}/file-{f:03d}.mp4" for c, f in layout.video_files
    ]
    assert meta.video_from_s["cam.a"].tolist() == layout.video_from_s


@settings(max_examples=25, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 6), min_size=1, max_size=12),
    per_meta_file=st.integers(1, 5),
    per_data_file=st.integers(1, 5),
    chunks_size=st.integers(1, 3),
)
def test_random_layouts_load_as_written(lengths, per_meta_file, per_data_file, chunks_size):
    # Oracle: the helper's own record of what it wrote (cumulative sums, rollover pairs).
    with tempfile.TemporaryDirectory() as root:
        layout = write_layout(
            Path(root),
            lengths,
            cameras=["cam"],
            episodes_per_meta_file=per_meta_file,
            episodes_per_data_file=per_data_file,
            episodes_per_video_file=per_data_file + 1,
            chunks_size=chunks_size,
            write_data=False,
        )
        meta = load_meta(LocalSource(root))
    assert meta.episode_index.tolist() == list(range(len(lengths)))
    assert [meta.frames(e) for e in range(len(lengths))] == lengths
    assert meta.from_index.tolist() == layout.from_index
    assert meta.to_index.tolist() == layout.to_index
    data_files = zip(meta.data_chunk.tolist(), meta.data_file.tolist(), strict=True)
    assert list(data_files) == layout.data_files
    assert meta.video_from_s["cam"].tolist() == layout.video_from_s
    assert meta.video_to_s["cam"].tolist() == layout.video_to_s
    # Every video file, whole: the files of each episode, looked up one at a time.
    assert meta.video_files() == sorted({meta.video_relpath(e, "cam") for e in range(len(lengths))})


def test_stats_columns_are_never_read(tmp_path):
    layout = write_layout(tmp_path, [4, 6], episodes_per_meta_file=1)
    for relpath in layout.meta_files:
        assert corrupt_columns(tmp_path / relpath, "stats/") > 0
        with pytest.raises(OSError):  # the corruption is real: a full read fails
            pq.read_table(tmp_path / relpath)
    assert load_meta(LocalSource(tmp_path)).length.tolist() == [4, 6]


def test_each_episodes_task_strings_are_read_when_every_file_has_them(tmp_path):
    layout = write_layout(tmp_path, [4, 6, 5], episodes_per_meta_file=2)
    meta = load_meta(LocalSource(tmp_path))
    assert meta.episodes["tasks"] == [[layout.tasks[e % 2]] for e in range(3)]
    assert meta.episodes["dataset_from_index"] is meta.from_index  # the columns, by file name
    last = tmp_path / layout.meta_files[-1]
    pq.write_table(pq.read_table(last).drop_columns(["tasks"]), last)
    meta = load_meta(LocalSource(tmp_path))  # no error: the column is not needed
    assert "tasks" not in meta.episodes and meta.length.tolist() == [4, 6, 5]


def test_a_dataset_without_cameras_has_no_video_path(tmp_path):
    write_layout(tmp_path, [2, 3], cameras=[])
    meta = load_meta(LocalSource(tmp_path))
    assert meta.camera_keys == [] and meta.video_path is None


# --- what the dataset is, when refstream does not read it ----------------------------------------


@pytest.mark.parametrize(
    "overrides, pattern",
    [
        ({"codebase_version": "v2.1"}, r"v2\.1 dataset.*convert"),
        ({"codebase_version": "v3.1"}, r"v3\.1 dataset"),
        ({"storage_format": "lance"}, r"lance"),
        ({"storage_format": "zarr"}, r"zarr"),
    ],
)
def test_other_versions_and_storage_formats_are_unsupported(tmp_path, overrides, pattern):
    write_layout(tmp_path, [2], info_overrides=overrides)
    with pytest.raises(UnsupportedDataset, match=pattern):
        load_meta(LocalSource(tmp_path))


def test_image_features_are_unsupported_and_named(tmp_path):
    image = {"dtype": "image", "shape": [8, 8, 3], "names": ["height", "width", "channels"]}
    layout = write_layout(tmp_path, [2])
    info = json.loads((tmp_path / "meta/info.json").read_text())
    info["features"]["observation.images.top"] = image
    (layout.root / "meta/info.json").write_text(json.dumps(info))
    with pytest.raises(UnsupportedDataset, match="observation.images.top"):
        load_meta(LocalSource(tmp_path))


# --- malformed layouts ---------------------------------------------------------------------------


def test_a_length_mismatch_names_episode_and_numbers(tmp_path):
    write_layout(tmp_path, [4, 6, 5], episode_overrides={"length": [4, 7, 5]})
    with pytest.raises(MalformedDataset, match=r"episode 1: .*= 6, but length is 7"):
        load_meta(LocalSource(tmp_path))


@pytest.mark.parametrize(
    "overrides, pattern",
    [
        ({"total_frames": 99}, r"hold 15 frames.*total_frames is 99"),
        ({"total_episodes": 2}, r"3 episode rows.*total_episodes is 2"),
        ({"total_episodes": 4}, r"meta/episodes/chunk-000/file-001.parquet: missing"),
        ({"fps": 0}, r"fps"),
        ({"chunks_size": DELETE}, r"chunks_size"),
        ({"codebase_version": DELETE}, r"codebase_version"),
        ({"total_tasks": 5}, r"total_tasks is 5"),
    ],
)
def test_totals_and_fields_are_checked_against_info(tmp_path, overrides, pattern):
    write_layout(tmp_path, [4, 6, 5], info_overrides=overrides)
    with pytest.raises(MalformedDataset, match=pattern):
        load_meta(LocalSource(tmp_path))


@pytest.mark.parametrize("ids", [[0, 1, 1], [0, 2, 1], [-1, 0, 1]])
def test_episode_ids_must_be_unique_sorted_and_non_negative(tmp_path, ids):
    write_layout(tmp_path, [4, 6, 5], episode_overrides={"episode_index": ids})
    with pytest.raises(MalformedDataset, match="episode_index"):
        load_meta(LocalSource(tmp_path))


def test_nulls_and_missing_columns_are_named(tmp_path):
    write_layout(tmp_path / "a", [4, 6], episode_overrides={"data/file_index": [0, None]})
    with pytest.raises(MalformedDataset, match=r"'data/file_index' has 1 null"):
        load_meta(LocalSource(tmp_path / "a"))
    write_layout(tmp_path / "b", [4, 6], cameras=["cam"])
    table = pq.read_table(tmp_path / "b/meta/episodes/chunk-000/file-000.parquet")
    pq.write_table(
        table.drop_columns(["videos/cam/to_timestamp"]),
        tmp_path / "b/meta/episodes/chunk-000/file-000.parquet",
    )
    with pytest.raises(
        MalformedDataset, match=r"missing column\(s\) \['videos/cam/to_timestamp'\]"
    ):
        load_meta(LocalSource(tmp_path / "b"))


def test_missing_files_are_named(tmp_path):
    write_layout(tmp_path, [4])
    (tmp_path / "meta/tasks.parquet").unlink()
    with pytest.raises(MalformedDataset, match="meta/tasks.parquet: missing"):
        load_meta(LocalSource(tmp_path))
    with pytest.raises(MalformedDataset, match="meta/info.json: missing"):
        load_meta(LocalSource(tmp_path / "elsewhere"))


@pytest.mark.parametrize("relpath", ["meta/info.json", "meta/stats.json"])
def test_a_json_file_that_is_not_json_is_named(tmp_path, relpath):
    write_layout(tmp_path, [4])
    (tmp_path / relpath).write_bytes(b"\xff not json")
    with pytest.raises(MalformedDataset, match=f"^{relpath}: not valid JSON"):
        load_meta(LocalSource(tmp_path))


def test_json_nested_past_the_parser_s_depth_is_named_not_a_recursion_error(tmp_path):
    write_layout(tmp_path, [4])
    (tmp_path / "meta/stats.json").write_bytes(b"[" * 100_000)
    with pytest.raises(MalformedDataset, match="^meta/stats.json: not valid JSON"):
        load_meta(LocalSource(tmp_path))


def test_a_dataset_without_stats_json_has_none_and_with_one_has_its_arrays(tmp_path):
    write_layout(tmp_path, [4])
    (tmp_path / "meta/stats.json").write_bytes(b'{"action": {"max": [2, 3]}}')
    assert load_meta(LocalSource(tmp_path)).stats["action"]["max"].tolist() == [2.0, 3.0]
    (tmp_path / "meta/stats.json").unlink()
    assert load_meta(LocalSource(tmp_path)).stats is None


def test_stats_json_may_hold_nan_as_lerobot_writes_it_and_info_json_may_not(tmp_path):
    write_layout(tmp_path, [4])
    (tmp_path / "meta/stats.json").write_bytes(b'{"action": {"mean": [NaN, 1.5]}}')
    assert np.isnan(load_meta(LocalSource(tmp_path)).stats["action"]["mean"][0])
    info = tmp_path / "meta/info.json"
    info.write_bytes(info.read_bytes().replace(b"{", b'{"x": NaN, ', 1))
    with pytest.raises(MalformedDataset, match="^meta/info.json: not valid JSON"):
        load_meta(LocalSource(tmp_path))


@pytest.mark.parametrize(
    "overrides, error, pattern",
    [
        ({"data_path": "../{chunk_index}/{file_index}.parquet"}, UnsafePath, r"\.\./0/0"),
        ({"data_path": "/data/{chunk_index}/{file_index}.parquet"}, UnsafePath, "/data/0/0"),
        ({"data_path": "data/{chunk_index}-{episode_index}.pq"}, MalformedDataset, "episode_index"),
        ({"data_path": "data/{chunk_index}.parquet"}, MalformedDataset, "file_index"),
        ({"data_path": "data/{chunk_index.real}/{file_index}"}, MalformedDataset, "chunk_index"),
        ({"data_path": "data/{chunk_index!r}/{file_index}"}, MalformedDataset, "chunk_index"),
        ({"data_path": "data/{chunk_index:q}/{file_index}"}, MalformedDataset, "data_path"),
        ({"data_path": "data/{chunk_index/{file_index}"}, MalformedDataset, "data_path"),
        ({"data_path": None}, MalformedDataset, "data_path"),
        ({"video_path": "videos/{chunk_index}/{file_index}.mp4"}, MalformedDataset, "video_key"),
        ({"video_path": "C:/{video_key}/{chunk_index}/{file_index}"}, UnsafePath, "C:"),
        ({"video_path": None}, MalformedDataset, "video_path"),
    ],
)
def test_templates_are_validated(tmp_path, overrides, error, pattern):
    write_layout(tmp_path, [4, 6], info_overrides=overrides)
    with pytest.raises(error, match=pattern):
        load_meta(LocalSource(tmp_path))


def test_a_camera_key_cannot_lead_out_of_the_root(tmp_path):
    write_layout(tmp_path, [4], cameras=["../../etc"])
    with pytest.raises(UnsafePath, match=r"\.\./\.\./etc"):
        load_meta(LocalSource(tmp_path))


@pytest.mark.parametrize("relpath", ["/etc/passwd", "../x", "a/../../x", "a//b", "./a", "", "a\\b"])
def test_local_source_refuses_unsafe_relpaths(tmp_path, relpath):
    with pytest.raises(UnsafePath):
        LocalSource(tmp_path).read_bytes(relpath)


@given(st.text(alphabet="ab./\\:", max_size=10))
def test_every_accepted_relpath_stays_inside_the_root(relpath):
    # Oracle: POSIX normalisation. An accepted path is relative and already normal.
    try:
        check_relpath(relpath)
    except UnsafePath:
        return
    normal = posixpath.normpath(relpath)
    assert normal == relpath and ":" not in normal
    assert normal != ".." and not normal.startswith(("/", "../"))


# --- episode selection ---------------------------------------------------------------------------


def test_selection_rules():
    meta = load_meta(LocalSource(ORACLE_ROOT))
    assert select_episodes(meta, None) == [0, 1, 2, 3, 4]
    assert select_episodes(meta, [4, 1]) == [1, 4]
    assert select_episodes(meta, np.array([3, 0])) == [0, 3]
    with pytest.raises(EpisodeSelectionError, match=r"duplicate episode ids \[1, 3\]"):
        select_episodes(meta, [1, 3, 1, 3, 1])
    with pytest.raises(EpisodeSelectionError, match=r"not in the dataset: \[5, 9\]"):
        select_episodes(meta, [9, 0, 5])
    with pytest.raises(EpisodeSelectionError, match="no episode"):
        select_episodes(meta, [])
    with pytest.raises(EpisodeSelectionError, match="integers"):
        select_episodes(meta, [True, 1.0])
    with pytest.raises(EpisodeSelectionError, match="episode 7"):
        meta.frames(7)
    with pytest.raises(UsageError, match="'observation.images.top' is not a camera"):
        meta.video_relpath(0, "observation.images.top")


# --- conformance fixtures ------------------------------------------------------------------------


def derive_meta_answer(case: dict) -> dict:
    """The expected answer of a valid ``meta`` case, derived from its JSON alone (no Parquet):
    episodes files found by listing and sorting, frames = to − from, paths by str.format."""
    files = case["files"]
    info = files["meta/info.json"]["json"]
    numbered = sorted(
        (tuple(int(n) for n in re.findall(r"\d+", path)), path)
        for path in files
        if path.startswith("meta/episodes/")
    )
    columns: dict[str, list] = {}
    for _, path in numbered:
        for name, column in files[path]["parquet"].items():
            columns.setdefault(name, []).extend(column["values"])
    cameras = [k for k, f in info["features"].items() if f["dtype"] == "video"]
    ids = columns["episode_index"]
    tasks = dict(
        zip(
            files["meta/tasks.parquet"]["parquet"]["task_index"]["values"],
            files["meta/tasks.parquet"]["parquet"]["task"]["values"],
            strict=True,
        )
    )
    answer = {
        "fps": info["fps"],
        "camera_keys": cameras,
        "parquet_keys": [k for k in info["features"] if k not in cameras],
        "total_episodes": info["total_episodes"],
        "total_frames": info["total_frames"],
        "episode_index": ids,
        "from_index": columns["dataset_from_index"],
        "to_index": columns["dataset_to_index"],
        "frames": [
            b - a
            for a, b in zip(columns["dataset_from_index"], columns["dataset_to_index"], strict=True)
        ],
        "data_relpath": [
            info["data_path"].format(chunk_index=c, file_index=f)
            for c, f in zip(columns["data/chunk_index"], columns["data/file_index"], strict=True)
        ],
        "video_relpath": {
            k: [
                info["video_path"].format(video_key=k, chunk_index=c, file_index=f)
                for c, f in zip(
                    columns[f"videos/{k}/chunk_index"],
                    columns[f"videos/{k}/file_index"],
                    strict=True,
                )
            ]
            for k in cameras
        },
        "video_from_s": {k: columns[f"videos/{k}/from_timestamp"] for k in cameras},
        "video_to_s": {k: columns[f"videos/{k}/to_timestamp"] for k in cameras},
        "tasks": [tasks[i] for i in range(len(tasks))],
    }
    if "select" in case:
        answer["selection"] = ids if case["select"] is None else sorted(case["select"])
    return answer


FIXTURE_CASES = sorted(FIXTURES.glob("*.json"))

# Why each error case fails: a fragment of refstream's message, so a case cannot pass by failing
# for an unrelated reason.
ERROR_REASONS = {
    "malformed-duplicate-episode-ids": "1 then 1",
    "malformed-info-not-json": "not valid JSON",
    "malformed-length-mismatch": "episode 2: dataset_to_index - dataset_from_index = 10 - 4 = 6",
    "malformed-missing-episodes-file": "meta/episodes/chunk-000/file-001.parquet: missing",
    "malformed-missing-tasks": "meta/tasks.parquet: missing",
    "malformed-total-frames": "total_frames is 11",
    "malformed-unknown-placeholder": "{episode_index}",
    "malformed-video-times": "episode 1: videos/observation.images.front",
    "selection-duplicates": "duplicate episode ids [2]",
    "selection-unknown": "not in the dataset: [3]",
    "unsafe-absolute-video-path": "'/videos/observation.images.front/0/0.mp4'",
    "unsafe-data-path-escapes-root": "'../0/0.parquet'",
    "unsupported-depth-feature": "'observation.images.depth' is a depth map",
    "unsupported-image-feature": "'observation.images.top' has dtype 'image'",
    "unsupported-lance": "storage_format 'lance'",
    "unsupported-v2.1": "v2.1 dataset",
    "malformed-float-episode-index": "column 'episode_index' has type double",
    "malformed-float-length": "column 'length' has type double",
    "malformed-fps-fraction": "fps must be an integer >= 1, got 12.5",
    "malformed-fps-written-as-float": "fps must be an integer >= 1, got 10.0",
    "malformed-template-conversion": "{chunk_index!s}/{file_index}.parquet': placeholder 'chunk",
    "malformed-template-hex": "{chunk_index:x}/file-{file_index:03d}.parquet': placeholder 'chunk",
    "malformed-template-no-type": "{file_index:03}.parquet': placeholder 'file_index'",
    "malformed-template-padded-video-key": "{video_key:>30}/{chunk_index:03d}/{file_index}.mp4': "
    "placeholder 'video_key'",
    "malformed-template-positional": "{}/{chunk_index}/{file_index}.parquet': placeholder ''",
    "malformed-template-space-padded": "{chunk_index:3d}/file-{file_index:03d}.parquet': "
    "placeholder 'chunk_index'",
    "malformed-template-zero-width": "{chunk_index:00d}/file-{file_index:03d}.parquet': "
    "placeholder 'chunk_index'",
    "selection-boolean": "must be integers, got [True]",
    "selection-not-an-integer": "must be integers, got [1.5]",
    "unsupported-storage-format-null": "unknown storage_format None",
    "malformed-info-nan-token": "NaN is not a JSON value",
    "malformed-info-infinity-token": "-Infinity is not a JSON value",
    "malformed-info-byte-order-mark": "BOM",
    "malformed-float-task-index": "column 'task_index' has type double",
    "malformed-total-tasks-written-as-float": "total_tasks is 2.0",
}


def test_there_are_meta_fixtures_of_every_outcome():
    cases = [json.loads(p.read_text()) for p in FIXTURE_CASES]
    outcomes = {c["expected"].get("error", "ok") for c in cases}
    assert len(cases) >= 12
    assert {"ok", "UnsupportedDataset", "MalformedDataset", "UnsafePath"} <= outcomes
    assert "EpisodeSelectionError" in outcomes


@pytest.mark.parametrize("path", FIXTURE_CASES, ids=lambda p: p.name)
def test_meta_fixtures(path):
    case = json.loads(path.read_text())
    assert case["kind"] == "meta"
    expected = case["expected"]
    if "error" in expected:
        assert hasattr(errors, expected["error"])  # a class name from refstream.errors
    else:
        assert expected == derive_meta_answer(case["input"])
    try:
        answer = adapters.kind_meta(json.loads(json.dumps(case["input"])))
    except errors.RefstreamError as exc:
        answer = {"error": type(exc).__name__}
        assert ERROR_REASONS[path.stem] in str(exc)
    assert json.loads(json.dumps(answer)) == expected


def test_layout_helper_data_rows_agree_with_the_metadata(tmp_path):
    # The helper's data Parquet, found through data_relpath, holds each episode's rows in order.
    write_layout(tmp_path, [3, 0, 4, 2], episodes_per_data_file=2, fps=15)
    meta = load_meta(LocalSource(tmp_path))
    for e in meta.episode_index.tolist():
        table = pq.read_table(tmp_path / meta.data_relpath(e)).to_pydict()
        rows = [i for i, owner in enumerate(table["episode_index"]) if owner == e]
        assert len(rows) == meta.frames(e)
        assert [table["frame_index"][i] for i in rows] == list(range(meta.frames(e)))
        first = int(meta.from_index[meta.row(e)])
        assert [table["index"][i] for i in rows] == list(range(first, first + meta.frames(e)))
        assert [table["timestamp"][i] for i in rows] == [
            float(np.float32(f / 15)) for f in range(meta.frames(e))
        ]
