"""Helpers for the sidecar tests: a small dataset of real MP4 files, an oracle indexer, index
builds with another indexer, and a command-line builder so other processes can build (or hold
the lock) concurrently.

Run as ``python tests/sidecar_helpers.py build CACHE ROOT LOG DELAY_S`` to build the index of the
dataset in ROOT, one file at a time, with an indexer that appends one line per indexed file to
LOG and then sleeps DELAY_S (``stdin`` for DELAY_S: it waits for a line on stdin, or its end,
instead, so a test decides when indexing goes on); ``... hold LOCK`` takes the lock file and
sleeps until killed; ``... volatile CACHE ROOT`` indexes ROOT as a source without identities,
prints the records' paths and sleeps until killed.
"""

from __future__ import annotations

import fcntl
import os
import sys
import time
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent))

from media import encode_video, index_from_pyav, pattern_frames  # noqa: E402

from refstream import sidecar  # noqa: E402
from refstream.source import LocalSource  # noqa: E402

# Three files in two folders, like a LeRobot videos/ tree, with both codecs.
DATASET_FILES = {
    "videos/cam_a/chunk-000/file-000.mp4": ("libx264", 10, 2),
    "videos/cam_a/chunk-000/file-001.mp4": ("libx264", 30, 0),
    "videos/cam_b/chunk-000/file-000.mp4": ("libsvtav1", 10, 0),
}


def make_dataset(root: Path) -> list[str]:
    """Write the real MP4 files of DATASET_FILES under ``root``; their relpaths."""
    for count, (relpath, (codec, gop, bframes)) in enumerate(DATASET_FILES.items()):
        path = root / relpath
        path.parent.mkdir(parents=True, exist_ok=True)
        encode_video(path, pattern_frames(20 + 5 * count), codec, gop, bframes)
    return sorted(DATASET_FILES)


def pyav_indexer(log_path: Path | None = None, delay_s: float = 0.0, wait=None):
    """An indexer with ``parse_index``'s signature answering from PyAV's demuxer (the oracle).

    It reads the whole file through ``read_range``, so the source and byte counting are used;
    with ``log_path`` it appends one line per file indexed, and then it calls ``wait`` (if given)
    and sleeps ``delay_s``.
    """

    def indexer(read_range, file_size: int, path: str):
        if log_path is not None:
            with open(log_path, "a") as handle:
                handle.write(f"{os.getpid()} {path}\n")
        if wait is not None:
            wait()
        time.sleep(delay_s)
        return index_from_pyav(read_range(0, file_size), path)

    return indexer


def ensure_with(indexer, source, relpaths, **options) -> sidecar.VideoIndex:
    """``sidecar.ensure_index`` indexing each file with ``indexer`` instead of ``parse_index``."""
    with mock.patch.object(sidecar, "parse_index", indexer):
        return sidecar.ensure_index(source, relpaths, **options)


class NoIdentitySource(LocalSource):
    """A folder whose files have no identity, as an HTTP server without ETag or Last-Modified."""

    def identity(self, relpath: str) -> str:
        return ""


def main(argv: list[str]) -> None:
    if argv[0] == "build":
        cache, root, log, delay = argv[1:5]
        indexer = (pyav_indexer(Path(log), wait=sys.stdin.readline) if delay == "stdin"
                   else pyav_indexer(Path(log), float(delay)))
        index = ensure_with(indexer, LocalSource(root), sorted(DATASET_FILES), cache_root=cache,
                            workers=1)
        print(index.origin, index.indexed, flush=True)
    elif argv[0] == "hold":
        fd = os.open(argv[1], os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)
        print("held", flush=True)
        time.sleep(3600)
    elif argv[0] == "volatile":
        cache, root = argv[1:3]
        index = ensure_with(pyav_indexer(), NoIdentitySource(root), sorted(DATASET_FILES),
                            cache_root=cache, workers=1)
        print(" ".join(record.path for record in index.records.values()), flush=True)
        time.sleep(3600)


if __name__ == "__main__":
    main(sys.argv[1:])
