"""A deliberately wrong implementation for the conformance runner's own test.

It answers like refstream, then corrupts the answer: the first number found (depth-first, keys
in sorted order) is increased by one, and an expected error is replaced by an empty answer. The
runner must report every case as failed and point at the corrupted place.
"""

import json
import sys

from refstream.tools.conformance import answer


def corrupt(value):
    """Return (corrupted value, whether a number was changed)."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value, False
    if isinstance(value, int | float):
        return value + 1, True
    if isinstance(value, list):
        for i, item in enumerate(value):
            changed, done = corrupt(item)
            if done:
                return value[:i] + [changed] + value[i + 1 :], True
        return value + [0], True
    for key in sorted(value):
        changed, done = corrupt(value[key])
        if done:
            return {**value, key: changed}, True
    return {**value, "broken": True}, True


if __name__ == "__main__":
    request = json.load(sys.stdin)
    reply = answer(request["kind"], request["input"])
    json.dump({} if "error" in reply else corrupt(reply)[0], sys.stdout)
