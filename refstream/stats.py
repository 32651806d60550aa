"""Normalisation statistics, the numbers a LeRobot policy is built from (SPEC §4.7).

Use::

    meta.stats["action"]["mean"]              # meta/stats.json, parsed by load_meta (parse_stats)
    selection_stats(source, meta, [3, 7])     # the statistics of those episodes alone
    aggregate_stats(episode_stats(table))     # combined from an episodes table's own columns

The module reads no file: :mod:`refstream.meta` reads the bytes and the rows
(``meta.episode_rows``) it is given.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import numpy as np
import pyarrow as pa

from refstream.errors import MalformedDataset, UsageError

__all__ = ["STATS_PATH", "aggregate_stats", "episode_stats", "parse_stats", "selection_stats"]

STATS_PATH = "meta/stats.json"
# A feature's statistics: stat name -> array (float64; "count" int64).
Stats = dict[str, dict[str, np.ndarray]]
# The statistics that are not quantiles; every other stat must be a quantile "qNN".
_MOMENTS = ("min", "max", "mean", "std", "count")
_QUANTILE = re.compile(r"q[0-9]{2}")


def selection_stats(source, meta, episodes: Sequence[int]) -> Stats:
    """The statistics of ``episodes`` alone, from their rows (``meta.episode_rows(source, …)``)."""
    return aggregate_stats([episode_stats(row, relpath)[0]
                            for relpath, row in meta.episode_rows(source, episodes)])


def parse_stats(document: object, where: str = STATS_PATH) -> Stats:
    """``meta/stats.json``'s JSON value as arrays (SPEC §4.7)."""
    if not isinstance(document, dict):
        raise MalformedDataset(f"{where}: expected an object of features")
    stats: Stats = {}
    for feature, values in document.items():
        if not isinstance(values, dict):
            raise MalformedDataset(f"{where}: feature {feature!r} is not an object of stats")
        stats[feature] = {name: _stat_array(value, f"{where}: {feature}/{name}", name)
                          for name, value in values.items()}
    return stats


def episode_stats(table: pa.Table, where: str = "meta/episodes") -> list[Stats]:
    """Each row's statistics from its ``stats/<feature>/<stat>`` columns (SPEC §4.7)."""
    columns = [name for name in table.column_names if name.startswith("stats/")]
    rows: list[Stats] = [{} for _ in range(table.num_rows)]
    for name in columns:
        feature, _, stat = name.removeprefix("stats/").rpartition("/")
        if not feature:
            raise MalformedDataset(f"{where}: column {name!r} is not stats/<feature>/<stat>")
        for row, value in zip(rows, table.column(name).to_pylist(), strict=True):
            if value is not None:
                row.setdefault(feature, {})[stat] = _stat_array(value, f"{where}: {name}", stat)
    return rows


def aggregate_stats(parts: Sequence[Mapping[str, Mapping[str, np.ndarray]]]) -> Stats:
    """The statistics of the union of disjoint ``parts`` (SPEC §4.7); a feature missing from a
    part is combined over the parts that have it."""
    if not parts:
        raise UsageError("aggregate_stats needs at least one part")
    features = dict.fromkeys(feature for part in parts for feature in part)
    return {feature: _aggregate_feature(parts, feature) for feature in features}


def _aggregate_feature(all_parts: Sequence[Mapping[str, Mapping]], feature: str) -> dict:
    parts = [part[feature] for part in all_parts if feature in part]  # the parts that have it
    quantiles = [name for name in parts[0] if name not in _MOMENTS]
    missing = [name for name in (*_MOMENTS, *quantiles) if any(name not in part for part in parts)]
    if missing:
        raise UsageError(f"stats of {feature!r}: a part lacks {missing}")
    stacked = {name: np.stack([part[name] for part in parts]) for name in (*_MOMENTS, *quantiles)}
    counts = stacked["count"].astype(np.int64)
    total = counts.sum(axis=0)
    means = stacked["mean"]
    weights = counts.reshape(counts.shape + (1,) * (means.ndim - counts.ndim))
    mean = (means * weights).sum(axis=0) / total
    variance = ((stacked["std"] ** 2 + (means - mean) ** 2) * weights).sum(axis=0) / total
    return {"min": stacked["min"].min(axis=0), "max": stacked["max"].max(axis=0),
            "mean": mean, "std": np.sqrt(variance), "count": total,
            **{name: (stacked[name] * weights).sum(axis=0) / total for name in quantiles}}


def _stat_array(value: object, where: str, name: str) -> np.ndarray:
    """One stat as LeRobot casts it: ``count`` int64, every other stat float64."""
    if name not in _MOMENTS and not _QUANTILE.fullmatch(name):
        raise MalformedDataset(f"{where}: unknown stat {name!r} (expected {_MOMENTS} or qNN)")
    try:
        array = np.array(value, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise MalformedDataset(f"{where}: not a rectangular array of numbers") from exc
    if name != "count":
        return array
    if not np.array_equal(array, np.round(array)) or (array < 0).any():
        raise MalformedDataset(f"{where}: a count must hold non-negative integers")
    return array.astype(np.int64)
