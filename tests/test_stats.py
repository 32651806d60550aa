"""Normalisation statistics against LeRobot's own files: ``meta/stats.json`` as LeRobot 0.6.1
loads it, and the per-episode statistics LeRobot wrote into ``meta/episodes``, which combined
over every episode must give back the ``stats.json`` LeRobot made from them; a subset's combined
mean, std, min, max and count must equal the same numbers computed straight from its rows, also
when its episodes' statistics lie in several ``meta/episodes`` files."""

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from refstream.errors import MalformedDataset, UsageError
from refstream.meta import load_meta
from refstream.source import LocalSource
from refstream.stats import aggregate_stats, episode_stats, parse_stats, selection_stats
from refstream.tools.demo import write_demo_dataset

ROOT = Path(__file__).resolve().parent.parent / "spec" / "fixtures" / "lerobot" / "lr_av1"
QUANTILES = ("q01", "q10", "q50", "q90", "q99")


def lerobot_stats():
    return parse_stats(json.loads((ROOT / "meta" / "stats.json").read_bytes()))


def per_episode():
    return episode_stats(pq.read_table(ROOT / "meta/episodes/chunk-000/file-000.parquet"))


def test_stats_json_loads_as_lerobot_casts_it():
    stats = lerobot_stats()
    raw = json.loads((ROOT / "meta" / "stats.json").read_text())
    assert set(stats) == set(raw)
    for feature, values in raw.items():
        assert set(stats[feature]) == {"min", "max", "mean", "std", "count", *QUANTILES}
        for name, value in values.items():
            array = stats[feature][name]
            assert array.dtype == (np.int64 if name == "count" else np.float64)
            assert array.tolist() == value
    assert stats["observation.images.front"]["mean"].shape == (3, 1, 1)
    assert stats["action"]["std"].shape == (6,)
    assert stats["action"]["count"].tolist() == [300]


def test_every_episode_combined_gives_back_lerobots_stats_json():
    combined = aggregate_stats(per_episode())
    expected = lerobot_stats()
    assert set(combined) == set(expected)
    for feature, values in expected.items():
        assert set(combined[feature]) == set(values)
        for name, value in values.items():
            assert combined[feature][name].shape == value.shape, (feature, name)
            np.testing.assert_allclose(combined[feature][name], value, rtol=1e-8, atol=0,
                                       err_msg=f"{feature}/{name}")


@pytest.mark.parametrize("episodes", [[0], [1, 3], [0, 2, 4], [4, 3, 2, 1]])
def test_a_subset_combined_equals_its_rows(episodes):
    rows = pq.read_table(ROOT / "data/chunk-000/file-000.parquet").to_pydict()
    combined = aggregate_stats([per_episode()[e] for e in episodes])
    chosen = np.isin(np.asarray(rows["episode_index"]), episodes)
    for feature in ("observation.state", "action"):
        values = np.asarray(rows[feature], np.float64)[chosen]
        got = combined[feature]
        assert got["count"].tolist() == [len(values)]
        np.testing.assert_array_equal(got["min"], values.min(axis=0))
        np.testing.assert_array_equal(got["max"], values.max(axis=0))
        np.testing.assert_allclose(got["mean"], values.mean(axis=0), rtol=1e-6, atol=1e-9)
        np.testing.assert_allclose(got["std"], values.std(axis=0), rtol=1e-6, atol=1e-9)


def test_quantiles_combine_count_weighted():
    a = {"x": {"min": np.array([0.0]), "max": np.array([1.0]), "mean": np.array([0.5]),
               "std": np.array([0.5]), "count": np.array([1]), "q50": np.array([0.0])}}
    b = {"x": {"min": np.array([2.0]), "max": np.array([4.0]), "mean": np.array([3.0]),
               "std": np.array([1.0]), "count": np.array([3]), "q50": np.array([4.0])}}
    got = aggregate_stats([a, b])["x"]
    assert got["q50"].tolist() == [3.0]  # (1·0 + 3·4) / 4
    assert got["mean"].tolist() == [2.375]  # (1·0.5 + 3·3) / 4
    # pooled variance: (1·(0.25 + 1.875²) + 3·(1 + 0.625²)) / 4
    assert got["std"].tolist() == pytest.approx([np.sqrt((0.25 + 1.875**2 + 3 * (1 + 0.625**2))
                                                         / 4)])
    assert (got["min"].tolist(), got["max"].tolist(), got["count"].tolist()) == ([0.0], [4.0], [4])


@pytest.mark.parametrize("text, fragment", [
    (b"[1, 2]", "object of features"),
    (b'{"action": 3}', "action"),
    (b'{"action": {"mean": [1, [2]]}}', "action/mean"),
    (b'{"action": {"count": [2.5]}}', "action/count"),
    (b'{"action": {"median": [1]}}', "median"),
    ('{"action": {"q\u0665\u0660": [1]}}'.encode(), "action/q"),  # not ASCII digits
])
def test_malformed_stats_name_the_feature_and_stat(text, fragment):
    with pytest.raises(MalformedDataset, match=fragment.replace("[", r"\[")):
        parse_stats(json.loads(text))


def test_combining_nothing_or_parts_without_moments_is_a_usage_error():
    with pytest.raises(UsageError):
        aggregate_stats([])
    with pytest.raises(UsageError, match="std"):
        aggregate_stats([{"x": {"min": np.zeros(1), "max": np.zeros(1), "mean": np.zeros(1),
                                "count": np.ones(1, np.int64)}}])


@pytest.fixture
def dataset(tmp_path, monkeypatch):
    from refstream.stream import StreamingDataset

    monkeypatch.setenv("REFSTREAM_CACHE", str(tmp_path / "cache"))
    return lambda **kw: StreamingDataset(ROOT, **kw)


def test_the_dataset_answers_what_lerobots_does(dataset):
    info = json.loads((ROOT / "meta" / "info.json").read_text())
    for feature in info["features"].values():  # LeRobot's DatasetInfo makes shapes tuples
        feature["shape"] = tuple(feature["shape"])
    full, some = dataset(), dataset(episodes=[1, 3])
    assert (full.fps, full.features, full.camera_keys) == (
        info["fps"], info["features"],
        [k for k, f in info["features"].items() if f["dtype"] == "video"])
    assert (full.num_episodes, full.num_frames) == (5, 300)
    assert (some.num_episodes, some.num_frames) == (2, 45 + 75)
    # meta.stats is the whole dataset's, whatever the selection, as LeRobot's is
    for ds in (full, some):
        assert set(ds.meta.stats) == set(lerobot_stats())
        for feature, values in lerobot_stats().items():
            for name, value in values.items():
                np.testing.assert_array_equal(ds.meta.stats[feature][name], value)


def test_selection_stats_combine_only_the_selected_episodes(dataset):
    some = dataset(episodes=[3, 1]).selection_stats()
    expected = aggregate_stats([per_episode()[1], per_episode()[3]])
    assert set(some) == set(expected)
    for feature, values in expected.items():
        for name, value in values.items():
            np.testing.assert_array_equal(some[feature][name], value)
    everything = dataset().selection_stats()
    np.testing.assert_allclose(everything["action"]["std"], lerobot_stats()["action"]["std"],
                               rtol=1e-8, atol=0)


def test_a_dataset_without_stats_json_has_none(tmp_path, monkeypatch):
    import shutil

    from refstream.stream import StreamingDataset

    root = tmp_path / "ds"
    shutil.copytree(ROOT, root)
    (root / "meta" / "stats.json").unlink()
    monkeypatch.setenv("REFSTREAM_CACHE", str(tmp_path / "cache"))
    assert StreamingDataset(root).meta.stats is None


# --- a selection whose statistics lie in several episodes files ----------------------------------

SPLIT_LENGTHS = (6, 9, 4, 7, 5, 8, 3)


@pytest.fixture(scope="module")
def split_root(tmp_path_factory) -> Path:
    """A demo dataset whose episodes table is three files: episodes 0-2, 3-5 and 6."""
    root = tmp_path_factory.mktemp("split") / "dataset"
    write_demo_dataset(root, episode_lengths=SPLIT_LENGTHS, cameras=["observation.images.front"],
                       size=(16, 16), episodes_per_meta_file=3)
    return root


def stats_by_episode(root: Path) -> dict[int, dict[str, dict[str, np.ndarray]]]:
    """Each episode's ``stats/<feature>/<stat>`` values, found by its ``episode_index``."""
    found = {}
    for path in sorted((root / "meta" / "episodes").rglob("*.parquet")):
        table = pq.read_table(path).to_pylist()
        for row in table:
            stats: dict = {}
            for name, value in row.items():
                if name.startswith("stats/"):
                    feature, _, stat = name.removeprefix("stats/").rpartition("/")
                    stats.setdefault(feature, {})[stat] = np.asarray(value, np.float64)
            found[row["episode_index"]] = stats
    return found


@pytest.mark.parametrize("episodes", [[6, 1, 4], [2, 3], [5], list(range(7))])
def test_selection_stats_over_several_episodes_files(split_root, episodes):
    source = LocalSource(split_root)
    meta = load_meta(source)
    assert [count for _, count in meta.episodes_files] == [3, 3, 1]
    got = selection_stats(source, meta, episodes)

    # the moments of the row features, straight from the selected episodes' data rows
    rows = pq.read_table(split_root / "data").to_pydict()
    chosen = np.isin(np.asarray(rows["episode_index"]), episodes)
    for feature in ("observation.state", "action", "frame_index", "index", "episode_index"):
        values = np.asarray(rows[feature], np.float64)[chosen].reshape(int(chosen.sum()), -1)
        assert got[feature]["count"].tolist() == [len(values)]
        np.testing.assert_array_equal(got[feature]["min"], values.min(axis=0))
        np.testing.assert_array_equal(got[feature]["max"], values.max(axis=0))
        np.testing.assert_allclose(got[feature]["mean"], values.mean(axis=0), rtol=1e-9)
        np.testing.assert_allclose(got[feature]["std"], values.std(axis=0), rtol=1e-9, atol=1e-12)

    # every stat of every feature (camera and quantiles too) as SPEC §4.7 combines the episodes'
    parts = [stats_by_episode(split_root)[e] for e in episodes]
    assert set(got) == set(parts[0])
    for feature, stats in got.items():
        of = [part[feature] for part in parts]
        counts = [stat["count"][0] for stat in of]

        def weighted(values, counts=counts):
            return sum(n * v for n, v in zip(counts, values, strict=True)) / sum(counts)

        mean = weighted([stat["mean"] for stat in of])
        spread = [stat["std"] ** 2 + (stat["mean"] - mean) ** 2 for stat in of]
        expected = {
            "count": [sum(counts)], "mean": mean,
            "min": np.min([stat["min"] for stat in of], axis=0),
            "max": np.max([stat["max"] for stat in of], axis=0),
            "std": np.sqrt(weighted(spread)),
            **{q: weighted([stat[q] for stat in of]) for q in QUANTILES},
        }
        assert set(stats) == set(expected), feature
        for name, value in expected.items():
            np.testing.assert_allclose(stats[name], value, rtol=1e-12, err_msg=f"{feature}/{name}")
