"""One episode's rows of a LeRobot v3 data Parquet file, read by range (SPEC §8.5).

Use::

    footers = Footers()          # one per worker: each file's footer is read once
    table = read_episode_rows(source, relpath, episode, expected_rows, columns, footers,
                              first_index=meta.from_index[row])     # checks the index column

The table is SPEC §8.5's answer in Arrow types (``refstream.meta.column_array`` converts them).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from refstream.errors import RefstreamError, TableError, UsageError, check_at_least
from refstream.meta import column_array
from refstream.source import RangeFile, Source

__all__ = ["Footers", "read_episode_rows", "candidate_row_groups"]

EPISODE_COLUMN = "episode_index"
FRAME_COLUMN = "frame_index"
INDEX_COLUMN = "index"


# The file's tail fetched with its size in one request: pyarrow reads the footer from the last
# 64 KiB (its default footer read), so a footer that fits costs no second request.
FOOTER_TAIL_BYTES = 64 * 1024


class Footers:
    """Each data file's size, tail and Parquet footer, read once (SPEC §8.5 step 1) and reused
    for every episode in it; threads share it, and only those needing the same file wait."""

    def __init__(self) -> None:
        self._known: dict[str, tuple[int, bytes, pq.FileMetaData]] = {}
        # One lock per file, held while it is read (setdefault is one atomic dict operation).
        self._locks: dict[str, threading.Lock] = {}

    def open(self, source: Source, relpath: str) -> pq.ParquetFile:
        with self._locks.setdefault(relpath, threading.Lock()):
            if relpath not in self._known:
                tail, size = source.read_tail(relpath, FOOTER_TAIL_BYTES)
                metadata = pq.ParquetFile(RangeFile(source, relpath, size, tail)).metadata
                self._known[relpath] = (size, tail, metadata)
        size, tail, metadata = self._known[relpath]
        return pq.ParquetFile(RangeFile(source, relpath, size, tail), metadata=metadata)


def candidate_row_groups(stats: Sequence[tuple[int, int] | None], episode: int) -> list[int]:
    """Row groups to read (SPEC §8.5 step 2); ``stats[i]``: group i's (min, max) episode or None."""
    return [i for i, s in enumerate(stats) if s is None or s[0] <= episode <= s[1]]


def read_episode_rows(source: Source, relpath: str, episode: int, expected_rows: int,
                      columns: Sequence[str], footers: Footers | None = None,
                      first_index: int | None = None) -> pa.Table:
    """The rows of ``episode`` in ``relpath``, projected to ``columns`` (module docstring)."""
    where = f"{relpath}: episode {episode}"
    wanted = list(dict.fromkeys(columns))
    if not wanted:
        raise UsageError(f"{where}: no columns asked")
    check_at_least(1, expected_rows=expected_rows)
    try:
        parquet = (footers or Footers()).open(source, relpath)
        names = parquet.schema_arrow.names
        missing = [c for c in [*wanted, EPISODE_COLUMN] if c not in names]
        if missing:
            raise TableError(f"{where}: columns {missing} are not in the file")
        extra = [c for c in (EPISODE_COLUMN, FRAME_COLUMN) if c in names and c not in wanted]
        groups = candidate_row_groups(_episode_stats(parquet), episode)
        # Single-threaded: pyarrow's threaded reads through a Python file object can abort the
        # interpreter at exit (apache/arrow#34314); one episode's rows are small anyway.
        table = parquet.read_row_groups(groups, columns=[*wanted, *extra], use_threads=False)
        table = table.filter(pc.equal(table[EPISODE_COLUMN], pa.scalar(episode, pa.int64())))
        _validate(table, where, expected_rows, first_index)
    except RefstreamError:
        raise
    except (pa.ArrowException, OSError) as exc:
        raise TableError(f"{where}: cannot read Parquet ({' '.join(str(exc).split())})") from exc
    return table.select(wanted)


def _episode_stats(parquet: pq.ParquetFile) -> list[tuple[int, int] | None]:
    """``(min, max)`` of ``episode_index`` per row group, None where unusable."""
    schema, metadata = parquet.schema, parquet.metadata
    leaf = [schema.column(i).path for i in range(len(schema))].index(EPISODE_COLUMN)
    stats = [metadata.row_group(g).column(leaf).statistics for g in range(metadata.num_row_groups)]
    return [(int(s.min), int(s.max)) if s is not None and s.has_min_max else None for s in stats]


def _validate(table: pa.Table, where: str, expected_rows: int, first_index: int | None) -> None:
    if table.num_rows != expected_rows:
        raise TableError(f"{where}: expected {expected_rows} rows, found {table.num_rows}")
    for name, first in ((FRAME_COLUMN, 0), (INDEX_COLUMN, first_index)):
        if first is None or name not in table.column_names:
            continue
        values = column_array(table[name], where, name)
        expected = np.arange(first, first + expected_rows)
        if not np.array_equal(values, expected):
            bad = int(np.flatnonzero(values != expected)[0])
            raise TableError(f"{where}: non-contiguous {name}: row {bad} has {int(values[bad])}, "
                             f"expected {int(expected[bad])}")
