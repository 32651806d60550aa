"""Independent, deliberately plain re-implementations of the spec's RNG, sharding, planner,
DataLoader batch order and elastic resume (whole simulations of every rank, kept as sets of
delivered anchors) — the oracles the core tests and the rng/shard/plan/resume fixtures are
checked against. Written from ``spec/SPEC.md`` §1–§3, sharing no code
with ``refstream``: Python integers only, lists instead of heaps and deques, whole simulations.

``python3 tests/core_oracle.py`` (re)writes the fixtures of those areas from these oracles.
"""

from __future__ import annotations

import json
import re
import struct
import sys
from pathlib import Path

M64 = 2**64


# --- RNG ----------------------------------------------------------------------------------------


def finalise(z: int) -> int:
    z %= M64
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 % M64
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB % M64
    return z ^ (z >> 31)


def words_of(label) -> list[int]:
    if isinstance(label, int):
        return [1, label % M64]
    raw = label.encode("utf-8")
    padded = raw + b"\0" * (-len(raw) % 8)
    chunks = [padded[j : j + 8] for j in range(0, len(padded), 8)]
    return [2, len(raw)] + [struct.unpack("<Q", chunk)[0] for chunk in chunks]


def key_of(seed: int, *labels) -> int:
    k = seed
    for label in labels:
        for w in words_of(label):
            k = finalise((k ^ w) + 0x9E3779B97F4A7C15)
    return k


def word(key: int, i: int) -> int:
    return finalise(key + (i + 1) * 0x9E3779B97F4A7C15)


def draw_below(n: int, key: int, i: int) -> int:
    return word(key, i) * n // M64


def keyed_order(key: int, ids) -> list[int]:
    return sorted(ids, key=lambda i: (word(key, i), i))


# --- sharding -------------------------------------------------------------------------------------


def lpt(ids, frames, parts: int) -> list[list[int]]:
    shards = [[] for _ in range(parts)]
    load = [0] * parts
    items = [e for e in zip(ids, frames, strict=True) if e[1] > 0]
    items.sort(key=lambda e: (-e[1], e[0]))
    for episode, count in items:
        target = min(range(parts), key=lambda p: (load[p], p))
        shards[target].append(episode)
        load[target] += count
    return shards


# --- planner ------------------------------------------------------------------------------------


def plan(episodes, frames, *, seed, epoch, rank, worker, strategy, pool_size,
         byte_sizes=None, byte_budget=None, delivered=None, pool_ramp=0):
    """The whole epoch as a list of steps: ("admit", e) / ("evict", e) / ("anchor", e, f).
    ``delivered[i]`` frames of episode i's keyed order were emitted before (SPEC §3.9); with a
    ``pool_ramp`` the pool holds one episode more every ``pool_ramp`` draws (SPEC §3.2)."""
    done = dict(zip(episodes, delivered or [0] * len(episodes), strict=True))
    count = {e: f for e, f in zip(episodes, frames, strict=True) if f - done[e] > 0}
    size = dict(zip(episodes, byte_sizes, strict=True)) if byte_sizes is not None else None
    pending = keyed_order(key_of(seed, epoch, "admit"), list(count))
    residents = []  # [episode, frame list in emission order, next position]
    steps = []

    def used_bytes():
        return sum(size[r[0]] for r in residents) if size is not None else 0

    def admit():
        capacity = pool_size if pool_ramp == 0 else min(pool_size, 1 + draw // pool_ramp)
        while len(residents) < capacity and pending:
            choice = None
            for e in pending:
                if size is None or size[e] <= byte_budget - used_bytes():
                    choice = e
                    break
            if choice is None:
                return
            pending.remove(choice)
            order = keyed_order(key_of(seed, epoch, "frames", choice), range(count[choice]))
            residents.append([choice, order, done[choice]])
            steps.append(("admit", choice))

    draw = 0
    admit()
    rounds = 0
    this_round = []
    while residents:
        if strategy == "pool":
            left = [len(r[1]) - r[2] for r in residents]
            t = draw_below(sum(left), key_of(seed, epoch, "draw", rank, worker), draw)
            index = 0
            while t >= left[index]:
                t -= left[index]
                index += 1
            chosen = residents[index]
        else:
            if not this_round:
                ids = [r[0] for r in residents]
                this_round = keyed_order(key_of(seed, epoch, "round", rank, worker, rounds), ids)
                rounds += 1
            episode = this_round.pop(0)
            chosen = next(r for r in residents if r[0] == episode)
        draw += 1
        steps.append(("anchor", chosen[0], chosen[1][chosen[2]]))
        chosen[2] += 1
        if chosen[2] == len(chosen[1]):
            residents.remove(chosen)
            steps.append(("evict", chosen[0]))
        admit()  # after every emission: an eviction or a grown pool lets episodes in
    return steps


def anchors_of(steps) -> list[tuple[int, int]]:
    return [(s[1], s[2]) for s in steps if s[0] == "anchor"]


# --- the DataLoader's in-order batch assembly --------------------------------------------------


def dataloader(worker_streams, batch_size: int, max_batches: int | None = None):
    """Batches an in-order DataLoader yields from per-worker sample iterables: worker p batches
    its own samples (last batch may be short), turns go 0, 1, …, a finished worker is dropped."""
    iterators = [iter(s) for s in worker_streams]
    alive = list(range(len(iterators)))
    batches = []
    turn = 0
    while alive and (max_batches is None or len(batches) < max_batches):
        p = alive[turn]
        batch = []
        for sample in iterators[p]:
            batch.append(sample)
            if len(batch) == batch_size:
                break
        if not batch:
            alive.pop(turn)
            if alive:
                turn %= len(alive)
            continue
        batches.append((p, batch))
        if len(batch) < batch_size:
            alive.pop(turn)  # a short batch means the worker's iterator is exhausted
            if alive:
                turn %= len(alive)
        else:
            turn = (turn + 1) % len(alive)
    return batches


def replay(k: int, limits):
    """batches_per_worker by simulation: workers yield limits[w] batches (None: endless); returns
    the batches each produced among the first k and the worker that produces batch k+1 (0 if
    none is left)."""
    streams = [range(limit) if limit is not None else _endless() for limit in limits]
    got = dataloader(streams, 1, max_batches=k + 1)
    counts = [0] * len(limits)
    for p, _ in got[:k]:
        counts[p] += 1
    return counts, (got[k][0] if len(got) > k else 0)


def _endless():
    i = 0
    while True:
        yield i
        i += 1


# --- elastic resume: every rank of every topology simulated, anchors kept as sets --------------


def worker_plans(inp, seen, epoch, world, workers):
    """[rank][worker] -> the anchors of that worker's plan in ``epoch``, planned over the frames
    not in ``seen`` (the anchors delivered in that epoch before)."""
    count = dict(zip(inp["episodes"], inp["frames"], strict=True))
    done = {e: sum(1 for (x, _) in seen if x == e) for e in count}
    for e in count:  # delivered frames are always the first of the episode's keyed order
        order = keyed_order(key_of(_seed(inp), epoch, "frames", e), range(count[e]))
        assert {(e, f) for f in order[: done[e]]} == {a for a in seen if a[0] == e}
    left = [count[e] - done[e] for e in inp["episodes"]]
    pool = inp["pool_size"] or max(1, (64 + workers) // (2 * workers))
    budget = inp.get("byte_budget")
    size = dict(zip(inp["episodes"], inp.get("byte_sizes") or [0] * len(count), strict=True))
    plans = []
    for r, rank_ids in enumerate(lpt(inp["episodes"], left, world)):
        rank_left = [count[e] - done[e] for e in rank_ids]
        row = []
        for w, ids in enumerate(lpt(rank_ids, rank_left, workers)):
            steps = plan(ids, [count[e] for e in ids], seed=_seed(inp), epoch=epoch, rank=r,
                         worker=w, strategy=inp["strategy"], pool_size=pool,
                         pool_ramp=inp.get("pool_ramp", 0),
                         byte_sizes=None if budget is None else [size[e] for e in ids],
                         byte_budget=None if budget is None else budget // workers,
                         delivered=[done[e] for e in ids])
            row.append([(epoch, e, f) for e, f in anchors_of(steps)])
        plans.append(row)
    return plans


def _seed(inp):
    return 42 if inp["seed"] is None else exact_integer(inp["seed"])


def run_topology(inp, first, seen, world, workers, batch, batches):
    """Every rank of one topology consumes ``batches`` batches from ``first`` on; returns the
    new (first, seen) where seen[epoch] is the set of anchors delivered in that epoch."""
    seen = {e: set(a) for e, a in seen.items()}
    if inp["repeat"]:
        seen_then, plans = {e: set(a) for e, a in seen.items()}, {}

        def endless(r, w):
            e = first
            while True:
                if e not in plans:
                    plans[e] = worker_plans(inp, seen_then.get(e, set()), e, world, workers)
                yield from plans[e][r][w]
                e += 1

        for r in range(world):
            got = dataloader([endless(r, w) for w in range(workers)], batch, max_batches=batches)
            for _, b in got:
                for e, x, f in b:
                    seen.setdefault(e, set()).add((x, f))
        total = sum(inp["frames"])
        first = min(e for e in range(first, first + 10**6) if len(seen.get(e, ())) < total)
        return first, {e: a for e, a in seen.items() if e >= first}
    while True:
        plans = worker_plans(inp, seen.get(first, set()), first, world, workers)
        per_rank = [dataloader(rank, batch) for rank in plans]
        common = min(len(got) for got in per_rank)  # the distributed end of an epoch
        if batches < common:
            for got in per_rank:
                for _, b in got[:batches]:
                    seen.setdefault(first, set()).update((x, f) for _, x, f in b)
            return first, {first: seen.get(first, set())}
        batches -= common
        first += 1


def expected_elastic(inp: dict) -> dict:
    """Every new worker's anchors of the rest of the epochs in progress (SPEC §3.9)."""
    if inp.get("byte_budget") is not None and inp.get("byte_sizes") is None:
        return {"error": "UsageError"}  # the old admissions cannot be replayed
    topologies = [*(h[:3] for h in inp["history"]),
                  (inp["world_size"], inp["num_workers"], inp["batch_size"])]
    for world, workers, _ in topologies:  # ordinary epochs need every share non-empty
        for rank_ids in lpt(inp["episodes"], inp["frames"], world):
            rank_frames = [dict(zip(inp["episodes"], inp["frames"], strict=True))[e]
                           for e in rank_ids]
            if not all(lpt(rank_ids, rank_frames, workers)):
                return {"error": "ShardingError"}
    first, seen = inp["epoch"], {}
    for world, workers, batch, samples in inp["history"]:
        first, seen = run_topology(inp, first, seen, world, workers, batch, samples // batch)
    world, workers, batch = topologies[-1]
    if inp["repeat"]:
        last = max([first - 1, *(e for e, a in seen.items() if a)])
        out = [[[] for _ in range(workers)] for _ in range(world)]
        for e in range(first, last + 1):
            for r, row in enumerate(worker_plans(inp, seen.get(e, set()), e, world, workers)):
                for w, anchors in enumerate(row):
                    out[r][w] += [list(a) for a in anchors]
        return {"first": first, "workers": out}
    plans = worker_plans(inp, seen.get(first, set()), first, world, workers)
    common = min(len(dataloader(rank, batch)) for rank in plans)
    out = []
    for rank in plans:  # each worker up to its stop: its anchors in the first `common` batches
        row = [[] for _ in rank]
        for w, b in dataloader(rank, batch)[:common]:
            row[w] += [list(a) for a in b]
        out.append(row)
    return {"first": first, "workers": out}


# --- fixtures ------------------------------------------------------------------------------------

FIXTURES = Path(__file__).resolve().parent.parent / "spec" / "fixtures"


def exact_integer(value):
    """A 64-bit field of the protocol: the integer a decimal string spells, else None."""
    return int(value) if isinstance(value, str) and re.fullmatch(r"-?[0-9]+", value) else None


def rng_label(label):
    """An RNG label of the protocol: ``{"int": decimal}`` or a string; None when refused."""
    if isinstance(label, str):
        return label
    if isinstance(label, dict) and set(label) == {"int"}:
        value = exact_integer(label["int"])
        if value is not None and -(2**63) <= value < M64:
            return value
    return None


def expected_rng(inp: dict) -> dict:
    seed = 42 if inp["seed"] is None else exact_integer(inp["seed"])
    labels = [rng_label(label) for label in inp["labels"]]
    below_n = exact_integer(inp["below_n"])
    indices = [exact_integer(i) for i in inp["indices"]]
    ids = inp["permute"]
    if (seed is None or not 0 <= seed < M64 or None in labels or below_n is None
            or not 1 <= below_n <= M64 or any(i is None or not 0 <= i < M64 for i in indices)
            or not all(type(i) is int and i >= 0 for i in ids) or len(set(ids)) != len(ids)):
        return {"error": "UsageError"}
    key = key_of(seed, *labels)
    return {
        "key": "0x" + format(key, "016x"),
        "u64": ["0x" + format(word(key, i), "016x") for i in indices],
        "below": [str(draw_below(below_n, key, i)) for i in indices],
        "permutation": keyed_order(key, inp["permute"]),
    }


def plan_refused(inp: dict) -> bool:
    """Whether the inputs break a rule of spec §3.1/§3.4 (UsageError)."""
    episodes, frames = inp["episodes"], inp["frames"]
    sizes, budget = inp.get("byte_sizes"), inp.get("byte_budget")
    seed = 42 if inp["seed"] is None else exact_integer(inp["seed"])
    return (
        len(set(episodes)) != len(episodes) or len(frames) != len(episodes)
        or min(episodes + frames, default=0) < 0 or seed is None or not 0 <= seed < M64
        or min(inp["epoch"], inp["rank"], inp["worker"]) < 0
        or inp["strategy"] not in ("pool", "round_robin") or inp["pool_size"] < 1
        or not (type(inp.get("pool_ramp", 0)) is int and inp.get("pool_ramp", 0) >= 0)
        or (sizes is None) != (budget is None)
        or (budget is not None and (budget < 1 or len(sizes) != len(episodes) or min(sizes) < 0))
        or not 0 <= inp.get("skip", 0) <= sum(frames)
    )


def expected_plan(inp: dict) -> dict:
    if plan_refused(inp):
        return {"error": "UsageError"}
    if inp.get("byte_sizes") is not None:
        for f, s in zip(inp["frames"], inp["byte_sizes"], strict=True):
            if f > 0 and s > inp["byte_budget"]:
                return {"error": "EpisodeTooLarge"}
    seed = 42 if inp["seed"] is None else exact_integer(inp["seed"])  # the default seed 42
    steps = plan(inp["episodes"], inp["frames"], seed=seed, epoch=inp["epoch"],
                 rank=inp["rank"], worker=inp["worker"], strategy=inp["strategy"],
                 pool_size=inp["pool_size"], byte_sizes=inp.get("byte_sizes"),
                 byte_budget=inp.get("byte_budget"), pool_ramp=inp.get("pool_ramp", 0))
    skip = inp.get("skip", 0)
    anchors = anchors_of(steps)
    # the frontier after `skip` anchors: pending episodes in admission order at that moment
    admitted_by_then = []
    seen = 0
    for s in steps:
        if s[0] == "anchor":
            if seen == skip:
                break
            seen += 1
        elif s[0] == "admit":
            admitted_by_then.append(s[1])
    order = keyed_order(key_of(seed, inp["epoch"], "admit"),
                        [e for e, f in zip(inp["episodes"], inp["frames"], strict=True) if f > 0])
    pending = [e for e in order if e not in admitted_by_then]
    return {
        "anchors": [list(a) for a in anchors[skip:]],
        "frontier": pending[: inp.get("frontier", 0)],
        "admitted": [s[1] for s in steps if s[0] == "admit"],
        "evicted": [s[1] for s in steps if s[0] == "evict"],
    }


def expected_shard(inp: dict) -> dict:
    ids, frames = inp["episodes"], inp["frames"]
    if (min(inp["world_size"], inp["num_workers"]) < 1 or len(set(ids)) != len(ids)
            or min(frames, default=0) < 0):
        return {"error": "UsageError"}
    count = dict(zip(ids, frames, strict=True))
    ranks = lpt(ids, frames, inp["world_size"])
    if any(not r for r in ranks):
        return {"error": "ShardingError"}
    workers = []
    for r in ranks:
        w = lpt(r, [count[e] for e in r], inp["num_workers"])
        if any(not part for part in w):
            return {"error": "ShardingError"}
        workers.append(w)
    return {
        "ranks": ranks,
        "rank_frames": [sum(count[e] for e in r) for r in ranks],
        "workers": workers,
        "worker_frames": [[sum(count[e] for e in w) for w in r] for r in workers],
    }


def expected_resume(inp: dict) -> dict:
    frames, b, epoch = inp["worker_frames"], inp["batch_size"], inp["epoch"]
    if b < 1:
        return {"error": "UsageError"}
    if epoch < 0 or inp["samples"] < 0 or inp["samples"] % b:
        return {"error": "ResumeError"}
    if not frames or min(frames) < 1:
        return {"error": "UsageError"}
    all_batches = sum(-(-f // b) for f in frames)
    if not inp["repeat"] and not 1 <= inp.get("rank_batches", all_batches) <= all_batches:
        return {"error": "UsageError"}
    k = inp["samples"] // b
    n = len(frames)
    if inp["repeat"]:
        def endless_epochs(w):
            e = epoch
            while True:
                for i in range(frames[w]):
                    yield (e, i)
                e += 1
        got = dataloader([endless_epochs(w) for w in range(n)], b, max_batches=k + 1)
        position = [(epoch, 0)] * n
        for p, batch in got[:k]:
            e, i = batch[-1]
            position[p] = (e + 1, 0) if i + 1 == frames[p] else (e, i + 1)
        return {"epochs": [e for e, _ in position], "offsets": [i for _, i in position],
                "stops": [None] * n, "rotation": got[k][0]}
    one_epoch = [range(f) for f in frames]
    per_epoch = inp.get("rank_batches", len(dataloader(one_epoch, b)))
    whole, k = divmod(k, per_epoch)
    got = dataloader(one_epoch, b)
    offsets, stops = [0] * n, [0] * n
    for index, (p, batch) in enumerate(got[:per_epoch]):
        stops[p] += len(batch)
        if index < k:
            offsets[p] += len(batch)
    return {"epochs": [epoch + whole] * n, "offsets": offsets, "stops": stops,
            "rotation": got[k][0] if k < len(got) else 0}


def expected_epoch_batches(inp: dict) -> dict:
    b = inp["batch_size"]
    if b < 1 or not inp["world_worker_frames"]:
        return {"error": "UsageError"}
    return {"batches": min(len(dataloader([range(f) for f in rank], b))
                           for rank in inp["world_worker_frames"])}


def expected_batches_per_worker(inp: dict) -> dict:
    if inp["batches"] < 0 or not inp["limits"]:
        return {"error": "UsageError"}
    counts, nxt = replay(inp["batches"], inp["limits"])
    return {"counts": counts, "next": nxt}


ORACLES = {
    "rng": expected_rng,
    "plan": expected_plan,
    "shard": expected_shard,
    "resume": expected_resume,
    "epoch_batches": expected_epoch_batches,
    "batches_per_worker": expected_batches_per_worker,
    "elastic_resume": expected_elastic,
}

def _write(area: str, name: str, kind: str, description: str, inp: dict, expected: dict) -> None:
    folder = FIXTURES / area
    folder.mkdir(parents=True, exist_ok=True)
    document = {"kind": kind, "description": description, "input": inp, "expected": expected}
    (folder / f"{name}.json").write_text(json.dumps(document, indent=1) + "\n")


def write_fixtures(cases) -> None:
    """Write every case; an oracle computes the expectation, and must agree with any
    hand-derived one given in the case."""
    for area, name, kind, description, inp, expected in cases:
        if kind in ORACLES:
            computed = ORACLES[kind](inp)
            if expected is not None and expected != computed:
                raise AssertionError(f"{area}/{name}: hand-derived {expected} != oracle {computed}")
            expected = computed
        _write(area, name, kind, description, inp, expected)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from core_cases import CASES

    write_fixtures(CASES)
