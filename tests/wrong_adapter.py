"""Deliberately wrong implementations, one per point the specification settles: refstream's
adapter with that one rule answered another plausible way. Every case that pins the point must
fail under its variant (tests/test_conformance.py), which shows that the cases decide it.

    python3 tests/wrong_adapter.py POINT        # a protocol command, like refstream's adapter

e.g. ``python3 spec/run.py --impl "python3 ../../tests/wrong_adapter.py rng-index" --case
'rng/index-*'``. ``WRONG[point]`` is ``(cases, patch)``: ``patch(fix)`` makes the wrong choice
with ``fix.setattr`` / ``fix.setitem`` (pytest's monkeypatch, or plain assignment).
"""

from __future__ import annotations

import json
import operator
import sys
import types

import numpy as np
import pyarrow as pa

from refstream import meta, rng, sidecar
from refstream.errors import MalformedDataset, UsageError
from refstream.tools import adapters, conformance

WRONG: dict[str, tuple[tuple[str, ...], object]] = {}


def point(name: str, *cases: str):
    def register(patch):
        WRONG[name] = (cases, patch)
        return patch
    return register


def wrap_kind(fix, kind: str, wrapper) -> None:
    """Answer ``kind`` with ``wrapper(real_adapter, case)``."""
    real = adapters.ADAPTERS[kind]
    fix.setitem(adapters.ADAPTERS, kind, lambda case: wrapper(real, case))


@point("rng-index", "rng/index-negative", "rng/index-2-to-the-64", "rng/index-not-an-integer")
def index_reduced(fix):
    # An index reduced modulo 2^64 (and truncated to an integer) instead of refused.
    def u64(key, i):
        return rng.mix64(key + ((int(i) & rng.MASK64) + 1) * rng.GOLDEN_GAMMA)
    fix.setattr(rng, "u64", u64)


@point("rng-index-signed", "rng/index-top")
def index_signed(fix):
    # Indices held as signed 64-bit integers: 2^63 and above refused.
    real = rng.u64

    def u64(key, i):
        if i >= 1 << 63:
            raise UsageError("index beyond int64")
        return real(key, i)
    fix.setattr(rng, "u64", u64)


@point("rng-permute", "rng/permutation-duplicate-id", "rng/permutation-non-integer-id")
def permute_unchecked(fix):
    # Ids cast to int64 (1.5 becomes 1) and sorted with a repeated id kept.
    def permutation(key, ids):
        ids = np.asarray(ids, dtype=np.int64)
        if ids.size and ids.min() < 0:
            raise UsageError("negative id")
        return ids[np.lexsort((ids, rng.u64_array(key, ids)))]
    fix.setattr(rng, "permutation", permutation)


@point("info-json", "meta/malformed-info-nan-token", "meta/malformed-info-infinity-token",
       "meta/malformed-info-byte-order-mark")
def info_json_lenient(fix):
    # Python's json as it comes: NaN and Infinity read as floats, a byte-order mark skipped.
    def loads(text, **_):
        return json.loads(text.removeprefix("\ufeff"))
    fix.setattr(meta, "json", types.SimpleNamespace(loads=loads))


@point("video-path-absent", "meta/valid-no-cameras-video-path-absent")
def video_path_required(fix):
    # An absent video_path key is an error, though null is accepted.
    def load_meta(source):
        if "video_path" not in json.loads(source.read_bytes(meta.INFO_PATH)):
            raise MalformedDataset("video_path missing")
        return real(source)
    real = adapters.load_meta
    fix.setattr(adapters, "load_meta", load_meta)


@point("task-types", "meta/malformed-float-task-index",
       "meta/malformed-total-tasks-written-as-float")
def task_types_by_value(fix):
    # task_index and total_tasks judged by value: whole-number floats accepted.
    real_column, real_tasks = meta.index_column, meta._read_tasks

    def index_column(table, name, where):
        if name == "task_index" and pa.types.is_floating(table[name].type):
            table = table.set_column(table.schema.get_field_index(name), name,
                                     table[name].cast(pa.int64()))
        return real_column(table, name, where)

    def read_tasks(source, info):
        total = info.get("total_tasks")
        if isinstance(total, float) and total.is_integer():
            info = {**info, "total_tasks": int(total)}
        return real_tasks(source, info)
    fix.setattr(meta, "index_column", index_column)
    fix.setattr(meta, "_read_tasks", read_tasks)


@point("saved-seed-null", "resume/state-saved-seed-null")
def saved_null_seed_is_default(fix):
    # A saved seed of null read as the default seed 42.
    def answer(real, case):
        saved = case["saved"]
        return real({**case, "saved": {**saved, "seed": saved["seed"] or "42"}})
    wrap_kind(fix, "resume_state", answer)


@point("elastic-last", "resume/elastic-repeat-nothing-delivered",
       "resume/elastic-repeat-whole-epoch-delivered")
def elastic_lists_first(fix):
    # With repeat, epoch `first` is listed even when nothing of it was delivered.
    def elastic_epochs(delivered, repeat):
        return range(delivered.first, delivered.first + max(1, len(delivered.counts)))
    fix.setattr(adapters, "elastic_epochs", elastic_epochs)


@point("elastic-rest-without-batches", "resume/elastic-rest-without-batches")
def elastic_lists_next_epoch(fix):
    # Without repeat, a rest of B = 0 is passed over: the epoch the new workers start is listed.
    def elastic_epochs(delivered, repeat):
        return range(delivered.first, delivered.first + (len(delivered.counts) if repeat else 2))
    fix.setattr(adapters, "elastic_epochs", elastic_epochs)


@point("elastic-sizes-need-budget", "resume/elastic-sizes-without-budget")
def elastic_both_or_neither(fix):
    # Byte sizes without a budget refused, as the plan kind refuses them.
    def answer(real, case):
        if case.get("byte_sizes") is not None and case.get("byte_budget") is None:
            raise UsageError("byte_sizes without byte_budget")
        return real(case)
    wrap_kind(fix, "elastic_resume", answer)


@point("elastic-budget-needs-sizes", "resume/elastic-budget-without-sizes")
def elastic_budget_ignored(fix):
    # A budget without byte sizes silently ignored.
    def answer(real, case):
        if case.get("byte_sizes") is None:
            case = {key: value for key, value in case.items() if key != "byte_budget"}
        return real(case)
    wrap_kind(fix, "elastic_resume", answer)


@point("meta-escapes", "sidecar/identity-escapes")
def meta_in_raw_utf8(fix):
    # The record's meta written with every character as itself in UTF-8 (no \\u escapes).
    def dumps(value, **options):
        return json.dumps(value, ensure_ascii=False, **options)
    fix.setattr(sidecar, "json", types.SimpleNamespace(dumps=dumps, loads=json.loads))


class Assign:
    """``setattr`` and ``setitem`` for good, in a process that answers one case."""

    setattr = staticmethod(setattr)
    setitem = staticmethod(operator.setitem)


if __name__ == "__main__":
    WRONG[sys.argv[1]][1](Assign)
    sys.exit(conformance.main_adapter())
