"""refstream.planner.Planner against a whole-simulation oracle and brute-force coverage."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
from core_oracle import expected_plan, plan
from hypothesis import given, settings
from hypothesis import strategies as st

from refstream import planner as planner_module
from refstream.errors import EpisodeTooLarge, ShardingError, UsageError
from refstream.planner import Planner
from refstream.shard import rank_share, split_limits, worker_shares
from refstream.tools import conformance

FIXTURES = Path(__file__).resolve().parent.parent / "spec" / "fixtures" / "plan"
STRATEGY = st.sampled_from(["pool", "round_robin"])


@st.composite
def plan_inputs(draw, max_episodes=8, max_frames=12):
    frames = draw(st.lists(st.integers(0, max_frames), min_size=1, max_size=max_episodes))
    ids = draw(st.permutations(range(2 * len(frames))))[: len(frames)]
    kwargs = {
        "seed": draw(st.integers(0, 2**64 - 1)),
        "epoch": draw(st.integers(0, 5)),
        "rank": draw(st.integers(0, 3)),
        "worker": draw(st.integers(0, 3)),
        "strategy": draw(STRATEGY),
        "pool_size": draw(st.integers(1, 5)),
        "pool_ramp": draw(st.one_of(st.just(0), st.integers(1, 6))),
    }
    if draw(st.booleans()):
        sizes = draw(st.lists(st.integers(0, 100), min_size=len(frames), max_size=len(frames)))
        kwargs["byte_sizes"] = sizes
        kwargs["byte_budget"] = draw(st.integers(max(1, max(sizes)), max(1, sum(sizes)) + 1))
    return list(ids), frames, kwargs


def run_with_events(planner: Planner):
    """The planner's epoch as the oracle's step list, checking the invariants after each step."""
    steps = []

    def record(anchor=None):
        admitted, evicted = planner.drain_events()
        if anchor is not None:
            steps.append(("anchor", *anchor))
        steps.extend(("evict", e) for e in evicted)
        steps.extend(("admit", e) for e in admitted)

    record()
    for anchor in planner:
        record(anchor)
    return steps


@settings(max_examples=250, deadline=None)
@given(plan_inputs())
def test_planner_matches_oracle_step_for_step(inputs):
    ids, frames, kwargs = inputs
    steps = run_with_events(Planner(ids, frames, **kwargs))
    assert steps == plan(ids, frames, **kwargs)


@settings(max_examples=200, deadline=None)
@given(plan_inputs())
def test_exact_coverage_and_limits_at_every_step(inputs):
    ids, frames, kwargs = inputs
    planner = Planner(ids, frames, **kwargs)
    sizes = dict(zip(ids, kwargs.get("byte_sizes", [0] * len(ids)), strict=True))
    emitted = []
    ramp = kwargs["pool_ramp"]
    while True:
        grown = kwargs["pool_size"] if not ramp else 1 + len(emitted) // ramp  # SPEC §3.2
        assert len(planner.resident) <= min(kwargs["pool_size"], grown)
        if "byte_budget" in kwargs:
            assert sum(sizes[e] for e in planner.resident) <= kwargs["byte_budget"]
        assert planner.remaining == sum(frames) - len(emitted)
        try:
            emitted.append(next(planner))
        except StopIteration:
            break
    everything = [(e, f) for e, n in zip(ids, frames, strict=True) for f in range(n)]
    assert Counter(emitted) == Counter(everything) and len(emitted) == len(set(emitted))
    assert planner.resident == [] and planner.remaining == 0


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(0, 15), min_size=1, max_size=14),
    st.integers(1, 3),
    st.integers(1, 3),
    STRATEGY,
    st.integers(0, 1000),
)
def test_every_frame_exactly_once_across_ranks_and_workers(frames, world, workers, strategy, seed):
    ids = list(range(len(frames)))
    limits = split_limits(workers, pool_size=None, byte_budget=None, decoder_cache=None, cameras=1)
    try:
        shares = [worker_shares(s, [frames[e] for e in s], workers)
                  for s in (rank_share(ids, frames, rank, world) for rank in range(world))]
    except ShardingError:
        return  # a topology sharding refuses (tested in test_shard)
    emitted = []
    for rank in range(world):
        for worker, part in enumerate(shares[rank]):
            emitted += Planner(part, [frames[e] for e in part], seed=seed, epoch=0, rank=rank,
                               worker=worker, strategy=strategy, pool_size=limits.pool_size)
    brute_force = {(e, f) for e in ids for f in range(frames[e])}
    assert len(emitted) == len(brute_force) and set(emitted) == brute_force


@pytest.mark.parametrize("strategy", ["pool", "round_robin"])
def test_same_inputs_same_order_other_seed_or_epoch_other_order(strategy):
    ids, frames = [4, 1, 7, 2, 9], [10, 7, 12, 3, 8]

    def order(seed, epoch):
        return list(Planner(ids, frames, seed=seed, epoch=epoch, rank=0, worker=0,
                            strategy=strategy, pool_size=2))

    base = order(5, 0)
    assert order(5, 0) == base
    for other in (order(6, 0), order(5, 1), order(None, 0)):
        assert other != base and sorted(other) == sorted(base)
    assert order(None, 0) == order(42, 0)


@settings(max_examples=100, deadline=None)
@given(plan_inputs(max_frames=20), st.sampled_from(["seed", "epoch"]))
def test_other_seed_or_epoch_reorders_with_full_coverage(inputs, change):
    ids, frames, kwargs = inputs
    if sum(frames) < 12:
        return  # a short epoch can repeat its order by chance (12! > 4.7e8 orders)
    base = list(Planner(ids, frames, **kwargs))
    assert list(Planner(ids, frames, **kwargs)) == base
    other = dict(kwargs)
    other[change] = (other[change] + 1) % 2**64
    moved = list(Planner(ids, frames, **other))
    assert moved != base and sorted(moved) == sorted(base)


@settings(max_examples=40, deadline=None)
@given(plan_inputs(max_episodes=6, max_frames=8), st.sampled_from([1, 2, 3, 1 << 16]),
       st.integers(0, 5))
def test_skip_equals_stepping_at_every_offset(inputs, block, first_skip):
    """Whatever the block of draws skip makes at once, and split in two skips or not."""
    ids, frames, kwargs = inputs
    full = list(Planner(ids, frames, **kwargs))
    for n in range(len(full) + 1):
        stepped = Planner(ids, frames, **kwargs)
        for _ in range(n):
            next(stepped)
        skipped = Planner(ids, frames, **kwargs)
        with mock.patch.object(planner_module, "SKIP_BLOCK", block):
            skipped.skip(min(n, first_skip))
            skipped.skip(n - min(n, first_skip))
        assert skipped.emitted() == stepped.emitted()
        assert skipped.resident == stepped.resident
        assert skipped.drain_events() == stepped.drain_events()
        assert skipped.frontier(3) == stepped.frontier(3)
        assert list(skipped) == full[n:]


def test_frontier_is_the_waiting_admission_order_without_side_effects():
    ids, frames = list(range(10)), [3] * 10
    planner = Planner(ids, frames, seed=1, epoch=0, rank=0, worker=0, pool_size=3)
    admitted, _ = planner.drain_events()
    waiting = planner.frontier(100)
    assert len(admitted) == 3 and sorted(admitted + waiting) == ids
    assert planner.frontier(2) == waiting[:2] and planner.frontier(0) == []
    assert planner.drain_events() == ([], []) and planner.resident == admitted
    seen = list(admitted)
    for _ in planner:
        admitted, _ = planner.drain_events()
        seen += admitted
    assert seen == admitted_order(ids, frames)  # admissions follow the frontier order


def admitted_order(ids, frames):
    return [s[1] for s in plan(ids, frames, seed=1, epoch=0, rank=0, worker=0,
                               strategy="pool", pool_size=3) if s[0] == "admit"]


def test_round_robin_round_visits_each_resident_once():
    ids, frames = [0, 1, 2, 3], [4, 4, 4, 4]
    anchors = list(Planner(ids, frames, seed=3, epoch=0, rank=0, worker=0,
                           strategy="round_robin", pool_size=4))
    rounds = [anchors[i : i + 4] for i in range(0, 16, 4)]
    for visit in rounds:
        assert sorted(e for e, _ in visit) == ids


def test_episode_larger_than_budget_fails_before_anything():
    with pytest.raises(EpisodeTooLarge, match="episode 7 needs 11 bytes.*budget of 10"):
        Planner([3, 7], [2, 2], seed=1, epoch=0, rank=0, worker=0, pool_size=2,
                byte_sizes=[5, 11], byte_budget=10)
    # an empty episode never needs its bytes
    planner = Planner([3, 7], [2, 0], seed=1, epoch=0, rank=0, worker=0, pool_size=2,
                      byte_sizes=[5, 11], byte_budget=10)
    assert len(list(planner)) == 2


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        (([1, 1], [2, 2]), {}, "distinct"),
        (([1, 2], [2]), {}, "frame counts"),
        (([-1], [2]), {}, "non-negative"),
        (([1], [-2]), {}, "non-negative"),
        (([1], [2]), {"strategy": "remaining"}, "strategy"),
        (([1], [2]), {"pool_size": 0}, "pool_size"),
        (([1], [2]), {"epoch": -1}, "epoch"),
        (([1], [2]), {"byte_budget": 10}, "together"),
        (([1], [2]), {"byte_sizes": [1], "byte_budget": 0}, "byte_budget must be an integer >= 1"),
        (([1], [2]), {"byte_sizes": [-1], "byte_budget": 5}, "negative"),
        (([1], [2]), {"seed": -3}, "seed"),
        (([1], [2]), {"pool_ramp": -1}, "pool_ramp"),
        (([1], [2]), {"pool_ramp": 1.5}, "pool_ramp"),
    ],
)
def test_invalid_arguments(args, kwargs, match):
    settings_ = {"seed": 1, "epoch": 0, "rank": 0, "worker": 0, "pool_size": 2} | kwargs
    with pytest.raises(UsageError, match=match):
        Planner(*args, **settings_)


def test_skip_past_the_epoch_is_refused():
    planner = Planner([1], [3], seed=1, epoch=0, rank=0, worker=0, pool_size=1)
    with pytest.raises(UsageError, match="cannot skip 4 anchors: 3 remain"):
        planner.skip(4)


def test_droid_sized_selection_plans_its_first_anchor():
    # DROID's size: 95,658 episodes, 27.6 M frames, on 8 ranks x 4 workers. How fast is shown by
    # `refstream bench` (its planner figures); here, that the share and first anchor are right.
    rng = np.random.default_rng(0)
    lengths = rng.integers(60, 520, size=95_658)
    lengths = np.maximum(1, lengths * 27_600_000 // lengths.sum()).tolist()
    ids = list(range(len(lengths)))
    share = rank_share(ids, lengths, 7, 8)
    part = worker_shares(share, [lengths[e] for e in share], 4)[3]
    limits = split_limits(4, pool_size=None, byte_budget=8 << 30, decoder_cache=None, cameras=3)
    planner = Planner(part, [lengths[e] for e in part], seed=None, epoch=0, rank=7, worker=3,
                      pool_size=limits.pool_size, byte_sizes=[lengths[e] * 30_000 for e in part],
                      byte_budget=limits.byte_budget)
    episode, frame = next(planner)
    assert episode in planner.resident and 0 <= frame < lengths[episode]
    assert planner.remaining == sum(lengths[e] for e in part) - 1


def _cases():
    return sorted(FIXTURES.glob("*.json"))


def test_plan_fixture_area_is_populated():
    assert len(_cases()) >= 10


@pytest.mark.parametrize("path", _cases(), ids=lambda p: p.stem)
def test_plan_fixtures(path):
    case = json.loads(path.read_text())
    assert case["kind"] == "plan"
    assert expected_plan(case["input"]) == case["expected"]  # the oracle agrees with the file
    answer = conformance.answer(case["kind"], case["input"])
    assert answer == case["expected"]


def test_plan_command_on_a_written_dataset(tmp_path, capsys):
    from lerobot_layout import write_layout

    from refstream.tools.cli import main

    lengths = [7, 0, 12, 5, 9, 3]
    layout = write_layout(tmp_path / "ds", lengths)
    argv = ["plan", str(layout.root), "--world-size", "2", "--num-workers", "2", "--limit", "0",
            "--json", "--strategy", "round_robin", "--seed", "3"]
    emitted, rank_frames = [], None
    for rank in range(2):
        assert main([*argv, "--rank", str(rank)]) == 0
        summary = json.loads(capsys.readouterr().out)
        rank_frames = summary["rank_frames"]
        assert summary["worker_frames"] == [len(w["anchors"]) for w in summary["workers"]]
        emitted += [tuple(a) for w in summary["workers"] for a in w["anchors"]]
    assert sorted(emitted) == [(e, f) for e, n in enumerate(lengths) for f in range(n)]
    assert sorted(rank_frames) == [17, 19]  # LPT: {12, 5} and {9, 7, 3}
    assert main(["plan", str(layout.root), "--episodes", "2,4", "--limit", "3"]) == 0
    text = capsys.readouterr().out
    assert "2 episodes, 21 frames" in text and "first 3 anchors" in text
    assert main(["plan", str(layout.root), "--num-workers", "9"]) == 2
    assert "fewer than its 9 DataLoader workers" in capsys.readouterr().err
