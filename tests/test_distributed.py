"""A real two-process ``torch.distributed`` (gloo, CPU) run, two DataLoader workers per rank.

Each rank learns its rank and world size from the initialised process group (no arguments),
streams one epoch, and takes part in one ``all_reduce`` per batch as DDP would: if the ranks
yielded different numbers of batches, the run would hang (the timeout turns that into a failure).
Every frame must be seen exactly once across ranks.
"""

from __future__ import annotations

import json
import socket
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.data import DataLoader

from refstream.tools.demo import write_demo_dataset

WORLD_SIZE = 2
BATCH = 4
# Equal lengths split evenly over 2 ranks x 2 workers, so the distributed end-of-epoch rule
# (every rank stops after the fewest batches any rank can fill) cuts nothing.
LENGTHS = (8, 8, 8, 8, 8, 8, 8, 8)
# A hung collective or a stuck process must fail the test, never keep the machine busy.
RUN_TIMEOUT_S = 240


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_main(rank: int, port: int, root: str, cache: str, out: str) -> None:
    import os

    os.environ["REFSTREAM_CACHE"] = cache
    from refstream.stream import StreamingDataset

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD_SIZE, timeout=timedelta(seconds=60))
    try:
        dataset = StreamingDataset(root, seed=9, batch_size=BATCH, return_uint8=True)
        assert (dataset.rank, dataset.world_size) == (rank, WORLD_SIZE)
        seen = []
        # Spawned workers: forking a process that runs gloo's threads is not safe.
        loader = DataLoader(dataset, batch_size=BATCH, num_workers=2,
                            multiprocessing_context="spawn")
        for batch in loader:
            seen += list(zip(batch["episode_index"].tolist(), batch["frame_index"].tolist(),
                             strict=True))
            step = torch.ones(1)
            dist.all_reduce(step)  # a DDP step: every rank must take part
        Path(out, f"rank{rank}.json").write_text(json.dumps({"seen": seen}))
    finally:
        dist.destroy_process_group()


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_two_ranks_two_workers_cover_every_frame_once(tmp_path):
    root = tmp_path / "dataset"
    write_demo_dataset(root, episode_lengths=LENGTHS, cameras=("observation.images.front",),
                       size=(32, 24), episodes_per_video_file=3, episodes_per_data_file=4)
    context = mp.start_processes(
        _rank_main, args=(_free_port(), str(root), str(tmp_path / "cache"), str(tmp_path)),
        nprocs=WORLD_SIZE, join=False, start_method="spawn")
    deadline = time.monotonic() + RUN_TIMEOUT_S
    try:
        while not context.join(timeout=1):  # raises if a rank failed
            if time.monotonic() > deadline:
                pytest.fail(f"the two-rank run did not finish within {RUN_TIMEOUT_S} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text())["seen"]
            for r in range(WORLD_SIZE)]
    episodes = [{e for e, _ in s} for s in seen]
    assert not episodes[0] & episodes[1]  # whole episodes per rank
    frames = sorted(tuple(x) for s in seen for x in s)
    assert frames == [(e, f) for e, n in enumerate(LENGTHS) for f in range(n)]
