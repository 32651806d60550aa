"""The sidecar: one persistent per-sample index of every MP4 file of a dataset.

Training needs each video file's sample table (``refstream.mp4.SampleIndex``) before it fetches a
byte; reading every ``moov`` again on each start would cost one round trip per file. The sidecar
keeps them in two files per dataset, in a cache directory keyed by the dataset's identity:

``index.npz`` — canonical, portable (``numpy.savez``, read with ``allow_pickle=False`` only)
    ``manifest``: the UTF-8 JSON manifest as a ``uint8`` array; ``dts``, ``pts``, ``duration``,
    ``size``, ``offset`` (``int64``) and ``keyframe`` (``bool``): every file's ``SampleIndex``
    arrays concatenated in manifest order. The manifest holds the schema and version, the dataset
    identity (``root``, ``revision``) and per file: ``relpath``, ``size``, ``fingerprint``,
    ``samples`` and the scalar ``SampleIndex`` fields (``ftyp`` and ``stsd`` as hex).
``index.compact`` — what workers map (``np.memmap`` mode ``"r"``, shared page cache)
    ``b"RSIDXC01"`` | header length (``uint64`` LE) | SHA-256 of every byte after these 48 |
    header JSON ``{"manifest": …, "arrays": [{field: block}, …]}`` | data. A block is
    ``{"dtype": "<u2", "offset": o}`` — the array stored in the smallest dtype holding every value
    exactly, at an 8-aligned absolute offset — or ``{"value": v}`` for a constant array, stored
    once. Each array has the file's ``samples`` elements.

Usage (``refstream index ROOT [--output PATH] [--workers N]`` does the same from the shell)::

    source = refstream.source.open_source(root)
    relpaths = video_relpaths(load_meta(source))          # every video file of the dataset
    dataset = dataset_identity(root, source, relpaths)    # what the cache is keyed by
    location = ensure_index(source, relpaths, dataset)    # find or build (main process)
    index = map_index(location.compact_path)              # in each worker: relpath -> SampleIndex
    export_npz(location, "ROOT/meta/refstream-index.npz") # to publish it with the dataset

(``open_index(source, relpaths, dataset)`` is ``ensure_index`` then ``map_index``.)

``source`` has ``read_range(relpath, offset, length)``, ``size(relpath)`` and
``identity(relpath)`` (a fingerprint: ETag, mtime, commit — ``""`` or ``None`` if it has none;
``refstream.source`` sources qualify);
``relpaths`` are every video file of the *complete* dataset, so any episode selection can use
the index. ``ensure_index`` looks in this order:

1. the cache, ``$REFSTREAM_CACHE`` (default ``~/.cache/refstream``) ``/sidecars/<digest>/``,
   ``digest`` = first 16 hex of SHA-256 of the canonical JSON of schema version and identity;
2. a published index inside the dataset, ``meta/refstream-index.npz``, copied into the cache;
3. a local build: every file indexed in parallel (``workers`` threads) with progress.

A candidate is used only if it validates: schema and version, dataset identity, the exact set of
files with the current size and fingerprint of each, array dtypes and lengths (and the compact
file's digest and bounds). Otherwise it is replaced: a valid ``index.npz`` yields a fresh
``index.compact``; else the index is built; a build that does not validate against the files as
they are afterwards (they changed meanwhile) is built once more, then ``SidecarInvalid``. A
commit-pinned dataset (``dataset.revision`` set, every fingerprint ``commit:<revision>``) cannot
change under its commit, so a cached compact index of exactly its files is used without asking the
source anything (no ``HEAD`` per video file).

Writing happens under an exclusive ``fcntl.flock`` on ``<dir>/.lock``, polled until
``$REFSTREAM_SIDECAR_LOCK_TIMEOUT_S`` (default 1800 s; then ``SidecarLockTimeout`` naming the lock
and the wait). Files are written to ``.tmp.<pid>.<random>.<name>`` in the same directory, fsynced
and installed with ``os.replace``, so a failed or killed build never replaces a valid file; the
next writer deletes temp files whose process is gone. A source with no fingerprint for some file
cannot be cached safely: it is indexed again on every open, with a warning naming the file, into
a per-process file under ``volatile/``.

``map_index`` returns a :class:`CompactIndex`, a read-only mapping ``relpath -> SampleIndex``.
Its arrays have the canonical dtypes (``int64``, ``keyframe`` ``bool``) and are read-only: stored
``int64``/``bool`` arrays are zero-copy views of the mapping, constant arrays are zero-copy
broadcasts, narrower arrays are widened into a private ``int64`` copy the first time that file is
looked up (so arithmetic such as ``pts - dts`` can never wrap). ``CompactIndex.stored`` gives the
narrow zero-copy views themselves.
"""

from __future__ import annotations

import fcntl
import hashlib
import io
import json
import logging
import os
import re
import struct
import sys
import time
import tokenize
import uuid
import warnings
import zipfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np

from refstream.errors import (
    RefstreamError,
    SidecarError,
    SidecarInvalid,
    SidecarLockTimeout,
    UsageError,
)

if TYPE_CHECKING:
    from refstream.meta import DatasetMeta
    from refstream.mp4 import SampleIndex

__all__ = [
    "IndexSource",
    "DatasetIdentity",
    "FileState",
    "BuildSummary",
    "IndexLocation",
    "CompactIndex",
    "ensure_index",
    "open_index",
    "map_index",
    "build_npz",
    "read_npz",
    "file_states",
    "cache_directory",
    "default_cache_root",
    "video_relpaths",
    "dataset_identity",
    "export_npz",
]

log = logging.getLogger(__name__)

SCHEMA = "refstream-sidecar"
SCHEMA_VERSION = 1
COMPACT_MAGIC = b"RSIDXC01"
COMPACT_PREFIX = 48  # magic (8) + header length (8) + SHA-256 (32)
ALIGN = 8  # every stored array starts at a multiple of 8 bytes, so any dtype view is aligned
PUBLISHED_RELPATH = "meta/refstream-index.npz"
CACHE_ENV = "REFSTREAM_CACHE"
LOCK_TIMEOUT_ENV = "REFSTREAM_SIDECAR_LOCK_TIMEOUT_S"
DEFAULT_LOCK_TIMEOUT_S = 1800.0  # a cold index of a large remote dataset can take many minutes
LOCK_POLL_S = 0.05
INT_FIELDS = ("dts", "pts", "duration", "size", "offset")
ARRAY_FIELDS = (*INT_FIELDS, "keyframe")
INT_SCALAR_FIELDS = ("width", "height", "track_id", "timescale", "movie_timescale")
SCALAR_FIELDS = ("codec", *INT_SCALAR_FIELDS)
# Candidate storage dtypes, narrowest first; the first that holds [min, max] is used.
NARROW_DTYPES = tuple(np.dtype(t) for t in ("u1", "i1", "<u2", "<i2", "<u4", "<i4", "<i8"))
TEMP_PATTERN = re.compile(r"^\.tmp\.(\d+)\.[0-9a-f]+\.")
VOLATILE_PATTERN = re.compile(r"^(\d+)\.[0-9a-f]+\.compact$")

Indexer = Callable[[Callable[[int, int], bytes], int, str], "SampleIndex"]
Progress = Callable[[int, int, str], None]  # (files done, files total, relpath just indexed)


class IndexSource(Protocol):
    """What the sidecar needs of a dataset's storage (``refstream.source`` sources have it)."""

    def read_range(self, relpath: str, offset: int, length: int) -> bytes: ...

    def size(self, relpath: str) -> int: ...

    def identity(self, relpath: str) -> str | None: ...


@dataclass(frozen=True)
class DatasetIdentity:
    root: str  # the dataset root as given: a folder, a base URL, hf://datasets/OWNER/NAME
    revision: str | None = None  # pinned commit for Hub datasets, None otherwise


@dataclass(frozen=True)
class FileState:
    relpath: str
    size: int  # bytes
    fingerprint: str | None  # the source's identity(relpath); None if it has none ("" or None)


@dataclass(frozen=True)
class BuildSummary:
    files: int
    samples: int
    bytes_read: int  # bytes read from the source to index every file (the moov, not the media)
    seconds: float


@dataclass(frozen=True)
class IndexLocation:
    compact_path: Path  # what workers map
    npz_path: Path | None  # the canonical file (None for a volatile index)
    origin: str  # "cache", "npz" (compact re-derived), "published", "built" or "volatile"
    summary: BuildSummary | None  # set when this call indexed the files


# --- identity and states ---------------------------------------------------------------------


def default_cache_root() -> Path:
    """``$REFSTREAM_CACHE``, else ``~/.cache/refstream``."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "refstream")


def cache_directory(dataset: DatasetIdentity, cache_root: str | Path | None = None) -> Path:
    """``<cache root>/sidecars/<digest of schema version and dataset identity>``."""
    if cache_root is None:
        cache_root = default_cache_root()
    key = _canonical_json({"schema_version": SCHEMA_VERSION, **_identity_json(dataset)})
    return Path(cache_root) / "sidecars" / hashlib.sha256(key).hexdigest()[:16]


def video_relpaths(meta: DatasetMeta) -> list[str]:
    """Every video file of the complete dataset (every episode, every camera), sorted."""
    return sorted({meta.video_relpath(int(episode), camera)
                   for episode in meta.episode_index for camera in meta.camera_keys})


def dataset_identity(
    root: str | Path, source: IndexSource, relpaths: Sequence[str]
) -> DatasetIdentity:
    """The identity a root is cached under: a folder's absolute path or the URL as given; the
    revision is the pinned commit when the source's identities are ``commit:<sha>`` (Hub)."""
    text = str(root)
    identity = (source.identity(relpaths[0]) or "") if relpaths else ""
    revision = identity.removeprefix("commit:") if identity.startswith("commit:") else None
    return DatasetIdentity(text if "://" in text else os.path.abspath(text), revision)


def file_states(source: IndexSource, relpaths: Sequence[str],
                workers: int = 8) -> list[FileState]:
    """Current size and fingerprint of each distinct relpath, sorted by relpath; looked up
    ``workers`` at a time (over HTTP each is a HEAD: serially, a dataset of many files would
    wait one round trip per file before its first sample)."""

    def state(relpath: str) -> FileState:
        # identity first: an HTTP source learns the size from the same HEAD
        fingerprint = source.identity(relpath) or None
        return FileState(relpath, int(source.size(relpath)), fingerprint)

    distinct = sorted(set(relpaths))
    with ThreadPoolExecutor(max(1, min(workers, len(distinct))),
                            thread_name_prefix="refstream-stat") as pool:
        return list(pool.map(state, distinct))


def _identity_json(dataset: DatasetIdentity) -> dict:
    return {"root": dataset.root, "revision": dataset.revision}


def _canonical_json(value) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


# --- the canonical NPZ -----------------------------------------------------------------------


def build_npz(
    destination: Path | io.BufferedIOBase,
    source: IndexSource,
    dataset: DatasetIdentity,
    states: Sequence[FileState],
    *,
    workers: int = 8,
    progress: Progress | None = None,
    indexer: Indexer | None = None,
) -> BuildSummary:
    """Index every file of ``states`` in parallel; write the canonical NPZ to ``destination``."""
    started = time.monotonic()
    indexes, bytes_read = _index_files(source, states, workers, progress, indexer)
    files = []
    for state, index in zip(states, indexes, strict=True):
        if index.file_size != state.size:
            raise SidecarInvalid(
                f"{state.relpath}: indexed {index.file_size} bytes but the source said {state.size}"
            )
        files.append(_file_manifest(state, index))
    manifest = {"schema": SCHEMA, "schema_version": SCHEMA_VERSION,
                "dataset": _identity_json(dataset), "files": files}
    arrays = {
        name: np.concatenate([np.asarray(getattr(i, name), dtype) for i in indexes])
        if indexes else np.empty(0, dtype)
        for name, dtype in _canonical_dtypes().items()
    }
    manifest_bytes = np.frombuffer(_canonical_json(manifest), np.uint8)
    np.savez(destination, manifest=manifest_bytes, **arrays)
    samples = int(arrays["pts"].size)
    return BuildSummary(len(states), samples, bytes_read, time.monotonic() - started)


def read_npz(
    path: Path | io.BytesIO,
    dataset: DatasetIdentity,
    states: Sequence[FileState],
    label: str | None = None,
) -> tuple[dict, dict[str, np.ndarray]]:
    """``(manifest, arrays)`` of a canonical NPZ valid for ``states``, else ``SidecarInvalid``.

    A missing file raises ``FileNotFoundError``; ``label`` names an in-memory file in messages.
    """
    label = label or str(path)
    try:
        with np.load(path, allow_pickle=False) as npz:
            members = set(npz.files)
            if members == {"manifest", *ARRAY_FIELDS}:
                manifest = json.loads(npz["manifest"].tobytes())
                arrays = {name: npz[name] for name in ARRAY_FIELDS}
    except FileNotFoundError:
        raise
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile, struct.error,
            # numpy parses a member's .npy header (literal_eval) before the zip CRC is checked,
            # and zipfile refuses unknown compression methods with NotImplementedError.
            SyntaxError, tokenize.TokenError, NotImplementedError) as exc:
        raise SidecarInvalid(f"{label}: unreadable ({type(exc).__name__}: {exc})") from exc
    if members != {"manifest", *ARRAY_FIELDS}:
        raise SidecarInvalid(f"{label}: members {sorted(members)} are not the schema's")
    _check_manifest(manifest, dataset, states, label)
    total = sum(f["samples"] for f in manifest["files"])
    for name, dtype in _canonical_dtypes().items():
        array = arrays[name]
        if array.dtype != dtype or array.shape != (total,):
            raise SidecarInvalid(
                f"{label}: array {name} is {array.dtype}{array.shape}, expected {dtype}({total},)"
            )
    return manifest, arrays


def _canonical_dtypes() -> dict[str, np.dtype]:
    return {**{name: np.dtype("<i8") for name in INT_FIELDS}, "keyframe": np.dtype(bool)}


def _file_manifest(state: FileState, index: SampleIndex) -> dict:
    entry = {"relpath": state.relpath, "size": state.size, "fingerprint": state.fingerprint,
             "samples": int(len(index.pts)), "ftyp": index.ftyp.hex(), "stsd": index.stsd.hex()}
    entry["codec"] = str(index.codec)
    entry.update({name: int(getattr(index, name)) for name in INT_SCALAR_FIELDS})
    return entry


def _check_manifest(manifest, dataset: DatasetIdentity, states: Sequence[FileState], path) -> None:
    """``SidecarInvalid`` unless ``manifest`` is this schema's, this dataset's and current."""
    if not isinstance(manifest, dict) or manifest.get("schema") != SCHEMA:
        raise SidecarInvalid(f"{path}: not a {SCHEMA} file")
    if manifest.get("schema_version") != SCHEMA_VERSION:
        raise SidecarInvalid(
            f"{path}: schema version {manifest.get('schema_version')!r}, expected {SCHEMA_VERSION}"
        )
    if manifest.get("dataset") != _identity_json(dataset):
        raise SidecarInvalid(f"{path}: indexes dataset {manifest.get('dataset')!r}, not {dataset}")
    files = manifest.get("files")
    if (
        not isinstance(files, list)
        or not all(isinstance(f, dict) for f in files)
        or [f.get("relpath") for f in files] != [s.relpath for s in states]
    ):
        raise SidecarInvalid(f"{path}: does not index exactly the dataset's {len(states)} files")
    for entry, state in zip(files, states, strict=True):
        for name in ("size", "fingerprint"):
            if entry.get(name) != getattr(state, name):
                raise SidecarInvalid(
                    f"{path}: {state.relpath} {name} is {getattr(state, name)!r} now, "
                    f"{entry.get(name)!r} when indexed (stale)"
                )
        _check_entry(entry, path)


def _check_entry(entry: dict, path) -> None:
    """``SidecarInvalid`` unless one file's manifest entry has the schema's fields and types."""
    if not isinstance(entry, dict):
        raise SidecarInvalid(f"{path}: bad manifest entry {entry!r:.80}")
    relpath = entry.get("relpath")
    try:
        checks = [isinstance(relpath, str), isinstance(entry["codec"], str),
                  bytes.fromhex(entry["ftyp"]) is not None,
                  bytes.fromhex(entry["stsd"]) is not None]
        checks += [type(entry[n]) is int for n in ("size", "samples", *INT_SCALAR_FIELDS)]
        checks.append(all(checks) and entry["samples"] >= 0)
    except (KeyError, TypeError, ValueError) as exc:
        raise SidecarInvalid(f"{path}: {relpath!r}: bad manifest entry ({exc})") from exc
    if not all(checks):
        raise SidecarInvalid(f"{path}: {relpath!r}: bad manifest entry")


def _index_files(
    source: IndexSource,
    states: Sequence[FileState],
    workers: int,
    progress: Progress | None,
    indexer: Indexer | None,
) -> tuple[list[SampleIndex], int]:
    if indexer is None:
        from refstream.mp4 import parse_index as indexer
    read_counts = [0] * len(states)

    def index_one(position: int) -> SampleIndex:
        relpath = states[position].relpath

        def read_range(offset: int, length: int) -> bytes:
            data = source.read_range(relpath, offset, length)
            read_counts[position] += len(data)
            return data

        try:
            return indexer(read_range, states[position].size, relpath)
        except RefstreamError:
            raise
        except OSError as exc:
            raise SidecarError(f"{relpath}: cannot read while indexing ({exc})") from exc

    report = progress if progress is not None else _default_progress(len(states))
    indexes: list = [None] * len(states)
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        futures = {pool.submit(index_one, i): i for i in range(len(states))}
        try:
            for done, future in enumerate(as_completed(futures), start=1):
                position = futures[future]
                indexes[position] = future.result()
                if report is not None:
                    report(done, len(states), states[position].relpath)
        except BaseException:
            for future in futures:
                future.cancel()
            raise
        finally:
            if report is not None and hasattr(report, "close"):
                report.close()
    return indexes, sum(read_counts)


class _TqdmProgress:
    def __init__(self, total: int) -> None:
        from tqdm import tqdm

        self._bar = tqdm(total=total, unit="file", desc="indexing MP4 files")

    def __call__(self, done: int, total: int, relpath: str) -> None:
        self._bar.update(1)

    def close(self) -> None:
        self._bar.close()


def _default_progress(total: int) -> Progress | None:
    return _TqdmProgress(total) if sys.stderr.isatty() else None


# --- the compact mapped file -----------------------------------------------------------------


def _write_compact(destination: io.BufferedIOBase, manifest: dict, arrays: dict) -> None:
    """Write the compact file for a validated ``(manifest, arrays)`` pair."""
    counts = [f["samples"] for f in manifest["files"]]
    starts = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
    blocks, chunks = [], []
    for position in range(len(counts)):
        file_blocks = {}
        for name in ARRAY_FIELDS:
            values = arrays[name][starts[position] : starts[position + 1]]
            file_blocks[name], stored = _storage(values)
            if stored is not None:
                chunks.append((file_blocks[name], stored))
        blocks.append(file_blocks)
    # Offsets depend on the header length, which depends on the offsets' digits: settle it by
    # reserving a header size and growing it until everything fits.
    header_room = 4096
    while True:
        position = _align(COMPACT_PREFIX + header_room)
        for block, stored in chunks:
            block["offset"] = position
            position = _align(position + stored.nbytes)
        header = _canonical_json({"manifest": manifest, "arrays": blocks})
        if len(header) <= header_room:
            break
        header_room = 2 * len(header)
    body = bytearray(position - COMPACT_PREFIX)
    body[: len(header)] = header
    body[len(header) : header_room] = b" " * (header_room - len(header))  # JSON allows spaces
    for block, stored in chunks:
        at = block["offset"] - COMPACT_PREFIX
        body[at : at + stored.nbytes] = stored.tobytes()
    destination.write(COMPACT_MAGIC + struct.pack("<Q", header_room))
    destination.write(hashlib.sha256(body).digest())
    destination.write(body)


def _storage(values: np.ndarray) -> tuple[dict, np.ndarray | None]:
    """How one array is stored: ``({"value": v}, None)`` for a constant (or empty) array, else
    ``({"dtype": …, "offset": None}, stored values)`` in the narrowest exact dtype (flags: bool).
    """
    if values.size == 0 or (values == values[0]).all():
        return {"value": values[0].item() if values.size else values.dtype.type(0).item()}, None
    stored = values if values.dtype == bool else values.astype(_narrowest(values))
    return {"dtype": stored.dtype.str, "offset": None}, stored


def _narrowest(values: np.ndarray) -> np.dtype:
    low, high = int(values.min()), int(values.max())
    return next(d for d in NARROW_DTYPES if np.iinfo(d).min <= low and high <= np.iinfo(d).max)


def _align(offset: int) -> int:
    return -(-offset // ALIGN) * ALIGN


class CompactIndex(Mapping):
    """Read-only ``relpath -> SampleIndex`` over a memory-mapped compact file (see module doc)."""

    def __init__(self, path: Path, *, verify: bool = False) -> None:
        self.path = Path(path)
        try:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        except (ValueError, OSError) as exc:
            if isinstance(exc, FileNotFoundError):
                raise
            raise SidecarInvalid(f"{path}: cannot map ({exc})") from exc
        self.manifest, self._blocks = _parse_compact(self._map, self.path, verify)
        self._position = {f["relpath"]: i for i, f in enumerate(self.manifest["files"])}
        self._cache: dict[str, SampleIndex] = {}

    def __getitem__(self, relpath: str) -> SampleIndex:
        cached = self._cache.get(relpath)
        if cached is None:
            cached = self._cache[relpath] = self._sample_index(relpath)
        return cached

    def __iter__(self) -> Iterator[str]:
        return iter(self._position)

    def __len__(self) -> int:
        return len(self._position)

    def stored(self, relpath: str, name: str) -> np.ndarray:
        """The array ``name`` of ``relpath`` as stored: a zero-copy read-only view, narrow dtype."""
        entry = self.manifest["files"][self._position[relpath]]
        block = self._blocks[self._position[relpath]][name]
        count = entry["samples"]
        if "value" in block:
            dtype = bool if name == "keyframe" else np.int64
            return np.broadcast_to(np.array(block["value"], dtype), (count,))
        return np.ndarray((count,), np.dtype(block["dtype"]), buffer=self._map,
                          offset=block["offset"])

    def _sample_index(self, relpath: str) -> SampleIndex:
        from refstream.mp4 import SampleIndex

        entry = self.manifest["files"][self._position[relpath]]
        arrays = {}
        for name, dtype in _canonical_dtypes().items():
            array = self.stored(relpath, name)
            if array.dtype != dtype:
                array = array.astype(dtype)
                array.setflags(write=False)
            arrays[name] = array
        return SampleIndex(
            path=relpath,
            file_size=entry["size"],
            ftyp=bytes.fromhex(entry["ftyp"]),
            stsd=bytes.fromhex(entry["stsd"]),
            **{name: entry[name] for name in SCALAR_FIELDS},
            **arrays,
        )


def _parse_compact(mapped: np.ndarray, path: Path, verify: bool) -> tuple[dict, list]:
    """Header of a compact file, its structure and bounds checked (and its digest if ``verify``)."""
    if mapped.size < COMPACT_PREFIX or mapped[:8].tobytes() != COMPACT_MAGIC:
        raise SidecarInvalid(f"{path}: not a refstream compact index (magic)")
    (header_length,) = struct.unpack("<Q", mapped[8:16].tobytes())
    if header_length > mapped.size - COMPACT_PREFIX:
        raise SidecarInvalid(f"{path}: header length {header_length} exceeds the file")
    if verify and hashlib.sha256(mapped[COMPACT_PREFIX:]).digest() != mapped[16:48].tobytes():
        raise SidecarInvalid(f"{path}: content digest mismatch (corrupt)")
    try:
        header = json.loads(mapped[COMPACT_PREFIX : COMPACT_PREFIX + header_length].tobytes())
        manifest, blocks = header["manifest"], header["arrays"]
        files = manifest["files"]
        if not isinstance(blocks, list) or len(blocks) != len(files):
            raise ValueError("one block table per file expected")
        for entry in files:
            _check_entry(entry, path)
            # dts rises, so a file of n > 1 samples stores it as >= n bytes: n <= the file size
            # bounds what widening a constant array could allocate.
            if entry["samples"] > mapped.size:
                raise ValueError(f"{entry['relpath']}: {entry['samples']} samples")
        if len({entry["relpath"] for entry in files}) != len(files):
            raise ValueError("a file is listed twice")
        for entry, file_blocks in zip(files, blocks, strict=True):
            if set(file_blocks) != set(ARRAY_FIELDS):
                raise ValueError(f"{entry['relpath']}: arrays {sorted(file_blocks)}")
            for name, block in file_blocks.items():
                _check_block(block, name, entry["samples"], mapped.size, header_length)
    except (ValueError, KeyError, TypeError) as exc:
        raise SidecarInvalid(f"{path}: bad compact header ({exc})") from exc
    return manifest, blocks


def _check_block(block: dict, name: str, count: int, file_size: int, header_length: int) -> None:
    if not isinstance(block, dict):
        raise ValueError(f"{name}: block {block!r}")
    if "value" in block:
        value = block["value"]
        if name == "keyframe":
            valid = type(value) is bool
        else:
            valid = type(value) is int and -(2**63) <= value < 2**63
        if not valid:
            raise ValueError(f"{name}: constant {value!r}")
        return
    allowed = [np.dtype(bool)] if name == "keyframe" else list(NARROW_DTYPES)
    if block.get("dtype") not in [d.str for d in allowed]:  # before np.dtype parses the string
        raise ValueError(f"{name}: dtype {block.get('dtype')!r}")
    dtype = np.dtype(block["dtype"])
    offset = block["offset"]
    if dtype not in allowed or type(offset) is not int or offset % ALIGN:
        raise ValueError(f"{name}: block {block}")
    if offset < COMPACT_PREFIX + header_length or offset + count * dtype.itemsize > file_size:
        raise ValueError(f"{name}: bytes [{offset}, +{count * dtype.itemsize}) outside the data")


def map_index(compact_path: str | Path, *, verify: bool = False) -> CompactIndex:
    """Map a compact index read-only (workers: cheap, checks structure; ``verify``: digest too)."""
    return CompactIndex(Path(compact_path), verify=verify)


# --- finding, building and installing --------------------------------------------------------


def ensure_index(
    source: IndexSource,
    relpaths: Sequence[str],
    dataset: DatasetIdentity,
    *,
    cache_root: str | Path | None = None,
    workers: int = 8,
    lock_timeout_s: float | None = None,
    progress: Progress | None = None,
    indexer: Indexer | None = None,
) -> IndexLocation:
    """A valid compact index for ``relpaths`` of ``dataset``: cached, published or built."""
    directory = cache_directory(dataset, cache_root)
    npz_path, compact_path = directory / "index.npz", directory / "index.compact"
    if dataset.revision is not None and _pinned_compact_is_valid(compact_path, dataset, relpaths):
        return IndexLocation(compact_path, npz_path, "cache", None)
    states = file_states(source, relpaths, workers)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SidecarError(
            f"cannot create the sidecar cache {directory} ({exc}); set {CACHE_ENV} to a "
            "writable folder"
        ) from exc
    unstable = [s.relpath for s in states if s.fingerprint is None]
    if unstable:
        others = f" and {len(unstable) - 1} more files have" if len(unstable) > 1 else " has"
        warnings.warn(
            f"{dataset.root}: {unstable[0]}{others} no stable identity (no ETag, Last-Modified "
            "or commit), so a cached index could not be trusted: indexing the dataset again on "
            "this open",
            stacklevel=2,
        )
        return _build_volatile(source, dataset, states, directory, workers, progress, indexer)
    if _compact_is_valid(compact_path, dataset, states):
        return IndexLocation(compact_path, npz_path, "cache", None)
    if lock_timeout_s is None:
        lock_timeout_s = _lock_timeout_from_environment()
    with _exclusive(directory / ".lock", lock_timeout_s):
        _remove_orphans(directory, TEMP_PATTERN)
        if _compact_is_valid(compact_path, dataset, states):
            return IndexLocation(compact_path, npz_path, "cache", None)  # another process built it
        for origin in ("npz", "published"):
            try:
                if origin == "published":
                    _install_published(source, dataset, states, npz_path)
                manifest, arrays = read_npz(npz_path, dataset, states)
            except (RefstreamError, OSError) as exc:
                # Not there, unreadable, stale or corrupt: the next candidate, or a build.
                log.info("sidecar %s candidate not usable: %s", origin, exc)
                continue
            _install(compact_path, lambda f, m=manifest, a=arrays: _write_compact(f, m, a))
            return IndexLocation(compact_path, npz_path, origin, None)
        summary = _build_and_install(source, dataset, relpaths, states, npz_path, compact_path,
                                     workers, progress, indexer)
        return IndexLocation(compact_path, npz_path, "built", summary)


def _lock_timeout_from_environment() -> float:
    text = os.environ.get(LOCK_TIMEOUT_ENV)
    if text is None:
        return DEFAULT_LOCK_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise UsageError(f"{LOCK_TIMEOUT_ENV}={text!r}: expected seconds, a number >= 0")
    return value


def open_index(
    source: IndexSource, relpaths: Sequence[str], dataset: DatasetIdentity, **options
) -> CompactIndex:
    """``map_index(ensure_index(source, relpaths, dataset, **options).compact_path)``."""
    return map_index(ensure_index(source, relpaths, dataset, **options).compact_path)


def _pinned_states(manifest, dataset: DatasetIdentity,
                   relpaths: Sequence[str]) -> list[FileState] | None:
    """The file states the manifest of a commit-pinned dataset's index recorded, if it holds
    exactly ``relpaths``, each fingerprinted with the dataset's commit; else None."""
    commit = f"commit:{dataset.revision}"
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, list) or not all(isinstance(f, dict) for f in files):
        return None
    if [f.get("relpath") for f in files] != sorted(set(relpaths)) or any(
            f.get("fingerprint") != commit or not isinstance(f.get("size"), int) for f in files):
        return None
    return [FileState(f["relpath"], f["size"], commit) for f in files]


def _pinned_compact_is_valid(path: Path, dataset: DatasetIdentity,
                             relpaths: Sequence[str]) -> bool:
    """``_compact_is_valid`` for a commit-pinned dataset, against the states its index recorded
    (the files cannot change under the commit, so the source is not asked)."""
    manifest = _compact_manifest(path)
    states = None if manifest is None else _pinned_states(manifest, dataset, relpaths)
    return states is not None and _manifest_is_valid(manifest, dataset, states, path)


def _compact_is_valid(path: Path, dataset: DatasetIdentity, states: Sequence[FileState]) -> bool:
    manifest = _compact_manifest(path)
    return manifest is not None and _manifest_is_valid(manifest, dataset, states, path)


def _compact_manifest(path: Path):
    """The manifest of the compact file at ``path`` (digest and bounds verified), or None when
    it is missing or not a valid compact file."""
    try:
        return CompactIndex(path, verify=True).manifest
    except FileNotFoundError:
        return None
    except SidecarInvalid as exc:
        log.info("cached compact index not usable: %s", exc)
        return None


def _manifest_is_valid(manifest, dataset: DatasetIdentity, states: Sequence[FileState],
                       path: Path) -> bool:
    try:
        _check_manifest(manifest, dataset, states, path)
    except SidecarInvalid as exc:
        log.info("cached compact index not usable: %s", exc)
        return False
    return True


def _build_and_install(source, dataset, relpaths, states, npz_path, compact_path, workers,
                       progress, indexer) -> BuildSummary:
    for attempt in (1, 2):
        with _temp_path(npz_path) as temp:
            with open(temp, "wb") as handle:
                summary = build_npz(handle, source, dataset, states, workers=workers,
                                    progress=progress, indexer=indexer)
                handle.flush()
                os.fsync(handle.fileno())
            fresh = file_states(source, relpaths)  # files may have changed while we indexed
            try:
                manifest, arrays = read_npz(temp, dataset, fresh)
            except SidecarInvalid as exc:
                if attempt == 2:
                    raise SidecarInvalid(f"index built twice is still not valid: {exc}") from exc
                states = fresh
                continue
            _install(compact_path, lambda f, m=manifest, a=arrays: _write_compact(f, m, a))
            os.replace(temp, npz_path)
            _fsync_directory(npz_path.parent)
            return summary
    raise AssertionError("unreachable")


def _build_volatile(source, dataset, states, directory, workers, progress, indexer):
    volatile = directory / "volatile"
    volatile.mkdir(exist_ok=True)
    for pattern in (VOLATILE_PATTERN, TEMP_PATTERN):
        _remove_orphans(volatile, pattern)
    buffer = io.BytesIO()
    summary = build_npz(buffer, source, dataset, states, workers=workers, progress=progress,
                        indexer=indexer)
    buffer.seek(0)
    manifest, arrays = read_npz(buffer, dataset, states, label="the index just built")
    path = volatile / f"{os.getpid()}.{uuid.uuid4().hex[:12]}.compact"
    _install(path, lambda f: _write_compact(f, manifest, arrays))
    return IndexLocation(path, None, "volatile", summary)


def export_npz(location: IndexLocation, output: str | Path) -> Path:
    """Copy the canonical NPZ to ``output`` atomically, e.g. ``ROOT/meta/refstream-index.npz``
    to publish it with the dataset (``UsageError`` for a volatile index: it could not validate).
    """
    if location.npz_path is None:
        raise UsageError("the source has no stable file identity: a published index cannot "
                         "be validated")
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    data = location.npz_path.read_bytes()
    _install(output, lambda f: f.write(data))
    return output


def _install_published(source, dataset, states, npz_path: Path) -> None:
    """Copy the dataset's published index into the cache if it is valid for ``states``."""
    size = int(source.size(PUBLISHED_RELPATH))
    data = source.read_range(PUBLISHED_RELPATH, 0, size)
    read_npz(io.BytesIO(data), dataset, states, label=f"{dataset.root}/{PUBLISHED_RELPATH}")
    _install(npz_path, lambda f: f.write(data))


# --- atomic files and the lock ---------------------------------------------------------------


@contextmanager
def _temp_path(destination: Path) -> Iterator[Path]:
    """A fresh temp file name beside ``destination``, removed on exit if still there."""
    temp = destination.with_name(f".tmp.{os.getpid()}.{uuid.uuid4().hex[:12]}.{destination.name}")
    temp.touch(exist_ok=False)  # exists from the start, so a killed build leaves evidence
    try:
        yield temp
    finally:
        temp.unlink(missing_ok=True)


def _install(destination: Path, write: Callable[[io.BufferedIOBase], object]) -> None:
    """Write a temp file beside ``destination`` with ``write``, fsync, then ``os.replace`` it."""
    with _temp_path(destination) as temp:
        with open(temp, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp, destination)
    _fsync_directory(destination.parent)


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_directory(directory: Path) -> None:
    _fsync_path(directory)  # makes the rename itself durable


def _remove_orphans(directory: Path, pattern: re.Pattern) -> None:
    """Delete files matching ``pattern`` whose owner process (first group: pid) is gone."""
    for path in directory.iterdir():
        match = pattern.match(path.name)
        if match and not _process_alive(int(match.group(1))):
            log.info("removing %s left by a process that is gone", path)
            path.unlink(missing_ok=True)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


@contextmanager
def _exclusive(lock_path: Path, timeout_s: float) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``lock_path``, polling up to ``timeout_s`` seconds."""
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise SidecarError(f"cannot open the sidecar lock {lock_path} ({exc})") from exc
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
                        f"waited {waited:.1f} s for the sidecar lock {lock_path} held by another "
                        f"build (timeout {timeout_s} s, set {LOCK_TIMEOUT_ENV} to change it)"
                    ) from None
                time.sleep(min(LOCK_POLL_S, max(0.0, timeout_s - waited)))
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock
