"""Parser hardening: mutated real MP4 and sidecar files only ever raise ``refstream.errors``.

Three readers take bytes from outside and are fuzzed here with hypothesis:

* ``refstream.mp4.parse_index`` through a ``read_range`` callable — the path streaming uses
  (``locate_moov``'s probes, then the moov) — over real MP4s from ``spec/fixtures/mp4``, with the
  mutations concentrated where the structure lives: bit flips inside ``moov``; 32/64-bit writes
  of hostile values into box sizes, versions and entry counts; truncation or garbage at box
  boundaries; a whole box removed or duplicated with every ancestor's size fixed, so the file
  stays well-formed but loses or doubles a table. (tests/test_mp4_fuzz.py by the MP4 engineer
  fuzzes ``parse_index_bytes`` with whole-file flips, field writes and truncations; this adds the
  streaming path and structural edits.)
* ``refstream.sidecar.read_record`` (a file's index record, as the main process checks it and a
  worker maps it): raw byte mutations of real records (flips in the header and meta, or
  anywhere; cuts), read with and without ``verify``; and records whose meta JSON has one leaf
  replaced by a hostile value or a key dropped, re-saved as a well-formed ``.npy``.
* the published index (a ZIP of records) as construction takes records from it: raw byte
  mutations of a real one, installed into a fresh cache.

Properties, for every input: the only exceptions are ``RefstreamError`` subclasses; what parses is
coherent (as many samples as the meta says, in the schema's dtypes; MP4 samples inside the
file); a record read with ``verify=True`` either fails or has exactly the original arrays, and a
record taken from a published index (its member CRC-checked, its digest verified) is exactly the
original; each input takes at most ``PER_INPUT_BOUND_S``; and every
``MEMORY_SAMPLE_EVERY``-th input is parsed again under ``tracemalloc`` and must peak under
``MEMORY_BOUND_BYTES``. The MP4 reader must also never ask for a byte outside the file.

Budget: ``BUDGET`` inputs per test, 22,000 in all plus ~650 exhaustive box edits (measured on the
shared 2-core box: parsing takes ~0.25 ms CPU per MP4 input and 0.1-0.7 ms per sidecar input,
hypothesis ~0.5 ms per example; the MP4 half ran in 25 s wall at load 5). ``--run-slow`` runs the
``slow`` variants with ``LONG_FACTOR`` times more, not derandomized; ``REFSTREAM_FUZZ_SCALE=k``
multiplies either. ``python tests/fuzz_atheris.py`` drives the same checks with atheris.

Longest runs so far (2026-11-29): MP4, atheris, 1,498,530 inputs in 600 s, no failure (peak RSS
478 MB with libFuzzer's corpus); MP4, these mutators without hypothesis, 80,000 inputs, no
failure; MP4, hypothesis at ``REFSTREAM_FUZZ_SCALE=5``, 62,500 inputs, no failure (a first try
hit a 0.58 s CPU outlier that did not reproduce — a garbage collection, now kept out of the
timing).
"""

from __future__ import annotations

import gc
import hashlib
import io
import json
import os
import random
import shutil
import struct
import time
import tracemalloc
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from refstream import sidecar
from refstream.errors import RefstreamError, SidecarInvalid
from refstream.mp4 import parse_index
from refstream.sidecar import ensure_index, read_record
from refstream.source import LocalSource
from refstream.tools.cli import export_index

MEDIA = Path(__file__).resolve().parents[1] / "spec" / "fixtures" / "mp4"
MP4_SEEDS = ("lerobot_av1", "lerobot_h264", "av1_g2", "h264_b", "h264_b_faststart",
             "h264_negcts", "h264_b_co64", "h264_b_largesize", "h264_audio", "h265_b",
             "h264_vfr", "h264_opengop", "h264_offset", "mpeg4")
SIDECAR_SEEDS = ("lerobot_av1", "av1_g2", "h264_b", "h264_negcts", "h265_b", "h264_vfr")
# Inputs per test in CI; together at least 20,000 mutated inputs per run.
BUDGET = {
    "mp4_moov_flips": 4000,
    "mp4_field_writes": 4000,
    "mp4_cut_or_pad": 2500,
    "mp4_box_edit": 2000,
    "record_bytes": 5000,
    "record_meta": 3000,
    "published_bytes": 3000,
}
LONG_FACTOR = 20  # --run-slow: 440,000 inputs, ~15 min
SCALE = float(os.environ.get("REFSTREAM_FUZZ_SCALE", "1"))
# CPU seconds of the parsing thread (wall time on a shared 2-core box swings by 100x); a typical
# input takes 0.2-3 ms, so a pathological loop shows long before this.
PER_INPUT_BOUND_S = 1.0
MEMORY_SAMPLE_EVERY = 25
MEMORY_BOUND_BYTES = 8 << 20  # inputs are ≤ 35 KB; a valid one peaks at ~0.3 MB
INTERESTING_32 = (0, 1, 7, 8, 9, 15, 16, 255, 0x7FFF, 0xFFFF, 0x7FFFFFFF, 0x80000000,
                  0xFFFFFFFE, 0xFFFFFFFF)
INTERESTING_64 = (0, 1, 8, 16, 48, 4096, 1 << 31, 1 << 32, 1 << 62, (1 << 63) - 1, 1 << 63,
                  (1 << 64) - 1)
MP4_CONTAINERS = {b"moov", b"trak", b"mdia", b"minf", b"stbl", b"edts", b"dinf", b"udta",
                  b"mvex"}

INPUTS: Counter = Counter()  # inputs parsed per test, so each test can prove its budget ran
SLOWEST = {"seconds": 0.0, "label": ""}


def fuzz_settings(examples: int, long_run: bool) -> settings:
    return settings(max_examples=max(1, int(examples * SCALE)), deadline=None,
                    derandomize=not long_run, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.filter_too_much])


# --- bounded parsing -----------------------------------------------------------------------


def bounded(label: str, parse, data: bytes) -> object | None:
    """``parse(data)``; None if it raised a RefstreamError. Anything else propagates (the test
    fails with that input). Checks the time bound and, on a sample, the memory bound."""
    INPUTS[label] += 1
    gc.disable()  # a full collection of hypothesis's heap is not the parser's time
    started = time.thread_time()
    try:
        result = parse(data)
    except RefstreamError:
        result = None
    finally:
        elapsed = time.thread_time() - started
        gc.enable()
    if elapsed > SLOWEST["seconds"]:
        SLOWEST.update(seconds=elapsed, label=label)
    assert elapsed <= PER_INPUT_BOUND_S, f"{label}: {elapsed:.3f} s CPU for one input"
    if INPUTS[label] % MEMORY_SAMPLE_EVERY == 0:
        tracemalloc.start()
        try:
            parse(data)
        except RefstreamError:
            pass
        finally:
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
        assert peak <= MEMORY_BOUND_BYTES, f"{label}: peak {peak:,} bytes for {len(data):,}"
    return result


# --- MP4: seeds, their box structure, and the check --------------------------------------------


@dataclass(frozen=True)
class FoundBox:
    offset: int
    header: int  # 8, or 16 with a 64-bit size
    size: int
    type: bytes
    ancestors: tuple[tuple[int, int], ...]  # (offset, header) of each enclosing box


def find_boxes(data: bytes) -> list[FoundBox]:
    """Every box of the container tree (walked independently of refstream.mp4)."""
    found: list[FoundBox] = []

    def walk(start: int, end: int, ancestors: tuple) -> None:
        pos = start
        while pos + 8 <= end:
            size, kind = struct.unpack_from(">I4s", data, pos)
            header = 8
            if size == 1 and pos + 16 <= end:
                size, header = struct.unpack_from(">Q", data, pos + 8)[0], 16
            elif size == 0:
                size = end - pos
            if size < header or pos + size > end:
                return
            found.append(FoundBox(pos, header, size, kind, ancestors))
            if kind in MP4_CONTAINERS:
                walk(pos + header, pos + size, (*ancestors, (pos, header)))
            pos += size

    walk(0, len(data), ())
    return found


@dataclass(frozen=True)
class Mp4Seed:
    data: bytes
    boxes: list[FoundBox]
    moov: FoundBox
    fields: list[int]  # offsets of size fields and of the words after each box header


def load_mp4_seed(name: str) -> Mp4Seed:
    data = (MEDIA / f"{name}.mp4").read_bytes()
    boxes = find_boxes(data)
    moov = next(b for b in boxes if b.type == b"moov" and not b.ancestors)
    fields = sorted({b.offset + k for b in boxes if b.ancestors or b.type == b"moov"
                     for k in (0, b.header, b.header + 4, b.header + 8, b.header + 12)
                     if b.offset + k + 4 <= len(data)})
    return Mp4Seed(data, boxes, moov, fields)


MP4 = {name: load_mp4_seed(name) for name in MP4_SEEDS}


def guarded_reader(data: bytes):
    """``read_range`` over ``data`` that fails the test on a read outside the file."""
    def read_range(offset: int, length: int) -> bytes:
        assert 0 <= offset and 0 <= length and offset + length <= len(data), \
            f"read of bytes [{offset}, +{length}) outside a {len(data)}-byte file"
        return data[offset:offset + length]

    return read_range


def parse_mp4(data: bytes):
    return parse_index(guarded_reader(data), len(data), "fuzz.mp4")


def check_mp4(label: str, data: bytes) -> None:
    index = bounded(label, parse_mp4, data)
    if index is None:
        return
    n = len(index.size)
    for array in (index.dts, index.pts, index.duration, index.size, index.offset):
        assert array.dtype == np.int64 and array.shape == (n,)
    assert index.keyframe.dtype == bool and index.keyframe.shape == (n,)
    assert np.all(index.size >= 0) and np.all(index.offset >= 0)
    assert np.all(index.offset + index.size <= len(data))
    assert index.file_size == len(data)


def _resize(data: bytearray, box_offset: int, header: int, delta: int) -> None:
    if header == 16:
        (size,) = struct.unpack_from(">Q", data, box_offset + 8)
        struct.pack_into(">Q", data, box_offset + 8, size + delta)
    else:
        (size,) = struct.unpack_from(">I", data, box_offset)
        struct.pack_into(">I", data, box_offset, size + delta)


def edit_box(seed: Mp4Seed, box: FoundBox, duplicate: bool) -> bytes:
    """Remove ``box`` (or insert a copy after it), fixing every ancestor's size."""
    data = bytearray(seed.data)
    whole = bytes(data[box.offset:box.offset + box.size])
    if duplicate:
        data[box.offset + box.size:box.offset + box.size] = whole
    else:
        del data[box.offset:box.offset + box.size]
    for offset, header in box.ancestors:  # ancestors lie before the edit: offsets unchanged
        _resize(data, offset, header, box.size if duplicate else -box.size)
    return bytes(data)


def moov_flips(seed: Mp4Seed, rng: random.Random) -> bytes:
    """1-12 bit flips inside the moov box."""
    data = bytearray(seed.data)
    for _ in range(rng.randint(1, 12)):
        data[seed.moov.offset + rng.randrange(seed.moov.size)] ^= 1 << rng.randrange(8)
    return bytes(data)


def field_writes(seed: Mp4Seed, rng: random.Random) -> bytes:
    """1-4 hostile 32- or 64-bit values written over sizes, versions and entry counts."""
    data = bytearray(seed.data)
    for _ in range(rng.randint(1, 4)):
        where = rng.choice(seed.fields)
        if rng.random() < 0.6 or where + 8 > len(data):
            value = rng.choice((rng.choice(INTERESTING_32), rng.randrange(2**32),
                                (len(data) + rng.randint(-64, 64)) % 2**32))
            struct.pack_into(">I", data, where, value)
        else:
            value = rng.choice((rng.choice(INTERESTING_64), rng.randrange(2**64)))
            struct.pack_into(">Q", data, where, value)
    return bytes(data)


def cut_or_pad(seed: Mp4Seed, rng: random.Random) -> bytes:
    """The file cut, or 1-64 random bytes inserted, near a box boundary."""
    box = rng.choice(seed.boxes)
    at = rng.choice((box.offset, box.offset + box.header, box.offset + box.size))
    at = min(len(seed.data), max(0, at + rng.randint(-9, 9)))
    if rng.random() < 0.5:
        return seed.data[:at]
    return seed.data[:at] + rng.randbytes(rng.randint(1, 64)) + seed.data[at:]


def box_edit(seed: Mp4Seed, rng: random.Random) -> bytes:
    """A box inside moov removed or duplicated (sizes fixed), then 0-2 bit flips in moov."""
    inner = [b for b in seed.boxes if b.ancestors]
    data = bytearray(edit_box(seed, rng.choice(inner), duplicate=rng.random() < 0.5))
    for _ in range(rng.randint(0, 2)):
        data[seed.moov.offset + rng.randrange(min(seed.moov.size, len(data) - seed.moov.offset))
             ] ^= 1 << rng.randrange(8)
    return bytes(data)


def test_mp4_seeds_parse_unmutated():
    for name, seed in MP4.items():
        assert len(parse_mp4(seed.data).size) > 0, name


def test_every_single_box_removed_or_duplicated():
    """Exhaustive: each box inside moov of each seed, removed and duplicated."""
    edits = 0
    for seed in MP4.values():
        for box in (b for b in seed.boxes if b.ancestors):
            for duplicate in (False, True):
                check_mp4("mp4_box_exhaustive", edit_box(seed, box, duplicate))
                edits += 1
    assert edits > 500


# --- sidecar: real files, and the checks ------------------------------------------------------


@dataclass
class SidecarSeed:
    records: dict  # relpath -> sidecar.Record
    data: dict  # relpath -> the record file's bytes
    expected: dict  # relpath -> {field: array or scalar} of the unmutated index
    published: bytes  # the published index of every record
    workdir: Path
    serial: int = 0

    def install(self, data: bytes, name: str) -> Path:
        """Write ``data`` as a fresh file (a new inode: no live mapping ever sees it change)."""
        self.serial += 1
        path = self.workdir / f"fuzz{self.serial % 2}.{name}"
        temp = self.workdir / "next.tmp"
        temp.write_bytes(data)
        os.replace(temp, path)
        return path


def index_fields(index) -> dict:
    return {name: getattr(index, name) for name in (
        "dts", "pts", "duration", "size", "offset", "keyframe", "codec", "width", "height",
        "track_id", "timescale", "movie_timescale", "file_size", "ftyp", "stsd")}


ARRAYS = ("dts", "pts", "duration", "size", "offset", "keyframe")


def build_sidecar_seed(folder: Path, workdir: Path) -> SidecarSeed:
    """Index copies of ``SIDECAR_SEEDS`` under ``folder``; mutated files go to ``workdir``."""
    (folder / "videos").mkdir(parents=True, exist_ok=True)
    relpaths = []
    for name in SIDECAR_SEEDS:
        shutil.copy(MEDIA / f"{name}.mp4", folder / "videos" / f"{name}.mp4")
        relpaths.append(f"videos/{name}.mp4")
    index = ensure_index(LocalSource(folder), relpaths, cache_root=folder / "cache")
    mapped = sidecar.MappedIndex(index)
    expected = {relpath: {k: v.copy() if isinstance(v, np.ndarray) else v
                          for k, v in index_fields(mapped[relpath]).items()}
                for relpath in relpaths}
    export_index(index, workdir / "published.npz")
    data = {relpath: Path(record.path).read_bytes() for relpath, record in index.records.items()}
    return SidecarSeed(index.records, data, expected, (workdir / "published.npz").read_bytes(),
                       workdir)


@pytest.fixture(scope="module")
def sidecar_seed(tmp_path_factory) -> SidecarSeed:
    return build_sidecar_seed(tmp_path_factory.mktemp("sidecar_seed"),
                              tmp_path_factory.mktemp("sidecar_fuzz"))


def coherent(fields: dict) -> None:
    """A parsed index's arrays: one length, the schema's dtypes, every element readable."""
    (count,) = fields["dts"].shape
    for name in ARRAYS:
        array = fields[name]
        assert array.shape == (count,), name
        assert array.dtype.kind in ("b" if name == "keyframe" else "iu"), name
        int(array.sum())


def read_mutated_record(seed: SidecarSeed, relpath: str, verify: bool):
    record = seed.records[relpath]

    def parse(data: bytes) -> dict:
        path = seed.install(data, "npy")
        fields = index_fields(read_record(path, record.size, record.identity, relpath,
                                          verify=verify))
        coherent(fields)
        return fields

    return parse


def check_record(seed: SidecarSeed, label: str, data: bytes, relpath: str, verify: bool) -> None:
    fields = bounded(label, read_mutated_record(seed, relpath, verify), data)
    if fields is not None and verify and label == "record_bytes":
        # raw mutations keep the original digest, which covers the meta and the arrays
        assert same_fields(fields, seed.expected[relpath])


def check_published(seed: SidecarSeed, label: str, data: bytes) -> None:
    """Take every record from the mutated published index into a fresh cache, as
    construction does; what is installed must be exactly the original."""
    def take(blob: bytes) -> dict:
        folder = seed.workdir / "published-dataset"
        shutil.rmtree(folder, ignore_errors=True)
        (folder / "meta").mkdir(parents=True)
        (folder / sidecar.PUBLISHED_RELPATH).write_bytes(blob)
        cache = folder / "cache"
        cache.mkdir()
        records = {r: sidecar.Record(x.size, x.identity, str(cache / Path(x.path).name))
                   for r, x in seed.records.items()}
        sidecar._take_published(LocalSource(folder), records)
        return {r: index_fields(read_record(x.path, x.size, x.identity, r))
                for r, x in records.items() if Path(x.path).exists()}

    taken = bounded(label, take, data)
    for relpath, fields in (taken or {}).items():
        assert same_fields(fields, seed.expected[relpath]), relpath


def same_fields(a: dict, b: dict) -> bool:
    return all(np.array_equal(a[k], b[k]) if isinstance(a[k], np.ndarray) else a[k] == b[k]
               for k in a)


def node_paths(value, prefix=()) -> list[tuple]:
    """The path (keys and list positions) of every node of a JSON value, the root included."""
    paths = [prefix]
    if isinstance(value, dict):
        for key, item in value.items():
            paths += node_paths(item, (*prefix, key))
    elif isinstance(value, list):
        for position, item in enumerate(value):
            paths += node_paths(item, (*prefix, position))
    return paths


HOSTILE = (None, True, False, 0, -1, 1, 7, 8, 2**31, 2**63, -(2**63), 2**64, 1e308, float("nan"),
           "", "zz", "<i8", "|b1", "<f8", "O", "V8", "<U4", "ffff", [], {}, [1], {"value": 1},
           {"dtype": "<i8", "offset": 8}, "../x", "videos/h264_b.mp4")


def hostile(rng: random.Random):
    return rng.choice((rng.choice(HOSTILE), rng.randint(-(2**70), 2**70),
                       rng.randbytes(rng.randint(0, 6)).hex()))


def mutate_json(value, paths: list[tuple], rng: random.Random):
    """A copy of ``value`` with one node replaced by a hostile value, or deleted."""
    path = rng.choice(paths)
    if not path:
        return hostile(rng)
    copy = json.loads(json.dumps(value))
    parent = copy
    for key in path[:-1]:
        parent = parent[key]
    if rng.random() < 0.2:
        del parent[path[-1]]
    else:
        parent[path[-1]] = hostile(rng)
    return copy


class SidecarMutators:
    """Mutations of the seed's records and published index: each returns (bytes, relpath,
    verify) for a record, (bytes,) for a published index."""

    def __init__(self, seed: SidecarSeed) -> None:
        self.seed = seed

    def record_bytes(self, rng: random.Random) -> tuple:
        """Flips (in the header and meta, or anywhere), or a cut; verify or not."""
        relpath = rng.choice(sorted(self.seed.data))
        data = bytearray(self.seed.data[relpath])
        kind = rng.choice(("flip_head", "flip_any", "cut"))
        if kind == "cut":
            data = data[:rng.randrange(len(data))]
        else:
            end = min(len(data), 600) if kind == "flip_head" else len(data)
            for _ in range(rng.randint(1, 8)):
                data[rng.randrange(end)] ^= 1 << rng.randrange(8)
        return bytes(data), relpath, rng.random() < 0.5

    def record_meta(self, rng: random.Random) -> tuple:
        """One meta JSON node replaced or deleted, the record re-saved around it."""
        relpath = rng.choice(sorted(self.seed.data))
        array = np.load(io.BytesIO(self.seed.data[relpath]), allow_pickle=False)
        meta = json.loads(array["meta"][0].tobytes())
        text = json.dumps(mutate_json(meta, node_paths(meta), rng)).encode()
        names = array.dtype.names[2:]
        fields = [("sha256", "u1", (32,)), ("meta", "u1", (len(text),))]
        fields += [(n, array.dtype[n]) for n in names]
        body = text + b"".join(array[n][0].tobytes() for n in names)
        blob = io.BytesIO()  # sealed with a correct digest: only the meta's checks can refuse it
        np.save(blob, np.frombuffer(hashlib.sha256(body).digest() + body, np.dtype(fields)))
        return blob.getvalue(), relpath, True

    def published_bytes(self, rng: random.Random) -> tuple:
        """The ZIP cut, or 1-6 bit flips anywhere in it (members are CRC-checked)."""
        data = bytearray(self.seed.published)
        if rng.random() < 0.3:
            return (bytes(data[:rng.randrange(len(data))]),)
        for _ in range(rng.randint(1, 6)):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        return (bytes(data),)


def check_sidecar(seed: SidecarSeed, label: str, data: bytes, *rest) -> None:
    if label.startswith("record"):
        check_record(seed, label, data, *rest)
    else:
        check_published(seed, label, data)


# --- the tests: CI budget, and the long runs behind --run-slow ----------------------------------

MP4_MUTATORS = {"mp4_moov_flips": moov_flips, "mp4_field_writes": field_writes,
                "mp4_cut_or_pad": cut_or_pad, "mp4_box_edit": box_edit}
SIDECAR_LABELS = ("record_bytes", "record_meta", "published_bytes")


def run_mp4(label: str, long_run: bool) -> None:
    mutate = MP4_MUTATORS[label]

    @fuzz_settings(budget(label, long_run), long_run)
    @given(st.sampled_from(MP4_SEEDS), st.integers(0, 2**64 - 1))
    def run(name, rng_seed):
        check_mp4(label, mutate(MP4[name], random.Random(rng_seed)))

    INPUTS[label] = 0
    run()
    assert INPUTS[label] >= budget(label, long_run), f"{label}: {INPUTS[label]} inputs"


def run_sidecar(label: str, seed: SidecarSeed, long_run: bool) -> None:
    mutate = getattr(SidecarMutators(seed), label)

    @fuzz_settings(budget(label, long_run), long_run)
    @given(st.integers(0, 2**64 - 1))
    def run(rng_seed):
        check_sidecar(seed, label, *mutate(random.Random(rng_seed)))

    INPUTS[label] = 0
    run()
    assert INPUTS[label] >= budget(label, long_run), f"{label}: {INPUTS[label]} inputs"


def budget(label: str, long_run: bool) -> int:
    return max(1, int(BUDGET[label] * SCALE * (LONG_FACTOR if long_run else 1)))


@pytest.mark.parametrize("label", MP4_MUTATORS)
def test_mp4_fuzz(label):
    run_mp4(label, long_run=False)


@pytest.mark.parametrize("label", SIDECAR_LABELS)
def test_sidecar_fuzz(label, sidecar_seed, monkeypatch):
    monkeypatch.setattr(os, "fsync", lambda fd: None)  # installing into a throwaway cache
    run_sidecar(label, sidecar_seed, long_run=False)


@pytest.mark.slow
@pytest.mark.parametrize("label", MP4_MUTATORS)
def test_mp4_fuzz_long(label):
    run_mp4(label, long_run=True)


@pytest.mark.slow
@pytest.mark.parametrize("label", SIDECAR_LABELS)
def test_sidecar_fuzz_long(label, sidecar_seed, monkeypatch):
    monkeypatch.setattr(os, "fsync", lambda fd: None)  # installing into a throwaway cache
    run_sidecar(label, sidecar_seed, long_run=True)


def spin(data: bytes) -> None:
    """Burn CPU past the per-input bound."""
    started = time.thread_time()
    while time.thread_time() - started <= PER_INPUT_BOUND_S:
        pass


def test_the_checks_can_fail(sidecar_seed):
    """The harness itself: a non-refstream exception escapes, a slow parse is caught, a read
    outside the file is caught, and a record with changed arrays read with verify is refused."""
    def crash(data: bytes):
        raise IndexError("not a refstream error")

    with pytest.raises(IndexError):
        bounded("selftest", crash, b"")
    with pytest.raises(AssertionError, match="for one input"):
        bounded("selftest", spin, b"")
    with pytest.raises(AssertionError, match="outside"):
        guarded_reader(b"abc")(2, 2)
    relpath = sorted(sidecar_seed.data)[0]
    corrupt = bytearray(sidecar_seed.data[relpath])
    corrupt[-1] ^= 1
    read_mutated_record(sidecar_seed, relpath, verify=False)(bytes(corrupt))
    with pytest.raises(SidecarInvalid, match="digest"):
        read_mutated_record(sidecar_seed, relpath, verify=True)(bytes(corrupt))
