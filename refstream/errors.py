"""Every exception refstream raises, in one place: SPEC §12 lists them, each one's parent (whose
fault it is) and the conformance kinds that may expect it.

A class that matches a builtin category also derives from it (``ValueError``, ``TimeoutError``,
``OSError``), so generic handlers keep working. The edges translate lower-layer exceptions
(``OSError``, ``requests``, ``av``, ``pyarrow``) into these with ``raise … from exc``; messages
name the file, episode, field, box or byte range involved. An error raised in a DataLoader worker
reaches the training process as the same class, with the worker's message as its message and the
worker's traceback kept apart in ``worker_traceback``.
"""

from __future__ import annotations

import re
from numbers import Integral

# How torch's DataLoader re-raises a worker's exception in the main process: one message holding
# the worker's whole traceback, whose last line is "module.Class: message".
_FROM_WORKER = re.compile(
    r"Caught \w+ in DataLoader worker process (\d+)\.\nOriginal (Traceback.*)", re.DOTALL)


class RefstreamError(Exception):
    """Base class of every error refstream raises on purpose."""

    worker_traceback: str | None = None  # the worker's traceback, when raised in a worker

    def __init__(self, *args: object) -> None:
        text = args[0] if len(args) == 1 and isinstance(args[0], str) else ""
        found = _FROM_WORKER.fullmatch(text)
        if found:
            self.worker_traceback = found[2]
            message = found[2].rstrip().splitlines()[-1].partition(": ")[2]
            args = (f"{message} (in DataLoader worker {found[1]})",)
        super().__init__(*args)


# --- the caller asked for something impossible ------------------------------------------------


class UsageError(RefstreamError, ValueError):
    """An argument is invalid, e.g. a negative seed or an unknown sampling strategy."""


class EpisodeSelectionError(UsageError):
    """An ``episodes=[…]`` selection holds duplicate or unknown episode ids (they are named)."""


class ShardingError(UsageError):
    """A topology cannot be served, e.g. fewer episodes on a rank than DataLoader workers."""


class ResumeError(UsageError):
    """A ``state_dict`` cannot be resumed (malformed, or not a whole number of batches)."""


class TopologyChanged(ResumeError):
    """A checkpoint's setup differs from this run's in more than the topology (SPEC §3.6)."""


def is_int(value: object, least: int | None = None, most: int | None = None) -> bool:
    """Whether ``value`` is an integer (a bool is not) in ``[least, most]`` (None: unbounded)."""
    return (isinstance(value, Integral) and not isinstance(value, bool)
            and (least is None or value >= least) and (most is None or value <= most))


def check_int(value: object, name: str, least: int, most: int | None = None,
              error: type[RefstreamError] = UsageError) -> int:
    """``value`` as an int when :func:`is_int`, else ``error`` saying what ``name`` must be."""
    if not is_int(value, least, most):
        bound = f">= {least}" if most is None else f"in [{least}, {most}]"
        raise error(f"{name} must be an integer {bound}, got {value!r}")
    return int(value)


def check_at_least(least: int, **counts: object) -> None:
    """:func:`check_int` of each of ``counts`` that is given (not None)."""
    for name, value in counts.items():
        if value is not None:
            check_int(value, name, least)


# --- the dataset ---------------------------------------------------------------------------


class DatasetError(RefstreamError):
    """The dataset's metadata or tables are wrong or unsupported."""


class UnsupportedDataset(DatasetError):
    """The dataset is valid but not a LeRobot v3.0 layout refstream reads (names what it is)."""


class MalformedDataset(DatasetError, ValueError):
    """Metadata is missing, truncated or inconsistent (names file, episode and field)."""


class UnsafePath(DatasetError, ValueError):
    """A path built from metadata is absolute or escapes the dataset root."""


class TableError(DatasetError, ValueError):
    """An episode's Parquet rows are missing, miscounted or not contiguous (names file, episode)."""


# --- MP4 -----------------------------------------------------------------------------------


class Mp4Error(RefstreamError):
    """A video file cannot be indexed."""


class MalformedMp4(Mp4Error, ValueError):
    """The file breaks the ISO-BMFF rules (names box, field, offset and file)."""


class UnsupportedMp4(Mp4Error):
    """The file is valid but uses a feature refstream rejects (fragments, complex edit lists)."""


# --- fetching ------------------------------------------------------------------------------


class FetchError(RefstreamError, OSError):
    """Reading bytes from a source failed (names URL or path and byte range)."""


class HTTPStatusError(FetchError):
    """A server answered with a status that is not retried, or still failed after retries."""


class BadRangeResponse(FetchError):
    """A range response disagrees with the request (status, ``Content-Range`` or length)."""


class ShortRead(FetchError):
    """Fewer bytes arrived than were asked for."""


class PayloadChanged(FetchError):
    """A file's identity (ETag, size or commit) differs from the one recorded when indexed."""


class RetriesExhausted(FetchError):
    """A transient failure persisted through every retry (the last cause is chained)."""


# --- the byte budget -----------------------------------------------------------------------


class BudgetError(RefstreamError):
    """The byte budget cannot hold what was asked."""


class EpisodeTooLarge(BudgetError, ValueError):
    """One episode's synthesized size exceeds the whole budget (raised before any fetch)."""


class BudgetClosed(BudgetError):
    """The budget was closed while a caller waited on it or after it was closed."""


# --- the sidecar index ---------------------------------------------------------------------


class SidecarError(RefstreamError):
    """The persistent MP4 index could not be built, installed or read."""


class SidecarLockTimeout(SidecarError, TimeoutError):
    """Waiting for another process's sidecar build exceeded the timeout (names lock and wait)."""


class SidecarInvalid(SidecarError, ValueError):
    """An index record is corrupt, of another schema or of another file's content."""


# --- decoding ------------------------------------------------------------------------------


class DecodeError(RefstreamError):
    """PyAV could not decode a synthesized episode video."""


class FrameNotFound(DecodeError, ValueError):
    """No decoded frame lies within tolerance of a requested time (names episode, camera, time)."""
