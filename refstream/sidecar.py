"""The video index: every video file's :class:`refstream.mp4.SampleIndex`, kept on disk so that
training starts without reading a ``moov`` again, one *record* per size and content (SPEC §10).
Use::

    relpaths = meta.video_files()                # every video file of the complete dataset
    index = ensure_index(source, relpaths)       # main process: cached, published or built
    mapped = MappedIndex(index)                  # in each worker: relpath -> SampleIndex

The ``refstream.sidecar`` logger says at INFO where the index came from, and a build's progress
when ``ensure_index`` is given no ``progress``.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import io
import json
import logging
import os
import re
import resource
import shutil
import struct
import threading
import time
import tokenize
import warnings
import zipfile
import zlib
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from refstream.errors import (
    RefstreamError,
    SidecarError,
    SidecarInvalid,
    SidecarLockTimeout,
    UsageError,
)
from refstream.meta import parse_json
from refstream.mp4 import SampleIndex, parse_index
from refstream.source import RangeFile, Source

__all__ = ["Record", "VideoIndex", "MappedIndex", "ensure_index", "read_record", "record_bytes",
           "record_name", "storage_dtype", "lock_timeout", "cache_folder", "default_cache_root",
           "install", "fsync_directory", "pin_identities"]

log = logging.getLogger(__name__)

SCHEMA = "refstream-index"
SCHEMA_VERSION = 2
PUBLISHED_RELPATH = "meta/refstream-index.npz"
CACHE_ENV = "REFSTREAM_CACHE"
LOCK_TIMEOUT_ENV = "REFSTREAM_SIDECAR_LOCK_TIMEOUT_S"
DEFAULT_LOCK_TIMEOUT_S = 1800.0  # a cold index of a large remote dataset can take many minutes
LOCK_POLL_S = 0.05
PROGRESS_EVERY_S = 2.0  # without a progress callback, a build logs its progress this often
PUBLISHED_READ_BYTES = 8 << 20  # the published file is read in ranges this large
FILES_BESIDE_RECORDS = 1024  # open files a process needs beside its mapped index records
ARRAY_FIELDS = ("dts", "pts", "duration", "size", "offset", "keyframe")
SCALAR_FIELDS = ("codec", "width", "height", "track_id", "timescale", "movie_timescale")
# Storage dtypes of integer arrays, narrowest first (SPEC §10.2); flags are stored as |b1.
NARROW_DTYPES = tuple(np.dtype(t) for t in ("|u1", "|i1", "<u2", "<i2", "<u4", "<i4", "<i8"))
FLAG_DTYPE = np.dtype("|b1")
# Records are NPY 1.0: numpy reads a header whole, and 1.0's is at most 64 KiB.
NPY_1_0 = b"\x93NUMPY\x01\x00"
# Files of one process: .tmp.<pid>.<hex>.<final name> and .volatile.<pid>.<hex>.<k>.npy.
OWNED = re.compile(r"^\.(?:tmp|volatile)\.(\d+)\.")
# What numpy raises on a corrupt NPY file: the header is a Python literal it tokenizes.
CORRUPT_NPY = (OSError, ValueError, EOFError, SyntaxError, tokenize.TokenError)
# numpy parses an NPY header with ast.literal_eval. CPython 3.11 counts AST recursion in state its
# threads share (python/cpython#106905), so headers parsed at once by index and fetch threads can
# fail with SystemError: one header is parsed at a time.
_HEADER_LOCK = threading.Lock()
# What zipfile raises on a corrupt archive (RuntimeError: an encrypted member).
CORRUPT_ZIP = (OSError, ValueError, EOFError, RuntimeError, NotImplementedError,
               zipfile.BadZipFile, struct.error, zlib.error)

@dataclass(frozen=True)
class Record:
    """Where one video file's index lives, and the content it describes."""

    size: int  # bytes of the video file
    identity: str  # its content identity (SPEC §10.1); "" for a volatile record
    path: str  # the record file


@dataclass(frozen=True)
class VideoIndex:
    """Every video file's record as :func:`ensure_index` found them (picklable: workers get it)."""

    records: dict[str, Record]  # relpath -> record
    origin: str  # "cache", "published", "built" or "volatile": the last place records came from
    indexed: int  # files this call indexed


def default_cache_root() -> Path:
    """``$REFSTREAM_CACHE``, else ``~/.cache/refstream``."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "refstream")


def cache_folder(cache_root: str | Path | None = None) -> Path:
    """Where records are cached: ``<cache root>/index``."""
    return Path(cache_root if cache_root is not None else default_cache_root()) / "index"


def record_name(size: int, identity: str) -> str:
    """The record file name of a file of ``size`` bytes and content ``identity`` (SPEC §10.2)."""
    return hashlib.sha256(f"{size} {identity}".encode()).hexdigest() + ".npy"


# --- one record ------------------------------------------------------------------------------


def storage_dtype(values: np.ndarray) -> np.dtype | None:
    """The dtype an array is stored in; None when it is constant or empty (SPEC §10.2)."""
    if values.size == 0 or bool((values == values[0]).all()):
        return None
    if values.dtype == bool:
        return FLAG_DTYPE
    low, high = int(values.min()), int(values.max())
    return next(d for d in NARROW_DTYPES if np.iinfo(d).min <= low and high <= np.iinfo(d).max)


def record_bytes(index: SampleIndex, identity: str) -> bytes:
    """The record file of ``index``, the index of a file with content ``identity``."""
    stored, constants = {}, {}
    for name in ARRAY_FIELDS:
        values = np.asarray(getattr(index, name))
        dtype = storage_dtype(values)
        if dtype is None:
            constants[name] = values[0].item() if values.size else values.dtype.type(0).item()
        else:
            stored[name] = values.astype(dtype)
    meta = {"schema": SCHEMA, "schema_version": SCHEMA_VERSION, "identity": identity,
            "size": int(index.file_size), "samples": len(index), "ftyp": index.ftyp.hex(),
            "stsd": index.stsd.hex(), "codec": str(index.codec), "constants": constants,
            **{name: int(getattr(index, name)) for name in SCALAR_FIELDS[1:]}}
    text = json.dumps(meta, sort_keys=True, separators=(",", ":")).encode()
    body = text + b"".join(array.tobytes() for array in stored.values())
    fields = [("sha256", "|u1", (32,)), ("meta", "|u1", (len(text),))]
    fields += [(name, array.dtype, array.shape) for name, array in stored.items()]
    buffer = io.BytesIO()
    np.save(buffer, np.frombuffer(hashlib.sha256(body).digest() + body, np.dtype(fields)),
            allow_pickle=False)
    return buffer.getvalue()


def read_record(file: str | Path | BinaryIO, size: int, identity: str, relpath: str = "", *,
                verify: bool = False) -> SampleIndex:
    """The ``SampleIndex`` a record holds for file ``relpath`` (``size`` bytes, content
    ``identity``), its arrays read-only views; else ``SidecarInvalid`` (SPEC §10.3)."""
    mapped = isinstance(file, str | Path)
    try:
        with open(file, "rb") if mapped else contextlib.nullcontext(file) as handle:
            head = handle.read(len(NPY_1_0))
            handle.seek(-len(head), io.SEEK_CUR)  # numpy reads a file object from here
        if head != NPY_1_0:
            raise ValueError("not an NPY 1.0 file")
        with _HEADER_LOCK:
            array = np.load(file, mmap_mode="r" if mapped else None, allow_pickle=False)
        index = _parse_record(array, size, identity, relpath)
        if mapped and os.path.getsize(file) != array.offset + array.dtype.itemsize:
            raise ValueError("the file is longer than its array")
        if verify:
            data = array.view(np.uint8)
            if hashlib.sha256(data[32:]).digest() != data[:32].tobytes():
                raise ValueError("the record does not match its digest")
            if np.any(index.dts[1:] < index.dts[:-1]):
                raise ValueError("dts decreases")  # spans are found by searching dts
    except CORRUPT_NPY as exc:
        if getattr(exc, "errno", None) in (errno.EMFILE, errno.ENFILE):  # not the record's fault
            raise SidecarError(f"{file}: cannot open the index record of {relpath or 'the file'}"
                               f" ({exc}): a worker keeps each video file's record open; raise "
                               "the open-file limit (ulimit -n) above the video files") from exc
        raise SidecarInvalid(f"{file}: not a valid index record of {relpath or 'the file'} "
                             f"({type(exc).__name__}: {exc})") from exc
    return index


def _parse_record(array: np.ndarray, size: int, identity: str, relpath: str) -> SampleIndex:
    """The index in a loaded record; ValueError unless valid for ``size`` and ``identity``."""
    names = array.dtype.names or ()
    if array.shape != (1,) or names[:2] != ("sha256", "meta") \
            or array.dtype["sha256"] != np.dtype(("u1", (32,))) \
            or array.dtype["meta"].base != np.uint8 or len(array.dtype["meta"].shape) != 1:
        raise ValueError(f"array {array.dtype}{array.shape} is not a record")
    meta = _record_meta(array["meta"][0].tobytes(), size, identity)
    arrays = _stored_arrays(array, meta["samples"], names[2:], meta["constants"])
    for name, value in meta["constants"].items():
        kind = bool if name == "keyframe" else int
        if type(value) is not kind or not -(2**63) <= value < 2**63:
            raise ValueError(f"constant {name} {value!r}")
        arrays[name] = np.broadcast_to(np.array(value, np.int64 if kind is int else bool),
                                       (meta["samples"],))
    return SampleIndex(path=relpath, file_size=size, ftyp=bytes.fromhex(meta["ftyp"]),
                       stsd=bytes.fromhex(meta["stsd"]),
                       **{name: meta[name] for name in SCALAR_FIELDS}, **arrays)


def _record_meta(text: bytes, size: int, identity: str) -> dict:
    """A record's JSON meta, checked to describe ``size`` and ``identity`` (SPEC §10.2)."""
    meta = parse_json(text, "its meta", error=SidecarInvalid)
    expected = {"schema": SCHEMA, "schema_version": SCHEMA_VERSION, "identity": identity,
                "size": size}
    if not isinstance(meta, dict) or {key: meta.get(key) for key in expected} != expected:
        got = [meta.get(key) for key in expected] if isinstance(meta, dict) else meta
        raise ValueError(f"describes {got}, not {expected}")
    integers = [meta.get(name) for name in ("samples", *SCALAR_FIELDS[1:])]
    if not (all(type(v) is int for v in integers) and meta["samples"] >= 0
            and meta["timescale"] > 0 and isinstance(meta.get("codec"), str)
            and all(isinstance(meta.get(name), str) for name in ("ftyp", "stsd"))
            and isinstance(meta.get("constants"), dict)):
        raise ValueError("bad meta fields")
    return meta


def _stored_arrays(array: np.ndarray, count: int, names: tuple[str, ...],
                   constants: dict) -> dict[str, np.ndarray]:
    """The record's stored arrays as read-only views; ValueError unless SPEC §10.3 allows them."""
    if list(names) != [name for name in ARRAY_FIELDS if name not in constants] \
            or not set(constants) <= set(ARRAY_FIELDS):
        raise ValueError(f"stored arrays {names} and constants {sorted(constants)}")
    arrays = {}
    for name in names:
        field = array.dtype[name]
        allowed = (FLAG_DTYPE,) if name == "keyframe" else NARROW_DTYPES
        if field.shape != (count,) or field.base not in allowed:
            raise ValueError(f"{name} is {field}, expected one of {allowed} x ({count},)")
        arrays[name] = np.asarray(array[name][0])  # an ndarray view: memmap slicing is slow
        arrays[name].flags.writeable = False
    return arrays


# --- finding, building and installing ----------------------------------------------------------


def ensure_index(source: Source, relpaths: Sequence[str], *,
                 cache_root: str | Path | None = None, workers: int = 8,
                 lock_timeout_s: float | None = None,
                 progress: Callable[[int, int], object] | None = None,
                 check: Callable[[str, SampleIndex], object] | None = None) -> VideoIndex:
    """Every video file's record: cached, published or built (module docstring, SPEC §10.5);
    ``check(relpath, index)`` sees each file's index once, from the read that validates it."""
    started = time.monotonic()
    timeout_s = lock_timeout(lock_timeout_s)
    folder = cache_folder(cache_root)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SidecarError(f"cannot create the index cache {folder} ({exc}); set {CACHE_ENV} "
                           "to a writable folder") from exc
    identities = source.content_identities(relpaths)
    records = {relpath: Record(size, identity, str(folder / record_name(size, identity)))
               for relpath, (size, identity) in identities.items() if identity}
    volatile = _volatile_records(folder, identities, records)
    _index_files(source, volatile, workers, progress)
    published, missing = 0, _missing(records, check)
    if missing:
        with _exclusive(folder / ".lock", timeout_s):
            _remove_orphans(folder)
            missing = _missing(missing, check)  # another process may have installed them
            if missing:
                published = _take_published(source, missing)
                missing = _missing(missing, check)
            _index_files(source, missing, workers, progress)  # what is still missing is built here
            fsync_directory(folder)
    for relpath, record in {**missing, **volatile}.items() if check else ():  # built here
        check(relpath, read_record(record.path, record.size, record.identity, relpath))
    counts = {"cached": len(records) - published - len(missing), "published": published,
              "built": len(missing), "volatile": len(volatile)}
    origin = next((o for o in ("volatile", "built", "published") if counts[o]), "cache")
    log.info("video index of %d files in %.2f s: %s (%s)", len(identities),
             time.monotonic() - started, ", ".join(f"{n} {o}" for o, n in counts.items() if n),
             folder)
    return VideoIndex({**records, **volatile}, origin, counts["built"] + counts["volatile"])


class MappedIndex(dict):
    """``relpath -> SampleIndex`` of a :class:`VideoIndex`, each mapped read-only on first use
    (holds only the records mapped so far: iterate ``index.records`` for every relpath)."""

    def __init__(self, index: VideoIndex | None) -> None:
        super().__init__()
        self.index = index
        if index is not None:  # None: a dataset without cameras, nothing to map
            _allow_open_records(len(index.records))

    def __missing__(self, relpath: str) -> SampleIndex:
        record = self.index.records[relpath]
        self[relpath] = read_record(record.path, record.size, record.identity, relpath)
        return self[relpath]


def _allow_open_records(records: int) -> None:
    """A mapped record keeps a file descriptor: make room for ``records`` of them, or warn."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = records + FILES_BESIDE_RECORDS
    if soft != resource.RLIM_INFINITY and soft < wanted:
        raised = wanted if hard == resource.RLIM_INFINITY else min(hard, wanted)
        resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
        if raised < wanted:
            log.warning("the open-file limit (ulimit -n) is %d, and a worker may keep the "
                        "index records of %d video files open: raise it", hard, records)


def lock_timeout(value: float | str | None = None) -> float:
    """Seconds to wait for another build's lock, as SPEC §10.6 says; else a ``UsageError``."""
    if value is None:
        value = os.environ.get(LOCK_TIMEOUT_ENV, DEFAULT_LOCK_TIMEOUT_S)
    with contextlib.suppress(TypeError, ValueError):
        seconds = float(value)
        if seconds >= 0:
            return seconds
    raise UsageError(f"index lock timeout {value!r} (sidecar_lock_timeout_s, else "
                     f"{LOCK_TIMEOUT_ENV}): expected seconds, a number >= 0")


def _missing(records: dict[str, Record], check=None) -> dict[str, Record]:
    """The ``records`` whose file is absent or not valid; ``check`` sees each valid one."""
    missing = {}
    for relpath, record in records.items():
        if not os.path.exists(record.path):
            missing[relpath] = record
            continue
        try:
            index = read_record(record.path, record.size, record.identity, relpath)
        except SidecarInvalid as exc:
            log.info("%s: indexing again", exc)
            missing[relpath] = record
            continue
        if check:
            check(relpath, index)
    return missing


def _install_record(relpath: str, record: Record, write: Callable[[BinaryIO], object]) -> None:
    install(Path(record.path), write,
            lambda path: read_record(path, record.size, record.identity, relpath, verify=True))


def _take_published(source: Source, wanted: dict[str, Record]) -> int:
    """Install the ``wanted`` records that the dataset's published index holds; how many."""
    taken = 0
    size = source.size_if_present(PUBLISHED_RELPATH)
    if size is None:
        return 0  # the dataset publishes no index
    try:
        reader = io.BufferedReader(RangeFile(source, PUBLISHED_RELPATH, size),
                                   max(1, min(size, PUBLISHED_READ_BYTES)))
        with zipfile.ZipFile(reader) as archive:
            members = set(archive.namelist())
            for relpath, record in wanted.items():
                name = Path(record.path).name
                if name not in members:
                    continue
                try:
                    with archive.open(name) as member:  # copied in pieces, never held whole
                        _install_record(relpath, record, lambda f: shutil.copyfileobj(member, f))
                    taken += 1
                except SidecarInvalid as exc:  # this record alone is indexed
                    log.info("%s: %s", PUBLISHED_RELPATH, exc)
    except (RefstreamError, *CORRUPT_ZIP) as exc:
        log.info("%s is not usable, the rest is indexed: %s", PUBLISHED_RELPATH, exc)
    log.info("%s held records for %d of the %d files without one", PUBLISHED_RELPATH, taken,
             len(wanted))
    return taken


def _index_files(source: Source, records: dict[str, Record], workers: int,
                 progress: Callable[[int, int], object] | None) -> None:
    def index_one(relpath: str, record: Record) -> None:
        index = parse_index(lambda offset, length: source.read_range(relpath, offset, length),
                            record.size, relpath)
        _install_record(relpath, record, lambda f: f.write(record_bytes(index, record.identity)))

    pin_identities(source, records)
    logged = time.monotonic()
    pool = ThreadPoolExecutor(max(1, min(workers, len(records))),
                              thread_name_prefix="refstream-index")
    try:
        futures = [pool.submit(index_one, *item) for item in records.items()]
        for done, future in enumerate(as_completed(futures), start=1):
            future.result()
            if progress:
                progress(done, len(records))
            elif time.monotonic() - logged >= PROGRESS_EVERY_S:
                logged = time.monotonic()
                log.info("indexing video files: %d/%d", done, len(records))
    finally:
        pool.shutdown(cancel_futures=True)  # after a failure, index no further file


def pin_identities(source: Source, records: dict[str, Record]) -> None:
    """A later read of a file of ``records`` finding other content: PayloadChanged (SPEC §10.1)."""
    for relpath, record in records.items():
        if record.identity:
            source.expect_identity(relpath, record.identity)


def _volatile_records(folder: Path, identities: dict[str, tuple[int, str]],
                      records: dict[str, Record]) -> dict[str, Record]:
    """This process's own records of the files without identity, named in a warning (SPEC §10.7)."""
    unstable = sorted(set(identities) - set(records))
    if not unstable:
        return {}
    more = f" and {len(unstable) - 1} more files have" if len(unstable) > 1 else " has"
    warnings.warn(f"{unstable[0]}{more} no stable identity (no content hash, ETag or "
                  "Last-Modified): indexed again on every open", stacklevel=3)
    _remove_orphans(folder)
    own = f".volatile.{os.getpid()}.{os.urandom(6).hex()}"
    return {relpath: Record(identities[relpath][0], "", str(folder / f"{own}.{position}.npy"))
            for position, relpath in enumerate(unstable)}


# --- atomic files and the lock ---------------------------------------------------------------


def install(destination: Path, write: Callable[[BinaryIO], object],
             check: Callable[[Path], object] | None = None) -> None:
    """Write a temp file beside ``destination``, fsync it, ``check`` it, ``os.replace`` it."""
    temp = destination.with_name(f".tmp.{os.getpid()}.{os.urandom(6).hex()}.{destination.name}")
    try:
        with open(temp, "xb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        if check is not None:
            check(temp)
        os.replace(temp, destination)
    finally:
        temp.unlink(missing_ok=True)


def fsync_directory(directory: Path) -> None:
    """Make the renames into ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_orphans(folder: Path) -> None:
    """Delete the temp and volatile files in ``folder`` whose process is gone."""
    for path in folder.iterdir():
        match = OWNED.match(path.name)
        if match and not _process_alive(int(match[1])):
            log.info("removing %s left by a process that is gone", path)
            path.unlink(missing_ok=True)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # it exists, owned by someone else
    return True


@contextlib.contextmanager
def _exclusive(lock_path: Path, timeout_s: float) -> Iterator[None]:
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise SidecarError(f"cannot open the index lock {lock_path} ({exc})") from exc
    try:
        started = time.monotonic()
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                waited = time.monotonic() - started
                if waited >= timeout_s:
                    raise SidecarLockTimeout(
                        f"waited {waited:.1f} s for the index lock {lock_path} held by another "
                        f"build (timeout {timeout_s} s: set {LOCK_TIMEOUT_ENV} or "
                        "sidecar_lock_timeout_s to change it)") from None
                time.sleep(min(LOCK_POLL_S, timeout_s - waited))
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock
