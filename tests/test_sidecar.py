"""refstream.sidecar: the per-dataset index of real MP4 files round-trips to PyAV's packet table
(the oracle), is built once by concurrent processes, survives a killed builder, is rebuilt when
corrupt or stale, times out on a held lock, and is mapped read-only and shared by workers."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from make_sidecar_decode_fixtures import FIXTURES, oracle_sidecar_storage
from media import assert_same_index, encode_video, index_from_pyav, pattern_frames
from sidecar_helpers import DATASET_FILES, make_dataset, pyav_indexer

from refstream import sidecar
from refstream.errors import (
    MalformedMp4,
    SidecarError,
    SidecarInvalid,
    SidecarLockTimeout,
    UsageError,
)
from refstream.mp4 import SampleIndex
from refstream.sidecar import DatasetIdentity, ensure_index, map_index, read_npz
from refstream.source import LocalSource
from refstream.tools import adapters

TESTS = Path(__file__).resolve().parent
HELPER = TESTS / "sidecar_helpers.py"
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS.parent), str(TESTS)])}
RELPATHS = sorted(DATASET_FILES)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("pristine")
    make_dataset(root)
    return root


@pytest.fixture
def root(pristine, tmp_path) -> Path:
    """A private copy of the dataset (tests change its files)."""
    copy = tmp_path / "dataset"
    shutil.copytree(pristine, copy)
    return copy


@pytest.fixture
def cache(tmp_path) -> Path:
    return tmp_path / "cache"


def never(read_range, file_size, path):
    raise AssertionError(f"{path} was indexed although a valid index exists")


class Counting:
    """The PyAV oracle indexer, counting the files it indexes."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self._index = pyav_indexer()

    def __call__(self, read_range, file_size, path):
        self.calls.append(path)
        return self._index(read_range, file_size, path)


def ensure(root: Path, cache: Path, indexer=None, **options):
    return ensure_index(LocalSource(root), RELPATHS, DatasetIdentity(str(root)), cache_root=cache,
                        workers=2, indexer=indexer or pyav_indexer(), **options)


def assert_matches_oracle(index, root: Path) -> None:
    assert sorted(index) == RELPATHS
    for relpath in RELPATHS:
        assert_same_index(index[relpath], index_from_pyav(root / relpath))
        assert index[relpath].path == relpath


def temp_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.rglob(".tmp.*"))


def bump_mtime(path: Path) -> None:
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))


# --- round trip ----------------------------------------------------------------------------


def test_build_then_open_equals_the_pyav_oracle(root, cache):
    location = ensure(root, cache)
    assert location.origin == "built"
    summary = location.summary
    oracles = [index_from_pyav(root / r) for r in RELPATHS]
    assert summary.files == 3 and summary.samples == sum(len(o.pts) for o in oracles)
    # The oracle indexer reads every file once, whole, through the source.
    assert summary.bytes_read == sum((root / r).stat().st_size for r in RELPATHS)
    assert_matches_oracle(map_index(location.compact_path), root)

    # The canonical NPZ: int64/bool arrays concatenated in relpath order, plus the manifest.
    states = sidecar.file_states(LocalSource(root), RELPATHS)
    manifest, arrays = read_npz(location.npz_path, DatasetIdentity(str(root)), states)
    for name in sidecar.ARRAY_FIELDS:
        expected = np.concatenate([getattr(o, name) for o in oracles])
        np.testing.assert_array_equal(arrays[name], expected)
    assert [f["relpath"] for f in manifest["files"]] == RELPATHS
    assert manifest["files"][0]["fingerprint"] == LocalSource(root).identity(RELPATHS[0])
    with zipfile.ZipFile(location.npz_path) as archive:  # plain .npy members, no pickles
        assert sorted(archive.namelist()) == sorted(
            f"{n}.npy" for n in ("manifest", *sidecar.ARRAY_FIELDS))


def test_the_real_parser_builds_the_same_index(root, cache):
    location = ensure_index(LocalSource(root), RELPATHS, DatasetIdentity(str(root)),
                            cache_root=cache)  # default indexer: refstream.mp4.parse_index
    assert location.origin == "built"
    assert location.summary.bytes_read <= sum((root / r).stat().st_size for r in RELPATHS)
    assert_matches_oracle(map_index(location.compact_path), root)


def test_a_second_open_uses_the_cache_without_indexing(root, cache):
    first = ensure(root, cache)
    again = ensure(root, cache, indexer=never)
    assert again.origin == "cache" and again.compact_path == first.compact_path
    assert again.summary is None


class PinnedSource(LocalSource):
    """A local folder that answers like a commit-pinned Hub source: every identity is the
    commit; ``asked`` counts the size and identity questions (HEADs on the Hub)."""

    def __init__(self, root: Path, commit: str) -> None:
        super().__init__(root)
        self.commit, self.asked = commit, 0

    def identity(self, relpath: str) -> str:
        self.asked += 1
        return f"commit:{self.commit}"

    def size(self, relpath: str) -> int:
        self.asked += 1
        return super().size(relpath)


def test_a_commit_pinned_dataset_reopens_from_the_cache_without_asking_the_source(root, cache):
    commit = "ab" * 20
    dataset = DatasetIdentity("hf://datasets/o/n", commit)
    first = PinnedSource(root, commit)
    built = ensure_index(first, RELPATHS, dataset, cache_root=cache, indexer=pyav_indexer())
    assert built.origin == "built" and first.asked > 0
    again = PinnedSource(root, commit)
    found = ensure_index(again, RELPATHS, dataset, cache_root=cache, indexer=never)
    assert (found.origin, again.asked) == ("cache", 0)
    assert_matches_oracle(map_index(found.compact_path), root)
    # Other files than the cached index holds: the states are asked for (and the index rebuilt).
    fewer = PinnedSource(root, commit)
    counting = Counting()
    rebuilt = ensure_index(fewer, RELPATHS[:2], dataset, cache_root=cache, indexer=counting)
    assert rebuilt.origin == "built" and fewer.asked > 0 and counting.calls
    # Not pinned (no revision): every open asks for the files' states.
    unpinned = PinnedSource(root, commit)
    ensure_index(unpinned, RELPATHS, DatasetIdentity("https://example/d"), cache_root=cache,
                 indexer=pyav_indexer())
    assert unpinned.asked > 0


def test_compact_arrays_are_narrow_exact_and_read_only(root, cache):
    index = map_index(ensure(root, cache).compact_path, verify=True)
    ladder = sidecar.NARROW_DTYPES
    for relpath in RELPATHS:
        oracle = index_from_pyav(root / relpath)
        for name in sidecar.INT_FIELDS:
            values, stored = getattr(oracle, name), index.stored(relpath, name)
            np.testing.assert_array_equal(stored, values)
            if np.all(values == values[0]):
                assert stored.strides == (0,), (relpath, name)  # a constant: stored once
                continue
            # The stored dtype holds every value; the narrower ones before it do not.
            position = ladder.index(stored.dtype)
            for narrower in ladder[:position]:
                info = np.iinfo(narrower)
                assert values.min() < info.min or values.max() > info.max, (relpath, name)
        sample_index = index[relpath]
        for name in sidecar.ARRAY_FIELDS:
            array = getattr(sample_index, name)
            assert array.dtype == (bool if name == "keyframe" else np.int64)
            assert not array.flags.writeable
        # int64 semantics: composition offsets (negative with B-frames) do not wrap.
        np.testing.assert_array_equal(sample_index.pts - sample_index.dts, oracle.pts - oracle.dts)


def synthetic_indexer(samples: int, seed: int = 0):
    """An indexer returning large random indexes (values that need int8..int64 storage)."""

    def indexer(read_range, file_size, path):
        rng = np.random.default_rng([seed, len(path)])
        dts = np.cumsum(rng.integers(1, 3000, samples)) - 5000  # negative first: int32
        return SampleIndex(
            path=path, file_size=file_size, ftyp=b"ftyp", stsd=b"\x00\x01", codec="av01",
            width=640, height=480, track_id=1, timescale=90000, movie_timescale=1000,
            dts=dts, pts=dts + rng.integers(-2, 3, samples),
            duration=np.full(samples, 3000, np.int64),
            size=rng.integers(0, 200, samples), offset=2**33 + np.arange(samples) * 7,
            keyframe=rng.random(samples) < 0.1,
        )

    return indexer


def test_dtypes_cover_negative_large_and_constant_values(root, cache):
    make = synthetic_indexer(1000)
    index = map_index(ensure(root, cache, indexer=make).compact_path)
    relpath = RELPATHS[0]
    expected = make(None, (root / relpath).stat().st_size, relpath)
    assert_same_index(index[relpath], expected)
    stored = {name: index.stored(relpath, name) for name in sidecar.ARRAY_FIELDS}
    assert stored["dts"].dtype == np.dtype("<i4") and stored["size"].dtype == np.dtype("u1")
    assert stored["offset"].dtype == np.dtype("<i8") and stored["duration"].strides == (0,)
    assert stored["pts"].dtype == np.dtype("<i4") and stored["keyframe"].dtype == bool


# --- processes -------------------------------------------------------------------------------


def spawn(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(HELPER), *args], env=ENV, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def wait_for(predicate, timeout_s: float = 60.0) -> None:
    """Until ``predicate()`` (a state another process reaches); the deadline is a hang guard."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.02)


def has_open(pid: int, path: Path) -> bool:
    """Whether process ``pid`` has ``path`` open."""
    fds = Path(f"/proc/{pid}/fd")
    return any(os.path.realpath(fd) == os.path.realpath(path) for fd in fds.iterdir())


def test_two_concurrent_builders_build_once(root, cache, tmp_path):
    log = tmp_path / "indexed.log"
    # Each builder's indexer waits for stdin: whichever takes the lock keeps it until the test
    # has seen the other one waiting at the lock, so the two really build at the same time.
    builders = [spawn("build", str(cache), str(root), str(log), "stdin") for _ in range(2)]
    wait_for(lambda: log.exists() and log.read_text())  # one builder holds the lock, indexing
    holder = next(b for b in builders if b.pid == int(log.read_text().split()[0]))
    waiting = next(b for b in builders if b is not holder)
    lock = sidecar.cache_directory(DatasetIdentity(str(root)), cache) / ".lock"
    wait_for(lambda: has_open(waiting.pid, lock))  # the other one polls the held lock
    # the holder's stdin closes first (its indexing goes on), then the waiting one's
    outputs = [b.communicate(timeout=120) for b in (holder, waiting)]
    assert [b.returncode for b in builders] == [0, 0], outputs
    assert [out.split()[0] for out, _ in outputs] == ["built", "cache"]
    assert len({out.split()[1] for out, _ in outputs}) == 1
    assert sorted(line.split()[1] for line in log.read_text().splitlines()) == RELPATHS
    assert_matches_oracle(map_index(outputs[0][0].split()[1]), root)


def test_a_killed_builder_leaves_the_old_index_and_no_temp_files(root, cache, tmp_path):
    location = ensure(root, cache)
    old_npz, old_compact = location.npz_path.read_bytes(), location.compact_path.read_bytes()
    bump_mtime(root / RELPATHS[1])  # stale: the next open rebuilds
    log = tmp_path / "indexed.log"
    builder = spawn("build", str(cache), str(root), str(log), "stdin")  # indexes on a line
    wait_for(lambda: log.exists() and log.read_text())  # indexing has started
    assert temp_files(cache)  # the build's temp file exists ...
    builder.send_signal(signal.SIGKILL)
    builder.wait(timeout=10)
    assert temp_files(cache)  # ... and outlives the killed builder
    assert location.npz_path.read_bytes() == old_npz
    assert location.compact_path.read_bytes() == old_compact

    rebuilt = ensure(root, cache)
    assert rebuilt.origin == "built"
    assert temp_files(cache) == []
    assert_matches_oracle(map_index(rebuilt.compact_path), root)


def test_a_held_lock_times_out_naming_the_lock(root, cache, monkeypatch):
    directory = sidecar.cache_directory(DatasetIdentity(str(root)), cache)
    directory.mkdir(parents=True)
    holder = spawn("hold", str(directory / ".lock"))
    try:
        assert holder.stdout.readline().strip() == "held"
        started = time.monotonic()
        with pytest.raises(SidecarLockTimeout, match=re.escape(str(directory / ".lock"))) as caught:
            ensure(root, cache, lock_timeout_s=0.3)
        assert 0.3 <= time.monotonic() - started < 30  # the timeout, not the default 1800 s
        assert "0.3" in str(caught.value) and "waited" in str(caught.value)
        monkeypatch.setenv(sidecar.LOCK_TIMEOUT_ENV, "0.1")
        with pytest.raises(SidecarLockTimeout, match="timeout 0.1 s"):
            ensure(root, cache)
    finally:
        holder.kill()
        holder.wait()
    assert ensure(root, cache).origin == "built"  # the lock is free again


def test_a_failed_build_keeps_the_old_index_and_leaves_no_temp_files(root, cache):
    location = ensure(root, cache)
    old_npz, old_compact = location.npz_path.read_bytes(), location.compact_path.read_bytes()
    bump_mtime(root / RELPATHS[2])

    def broken(read_range, file_size, path):
        raise MalformedMp4(f"{path}: stsz: entry count past the box (test)")

    with pytest.raises(MalformedMp4, match="stsz"):
        ensure(root, cache, indexer=broken)
    assert location.npz_path.read_bytes() == old_npz
    assert location.compact_path.read_bytes() == old_compact
    assert temp_files(cache) == []


# --- corrupt and stale files -------------------------------------------------------------------


def flip_bytes(path: Path, start: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    start = len(data) // 3 if start is None else start
    for at in range(start, start + 16):
        data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def wrong_schema(path: Path) -> None:
    with np.load(path) as npz:
        members = {name: npz[name] for name in npz.files}
    manifest = json.loads(members["manifest"].tobytes())
    manifest["schema_version"] = 99
    members["manifest"] = np.frombuffer(json.dumps(manifest).encode(), np.uint8)
    with open(path, "wb") as handle:
        np.savez(handle, **members)


def wrong_dtype(path: Path) -> None:
    with np.load(path) as npz:
        members = {name: npz[name] for name in npz.files}
    members["pts"] = members["pts"].astype(np.float64)
    with open(path, "wb") as handle:
        np.savez(handle, **members)


CORRUPTIONS = {
    "truncated": lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]),
    "flipped bytes": flip_bytes,
    "flipped tail": lambda p: flip_bytes(p, p.stat().st_size - 40),  # array data, not header
    "wrong schema": wrong_schema,
    "wrong dtype": wrong_dtype,
    "empty": lambda p: p.write_bytes(b""),
}


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_a_corrupt_index_is_rebuilt(root, cache, corruption):
    location = ensure(root, cache)
    CORRUPTIONS[corruption](location.npz_path)
    location.compact_path.unlink()  # so that the canonical file is what is read
    counting = Counting()
    again = ensure(root, cache, indexer=counting)
    assert again.origin == "built" and sorted(counting.calls) == RELPATHS
    assert_matches_oracle(map_index(again.compact_path), root)


@pytest.mark.parametrize("corruption", ["truncated", "flipped bytes", "flipped tail", "empty"])
def test_a_corrupt_compact_file_is_derived_again_from_the_npz(root, cache, corruption):
    location = ensure(root, cache)
    CORRUPTIONS[corruption](location.compact_path)
    again = ensure(root, cache, indexer=never)
    assert again.origin == "npz"
    assert_matches_oracle(map_index(again.compact_path, verify=True), root)


def test_a_changed_fingerprint_or_size_is_rebuilt(root, cache):
    ensure(root, cache)
    bump_mtime(root / RELPATHS[0])  # same bytes, new fingerprint
    counting = Counting()
    assert ensure(root, cache, indexer=counting).origin == "built"
    assert sorted(counting.calls) == RELPATHS

    encode_video(root / RELPATHS[2], pattern_frames(12), "libx264", 4, 1)  # new size and content
    location = ensure(root, cache)
    assert location.origin == "built"
    assert_matches_oracle(map_index(location.compact_path), root)
    assert len(map_index(location.compact_path)[RELPATHS[2]].pts) == 12


class ChangingSource(LocalSource):
    """Every identity query answers differently, as if the files kept changing."""

    counter = 0

    def identity(self, relpath: str) -> str:
        ChangingSource.counter += 1
        return f"generation {ChangingSource.counter}"


def test_files_that_change_during_every_build_raise_after_one_retry(root, cache):
    counting = Counting()
    with pytest.raises(SidecarInvalid, match="built twice"):
        ensure_index(ChangingSource(root), RELPATHS, DatasetIdentity(str(root)),
                     cache_root=cache, indexer=counting)
    assert len(counting.calls) == 2 * len(RELPATHS)
    directory = sidecar.cache_directory(DatasetIdentity(str(root)), cache)
    assert temp_files(directory) == [] and not (directory / "index.npz").exists()


class NoIdentitySource(LocalSource):
    def identity(self, relpath: str) -> str:
        return ""  # e.g. an HTTP server without ETag or Last-Modified


def test_a_source_without_identity_is_indexed_on_every_open_with_a_warning(root, cache):
    for _ in range(2):
        counting = Counting()
        with pytest.warns(UserWarning, match="no stable identity"):
            location = ensure_index(NoIdentitySource(root), RELPATHS, DatasetIdentity(str(root)),
                                    cache_root=cache, indexer=counting)
        assert location.origin == "volatile" and sorted(counting.calls) == RELPATHS
        assert_matches_oracle(map_index(location.compact_path), root)


def test_a_published_index_is_used_when_valid(root, cache, tmp_path):
    built = ensure(root, cache)
    (root / "meta").mkdir()
    shutil.copy(built.npz_path, root / sidecar.PUBLISHED_RELPATH)
    fresh_cache = tmp_path / "fresh-cache"
    location = ensure(root, fresh_cache, indexer=never)
    assert location.origin == "published"
    assert_matches_oracle(map_index(location.compact_path), root)

    bump_mtime(root / RELPATHS[1])  # the published index is now stale
    counting = Counting()
    assert ensure(root, tmp_path / "third-cache", indexer=counting).origin == "built"
    assert sorted(counting.calls) == RELPATHS


# --- sharing between workers --------------------------------------------------------------------

# Run in a second process: map the index, touch every stored array, report the mapping's smaps.
SMAPS_PROBE = """
import json, os, re, sys
from refstream.sidecar import map_index
path = os.path.realpath(sys.argv[1])
index = map_index(path)
total = sum(int(index.stored(r, n).sum()) for r in index for n in ("dts", "pts", "offset"))
total += sum(int(index.stored(r, n).sum()) for r in index for n in ("size", "keyframe"))
fields, ours = {}, False
with open("/proc/self/smaps") as smaps:
    for line in smaps:
        parts = line.split()
        if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
            ours = len(parts) >= 6 and parts[5] == path
            if ours:
                fields["perms"] = parts[1]
        elif ours and len(parts) == 3 and parts[2] == "kB":
            fields[parts[0][:-1]] = fields.get(parts[0][:-1], 0) + int(parts[1])
print(json.dumps({"total": total, **fields}))
"""


def test_workers_map_the_compact_index_read_only_and_share_its_pages(root, cache):
    location = ensure(root, cache, indexer=synthetic_indexer(150_000))
    size = location.compact_path.stat().st_size
    assert size > 2_000_000  # large enough for the page counts to mean something
    index = map_index(location.compact_path)
    total = sum(int(index.stored(r, n).sum()) for r in index for n in ("dts", "pts", "offset"))
    total += sum(int(index.stored(r, n).sum()) for r in index for n in ("size", "keyframe"))
    # A stored int64 array is a view of the mapping itself, not a copy.
    relpath = RELPATHS[0]
    assert np.shares_memory(index[relpath].offset, index._map)
    # This process keeps the pages mapped and touched while a second one maps them too.
    probe = subprocess.run([sys.executable, "-c", SMAPS_PROBE, str(location.compact_path)],
                           env=ENV, capture_output=True, text=True, timeout=60, check=True)
    report = json.loads(probe.stdout)
    assert report["total"] == total
    assert report["perms"] == "r--s"  # read-only, shared, backed by the file
    assert report["Private_Dirty"] == 0 and report["Anonymous"] == 0
    assert report["Rss"] * 1024 >= size * 0.9
    assert report["Shared_Clean"] >= report["Rss"] * 0.9
    assert report["Pss"] <= report["Rss"] * 0.6  # each resident page is split between two


# --- the command line --------------------------------------------------------------------------


def test_the_index_command_builds_refreshes_and_publishes(tmp_path, monkeypatch, capsys):
    from refstream.tools.cli import main
    from refstream.tools.demo import write_demo_dataset

    root = tmp_path / "lerobot"
    write_demo_dataset(root, episode_lengths=(6, 5, 7), episodes_per_video_file=2)
    monkeypatch.setenv(sidecar.CACHE_ENV, str(tmp_path / "cache"))
    published = root / sidecar.PUBLISHED_RELPATH

    assert main(["index", str(root), "--json", "--workers", "2", "--output", str(published)]) == 0
    first = json.loads(capsys.readouterr().out)
    videos = sorted(str(p.relative_to(root)) for p in root.rglob("*.mp4"))
    oracles = {relpath: index_from_pyav(root / relpath) for relpath in videos}
    assert first["origin"] == "built" and first["files"] == len(videos) == 4
    assert first["samples"] == sum(len(o.pts) for o in oracles.values()) == 2 * 18
    assert first["video_bytes"] == sum((root / v).stat().st_size for v in videos)
    index = map_index(first["compact_index"])
    for relpath, oracle in oracles.items():
        assert_same_index(index[relpath], oracle)
    assert published.exists()

    assert main(["index", str(root), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["origin"] == "cache"
    monkeypatch.setenv(sidecar.CACHE_ENV, str(tmp_path / "other-cache"))
    assert main(["index", str(root), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["origin"] == "published"


# --- conformance cases ---------------------------------------------------------------------

STORAGE_CASES = sorted((FIXTURES / "sidecar").glob("*.json"))


@pytest.mark.parametrize("path", STORAGE_CASES, ids=lambda p: p.stem)
def test_storage_cases_match_the_oracle_and_the_adapter(path):
    case = json.loads(path.read_text())
    assert case["kind"] == "sidecar_storage"
    assert oracle_sidecar_storage(case["input"]) == case["expected"]
    assert adapters.kind_sidecar_storage(case["input"]) == case["expected"]


def test_there_are_storage_cases():
    assert len(STORAGE_CASES) >= 15


def test_a_malformed_lock_timeout_setting_is_a_usage_error(root, cache, monkeypatch):
    monkeypatch.setenv(sidecar.LOCK_TIMEOUT_ENV, "half an hour")
    with pytest.raises(UsageError, match="REFSTREAM_SIDECAR_LOCK_TIMEOUT_S"):
        ensure(root, cache)


# --- property: any arrays survive the compact file exactly ---------------------------------------

INT64 = (-(2**63), 2**63 - 1)
RANGES = [(0, 3), (-5, 5), (0, 70_000), (-(2**40), 2**40), INT64]


@st.composite
def sample_tables(draw):
    tables = []
    for _ in range(draw(st.integers(1, 3))):
        n = draw(st.integers(0, 12))
        table = {}
        for name in sidecar.INT_FIELDS:
            low, high = draw(st.sampled_from(RANGES))
            if draw(st.booleans()):
                table[name] = [draw(st.integers(low, high))] * n
            else:
                table[name] = draw(st.lists(st.integers(low, high), min_size=n, max_size=n))
        table["keyframe"] = draw(st.lists(st.booleans(), min_size=n, max_size=n))
        tables.append(table)
    return tables


class MemorySource:
    """Files that exist only as sizes and fingerprints (the indexer below ignores bytes)."""

    def __init__(self, sizes: dict[str, int]) -> None:
        self.sizes = sizes

    def read_range(self, relpath, offset, length):
        return bytes(length)

    def size(self, relpath):
        if relpath not in self.sizes:
            raise FileNotFoundError(relpath)  # e.g. no published index
        return self.sizes[relpath]

    def identity(self, relpath):
        return f"memory:{self.sizes[relpath]}"


@settings(max_examples=40, deadline=None)
@given(tables=sample_tables())
def test_any_arrays_round_trip_exactly_through_the_compact_file(tmp_path_factory, tables):
    relpaths = [f"videos/c/file-{i}.mp4" for i in range(len(tables))]
    by_path = dict(zip(relpaths, tables, strict=True))

    def indexer(read_range, file_size, path):
        arrays = {name: np.array(values, np.int64) for name, values in by_path[path].items()
                  if name != "keyframe"}
        return SampleIndex(path=path, file_size=file_size, ftyp=b"", stsd=b"\x01", codec="avc1",
                           width=2, height=2, track_id=1, timescale=30, movie_timescale=1000,
                           keyframe=np.array(by_path[path]["keyframe"], bool), **arrays)

    source = MemorySource({relpath: 100 + i for i, relpath in enumerate(relpaths)})
    location = ensure_index(source, relpaths, DatasetIdentity("memory://x"),
                            cache_root=tmp_path_factory.mktemp("cache"), indexer=indexer)
    index = map_index(location.compact_path, verify=True)
    for relpath, table in by_path.items():
        for name, values in table.items():
            got = getattr(index[relpath], name)
            assert got.dtype == (bool if name == "keyframe" else np.int64)
            assert got.tolist() == values, (relpath, name)
            stored = index.stored(relpath, name)
            assert stored.tolist() == values
            if len(set(values)) > 1 and name != "keyframe":  # narrowest type that holds them
                position = sidecar.NARROW_DTYPES.index(stored.dtype)
                for narrower in sidecar.NARROW_DTYPES[:position]:
                    info = np.iinfo(narrower)
                    assert min(values) < info.min or max(values) > info.max


def test_an_unusable_cache_folder_is_a_sidecar_error_naming_it(root, tmp_path):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the cache folder should be")
    with pytest.raises(SidecarError, match="not-a-folder"):
        ensure(root, blocker)


def test_file_states_over_http_are_one_head_per_file_in_relpath_order(tmp_path):
    from rangeserver import RangeServer, etag_of

    from refstream.http import HTTPSource

    contents = {f"videos/cam{k % 3}/file-{k:03d}.mp4": os.urandom(100 + k) for k in range(20)}
    for relpath, content in contents.items():
        (tmp_path / relpath).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / relpath).write_bytes(content)
    with RangeServer(tmp_path) as server:
        source = HTTPSource(server.url)
        states = sidecar.file_states(source, [*contents, *contents])  # duplicates: once each
        methods = [r.method for r in server.log]
        source.close()
    assert [(s.relpath, s.size, s.fingerprint) for s in states] == [
        (r, len(contents[r]), f"etag:{etag_of(contents[r])}") for r in sorted(contents)]
    assert methods == ["HEAD"] * len(contents)
