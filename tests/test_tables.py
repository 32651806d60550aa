"""Episode rows from Parquet: answers checked against a whole-file pyarrow read filtered with
numpy, and row-group pruning checked against the byte ranges the footer gives each group."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from rangeserver import RangeServer

from refstream.errors import MalformedDataset, TableError, UsageError
from refstream.http import HTTPSource, RetryPolicy
from refstream.meta import column_array
from refstream.source import LocalSource
from refstream.tables import (
    Footers,
    candidate_row_groups,
    read_episode_rows,
)
from refstream.tools.conformance import first_difference, in_process, load_cases

COLUMNS = ["observation.state", "action", "timestamp", "frame_index", "episode_index", "index"]


class RecordingSource(LocalSource):
    """A local source that remembers every (offset, length) it was asked for."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.spans: list[tuple[int, int]] = []

    def read_range(self, relpath: str, offset: int, length: int) -> bytes:
        self.spans.append((offset, length))
        return super().read_range(relpath, offset, length)


def episode_rows(episode: int, length: int, start: int, frames=None) -> dict:
    frames = np.arange(length) if frames is None else np.asarray(frames)
    return {
        "observation.state": [[float(episode), float(f), 0.5] for f in frames],
        "action": pa.array(np.full(length, episode + 0.25, np.float32)),
        "timestamp": pa.array(frames / 30.0, pa.float32()),
        "frame_index": pa.array(frames, pa.int64()),
        "episode_index": pa.array(np.full(length, episode), pa.int64()),
        "index": pa.array(np.arange(start, start + length), pa.int64()),
        # incompressible filler: row groups of tens of kilobytes, more than pyarrow's 64 KiB
        # speculative footer read covers
        "pad": pa.array([bytes(np.random.default_rng(episode * 1000 + int(f)).bytes(2000))
                         for f in frames], pa.binary()),
    }


def write_file(path: Path, episodes: dict[int, int], *, row_group_rows: int | None = None,
               statistics: bool = True, frames: dict[int, list[int]] | None = None) -> None:
    """One row group per episode, or fixed-size groups when ``row_group_rows`` is given."""
    tables, start = [], 0
    for episode, length in episodes.items():
        custom = (frames or {}).get(episode)
        tables.append(pa.table(episode_rows(episode, length, start, custom)))
        start += length
    with pq.ParquetWriter(path, tables[0].schema, write_statistics=statistics) as writer:
        if row_group_rows is None:
            for table in tables:
                writer.write_table(table)
        else:
            writer.write_table(pa.concat_tables(tables), row_group_size=row_group_rows)


def oracle(path: Path, episode: int, columns: list[str]) -> pa.Table:
    whole = pq.read_table(path)
    keep = np.flatnonzero(whole["episode_index"].to_numpy() == episode)
    return whole.take(pa.array(keep)).select(columns)


def group_byte_ranges(path: Path) -> list[tuple[int, int]]:
    """[start, end) of each row group's column chunks, from the footer."""
    meta = pq.ParquetFile(path).metadata
    ranges = []
    for g in range(meta.num_row_groups):
        chunks = [meta.row_group(g).column(c) for c in range(meta.num_columns)]
        starts = [min(x for x in (c.dictionary_page_offset, c.data_page_offset) if x is not None)
                  for c in chunks]
        ends = [s + c.total_compressed_size for s, c in zip(starts, chunks, strict=True)]
        ranges.append((min(starts), max(ends)))
    return ranges


def groups_touched(source: RecordingSource, path: Path) -> set[int]:
    """Row groups whose bytes were read, apart from the first read: the file's last 64 KiB,
    with the footer (it may cover the last groups wholesale, which then cost no read)."""
    size = path.stat().st_size
    first_offset, first_length = source.spans[0]
    assert first_offset + first_length == size and first_length <= 64 * 1024
    ranges = group_byte_ranges(path)
    return {g for g, (lo, hi) in enumerate(ranges)
            for offset, length in source.spans[1:] if offset < hi and offset + length > lo}


def groups_outside_the_tail(path: Path) -> set[int]:
    """Row groups not wholly inside the file's last 64 KiB: reading them costs a request."""
    tail_start = path.stat().st_size - 64 * 1024
    return {g for g, (lo, _hi) in enumerate(group_byte_ranges(path)) if lo < tail_start}


LENGTHS = {0: 40, 1: 25, 2: 60, 3: 13, 4: 31}


def test_one_group_per_episode_reads_only_that_group(tmp_path):
    path = tmp_path / "data.parquet"
    write_file(path, LENGTHS)
    for episode, length in LENGTHS.items():
        source = RecordingSource(tmp_path)
        table = read_episode_rows(source, "data.parquet", episode, length, COLUMNS)
        assert table.equals(oracle(path, episode, COLUMNS))
        assert groups_touched(source, path) == {episode} & groups_outside_the_tail(path)


class StalledTailSource(LocalSource):
    """A local source whose footer read of ``stalled`` waits until ``release`` is set."""

    def __init__(self, root: Path, stalled: str) -> None:
        super().__init__(root)
        self.stalled, self.entered, self.release = stalled, threading.Event(), threading.Event()

    def read_tail(self, relpath: str, length: int) -> tuple[bytes, int]:
        if relpath == self.stalled:
            self.entered.set()
            self.release.wait()
        return super().read_tail(relpath, length)


def test_a_slow_footer_holds_up_only_the_threads_that_need_its_file(tmp_path):
    write_file(tmp_path / "a.parquet", {0: 20})
    write_file(tmp_path / "b.parquet", {1: 20})
    source, footers = StalledTailSource(tmp_path, "a.parquet"), Footers()
    with ThreadPoolExecutor(2) as pool:
        stalled = pool.submit(footers.open, source, "a.parquet")
        assert source.entered.wait(60)
        try:  # the other file's footer is read while a.parquet's read is stalled
            other = pool.submit(footers.open, source, "b.parquet")
            assert other.result(timeout=60).metadata.num_rows == 20  # a bound, not a race
            assert not stalled.done()
        finally:
            source.release.set()
        assert stalled.result().metadata.num_rows == 20


def test_with_known_footers_an_episode_costs_one_range_inside_its_group(tmp_path):
    path = tmp_path / "data.parquet"
    write_file(path, LENGTHS)
    source, footers = RecordingSource(tmp_path), Footers()
    read_episode_rows(source, "data.parquet", 0, LENGTHS[0], COLUMNS, footers)  # reads the footer
    groups = group_byte_ranges(path)
    for episode, length in LENGTHS.items():
        source.spans.clear()
        table = read_episode_rows(source, "data.parquet", episode, length, COLUMNS, footers)
        assert table.equals(oracle(path, episode, COLUMNS))
        assert len(source.spans) == 1
        (offset, size), (begin, end) = source.spans[0], groups[episode]
        assert begin <= offset and offset + size <= end


def test_mixed_groups_read_exactly_the_candidates(tmp_path):
    path = tmp_path / "data.parquet"
    write_file(path, LENGTHS, row_group_rows=17)
    episodes_by_group = [set(pq.ParquetFile(path).read_row_group(g)["episode_index"].to_pylist())
                         for g in range(pq.ParquetFile(path).metadata.num_row_groups)]
    for episode, length in LENGTHS.items():
        source = RecordingSource(tmp_path)
        table = read_episode_rows(source, "data.parquet", episode, length, ["action", "index"])
        assert table.equals(oracle(path, episode, ["action", "index"]))
        # contiguous episodes: min <= e <= max holds exactly for the groups that contain e
        expected = {g for g, held in enumerate(episodes_by_group) if episode in held}
        assert groups_touched(source, path) == expected


def test_groups_without_statistics_all_stay_candidates(tmp_path):
    path = tmp_path / "data.parquet"
    write_file(path, LENGTHS, statistics=False)
    source = RecordingSource(tmp_path)
    table = read_episode_rows(source, "data.parquet", 2, 60, COLUMNS)
    assert table.equals(oracle(path, 2, COLUMNS))
    assert groups_touched(source, path) == set(LENGTHS)


def test_projection_keeps_the_asked_columns_in_order(tmp_path):
    write_file(tmp_path / "data.parquet", LENGTHS)
    table = read_episode_rows(LocalSource(tmp_path), "data.parquet", 1, 25,
                              ["index", "timestamp", "index"])
    assert table.column_names == ["index", "timestamp"]
    assert table["index"].to_pylist() == list(range(40, 65))


def test_missing_rows_and_gaps_in_frame_index_are_errors(tmp_path):
    write_file(tmp_path / "data.parquet", {0: 10, 1: 5},
               frames={1: [0, 1, 3, 4, 5]})
    source = LocalSource(tmp_path)
    with pytest.raises(TableError, match=r"data.parquet: episode 0: expected 11 rows, found 10"):
        read_episode_rows(source, "data.parquet", 0, 11, ["action"])
    with pytest.raises(TableError, match=r"episode 1: non-contiguous frame_index: row 2 has 3"):
        read_episode_rows(source, "data.parquet", 1, 5, ["action"])
    with pytest.raises(TableError, match=r"episode 7: expected 3 rows, found 0"):
        read_episode_rows(source, "data.parquet", 7, 3, ["action"])


def test_bad_files_and_columns_name_file_and_episode(tmp_path):
    write_file(tmp_path / "data.parquet", {0: 10})
    (tmp_path / "junk.parquet").write_bytes(b"not parquet at all" * 10)
    source = LocalSource(tmp_path)
    with pytest.raises(TableError, match=r"data.parquet: episode 0: columns \['nope'\]"):
        read_episode_rows(source, "data.parquet", 0, 10, ["action", "nope"])
    with pytest.raises(TableError, match=r"junk.parquet: episode 0: cannot read") as info:
        read_episode_rows(source, "junk.parquet", 0, 10, ["action"])
    assert isinstance(info.value.__cause__, pa.ArrowException)
    with pytest.raises(MalformedDataset, match="gone.parquet"):  # fetch errors pass through
        read_episode_rows(source, "gone.parquet", 0, 10, ["action"])
    with pytest.raises(UsageError):
        read_episode_rows(source, "data.parquet", 0, 10, [])


def test_rows_over_http_equal_the_local_answer(tmp_path):
    path = tmp_path / "data.parquet"
    write_file(path, LENGTHS, row_group_rows=17)
    with RangeServer(tmp_path) as server:
        source = HTTPSource(server.url, retry=RetryPolicy(backoff_base_s=0.01))
        table = read_episode_rows(source, "data.parquet", 3, 13, COLUMNS)
        ranged = [r.range for r in server.log if r.method == "GET"]
    assert table.equals(oracle(path, 3, COLUMNS))
    assert ranged and all(r is not None for r in ranged)  # never a whole-file GET
    size = path.stat().st_size
    # the footer's read is the file's last 64 KiB (bytes=-65536), the rest are row groups
    assert ranged[0] == "bytes=-65536"
    assert [r.method for r in server.log].count("HEAD") == 0  # the size came with the tail
    group_bytes = sum(int(r.split("-")[1]) - int(r[6:].split("-")[0]) + 1 for r in ranged[1:])
    assert min(size, 64 * 1024) + group_bytes < size / 2


def test_candidate_rule_by_hand():
    stats = [(0, 0), (0, 2), None, (3, 5), (5, 5)]
    assert candidate_row_groups(stats, 0) == [0, 1, 2]
    assert candidate_row_groups(stats, 5) == [2, 3, 4]
    assert candidate_row_groups(stats, 9) == [2]
    assert candidate_row_groups([], 0) == []


CASES = load_cases(kind="row_group_candidates")


@pytest.mark.parametrize("case", CASES, ids=[c.path.stem for c in CASES])
def test_conformance_cases(case):
    answer = in_process(case)
    assert first_difference(case.expected, answer) is None, (case.expected, answer)
    assert len(CASES) >= 2


def test_threads_sharing_footers_read_each_footer_once(tmp_path):
    path = tmp_path / "data.parquet"
    write_file(path, LENGTHS)

    arrived = threading.Condition()
    callers = []

    class CountedFooters(Footers):
        def open(self, source, relpath):
            with arrived:
                callers.append(relpath)
                arrived.notify_all()
            return super().open(source, relpath)

    class SlowTails(RecordingSource):
        tails = 0

        def read_tail(self, relpath, length):
            SlowTails.tails += 1
            with arrived:  # the first reader holds on until every thread has asked for the footer
                assert arrived.wait_for(lambda: len(callers) == len(LENGTHS), timeout=30)
            return super().read_tail(relpath, length)

    source, footers = SlowTails(tmp_path), CountedFooters()
    with ThreadPoolExecutor(len(LENGTHS)) as pool:
        tables = list(pool.map(lambda e: read_episode_rows(source, "data.parquet", e, LENGTHS[e],
                                                           COLUMNS, footers), LENGTHS))
    for episode, table in zip(LENGTHS, tables, strict=True):
        assert table.equals(oracle(path, episode, COLUMNS))
    assert SlowTails.tails == 1


def test_column_array_turns_fixed_lists_into_axes_and_names_bad_columns():
    table = pa.table({
        "scalar": pa.array([1.5, 2.5], pa.float32()),
        "vector": pa.array([[1, 2, 3], [4, 5, 6]], pa.list_(pa.int64(), 3)),
        "matrix": pa.array([[[1, 2], [3, 4]], [[5, 6], [7, 8]]],
                           pa.list_(pa.list_(pa.int16(), 2), 2)),
        "listed": pa.array([[1.0, 2.0], [3.0, 4.0]], pa.list_(pa.float64())),
        "ragged": pa.array([[1.0], [2.0, 3.0]], pa.list_(pa.float64())),
        "holes": pa.array([1, None], pa.int64()),
    })
    got = {n: column_array(table[n], "f.parquet: episode 3", n)
           for n in ("scalar", "vector", "matrix", "listed")}
    np.testing.assert_array_equal(got["scalar"], np.array([1.5, 2.5], np.float32))
    np.testing.assert_array_equal(got["vector"], [[1, 2, 3], [4, 5, 6]])
    assert got["matrix"].shape == (2, 2, 2) and got["matrix"][1, 0, 1] == 6
    np.testing.assert_array_equal(got["listed"], [[1.0, 2.0], [3.0, 4.0]])
    with pytest.raises(TableError, match=r"f.parquet: episode 3: column 'ragged' is ragged"):
        column_array(table["ragged"], "f.parquet: episode 3", "ragged")
    with pytest.raises(TableError, match=r"f.parquet: episode 3: column 'holes' has 1 null"):
        column_array(table["holes"], "f.parquet: episode 3", "holes")
