"""The demo dataset writer and the loopback server, checked against LeRobot's own files and PyAV."""

from __future__ import annotations

import http.client
import json
import os
from pathlib import Path

import av
import numpy as np
import pyarrow.parquet as pq
import pytest

from refstream.tools.demo import (
    frame_picture,
    read_frame_label,
    serve_directory,
    write_demo_dataset,
)

ORACLE = Path("/work/shared/lerobot-oracle/lr_av1")
for candidate in (Path(__file__).parents[1] / "spec/fixtures/lerobot/lr_av1", ORACLE):
    if (candidate / "meta/info.json").exists():
        ORACLE = candidate
        break

LENGTHS = (7, 5, 9, 6)
SIZES = {"observation.images.front": (96, 64), "observation.images.wrist": (64, 48)}


@pytest.fixture(scope="module", params=["av1", "h264"])
def dataset(request, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp(f"demo_{request.param}")
    if request.param == "av1":
        write_demo_dataset(root, episode_lengths=LENGTHS, size=SIZES, episodes_per_video_file=3,
                           episodes_per_data_file=2)
    else:
        write_demo_dataset(root, episode_lengths=LENGTHS, size=SIZES, codec="libx264", gop=30,
                           bframes=2, episodes_per_video_file=3, episodes_per_data_file=2)
    return root


def _episodes(root: Path) -> dict:
    return pq.read_table(root / "meta/episodes/chunk-000/file-000.parquet").to_pydict()


def test_metadata_has_lerobots_shape(dataset):
    if not (ORACLE / "meta/info.json").exists():
        pytest.skip("LeRobot oracle dataset not available")
    ours = json.loads((dataset / "meta/info.json").read_text())
    theirs = json.loads((ORACLE / "meta/info.json").read_text())
    assert ours.keys() == theirs.keys()
    assert ours["codebase_version"] == "v3.0"
    assert ours["data_path"] == theirs["data_path"]
    assert ours["video_path"] == theirs["video_path"]
    assert list(ours["features"]) == list(theirs["features"])
    for name, feature in theirs["features"].items():
        assert ours["features"][name].keys() == feature.keys(), name
        assert ours["features"][name]["dtype"] == feature["dtype"]
        if feature["dtype"] == "video":
            assert ours["features"][name]["info"].keys() == feature["info"].keys()
        else:
            assert ours["features"][name]["shape"] == feature["shape"]
    assert ours["total_frames"] == sum(LENGTHS)
    assert ours["total_episodes"] == len(LENGTHS)
    stats_theirs = json.loads((ORACLE / "meta/stats.json").read_text())
    stats_ours = json.loads((dataset / "meta/stats.json").read_text())
    assert stats_ours.keys() == stats_theirs.keys()
    for name in stats_theirs:
        assert stats_ours[name].keys() == stats_theirs[name].keys()
        for stat, value in stats_theirs[name].items():
            assert np.shape(stats_ours[name][stat]) == np.shape(value), (name, stat)


def test_parquet_schemas_equal_lerobots(dataset):
    if not (ORACLE / "meta/info.json").exists():
        pytest.skip("LeRobot oracle dataset not available")
    for relpath in ("meta/tasks.parquet", "meta/episodes/chunk-000/file-000.parquet",
                    "data/chunk-000/file-000.parquet"):
        ours = pq.read_schema(dataset / relpath)
        theirs = pq.read_schema(ORACLE / relpath)
        assert ours.remove_metadata() == theirs.remove_metadata(), relpath
        assert set((ours.metadata or {}).keys()) == set((theirs.metadata or {}).keys()), relpath
    ours = json.loads(pq.read_schema(dataset / "data/chunk-000/file-000.parquet")
                      .metadata[b"huggingface"])
    theirs = json.loads(pq.read_schema(ORACLE / "data/chunk-000/file-000.parquet")
                        .metadata[b"huggingface"])
    assert ours["info"]["features"] == theirs["info"]["features"]


def test_rows_one_row_group_per_episode(dataset):
    episodes = _episodes(dataset)
    starts = np.concatenate([[0], np.cumsum(LENGTHS)])
    assert episodes["dataset_from_index"] == starts[:-1].tolist()
    assert episodes["dataset_to_index"] == starts[1:].tolist()
    tasks = pq.read_table(dataset / "meta/tasks.parquet").to_pydict()
    for e, length in enumerate(LENGTHS):
        relpath = (f"data/chunk-{episodes['data/chunk_index'][e]:03d}/"
                   f"file-{episodes['data/file_index'][e]:03d}.parquet")
        parquet = pq.ParquetFile(dataset / relpath)
        groups = [parquet.read_row_group(i).to_pydict()
                  for i in range(parquet.metadata.num_row_groups)]
        mine = [g for g in groups if g["episode_index"][0] == e]
        assert len(mine) == 1 and set(mine[0]["episode_index"]) == {e}
        rows = mine[0]
        assert rows["frame_index"] == list(range(length))
        assert rows["index"] == list(range(starts[e], starts[e] + length))
        assert np.array_equal(np.array(rows["timestamp"], dtype=np.float32),
                              (np.arange(length) / 30).astype(np.float32))
        state = np.array(rows["observation.state"])
        assert (state[:, 0] == e).all() and (state[:, 1] == np.arange(length)).all()
        assert tasks["task"][rows["task_index"][0]] == episodes["tasks"][e][0]
    assert episodes["data/file_index"] == [0, 0, 1, 1]


def test_video_timestamps_and_labels_match_pyav(dataset):
    """from/to are cumulative durations; every decoded frame shows the episode and frame there."""
    episodes = _episodes(dataset)
    for camera, (width, height) in SIZES.items():
        assert episodes[f"videos/{camera}/file_index"] == [0, 0, 0, 1]
        for file_index in (0, 1):
            members = [e for e in range(len(LENGTHS))
                       if episodes[f"videos/{camera}/file_index"][e] == file_index]
            expected_from = 0.0
            for e in members:
                assert episodes[f"videos/{camera}/from_timestamp"][e] == expected_from
                expected_from += LENGTHS[e] / 30
                assert episodes[f"videos/{camera}/to_timestamp"][e] == expected_from
            path = dataset / f"videos/{camera}/chunk-000/file-{file_index:03d}.mp4"
            with av.open(str(path)) as container:
                seen = []
                for frame in container.decode(video=0):
                    picture = frame.to_ndarray(format="rgb24")
                    assert picture.shape == (height, width, 3)
                    e, f = read_frame_label(picture)
                    from_s = episodes[f"videos/{camera}/from_timestamp"][e]
                    assert abs(float(frame.pts * frame.time_base) - (from_s + f / 30)) < 1e-4
                    seen.append((e, f))
            assert seen == [(e, f) for e in members for f in range(LENGTHS[e])]


def test_gop_structure(dataset):
    """AV1: LeRobot's g=2, no reordering; H.264: B-frames and one keyframe per episode (g=30)."""
    path = dataset / "videos/observation.images.front/chunk-000/file-000.mp4"
    with av.open(str(path)) as container:
        packets = [p for p in container.demux(video=0) if p.size]
    assert len(packets) == sum(LENGTHS[:3])
    if "h264" in dataset.name:
        assert any(p.pts != p.dts for p in packets)
        assert sum(p.is_keyframe for p in packets) == 3  # one per episode: g=30 > every length
    else:
        assert all(p.pts == p.dts for p in packets)
        starts = {0, LENGTHS[0], LENGTHS[0] + LENGTHS[1]}
        keyframes = {i for i, p in enumerate(packets) if p.is_keyframe}
        assert starts <= keyframes
        assert all(i - 2 in keyframes or i - 1 in keyframes for i in range(2, len(packets)))


def test_frame_label_round_trip_and_rejection():
    for e, f in [(0, 0), (1, 1), (4095, 4094), (17, 300)]:
        picture = frame_picture(e, f, 64, 48)
        assert read_frame_label(picture) == (e, f)
        assert read_frame_label(picture.transpose(2, 0, 1)) == (e, f)
    noisy = frame_picture(3, 5, 64, 48).astype(int) + 8
    assert read_frame_label(noisy.clip(0, 255).astype(np.uint8)) == (3, 5)
    with pytest.raises(ValueError):
        read_frame_label(np.full((48, 64, 3), 38, dtype=np.uint8))  # between two digit levels


def _request(conn, method, path, headers=None):
    conn.request(method, path, headers=headers or {})
    response = conn.getresponse()
    return response, response.read()


def test_loopback_server_ranges_etag_keepalive(tmp_path):
    payload = bytes(range(256)) * 4
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub/file.bin").write_bytes(payload)
    with serve_directory(tmp_path) as server:
        host, port = server.url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port))
        response, body = _request(conn, "HEAD", "/sub/file.bin")
        assert response.status == 200 and body == b""
        assert int(response.getheader("Content-Length")) == len(payload)
        etag = response.getheader("ETag")
        assert etag.startswith('"') and etag.endswith('"')
        response, body = _request(conn, "GET", "/sub/file.bin", {"Range": "bytes=10-19"})
        assert response.status == 206 and body == payload[10:20]
        assert response.getheader("Content-Range") == f"bytes 10-19/{len(payload)}"
        assert response.getheader("ETag") == etag
        response, body = _request(conn, "GET", "/sub/file.bin", {"Range": "bytes=-5"})
        assert response.status == 206 and body == payload[-5:]
        response, body = _request(conn, "GET", "/sub/file.bin", {"Range": "bytes=1000-"})
        assert response.status == 206 and body == payload[1000:]
        response, body = _request(conn, "GET", "/sub/file.bin", {"Range": "bytes=5000-6000"})
        assert response.status == 416
        assert response.getheader("Content-Range") == f"bytes */{len(payload)}"
        response, body = _request(conn, "GET", "/sub/file.bin")
        assert response.status == 200 and body == payload
        response, _ = _request(conn, "GET", "/../etc/passwd")
        assert response.status == 404
        first_socket = conn.sock
        response, _ = _request(conn, "GET", "/sub/file.bin", {"Range": "bytes=0-0"})
        assert conn.sock is first_socket  # the same connection served every request
        conn.close()
        assert len(server.log) == 8
        assert server.body_bytes == 10 + 5 + 24 + len(payload) + len(b"not found\n") + 1


def test_demo_command_verifies_every_frame(tmp_path, capsys):
    from refstream.tools.cli import main

    assert main(["demo", "--keep", str(tmp_path), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert f"dataset: {tmp_path / 'dataset'} (kept)" in out
    assert (tmp_path / "dataset" / "meta" / "info.json").is_file()
    assert "verified: OK" in out
    assert "519 samples" in out
    assert "video spans for 12 episodes x 2 cameras" in out


def test_writing_an_av1_dataset_leaves_the_scheduling_policy_alone(tmp_path):
    # SVT-AV1 run as root switches its caller to SCHED_FIFO 99; forked DataLoader workers would
    # inherit it and starve the machine.
    before = os.sched_getscheduler(0), os.sched_getparam(0)
    write_demo_dataset(tmp_path / "ds", episode_lengths=(3, 2), codec="libsvtav1")
    assert (os.sched_getscheduler(0), os.sched_getparam(0)) == before
