"""One rule for "an integer, not a bool, within bounds": :func:`refstream.errors.check_int`, and
every check of an integer argument or field says it in its words."""

from dataclasses import fields

import numpy as np
import pytest

from refstream import rng, shard, windows
from refstream.errors import ResumeError, UsageError, check_at_least, check_int, is_int
from refstream.resume import ResumeSetup, ResumeState

ACCEPTED = [0, 1, 7, 2**64, np.int64(3), np.uint8(2)]
REFUSED = [True, False, 1.0, 2.5, "3", None, [1], np.float64(1.0)]


@pytest.mark.parametrize("value", ACCEPTED)
def test_integers_pass_as_python_ints(value):
    assert is_int(value) and check_int(value, "x", 0) == int(value)
    assert type(check_int(value, "x", 0)) is int


@pytest.mark.parametrize("value", REFUSED)
def test_bools_floats_and_the_rest_are_refused(value):
    assert not is_int(value)
    with pytest.raises(UsageError, match=r"^x must be an integer >= 0, got "):
        check_int(value, "x", 0)


def test_the_bounds_are_inclusive_and_named():
    assert is_int(3, 3, 3) and not is_int(2, 3) and not is_int(4, None, 3)
    with pytest.raises(UsageError, match=r"^n must be an integer in \[1, 5\], got 6$"):
        check_int(6, "n", 1, 5)
    with pytest.raises(ResumeError, match="^x must be an integer >= 1, got 0$"):
        check_int(0, "x", 1, error=ResumeError)
    check_at_least(1, pool_size=None, decoder_cache=1)  # None: not given
    with pytest.raises(UsageError, match="^decoder_cache must be an integer >= 1, got True$"):
        check_at_least(1, pool_size=None, decoder_cache=True)


@pytest.mark.parametrize("call, message", [
    (lambda: windows.make_windows(None, True, 0.0), "fps must be an integer >= 1, got True"),
    (lambda: rng.derive_key(-1), "seed must be an integer in [0, 18446744073709551615], got -1"),
    (lambda: rng.below(2.0, 1, 0), "below(n): n must be an integer in [1, "),
    (lambda: shard.split_limits(2, pool_size=0, byte_budget=None, decoder_cache=None, cameras=1),
     "pool_size must be an integer >= 1, got 0"),
    (lambda: shard.episode_ids([1, True]), "episode ids must be integers, got [True]"),
])
def test_each_caller_uses_the_one_rule(call, message):
    with pytest.raises(UsageError) as caught:
        call()
    assert str(caught.value).startswith(message)


def test_a_resume_field_uses_the_one_rule():
    setup = {field.name: 1 for field in fields(ResumeSetup)}
    with pytest.raises(ResumeError, match=r"^resume state field epoch must be an integer >= 0, "
                                          r"got 1\.5$"):
        ResumeState.from_dict({**setup, "epoch": 1.5, "samples": 0})
