"""Run ``refstream lerobot-train`` (its ``main``) and write down what LeRobot's trainer took.

    python tests/lerobot_probe.py OUT lerobot-train's flags...
    torchrun --nproc-per-node=2 tests/lerobot_probe.py OUT lerobot-train's flags...

For every training step, in order, one JSON line in ``OUT.rank<R>``: the batch's ``index`` and
``episode_index`` values and the shape of its ``action``, read where LeRobot's training loop takes
its batches (its ``cycle`` over the DataLoader that accelerate prepared).

With ``PROBE_UPLOADS=DIR`` in the environment, the Hub's write calls that ``--policy.push_to_hub``
makes are answered here instead (refstream only reads from the Hub): a repository created is
named back, a folder uploaded is copied to ``DIR/<repo id>/``, and a model card is valid.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from types import SimpleNamespace

import huggingface_hub
from lerobot.scripts import lerobot_train

from refstream.tools import lerobot_train as command

_cycle = lerobot_train.cycle
OUT = f"{sys.argv[1]}.rank{os.environ.get('RANK', '0')}"


def recording_cycle(loader):
    with open(OUT, "a") as out:
        for batch in _cycle(loader):
            step = {"index": batch["index"].tolist(), "episode": batch["episode_index"].tolist(),
                    "action": list(batch["action"].shape)}
            out.write(json.dumps(step) + "\n")
            out.flush()
            yield batch


def answer_hub_writes(directory: str) -> None:
    def create_repo(api, repo_id, **_):
        return huggingface_hub.RepoUrl(f"https://huggingface.co/{repo_id}")

    def upload_folder(api, *, repo_id, folder_path, **_):
        shutil.copytree(folder_path, os.path.join(directory, repo_id), dirs_exist_ok=True)
        return SimpleNamespace(repo_url=create_repo(api, repo_id))

    huggingface_hub.HfApi.create_repo = create_repo
    huggingface_hub.HfApi.upload_folder = upload_folder
    huggingface_hub.ModelCard.validate = lambda card, *args, **kwargs: None


if __name__ == "__main__":
    lerobot_train.cycle = recording_cycle
    if os.environ.get("PROBE_UPLOADS"):
        answer_hub_writes(os.environ["PROBE_UPLOADS"])
    sys.exit(command.main(sys.argv[2:]))
