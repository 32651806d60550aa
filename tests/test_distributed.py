"""Real two-process ``torch.distributed`` (gloo, CPU) runs, two DataLoader workers per rank.

Each rank learns its rank and world size from the initialised process group (no arguments),
streams, and takes part in one ``all_reduce`` per batch as DDP would: if the ranks yielded
different numbers of batches, the run would hang (the timeout turns that into a failure). One
epoch streamed whole must show every frame exactly once across ranks; an epoch interrupted by a
checkpoint and resumed with another world size (2 ranks -> 1 process, 1 process -> 2 ranks) must
show every frame exactly once across the samples before and after the checkpoint.
"""

from __future__ import annotations

import json
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.data import DataLoader

from refstream.stream import StreamingDataset
from refstream.tools.demo import write_demo_dataset

WORLD_SIZE = 2
BATCH = 4
# Equal lengths split evenly over 2 ranks x 2 workers, so the distributed end-of-epoch rule
# (every rank stops after the fewest batches any rank can fill) cuts nothing.
LENGTHS = (8, 8, 8, 8, 8, 8, 8, 8)
# A hung collective or a stuck process must fail the test, never keep the machine busy.
RUN_TIMEOUT_S = 240


def _rank_main(rank: int, store: str, root: str, cache: str, out: str, job: dict) -> None:
    """One rank: stream ``job["batches"]`` batches (None: the epoch) after loading
    ``job["resume"]`` (a checkpoint) if given; rank 0 saves a checkpoint after them."""
    import os

    os.environ["REFSTREAM_CACHE"] = cache
    from refstream.stream import StreamingDataset

    # A file rendezvous: a free TCP port picked in advance may be taken by another process
    # before rank 0 listens on it.
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=WORLD_SIZE, timeout=timedelta(seconds=60))
    try:
        dataset = StreamingDataset(root, batch_size=BATCH, return_uint8=True, **job["options"])
        assert (dataset.rank, dataset.world_size) == (rank, WORLD_SIZE)
        if job.get("resume") is not None:
            dataset.load_state_dict(job["resume"], num_workers=2)
        # Spawned workers: forking a process that runs gloo's threads is not safe.
        loader = DataLoader(dataset, batch_size=BATCH, num_workers=2,
                            multiprocessing_context="spawn")
        seen = _consume(loader, job.get("batches"), step=lambda: dist.all_reduce(torch.ones(1)))
        state = dataset.state_dict(len(seen) * BATCH, batch_size=BATCH, num_workers=2)
        Path(out, f"rank{rank}.json").write_text(json.dumps({"seen": seen, "state": state}))
    finally:
        dist.destroy_process_group()


def _consume(loader, batches: int | None, step=None) -> list[list[list[int]]]:
    """The (episode, frame) labels of each batch, up to ``batches`` batches."""
    seen = []
    for batch in loader:
        seen.append([list(x) for x in zip(batch["episode_index"].tolist(),
                                          batch["frame_index"].tolist(), strict=True)])
        if step is not None:
            step()  # a DDP step: every rank must take part
        if len(seen) == batches:
            break
    return seen


def _two_ranks(tmp_path: Path, root: Path, job: dict) -> list[dict]:
    out = tmp_path / f"run{len(list(tmp_path.glob('run*')))}"
    out.mkdir()
    context = mp.start_processes(
        _rank_main, args=(str(out / "rendezvous"), str(root), str(tmp_path / "cache"), str(out),
                          job),
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
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD_SIZE)]


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("distributed") / "dataset"
    write_demo_dataset(root, episode_lengths=LENGTHS, cameras=("observation.images.front",),
                       size=(32, 24), episodes_per_video_file=3, episodes_per_data_file=4)
    return root


def _frames(batches) -> list[tuple[int, int]]:
    return sorted(tuple(x) for b in batches for x in b)


EVERY_FRAME = [(e, f) for e, n in enumerate(LENGTHS) for f in range(n)]


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_two_ranks_two_workers_cover_every_frame_once(tmp_path, root):
    ranks = _two_ranks(tmp_path, root, {"options": {"seed": 9}})
    episodes = [{e for b in r["seen"] for e, _ in b} for r in ranks]
    assert not episodes[0] & episodes[1]  # whole episodes per rank
    assert _frames(ranks[0]["seen"] + ranks[1]["seen"]) == EVERY_FRAME


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_two_ranks_resumed_in_one_process_deliver_the_rest_once(tmp_path, root, monkeypatch):
    """2 ranks x 2 workers, batch 4, stop after 3 batches; resume in one process with 3
    workers and batch 2 (a dataset without a seed takes the checkpoint's)."""
    monkeypatch.setenv("REFSTREAM_CACHE", str(tmp_path / "cache"))
    ranks = _two_ranks(tmp_path, root, {"options": {"seed": 9}, "batches": 3})
    state = ranks[0]["state"]
    assert state["world_size"] == 2 and state["samples"] == 3 * BATCH
    dataset = StreamingDataset(root, batch_size=2, return_uint8=True)
    dataset.load_state_dict(state, num_workers=3)
    assert dataset.seed == 9
    rest = _consume(DataLoader(dataset, batch_size=2, num_workers=3), None)
    assert _frames(ranks[0]["seen"] + ranks[1]["seen"] + rest) == EVERY_FRAME


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_one_process_resumed_on_two_ranks_delivers_the_rest_once(tmp_path, root, monkeypatch):
    """1 process x 2 workers, batch 4, pool 1, stop after 6 batches (each worker mid-way
    through its second episode); resume on 2 ranks x 2 workers. The rest is 40 frames that
    split 20/20 over the ranks, so the distributed end of the epoch cuts nothing."""
    monkeypatch.setenv("REFSTREAM_CACHE", str(tmp_path / "cache"))
    options = {"seed": 9, "episode_pool_size": 1}
    dataset = StreamingDataset(root, batch_size=BATCH, return_uint8=True, **options)
    before = _consume(DataLoader(dataset, batch_size=BATCH, num_workers=2), 6)
    state = dataset.state_dict(6 * BATCH, batch_size=BATCH, num_workers=2)
    ranks = _two_ranks(tmp_path, root, {"options": options, "resume": state})
    assert len(ranks[0]["seen"]) == len(ranks[1]["seen"])  # the same steps on every rank
    assert _frames(before + ranks[0]["seen"] + ranks[1]["seen"]) == EVERY_FRAME
    assert ranks[0]["state"]["history"] == [[1, 2, BATCH, 6 * BATCH]]
