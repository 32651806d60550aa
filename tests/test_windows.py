"""windows.py against an independent brute force of LeRobot's map-style rule.

The oracle works on *absolute* dataset indices, as LeRobot's map-style dataset does: an item at
index ``a`` of an episode ``[s, e)`` queries ``clamp(a + δ, s, e − 1)`` and pads where
``a + δ`` leaves ``[s, e)``; ``δ`` is ``d·fps`` rounded half to even, computed here with exact
fractions instead of Python's ``round``. refstream works on episode-local rows; the two must
agree for every anchor of every episode.
"""

from __future__ import annotations

import json
import math
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from refstream.errors import UsageError
from refstream.tools.adapters import kind_windows
from refstream.windows import make_windows, window_rows

FIXTURES = Path(__file__).resolve().parent.parent / "spec" / "fixtures" / "windows"


# --- the oracle --------------------------------------------------------------------------------


def half_even(value: float) -> int:
    """Round the exact binary value of a float to the nearest integer, halves to even."""
    exact = Fraction(value)
    below = math.floor(exact)
    rest = exact - below
    if rest > Fraction(1, 2) or (rest == Fraction(1, 2) and below % 2 == 1):
        return below + 1
    return below


def oracle_offsets(deltas: list[float], fps: int, tolerance_s: float) -> list[int] | None:
    """LeRobot's check_delta_timestamps + get_delta_indices; None when the check fails."""
    offsets = []
    for d in deltas:
        ticks = d * fps
        if abs(ticks - half_even(ticks)) / fps > tolerance_s:
            return None
        offsets.append(half_even(ticks))
    return offsets


def oracle_items(lengths: list[int], offsets: list[int]) -> list[tuple[list[int], list[bool]]]:
    """For every absolute index of a dataset of consecutive episodes: (query indices, pads)."""
    items = []
    start = 0
    for length in lengths:
        end = start + length
        for a in range(start, end):
            query = [min(max(a + d, start), end - 1) for d in offsets]
            pads = [not (start <= a + d < end) for d in offsets]
            items.append((query, pads))
        start = end
    return items


def oracle_answer(case: dict) -> dict:
    """The expected answer of a ``windows`` conformance case, from the oracle alone."""
    keys = case.get("feature_keys")
    fps, tolerance_s = case["fps"], case["tolerance_s"]
    if type(fps) is not int or fps < 1 or type(tolerance_s) not in (int, float) or not (
        0 <= tolerance_s < math.inf
    ):
        return {"error": "UsageError"}
    offsets = {}
    for key, deltas in case["delta_timestamps"].items():
        if (keys is not None and key not in keys) or type(deltas) is not list or not deltas:
            return {"error": "UsageError"}
        if any(type(d) not in (int, float) or not math.isfinite(d) for d in deltas):
            return {"error": "UsageError"}
        found = oracle_offsets(deltas, case["fps"], case["tolerance_s"])
        if found is None:
            return {"error": "UsageError"}
        offsets[key] = found
    length = case["length"]
    if any(not 0 <= f < length for f in case["frames"]):
        return {"error": "UsageError"}
    # Place the episode after a 7-frame neighbour so absolute and local indices differ.
    before = 7
    rows, pads = {}, {}
    for key, key_offsets in offsets.items():
        items = oracle_items([before, length], key_offsets)
        rows[key] = [[q - before for q in items[before + f][0]] for f in case["frames"]]
        pads[key] = [items[before + f][1] for f in case["frames"]]
    return {"offsets": offsets, "rows": rows, "is_pad": pads}


# --- agreement with the oracle -----------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 12), min_size=1, max_size=4),
    fps=st.sampled_from([1, 2, 10, 15, 30, 50]),
    half_ticks=st.lists(st.integers(-30, 30), min_size=1, max_size=6),
)
def test_rows_and_pads_equal_map_style_items(lengths, fps, half_ticks):
    # Deltas on a half-frame grid, so .5 ties occur; a tolerance of half a frame admits them.
    deltas = [h / (2 * fps) for h in half_ticks]
    tolerance_s = 0.5 / fps
    expected_offsets = oracle_offsets(deltas, fps, tolerance_s)
    if expected_offsets is None:  # a tie that floating point pushed just past the tolerance
        with pytest.raises(UsageError):
            make_windows({"action": deltas}, fps, tolerance_s)
        return
    windows = make_windows({"action": deltas}, fps, tolerance_s)
    assert windows["action"].tolist() == expected_offsets
    items = iter(oracle_items(lengths, expected_offsets))
    start = 0
    for length in lengths:
        for frame in range(length):
            query, pads = next(items)
            rows, is_pad = window_rows(windows["action"], frame, length)
            assert rows.dtype == np.int64 and is_pad.dtype == np.bool_
            assert (rows + start).tolist() == query
            assert is_pad.tolist() == pads
        start += length


def test_halves_round_to_even():
    # fps 2: d·fps = -1.5, -0.5, 0.5, 1.5, 2.5 -> -2, 0, 0, 2, 2.
    windows = make_windows({"k": [-0.75, -0.25, 0.25, 0.75, 1.25]}, 2, tolerance_s=0.25)
    assert windows["k"].tolist() == [-2, 0, 0, 2, 2]


def test_windows_past_both_ends_repeat_the_boundary_rows():
    offsets = np.array([-3, -1, 0, 2, 4], np.int64)
    rows, is_pad = window_rows(offsets, frame=1, length=4)
    assert rows.tolist() == [0, 0, 1, 3, 3]
    assert is_pad.tolist() == [True, False, False, False, True]
    rows, is_pad = window_rows(offsets, frame=0, length=1)
    assert rows.tolist() == [0, 0, 0, 0, 0]
    assert is_pad.tolist() == [True, True, False, True, True]


def test_lerobot_float_deltas_convert_exactly():
    # The oracle dataset's windows, as LeRobot users write them (k / 30 in floating point).
    windows = make_windows(
        {"action": [k / 30 for k in range(8)], "observation.state": [-1 / 30, 0.0]}, 30, 1e-4
    )
    assert windows["action"].tolist() == list(range(8))
    assert windows["observation.state"].tolist() == [-1, 0]
    as_array = make_windows({"action": np.arange(8) / 30}, 30, 1e-4)
    assert as_array["action"].tolist() == list(range(8))


# --- validation ----------------------------------------------------------------------------------


def test_a_delta_off_the_frame_grid_names_key_and_value():
    with pytest.raises(UsageError, match=r"'action'.*0\.01"):
        make_windows({"action": [0.0, 0.01]}, 30, 1e-4)
    # The same delta passes with a tolerance that covers its distance to the grid (0.3 frame).
    assert make_windows({"action": [0.01]}, 30, 0.011)["action"].tolist() == [0]


def test_the_tolerance_bound_is_inclusive():
    # 3·0.1 = 0.30000000000000004 and ·10 = 3.0000000000000004 in doubles: off the grid by
    # 4.4e-16 ticks = 4.4e-17 s. A zero tolerance refuses it; exactly that distance admits it.
    delta_s = 3 * 0.1
    distance_s = abs(delta_s * 10 - 3) / 10
    assert distance_s > 0
    assert make_windows({"k": [delta_s]}, 10, distance_s)["k"].tolist() == [3]
    with pytest.raises(UsageError):
        make_windows({"k": [delta_s]}, 10, 0.0)


@pytest.mark.parametrize(
    "delta_timestamps",
    [
        {"k": []},
        {"k": [float("nan")]},
        {"k": [float("inf")]},
        {"k": [True]},
        {"k": "0.1"},
        {"k": 0.1},
    ],
)
def test_malformed_deltas_are_usage_errors(delta_timestamps):
    with pytest.raises(UsageError, match="'k'"):
        make_windows(delta_timestamps, 30, 1e-4)


def test_unknown_keys_are_usage_errors():
    with pytest.raises(UsageError, match="'nope'"):
        make_windows({"nope": [0.0]}, 30, 1e-4, feature_keys={"action", "timestamp"})


@pytest.mark.parametrize("fps, tolerance_s", [(0, 1e-4), (30.0, 1e-4), (30, -1.0), (30, math.nan)])
def test_bad_fps_or_tolerance_are_usage_errors(fps, tolerance_s):
    with pytest.raises(UsageError):
        make_windows({"k": [0.0]}, fps, tolerance_s)


def test_no_delta_timestamps_means_no_windows():
    assert make_windows(None, 30, 1e-4) == {}
    assert make_windows({}, 30, 1e-4) == {}


@pytest.mark.parametrize("frame, length", [(-1, 5), (5, 5), (0, 0)])
def test_an_anchor_outside_the_episode_is_a_usage_error(frame, length):
    with pytest.raises(UsageError, match="outside"):
        window_rows(np.array([0], np.int64), frame, length)


# --- conformance fixtures ------------------------------------------------------------------------


FIXTURE_CASES = sorted(FIXTURES.glob("*.json"))


def test_there_are_windows_fixtures():
    assert len(FIXTURE_CASES) >= 8


@pytest.mark.parametrize("path", FIXTURE_CASES, ids=lambda p: p.name)
def test_fixture_expectations_come_from_the_oracle_and_refstream_meets_them(path):
    case = json.loads(path.read_text())
    assert case["kind"] == "windows"
    assert case["expected"] == oracle_answer(case["input"])
    try:
        answer = kind_windows(json.loads(json.dumps(case["input"])))
    except UsageError:
        answer = {"error": "UsageError"}
    assert json.loads(json.dumps(answer)) == case["expected"]


def test_delta_timestamps_must_be_a_mapping():
    with pytest.raises(UsageError, match="map keys"):
        make_windows([("action", [0.0])], 30, 1e-4)
