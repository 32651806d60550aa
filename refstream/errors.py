"""Every exception refstream raises, in one place (SPEC §12 lists them and whose fault each is).

A class that matches a builtin category also derives from it, so generic handlers keep working.
Each foreign family is translated once, at its edge, with ``raise … from exc``: ``OSError`` in
``source``, ``requests`` in ``http``, pyarrow in ``meta`` and ``tables``, a corrupt NPY or ZIP
file in ``sidecar``, PyAV in ``decode``. An error raised again from a DataLoader worker keeps the
worker's message as its own, and its traceback apart (:func:`_from_worker`).
"""

from __future__ import annotations

import re
from numbers import Integral


class RefstreamError(Exception):
    """Base class of every error refstream raises on purpose."""

    worker_traceback: str | None = None  # the worker's traceback, when raised in a worker

    def __init__(self, message: str = "") -> None:
        message, self.worker_traceback = _from_worker(type(self), message)
        super().__init__(message)


# --- the caller asked for something impossible ------------------------------------------------


class UsageError(RefstreamError, ValueError):
    """An argument is invalid, e.g. a negative seed or an unknown sampling strategy."""


class EpisodeSelectionError(UsageError):
    """An ``episodes=[…]`` selection holds duplicate or unknown episode ids (they are named)."""


class ShardingError(UsageError):
    """A topology cannot be served, e.g. fewer episodes on a rank than DataLoader workers."""


class IterableOnly(UsageError, TypeError):
    """``dataset[i]``, or a ``len()`` lacking ``num_workers``; a TypeError, so list() goes on."""


class ResumeError(UsageError):
    """A ``state_dict`` cannot be resumed (malformed, or not a whole number of batches)."""


class TopologyChanged(ResumeError):
    """A checkpoint's setup differs from this run's in more than the topology (SPEC §3.6)."""


def is_int(value: object, least: int | None = None, most: int | None = None) -> bool:
    """Whether ``value`` is an integer (a bool is not) in ``[least, most]`` (None: unbounded)."""
    if type(value) is not int and (isinstance(value, bool) or not isinstance(value, Integral)):
        return False  # (``type`` first: the RNG checks every draw, and ABCs are slow)
    return (least is None or value >= least) and (most is None or value <= most)


def check_int(value: object, name: str, least: int, most: int | None = None,
              error: type[RefstreamError] = UsageError) -> int:
    """``value`` as an int when :func:`is_int`, else ``error`` saying what ``name`` must be."""
    if not is_int(value, least, most):
        bound = f">= {least}" if most is None else f"in [{least}, {most}]"
        raise error(f"{name} must be an integer {bound}, got {value!r}")
    return value if type(value) is int else int(value)


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


class RateLimited(FetchError):
    """A server's rate limit resets later than a request may wait (names quota and reset)."""


class HubAuthError(FetchError):
    """The Hub wants a token it was not given, refused the one given, or gates the dataset."""


class HubRepoNotFound(FetchError):
    """No such dataset on the Hub, or none the token can see (names the repository)."""


class HubRevisionNotFound(FetchError):
    """The dataset has no such branch, tag or commit (names the revision and the repository)."""


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


# --- an error raised again from a DataLoader worker ----------------------------------------

# torch's DataLoader sends a worker's exception to the training process as its class and the text
# of traceback.format_exception, then raises cls(f"Caught Name {where}.\nOriginal {that text}").
_TORCH_REPORT = re.compile(r"Caught \w+ (in [^\n]+)\.\nOriginal (.*)", re.DOTALL)


def _from_worker(cls: type, text: str) -> tuple[str, str | None]:
    """``(message, worker traceback)`` from torch's report: the message (of one line or more)
    follows the last line that starts ``module.Class: ``; ``(text, None)`` for any other text."""
    report = _TORCH_REPORT.fullmatch(text)
    prefix = f"{cls.__module__}.{cls.__qualname__}: "
    start = -1 if report is None else f"\n{report[2]}".rfind(f"\n{prefix}")
    if start < 0:
        return text, None
    message = report[2][start + len(prefix) :].removesuffix("\n")
    return f"{message} ({report[1]})", report[2]
