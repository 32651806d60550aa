"""Temporal windows: ``delta_timestamps`` → row offsets → per-anchor rows and pad masks (SPEC §5).

Use::

    offsets = make_windows({"action": [0, 1 / 30, 2 / 30]}, fps=30, tolerance_s=1e-4,
                           feature_keys=meta.features)          # once, when the dataset opens
    rows, is_pad = window_rows(offsets["action"], frame=28, length=30)
    # rows == [28, 29, 29], is_pad == [False, False, True]
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence

import numpy as np

from refstream.errors import UsageError, check_int

__all__ = ["make_windows", "window_rows", "check_tolerance"]


def make_windows(delta_timestamps: Mapping[str, Sequence[float]] | None, fps: int,
                 tolerance_s: float, *,
                 feature_keys: Collection[str] | None = None) -> dict[str, np.ndarray]:
    """Each windowed key's row offsets (int64, in the order given) after SPEC §5.1's checks."""
    check_int(fps, "fps", 1)
    check_tolerance(tolerance_s)
    if delta_timestamps is None:
        return {}
    if not isinstance(delta_timestamps, Mapping):
        raise UsageError("delta_timestamps must map keys to lists of seconds, "
                         f"got {delta_timestamps!r}")
    offsets = {}
    for key, deltas in delta_timestamps.items():
        if feature_keys is not None and key not in feature_keys:
            raise UsageError(f"delta_timestamps key {key!r} is not a feature "
                             f"(features: {sorted(feature_keys)})")
        if isinstance(deltas, np.ndarray) and deltas.ndim == 1:
            deltas = deltas.tolist()
        if isinstance(deltas, str) or not isinstance(deltas, Sequence) or not deltas:
            raise UsageError(f"delta_timestamps[{key!r}] must be a non-empty list of seconds")
        offsets[key] = np.array([_offset(key, d, fps, tolerance_s) for d in deltas], np.int64)
    return offsets


def window_rows(offsets: np.ndarray, frame: int | np.ndarray,
                length: int) -> tuple[np.ndarray, np.ndarray]:
    """Episode-local rows (int64) and pad mask (bool) of an anchor or array of them (SPEC §5.2)."""
    anchors = np.asarray(frame, dtype=np.int64)
    if anchors.size and not (0 <= anchors.min() and anchors.max() < length):
        raise UsageError(f"anchor frame {frame} is outside an episode of {length} frames")
    target = anchors[..., None] + np.asarray(offsets, dtype=np.int64)
    # np.minimum and np.maximum: np.clip costs several times more on arrays this small
    return np.minimum(np.maximum(target, 0), length - 1), (target < 0) | (target >= length)


def _offset(key: str, delta_s: object, fps: int, tolerance_s: float) -> int:
    """The row offset of one delta (SPEC §5.1 items 4–5)."""
    if isinstance(delta_s, bool) or not _is_number(delta_s):
        raise UsageError(f"delta_timestamps[{key!r}] holds {delta_s!r}, not a finite number")
    ticks = float(delta_s) * fps  # IEEE double product, as LeRobot computes it
    nearest = round(ticks)  # Python rounds halves to even
    if abs(ticks - nearest) / fps > tolerance_s:
        raise UsageError(f"delta_timestamps[{key!r}] value {delta_s!r} s is "
                         f"{abs(ticks - nearest) / fps:.3g} s from a frame at {fps} fps "
                         f"(tolerance_s {tolerance_s})")
    return nearest


def check_tolerance(tolerance_s: object) -> float:
    """The one check of every ``tolerance_s`` a user gives (SPEC §5.1 item 1); it as a float."""
    if isinstance(tolerance_s, bool) or not _is_number(tolerance_s) or not tolerance_s >= 0:
        raise UsageError(f"tolerance_s must be a finite number >= 0, got {tolerance_s!r}")
    return float(tolerance_s)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float | np.integer | np.floating) and math.isfinite(value)
