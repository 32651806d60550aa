"""``refstream bench`` on a tiny configuration, and the pieces it measures with.

No timing is asserted: the machine is shared. What is checked is that the bench measures the
right thing — the map-style baseline returns the frames it is asked for (read back from the
labels drawn in them), counts are counts, and the whole run's figures agree with the dataset.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from itertools import combinations
from types import SimpleNamespace

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

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


def test_batch_mixing_against_brute_force(monkeypatch):
    config = bench.BenchConfig.quick(num_workers=1, batch_size=2)
    # Round robin over two resident episodes puts one frame of each into every batch; with the
    # pool growing by one every 8 draws, 8 draws come from one episode at a time.
    assert droid.batch_mixing([7, 9], [4, 4], config, "round_robin", None).mean_distinct == 1.0
    monkeypatch.setattr(droid, "DEFAULT_POOL_RAMP", 0)
    mixing = droid.batch_mixing([7, 9], [4, 4], config, "round_robin", None)
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
    for name in streamed:  # every frame decoded once, each shown in two windows: long GOPs too
        assert methods[name]["amplification"] == 1 / QUICK.camera_window, name
    for name, method in methods.items():  # memory is measured however short the pass
        assert all(p["peak_rss_above_bytes"] > 0 for p in method["passes"]), name
    http = methods["refstream-http"]
    # Every (episode, camera) span is fetched once: one video request each, at least its bytes.
    assert http["traffic"]["video_requests"] == QUICK.episodes * QUICK.cameras
    assert http["traffic"]["video_bytes"] >= report["spans"]["span_bytes"] > 0
    assert [t["key"] for t in report["targets"]] == list(bench.TARGET_TEXT)
    verdicts = {t["key"]: t["passed"] for t in report["targets"]}
    assert verdicts["span_bytes"] is verdicts["requests"] is True  # counts hold at any size
    assert verdicts["float32_limit"] is verdicts["uint8_limit"] is None  # timed: n/a in --quick
    assert verdicts["ttfs_flat"] is verdicts["elastic"] is None
    floor = report["write_floor"]  # a batch of thumbnails' camera values, written
    assert floor["float32_ms"] > 0 and floor["uint8_ms"] > 0
    assert floor["megabytes"] == QUICK.cameras * QUICK.camera_window * 3 * 48 * 64 * 4 / 1e6
    assert verdicts["long_gop_amplification"] is True  # each GOP decoded once
    assert all(method["loader_cpu_ms"] >= 0 for method in methods.values())
    # The memory table's row in --quick: the named configuration, in a process of its own.
    (row,) = report["memory_table"]
    assert (row["workers"], row["budget_gb"], row["pool"], row["uint8"]) == (
        bench.MEMORY_WORKERS, bench.MEMORY_BUDGET_GB, bench.MEMORY_POOL, True)
    assert 0 < row["pss_bytes"] < methods["refstream-http"]["passes"][0]["peak_rss_above_bytes"] \
        + 2 * 1024**3
    hub = report["hub_run"]  # one resolve per file for the main process and its workers
    assert hub["resolves"] == hub["files"] > 0 and hub["most_per_file"] == 1
    assert hub["target_requests"] >= QUICK.episodes * QUICK.cameras  # spans from the targets


def test_the_first_batch_alone_from_the_command_line(cache, root, monkeypatch, capsys):
    # x1 and x2 (--quick's scale) in turn: both datasets' first batches, and the flat target.
    monkeypatch.setenv("REFSTREAM_CACHE", cache)
    assert main(["bench", "--quick", "--first-batch"]) == 0
    line, target = capsys.readouterr().out.splitlines()
    assert line.startswith("time to first batch over HTTP, sidecar built: x1 ") and " x2 " in line
    assert "flat in dataset size: x2 <= 1.3 x the x1 time" in target


def fake_pass(cpu_s=lambda n: 0.0, decoded=lambda n: 0) -> bench.Pass:
    """A timed pass of 12 batches of 4 samples from a loader with 2 workers fetching 2 batches
    ahead each, the iterator itself spending ``cpu_s(n)`` of CPU on batch ``n``, which counts
    ``decoded(n)`` decoded frames."""
    class Loader:
        num_workers, prefetch_factor = 2, 2  # batches 0 and 1: each worker's first
        collate_fn = bench.TimedCollate(lambda batch: batch)

        def __iter__(self):
            for n in range(12):
                until = time.thread_time() + cpu_s(n)
                while time.thread_time() < until:
                    pass
                yield {"index": torch.arange(4), "bench.decoded_frames": torch.tensor([decoded(n)])}

    return bench.timed_pass(lambda: (None, Loader()), None)


def test_cpu_per_sample_leaves_out_the_batches_fetched_ahead():
    # A DataLoader's workers finish prefetch_factor x num_workers batches before the consumer
    # receives them: those arrive with no CPU spent, which must not dilute the steady figure.
    run = fake_pass(lambda n: 0.05 if n < 12 - 2 * 2 else 0.0)
    assert run.samples == 48
    assert run.steady_cpu_ms[0] == pytest.approx(50 / 4, rel=0.3)  # ms per sample


def test_samples_per_s_cover_the_pass_after_each_workers_first_batch():
    # With a share's episodes resident at once, a pass decodes most frames early and reuses them
    # late. Its rate is taken over the whole pass after each worker's first batch, not over its
    # second half. Here a batch costs 40 ms of CPU in the first half and 10 ms in the second.
    run = fake_pass(lambda n: 0.04 if n < 6 else 0.01)
    (first_s, first), (half_s, half), (last_s, last) = (run.batch_times_s[i] for i in (1, 5, -1))
    assert run.steady_samples_per_s == pytest.approx((last - first) / (last_s - first_s))
    assert run.steady_samples_per_s < 0.7 * (last - half) / (last_s - half_s)


def test_the_decode_limit_counts_the_frames_decoded_in_the_timed_window():
    # A pass decodes most frames while making each worker's first batch: 100 frames each for
    # batches 0 and 1, then 10 per batch. Its rate leaves those batches out, and so must the
    # amplification its decode limit is taken at.
    run = fake_pass(decoded=lambda n: 100 if n < 2 else 10)
    assert (run.decoded_frames, run.samples) == (300, 48)
    assert run.steady_frames == (100, 40)  # batches 2 to 11
    assert bench._amplification([run, run], 2) == 300 / 96
    assert bench._amplification([run, run], 2, steady=True) == 100 / 80


def test_decode_and_rgb_scale_apart_with_the_amplification():
    # The ceiling decodes each frame once (3 s) and converts it (1 s): at 0.5 decoded frames per
    # delivered one where the method was timed, decoding costs half, converting the same.
    ceiling = baselines.Ceiling(processes=1, episode_frames=100, decoded_frames=100, wall_s=1.0,
                                decode_s=3.0, rgb_s=1.0, cpu_s=4.0)
    report = SimpleNamespace(long_gop=None, ceiling=ceiling, ceiling_samples_per_s=800.0,
                             ceiling_cpu_ms=2.0)
    method = SimpleNamespace(name="refstream-http", amplification=1.0, steady_amplification=0.5)
    assert bench.BenchReport._decode_share(report, method) == (800.0, 2.0, (1.5 + 1) / 4)
    # The window its rate was timed over decoded 0.25 frames per delivered one: the limit there.
    method.steady_amplification = 0.25
    assert bench.BenchReport._decode_share(report, method) == (800.0, 2.0, (0.75 + 1) / 4)
    method.steady_amplification = 0.0  # every frame decoded before the window: RGB alone
    assert bench.BenchReport._decode_share(report, method) == (800.0, 2.0, 1 / 4)


def test_the_write_floor_adds_to_each_samples_decode_cpu():
    # Decoding and RGB take 1.5 ms of CPU per sample, the float32 write 0.5 ms more: the limit
    # falls to 1.5 / 2 of itself; uint8 items are held to their own floor.
    ceiling = baselines.Ceiling(processes=2, episode_frames=100, decoded_frames=100, wall_s=1.0,
                                decode_s=1.0, rgb_s=1.0, cpu_s=2.0)
    report = bench.BenchReport.__new__(bench.BenchReport)
    for name, value in dict(long_gop=None, ceiling=ceiling, ceiling_samples_per_s=1000.0,
                            ceiling_cpu_ms=2.0,
                            write_floor=bench.WriteFloor(0.5, 0.1, 5.5)).items():
        object.__setattr__(report, name, value)
    float32 = SimpleNamespace(name="refstream-http", amplification=1.0, steady_amplification=0.5)
    uint8 = SimpleNamespace(name="refstream-http-uint8", amplification=1.0,
                            steady_amplification=0.5)
    assert report.decode_limit(float32) == pytest.approx(1000 / 0.75)
    assert report.floor_limit(float32) == pytest.approx(1000 / 0.75 * 1.5 / 2.0)
    assert report.floor_limit(uint8) == pytest.approx(1000 / 0.75 * 1.5 / 1.6)


def test_targets_made_for_another_run_do_not_apply():
    def why(key, gop=2, **config):
        report = SimpleNamespace(config=bench.BenchConfig(**config), gop=gop)
        return bench._not_applying(report, key)

    assert why("amplification") is None and why("ttfs_flat") is None
    assert "GOP is 30" in why("amplification", gop=30)  # g=2's bound, on a g=30 dataset
    assert "--quick" in why("float32_limit", smoke=True) and why("span_bytes", smoke=True) is None
    assert "DROID" in why("elastic", smoke=True) and why("elastic") is None
    for key in ("ttfs_flat", "long_gop_amplification", "long_gop_speed", "memory_table"):
        assert "--root" in why(key, root="/data")


def test_the_help_names_only_what_the_bench_measures(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "map-style reading and the decode ceiling" in text
    assert "download" not in text  # no download-then-read row is measured


def test_hub_projection_counts_each_file_once_per_target_lifetime():
    config = QUICK  # so few episodes that the first 5 minutes touch every file
    resolves = droid.hub_resolves(config)
    assert resolves.first_window == resolves.files > 0
    assert resolves.window_average == resolves.files * droid.QUOTA_WINDOW_S / TARGET_LIFETIME_S
