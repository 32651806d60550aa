"""refstream's answers to the conformance kinds (``spec/README.md``): ``kind_NAME`` maps the
``input`` of a case of kind NAME (defined where SPEC says ``kind NAME``) to its answer, and
:func:`answer`, which the runner calls, picks the function.

Inputs arrive in the protocol's encoding (``spec/README.md``, "Encoding"): the adapters decode
the 64-bit fields written as decimal strings (:func:`decode_u64`, :func:`decode_label`) before
calling the library, and encode such answers back.
"""

from __future__ import annotations

import email.utils
import hashlib
import io
import json
import os
import re
import tempfile
from itertools import islice
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from requests.structures import CaseInsensitiveDict

from refstream import hub, mp4, resume, rng, shard, sidecar, source, synth, tables
from refstream.budget import ByteBudget
from refstream.errors import BudgetError, MalformedDataset, RefstreamError, UsageError, check_int
from refstream.http import Accept, FallBack, HTTPSource, Retry, judge_response
from refstream.meta import load_meta, select_episodes
from refstream.planner import Planner
from refstream.tools.doctor import episode_tiling
from refstream.windows import make_windows, window_rows

# The fixtures of a source checkout: <repo>/spec/fixtures (absent from an installed package).
FIXTURES_DIR = Path(__file__).resolve().parents[2] / "spec" / "fixtures"

# The kinds whose input names a media file (``file``, relative to the fixtures folder).
MEDIA_KINDS = frozenset({"mp4_index", "span", "synth"})


def answer(kind: str, case_input: dict, fixtures: Path = FIXTURES_DIR) -> dict:
    """refstream's own answer to one case; refstream errors become ``{"error": name}``.
    A media file the case names is read from ``fixtures``."""
    adapter = ADAPTERS.get(kind)
    if adapter is None:
        return {"error": f"unknown kind {kind!r}"}
    if kind in MEDIA_KINDS:
        case_input = {**case_input, "file": str(Path(fixtures) / case_input["file"])}
    try:
        return adapter(case_input)
    except RefstreamError as exc:
        return {"error": type(exc).__name__}


# --- the protocol's 64-bit fields --------------------------------------------------------------

_DECIMAL = re.compile(r"-?[0-9]+")


def decode_u64(value):
    """A 64-bit field (``spec/README.md``, "Encoding"): a decimal string is that integer; any
    other value is handed on (a number as its binary64 value) for the rule under test to refuse."""
    if isinstance(value, str) and _DECIMAL.fullmatch(value):
        return int(value)
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return value


def decode_label(label):
    """An RNG label: ``{"int": decimal}`` is an integer label, a string is a string label; any
    other JSON value is handed on (as :func:`decode_u64` does) for :func:`derive_key` to refuse."""
    if isinstance(label, dict) and set(label) == {"int"}:
        return decode_u64(label["int"])
    return label if isinstance(label, str) else decode_u64(label)


def kind_rng(case: dict) -> dict:
    seed = decode_u64(case["seed"])
    key = rng.derive_key(rng.resolve_seed(seed), *(decode_label(label) for label in case["labels"]))
    indices = [decode_u64(i) for i in case["indices"]]
    below_n = decode_u64(case["below_n"])
    return {"key": f"0x{key:016x}", "u64": [f"0x{rng.u64(key, i):016x}" for i in indices],
            "below": [str(rng.below(below_n, key, i)) for i in indices],
            "permutation": rng.permutation(key, case["permute"]).tolist()}


def kind_shard(case: dict) -> dict:
    ids, frames = case["episodes"], case["frames"]
    count = dict(zip(ids, frames, strict=True))
    # max(1, …): a world size of 0 reaches rank_share, which refuses it (SPEC §2.2).
    ranks = [shard.rank_share(ids, frames, r, case["world_size"])
             for r in range(max(1, case["world_size"]))]
    workers = [shard.worker_shares(r, [count[e] for e in r], case["num_workers"]) for r in ranks]
    return {"ranks": ranks, "rank_frames": [sum(count[e] for e in r) for r in ranks],
            "workers": workers,
            "worker_frames": [[sum(count[e] for e in w) for w in r] for r in workers]}


def kind_limits(case: dict) -> dict:
    limits = shard.split_limits(case["num_workers"], **{name: case[name] for name in (
        "pool_size", "byte_budget", "decoder_cache", "cameras")})
    return {name: getattr(limits, name) for name in ("pool_size", "byte_budget", "decoder_cache")}


def kind_plan(case: dict) -> dict:
    planner = Planner(case["episodes"], case["frames"], seed=decode_u64(case["seed"]),
                      epoch=case["epoch"], rank=case["rank"], worker=case["worker"],
                      strategy=case["strategy"], pool_size=case["pool_size"],
                      pool_ramp=case.get("pool_ramp", 0),
                      byte_sizes=case.get("byte_sizes"), byte_budget=case.get("byte_budget"),
                      delivered=case.get("delivered"))
    planner.skip(case.get("skip", 0))
    frontier = planner.frontier(case.get("frontier", 0))
    anchors = [list(anchor) for anchor in planner]
    admitted, evicted = planner.drain_events()
    return {"anchors": anchors, "frontier": frontier, "admitted": admitted, "evicted": evicted}


# The argument refusals of SPEC §3.6-3.7 that the library's callers never reach are checked here.


def kind_batches_per_worker(case: dict) -> dict:
    check_int(case["batches"], "batches", 0)
    if not case["limits"]:
        raise UsageError("batches_per_worker needs at least one worker")
    counts, next_worker = resume.batches_per_worker(case["batches"], case["limits"])
    return {"counts": counts, "next": next_worker}


def kind_resume(case: dict) -> dict:
    frames, batch_size = case["worker_frames"], check_int(case["batch_size"], "batch_size", 1)
    rank_batches = case.get("rank_batches")
    if not frames or min(frames) < 1:
        raise UsageError(f"every worker share needs frames, got {frames}")
    most = sum(shard.ceil_div(f, batch_size) for f in frames)  # every worker's batches
    if rank_batches is not None and not 1 <= rank_batches <= most:
        raise UsageError(f"rank_batches {rank_batches} is not an epoch of these workers")
    positions = resume.resume_positions(frames, batch_size, epoch=case["epoch"],
                                        samples=case["samples"], repeat=case["repeat"],
                                        rank_batches=rank_batches)
    return {"epochs": list(positions.epochs), "offsets": list(positions.offsets),
            "stops": list(positions.stops), "rotation": positions.rotation}


def kind_epoch_batches(case: dict) -> dict:
    check_int(case["batch_size"], "batch_size", 1)
    if not case["world_worker_frames"]:
        raise UsageError("epoch_batches needs at least one rank")
    return {"batches": resume.epoch_batches(case["world_worker_frames"], case["batch_size"])}


def kind_resume_state(case: dict) -> dict:
    """Kind ``resume_state`` (SPEC §3.8). Both seeds are 64-bit fields."""
    saved = dict(case["saved"])
    if "seed" in saved:
        saved["seed"] = decode_u64(saved["seed"])
    current = resume.ResumeSetup(**{**case["current"], "seed": decode_u64(case["current"]["seed"])})
    state = resume.ResumeState.from_dict(saved).resume_with(current)
    return {"epoch": state.epoch, "samples": state.samples, "history": state.to_dict()["history"]}


def kind_elastic_resume(case: dict) -> dict:
    """Kind ``elastic_resume`` (SPEC §3.9). The seed is a 64-bit field."""
    episodes, frames, sizes = case["episodes"], case["frames"], case.get("byte_sizes")
    setup = resume.ResumeSetup(
        seed=rng.resolve_seed(decode_u64(case["seed"])), strategy=case["strategy"],
        pool_size=case["pool_size"], pool_ramp=case.get("pool_ramp", 0),
        byte_budget=case.get("byte_budget"), world_size=case["world_size"],
        num_workers=case["num_workers"], batch_size=case["batch_size"], repeat=case["repeat"],
        selection=resume.selection_digest(episodes, frames))
    history = tuple(resume.Segment(*segment) for segment in case["history"])
    by_episode = None if sizes is None else dict(zip(episodes, sizes, strict=True))
    state = resume.ResumeState(case["epoch"], 0, setup, history)
    delivered = resume.delivered_by(state, episodes, frames, by_episode)
    course = resume.Course(setup, episodes, frames, delivered)
    listed = elastic_epochs(delivered, case["repeat"])
    workers = []
    for rank in range(case["world_size"]):
        start, row = course.positions(rank, 0), []
        for worker in range(case["num_workers"]):
            epoch, anchors = start.epochs[worker], []
            for at in range(epoch, listed.stop):
                planner = course.planner(rank, worker, at, by_episode)
                planner.skip(start.offsets[worker] if at == epoch else 0)
                stop = start.stops[worker]
                taken = planner.remaining if stop is None else stop - start.offsets[worker]
                anchors += [[at, e, f] for e, f in islice(planner, taken)]
            row.append(anchors)
        workers.append(row)
    return {"first": delivered.first, "workers": workers}


def elastic_epochs(delivered: resume.Delivered, repeat: bool) -> range:
    """The epochs an ``elastic_resume`` answer lists (SPEC §3.9, Conformance): from the first in
    progress to the last with a frame delivered (none when nothing was) with ``repeat``, else
    the first alone."""
    return range(delivered.first, delivered.first + (len(delivered.counts) if repeat else 1))


# Arrow types a conformance case may give a Parquet column.
CASE_COLUMN_TYPES = {"int64": pa.int64(), "float64": pa.float64(), "string": pa.string(),
                     "list<string>": pa.list_(pa.string()), "list<float64>": pa.list_(pa.float64())}


class MemorySource:
    """A dataset held in memory as ``{relpath: bytes}`` (a ``meta`` case's files)."""

    def __init__(self, files: dict[str, bytes]) -> None:
        self.files = dict(files)

    def read_bytes(self, relpath: str) -> bytes:
        if source.check_relpath(relpath) not in self.files:
            raise MalformedDataset(f"{relpath}: missing from the dataset")
        return self.files[relpath]

    def read_if_present(self, relpath: str) -> bytes | None:
        return self.files.get(source.check_relpath(relpath))


def kind_meta(case: dict) -> dict:
    """Kind ``meta`` (SPEC §4.6): the case's files become the dataset's bytes."""
    meta = load_meta(MemorySource({path: _case_file(f) for path, f in case["files"].items()}))
    ids = [int(e) for e in meta.episode_index]
    answer = {name: getattr(meta, name) for name in (
        "fps", "camera_keys", "parquet_keys", "total_episodes", "total_frames", "tasks")}
    answer |= {
        "episode_index": ids, "frames": [meta.frames(e) for e in ids],
        "from_index": meta.from_index.tolist(), "to_index": meta.to_index.tolist(),
        "data_relpath": [meta.data_relpath(e) for e in ids],
        "video_relpath": {k: [meta.video_relpath(e, k) for e in ids] for k in meta.camera_keys},
        "video_from_s": {k: meta.video_from_s[k].tolist() for k in meta.camera_keys},
        "video_to_s": {k: meta.video_to_s[k].tolist() for k in meta.camera_keys},
    }
    if "select" in case:
        answer["selection"] = select_episodes(meta, case["select"])
    return answer


def _case_file(description: dict) -> bytes:
    """The bytes of one file of a ``meta`` case: JSON, text or a Parquet table."""
    if "json" in description:
        return json.dumps(description["json"]).encode()
    if "text" in description:
        return description["text"].encode()
    table = pa.table({name: pa.array(column["values"], CASE_COLUMN_TYPES[column["type"]])
                      for name, column in description["parquet"].items()})
    sink = io.BytesIO()
    pq.write_table(table, sink)
    return sink.getvalue()


def kind_windows(case: dict) -> dict:
    windows = make_windows(case["delta_timestamps"], case["fps"], case["tolerance_s"],
                           feature_keys=case.get("feature_keys"))
    per_key = {key: [window_rows(offsets, frame, case["length"]) for frame in case["frames"]]
               for key, offsets in windows.items()}
    return {"offsets": {key: offsets.tolist() for key, offsets in windows.items()},
            "rows": {key: [rows.tolist() for rows, _ in got] for key, got in per_key.items()},
            "is_pad": {key: [pad.tolist() for _, pad in got] for key, got in per_key.items()}}


def kind_range_response(case: dict) -> dict:
    decision = _judge(case, first_last=(case["first"], case["last"]))
    return _decision_answer(decision, ("body_bytes", "skip_bytes", "file_size"))


def kind_suffix_response(case: dict) -> dict:
    decision = _judge(case, suffix=case["length"])
    return _decision_answer(decision, ("body_bytes", "skip_bytes", "file_size", "answer_bytes"))


def _judge(case: dict, **asked) -> Accept | Retry | FallBack:
    """:func:`judge_response` on a fetch case; its ``now`` (an HTTP date) fixes the clock."""
    now = case.get("now")
    return judge_response(
        case["status"], CaseInsensitiveDict(case["headers"]), **asked,
        known_size=case["known_size"], whole_body_cap_bytes=case["whole_body_cap_bytes"],
        where="case", now=None if now is None else email.utils.parsedate_to_datetime(now))


def _decision_answer(decision: Accept | Retry | FallBack, fields: tuple[str, ...]) -> dict:
    """A response-judging decision as the fetch kinds answer it (``fields`` of an Accept)."""
    if isinstance(decision, Retry):
        return {"retry": True, "retry_after_s": decision.after_s}
    if isinstance(decision, FallBack):
        return {"fallback": True}
    return {name: getattr(decision, name) for name in fields}


def kind_hf_url(case: dict) -> dict:
    hf, endpoint = hub.parse_hf_root(case["root"]), hub.hub_endpoint(case["endpoint"])
    api_url = hf.revision_api_url(endpoint)
    commit = case["commit"] if api_url is not None else hf.revision
    url = HTTPSource(hf.base_url(endpoint, commit)).url(case["relpath"])
    identity = None if hf.kind == "buckets" else f"commit:{commit}"
    return {"revision_api_url": api_url, "url": url, "identity": identity}


def kind_hub_target(case: dict) -> dict:
    expiry = hub.target_expiry(case["target"], case["issued"])
    return {"expiry": expiry, "resolve": hub.resolve_again(expiry, case["now"])}


def kind_row_group_candidates(case: dict) -> dict:
    stats = [None if s is None else (int(s[0]), int(s[1])) for s in case["stats"]]
    return {"candidates": tables.candidate_row_groups(stats, int(case["episode"]))}


def kind_budget_ops(case: dict) -> dict:
    """Kind ``budget_ops`` (SPEC §8.7); ``acquire`` gets a zero timeout, so it never waits."""
    budget = ByteBudget(case["budget_bytes"])
    calls = {
        "try_reserve": lambda e, n: budget.try_reserve(e, n),
        "reserve_in_room": lambda e, n: budget.reserve_in_room(e, n),
        "touch": lambda e, n: budget.touch([e]),
        "acquire": lambda e, n: budget.acquire(e, n, timeout_s=0),
        "release": lambda e, n: budget.release(e),
        "claim_fetch": lambda e, n: budget.claim_fetch(e),
        "mark_resident": lambda e, n: budget.mark_resident(e, n),
        "mark_fetched": lambda e, n: budget.mark_fetched(e),
        "forget": lambda e, n: budget.forget(e),
        "close": lambda e, n: budget.close(),
    }
    results, evicted = [], []
    for name, episode, *size in case["ops"]:
        try:
            results.append(calls[name](episode, size[0] if size else 0))
        except (BudgetError, UsageError) as exc:
            results.append({"error": type(exc).__name__})
        evicted.append(budget.take_evicted())
    table = budget.reservations()
    return {"results": results, "evicted": evicted, "lru": list(table),
            "reserved_bytes": sum(r.size_bytes for r in table.values()),
            "resident_bytes": sum(r.resident_bytes for r in table.values()),
            "leases": sum(r.leases for r in table.values())}


def kind_frame_select(case: dict) -> dict:
    num, den = case["time_base"]
    pts_ticks = np.array(sorted(case["pts"]), dtype=np.int64)
    chosen = synth.select_frames(pts_ticks * num, den, np.array(case["times_s"], np.float64),
                                 case["tolerance_s"])
    return {"pts": [int(pts_ticks[j]) for j in chosen]}


def kind_sidecar_record(case: dict) -> dict:
    fields = case["index"]
    identity = case.get("identity")
    if identity is None:  # the identity of a local file of that size and mtime
        with tempfile.TemporaryDirectory() as folder:
            with open(Path(folder) / "video.mp4", "wb") as handle:
                handle.truncate(fields["file_size"])
            mtime_ns = int(case["local_mtime_ns"])  # a 64-bit field: a decimal string
            os.utime(Path(folder) / "video.mp4", ns=(mtime_ns, mtime_ns))
            identity = source.LocalSource(folder).identity("video.mp4")
    index = mp4.SampleIndex(
        path="case", file_size=fields["file_size"], ftyp=bytes.fromhex(fields["ftyp"]),
        stsd=bytes.fromhex(fields["stsd"]),
        **{name: fields[name] for name in sidecar.SCALAR_FIELDS},
        **{name: np.array(fields[name], bool if name == "keyframe" else np.int64)
           for name in sidecar.ARRAY_FIELDS})
    record = np.load(io.BytesIO(sidecar.record_bytes(index, identity)), allow_pickle=False)
    arrays = b"".join(record[name][0].tobytes() for name in record.dtype.names[2:])
    return {"identity": identity, "name": sidecar.record_name(index.file_size, identity),
            "fields": [[name, record.dtype[name].base.str, list(record.dtype[name].shape)]
                       for name in record.dtype.names],
            "meta": json.loads(record["meta"][0].tobytes()),
            "arrays_sha256": hashlib.sha256(arrays).hexdigest()}


def _media_index(case_input: dict) -> tuple[bytes, mp4.SampleIndex]:
    data = Path(case_input["file"]).read_bytes()
    return data, mp4.parse_index(lambda at, n: data[at : at + n], len(data), case_input["file"])


def kind_mp4_index(case_input: dict) -> dict:
    _, index = _media_index(case_input)
    scalars = ("codec", "width", "height", "track_id", "timescale")
    return ({name: getattr(index, name) for name in scalars}
            | {name: getattr(index, name).tolist() for name in sidecar.ARRAY_FIELDS})


def kind_span(case_input: dict) -> dict:
    _, index = _media_index(case_input)
    times = case_input.get("request_times_s")
    request_times_s = None if times is None else np.asarray(times, float)
    span = synth.select_span(index, case_input["from_s"], case_input["to_s"],
                             case_input["tolerance_s"], request_times_s)  # fmt: skip
    fields = ("sample_lo", "sample_hi", "byte_offset", "byte_length", "start_pts")
    return {name: getattr(span, name) for name in fields}


def kind_synth(case_input: dict) -> dict:
    file, index = _media_index(case_input)
    span = synth.span_of(index, case_input["sample_lo"], case_input["sample_hi"])
    payload = file[span.byte_offset : span.byte_offset + span.byte_length]
    data = synth.synthesize(index, span, payload)
    return {"synthesized_size": synth.synthesized_size(index, span), "size": len(data),
            "sha256": hashlib.sha256(data).hexdigest()}  # fmt: skip


def kind_doctor_tiling(case: dict) -> dict:
    tiling = episode_tiling(*(np.asarray(case[k], np.int64)
                              for k in ("episode_index", "from_index", "to_index")),
                            int(case["total_frames"]))
    tiled = not tiling.gaps and not tiling.overlaps and tiling.covered_to == case["total_frames"]
    return {"gaps": [list(gap) for gap in tiling.gaps], "covered_to": tiling.covered_to,
            "overlaps": [list(overlap) for overlap in tiling.overlaps], "tiled": tiled}


def kind_doctor_requests(case: dict) -> dict:
    times_s = np.asarray(case["times_s"], np.float64)
    served = synth.serving_samples(np.asarray(case["pts"], np.int64), int(case["timescale"]),
                                   times_s, float(case["tolerance_s"]))
    return {"unserved": served.unserved(len(times_s)).tolist()}


def kind_frame_rate(case: dict) -> dict:
    spacing = synth.check_frame_rate(np.asarray(case["pts"], np.int64), int(case["timescale"]),
                                     case["fps"], "video")
    return {"spacing_ticks": None if np.isnan(spacing) else spacing}


# Kind NAME is answered by kind_NAME.
ADAPTERS = {name.removeprefix("kind_"): adapter for name, adapter in list(globals().items())
            if name.startswith("kind_")}
