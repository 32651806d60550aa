"""``refstream lerobot-train``: LeRobot 0.6.1's own trainer (``lerobot-train``), fed by
``StreamingDataset`` instead of a downloaded dataset.

Use: ``refstream lerobot-train`` (or ``torchrun ... -m refstream.tools.lerobot_train``) with
``lerobot-train``'s own flags, as the README's "Training with LeRobot" shows. It runs LeRobot's
``train()`` unchanged and replaces, for the run only, five things around it:

* LeRobot's dataset factory makes ``StreamingDataset``\\ s, with the run's seed, batch size and
  worker count, in a streaming run: the trainer's DataLoader has no sampler (``_Run``);
* DataLoader workers are capped at the fewest episodes a rank owns (a worker streams whole
  episodes);
* accelerate's ``prepare`` hands a ``StreamingDataset``'s DataLoader back unsplit, each further
  pass the next epoch (SPEC §9.5, ``_Loader``);
* each checkpoint also holds the data position, which ``--resume=true`` loads;
* ``--policy.push_to_hub=true`` writes the model card from refstream's metadata, shown to LeRobot
  with its repo id and its tasks as LeRobot's metadata has them (``card_metadata``).

Everything else — policy, processors, optimizer, logging, evaluation, checkpoints — is LeRobot's.
lerobot is imported only here (the ``lerobot`` extra).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import accelerate
import pandas
from lerobot.datasets import factory
from lerobot.policies.pretrained import PreTrainedPolicy
from lerobot.scripts import lerobot_train
from lerobot.utils.constants import TRAINING_STATE_DIR

from refstream import shard
from refstream.errors import UsageError
from refstream.meta import DatasetMeta, load_meta
from refstream.roots import open_source
from refstream.stream import StreamingDataset

__all__ = ["main", "DATA_STATE", "card_metadata"]

DATA_STATE = "refstream_data.json"  # in a checkpoint's training_state/, beside LeRobot's


def main(argv: list[str] | None = None) -> int:
    sys.argv = [sys.argv[0], *(sys.argv[1:] if argv is None else argv)]  # LeRobot parses these
    run = _Run()
    with mock.patch.multiple(lerobot_train, make_train_eval_datasets=run.make_datasets,
                             save_checkpoint=run.save_checkpoint), \
            mock.patch.multiple(accelerate.Accelerator, end_training=_end_training,
                                prepare_data_loader=lambda accelerator, loader, *args, **kwargs:
                                run.prepare_data_loader(accelerator, loader, *args, **kwargs)), \
            mock.patch.object(PreTrainedPolicy, "push_model_to_hub", _push_model_to_hub):
        lerobot_train.main()
    return 0


def _end_training(accelerator) -> None:
    """accelerate's ``end_training``; then a process of a distributed run ends at once.

    Once the process group is destroyed, freeing DDP's reducer (when LeRobot's ``train``
    returns) can wait forever in the gloo process group's destructor after a peer has exited
    (torch 2.13 with gloo): the run is over, so the process exits before that."""
    _ORIGINAL_END(accelerator)
    if accelerator.num_processes > 1:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _push_model_to_hub(policy, cfg, *args, dataset_meta=None, **kwargs):
    """LeRobot's ``push_model_to_hub``, its model card written from :func:`card_metadata`."""
    if isinstance(dataset_meta, DatasetMeta):
        dataset_meta = card_metadata(dataset_meta, cfg.dataset.repo_id)
    return _ORIGINAL_PUSH(policy, cfg, *args, dataset_meta=dataset_meta, **kwargs)


def card_metadata(meta: DatasetMeta, repo_id: str) -> _CardMetadata:
    """``meta`` as LeRobot's model card reads a ``LeRobotDatasetMetadata``: with ``repo_id``,
    and its tasks a frame indexed by the task strings, in ``task_index`` order."""
    tasks = pandas.DataFrame({"task_index": range(len(meta.tasks))},
                             index=pandas.Index(meta.tasks, name="task"))
    return _CardMetadata(meta, repo_id, tasks)


class _CardMetadata:
    """A ``DatasetMeta`` with LeRobot's ``repo_id`` and ``tasks`` (:func:`card_metadata`)."""

    def __init__(self, meta: DatasetMeta, repo_id: str, tasks: pandas.DataFrame) -> None:
        self.meta, self.repo_id, self.tasks = meta, repo_id, tasks

    def __getattr__(self, name: str):
        return getattr(self.meta, name)


def dataset_root(repo_id: str, root: str | None, revision: str | None) -> str:
    """The root refstream streams: ``--dataset.root`` as given, else the Hub dataset."""
    if root is not None:
        return str(root)
    return f"hf://datasets/{repo_id}" + (f"@{revision}" if revision else "")


class _Run:
    """What one training run replaces in LeRobot, and what it keeps between the replacements."""

    def __init__(self) -> None:
        self.train_set: StreamingDataset | None = None
        self.loaders: dict[int, _Loader] = {}  # id(dataset) -> its prepared loader

    def make_datasets(self, cfg) -> tuple[StreamingDataset, StreamingDataset | None]:
        """LeRobot's ``make_train_eval_datasets(cfg)``, making StreamingDatasets."""
        if cfg.dataset.repo_type != "dataset":
            raise UsageError(f"--dataset.repo_type={cfg.dataset.repo_type}: refstream streams "
                             "datasets (a folder, an http(s):// URL or hf://datasets/…)")
        cfg.dataset.streaming = True

        def metadata(repo_id, *, root=None, revision=None, **_) -> DatasetMeta:
            with contextlib.closing(open_source(dataset_root(repo_id, root, revision))) as source:
                return load_meta(source)

        def dataset(repo_id, *, root=None, revision=None, episodes=None, delta_timestamps=None,
                    image_transforms=None, tolerance_s=1e-4, return_uint8=False, **_):
            return StreamingDataset(
                dataset_root(repo_id, root, revision), episodes=episodes,
                delta_timestamps=delta_timestamps, image_transforms=image_transforms,
                tolerance_s=tolerance_s, return_uint8=return_uint8, seed=cfg.seed,
                batch_size=cfg.batch_size, num_workers=cfg.num_workers)

        with mock.patch.multiple(factory, LeRobotDatasetMetadata=metadata,
                                 LeRobotDataset=dataset, StreamingLeRobotDataset=dataset):
            train, evaluation = factory.make_train_eval_datasets(cfg)
        made = [train] if evaluation is None else [train, evaluation]
        workers = min([cfg.num_workers, *(len(_rank_episodes(d)) for d in made)])
        if workers < cfg.num_workers:
            logging.warning(f"refstream: {workers} DataLoader worker(s) instead of "
                            f"--num_workers={cfg.num_workers}: a worker streams whole episodes, "
                            f"and a rank owns {workers} episode(s) of a dataset")
            cfg.num_workers = workers
        for made_set in made:
            made_set.num_workers = workers
        if cfg.resume:
            path = Path(cfg.checkpoint_path) / TRAINING_STATE_DIR / DATA_STATE
            if not path.is_file():
                raise UsageError(f"{path} is missing: resume a checkpoint that refstream "
                                 "lerobot-train wrote")
            train.load_state_dict(json.loads(path.read_text()), num_workers=workers)
        self.train_set = train
        return train, evaluation

    def prepare_data_loader(self, accelerator, data_loader, *args, **kwargs):
        """accelerate's ``prepare_data_loader``, except for a StreamingDataset's loader."""
        if not isinstance(data_loader.dataset, StreamingDataset):
            return _ORIGINAL_PREPARE(accelerator, data_loader, *args, **kwargs)
        loader = self.loaders[id(data_loader.dataset)] = _Loader(data_loader)
        return loader

    def save_checkpoint(self, checkpoint_dir, *args, **kwargs) -> None:
        """LeRobot's ``save_checkpoint``, then the data position beside its training state."""
        _ORIGINAL_SAVE(checkpoint_dir, *args, **kwargs)
        state = self.loaders[id(self.train_set)].state_dict()
        (Path(checkpoint_dir) / TRAINING_STATE_DIR / DATA_STATE).write_text(json.dumps(state))


_ORIGINAL_PREPARE = accelerate.Accelerator.prepare_data_loader
_ORIGINAL_SAVE = lerobot_train.save_checkpoint
_ORIGINAL_END = accelerate.Accelerator.end_training
_ORIGINAL_PUSH = PreTrainedPolicy.push_model_to_hub


class _Loader:
    """A StreamingDataset's DataLoader as the trainer gets it back from accelerate: the rank's
    own batches, counted; each pass after the first plays the next epoch. The dataset moves to
    that epoch as the last batch of a pass is handed out, so a checkpoint taken after it resumes
    into the next epoch (one batch is read ahead to know which batch is the last)."""

    def __init__(self, loader) -> None:
        self.loader, self.dataset = loader, loader.dataset
        self.workers = loader.num_workers
        # The epoch the dataset stands in (0, or a loaded checkpoint's).
        self.epoch = self.dataset.state_dict(0, batch_size=loader.batch_size,
                                             num_workers=self.workers)["epoch"]
        self.batches = 0  # taken since the dataset's position was last set

    def __iter__(self) -> Iterator:
        batches = iter(self.loader)
        batch = next(batches, None)
        while batch is not None:
            following = next(batches, None)
            if following is None:
                break
            self.batches += 1
            yield batch
            batch = following
        self.epoch += 1
        self.dataset.set_epoch(self.epoch)
        self.batches = 0
        if batch is not None:
            yield batch

    def state_dict(self) -> dict:
        """The checkpoint of the data position after the batches taken."""
        size = self.loader.batch_size
        return self.dataset.state_dict(self.batches * size, batch_size=size,
                                       num_workers=self.workers)


def _rank_episodes(dataset: StreamingDataset) -> list[int]:
    frames = [dataset.meta.frames(e) for e in dataset.episodes]
    return shard.rank_share(dataset.episodes, frames, dataset.rank, dataset.world_size)


if __name__ == "__main__":
    sys.exit(main())
