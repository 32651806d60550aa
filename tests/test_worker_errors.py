"""An error raised in a DataLoader worker reaches the training loop as the same class with the
worker's whole message — the message the same error has without workers, then where it was
raised — and the worker's traceback apart in ``worker_traceback``.

Two levels, both through real DataLoader worker processes:

* every class of ``refstream.errors``, raised by a small dataset with a cause that was never
  raised (as the HTTP source chains a failed attempt) and a message over several lines that
  quotes the class's own name;
* real failures of a streamed dataset, in both loops (the DataLoader batching samples, and ready
  batches: ``batched=True`` with ``batch_size=None``): each is run once in the training process
  (``num_workers=0``, the oracle for the message) and once in a worker. The messages are one line
  and name the file, or the URL and byte range.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from rangeserver import RangeServer
from torch.utils.data import DataLoader, IterableDataset

from refstream import errors
from refstream.http import RetryPolicy
from refstream.stream import StreamingDataset
from refstream.tools.demo import write_demo_dataset

WHERE = " (in DataLoader worker process 0)"  # what torch says of the worker, kept from its report
CAMERA = "observation.images.front"
VIDEO = f"videos/{CAMERA}/chunk-000/file-000.mp4"
DATA = "data/chunk-000/file-000.parquet"
ERROR_CLASSES = sorted((c for c in vars(errors).values()
                        if isinstance(c, type) and issubclass(c, errors.RefstreamError)),
                       key=lambda c: c.__name__)


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("REFSTREAM_CACHE", str(tmp_path / "cache"))


def first_error(loader) -> errors.RefstreamError:
    """The RefstreamError that iterating ``loader`` ends with (it must end with one)."""
    iterator = iter(loader)
    try:
        for _ in iterator:
            pass
    except errors.RefstreamError as exc:
        # without its traceback's frames, nothing holds the iterator: its workers stop at once
        return exc.with_traceback(None)
    finally:
        del iterator
    pytest.fail("the loader ended without an error")


# --- every class, raised by a dataset of its own ------------------------------------------------


class Raising(IterableDataset):
    """Raises ``error_class(message)``, chained to a cause that was never raised."""

    def __init__(self, error_class: type, message: str) -> None:
        self.error_class, self.message = error_class, message

    def __iter__(self):
        cause = errors.HTTPStatusError("http://127.0.0.1:9/a.mp4 bytes 0-99: HTTP 503")
        raise self.error_class(self.message) from cause


def message_of(error_class: type) -> str:
    """A message over several lines that names the URL and byte range first, then its class."""
    return (f"http://127.0.0.1:9/videos/a.mp4 bytes 100-199: episode 3: quoting "
            f"refstream.errors.{error_class.__name__}: (first line\nsecond line\n)")


@pytest.mark.parametrize("error_class", ERROR_CLASSES, ids=lambda c: c.__name__)
def test_every_error_class_keeps_its_message_through_a_worker(error_class):
    message = message_of(error_class)
    raised = first_error(DataLoader(Raising(error_class, message), num_workers=1))
    assert type(raised) is error_class
    assert str(raised) == message + WHERE
    assert raised.worker_traceback.endswith(
        f"refstream.errors.{error_class.__name__}: {message}\n")
    assert "HTTP 503" in raised.worker_traceback  # the cause is kept too


def test_an_error_made_in_the_training_process_keeps_its_message():
    for error_class in ERROR_CLASSES:
        made = error_class(message_of(error_class))
        assert str(made) == message_of(error_class) and made.worker_traceback is None


# --- real failures of a streamed dataset -----------------------------------------------------


@dataclass
class Case:
    """A copy of the dataset, and the loopback server it is streamed from (if any)."""

    root: Path
    server: RangeServer | None = None

    @property
    def url(self) -> str:
        return str(self.root) if self.server is None else self.server.url


def corrupt_data_footer(case: Case) -> None:
    """Zeroes the data Parquet's footer: pyarrow's message then ends with a line break."""
    path = case.root / DATA
    data = path.read_bytes()
    footer = int.from_bytes(data[-8:-4], "little")
    path.write_bytes(data[: -8 - footer] + bytes(footer) + data[-8:])


def corrupt_video_payload(case: Case) -> None:
    """Overwrites the coded frames (the ``mdat`` payload) of a video; its boxes stay valid."""
    path = case.root / VIDEO
    data = bytearray(path.read_bytes())
    start = data.index(b"mdat") + 4
    size = int.from_bytes(data[start - 8 : start - 4], "big") - 8
    data[start : start + size] = b"\xff" * size
    path.write_bytes(bytes(data))


def touch_video(case: Case) -> None:
    """The same bytes, written again: another modification time, so another file version."""
    path = case.root / VIDEO
    path.write_bytes(path.read_bytes())
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))


def video_becomes_a_folder(case: Case) -> None:
    path = case.root / VIDEO
    path.unlink()
    path.mkdir()


def script(*modes: str) -> Callable[[Case], None]:
    return lambda case: case.server.script(*modes)


def load_checkpoint_of_two_workers(dataset: StreamingDataset) -> None:
    batch = dataset.batch_size
    dataset.load_state_dict(dataset.state_dict(2 * batch, batch_size=batch, num_workers=2))


@dataclass(frozen=True)
class Failure:
    error: type
    names: str  # a pattern the message must match: the file, or the URL and byte range
    before: Callable[[Case], None] | None = None  # changes the files before the dataset is made
    after: Callable[[Case], None] | None = None  # before each run, once the dataset is made
    http: bool = False
    options: dict | None = None
    prepare: Callable[[StreamingDataset], None] | None = None


URL_RANGE = r"http://127\.0\.0\.1:\d+/\S+ bytes \d*-\d+"
FAILURES = {
    "corrupt data Parquet": Failure(errors.TableError, rf"^{DATA}: episode \d+: cannot read",
                                    before=corrupt_data_footer),
    "data Parquet missing": Failure(errors.MalformedDataset, rf"^{DATA}: missing",
                                    before=lambda case: (case.root / DATA).unlink()),
    "video replaced by a folder": Failure(errors.FetchError, rf"/{VIDEO}: ",
                                          after=video_becomes_a_folder),
    "video written again": Failure(errors.PayloadChanged, rf"/{VIDEO} bytes \d+-\d+",
                                   after=touch_video),
    "video payload corrupt": Failure(errors.DecodeError, r"episode \d+",
                                     before=corrupt_video_payload),
    "episode above the budget": Failure(errors.EpisodeTooLarge, r"^episode \d+",
                                        options={"byte_budget_gb": 1e-7}),
    "checkpoint of two workers": Failure(errors.TopologyChanged, r"loaded for 2 DataLoader",
                                         prepare=load_checkpoint_of_two_workers),
    "500 on every attempt": Failure(errors.RetriesExhausted, URL_RANGE, http=True,
                                    after=script(*["500"] * RetryPolicy().max_attempts)),
    "403": Failure(errors.HTTPStatusError, URL_RANGE, http=True, after=script("403")),
    "416": Failure(errors.BadRangeResponse, URL_RANGE, http=True, after=script("", "416")),
}


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("worker_errors") / "dataset"
    write_demo_dataset(root, episode_lengths=(6, 5, 7), size=(32, 24))
    return root


@pytest.mark.parametrize("batched", [False, True], ids=["samples", "ready batches"])
@pytest.mark.parametrize("name", FAILURES)
def test_a_failing_dataset_raises_the_same_error_in_a_worker(name, batched, pristine, tmp_path):
    failure = FAILURES[name]
    case = Case(tmp_path / "dataset")
    shutil.copytree(pristine, case.root)
    if failure.before:
        failure.before(case)
    with contextlib.ExitStack() as stack:
        if failure.http:
            case.server = stack.enter_context(RangeServer(case.root))
        dataset = StreamingDataset(case.url, seed=0, batch_size=2, batched=batched,
                                   episode_pool_size=1, prefetch_episodes=0,
                                   **(failure.options or {}))
        raised = []
        for num_workers in (0, 1):
            dataset.set_epoch(0)  # both runs play the same epoch, so fail at the same place
            if failure.prepare:
                failure.prepare(dataset)
            if failure.after and (failure.http or num_workers == 0):
                failure.after(case)  # a scripted fault is used up by the run
            raised.append(first_error(DataLoader(dataset, batch_size=None if batched else 2,
                                                 num_workers=num_workers)))
    here, there = raised
    print(f"{name}: {type(there).__name__}: {there}")
    assert type(here) is failure.error and type(there) is failure.error
    message = str(here)
    assert "\n" not in message and re.search(failure.names, message), message
    assert str(there) == message + WHERE
    assert here.worker_traceback is None
    assert f"refstream.errors.{failure.error.__name__}: {message}\n" in there.worker_traceback
