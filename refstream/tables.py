"""One episode's rows of a LeRobot v3 data Parquet file, read by range: SPEC §8.5.

Use::

    footers = Footers()          # one per worker: each file's footer is read once
    table = read_episode_rows(source, relpath, episode, expected_rows, columns, footers,
                              first_index=meta.from_index[row])     # checks the index column
    values = column_array(table[name], where, name)          # refstream.meta: numpy per row

``read_episode_rows`` returns a ``pyarrow.Table`` of exactly ``columns`` (asked order,
duplicates dropped) and ``expected_rows`` rows whose ``frame_index`` counts from 0 and, given
``first_index``, whose ``index`` counts from it: list and struct features keep their Arrow types
until the caller converts them. It reads through a ``RangeFile`` over the source, so only the
footer (one ``read_tail`` of :data:`FOOTER_TAIL_BYTES`) and the candidate row groups' column
chunks travel; :func:`candidate_row_groups` is the pruning rule on its own. Failures are
:class:`TableError` naming the file and the episode, pyarrow's errors chained; fetch errors pass
through unchanged.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from refstream.errors import RefstreamError, TableError, UsageError
from refstream.meta import column_array
from refstream.source import RangeFile, Source

__all__ = ["Footers", "read_episode_rows", "candidate_row_groups", "EPISODE_COLUMN",
           "FRAME_COLUMN", "INDEX_COLUMN"]

EPISODE_COLUMN = "episode_index"
FRAME_COLUMN = "frame_index"
INDEX_COLUMN = "index"


# The file's tail fetched with its size in one request: pyarrow reads the footer from the last
# 64 KiB (its default footer read), so a footer that fits costs no second request.
FOOTER_TAIL_BYTES = 64 * 1024


class Footers:
    """Each data file's size, tail and Parquet footer, read once (one ``read_tail``) and reused
    for every episode in it (the tail is at most 64 KiB per file a worker touches). Threads
    share it: one reads a footer while the others wait."""

    def __init__(self) -> None:
        self._known: dict[str, tuple[int, bytes, pq.FileMetaData]] = {}
        self._lock = threading.Lock()

    def open(self, source: Source, relpath: str) -> pq.ParquetFile:
        with self._lock:
            if relpath not in self._known:
                tail, size = source.read_tail(relpath, FOOTER_TAIL_BYTES)
                metadata = pq.ParquetFile(RangeFile(source, relpath, size, tail)).metadata
                self._known[relpath] = (size, tail, metadata)
        size, tail, metadata = self._known[relpath]
        return pq.ParquetFile(RangeFile(source, relpath, size, tail), metadata=metadata)


def candidate_row_groups(stats: Sequence[tuple[int, int] | None], episode: int) -> list[int]:
    """Indices of the row groups that may hold ``episode``: ``stats[i]`` is ``(min, max)`` of
    group ``i``'s ``episode_index``, or None (no usable statistics: always a candidate)."""
    return [i for i, s in enumerate(stats) if s is None or s[0] <= episode <= s[1]]


def read_episode_rows(
    source: Source,
    relpath: str,
    episode: int,
    expected_rows: int,
    columns: Sequence[str],
    footers: Footers | None = None,
    first_index: int | None = None,
) -> pa.Table:
    """The rows of ``episode`` in ``relpath``, projected to ``columns`` (module docstring)."""
    wanted = list(dict.fromkeys(columns))
    if not wanted:
        raise UsageError(f"{relpath}: episode {episode}: no columns asked")
    if expected_rows <= 0:
        raise UsageError(f"{relpath}: episode {episode}: expected_rows must be > 0")
    where = f"{relpath}: episode {episode}"
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
        raise TableError(f"{where}: cannot read Parquet ({exc})") from exc
    return table.select(wanted)


def _episode_stats(parquet: pq.ParquetFile) -> list[tuple[int, int] | None]:
    """``(min, max)`` of ``episode_index`` per row group, None where unusable."""
    metadata = parquet.metadata
    if metadata.num_row_groups == 0:
        return []
    first = metadata.row_group(0)
    leaf = next(i for i in range(first.num_columns)
                if first.column(i).path_in_schema == EPISODE_COLUMN)
    stats: list[tuple[int, int] | None] = []
    for group in range(metadata.num_row_groups):
        chunk = metadata.row_group(group).column(leaf).statistics
        if chunk is None or not chunk.has_min_max:
            stats.append(None)
        else:
            stats.append((int(chunk.min), int(chunk.max)))
    return stats


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
