"""Resume and the distributed end of epoch, against a simulated in-order DataLoader."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from itertools import count
from pathlib import Path

import pytest
from core_oracle import (
    dataloader,
    expected_batches_per_worker,
    expected_epoch_batches,
    expected_resume,
    replay,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from refstream.errors import (
    ResumeError,
    ShardingError,
    TopologyChanged,
    UsageError,
)
from refstream.planner import Planner
from refstream.resume import (
    ResumeSetup,
    ResumeState,
    Segment,
    batches_per_worker,
    epoch_batches,
    resume_positions,
    selection_digest,
)
from refstream.shard import rank_share, worker_shares
from refstream.tools import adapters, conformance

FIXTURES = Path(__file__).resolve().parent.parent / "spec" / "fixtures" / "resume"


@pytest.mark.parametrize(
    ("batches", "limits", "expected"),
    [  # LeRobot's test vectors for _batches_per_worker
        (7, [None, None, None], ([3, 2, 2], 1)),
        (5, [1, None], ([1, 4], 1)),
        (4, [0, None, 2], ([0, 2, 2], 1)),
        (3, [2, None, None], ([1, 1, 1], 0)),
        (10, [2, 3], ([2, 3], 0)),
    ],
)
def test_batches_per_worker_reference_vectors(batches, limits, expected):
    assert batches_per_worker(batches, limits) == expected


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 40), st.lists(st.one_of(st.none(), st.integers(0, 6)), min_size=1,
                                   max_size=5))
def test_batches_per_worker_matches_dataloader_simulation(batches, limits):
    assert batches_per_worker(batches, limits) == replay(batches, limits)


@st.composite
def resume_inputs(draw):
    frames = draw(st.lists(st.integers(1, 15), min_size=1, max_size=4))
    batch = draw(st.integers(1, 5))
    repeat = draw(st.booleans())
    samples = batch * draw(st.integers(0, 3 * sum(frames) // batch + 3))
    case = {"worker_frames": frames, "batch_size": batch, "epoch": draw(st.integers(0, 3)),
            "samples": samples, "repeat": repeat}
    if not repeat and draw(st.booleans()):
        case["rank_batches"] = draw(st.integers(1, sum(-(-f // batch) for f in frames)))
    return case


@settings(max_examples=300, deadline=None)
@given(resume_inputs())
def test_resume_positions_match_dataloader_simulation(case):
    assert adapters.kind_resume(case) == expected_resume(case)


def share_streams(shares, frames, *, seed, strategy, pool):
    """One planner per (logical worker, epoch): stream(w, epoch, offset, stop) -> anchors."""

    def stream(w, epoch, offset=0, stop=None):
        plan = Planner(shares[w], [frames[e] for e in shares[w]], seed=seed, epoch=epoch, rank=0,
                       worker=w, strategy=strategy, pool_size=pool)
        plan.skip(offset)
        limit = plan.remaining if stop is None else stop - offset
        for _ in range(max(0, limit)):
            yield next(plan)

    return stream


def endless(stream, w, epoch, offset=0):
    yield from stream(w, epoch, offset)
    for later in count(epoch + 1):
        yield from stream(w, later)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(1, 7), min_size=2, max_size=6),
    st.integers(1, 3),
    st.integers(1, 4),
    st.sampled_from(["pool", "round_robin"]),
    st.booleans(),
    st.integers(0, 3),
)
def test_resume_at_every_offset_reproduces_the_uninterrupted_suffix(
    frames, workers, batch, strategy, repeat, shortfall
):
    """``shortfall`` batches fewer than the rank could fill: a distributed finite epoch."""
    ids = list(range(len(frames)))
    workers = min(workers, len(ids))
    shares = worker_shares(ids, frames, workers)
    totals = [sum(frames[e] for e in share) for share in shares]
    stream = share_streams(shares, frames, seed=9, strategy=strategy, pool=2)
    epoch = 2
    rank_batches = None
    if repeat:
        horizon = 2 * sum(totals) // batch + 3
        reference = dataloader([endless(stream, w, epoch) for w in range(workers)], batch,
                               max_batches=horizon)
    else:
        rank_batches = max(1, sum(-(-t // batch) for t in totals) - shortfall)
        start = resume_positions(totals, batch, epoch=epoch, samples=0, repeat=False,
                                 rank_batches=rank_batches)
        reference = dataloader([stream(w, epoch, 0, start.stops[w]) for w in range(workers)],
                               batch)
        assert len(reference) == rank_batches
        horizon = rank_batches
    for k in range(horizon + 1):
        at = resume_positions(totals, batch, epoch=epoch, samples=k * batch, repeat=repeat,
                              rank_batches=rank_batches)
        logical = [(p + at.rotation) % workers for p in range(workers)]
        if repeat:
            streams = [endless(stream, w, at.epochs[w], at.offsets[w]) for w in logical]
            resumed = dataloader(streams, batch, max_batches=horizon - k)
            assert [b for _, b in resumed] == [b for _, b in reference[k:]]
        else:
            streams = [stream(w, at.epochs[w], at.offsets[w], at.stops[w]) for w in logical]
            resumed = dataloader(streams, batch)
            if k < horizon:
                assert [b for _, b in resumed] == [b for _, b in reference[k:]]
            else:  # a whole epoch consumed: the next one starts afresh
                assert at.epochs == (epoch + 1,) * workers and at.offsets == (0,) * workers
                nxt = dataloader([stream(w, epoch + 1, 0, start.stops[w])
                                  for w in range(workers)], batch)
                assert resumed == nxt


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.integers(0, 9), min_size=4, max_size=12),
    st.integers(1, 3),
    st.integers(1, 2),
    st.integers(1, 4),
)
def test_finite_distributed_epoch_gives_every_rank_the_same_batch_count(
    frames, world, workers, batch
):
    ids = list(range(len(frames)))
    try:
        per_rank = [worker_shares(s, [frames[e] for e in s], workers)
                    for s in (rank_share(ids, frames, rank, world) for rank in range(world))]
    except ShardingError:
        return  # a topology sharding refuses (tested in test_shard)
    totals = [[sum(frames[e] for e in part) for part in shares] for shares in per_rank]
    common = epoch_batches(totals, batch)
    seen = []
    for rank, shares in enumerate(per_rank):
        stream = share_streams(shares, frames, seed=1, strategy="pool", pool=2)
        start = resume_positions(totals[rank], batch, epoch=0, samples=0, repeat=False,
                                 rank_batches=common)
        got = dataloader([stream(w, 0, 0, start.stops[w]) for w in range(workers)], batch)
        assert len(got) == common  # no rank waits for another at the end of the epoch
        seen += [anchor for _, b in got for anchor in b]
    assert len(seen) == len(set(seen))
    assert common == min(len(dataloader([range(f) for f in t], batch)) for t in totals)


SETUP = ResumeSetup(seed=42, strategy="pool", pool_size=None, byte_budget=1 << 30,
                    world_size=2, num_workers=4, batch_size=8, repeat=True,
                    selection=selection_digest([0, 1], [5, 7]))


def test_resume_state_round_trip_and_checks():
    state = ResumeState(epoch=3, samples=64, setup=SETUP)
    document = json.loads(json.dumps(state.to_dict()))
    restored = ResumeState.from_dict(document)
    assert restored == state
    assert restored.resume_with(SETUP) is restored
    changed = dataclasses.replace(SETUP, world_size=4, num_workers=2)
    elastic = restored.resume_with(changed)  # the old topology's samples become history
    assert elastic == ResumeState(3, 0, changed, (Segment(2, 4, 8, 64),))
    assert ResumeState.from_dict(json.loads(json.dumps(elastic.to_dict()))) == elastic
    other = dataclasses.replace(SETUP, seed=1, strategy="round_robin", world_size=3)
    with pytest.raises(TopologyChanged, match=r"seed 42 -> 1, strategy 'pool' -> 'round_robin' \("):
        restored.resume_with(other)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"samples": 12}, "12 samples is not a whole number of batches of 8"),
        ({"epoch": -1}, "epoch"),
        ({"batch_size": 0}, "batch_size"),
        ({"strategy": "remaining"}, "strategy"),
        ({"pool_size": 0}, "pool_size"),
        ({"selection": 5}, "selection"),
        ({"seed": None}, "seed"),
    ],
)
def test_malformed_resume_states(change, match):
    document = ResumeState(epoch=0, samples=8, setup=SETUP).to_dict() | change
    with pytest.raises(ResumeError, match=match):
        ResumeState.from_dict(document)
    with pytest.raises(ResumeError, match=r"lacks \['seed'\]"):
        ResumeState.from_dict({k: v for k, v in document.items() if k != "seed"})


def test_resume_positions_refusals():
    with pytest.raises(ResumeError, match="6 samples is not a whole number of batches of 4"):
        resume_positions([10], 4, epoch=0, samples=6, repeat=True)
    # Refusals no caller of the library reaches: the conformance adapter checks them.
    case = {"worker_frames": [10, 0], "batch_size": 4, "epoch": 0, "samples": 0, "repeat": True}
    with pytest.raises(UsageError, match="frames"):
        adapters.kind_resume(case)
    with pytest.raises(UsageError, match="rank_batches"):
        adapters.kind_resume({**case, "worker_frames": [10], "repeat": False, "rank_batches": 4})


def test_selection_digest_is_the_sorted_lines_hash():
    text = "0 5\n3 7\n"
    assert selection_digest([3, 0], [7, 5]) == hashlib.sha256(text.encode()).hexdigest()
    assert selection_digest([3, 0], [7, 6]) != selection_digest([3, 0], [7, 5])


ORACLES = {
    "batches_per_worker": expected_batches_per_worker,
    "resume": expected_resume,
    "epoch_batches": expected_epoch_batches,
}


def _cases():
    return sorted(FIXTURES.glob("*.json"))


def test_resume_fixture_area_is_populated():
    assert len(_cases()) >= 10


@pytest.mark.parametrize("path", _cases(), ids=lambda p: p.stem)
def test_resume_fixtures(path):
    case = json.loads(path.read_text())
    if case["kind"] in ORACLES:
        assert ORACLES[case["kind"]](case["input"]) == case["expected"]  # the oracle agrees
    answer = conformance.answer(case["kind"], case["input"])
    assert answer == case["expected"]
