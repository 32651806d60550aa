"""Resuming with another world size, worker count or batch size (SPEC §3.9), against brute force.

Every rank of every topology is simulated: its DataLoader (the in-order round robin of
``core_oracle.dataloader``) over the streams its workers would yield, for the batches the
checkpoint says each rank consumed. The anchors delivered that way are kept as sets per epoch;
the rest planned for the new topology must hold every other frame of each epoch in progress,
once. The conformance kind is checked against ``core_oracle.expected_elastic``, a separate
whole simulation written from the spec.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import replace
from itertools import islice
from pathlib import Path
from typing import NamedTuple

import pytest
from core_oracle import dataloader, expected_elastic, key_of, keyed_order, plan
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from refstream.errors import ShardingError, UsageError
from refstream.planner import Planner
from refstream.resume import (
    Course,
    Delivered,
    ResumeSetup,
    ResumeState,
    Segment,
    delivered_by,
    selection_digest,
)
from refstream.tools import adapters, conformance

FIXTURES = Path(__file__).resolve().parent.parent / "spec" / "fixtures" / "resume"


class Selection(NamedTuple):
    episodes: list[int]
    frames: list[int]
    sizes: dict[int, int] | None  # each episode's byte size, under a byte budget


# --- simulating every rank of a topology ------------------------------------------------------


def worker_stream(course: Course, sizes, rank: int, worker: int, epoch: int, offset: int,
                  stop: int | None):
    """The anchors ``(epoch, episode, frame)`` one logical worker yields, as the dataset's
    worker streams them: its plan from ``offset`` to ``stop``, then (repeat) later epochs."""
    while True:
        planner = course.planner(rank, worker, epoch, sizes)
        planner.skip(offset)
        taken = planner.remaining if stop is None else stop - offset
        yield from ((epoch, e, f) for e, f in islice(planner, taken))
        if not course.setup.repeat:
            return
        epoch, offset = epoch + 1, 0


def rank_batches(course: Course, sizes, rank: int, samples: int, limit: int | None):
    """The batches rank ``rank`` yields after ``samples``, up to ``limit``: DataLoader worker
    p plays logical worker (p + rotation) mod N. Without repeat an iterator is one epoch
    (``limit`` None: that epoch) and the next one starts afresh where it ended."""
    out: list = []
    while limit is None or len(out) < limit:
        start = course.positions(rank, samples + len(out) * course.setup.batch_size)
        workers = course.setup.num_workers
        streams = []
        for p in range(workers):
            w = (p + start.rotation) % workers
            streams.append(worker_stream(course, sizes, rank, w, start.epochs[w],
                                         start.offsets[w], start.stops[w]))
        left = None if limit is None else limit - len(out)
        got = [batch for _, batch in dataloader(streams, course.setup.batch_size,
                                                max_batches=left)]
        out += got
        if course.setup.repeat or limit is None or not got:
            break
    return out


def delivered_sets(state: ResumeState, selection: Selection) -> dict[int, list]:
    """Brute force: the anchors every rank delivered, per epoch, topology after topology."""
    seen: dict[int, list] = {}
    for i, segment in enumerate(state.history):
        setup = replace(state.setup, world_size=segment.world_size,
                        num_workers=segment.num_workers, batch_size=segment.batch_size)
        delivered = delivered_by(ResumeState(state.epoch, 0, setup, state.history[:i]),
                                 *selection)
        course = Course(setup, selection.episodes, selection.frames, delivered)
        for rank in range(segment.world_size):
            batches = segment.samples // segment.batch_size
            for batch in rank_batches(course, selection.sizes, rank, 0, batches):
                for e, x, f in batch:
                    seen.setdefault(e, []).append((x, f))
    return seen


def all_frames(selection: Selection) -> Counter:
    return Counter((e, f) for e, n in zip(selection.episodes, selection.frames, strict=True)
                   for f in range(n))


# --- random selections and topologies ---------------------------------------------------------


@st.composite
def topologies(draw):
    """World size 1-8, DataLoader workers 0-4 (0: iterated in the process, one logical
    worker), batch size 1-5."""
    return (draw(st.integers(1, 8)), max(1, draw(st.integers(0, 4))), draw(st.integers(1, 5)))


@st.composite
def elastic_cases(draw, max_history=3):
    chain = draw(st.lists(topologies(), min_size=2, max_size=max_history + 1))
    parts = max(w * n for w, n, _ in chain)
    count = draw(st.integers(parts, parts + 6))
    frames = draw(st.lists(st.integers(1, 4), min_size=count, max_size=count))
    ids = draw(st.permutations(range(count + 5)))[:count]
    repeat = draw(st.booleans())
    sizes = None
    budget = None
    if draw(st.booleans()):
        drawn = draw(st.lists(st.integers(0, 40), min_size=count, max_size=count))
        sizes = dict(zip(ids, drawn, strict=True))
        budget = 8 * (max(drawn) + 1) * draw(st.integers(1, 3))
    world, workers, batch = chain[-1]
    setup = ResumeSetup(seed=draw(st.integers(0, 2**64 - 1)),
                        strategy=draw(st.sampled_from(["pool", "round_robin"])),
                        pool_size=draw(st.sampled_from([None, 1, 2, 3])), byte_budget=budget,
                        world_size=world, num_workers=workers, batch_size=batch, repeat=repeat,
                        selection=selection_digest(ids, frames))
    total = sum(frames)
    history = []
    for world, workers, batch in chain[:-1]:
        batches = draw(st.integers(0, (2 * total if repeat else 3 * total) // batch // world + 2))
        history.append(Segment(world, workers, batch, batches * batch))
    state = ResumeState(draw(st.integers(0, 3)), 0, setup, tuple(history))
    return state, Selection(ids, frames, sizes)


def courses_or_reject(state: ResumeState, selection: Selection):
    try:
        delivered = delivered_by(state, *selection)
        return delivered, Course(state.setup, selection.episodes, selection.frames, delivered)
    except ShardingError:
        assume(False)  # a topology with an empty ordinary share is refused (test_shard)


# --- the properties -----------------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(elastic_cases())
def test_the_rest_holds_every_frame_the_old_topologies_did_not_deliver_once(case):
    state, selection = case
    delivered, course = courses_or_reject(state, selection)
    seen = delivered_sets(state, selection)
    for e, anchors in seen.items():
        assert len(anchors) == len(set(anchors)), f"epoch {e}: an anchor delivered twice"
    # What the checkpoint alone says was delivered is what the ranks delivered.
    for i, counts in enumerate(delivered.counts):
        got = Counter(x for x, _ in seen.get(delivered.first + i, []))
        assert dict(zip(selection.episodes, counts.tolist(), strict=True)) == {
            x: got[x] for x in selection.episodes}
    sizes, world, workers = selection.sizes, state.setup.world_size, state.setup.num_workers
    in_progress = range(delivered.first, delivered.first + max(1, len(delivered.counts)))
    if not state.setup.repeat:
        assert len(in_progress) == 1  # one epoch at a time
    for e in in_progress:  # the whole rest, before any distributed stop
        rest = [anchor for r in range(world) for w in range(workers)
                for anchor in course.planner(r, w, e, sizes)]
        assert Counter(seen.get(e, [])) + Counter(rest) == all_frames(selection), e
    if state.setup.repeat:  # the epochs before the first in progress were delivered whole
        for e in range(state.epoch, delivered.first):
            assert Counter(seen.get(e, [])) == all_frames(selection)
    else:  # the distributed end of an epoch holds for the rest too: every rank, same batches
        assert len({len(rank_batches(course, sizes, r, 0, None)) for r in range(world)}) == 1


@settings(max_examples=60, deadline=None)
@given(elastic_cases(max_history=2), st.integers(0, 40))
def test_a_checkpoint_taken_during_the_rest_resumes_exactly(case, batches):
    """The same topology again: the batches the uninterrupted run would have yielded next."""
    state, selection = case
    _, course = courses_or_reject(state, selection)
    sizes, world, batch = selection.sizes, state.setup.world_size, state.setup.batch_size
    horizon = batches + 8
    for rank in range(world):
        full = rank_batches(course, sizes, rank, 0, horizon)
        assert len(full) == horizon  # the rest, then ordinary epochs: never a dead end
        resumed = rank_batches(course, sizes, rank, batches * batch, horizon - batches)
        assert resumed == full[batches:]


@settings(max_examples=120, deadline=None)
@given(elastic_cases(max_history=2))
def test_conformance_answer_matches_the_whole_simulation_oracle(case):
    state, selection = case
    setup = state.setup
    case_input = {
        "episodes": selection.episodes, "frames": selection.frames, "seed": str(setup.seed),
        "strategy": setup.strategy, "pool_size": setup.pool_size, "repeat": setup.repeat,
        "epoch": state.epoch, "history": [list(vars(s).values()) for s in state.history],
        "world_size": setup.world_size, "num_workers": setup.num_workers,
        "batch_size": setup.batch_size,
    }
    if selection.sizes is not None:
        case_input |= {"byte_sizes": [selection.sizes[e] for e in selection.episodes],
                       "byte_budget": setup.byte_budget}
    assert adapters.answer("elastic_resume", case_input) == expected_elastic(case_input)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 9), min_size=1, max_size=7), st.data())
def test_planner_with_delivered_frames_plans_the_rest_of_each_keyed_order(frames, data):
    ids = list(range(len(frames)))
    delivered = [data.draw(st.integers(0, f)) for f in frames]
    kwargs = {"seed": data.draw(st.integers(0, 2**64 - 1)), "epoch": 1, "rank": 2, "worker": 1,
              "strategy": data.draw(st.sampled_from(["pool", "round_robin"])),
              "pool_size": data.draw(st.integers(1, 4))}
    planner = Planner(ids, frames, delivered=delivered, **kwargs)
    anchors = list(planner)
    steps = plan(ids, frames, delivered=delivered, **kwargs)
    assert anchors == [(s[1], s[2]) for s in steps if s[0] == "anchor"]
    for e, f in zip(ids, frames, strict=True):
        order = keyed_order(key_of(kwargs["seed"], 1, "frames", e), range(f))
        assert [y for x, y in anchors if x == e] == order[delivered[e]:]
    skip = data.draw(st.integers(0, len(anchors)))
    again = Planner(ids, frames, delivered=delivered, **kwargs)
    again.skip(skip)
    assert again.emitted() == dict(Counter(e for e, _ in anchors[:skip]))


def test_planner_refuses_impossible_delivered_counts():
    with pytest.raises(UsageError, match="episode 1 has 3 frames, 4 cannot be delivered"):
        Planner([0, 1], [2, 3], seed=0, epoch=0, rank=0, worker=0, pool_size=1,
                delivered=[0, 4])
    with pytest.raises(UsageError, match="2 episode ids but 1 delivered counts"):
        Planner([0, 1], [2, 3], seed=0, epoch=0, rank=0, worker=0, pool_size=1, delivered=[0])


def setup_of(episodes, frames, **settings) -> ResumeSetup:
    return ResumeSetup(**settings, selection=selection_digest(episodes, frames))


def test_replaying_a_budget_needs_the_byte_sizes():
    setup = setup_of([0, 1], [3, 3], seed=0, strategy="pool", pool_size=None, byte_budget=100,
                     world_size=1, num_workers=1, batch_size=2, repeat=False)
    with pytest.raises(UsageError, match="byte sizes"):
        delivered_by(ResumeState(0, 0, setup, (Segment(1, 1, 2, 2),)), [0, 1], [3, 3])


def test_nothing_delivered_plans_the_ordinary_epoch():
    """Resuming at an epoch's start with another topology is that topology's own epoch."""
    episodes, frames = list(range(9)), [5, 3, 4, 2, 6, 1, 3, 4, 2]
    setup = setup_of(episodes, frames, seed=5, strategy="pool", pool_size=None,
                     byte_budget=None, world_size=2, num_workers=2, batch_size=3, repeat=True)
    delivered = delivered_by(ResumeState(2, 0, setup, (Segment(3, 2, 4, 0),)), episodes, frames)
    assert delivered == Delivered(2)
    course = Course(setup, episodes, frames, delivered)
    assert course.positions(1, 0).epochs == (2, 2)
    share = course.episodes_from(1, 0, 2)  # nothing in progress: the ordinary epoch's share
    plain = Planner(share, [frames[e] for e in share],
                    seed=5, epoch=2, rank=1, worker=0, pool_size=16)
    assert list(course.planner(1, 0, 2, None)) == list(plain)


# --- conformance fixtures -----------------------------------------------------------------------


def _elastic_cases():
    return sorted(p for p in FIXTURES.glob("elastic-*.json"))


def test_elastic_fixtures_are_there():
    assert len(_elastic_cases()) >= 8


@pytest.mark.parametrize("path", _elastic_cases(), ids=lambda p: p.stem)
def test_elastic_fixtures(path):
    case = json.loads(path.read_text())
    assert expected_elastic(case["input"]) == case["expected"]  # the oracle agrees
    assert conformance.answer(case["kind"], case["input"]) == case["expected"]
