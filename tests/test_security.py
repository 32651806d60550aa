"""Credentials: an ``HF_TOKEN`` streamed with never leaves the Hub it belongs to.

A fake Hub (tests/rangeserver.py, ``HubConfig`` with a required token) on 127.0.0.1 redirects
every file to a "CDN" on a second loopback host, as huggingface.co does. Streaming a real dataset
from ``hf://datasets/owner/name@main`` with the token in the environment, the token must not
appear in logs (every logger at DEBUG), exception messages and tracebacks, sidecar files,
``state_dict()`` or a pickled dataset; and ``Authorization`` must reach the Hub on every request
and the CDN on none (asserted from each server's request log).
"""

from __future__ import annotations

import json
import logging
import pickle
import traceback
from pathlib import Path

import pytest
from rangeserver import HubConfig, RangeServer, second_loopback_host
from torch.utils.data import DataLoader

from refstream import errors
from refstream.stream import StreamingDataset
from refstream.tools.demo import read_frame_label, write_demo_dataset

TOKEN = "hf_refstreamSecretToken0123456789abcdef"
COMMIT = "89abcdef0123456789abcdef0123456789abcdef"
ROOT = "hf://datasets/owner/name@main"
LENGTHS = (12, 12, 12, 12)
CAMERAS = ("observation.images.front", "observation.images.wrist")


@pytest.fixture(scope="module")
def dataset_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("security_dataset")
    write_demo_dataset(root, episode_lengths=LENGTHS, cameras=CAMERAS, size=(64, 48),
                       episodes_per_video_file=2, episodes_per_data_file=2)
    return root



@pytest.fixture
def hub(dataset_root, tmp_path, monkeypatch):
    """(hub, cdn) servers; the environment points HF_ENDPOINT at the hub and holds HF_TOKEN."""
    with RangeServer(dataset_root, host=second_loopback_host()) as cdn:
        config = HubConfig(revisions={"main": COMMIT}, token=TOKEN)
        with RangeServer(dataset_root, hub=config, redirect_to=cdn) as hub_server:
            monkeypatch.setenv("HF_ENDPOINT", hub_server.url)
            monkeypatch.setenv("HF_TOKEN", TOKEN)
            monkeypatch.setenv("REFSTREAM_CACHE", str(tmp_path / "cache"))
            yield hub_server, cdn


def every_frame_once(samples: list[dict]) -> bool:
    seen = []
    for item in samples:
        key = int(item["episode_index"]), int(item["frame_index"])
        for camera in CAMERAS:
            assert read_frame_label(item[camera].numpy()) == key
        seen.append(key)
    return sorted(seen) == [(e, f) for e, n in enumerate(LENGTHS) for f in range(n)]


def assert_token_stays_on_the_hub(hub_server: RangeServer, cdn: RangeServer) -> None:
    assert hub_server.log and cdn.log
    assert all(r.authorization for r in hub_server.log)  # the Hub needs it: 401 otherwise
    assert not any(r.authorization for r in cdn.log)
    assert not any(TOKEN in f"{name}: {value}" for r in cdn.log for name, value in
                   r.headers.items())
    assert any(r.range and r.path.endswith(".mp4") for r in cdn.log)  # the payload came from it


def cache_files_containing_the_token(cache: Path) -> list[Path]:
    files = [p for p in cache.rglob("*") if p.is_file()]
    assert files, "no sidecar was written"
    return [p for p in files if TOKEN.encode() in p.read_bytes()]


def text_of(exc: BaseException) -> str:
    """Everything a user could see of an exception: message, repr, the whole chained traceback."""
    return f"{exc}\n{exc!r}\n" + "".join(traceback.format_exception(exc))


def test_the_token_is_used_only_on_the_hub_and_never_written(hub, tmp_path, caplog):
    hub_server, cdn = hub
    caplog.set_level(logging.DEBUG)  # every logger, urllib3's request lines included
    dataset = StreamingDataset(ROOT, seed=0, return_uint8=True)
    assert every_frame_once(list(dataset))
    assert every_frame_once(list(DataLoader(dataset, batch_size=None, num_workers=2)))
    assert_token_stays_on_the_hub(hub_server, cdn)
    assert any(r.name.startswith("urllib3") for r in caplog.records)  # logs were captured
    assert TOKEN not in caplog.text
    assert not any(TOKEN in repr(r.args) for r in caplog.records)
    assert cache_files_containing_the_token(tmp_path / "cache") == []
    state = dataset.state_dict(samples=8, batch_size=4, num_workers=2)
    assert TOKEN not in json.dumps(state) and TOKEN not in repr(state)
    assert TOKEN.encode() not in pickle.dumps(dataset)  # what a spawned worker receives
    assert TOKEN not in repr(dataset.__dict__)


def test_a_failing_cdn_error_does_not_show_the_token(hub, caplog):
    hub_server, cdn = hub
    caplog.set_level(logging.DEBUG)
    dataset = StreamingDataset(ROOT, seed=0, return_uint8=True, prefetch_episodes=0)
    cdn.faults.status_5xx = 1.0  # every range GET on the CDN fails from now on
    with pytest.raises(errors.RetriesExhausted) as info:
        list(dataset)
    assert "bytes" in str(info.value)
    assert TOKEN not in text_of(info.value)
    assert TOKEN not in caplog.text
    assert_token_stays_on_the_hub(hub_server, cdn)


def test_a_refused_token_is_not_echoed(hub, monkeypatch, caplog):
    caplog.set_level(logging.DEBUG)
    wrong = "hf_refstreamWrongToken9876543210fedcba"
    monkeypatch.setenv("HF_TOKEN", wrong)
    with pytest.raises(errors.HubAuthError, match="the Hub refused the token") as info:
        StreamingDataset(ROOT, seed=0)
    assert wrong not in text_of(info.value) and TOKEN not in text_of(info.value)
    assert wrong not in caplog.text


def test_a_branch_moved_after_open_keeps_the_indexed_commit(hub):
    """``@main`` is resolved once, when the dataset is opened: the sidecar indexes that commit,
    so every later read (workers, later epochs) must name it, even after main moves."""
    hub_server, _ = hub
    dataset = StreamingDataset(ROOT, seed=0, return_uint8=True)
    opened = len(hub_server.log)
    hub_server.hub.revisions["main"] = "f" * 40  # someone pushes to main
    assert every_frame_once(list(dataset))
    later = [r.path for r in hub_server.log[opened:]]
    assert later and all(f"/resolve/{COMMIT}/" in path for path in later), later[:3]
