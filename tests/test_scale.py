"""The DROID-sized simulation of ``refstream bench --scale droid``, on small instances.

The sparse MP4 writer is checked against FFmpeg's demuxer (``ffprobe -show_packets``) and
refstream's own parser; the simulated metadata against the videos it points into; the harness
end to end through the command line. No timing is asserted: the machine is shared.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from media import parse_index_bytes

from refstream.meta import load_meta
from refstream.source import LocalSource
from refstream.tools import scale
from refstream.tools.bench import droid_lengths
from refstream.tools.cli import main


def _ffprobe_packets(path) -> list[list[str]]:
    result = subprocess.run(
        ["ffprobe", "-v", "error", "-select_streams", "v:0", "-show_packets", "-show_entries",
         "packet=pts,dts,size,pos,flags", "-of", "csv=p=0", str(path)],
        capture_output=True, text=True, check=True)
    assert result.stderr == ""
    return [line.split(",") for line in result.stdout.split()]


@pytest.mark.skipif(shutil.which("ffprobe") is None, reason="needs ffprobe")
def test_sparse_mp4_is_what_ffprobe_and_the_parser_read(tmp_path):
    lengths = [7, 6, 301, 5]  # one episode long enough for a second chunk (1 MiB)
    keyframe = np.concatenate([np.arange(n) % 2 == 0 for n in lengths])
    sizes = np.random.default_rng(3).integers(1_000, 9_000, len(keyframe))
    path = tmp_path / "file-000.mp4"
    offsets = scale.write_sparse_mp4(path, sizes, keyframe, 15)

    packets = _ffprobe_packets(path)
    ticks = 1024  # FFmpeg's time base for 15 fps: 1/15360
    assert [int(p[0]) for p in packets] == [ticks * i for i in range(len(sizes))]  # pts
    assert [int(p[1]) for p in packets] == [ticks * i for i in range(len(sizes))]  # dts
    assert [int(p[2]) for p in packets] == sizes.tolist()
    assert [int(p[3]) for p in packets] == offsets.tolist()
    assert [p[4].startswith("K") for p in packets] == keyframe.tolist()

    index = parse_index_bytes(path.read_bytes(), str(path))
    assert index.dts.tolist() == index.pts.tolist()
    assert index.pts.tolist() == [int(p[0]) for p in packets]
    assert index.size.tolist() == sizes.tolist()
    assert index.offset.tolist() == offsets.tolist()
    assert index.keyframe.tolist() == keyframe.tolist()
    assert (index.codec, index.width, index.height) == ("av01", 320, 180)
    stat = path.stat()
    assert stat.st_blocks * 512 < stat.st_size // 10  # the payload is a hole


def test_simulated_metadata_points_at_episode_starts_in_the_videos(tmp_path):
    config = scale.ScaleConfig.quick(episodes=12, video_file_mb=5)
    facts = scale.write_simulation(tmp_path, config, progress=False)
    meta = load_meta(LocalSource(tmp_path))
    lengths = droid_lengths(12, config.seed)
    assert meta.length.tolist() == lengths
    assert facts["samples"] == sum(lengths) * len(meta.camera_keys) == sum(
        len(parse_index_bytes(p.read_bytes(), str(p)))
        for p in tmp_path.glob("videos/*/*/*.mp4"))
    for camera in meta.camera_keys:
        files = {}
        for episode in meta.episode_index.tolist():
            files.setdefault(meta.video_relpath(episode, camera), []).append(episode)
        assert len(files) > 1  # episodes rolled over into several files
        for relpath, episodes in files.items():
            index = parse_index_bytes((tmp_path / relpath).read_bytes(), relpath)
            frame = 0  # the episodes of a file follow each other from time 0
            for episode in episodes:
                row = meta.row(episode)
                start_s, end_s = meta.video_from_s[camera][row], meta.video_to_s[camera][row]
                assert start_s == pytest.approx(frame / meta.fps)
                assert end_s - start_s == pytest.approx(lengths[episode] / meta.fps)
                assert index.pts[frame] == round(start_s * index.timescale)
                assert index.keyframe[frame]  # each episode is its own encode
                frame += lengths[episode]
            assert frame == len(index)
            assert len(episodes) == 1 or index.size.sum() < config.video_file_mb * 2**20


def test_scale_command_measures_the_quick_simulation(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("REFSTREAM_CACHE", str(tmp_path))
    monkeypatch.setattr(scale, "HUB_PAGE_ENTRIES", 7)  # the listing takes several pages
    # A peak of 1.5 GB in this process: `refstream index` in a child must report its own.
    ballast = np.ones(1_500_000_000, np.uint8)
    assert main(["bench", "--scale", "droid", "--quick", "--json"]) == 0
    del ballast
    report = json.loads(capsys.readouterr().out)
    facts = report["simulation"]
    assert facts["samples"] == facts["frames"] * facts["cameras"]
    assert report["apparent_bytes"] > 10 * report["disk_bytes"]  # sparse videos
    folder, http, hub = report["folder"], report["http"], report["hub"]
    assert folder["index_requests"] == folder["cold_requests"] == folder["warm_requests"] == 0
    for place in (http, hub):
        assert place["index_requests"] >= facts["video_files"]  # every moov was read over HTTP
        assert 0 < place["index_served_bytes"] < facts["video_bytes"] / 10  # the moovs only
    # Identities: plain HTTP asks one HEAD per video file; the Hub lists the videos folder.
    assert http["cold_identity_requests"] >= facts["video_files"]
    listed = len(list((Path(report["root"]) / "videos").rglob("*")))  # files and folders
    for moment in ("cold", "warm"):
        assert hub[f"{moment}_identity_requests"] == -(-listed // 7)
        assert hub[f"{moment}_requests"] < facts["video_files"]
    for place in (folder, http, hub):
        assert 0 < place["index_peak_rss_bytes"] < 1_000_000_000  # the child's, not ours
        assert place["index_disk_bytes"] > 0
        assert place["index_s"] > 0 and place["cold_s"] > 0 and place["warm_s"] > 0
    assert len(report["workers"]) == scale.ScaleConfig.quick().workers
    for worker in report["workers"]:
        assert worker["rss_bytes"] >= worker["private_bytes"] > 0
        assert worker["rss_bytes"] >= worker["pss_bytes"] > 0
        assert 0 < worker["index_records"] <= facts["video_files"]
        assert worker["rss_bytes"] >= worker["index_rss_bytes"] > 0  # the index is mapped
        assert worker["index_rss_bytes"] >= worker["index_private_bytes"]
        assert worker["index_heap_bytes"] > 0
    assert [t["key"] for t in report["targets"]] == list(scale.TARGETS)
    for target in report["targets"]:  # rates made at DROID's size say nothing of 40 episodes
        assert (target["passed"] is None) == (target["key"] in scale.AT_DROID_SIZE), target
