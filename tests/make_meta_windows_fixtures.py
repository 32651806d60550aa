"""Write the ``meta`` and ``windows`` conformance cases in ``spec/fixtures/{meta,windows}/``.

Run ``PYTHONPATH=. python3 tests/make_meta_windows_fixtures.py`` from the repository root.
Expected values come from the oracles in the test modules, never from refstream: ``windows``
answers from the brute-force map-style oracle (``tests/test_windows.py: oracle_answer``), valid
``meta`` answers from the plain-JSON derivation (``tests/test_meta.py: derive_meta_answer``);
expected errors are written by hand below, one per rule of ``spec/SPEC.md`` §4. The
tests re-derive every windows answer and every valid meta answer, so such a fixture edited by
hand without its oracle fails.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))

from test_meta import derive_meta_answer  # noqa: E402
from test_windows import oracle_answer  # noqa: E402

FIXTURES = TESTS.parent / "spec" / "fixtures"
CAM = "observation.images.front"
EPISODES = "meta/episodes/chunk-{:03d}/file-{:03d}.parquet"


# --- windows -------------------------------------------------------------------------------------

LEROBOT_DT = {
    "observation.images.front": [-2 / 30, -1 / 30, 0.0],
    "observation.images.wrist": [0.0, 1 / 30],
    "observation.state": [-1 / 30, 0.0],
    "action": [k / 30 for k in range(8)],
}
LEROBOT_KEYS = list(LEROBOT_DT) + ["timestamp", "frame_index", "episode_index", "index"]

WINDOWS = {
    "lerobot-oracle-windows": (
        "The windows of spec/fixtures/lerobot (k/30 in floating point) on its first episode",
        dict(
            delta_timestamps=LEROBOT_DT,
            fps=30,
            tolerance_s=1e-4,
            length=30,
            frames=[0, 1, 2, 15, 22, 23, 28, 29],
            feature_keys=LEROBOT_KEYS,
        ),
    ),
    "one-frame-episode": (
        "A one-frame episode: every position repeats row 0, all but offset 0 pad",
        dict(
            delta_timestamps={"action": [-0.1, 0.0, 0.1, 0.2]},
            fps=10,
            tolerance_s=1e-4,
            length=1,
            frames=[0],
        ),
    ),
    "past-both-ends": (
        "A window wider than the episode reaches past both ends at every anchor",
        dict(
            delta_timestamps={"a": [-1.0, -0.5, -0.25, 0.0, 0.25, 0.5, 1.0]},
            fps=4,
            tolerance_s=1e-4,
            length=3,
            frames=[0, 1, 2],
        ),
    ),
    "round-half-to-even": (
        "d·fps on .5 rounds half to even: -1.5→-2, -0.5→0, 0.5→0, 1.5→2, 2.5→2",
        dict(
            delta_timestamps={"k": [-0.75, -0.25, 0.25, 0.75, 1.25]},
            fps=2,
            tolerance_s=0.25,
            length=6,
            frames=[0, 1, 2, 3, 4, 5],
        ),
    ),
    "history-only": (
        "Past-only window (observation history) pads at the episode start",
        dict(
            delta_timestamps={"observation.state": [-0.2, -0.1, 0.0]},
            fps=10,
            tolerance_s=1e-4,
            length=5,
            frames=[0, 1, 2, 3, 4],
        ),
    ),
    "action-chunk-longer-than-episode": (
        "Sixteen future actions (k/30) over a ten-frame episode",
        dict(
            delta_timestamps={"action": [k / 30 for k in range(16)]},
            fps=30,
            tolerance_s=1e-4,
            length=10,
            frames=[0, 5, 9],
        ),
    ),
    "float-one-ulp-off-grid": (
        "31/30 and 62/30 s at 30 fps miss the grid by one ulp in floating point: offsets 31, 62",
        dict(
            delta_timestamps={"action": [-31 / 30, 31 / 30, 62 / 30]},
            fps=30,
            tolerance_s=1e-4,
            length=70,
            frames=[0, 30, 31, 38, 69],
        ),
    ),
    "tolerance-bound-inclusive": (
        "3·0.1·10 = 3.0000000000000004: admitted when tolerance_s equals its distance exactly",
        dict(
            delta_timestamps={"k": [3 * 0.1]},
            fps=10,
            tolerance_s=abs(3 * 0.1 * 10 - 3) / 10,
            length=5,
            frames=[0, 1, 2],
        ),
    ),
    "no-windowed-keys": (
        "An empty delta_timestamps gives no offsets, rows or pads",
        dict(delta_timestamps={}, fps=30, tolerance_s=1e-4, length=3, frames=[0, 2]),
    ),
    "error-off-grid": (
        "0.01 s is 0.3 frame off the 30 fps grid: UsageError",
        dict(
            delta_timestamps={"action": [0.0, 0.01]}, fps=30, tolerance_s=1e-4, length=5, frames=[0]
        ),
    ),
    "error-zero-tolerance": (
        "A zero tolerance refuses 3·0.1 at 10 fps (4.4e-17 s off the grid): UsageError",
        dict(delta_timestamps={"k": [3 * 0.1]}, fps=10, tolerance_s=0.0, length=5, frames=[0]),
    ),
    "error-unknown-key": (
        "A windowed key that is not a feature: UsageError",
        dict(
            delta_timestamps={"actions": [0.0]},
            fps=30,
            tolerance_s=1e-4,
            length=5,
            frames=[0],
            feature_keys=["action", "timestamp"],
        ),
    ),
    "error-empty-deltas": (
        "A key with an empty delta list: UsageError",
        dict(delta_timestamps={"action": []}, fps=30, tolerance_s=1e-4, length=5, frames=[0]),
    ),
    "error-anchor-outside": (
        "An anchor frame equal to the episode length: UsageError",
        dict(delta_timestamps={"action": [0.0]}, fps=30, tolerance_s=1e-4, length=5, frames=[4, 5]),
    ),
    "error-fps-not-an-integer": (
        "fps 29.97 is not an integer: UsageError",
        dict(delta_timestamps={"action": [0.0]}, fps=29.97, tolerance_s=1e-4, length=5, frames=[0]),
    ),
    "error-negative-tolerance": (
        "A negative tolerance: UsageError",
        dict(delta_timestamps={"action": [0.0]}, fps=30, tolerance_s=-1e-4, length=5, frames=[0]),
    ),
    "error-delta-boolean": (
        "A delta that is a boolean, not a number: UsageError",
        dict(delta_timestamps={"action": [0.0, True]}, fps=30, tolerance_s=1e-4, length=5,
             frames=[0]),
    ),
    "error-deltas-not-a-list": (
        "A key whose value is a number, not a list: UsageError",
        dict(delta_timestamps={"action": 0.1}, fps=10, tolerance_s=1e-4, length=5, frames=[0]),
    ),
}


# --- meta ----------------------------------------------------------------------------------------


def parquet(columns: dict[str, tuple[str, list]]) -> dict:
    """A Parquet file description: column name -> (type, values)."""
    return {"parquet": {name: {"type": t, "values": v} for name, (t, v) in columns.items()}}


def episodes_file(ids, lengths, starts, data, video, video_from, cameras=(CAM,), **extra):
    """One episodes Parquet description (with a stats column that must not matter)."""
    columns = {
        "episode_index": ("int64", ids),
        "tasks": ("list<string>", [["pick"] for _ in ids]),
        "length": ("int64", lengths),
        "data/chunk_index": ("int64", [c for c, _ in data]),
        "data/file_index": ("int64", [f for _, f in data]),
        "dataset_from_index": ("int64", starts),
        "dataset_to_index": ("int64", [s + n for s, n in zip(starts, lengths, strict=True)]),
    }
    for key in cameras:
        columns[f"videos/{key}/chunk_index"] = ("int64", [c for c, _ in video])
        columns[f"videos/{key}/file_index"] = ("int64", [f for _, f in video])
        columns[f"videos/{key}/from_timestamp"] = ("float64", video_from)
        columns[f"videos/{key}/to_timestamp"] = (
            "float64",
            [a + n / 10 for a, n in zip(video_from, lengths, strict=True)],
        )
    columns["stats/action/mean"] = ("list<float64>", [[0.5, 0.25] for _ in ids])
    columns.update(extra)
    return parquet(columns)


def base_dataset(cameras=(CAM,)) -> dict:
    """A valid three-episode dataset at 10 fps (lengths 4, 0, 6), one episodes file."""
    features = {key: {"dtype": "video", "shape": [8, 8, 3]} for key in cameras}
    features.update(
        {
            "action": {"dtype": "float32", "shape": [2]},
            "timestamp": {"dtype": "float32", "shape": [1]},
            "index": {"dtype": "int64", "shape": [1]},
        }
    )
    info = {
        "codebase_version": "v3.0",
        "fps": 10,
        "features": features,
        "total_episodes": 3,
        "total_frames": 10,
        "total_tasks": 2,
        "chunks_size": 1000,
        "data_path": "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet",
        "video_path": "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"
        if cameras
        else None,
    }
    return {
        "files": {
            "meta/info.json": {"json": info},
            EPISODES.format(0, 0): episodes_file(
                [0, 1, 2],
                [4, 0, 6],
                [0, 4, 4],
                [(0, 0)] * 3,
                [(0, 0)] * 3,
                [0.0, 0.4, 0.4],
                cameras=cameras,
            ),
            "meta/tasks.parquet": parquet(
                {"task_index": ("int64", [1, 0]), "task": ("string", ["place", "pick"])}
            ),
        }
    }


def with_info(case: dict, **changes) -> dict:
    case = copy.deepcopy(case)
    case["files"]["meta/info.json"]["json"].update(changes)
    return case


def with_column(case: dict, path: str, name: str, values: list) -> dict:
    case = copy.deepcopy(case)
    case["files"][path]["parquet"][name]["values"] = values
    return case


def rollover_dataset() -> dict:
    """Five episodes over three episodes files with chunks_size 2: chunk 0 files 0 and 1, then
    chunk 1 file 0; data in two files of different chunks, video in two files."""
    lengths = [3, 5, 2, 4, 1]
    starts = [0, 3, 8, 10, 14]
    data = [(0, 0), (0, 0), (0, 1), (0, 1), (1, 0)]
    video = [(0, 0), (0, 0), (0, 0), (0, 1), (0, 1)]
    video_from = [0.0, 0.3, 0.8, 0.0, 0.4]
    case = base_dataset()
    info = case["files"]["meta/info.json"]["json"]
    info.update(total_episodes=5, total_frames=15, chunks_size=2)
    del case["files"][EPISODES.format(0, 0)]
    for path, rows in [
        (EPISODES.format(0, 0), [0, 1]),
        (EPISODES.format(0, 1), [2, 3]),
        (EPISODES.format(1, 0), [4]),
    ]:
        case["files"][path] = episodes_file(
            rows,
            [lengths[e] for e in rows],
            [starts[e] for e in rows],
            [data[e] for e in rows],
            [video[e] for e in rows],
            [video_from[e] for e in rows],
        )
    return case


def meta_cases() -> dict[str, tuple[str, dict, dict | None]]:
    """name -> (description, input, hand-written expected error or None for a valid case)."""
    base = base_dataset()
    ep0 = EPISODES.format(0, 0)
    cases = {
        "valid-zero-length-episode": (
            "Three episodes (4, 0, 6 frames), one camera; tasks stored out of task_index order",
            {**base, "select": None},
            None,
        ),
        "valid-rollover": (
            "Episodes files followed by the rollover rule with chunks_size 2; selection sorted",
            {**rollover_dataset(), "select": [4, 0, 2]},
            None,
        ),
        "valid-no-cameras": (
            "No video features and video_path null",
            base_dataset(cameras=()),
            None,
        ),
        "valid-custom-templates": (
            "Templates with other layouts and format specs are followed exactly",
            with_info(
                base,
                data_path="parquet/{chunk_index}/part-{file_index:05d}.parquet",
                video_path="mp4/{chunk_index:02d}/{video_key}/{file_index}.mp4",
            ),
            None,
        ),
        "unsupported-v2.1": (
            "codebase_version v2.1: UnsupportedDataset",
            with_info(base, codebase_version="v2.1"),
            "UnsupportedDataset",
        ),
        "unsupported-lance": (
            "storage_format lance: UnsupportedDataset",
            with_info(base, storage_format="lance"),
            "UnsupportedDataset",
        ),
        "unsupported-depth-feature": (
            "A video feature LeRobot reads as a depth map (info.is_depth_map): UnsupportedDataset",
            with_info(
                base,
                features={
                    **base["files"]["meta/info.json"]["json"]["features"],
                    "observation.images.depth": {"dtype": "video", "shape": [8, 8, 1],
                                                 "info": {"video.is_depth_map": True}},
                },
            ),
            "UnsupportedDataset",
        ),
        "unsupported-image-feature": (
            "A feature of dtype image (images inside Parquet): UnsupportedDataset",
            with_info(
                base,
                features={
                    **base["files"]["meta/info.json"]["json"]["features"],
                    "observation.images.top": {"dtype": "image", "shape": [8, 8, 3]},
                },
            ),
            "UnsupportedDataset",
        ),
        "malformed-length-mismatch": (
            "Episode 2 says length 5 but spans 6 rows: MalformedDataset",
            with_column(base, ep0, "length", [4, 0, 5]),
            "MalformedDataset",
        ),
        "malformed-total-frames": (
            "info total_frames 11 but episodes hold 10: MalformedDataset",
            with_info(base, total_frames=11),
            "MalformedDataset",
        ),
        "malformed-missing-episodes-file": (
            "total_episodes 4 needs a second episodes file that is absent: MalformedDataset",
            with_info(base, total_episodes=4),
            "MalformedDataset",
        ),
        "malformed-duplicate-episode-ids": (
            "episode_index 0, 1, 1: MalformedDataset",
            with_column(base, ep0, "episode_index", [0, 1, 1]),
            "MalformedDataset",
        ),
        "malformed-video-times": (
            "to_timestamp before from_timestamp: MalformedDataset",
            with_column(base, ep0, f"videos/{CAM}/to_timestamp", [0.4, 0.3, 1.0]),
            "MalformedDataset",
        ),
        "malformed-unknown-placeholder": (
            "data_path uses {episode_index}: MalformedDataset",
            with_info(base, data_path="data/{chunk_index}/{file_index}/{episode_index}.pq"),
            "MalformedDataset",
        ),
        "malformed-info-not-json": (
            "meta/info.json is not JSON: MalformedDataset",
            {"files": {**base["files"], "meta/info.json": {"text": "{codebase_version: v3.0"}}},
            "MalformedDataset",
        ),
        "malformed-missing-tasks": (
            "meta/tasks.parquet is absent: MalformedDataset",
            {"files": {k: v for k, v in base["files"].items() if k != "meta/tasks.parquet"}},
            "MalformedDataset",
        ),
        "unsafe-data-path-escapes-root": (
            "data_path starting with ../: UnsafePath",
            with_info(base, data_path="../{chunk_index}/{file_index}.parquet"),
            "UnsafePath",
        ),
        "unsafe-absolute-video-path": (
            "video_path starting with /: UnsafePath",
            with_info(base, video_path="/videos/{video_key}/{chunk_index}/{file_index}.mp4"),
            "UnsafePath",
        ),
        "selection-duplicates": (
            "episodes=[2, 0, 2]: EpisodeSelectionError",
            {**base, "select": [2, 0, 2]},
            "EpisodeSelectionError",
        ),
        "selection-unknown": (
            "episodes=[1, 3]: EpisodeSelectionError",
            {**base, "select": [1, 3]},
            "EpisodeSelectionError",
        ),
        "selection-not-an-integer": (
            "episodes=[0, 1.5]: EpisodeSelectionError",
            {**base, "select": [0, 1.5]},
            "EpisodeSelectionError",
        ),
        "selection-boolean": (
            "episodes=[true]: a boolean is not an episode id: EpisodeSelectionError",
            {**base, "select": [True]},
            "EpisodeSelectionError",
        ),
        "unsupported-storage-format-null": (
            "storage_format null is a value other than parquet: UnsupportedDataset",
            with_info(base, storage_format=None),
            "UnsupportedDataset",
        ),
        "valid-storage-format-parquet": (
            "storage_format parquet, written out",
            with_info(base, storage_format="parquet"),
            None,
        ),
        "malformed-float-episode-index": (
            "episode_index stored as float64 (0.0, 1.0, 2.0): MalformedDataset",
            with_type(base, ep0, "episode_index", "float64"),
            "MalformedDataset",
        ),
        "malformed-float-length": (
            "length stored as float64: MalformedDataset",
            with_type(base, ep0, "length", "float64"),
            "MalformedDataset",
        ),
        "valid-integer-timestamps": (
            "from_timestamp and to_timestamp stored as int64 seconds are read as seconds",
            with_type(
                with_column(
                    with_column(base, ep0, f"videos/{CAM}/from_timestamp", [0, 1, 1]),
                    ep0, f"videos/{CAM}/to_timestamp", [1, 1, 2]),
                ep0, f"videos/{CAM}/from_timestamp", "int64", f"videos/{CAM}/to_timestamp"),
            None,
        ),
        "malformed-fps-written-as-float": (
            "info.json (given as text) writes fps as 10.0, a number with a fraction part: "
            "MalformedDataset",
            info_text(base, '"fps": 10', '"fps": 10.0'),
            "MalformedDataset",
        ),
        "malformed-fps-fraction": (
            "fps 12.5: MalformedDataset",
            with_info(base, fps=12.5),
            "MalformedDataset",
        ),
        "malformed-template-space-padded": (
            "{chunk_index:3d} pads with spaces, outside the template subset: MalformedDataset",
            with_info(base, data_path="data/chunk-{chunk_index:3d}/file-{file_index:03d}.parquet"),
            "MalformedDataset",
        ),
        "malformed-template-hex": (
            "{chunk_index:x} (hexadecimal) is outside the template subset: MalformedDataset",
            with_info(base, data_path="data/chunk-{chunk_index:x}/file-{file_index:03d}.parquet"),
            "MalformedDataset",
        ),
        "malformed-template-no-type": (
            "{file_index:03} (no d) is outside the template subset: MalformedDataset",
            with_info(base, data_path="data/chunk-{chunk_index:03d}/file-{file_index:03}.parquet"),
            "MalformedDataset",
        ),
        "malformed-template-zero-width": (
            "{chunk_index:00d} (width 0) is outside the template subset: MalformedDataset",
            with_info(base, data_path="data/chunk-{chunk_index:00d}/file-{file_index:03d}.parquet"),
            "MalformedDataset",
        ),
        "malformed-template-padded-video-key": (
            "{video_key:>30} is outside the template subset (video_key takes no spec): "
            "MalformedDataset",
            with_info(base, video_path="videos/{video_key:>30}/{chunk_index:03d}/{file_index}.mp4"),
            "MalformedDataset",
        ),
        "malformed-template-conversion": (
            "{chunk_index!s} (a conversion) is outside the template subset: MalformedDataset",
            with_info(base, data_path="data/{chunk_index!s}/{file_index}.parquet"),
            "MalformedDataset",
        ),
        "malformed-template-positional": (
            "{} (a positional field) is not a placeholder: MalformedDataset",
            with_info(base, data_path="data/{}/{chunk_index}/{file_index}.parquet"),
            "MalformedDataset",
        ),
        "valid-template-wide-padding-and-braces": (
            "{chunk_index:010d}, {file_index:01d} and escaped braces {{ }} (a literal {v3})",
            with_info(
                base,
                data_path="data/{{v3}}/chunk-{chunk_index:010d}/file-{file_index:01d}.parquet",
            ),
            None,
        ),
        "malformed-info-nan-token": (
            "info.json (given as text) holds NaN in a key nobody reads: NaN is not JSON (RFC "
            "8259), so the file is not JSON: MalformedDataset",
            info_text(base, '"total_tasks": 2', '"total_tasks": 2, "jitter_s": NaN'),
            "MalformedDataset",
        ),
        "malformed-info-infinity-token": (
            "info.json (given as text) holds -Infinity in a key nobody reads: not JSON: "
            "MalformedDataset",
            info_text(base, '"total_tasks": 2', '"total_tasks": 2, "jitter_s": -Infinity'),
            "MalformedDataset",
        ),
        "malformed-info-byte-order-mark": (
            "info.json (given as text) starts with U+FEFF, a UTF-8 byte-order mark: "
            "MalformedDataset",
            info_text(base, "{", "\ufeff{", first=True),
            "MalformedDataset",
        ),
        "valid-no-cameras-video-path-absent": (
            "No video features and no video_path key at all: absent is null",
            without_info_key(base_dataset(cameras=()), "video_path"),
            None,
        ),
        "malformed-float-task-index": (
            "task_index stored as float64 (1.0, 0.0): not an integer column: MalformedDataset",
            with_type(base, "meta/tasks.parquet", "task_index", "float64"),
            "MalformedDataset",
        ),
        "malformed-total-tasks-written-as-float": (
            "info.json (given as text) writes total_tasks as 2.0, not an integer as written, "
            "though there are 2 tasks: MalformedDataset",
            info_text(base, '"total_tasks": 2', '"total_tasks": 2.0'),
            "MalformedDataset",
        ),
    }
    return cases


def without_info_key(case: dict, key: str) -> dict:
    case = copy.deepcopy(case)
    del case["files"]["meta/info.json"]["json"][key]
    return case


def with_type(case: dict, path: str, name: str, column_type: str, *more: str) -> dict:
    """The case with the Parquet column ``name`` (and ``more``) stored as ``column_type``."""
    case = copy.deepcopy(case)
    for column in (name, *more):
        case["files"][path]["parquet"][column]["type"] = column_type
    return case


def info_text(case: dict, old: str, new: str, first: bool = False) -> dict:
    """The case with info.json given as text: its JSON with ``old`` (once, or its ``first``
    occurrence) replaced by ``new``."""
    case = copy.deepcopy(case)
    text = json.dumps(case["files"]["meta/info.json"]["json"])
    assert first or text.count(old) == 1
    case["files"]["meta/info.json"] = {"text": text.replace(old, new, 1)}
    return case


def write(area: str, name: str, kind: str, description: str, case_input: dict, expected: dict):
    path = FIXTURES / area / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    document = {"kind": kind, "description": description, "input": case_input, "expected": expected}
    path.write_text(json.dumps(document, indent=1, ensure_ascii=False) + "\n")


def main() -> None:
    for name, (description, case_input) in WINDOWS.items():  # errors: the oracle refuses too
        write("windows", name, "windows", description, case_input, oracle_answer(case_input))
    for name, (description, case_input, error) in meta_cases().items():
        expected = {"error": error} if error else derive_meta_answer(case_input)
        write("meta", name, "meta", description, case_input, expected)


if __name__ == "__main__":
    main()
