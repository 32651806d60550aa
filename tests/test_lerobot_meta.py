"""``StreamingDataset.meta`` answers what LeRobot 0.6.1's trainer asks of its metadata, as
LeRobot's own ``LeRobotDatasetMetadata`` answers it for the dataset LeRobot wrote (``lr_av1``).

Runs where LeRobot is installed: the LeRobot environment of ``.ci/lerobot``
(``../shared/lerobot-env/install.sh``); elsewhere the module is skipped as a whole.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import numpy as np
import pytest

lerobot = pytest.importorskip("lerobot", reason="needs LeRobot: run under .ci/lerobot's env")

from lerobot.datasets import LeRobotDatasetMetadata  # noqa: E402
from lerobot.datasets.factory import resolve_delta_timestamps  # noqa: E402
from lerobot.policies.act.configuration_act import ACTConfig  # noqa: E402
from lerobot.utils.feature_utils import dataset_to_policy_features  # noqa: E402

from refstream.stream import StreamingDataset  # noqa: E402

LR_AV1 = Path(__file__).parents[1] / "spec/fixtures/lerobot/lr_av1"
# What LeRobot's factory, trainer and policy factory read of the metadata, by name.
SAME = ("fps", "features", "robot_type", "video_keys", "image_keys", "depth_keys", "camera_keys",
        "total_tasks", "total_episodes", "total_frames", "has_language_columns")


@pytest.fixture(scope="module")
def both(tmp_path_factory) -> tuple:
    root = tmp_path_factory.mktemp("lerobot") / "lr_av1"
    shutil.copytree(LR_AV1, root)
    cache = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("REFSTREAM_CACHE", str(cache))
        ours = StreamingDataset(root, delta_timestamps={"action": [0, 1 / 30]})
    return ours, LeRobotDatasetMetadata("local/lr_av1", root=root)


def test_attributes_equal_lerobots_in_value_and_type(both):
    ours, theirs = both
    for name in SAME:
        mine, lerobots = getattr(ours.meta, name), getattr(theirs, name)
        assert mine == lerobots, name
        assert type(mine) is type(lerobots), name
    for key, feature in ours.meta.features.items():
        assert type(feature["shape"]) is tuple, key
    assert ours.delta_timestamps == {"action": [0, 1 / 30]}


def test_info_has_every_field_lerobot_read(both):
    ours, theirs = both
    for field in dataclasses.fields(theirs.info):
        if hasattr(ours.meta.info, field.name):  # LeRobot fills absent keys with defaults
            assert getattr(ours.meta.info, field.name) == getattr(theirs.info, field.name)
    present = {"codebase_version", "fps", "features", "total_episodes", "total_frames",
               "total_tasks", "chunks_size", "data_path", "video_path", "robot_type", "splits"}
    assert present <= set(vars(ours.meta.info))


def test_episodes_columns_equal_lerobots(both):
    ours, theirs = both
    assert "tasks" in ours.meta.episodes
    for column, values in ours.meta.episodes.items():
        assert len(values) == theirs.total_episodes, column
        assert list(values) == list(theirs.episodes[column]), column
    # The one read LeRobot's eval split makes (factory.make_train_eval_datasets).
    for episode in range(theirs.total_episodes):
        assert ours.meta.episodes["tasks"][episode][0] == theirs.episodes["tasks"][episode][0]


def test_tasks_and_stats_equal_lerobots(both):
    ours, theirs = both
    assert ours.meta.tasks == list(theirs.tasks.sort_values("task_index").index)
    assert ours.meta.stats.keys() == theirs.stats.keys()
    for feature, stats in theirs.stats.items():
        assert ours.meta.stats[feature].keys() == stats.keys()
        for name, value in stats.items():
            assert np.array_equal(ours.meta.stats[feature][name], value), (feature, name)


def test_lerobots_own_readers_give_the_same_answers(both):
    ours, theirs = both
    assert dataset_to_policy_features(ours.meta.features) == \
        dataset_to_policy_features(theirs.features)
    config = ACTConfig(chunk_size=4, n_action_steps=4)
    assert resolve_delta_timestamps(config, ours.meta) == resolve_delta_timestamps(config, theirs)
