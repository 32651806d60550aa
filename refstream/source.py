"""Byte sources: where the files of a dataset are read from (SPEC §8.1).

Usage::

    source = open_source(root)        # refstream.roots: a folder, file://, http(s)://, hf://
    source.read_bytes(relpath)        # a whole file (metadata)
    source.read_range(relpath, offset, length)   # exactly `length` bytes, or an error
    source.read_tail(relpath, length)            # (the last min(length, size) bytes, size)
    source.size(relpath), source.identity(relpath)
    source.size_if_present(relpath), source.read_if_present(relpath)   # None: no such file
    source.content_identities(relpaths)          # relpath -> (size, content identity), SPEC §10.1
    source.expect_identity(relpath, identity)    # a later read of another version: PayloadChanged
    pq.ParquetFile(RangeFile(source, relpath, size, tail))   # pyarrow reads through the source

:class:`LocalSource` reads a folder; :mod:`refstream.http` and :mod:`refstream.hub` serve the
other roots. A source may be shared by threads.
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from refstream.errors import (
    FetchError,
    MalformedDataset,
    PayloadChanged,
    ShortRead,
    UnsafePath,
    UsageError,
)

__all__ = ["Source", "LocalSource", "RangeFile", "check_relpath"]

IDENTITY_THREADS = 8  # files whose identity is asked at once: one HEAD each over HTTP


class Source:
    """The base of every source: the identity check of every read (SPEC §8.1); a subclass adds
    ``read_bytes``, ``read_range``, ``size``, ``size_if_present``, ``identity`` and ``close``."""

    def __init__(self) -> None:
        # relpath -> identity; threads share it, and one dict operation is atomic: no lock
        self._expected: dict[str, str] = {}

    def expect_identity(self, relpath: str, identity: str) -> None:
        self._expected[check_relpath(relpath)] = identity

    def content_identities(self, relpaths: Iterable[str]) -> dict[str, tuple[int, str]]:
        """``relpath -> (size, identity)`` of each distinct file, ``IDENTITY_THREADS`` at a time."""
        def ask(relpath: str) -> tuple[str, tuple[int, str]]:
            identity = self.identity(relpath)  # first: HTTP learns the size from the same HEAD
            return relpath, (self.size(relpath), identity)

        with ThreadPoolExecutor(IDENTITY_THREADS, thread_name_prefix="refstream-stat") as pool:
            return dict(pool.map(ask, sorted(set(relpaths))))

    def _check_identity(self, relpath: str, actual: str, where: str) -> None:
        expected = self._expected.get(relpath)
        if expected is not None and actual != expected:
            raise PayloadChanged(f"{where}: file changed since indexed ({expected} -> {actual})")

    def read_if_present(self, relpath: str) -> bytes | None:
        return None if self.size_if_present(relpath) is None else self.read_bytes(relpath)

    def read_tail(self, relpath: str, length: int) -> tuple[bytes, int]:
        check_tail(relpath, length)
        size = self.size(relpath)
        count = min(length, size)
        return self.read_range(relpath, size - count, count), size


def check_relpath(relpath: str) -> str:
    """``relpath`` if the lexical rule of SPEC §4.1 finds it safe, else UnsafePath."""
    if not isinstance(relpath, str) or not relpath:
        raise UnsafePath(f"path {relpath!r} is empty or not a string")
    if any(ch in relpath for ch in "\\:\x00"):
        raise UnsafePath(f"path {relpath!r} contains '\\', ':' or NUL")
    if any(part in ("", ".", "..") for part in relpath.split("/")):
        raise UnsafePath(f"path {relpath!r} is absolute or has an empty, '.' or '..' component")
    return relpath


def check_span(where: str, offset: int, length: int) -> None:
    if offset < 0 or length < 0:
        raise UsageError(f"{where}: invalid byte range offset={offset} length={length}")


def check_tail(where: str, length: int) -> None:
    if length < 1:
        raise UsageError(f"{where}: a tail read needs a positive length, got {length}")


def byte_range(offset: int, length: int) -> str:  # as messages name a range (SPEC §8.1)
    return f"bytes {offset}-{offset + length - 1}"


class LocalSource(Source):
    """A dataset in a local folder."""

    def __init__(self, root: str | Path) -> None:
        super().__init__()
        self.root = Path(root)

    def __repr__(self) -> str:
        return f"LocalSource({str(self.root)!r})"

    def read_bytes(self, relpath: str) -> bytes:
        return self._read(relpath, 0, None)

    def read_range(self, relpath: str, offset: int, length: int) -> bytes:
        return self._read(relpath, offset, length)

    def size(self, relpath: str) -> int:
        return self._stat(relpath).st_size

    def size_if_present(self, relpath: str) -> int | None:
        return self.size(relpath) if (self.root / check_relpath(relpath)).is_file() else None

    def identity(self, relpath: str) -> str:
        return _local_identity(self._stat(relpath))

    def close(self) -> None:
        """Nothing stays open between calls."""

    def _read(self, relpath: str, offset: int, length: int | None) -> bytes:
        """``length`` bytes at ``offset``; ``None`` means to the end of the file."""
        path = self.root / check_relpath(relpath)
        check_span(str(path), offset, length or 0)
        with self._os_errors(relpath, path), open(path, "rb") as file:
            status = os.fstat(file.fileno())  # of the version read: its identity is checked
            file.seek(offset)
            data = file.read(length)  # fewer bytes only at the end of the file
        asked = len(data) if length is None else length
        where = f"{path} {byte_range(offset, asked)}"
        self._check_identity(relpath, _local_identity(status), where)
        if len(data) != asked:
            raise ShortRead(f"{where}: got {len(data)} of {asked} bytes (end of file)")
        return data

    def _stat(self, relpath: str) -> os.stat_result:
        path = self.root / check_relpath(relpath)
        with self._os_errors(relpath, path):
            return os.stat(path)

    @contextlib.contextmanager
    def _os_errors(self, relpath: str, path: Path) -> Iterator[None]:
        try:
            yield
        except FileNotFoundError as exc:
            raise MalformedDataset(f"{relpath}: missing from dataset root {self.root}") from exc
        except OSError as exc:
            raise FetchError(f"{path}: {exc}") from exc


def _local_identity(st: os.stat_result) -> str:
    return f"local:size={st.st_size};mtime_ns={st.st_mtime_ns}"


class RangeFile(io.RawIOBase):
    """A read-only, seekable file over one source file; every read is one ``read_range``,
    except reads that lie inside ``tail`` (the file's last bytes, already fetched)."""

    def __init__(self, source: Source, relpath: str, size: int | None = None,
                 tail: bytes = b"") -> None:
        super().__init__()
        self.source = source
        self.relpath = relpath
        self._size = source.size(relpath) if size is None else size
        if len(tail) > self._size:
            raise UsageError(f"{relpath}: a tail of {len(tail)} bytes in a {self._size}-byte file")
        self._tail = tail
        self._position = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self._size}[whence]
        if base + offset < 0:
            raise UsageError(f"{self.relpath}: seek to negative offset {base + offset}")
        self._position = base + offset
        return self._position

    def readinto(self, buffer) -> int:
        view = memoryview(buffer).cast("B")
        data = self._read_at_position(len(view))
        view[: len(data)] = data
        return len(data)

    def readall(self) -> bytes:
        return self._read_at_position(self._size - self._position)

    def _read_at_position(self, limit: int) -> bytes:
        length = max(0, min(limit, self._size - self._position))
        at = self._position - (self._size - len(self._tail))  # in the tail when not negative
        if at < 0 and length:
            data = self.source.read_range(self.relpath, self._position, length)
        else:  # in the tail, or nothing to read
            data = self._tail[at : at + length]
        self._position += length
        return data
