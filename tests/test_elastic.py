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
from itertools import islice
from pathlib import Path

import pytest
from core_oracle import dataloader, expected_elastic, key_of, keyed_order, plan
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from refstream.errors import ShardingError, UsageError
from refstream.planner import Planner
from refstream.resume import Course, Delivered, Order, Segment, delivered_by
from refstream.tools import adapters, conformance

FIXTURES = Path(__file__).resolve().parent.parent / "spec" / "fixtures" / "resume"


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
        if not course.order.repeat:
            return
        epoch, offset = epoch + 1, 0


def rank_batches(course: Course, sizes, rank: int, samples: int, limit: int | None):
    """The batches rank ``rank`` yields after ``samples``, up to ``limit``: DataLoader worker
    p plays logical worker (p + rotation) mod N. Without repeat an iterator is one epoch
    (``limit`` None: that epoch) and the next one starts afresh where it ended."""
    out: list = []
    while limit is None or len(out) < limit:
        start = course.positions(rank, samples + len(out) * course.batch_size)
        workers = course.num_workers
        streams = []
        for p in range(workers):
            w = (p + start.rotation) % workers
            streams.append(worker_stream(course, sizes, rank, w, start.epochs[w],
                                         start.offsets[w], start.stops[w]))
        left = None if limit is None else limit - len(out)
        got = [batch for _, batch in dataloader(streams, course.batch_size, max_batches=left)]
        out += got
        if course.order.repeat or limit is None or not got:
            break
    return out


def delivered_sets(order: Order, epoch: int, history: list[Segment]) -> dict[int, list]:
    """Brute force: the anchors every rank delivered, per epoch, topology after topology."""
    sizes = _sizes(order)
    seen: dict[int, list] = {}
    for i, segment in enumerate(history):
        course = Course(order, delivered_by(order, epoch, history[:i]), segment.world_size,
                        segment.num_workers, segment.batch_size)
        for rank in range(segment.world_size):
            batches = segment.samples // segment.batch_size
            for batch in rank_batches(course, sizes, rank, 0, batches):
                for e, x, f in batch:
                    seen.setdefault(e, []).append((x, f))
    return seen


def all_frames(order: Order) -> Counter:
    return Counter((e, f) for e, n in zip(order.episodes, order.frames, strict=True)
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
        sizes = tuple(draw(st.lists(st.integers(0, 40), min_size=count, max_size=count)))
        budget = 8 * (max(sizes) + 1) * draw(st.integers(1, 3))
    order = Order(tuple(ids), tuple(frames), seed=draw(st.integers(0, 2**64 - 1)),
                  strategy=draw(st.sampled_from(["pool", "round_robin"])),
                  pool_size=draw(st.sampled_from([None, 1, 2, 3])), byte_budget=budget,
                  repeat=repeat, byte_sizes=sizes)
    total = sum(frames)
    history = []
    for world, workers, batch in chain[:-1]:
        batches = draw(st.integers(0, (2 * total if repeat else 3 * total) // batch // world + 2))
        history.append(Segment(world, workers, batch, batches * batch))
    return order, draw(st.integers(0, 3)), history, chain[-1]


def courses_or_reject(order, epoch, history, new):
    try:
        delivered = delivered_by(order, epoch, history)
        return delivered, Course(order, delivered, *new)
    except ShardingError:
        assume(False)  # a topology with an empty ordinary share is refused (test_shard)


# --- the properties -----------------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(elastic_cases())
def test_the_rest_holds_every_frame_the_old_topologies_did_not_deliver_once(case):
    order, epoch, history, new = case
    delivered, course = courses_or_reject(order, epoch, history, new)
    seen = delivered_sets(order, epoch, history)
    for e, anchors in seen.items():
        assert len(anchors) == len(set(anchors)), f"epoch {e}: an anchor delivered twice"
    # What the checkpoint alone says was delivered is what the ranks delivered.
    for i, counts in enumerate(delivered.counts):
        got = Counter(x for x, _ in seen.get(delivered.first + i, []))
        assert dict(zip(order.episodes, counts.tolist(), strict=True)) == {
            x: got[x] for x in order.episodes}
    sizes = _sizes(order)
    world, workers, _ = new
    in_progress = range(delivered.first, delivered.first + max(1, len(delivered.counts)))
    if not order.repeat:
        assert len(in_progress) == 1  # one epoch at a time
    for e in in_progress:  # the whole rest, before any distributed stop
        rest = [anchor for r in range(world) for w in range(workers)
                for anchor in course.planner(r, w, e, sizes)]
        assert Counter(seen.get(e, [])) + Counter(rest) == all_frames(order), e
    if order.repeat:  # the epochs before the first in progress were delivered whole
        for e in range(epoch, delivered.first):
            assert Counter(seen.get(e, [])) == all_frames(order)
    else:  # the distributed end of an epoch holds for the rest too: every rank, same batches
        assert len({len(rank_batches(course, sizes, r, 0, None)) for r in range(world)}) == 1


def _sizes(order: Order) -> dict[int, int] | None:
    if order.byte_sizes is None:
        return None
    return dict(zip(order.episodes, order.byte_sizes, strict=True))


@settings(max_examples=60, deadline=None)
@given(elastic_cases(max_history=2), st.integers(0, 40))
def test_a_checkpoint_taken_during_the_rest_resumes_exactly(case, batches):
    """The same topology again: the batches the uninterrupted run would have yielded next."""
    order, epoch, history, new = case
    _, course = courses_or_reject(order, epoch, history, new)
    sizes = _sizes(order)
    world, _, batch = new
    horizon = batches + 8
    for rank in range(world):
        full = rank_batches(course, sizes, rank, 0, horizon)
        assert len(full) == horizon  # the rest, then ordinary epochs: never a dead end
        resumed = rank_batches(course, sizes, rank, batches * batch, horizon - batches)
        assert resumed == full[batches:]


@settings(max_examples=120, deadline=None)
@given(elastic_cases(max_history=2))
def test_conformance_answer_matches_the_whole_simulation_oracle(case):
    order, epoch, history, new = case
    world, workers, batch = new
    case_input = {
        "episodes": list(order.episodes), "frames": list(order.frames), "seed": str(order.seed),
        "strategy": order.strategy, "pool_size": order.pool_size, "repeat": order.repeat,
        "epoch": epoch, "history": [list(vars(s).values()) for s in history],
        "world_size": world, "num_workers": workers, "batch_size": batch,
    }
    if order.byte_sizes is not None:
        case_input |= {"byte_sizes": list(order.byte_sizes), "byte_budget": order.byte_budget}
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


def test_replaying_a_budget_needs_the_byte_sizes():
    order = Order((0, 1), (3, 3), seed=0, strategy="pool", pool_size=None, byte_budget=100,
                  repeat=False)
    with pytest.raises(UsageError, match="byte sizes"):
        delivered_by(order, 0, [Segment(1, 1, 2, 2)])


def test_nothing_delivered_plans_the_ordinary_epoch():
    """Resuming at an epoch's start with another topology is that topology's own epoch."""
    order = Order(tuple(range(9)), (5, 3, 4, 2, 6, 1, 3, 4, 2), seed=5, strategy="pool",
                  pool_size=None, byte_budget=None, repeat=True)
    delivered = delivered_by(order, 2, [Segment(3, 2, 4, 0)])
    assert delivered == Delivered(2)
    course = Course(order, delivered, 2, 2, 3)
    assert course.positions(1, 0).epochs == (2, 2)
    plain = Planner(course.share(1, 0, 2), [order.frames[e] for e in course.share(1, 0, 2)],
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
