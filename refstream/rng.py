"""The portable, counter-based random numbers every refstream order is made of (SPEC §1). Use::

    seed = resolve_seed(user_seed)                  # DEFAULT_SEED when the user gives None
    key = derive_key(seed, epoch, "admit")          # labels are ints and strs
    key_e = extend_key(key, e)                      # == derive_key(seed, epoch, "admit", e)
    u64(key, i), below(n, key, i)                   # word i of the key's stream; a number < n
    permutation(key, ids)                           # the ids in keyed order (numpy int64)
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from refstream.errors import UsageError, check_int

__all__ = ["DEFAULT_SEED", "resolve_seed", "derive_key", "extend_key", "u64", "u64_array", "below",
           "below_word", "permutation"]

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


def mix64(z: int | np.ndarray) -> int | np.ndarray:
    """SplitMix64's finaliser of ``z`` modulo 2⁶⁴ (SPEC §1.1): of an int, or of a uint64 array."""
    z = z & MASK64
    z = ((z ^ (z >> 30)) * _MIX_MUL_1) & MASK64
    z = ((z ^ (z >> 27)) * _MIX_MUL_2) & MASK64
    return z ^ (z >> 31)


def label_words(label: int | str) -> list[int]:
    """A label's 64-bit words (SPEC §1.2); UsageError outside the label domain."""
    if isinstance(label, bool) or not isinstance(label, int | str):
        raise UsageError(f"an RNG label is an int or a str, not {type(label).__name__}")
    if isinstance(label, int):
        return [TAG_INT, check_int(label, "an RNG label", -(1 << 63), MASK64) & MASK64]
    data = label.encode("utf-8")
    chunks = (data[start : start + 8].ljust(8, b"\0") for start in range(0, len(data), 8))
    return [TAG_STR, len(data), *(int.from_bytes(chunk, "little") for chunk in chunks)]


def resolve_seed(seed: int | None) -> int:
    """``seed``, or :data:`DEFAULT_SEED` when it is None (SPEC §1.2); UsageError for a bad seed."""
    return DEFAULT_SEED if seed is None else derive_key(seed)  # no labels: the seed itself


def derive_key(seed: int, *labels: int | str) -> int:
    """The key of ``labels`` under ``seed`` (SPEC §1.2); UsageError for a bad seed or label."""
    return extend_key(check_int(seed, "seed", 0, MASK64), *labels)


def extend_key(key: int, *labels: int | str) -> int:
    """Fold more labels into a key: ``derive_key(s, a, b) == extend_key(derive_key(s, a), b)``."""
    for label in labels:
        for word in label_words(label):
            key = mix64((key ^ word) + GOLDEN_GAMMA)
    return key


def u64(key: int, i: int) -> int:
    """Word ``i`` (``0 ≤ i < 2⁶⁴``, else UsageError) of the stream of ``key`` (SPEC §1.3)."""
    return mix64(key + (check_int(i, "an RNG index", 0, MASK64) + 1) * GOLDEN_GAMMA)


def below_word(word: int, n: int) -> int:
    """The number in ``[0, n)`` a word gives (SPEC §1.3): :func:`below` of a word already made."""
    return (word * n) >> 64


def u64_array(key: int, indices: np.ndarray) -> np.ndarray:
    """``u64(key, i)`` for every ``i`` of a non-negative integer array; returns ``uint64``."""
    # uint64 arithmetic wraps modulo 2⁶⁴, as the definition does.
    i = np.asarray(indices).astype(np.uint64)
    return mix64(np.uint64(key) + (i + np.uint64(1)) * np.uint64(GOLDEN_GAMMA))


def below(n: int, key: int, i: int) -> int:
    """A number in ``[0, n)`` from word ``i`` of ``key`` (SPEC §1.3)."""
    return below_word(u64(key, i), check_int(n, "below(n): n", 1, MASK64 + 1))


def permutation(key: int, ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """``ids`` (distinct non-negative integers, else UsageError) in SPEC §1.3's keyed order."""
    ids = np.asarray(ids)
    if ids.size and (ids.dtype.kind not in "iu" or ids.min() < 0):
        raise UsageError(f"permutation ids must be non-negative integers, got {ids.dtype} ids "
                         f"as low as {ids.min()}")
    ids = ids.astype(np.int64)
    # lexsort sorts by its last key first: primary u64(key, id), then id, so equal ids meet.
    order = ids[np.lexsort((ids, u64_array(key, ids)))]
    repeated = order[1:][order[1:] == order[:-1]]
    if repeated.size:
        raise UsageError(f"permutation ids must be distinct, {sorted(set(repeated.tolist()))} "
                         "occur more than once")
    return order
