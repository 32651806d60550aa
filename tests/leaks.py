"""Threads and file descriptors before and after a test's work: did everything it started end?

Usage::

    baseline = Baseline()          # this process's threads and descriptors now
    ...                            # start a stream, a loader, a server's connections; close them
    baseline.assert_back()         # waits until the threads started since have ended, then checks

What ends after a close is another thread's business: a loopback server's handler thread closes
its side of a connection when the client hangs up, a pool thread ends after its last task. So
``assert_back`` joins every thread started since the baseline (one deadline for all, only a hang
guard) and then counts: no thread left, no more descriptors than before. Joining waits for exactly
those events, however slowly a loaded machine runs them; no sleep, no polling interval.
"""

from __future__ import annotations

import gc
import os
import threading
import time

HANG_GUARD_S = 30.0  # threads end in milliseconds after a close; this only catches a leak


def open_fds(pid: int | None = None) -> int:
    """Open file descriptors of ``pid`` (this process by default)."""
    return len(os.listdir(f"/proc/{pid or 'self'}/fd"))


class Baseline:
    """The threads and descriptor count of this process when made (see the module docstring)."""

    def __init__(self) -> None:
        gc.collect()  # what earlier work left for the collector is not this test's
        self.threads = set(threading.enumerate())
        self.fds = open_fds()

    def new_threads(self) -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t not in self.threads]

    def assert_back(self, timeout_s: float = HANG_GUARD_S) -> None:
        gc.collect()  # a stream or loader in a reference cycle closes when collected
        deadline = time.monotonic() + timeout_s
        for thread in self.new_threads():
            thread.join(max(0.0, deadline - time.monotonic()))
        gc.collect()
        left = [t.name for t in self.new_threads()]
        assert not left, f"threads left running: {left}"
        fds = open_fds()
        assert fds <= self.fds, f"{fds - self.fds} file descriptors left open"
