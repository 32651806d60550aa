"""Run ``refstream lerobot-train`` (its ``main``) and write down what LeRobot's trainer took.

    python tests/lerobot_probe.py OUT lerobot-train's flags...
    torchrun --nproc-per-node=2 tests/lerobot_probe.py OUT lerobot-train's flags...

For every training step, in order, one JSON line in ``OUT.rank<R>``: the batch's ``index`` and
``episode_index`` values and the shape of its ``action``, read where LeRobot's training loop takes
its batches (its ``cycle`` over the DataLoader that accelerate prepared).
"""

from __future__ import annotations

import json
import os
import sys

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


if __name__ == "__main__":
    lerobot_train.cycle = recording_cycle
    sys.exit(command.main(sys.argv[2:]))
