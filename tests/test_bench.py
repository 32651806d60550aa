"""``refstream bench`` on a tiny configuration, and the pieces it measures with.

No timing is asserted: the machine is shared. What is checked is that the bench measures the
right thing — the map-style baseline returns the frames it is asked for (read back from the
labels drawn in them), counts are counts, and the whole run's figures agree with the dataset.
"""

from __future__ import annotations

import json
import subprocess
import sys
from itertools import combinations

import numpy as np
import pyarrow.parquet as pq
import pytest

from refstream.hub import TARGET_LIFETIME_S
from refstream.tools import baselines, bench, droid
from refstream.tools.cli import main
from refstream.tools.demo import read_frame_label

QUICK = bench.BenchConfig.quick()


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def root(cache):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("REFSTREAM_CACHE", cache)
        yield bench.cached_dataset(QUICK, QUICK.episodes, lambda _message: None)


def test_generated_dataset_has_the_configured_shape_and_is_reused(root, cache, monkeypatch):
    rows = pq.read_table(root / "meta/episodes/chunk-000/file-000.parquet").to_pydict()
    assert rows["length"] == [QUICK.frames_per_episode] * QUICK.episodes
    assert len(list(root.glob("videos/*"))) == QUICK.cameras
    monkeypatch.setenv("REFSTREAM_CACHE", cache)
    said = []
    assert bench.cached_dataset(QUICK, QUICK.episodes, said.append) == root
    assert said == []  # found in the cache, not generated again


def test_map_style_items_show_the_requested_frames(root):
    windows = QUICK.delta_timestamps(bench.camera_names(QUICK.cameras), QUICK.fps)
    dataset = baselines.MapStyleVideoDataset(root, windows)
    assert len(dataset) == QUICK.episodes * QUICK.frames_per_episode
    for position in (0, 1, QUICK.frames_per_episode, len(dataset) - 1):
        item = dataset[position]
        episode, frame = divmod(position, QUICK.frames_per_episode)
        assert int(item["episode_index"]) == episode and int(item["frame_index"]) == frame
        wanted = [(episode, max(0, frame - k)) for k in range(QUICK.camera_window - 1, -1, -1)]
        for camera in bench.camera_names(QUICK.cameras):
            pictures = (item[camera].numpy() * 255).round().astype(np.uint8)
            assert [read_frame_label(p) for p in pictures] == wanted
            assert item[f"{camera}_is_pad"].tolist() == [frame - k < 0 for k in
                                                         range(QUICK.camera_window - 1, -1, -1)]
        # At least the distinct frames shown were decoded, once per camera.
        assert int(item["bench.decoded_frames"]) >= QUICK.cameras * len(set(wanted))


def test_no_plot_without_matplotlib(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    assert bench.plot(None, tmp_path / "bench.png") is False
    assert not (tmp_path / "bench.png").exists()


def test_batch_mixing_against_brute_force():
    config = bench.BenchConfig.quick(num_workers=1, batch_size=2)
    mixing = droid.batch_mixing([7, 9], [4, 4], config, "round_robin", None)
    # Round robin over two resident episodes puts one frame of each into every batch.
    assert (mixing.batches, mixing.mean_distinct) == (4, 2.0)
    # A uniform shuffle of 8 frames of 2 episodes: a batch of 2 is mixed with probability
    # 4*4 / C(8, 2) = 16/28, so its expected distinct count is 1 + 16/28.
    labels = [7] * 4 + [9] * 4
    exact = np.mean([len(set(pair)) for pair in combinations(labels, 2)])
    assert exact == pytest.approx(1 + 16 / 28)
    assert 1.0 <= mixing.uniform_mean_distinct <= 2.0


def test_memory_of_finds_children():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert child.pid in bench.descendants(bench.os.getpid())
        rss, pss = bench.memory_of([child.pid])
        assert rss > 0 and 0 < pss <= rss
    finally:
        child.kill()
        child.wait()


def test_quick_bench_from_the_command_line(cache, root, monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("REFSTREAM_CACHE", cache)
    assert main(["bench", "--quick", "--json", "--plot", str(tmp_path / "bench.png")]) == 0
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = json.loads(capsys.readouterr().out)
    frames = QUICK.episodes * QUICK.frames_per_episode
    assert report["frames"] == frames and report["root"] == str(root)
    methods = {m["name"]: m for m in report["methods"]}
    streamed = {"refstream-http", "refstream-http-plain",
                "refstream-http-uint8", "refstream-http-uint8-plain", "refstream-http-h264-g30"}
    assert set(methods) == {"map-style", *streamed}  # both idioms, float32 and uint8
    for name in streamed:  # whole epochs, in steady state at least the last batch's samples
        assert [p["samples"] for p in methods[name]["passes"]] == [frames] * QUICK.repeats
        assert all(sum(p["steady_cpu_ms"]) > 0 for p in methods[name]["passes"]), name
    assert methods["refstream-http-plain"]["cpu_ms"][2] > 0  # the DataLoader collates
    assert methods["refstream-http-h264-g30"]["amplification"] > 1
    for name, method in methods.items():  # memory is measured however short the pass
        assert all(p["peak_rss_above_bytes"] > 0 for p in method["passes"]), name
    http = methods["refstream-http"]
    # Every (episode, camera) span is fetched once: one video request each, at least its bytes.
    assert http["traffic"]["video_requests"] == QUICK.episodes * QUICK.cameras
    assert http["traffic"]["video_bytes"] >= report["spans"]["span_bytes"] > 0
    assert {t["key"] for t in report["targets"]} == set(bench.TARGET_TEXT)
    hub = report["hub_run"]  # one resolve per file for the main process and its workers
    assert hub["resolves"] == hub["files"] > 0 and hub["most_per_file"] == 1
    assert hub["target_requests"] >= QUICK.episodes * QUICK.cameras  # spans from the targets


def test_hub_projection_counts_each_file_once_per_target_lifetime():
    config = QUICK  # so few episodes that the first 5 minutes touch every file
    resolves = droid.hub_resolves(config)
    assert resolves.first_window == resolves.files > 0
    assert resolves.window_average == resolves.files * droid.QUOTA_WINDOW_S / TARGET_LIFETIME_S
