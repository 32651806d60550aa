"""refstream.sidecar: the video index of real MP4 files round-trips to PyAV's packet table (the
oracle); a record serves every copy, branch, tag and commit with the same video and only a
changed video is indexed again; records are built once by concurrent processes, installed
atomically (a reader keeps what it mapped, a crash leaves the old file), never lost to a killed
or failed build, rebuilt when corrupt, guarded by a lock with a timeout, and mapped read-only
and shared by workers in their narrow stored dtypes."""

import hashlib
import io
import json
import logging
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
from make_sidecar_decode_fixtures import FIXTURES, oracle_sidecar_record
from media import encode_video, index_from_pyav, pattern_frames
from rangeserver import HubConfig, RangeServer, etag_of
from sidecar_helpers import (
    DATASET_FILES,
    NoIdentitySource,
    ensure_with,
    make_dataset,
    pyav_indexer,
)

from refstream import sidecar
from refstream.errors import (
    MalformedDataset,
    MalformedMp4,
    PayloadChanged,
    SidecarError,
    SidecarInvalid,
    SidecarLockTimeout,
    UsageError,
)
from refstream.meta import load_meta
from refstream.mp4 import SampleIndex
from refstream.roots import open_source
from refstream.sidecar import MappedIndex, ensure_index, read_record, record_name
from refstream.source import LocalSource
from refstream.tools import adapters
from refstream.tools.cli import export_index

TESTS = Path(__file__).resolve().parent
HELPER = TESTS / "sidecar_helpers.py"
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS.parent), str(TESTS)])}
RELPATHS = sorted(DATASET_FILES)
COMMITS = ("1" * 40, "2" * 40, "3" * 40)


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
    raise AssertionError(f"{path} was indexed although a valid record exists")


class Counting:
    """The PyAV oracle indexer, counting the files it indexes."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self._index = pyav_indexer()

    def __call__(self, read_range, file_size, path):
        self.calls.append(path)
        return self._index(read_range, file_size, path)


def ensure(root: Path, cache: Path, indexer=None, **options):
    return ensure_with(indexer or pyav_indexer(), LocalSource(root), RELPATHS, cache_root=cache,
                       workers=2, **options)


def assert_same_values(actual: SampleIndex, expected: SampleIndex) -> None:
    """Every field equal; arrays by value, whatever integer dtype they are stored in."""
    for name in ("file_size", "ftyp", "stsd", *sidecar.SCALAR_FIELDS):
        assert getattr(actual, name) == getattr(expected, name), name
    for name in sidecar.ARRAY_FIELDS:
        got, want = getattr(actual, name), getattr(expected, name)
        assert got.dtype.kind == want.dtype.kind or got.dtype.kind in "ui", (name, got.dtype)
        np.testing.assert_array_equal(got, want, err_msg=name)


def assert_matches_oracle(index, root: Path, relpaths=RELPATHS) -> None:
    mapped = MappedIndex(index)
    assert sorted(index.records) == sorted(relpaths)
    for relpath in relpaths:
        assert_same_values(mapped[relpath], index_from_pyav(root / relpath))
        assert mapped[relpath].path == relpath


def record_of(index, relpath: str) -> Path:
    return Path(index.records[relpath].path)


def temp_files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.rglob(".tmp.*"))


def bump_mtime(path: Path) -> None:
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))


def reencode(path: Path, frames: int = 12) -> None:
    """A new video (other content and size) in place of ``path``."""
    encode_video(path, pattern_frames(frames), "libx264", 4, 1)


# --- round trip ----------------------------------------------------------------------------


def test_build_then_open_equals_the_pyav_oracle(root, cache):
    index = ensure(root, cache)
    assert (index.origin, index.indexed) == ("built", 3)
    assert_matches_oracle(index, root)
    source = LocalSource(root)
    for relpath in RELPATHS:  # one record per file, named by its size and content identity
        size, identity = source.size(relpath), source.identity(relpath)
        assert index.records[relpath] == sidecar.Record(
            size, identity, str(cache / "index" / record_name(size, identity)))


class ReadCounting(LocalSource):
    """A local source that keeps the length of every range read through it."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.lengths: list[int] = []

    def read_range(self, relpath: str, offset: int, length: int) -> bytes:
        self.lengths.append(length)
        return super().read_range(relpath, offset, length)


def test_the_real_parser_builds_the_same_index(root, cache):
    source = ReadCounting(root)
    index = ensure_index(source, RELPATHS, cache_root=cache)  # refstream.mp4
    assert index.origin == "built"
    assert 0 < sum(source.lengths) <= sum((root / r).stat().st_size for r in RELPATHS)
    assert_matches_oracle(index, root)


def test_a_second_open_uses_the_cache_without_indexing(root, cache):
    first = ensure(root, cache)
    again = ensure(root, cache, indexer=never)
    assert (again.origin, again.indexed, again.records) == ("cache", 0, first.records)


def test_records_are_narrow_exact_read_only_views_of_the_mapping(root, cache):
    mapped = MappedIndex(ensure(root, cache))
    ladder = sidecar.NARROW_DTYPES
    for relpath in RELPATHS:
        oracle = index_from_pyav(root / relpath)
        for name in sidecar.ARRAY_FIELDS:
            values, stored = getattr(oracle, name), getattr(mapped[relpath], name)
            np.testing.assert_array_equal(stored, values)
            assert not stored.flags.writeable
            if np.all(values == values[0]):
                assert stored.strides == (0,), (relpath, name)  # a constant: stored once
                continue
            base = stored  # a plain ndarray view of the record file's mapping
            while base is not None and not isinstance(base, np.memmap):
                base = base.base
            assert type(stored) is np.ndarray and base is not None, (relpath, name)
            if name == "keyframe":
                assert stored.dtype == np.dtype("|b1")
                continue
            # The stored dtype holds every value; the narrower ones before it do not.
            for narrower in ladder[: ladder.index(stored.dtype)]:
                info = np.iinfo(narrower)
                assert values.min() < info.min or values.max() > info.max, (relpath, name)


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
    mapped = MappedIndex(ensure(root, cache, indexer=make))
    relpath = RELPATHS[0]
    stored = mapped[relpath]
    assert_same_values(stored, make(None, (root / relpath).stat().st_size, relpath))
    assert stored.dts.dtype == np.dtype("<i4") and stored.size.dtype == np.dtype("u1")
    assert stored.offset.dtype == np.dtype("<i8") and stored.duration.strides == (0,)
    assert stored.pts.dtype == np.dtype("<i4") and stored.keyframe.dtype == bool


INT64 = (-(2**63), 2**63 - 1)
RANGES = [(0, 3), (-5, 5), (0, 70_000), (-(2**40), 2**40), INT64]


@st.composite
def sample_tables(draw):
    n = draw(st.integers(0, 12))
    table = {}
    for name in ("dts", "pts", "duration", "size", "offset"):
        low, high = draw(st.sampled_from(RANGES))
        if draw(st.booleans()):
            table[name] = [draw(st.integers(low, high))] * n
        else:
            table[name] = draw(st.lists(st.integers(low, high), min_size=n, max_size=n))
    table["keyframe"] = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    return table


@settings(max_examples=60, deadline=None)
@given(table=sample_tables(), identity=st.text(min_size=1, max_size=20))
def test_any_arrays_round_trip_exactly_through_a_record(tmp_path_factory, table, identity):
    arrays = {name: np.array(values, bool if name == "keyframe" else np.int64)
              for name, values in table.items()}
    index = SampleIndex(path="p", file_size=100, ftyp=b"", stsd=b"\x01", codec="avc1", width=2,
                        height=2, track_id=1, timescale=30, movie_timescale=1000, **arrays)
    path = tmp_path_factory.mktemp("record") / record_name(100, identity)
    path.write_bytes(sidecar.record_bytes(index, identity))
    dts = table["dts"]
    if any(later < earlier for earlier, later in zip(dts, dts[1:], strict=False)):
        with pytest.raises(SidecarInvalid, match="dts decreases"):  # not what a parser gives
            read_record(path, 100, identity, "p", verify=True)
    for verify in (False, True) if sorted(dts) == dts else (False,):
        got = read_record(path, 100, identity, "p", verify=verify)
        for name, values in table.items():
            assert getattr(got, name).tolist() == values, name
            if len(set(values)) > 1 and name != "keyframe":  # narrowest type that holds them
                ladder = sidecar.NARROW_DTYPES
                for narrower in ladder[: ladder.index(getattr(got, name).dtype)]:
                    info = np.iinfo(narrower)
                    assert min(values) < info.min or max(values) > info.max
    with pytest.raises(SidecarInvalid, match="describes"):
        read_record(path, 101, identity)  # another size
    with pytest.raises(SidecarInvalid, match="describes"):
        read_record(path, 100, identity + "x")  # another content


# --- one index for every copy, branch, tag and commit; a changed video alone rebuilt -------------


def test_a_cp_a_copy_reuses_the_cache_and_the_published_index(root, tmp_path):
    cache, published = tmp_path / "cache", root / sidecar.PUBLISHED_RELPATH
    built = ensure(root, cache)
    export_index(built, published)
    copy = tmp_path / "copy"
    subprocess.run(["cp", "-a", str(root), str(copy)], check=True)
    assert ensure(copy, cache, indexer=never).origin == "cache"
    fresh = ensure(copy, tmp_path / "fresh", indexer=never)
    assert (fresh.origin, fresh.indexed) == ("published", 0)
    assert_matches_oracle(fresh, copy)

    reencode(copy / RELPATHS[1])  # one video changes: only its record is built
    counting = Counting()
    changed = ensure(copy, tmp_path / "fresh", indexer=counting)
    assert (changed.origin, changed.indexed, counting.calls) == ("built", 1, [RELPATHS[1]])
    assert_matches_oracle(changed, copy)


def test_a_changed_video_rebuilds_only_its_record(root, cache):
    first = ensure(root, cache)
    bump_mtime(root / RELPATHS[0])  # same bytes, new fingerprint
    reencode(root / RELPATHS[2])  # new size and content
    counting = Counting()
    again = ensure(root, cache, indexer=counting)
    assert (again.origin, sorted(counting.calls)) == ("built", [RELPATHS[0], RELPATHS[2]])
    assert again.records[RELPATHS[1]] == first.records[RELPATHS[1]]
    assert_matches_oracle(again, root)
    assert len(MappedIndex(again)[RELPATHS[2]]) == 12


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """A LeRobot dataset on the emulated Hub (listing pages of 3 entries); main at COMMITS[0]."""
    from refstream.tools.demo import write_demo_dataset

    folder = tmp_path / "repo"
    write_demo_dataset(folder, episode_lengths=(6, 5, 7, 4), episodes_per_video_file=2)
    config = HubConfig(revisions={"main": COMMITS[0], "v1.0": COMMITS[0]}, page_size=3)
    with RangeServer(folder, hub=config) as server:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        monkeypatch.delenv("HF_TOKEN", raising=False)
        yield server


def hub_videos(server: RangeServer) -> list[str]:
    return sorted(str(p.relative_to(server.folder)) for p in server.folder.rglob("*.mp4"))


def open_hub(root: str, cache: Path, indexer=None):
    """The video index of a Hub root, as StreamingDataset gets it."""
    source = open_source(root)
    try:
        relpaths = load_meta(source).video_files()
        return ensure_with(indexer or never, source, relpaths, cache_root=cache)
    finally:
        source.close()


def test_a_published_index_serves_later_commits_tags_and_branches(hub, tmp_path, monkeypatch):
    from refstream.stream import StreamingDataset
    from refstream.tools.cli import main

    monkeypatch.setenv(sidecar.CACHE_ENV, str(tmp_path / "maintainer"))
    published = hub.folder / sidecar.PUBLISHED_RELPATH
    assert main(["index", "hf://datasets/o/n", "--output", str(published), "--json"]) == 0
    hub.hub.revisions.update({"main": COMMITS[1], "v1.1": COMMITS[1]})  # the upload's commit
    pages = -(-len(hub.tree("videos")) // hub.hub.page_size)
    roots = ["hf://datasets/o/n", "hf://datasets/o/n@main", "hf://datasets/o/n@v1.1",
             f"hf://datasets/o/n@{COMMITS[1]}"]
    for position, root in enumerate(roots):
        start = len(hub.log)
        index = open_hub(root, tmp_path / f"user-{position}")
        assert (index.origin, index.indexed) == ("published", 0), root
        listed = [r for r in hub.log[start:] if "/tree/" in r.path]
        assert len(listed) == pages and all(COMMITS[1] in r.path for r in listed)
        assert not any(r.method == "HEAD" and r.path.endswith(".mp4") for r in hub.log[start:])
    monkeypatch.setenv(sidecar.CACHE_ENV, str(tmp_path / "trainer"))
    dataset = StreamingDataset("hf://datasets/o/n", seed=0, return_uint8=True)
    assert dataset.video_index.origin == "published"
    assert len(list(dataset)) == 6 + 5 + 7 + 4


def test_a_changed_video_on_the_hub_rebuilds_only_its_record(hub, tmp_path):
    maintainer = tmp_path / "maintainer"
    export_index(open_hub("hf://datasets/o/n", maintainer, Counting()),
                 hub.folder / sidecar.PUBLISHED_RELPATH)
    changed = hub_videos(hub)[1]
    encode_video(tmp_path / "new.mp4", pattern_frames(9), "libx264", 3, 0)
    hub.replace_file(changed, (tmp_path / "new.mp4").read_bytes())
    hub.hub.revisions["main"] = COMMITS[2]
    for cache, origin in ((maintainer, "built"), (tmp_path / "user", "built")):
        counting = Counting()
        index = open_hub("hf://datasets/o/n", cache, counting)
        assert (index.origin, index.indexed, counting.calls) == (origin, 1, [changed])
        assert len(MappedIndex(index)[changed]) == 9


def test_hub_identities_come_from_the_listing_in_pages(tmp_path, monkeypatch):
    contents = {f"sub/videos/cam{k % 3}/chunk-00{k % 2}/file-{k:04d}.mp4": b"%d" % k * 3
                for k in range(1000)}
    for relpath, content in contents.items():
        (tmp_path / relpath).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / relpath).write_bytes(content)
    (tmp_path / "sub/videos/notes.json").write_bytes(b"{}")  # not in LFS: its git blob id
    expected = {relpath.removeprefix("sub/"): (len(content),
                                              f"sha256:{hashlib.sha256(content).hexdigest()}")
                for relpath, content in contents.items()}
    expected["videos/notes.json"] = (2, "git-sha1:9e26dfeeb6e641a33dae4961196235bdb965b21b")
    with RangeServer(tmp_path, hub=HubConfig(revisions={"main": COMMITS[0]})) as server:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        source = open_source("hf://datasets/o/n/sub")  # the Hub's default page: 1000 entries
        start = len(server.log)
        assert source.content_identities([*expected, *expected]) == expected
        requests = server.log[start:]
        assert 1 < len(requests) <= 10 and all("/tree/" in r.path for r in requests)
        with pytest.raises(MalformedDataset, match="videos/missing.mp4"):
            source.content_identities(["videos/missing.mp4"])


def test_http_identities_are_one_head_per_file(tmp_path):
    from refstream.http import HTTPSource

    contents = {f"videos/cam{k % 3}/file-{k:03d}.mp4": os.urandom(100 + k) for k in range(20)}
    for relpath, content in contents.items():
        (tmp_path / relpath).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / relpath).write_bytes(content)
    with RangeServer(tmp_path) as server:
        source = HTTPSource(server.url)
        identities = source.content_identities([*contents, *contents])  # duplicates: once each
        methods = [r.method for r in server.log]
        source.close()
    assert identities == {r: (len(c), f"etag:{etag_of(c)}") for r, c in contents.items()}
    assert methods == ["HEAD"] * len(contents)


# --- processes, the lock, atomic installation ----------------------------------------------------


def spawn(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(HELPER), *args], env=ENV, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def wait_for(predicate, timeout_s: float = 60.0) -> None:
    """Until ``predicate()`` (a state another process reaches); the deadline is a hang guard."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.02)


def dead_pid() -> int:
    """The pid of a process that has exited."""
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


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
    wait_for(lambda: has_open(waiting.pid, cache / "index" / ".lock"))  # it polls the held lock
    # the holder's stdin closes first (its indexing goes on), then the waiting one's
    outputs = [b.communicate(timeout=120) for b in (holder, waiting)]
    assert [b.returncode for b in builders] == [0, 0], outputs
    assert [out.split()[0] for out, _ in outputs] == ["built", "cache"]
    assert sorted(line.split()[1] for line in log.read_text().splitlines()) == RELPATHS
    assert_matches_oracle(ensure(root, cache, indexer=never), root)


def test_a_killed_builder_keeps_the_records_it_finished(root, cache, tmp_path):
    """Each record is installed as its file finishes: a build killed while it indexes the
    second file leaves the first file's record, and the next open indexes only the others."""
    log = tmp_path / "indexed.log"
    builder = spawn("build", str(cache), str(root), str(log), "stdin")  # a file on each line
    wait_for(lambda: log.exists() and log.read_text())  # the first file waits for its line
    builder.stdin.write("\n")
    builder.stdin.flush()
    wait_for(lambda: len(log.read_text().splitlines()) >= 2)  # the second file waits now
    builder.send_signal(signal.SIGKILL)
    builder.wait(timeout=10)
    source = LocalSource(root)
    size, identity = source.size(RELPATHS[0]), source.identity(RELPATHS[0])
    assert [p.name for p in (cache / "index").glob("*.npy")] == [record_name(size, identity)]
    counting = Counting()
    index = ensure(root, cache, indexer=counting)
    assert sorted(counting.calls) == RELPATHS[1:] and temp_files(cache) == []
    assert_matches_oracle(index, root)


def test_a_held_lock_times_out_naming_the_lock(root, cache, monkeypatch, tmp_path):
    from refstream.stream import StreamingDataset
    from refstream.tools.demo import write_demo_dataset

    lock = cache / "index" / ".lock"
    lock.parent.mkdir(parents=True)
    holder = spawn("hold", str(lock))
    try:
        assert holder.stdout.readline().strip() == "held"
        started = time.monotonic()
        with pytest.raises(SidecarLockTimeout, match=re.escape(str(lock))) as caught:
            ensure(root, cache, lock_timeout_s=0.3)
        assert 0.3 <= time.monotonic() - started < 30  # the timeout, not the default 1800 s
        assert "0.3" in str(caught.value) and "waited" in str(caught.value)
        monkeypatch.setenv(sidecar.LOCK_TIMEOUT_ENV, "0.1")
        with pytest.raises(SidecarLockTimeout, match="timeout 0.1 s"):
            ensure(root, cache)
        # The dataset's own argument wins over the environment.
        lerobot = tmp_path / "lerobot"
        write_demo_dataset(lerobot, episode_lengths=(3, 4), episodes_per_video_file=2)
        monkeypatch.setenv(sidecar.CACHE_ENV, str(cache))
        monkeypatch.setenv(sidecar.LOCK_TIMEOUT_ENV, "0.05")
        with pytest.raises(SidecarLockTimeout, match="timeout 0.2 s"):
            StreamingDataset(lerobot, sidecar_lock_timeout_s=0.2)
    finally:
        holder.kill()
        holder.wait()
    assert ensure(root, cache).origin == "built"  # the lock is free again


@pytest.mark.parametrize("setting", ["half an hour", "-1", "nan"])
def test_a_malformed_lock_timeout_is_a_usage_error(root, cache, monkeypatch, setting):
    monkeypatch.setenv(sidecar.LOCK_TIMEOUT_ENV, setting)
    with pytest.raises(UsageError, match="REFSTREAM_SIDECAR_LOCK_TIMEOUT_S"):
        ensure(root, cache)
    monkeypatch.delenv(sidecar.LOCK_TIMEOUT_ENV)
    with pytest.raises(UsageError, match="sidecar_lock_timeout_s"):
        ensure(root, cache, lock_timeout_s=setting)


def test_a_failed_build_keeps_every_other_record_and_leaves_no_temp_files(root, cache):
    first = ensure(root, cache)
    kept = {r: record_of(first, r).read_bytes() for r in RELPATHS}
    bump_mtime(root / RELPATHS[2])

    def broken(read_range, file_size, path):
        raise MalformedMp4(f"{path}: stsz: entry count past the box (test)")

    with pytest.raises(MalformedMp4, match="stsz"):
        ensure(root, cache, indexer=broken)
    assert {r: record_of(first, r).read_bytes() for r in RELPATHS} == kept
    assert sorted(p.name for p in (cache / "index").glob("*.npy")) == sorted(
        record_of(first, r).name for r in RELPATHS)
    assert temp_files(cache) == []


def test_a_file_that_changes_while_it_is_indexed_is_not_recorded(root, cache):
    def changing(read_range, file_size, path):
        bump_mtime(root / path)  # someone rewrites the file meanwhile
        return pyav_indexer()(read_range, file_size, path)

    with pytest.raises(PayloadChanged, match="changed since indexed"):
        ensure(root, cache, indexer=changing)
    assert temp_files(cache) == []
    assert_matches_oracle(ensure(root, cache), root)  # the new versions, under their identities


def test_a_reader_keeps_the_record_it_mapped_when_a_new_one_is_installed(root, cache):
    """Installation is a rename: a worker that mapped a record keeps reading it (here: values
    no longer valid for the file), while a new one is built where the old one stood."""
    old = ensure(root, cache, indexer=synthetic_indexer(500, seed=1))
    held = MappedIndex(old)[RELPATHS[0]]
    before = {name: getattr(held, name).copy() for name in sidecar.ARRAY_FIELDS}
    path = record_of(old, RELPATHS[0])
    with open(path, "ab") as handle:  # no longer a valid record: the next open rebuilds it
        handle.write(b"\0" * 8)
    new = ensure(root, cache, indexer=synthetic_indexer(700, seed=2))
    assert record_of(new, RELPATHS[0]) == path and new.indexed == 1
    for name, values in before.items():
        np.testing.assert_array_equal(getattr(held, name), values, err_msg=name)
    assert len(MappedIndex(new)[RELPATHS[0]]) == 700


def test_a_crash_while_writing_leaves_the_old_file(root, cache, tmp_path):
    index = ensure(root, cache)
    output = tmp_path / "published" / "refstream-index.npz"
    export_index(index, output)
    old = output.read_bytes()
    last = max((record_of(index, r) for r in RELPATHS), key=lambda p: p.name)
    last.unlink()  # the export fails after it wrote the other records
    with pytest.raises(FileNotFoundError):
        export_index(index, output)
    assert output.read_bytes() == old
    assert temp_files(output.parent) == []


def test_another_job_never_deletes_a_live_jobs_files(root, cache):
    live = spawn("volatile", str(cache), str(root))
    try:
        paths = [Path(p) for p in live.stdout.readline().split()]
        assert len(paths) == 3 and all(p.exists() for p in paths)
        folder = cache / "index"
        mine = folder / f".tmp.{live.pid}.0123456789ab.x.npy"  # being written by the live job
        gone = folder / f".tmp.{dead_pid()}.0123456789ab.x.npy"  # left by a job that is gone
        mine.write_bytes(b"being written")
        gone.write_bytes(b"left behind")
        with pytest.warns(UserWarning, match="no stable identity"):
            ensure_with(pyav_indexer(), NoIdentitySource(root), RELPATHS, cache_root=cache)
        bump_mtime(root / RELPATHS[0])  # a build under the lock: it cleans up too
        ensure(root, cache)
        assert all(p.exists() for p in paths) and mine.exists() and not gone.exists()
    finally:
        live.kill()
        live.wait()
    with pytest.warns(UserWarning):  # the job is gone: its files go with the next job's cleanup
        ensure_with(pyav_indexer(), NoIdentitySource(root), RELPATHS, cache_root=cache)
    assert not any(p.exists() for p in paths) and not mine.exists()


def test_a_source_without_identity_is_indexed_on_every_open_with_a_warning(root, cache):
    for _ in range(2):
        counting = Counting()
        with pytest.warns(UserWarning, match=f"{RELPATHS[0]} and 2 more files have no stable"):
            index = ensure_with(counting, NoIdentitySource(root), RELPATHS, cache_root=cache)
        assert index.origin == "volatile" and sorted(counting.calls) == RELPATHS
        assert_matches_oracle(index, root)
    with pytest.raises(UsageError, match="no stable identity"):
        export_index(index, cache / "out.npz")


# --- corrupt records and published files ---------------------------------------------------------


def flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def rewrite(path: Path, change) -> None:
    """The record with its meta or arrays changed by ``change(meta, fields)``."""
    array = np.load(path, allow_pickle=False)
    meta = json.loads(array["meta"][0].tobytes())
    fields = {name: array[name][0] for name in array.dtype.names[2:]}
    change(meta, fields)
    text = json.dumps(meta).encode()
    dtype = [("sha256", "u1", (32,)), ("meta", "u1", (len(text),))]
    dtype += [(n, a.dtype, a.shape) for n, a in fields.items()]
    body = text + b"".join(a.tobytes() for a in fields.values())
    np.save(path, np.frombuffer(hashlib.sha256(body).digest() + body, np.dtype(dtype)))


CORRUPTIONS = {
    "truncated": lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]),
    "empty": lambda p: p.write_bytes(b""),
    "longer": lambda p: p.write_bytes(p.read_bytes() + b"\0"),
    "flipped header": lambda p: flip(p, 20),
    "flipped meta": lambda p: flip(p, 140),
    "another schema": lambda p: rewrite(p, lambda m, f: m.update(schema_version=1)),
    "another file's": lambda p: rewrite(p, lambda m, f: m.update(identity="etag:\"x\"")),
    "more samples": lambda p: rewrite(p, lambda m, f: m.update(samples=m["samples"] + 1)),
    "wider dtype": lambda p: rewrite(p, lambda m, f: f.update(pts=f["pts"].astype("<f8"))),
    "big-endian": lambda p: rewrite(p, lambda m, f: f.update(pts=f["pts"].astype(">i4"))),
    "a constant too many": lambda p: rewrite(p, lambda m, f: m["constants"].update(pts=0)),
}


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_a_corrupt_record_is_rebuilt_alone(root, cache, corruption):
    index = ensure(root, cache)
    CORRUPTIONS[corruption](record_of(index, RELPATHS[1]))
    record = index.records[RELPATHS[1]]
    with pytest.raises(SidecarInvalid):
        read_record(record.path, record.size, record.identity)
    counting = Counting()
    again = ensure(root, cache, indexer=counting)
    assert counting.calls == [RELPATHS[1]]
    assert_matches_oracle(again, root)


def test_record_headers_are_parsed_one_at_a_time(root, cache, monkeypatch):
    # numpy parses them with ast, whose recursion count CPython 3.11 shares between threads
    record = ensure(root, cache).records[RELPATHS[1]]
    load, held = np.load, []

    def load_noting_the_lock(*args, **kwargs):
        held.append(sidecar._HEADER_LOCK.locked())
        return load(*args, **kwargs)

    monkeypatch.setattr(np, "load", load_noting_the_lock)
    read_record(record.path, record.size, record.identity)
    assert held == [True]


def test_a_programming_error_while_reading_a_record_is_not_called_corrupt(root, cache,
                                                                           monkeypatch):
    record = ensure(root, cache).records[RELPATHS[1]]
    monkeypatch.setattr(sidecar, "_stored_arrays", lambda *args: None.missing)  # a bug
    with pytest.raises(AttributeError):
        read_record(record.path, record.size, record.identity)


def test_a_record_claiming_a_huge_header_is_refused_without_reading_it(tmp_path):
    import struct
    import tracemalloc

    path = tmp_path / record_name(1, "x")
    path.write_bytes(b"\x93NUMPY\x02\x00" + struct.pack("<I", 2**31) + b"{}")  # NPY 2.0
    tracemalloc.start()
    try:
        with pytest.raises(SidecarInvalid, match="NPY 1.0"):
            read_record(path, 1, "x")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


def test_changed_array_bytes_fail_the_digest(root, cache):
    index = ensure(root, cache)
    path = record_of(index, RELPATHS[0])
    flip(path, path.stat().st_size - 3)  # in the arrays: only the digest can tell
    record = index.records[RELPATHS[0]]
    read_record(path, record.size, record.identity)
    with pytest.raises(SidecarInvalid, match="digest"):
        read_record(path, record.size, record.identity, verify=True)


def test_a_published_index_is_checked_record_by_record(root, cache, tmp_path):
    built = ensure(root, cache)
    published = root / sidecar.PUBLISHED_RELPATH
    export_index(built, published)
    data = bytearray(published.read_bytes())
    member = data.find(record_of(built, RELPATHS[2]).name.encode(), 0)  # its local header
    data[member + 200] ^= 0xFF  # inside that record: the zip's CRC and its digest both fail
    published.write_bytes(bytes(data))
    counting = Counting()
    index = ensure(root, tmp_path / "fresh", indexer=counting)
    assert index.origin == "built" and counting.calls == [RELPATHS[2]]
    assert_matches_oracle(index, root)

    published.write_bytes(b"PK not a zip")
    counting = Counting()
    assert ensure(root, tmp_path / "third", indexer=counting).origin == "built"
    assert sorted(counting.calls) == RELPATHS


# Records that a ZIP's CRC cannot tell from good ones: only verifying each one refuses them.
UNVERIFIED = {
    "digest": lambda path: flip(path, path.stat().st_size - 3),  # array bytes, digest kept
    "dts decreases": lambda path: rewrite(path, lambda m, f: f.update(dts=f["dts"][::-1].copy())),
}


@pytest.mark.parametrize("check", list(UNVERIFIED))
def test_a_published_record_that_does_not_verify_is_indexed_again(root, cache, tmp_path, check):
    built = ensure(root, cache)
    UNVERIFIED[check](record_of(built, RELPATHS[0]))
    published = export_index(built, root / sidecar.PUBLISHED_RELPATH)
    with zipfile.ZipFile(published) as archive:
        assert archive.testzip() is None  # every member's CRC holds
    counting = Counting()
    index = ensure(root, tmp_path / "fresh", indexer=counting)
    assert counting.calls == [RELPATHS[0]]  # the others are taken from the published index
    assert_matches_oracle(index, root)


def test_an_unusable_cache_folder_is_a_sidecar_error_naming_it(root, tmp_path):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the cache folder should be")
    with pytest.raises(SidecarError, match="not-a-folder"):
        ensure(root, blocker)


# --- sharing between workers, logging, progress ------------------------------------------------

# Run in a second process: map the index, touch every array, report the records' smaps.
SMAPS_PROBE = """
import json, pickle, re, sys
from refstream.sidecar import MappedIndex
index = pickle.loads(bytes.fromhex(sys.argv[1]))
mapped = MappedIndex(index)
total = sum(int(getattr(mapped[r], n).sum()) for r in index.records for n in
            ("dts", "pts", "offset", "size", "keyframe"))
paths = {record.path for record in index.records.values()}
fields, ours = {}, False
with open("/proc/self/smaps") as smaps:
    for line in smaps:
        parts = line.split()
        if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
            ours = len(parts) >= 6 and parts[5] in paths
            if ours:
                fields["perms"] = parts[1]
        elif ours and len(parts) == 3 and parts[2] == "kB":
            fields[parts[0][:-1]] = fields.get(parts[0][:-1], 0) + int(parts[1])
print(json.dumps({"total": total, **fields}))
"""


def test_workers_map_the_records_read_only_and_share_their_pages(root, cache):
    import pickle

    index = ensure(root, cache, indexer=synthetic_indexer(150_000))
    size = sum(record_of(index, r).stat().st_size for r in RELPATHS)
    assert size > 2_000_000  # large enough for the page counts to mean something
    mapped = MappedIndex(index)
    total = sum(int(getattr(mapped[r], n).sum()) for r in index.records for n in
                ("dts", "pts", "offset", "size", "keyframe"))
    probe = subprocess.run([sys.executable, "-c", SMAPS_PROBE, pickle.dumps(index).hex()],
                           env=ENV, capture_output=True, text=True, timeout=60, check=True)
    report = json.loads(probe.stdout)
    assert report["total"] == total
    assert report["perms"] == "r--s"  # read-only, shared, backed by the file
    assert report["Private_Dirty"] == 0 and report["Anonymous"] == 0
    assert report["Rss"] * 1024 >= size * 0.9
    assert report["Shared_Clean"] >= report["Rss"] * 0.9
    assert report["Pss"] <= report["Rss"] * 0.6  # each resident page is split between two


def test_the_origin_and_progress_are_logged_and_the_library_draws_nothing(root, cache,
                                                                           monkeypatch, caplog):
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    caplog.set_level(logging.INFO, logger="refstream")
    monkeypatch.setattr(sys, "stderr", Terminal())
    for every_s in (3600.0, 0.0):
        monkeypatch.setattr(sidecar, "PROGRESS_EVERY_S", every_s)
        shutil.rmtree(cache, ignore_errors=True)
        caplog.clear()
        ensure(root, cache)
        logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("indexing")]
        assert logged == ([] if every_s else ["indexing video files: 1/3",
                                              "indexing video files: 2/3",
                                              "indexing video files: 3/3"])
    assert "video index of 3 files" in caplog.text and "3 built" in caplog.text
    assert sys.stderr.getvalue() == ""
    shutil.rmtree(cache, ignore_errors=True)
    calls = []
    ensure(root, cache, progress=lambda done, total: calls.append((done, total)))
    assert calls == [(1, 3), (2, 3), (3, 3)]
    ensure(root, cache)
    assert "3 cached" in caplog.records[-1].getMessage()


def test_the_index_command_draws_progress_on_a_terminal(monkeypatch):
    from refstream.tools.cli import draw_index_progress

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    for stderr, drawn in ((Terminal(), "\rindexing video files: 1/2\rindexing video files: 2/2\n"),
                          (io.StringIO(), "")):
        monkeypatch.setattr(sys, "stderr", stderr)
        draw_index_progress(1, 2)
        draw_index_progress(2, 2)
        assert stderr.getvalue() == drawn


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
    assert first["origin"] == "built" and first["files"] == first["indexed"] == len(videos) == 4
    assert first["samples"] == sum(len(o.pts) for o in oracles.values()) == 2 * 18
    assert first["video_bytes"] == sum((root / v).stat().st_size for v in videos)
    assert first["index_bytes"] <= 20 * first["samples"] + 4 * 1200  # a little meta per file
    assert published.exists() and first["output"] == str(published)

    assert main(["index", str(root), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["origin"] == "cache"
    monkeypatch.setenv(sidecar.CACHE_ENV, str(tmp_path / "other-cache"))
    assert main(["index", str(root), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["origin"] == "published"


# --- conformance cases ---------------------------------------------------------------------

RECORD_CASES = sorted((FIXTURES / "sidecar").glob("*.json"))


@pytest.mark.parametrize("path", RECORD_CASES, ids=lambda p: p.stem)
def test_record_cases_match_the_oracle_and_the_adapter(path):
    case = json.loads(path.read_text())
    assert case["kind"] == "sidecar_record"
    assert oracle_sidecar_record(case["input"]) == case["expected"]
    assert adapters.kind_sidecar_record(case["input"]) == case["expected"]


def test_there_are_record_cases():
    assert len(RECORD_CASES) >= 15


MAP_MANY = """
import resource, sys
from refstream.errors import SidecarError
from refstream.sidecar import MappedIndex, Record, VideoIndex
path, size, identity, soft, hard = sys.argv[1:]
resource.setrlimit(resource.RLIMIT_NOFILE, (int(soft), int(hard)))
record = Record(int(size), identity, path)  # 300 video files, standing in with one record file
mapped = MappedIndex(VideoIndex({f"v{i}.mp4": record for i in range(300)}, "cache", 0))
try:
    print(sum(len(mapped[relpath]) for relpath in mapped.index.records))
except SidecarError as exc:
    print(type(exc).__name__, exc)
print(resource.getrlimit(resource.RLIMIT_NOFILE)[0])
"""


@pytest.mark.parametrize("soft, hard", [(64, 20000), (100, 100)])
def test_mapping_more_records_than_the_open_file_limit(root, cache, soft, hard):
    """Each mapped record holds a descriptor: the soft limit is raised for every record within
    the hard one; past the hard one, the error names the limit, not a corrupt record."""
    index = ensure(root, cache)
    record = index.records[RELPATHS[0]]
    args = [record.path, str(record.size), record.identity, str(soft), str(hard)]
    done = subprocess.run([sys.executable, "-c", MAP_MANY, *args], capture_output=True,
                          text=True, timeout=120, check=True)
    answer, limit = done.stdout.splitlines()
    if hard >= 300 + sidecar.FILES_BESIDE_RECORDS:
        assert answer == str(300 * len(MappedIndex(index)[RELPATHS[0]]))
        assert int(limit) == 300 + sidecar.FILES_BESIDE_RECORDS
    else:
        assert answer.startswith("SidecarError ") and "ulimit -n" in answer
        assert "Too many open files" in answer and int(limit) == hard
        assert "the open-file limit (ulimit -n) is 100" in done.stderr
