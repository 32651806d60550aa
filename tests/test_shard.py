"""refstream.shard against LeRobot's test vectors, a list-scan LPT oracle and the spec's limits."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from core_oracle import expected_shard, lpt
from hypothesis import given, settings
from hypothesis import strategies as st

from refstream import shard
from refstream.errors import EpisodeSelectionError, ShardingError, UsageError
from refstream.planner import Planner
from refstream.tools import conformance

FIXTURES = Path(__file__).resolve().parent.parent / "spec" / "fixtures" / "shard"


def test_lerobot_lpt_vector():
    assert shard.lpt_partition([0, 1, 2, 3, 4], [100, 90, 20, 10, 5], 2) == [[0, 3, 4], [1, 2]]


def test_lerobot_rank_shares():
    lengths = [5, 9, 3, 11, 6, 8, 4, 10]
    ids = list(range(8))
    assert shard.rank_share(ids, lengths, 1, 2) == [7, 1, 0, 6]
    assert shard.rank_share(ids, lengths, 0, 2) == [3, 5, 4, 2]


@st.composite
def episodes(draw, min_size=0):
    frames = draw(st.lists(st.integers(0, 50), min_size=min_size, max_size=30))
    ids = draw(st.permutations(range(0, 3 * len(frames) + 1)))[: len(frames)]
    return list(ids), frames


@settings(max_examples=300, deadline=None)
@given(episodes(), st.integers(1, 8))
def test_lpt_matches_oracle_and_is_balanced(selection, parts):
    ids, frames = selection
    got = shard.lpt_partition(ids, frames, parts)
    assert got == lpt(ids, frames, parts)
    count = dict(zip(ids, frames, strict=True))
    flat = [e for part in got for e in part]
    assert sorted(flat) == sorted(e for e in ids if count[e] > 0)  # disjoint, zero-length out
    loads = [sum(count[e] for e in part) for part in got]
    assert max(loads) - min(loads) <= max(frames, default=0)


@settings(max_examples=200, deadline=None)
@given(episodes(min_size=1), st.integers(1, 4), st.integers(1, 4))
def test_rank_and_worker_shares_cover_the_selection(selection, world, workers):
    ids, frames = selection
    count = dict(zip(ids, frames, strict=True))
    covered = []
    try:
        for rank in range(world):
            share = shard.rank_share(ids, frames, rank, world)
            for part in shard.worker_shares(share, [count[e] for e in share], workers):
                assert part
                covered.extend(part)
    except ShardingError:
        # only when the oracle leaves some rank with fewer episodes than workers (or none)
        assert any(len(part) < workers for part in lpt(ids, frames, world))
        return
    assert all(len(part) >= workers for part in lpt(ids, frames, world))
    assert sorted(covered) == sorted(e for e in ids if count[e] > 0)


def test_sharding_errors_name_the_numbers():
    with pytest.raises(ShardingError, match=r"owns 2 episodes.*3 DataLoader workers.*at most 2"):
        shard.worker_shares([4, 5], [10, 10], 3)
    with pytest.raises(ShardingError, match=r"rank 3 of world size 4.*3 episodes.*at most 3"):
        shard.rank_share([0, 1, 2, 3], [1, 1, 1, 0], 3, 4)
    with pytest.raises(UsageError, match="duplicate episode ids \\[2\\]"):
        shard.lpt_partition([2, 2, 3], [1, 1, 1], 2)
    with pytest.raises(UsageError, match="negative"):
        shard.lpt_partition([1], [-1], 1)
    with pytest.raises(UsageError, match="rank 2"):
        shard.rank_share([1], [1], 2, 2)


@pytest.mark.parametrize(
    ("ids", "match"),
    [
        ([1, True], r"integers, got \[True\]"),
        ([1, 2.0], r"integers, got \[2.0\]"),
        ([3, 1, 3, 1], r"duplicate episode ids \[1, 3\]"),
        ([4, -2, -1], r"non-negative, got \[-2, -1\]"),
    ],
)
def test_one_episode_id_rule_for_selections_shards_and_planners(ids, match):
    with pytest.raises(EpisodeSelectionError, match=match):
        shard.episode_ids(ids, EpisodeSelectionError)
    with pytest.raises(UsageError, match=match):
        shard.lpt_partition(ids, [1] * len(ids), 2)
    with pytest.raises(UsageError, match=match):
        Planner(ids, [1] * len(ids), seed=1, epoch=0, rank=0, worker=0, pool_size=2)


def test_episode_ids_are_plain_ints():
    got = shard.episode_ids(np.array([5, 0, 9]))
    assert got == [5, 0, 9] and all(type(e) is int for e in got)


@pytest.mark.parametrize(
    ("workers", "pool", "budget", "cache", "cameras", "expected"),
    [
        (1, None, 1000, None, 2, (32, 1000, 64)),
        (3, None, 1000, None, 2, (11, 333, 22)),  # LeRobot's test: round(32 / 3) = 11
        (4, None, None, None, 0, (8, None, 1)),
        (5, None, 10, 7, 1, (6, 2, 1)),  # round(6.4) = 6
        (7, None, 7, None, 1, (5, 1, 5)),  # round(4.57) = 5
        (64, None, 64, None, 3, (1, 1, 3)),
        (100, None, 100, None, 1, (1, 1, 1)),
        (2, 9, 10, 8, 4, (9, 5, 4)),  # an explicit pool is already per worker
    ],
)
def test_split_limits(workers, pool, budget, cache, cameras, expected):
    limits = shard.split_limits(
        workers, pool_size=pool, byte_budget=budget, decoder_cache=cache, cameras=cameras
    )
    assert (limits.pool_size, limits.byte_budget, limits.decoder_cache) == expected


@pytest.mark.parametrize(
    "kwargs",
    [
        {"pool_size": 0, "byte_budget": None, "decoder_cache": None, "cameras": 1},
        {"pool_size": None, "byte_budget": 3, "decoder_cache": None, "cameras": 1},
        {"pool_size": None, "byte_budget": None, "decoder_cache": 0, "cameras": 1},
        {"pool_size": None, "byte_budget": None, "decoder_cache": None, "cameras": -1},
    ],
)
def test_split_limits_refuses_impossible_settings(kwargs):
    with pytest.raises(UsageError):
        shard.split_limits(4, **kwargs)


def _cases():
    return sorted(FIXTURES.glob("*.json"))


def test_shard_fixture_area_is_populated():
    assert len(_cases()) >= 10


@pytest.mark.parametrize("path", _cases(), ids=lambda p: p.stem)
def test_shard_fixtures(path):
    case = json.loads(path.read_text())
    if case["kind"] == "shard":
        assert expected_shard(case["input"]) == case["expected"]  # the oracle agrees
    answer = conformance.answer(case["kind"], case["input"])
    assert answer == case["expected"]
