"""The portable, counter-based random numbers every refstream order is made of.

The order of a stream must be reproducible in any language, so refstream does not use numpy's
generators. Everything random is a pure function of a *key* and an *index*, built on SplitMix64
(Steele, Lea & Flood 2014; the generator of Java's ``SplittableRandom``):

``mix64(z)``
    The SplitMix64 finaliser, a bijection of 64-bit words.
``derive_key(seed, *labels)``
    Folds labels (integers and strings) into a seed, one 64-bit word at a time, with ``mix64``;
    ``extend_key(key, *labels)`` folds more labels into a derived key.
    The planner's keys are ``(seed, epoch, "admit")``, ``(seed, epoch, "frames", episode)``,
    ``(seed, epoch, "draw", rank, worker)`` and ``(seed, epoch, "round", rank, worker, round)``.
``u64(key, i)``
    The ``i``-th word of the key's stream: ``mix64(key + (i + 1)·GOLDEN_GAMMA mod 2⁶⁴)``.
``below(n, key, i)``
    A number in ``[0, n)``: ``(u64(key, i) · n) >> 64`` (Lemire's multiply-shift, no rejection).
``permutation(key, ids)``
    The ids sorted by ``(u64(key, id), id)``; an id's place depends only on the key and the id.
    ``permutation_list`` is the same in plain integers, for short lists.

``u64_array`` and ``permutation`` are vectorised with numpy ``uint64`` arithmetic (which wraps
modulo 2⁶⁴ like the definition); ``u64`` and ``below`` are the plain-integer forms. The exact
label encoding is in ``spec/SPEC.md`` §1.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from refstream.errors import UsageError

__all__ = [
    "DEFAULT_SEED",
    "GOLDEN_GAMMA",
    "resolve_seed",
    "mix64",
    "label_words",
    "derive_key",
    "extend_key",
    "u64",
    "u64_array",
    "below",
    "permutation",
    "permutation_list",
]

MASK64 = (1 << 64) - 1
# The seed when the user gives none (LeRobot's DEFAULT_STREAMING_SEED).
DEFAULT_SEED = 42
# SplitMix64's increment: 2⁶⁴ divided by the golden ratio, made odd.
GOLDEN_GAMMA = 0x9E3779B97F4A7C15
# The two multipliers of SplitMix64's finaliser (Stafford's "Mix13" variant).
_MIX_MUL_1 = 0xBF58476D1CE4E5B9
_MIX_MUL_2 = 0x94D049BB133111EB
# Type tags that start a label's words, so an integer label never encodes like a string label.
TAG_INT = 1
TAG_STR = 2


def mix64(z: int) -> int:
    """SplitMix64's finaliser of the 64-bit word ``z`` (taken modulo 2⁶⁴)."""
    z &= MASK64
    z = ((z ^ (z >> 30)) * _MIX_MUL_1) & MASK64
    z = ((z ^ (z >> 27)) * _MIX_MUL_2) & MASK64
    return z ^ (z >> 31)


def label_words(label: int | str) -> list[int]:
    """A label's 64-bit words: ``[1, v mod 2⁶⁴]`` for an integer, ``[2, byte length, packed
    UTF-8 bytes…]`` for a string (8 bytes per word, little-endian, the last word zero-padded)."""
    if isinstance(label, bool) or not isinstance(label, int | str):
        raise UsageError(f"an RNG label is an int or a str, not {type(label).__name__}")
    if isinstance(label, int):
        if not -(1 << 63) <= label <= MASK64:
            raise UsageError(f"integer RNG label {label} does not fit in 64 bits")
        return [TAG_INT, label & MASK64]
    data = label.encode("utf-8")
    words = [TAG_STR, len(data)]
    for start in range(0, len(data), 8):
        words.append(int.from_bytes(data[start : start + 8].ljust(8, b"\0"), "little"))
    return words


def resolve_seed(seed: int | None) -> int:
    """``seed``, or :data:`DEFAULT_SEED` when it is None; UsageError unless an integer in
    ``[0, 2⁶⁴)``."""
    return DEFAULT_SEED if seed is None else _checked_seed(seed)


def derive_key(seed: int, *labels: int | str) -> int:
    """The key of ``labels`` under ``seed``: start at the seed and, for every word of every
    label in turn, ``key = mix64((key XOR word) + GOLDEN_GAMMA mod 2⁶⁴)``."""
    return extend_key(_checked_seed(seed), *labels)


def _checked_seed(seed: object) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MASK64:
        raise UsageError(f"seed must be an integer in [0, 2**64), got {seed!r}")
    return seed


def extend_key(key: int, *labels: int | str) -> int:
    """Fold more labels into a key: ``derive_key(s, a, b) == extend_key(derive_key(s, a), b)``."""
    for label in labels:
        for word in label_words(label):
            key = mix64(((key ^ word) + GOLDEN_GAMMA) & MASK64)
    return key


def u64(key: int, i: int) -> int:
    """Word ``i`` (``i ≥ 0``) of the stream of ``key``."""
    return mix64((key + (i + 1) * GOLDEN_GAMMA) & MASK64)


def u64_array(key: int, indices: np.ndarray) -> np.ndarray:
    """``u64(key, i)`` for every ``i`` of a non-negative integer array; returns ``uint64``."""
    z = np.asarray(indices).astype(np.uint64) + np.uint64(1)
    z = z * np.uint64(GOLDEN_GAMMA) + np.uint64(key)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(_MIX_MUL_1)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(_MIX_MUL_2)
    return z ^ (z >> np.uint64(31))


def below(n: int, key: int, i: int) -> int:
    """A number in ``[0, n)`` from word ``i`` of ``key``: ``(u64(key, i) · n) >> 64``."""
    return (u64(key, i) * n) >> 64


def permutation(key: int, ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """``ids`` (distinct, non-negative) sorted by ``(u64(key, id), id)``, as ``int64``."""
    ids = np.asarray(ids, dtype=np.int64)
    if ids.size and ids.min() < 0:
        raise UsageError(f"permutation ids must be non-negative, got {int(ids.min())}")
    # lexsort sorts by its last key first: primary u64(key, id), ties (never seen) by id.
    return ids[np.lexsort((ids, u64_array(key, ids)))]


def permutation_list(key: int, ids: Sequence[int]) -> list[int]:
    """The same order as :func:`permutation`, in plain integers: faster for a few ids."""
    if any(i < 0 for i in ids):
        raise UsageError(f"permutation ids must be non-negative, got {min(ids)}")
    return sorted(ids, key=lambda i: (u64(key, i), i))
