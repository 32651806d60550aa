"""``refstream lerobot-train`` runs LeRobot 0.6.1's own trainer on ``StreamingDataset``.

Each test trains a tiny ACT on CPU for a few steps on the dataset LeRobot wrote (``lr_av1``): from
a folder, from loopback HTTP, from a loopback Hub, resumed from its checkpoints, and in two
processes (torchrun, gloo). ``lerobot_probe.py`` runs the command and writes down, step by step,
the batches LeRobot's training loop took. Runs where LeRobot is installed: the LeRobot
environment of ``.ci/lerobot``; elsewhere the module is skipped as a whole.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lerobot", reason="needs LeRobot: run under .ci/lerobot's env")

import pandas  # noqa: E402
from lerobot.datasets import LeRobotDatasetMetadata  # noqa: E402
from lerobot.policies.pretrained import _build_card_context  # noqa: E402
from rangeserver import HubConfig, RangeServer  # noqa: E402

from refstream.meta import load_meta  # noqa: E402
from refstream.source import LocalSource  # noqa: E402
from refstream.tools.lerobot_train import card_metadata  # noqa: E402

PROJECT = Path(__file__).parents[1]
PROBE = Path(__file__).with_name("lerobot_probe.py")
BATCH = 8
# A tiny ACT (no pretrained backbone: nothing to download), chunks of 4 actions.
TINY_ACT = ["--policy.type=act", "--policy.device=cpu", "--policy.push_to_hub=false",
            "--policy.dim_model=32", "--policy.n_heads=2", "--policy.dim_feedforward=64",
            "--policy.n_encoder_layers=1", "--policy.n_decoder_layers=1",
            "--policy.chunk_size=4", "--policy.n_action_steps=4", "--policy.use_vae=false",
            "--policy.pretrained_backbone_weights=null", f"--batch_size={BATCH}",
            "--log_freq=1", "--seed=1", "--wandb.enable=false"]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("lerobot") / "lr_av1"
    shutil.copytree(PROJECT / "spec/fixtures/lerobot/lr_av1", root)
    return root


@pytest.fixture
def env(tmp_path) -> dict:
    path = os.pathsep.join(filter(None, [str(PROJECT), os.environ.get("PYTHONPATH")]))
    return dict(os.environ, PYTHONPATH=path, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1",
                REFSTREAM_CACHE=str(tmp_path / "cache"))


def run(command: list[str], env: dict, cwd: Path) -> str:
    done = subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True, timeout=900)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert "End of training" in output, output[-4000:]
    return output


def steps(probe: Path, rank: int = 0) -> list[dict]:
    lines = Path(f"{probe}.rank{rank}").read_text().splitlines()
    return [json.loads(line) for line in lines]


def test_resume_takes_the_batches_the_uninterrupted_run_took(dataset, env, tmp_path):
    # Episode 0 alone (30 frames): an epoch is 4 batches (8, 8, 8, 6), so 10 steps play epochs
    # 0, 1 and half of 2; checkpoints after steps 2 (inside an epoch) and 4 (at its end).
    out = tmp_path / "out"
    output = run([sys.executable, str(PROBE), str(tmp_path / "whole"), *TINY_ACT,
                  f"--dataset.root={dataset}", "--dataset.repo_id=local/lr_av1",
                  "--dataset.episodes=[0]", "--num_workers=2", "--steps=10", "--save_freq=2",
                  f"--output_dir={out}"], env, tmp_path)
    assert "1 DataLoader worker(s) instead of --num_workers=2" in output
    whole = steps(tmp_path / "whole")
    assert len(whole) == 10
    assert [len(step["index"]) for step in whole] == [8, 8, 8, 6] * 2 + [8, 8]
    for epoch in (whole[:4], whole[4:8]):  # every frame of the episode once, in its own order
        assert sorted(i for step in epoch for i in step["index"]) == list(range(30))
    assert len({tuple(step["index"]) for step in whole[::4]}) == 3
    assert all(step["episode"] == [0] * len(step["index"]) for step in whole)
    assert all(step["action"][1:] == [4, 6] for step in whole)  # ACT's delta_timestamps
    state = json.loads((out / "checkpoints/000002/training_state/refstream_data.json")
                       .read_text())
    assert (state["seed"], state["samples"], state["num_workers"]) == (1, 2 * BATCH, 1)
    state = json.loads((out / "checkpoints/000004/training_state/refstream_data.json")
                       .read_text())
    assert (state["epoch"], state["samples"]) == (1, 0)  # after an epoch's last batch: the next
    for step in (2, 4):
        config = out / f"checkpoints/{step:06d}/pretrained_model/train_config.json"
        run([sys.executable, str(PROBE), str(tmp_path / f"from{step}"),
             f"--config_path={config}", "--resume=true"], env, tmp_path)
        assert steps(tmp_path / f"from{step}") == whole[step:], step


def test_trains_from_loopback_http_with_an_eval_split(dataset, env, tmp_path):
    with RangeServer(dataset) as server:
        output = run([sys.executable, "-m", "refstream", "lerobot-train", *TINY_ACT,
                      f"--dataset.root={server.url}", "--dataset.repo_id=local/lr_av1",
                      "--dataset.eval_split=0.4", "--eval_steps=2", "--steps=2",
                      "--dataset.image_transforms.enable=true", "--num_workers=1",
                      f"--output_dir={tmp_path / 'out'}"], env, tmp_path)
        fetched = {record.path for record in server.log}
    # LeRobot's split of 5 episodes of two tasks: 2 train, 3 held out, evaluated at step 2.
    assert "Train/eval split: 2 train, 3 eval" in output
    assert "step 2: eval_loss=" in output
    assert any(path.endswith(".mp4") for path in fetched)


def test_trains_from_the_hub(dataset, env, tmp_path):
    with RangeServer(dataset, hub=HubConfig(revisions={"main": "b" * 40})) as hub:
        env = dict(env, HF_ENDPOINT=hub.url)
        run([sys.executable, "-m", "refstream", "lerobot-train", *TINY_ACT,
             "--dataset.repo_id=refstream/lr_av1", "--steps=1", "--num_workers=0",
             f"--output_dir={tmp_path / 'out'}"], env, tmp_path)
        fetched = {record.path for record in hub.log}
    assert f"/datasets/refstream/lr_av1/resolve/{'b' * 40}/meta/info.json" in fetched


def test_pushes_the_policy_with_a_model_card_of_the_streamed_dataset(dataset, env, tmp_path):
    uploads = tmp_path / "uploads"
    output = run([sys.executable, str(PROBE), str(tmp_path / "p"), *TINY_ACT,
                  "--policy.push_to_hub=true", "--policy.repo_id=someone/act",
                  f"--dataset.root={dataset}", "--dataset.repo_id=local/lr_av1", "--steps=1",
                  "--num_workers=0", f"--output_dir={tmp_path / 'out'}"],
                 dict(env, PROBE_UPLOADS=str(uploads)), tmp_path)
    assert "Model pushed to https://huggingface.co/someone/act" in output
    card = (uploads / "someone/act/README.md").read_text()
    assert "local/lr_av1" in card
    for task in LeRobotDatasetMetadata("local/lr_av1", root=dataset).tasks.index:
        assert task in card
    assert (uploads / "someone/act/model.safetensors").is_file()


def test_the_model_card_reads_what_lerobots_metadata_gives(dataset):
    lerobot_meta = LeRobotDatasetMetadata("local/lr_av1", root=dataset)
    with contextlib.closing(LocalSource(dataset)) as source:
        ours = card_metadata(load_meta(source), "local/lr_av1")
    pandas.testing.assert_frame_equal(ours.tasks, lerobot_meta.tasks)
    assert _build_card_context(None, ours, None, None) == \
        _build_card_context(None, lerobot_meta, None, None)


def test_two_processes_stream_disjoint_episodes_and_end_epochs_together(dataset, env, tmp_path):
    # Episodes 0 (30 frames) and 1 (45): one each. Every rank stops an epoch after the batches
    # the rank with the fewest can fill (SPEC §9.5): ceil(30 / 8) = 4.
    torchrun = Path(sys.executable).with_name("torchrun")
    run([str(torchrun), "--standalone", "--nproc-per-node=2", str(PROBE), str(tmp_path / "p"),
         *TINY_ACT, f"--dataset.root={dataset}", "--dataset.repo_id=local/lr_av1",
         "--dataset.episodes=[0,1]", "--num_workers=1", "--steps=6", "--save_freq=6",
         f"--output_dir={tmp_path / 'out'}"], env, tmp_path)
    ranks = [steps(tmp_path / "p", rank) for rank in (0, 1)]
    assert [len(taken) for taken in ranks] == [6, 6]
    owned = [{e for step in taken for e in step["episode"]} for taken in ranks]
    assert sorted(owned, key=min) == [{0}, {1}]
    epoch = math.ceil(30 / BATCH)
    for taken in ranks:
        first = [i for step in taken[:epoch] for i in step["index"]]
        assert len(first) == len(set(first))  # an epoch: no frame twice
        assert taken[epoch]["index"] != taken[0]["index"]
    assert [len(step["index"]) for step in ranks[owned.index({0})][:epoch]] == [8, 8, 8, 6]
    assert [len(step["index"]) for step in ranks[owned.index({1})][:epoch]] == [8, 8, 8, 8]
