"""Byte sources: a local folder, an HTTP(S) base URL, or a Hugging Face ``hf://`` repository.

Every source answers the same calls, with paths relative to the dataset root (checked by
:func:`refstream.meta.check_relpath`: no ``..``, no absolute paths, no ``\\``/``:``/NUL)::

    source = open_source(root)            # a folder, file://, http(s)://, hf://datasets|buckets
    source.read_bytes(relpath) -> bytes   # a whole (metadata) file
    source.read_range(relpath, offset, length) -> bytes   # exactly `length` bytes or an error
    source.read_tail(relpath, length) -> (bytes, size)    # the last min(length, size) bytes and
                                          # the file's size, in one request (Parquet footers)
    source.size(relpath) -> int           # bytes
    source.identity(relpath) -> str       # what changes when the file changes ("" if unknown)
    source.expect_identity(relpath, ident)   # later reads of relpath raise PayloadChanged if the
                                             # file's identity differs from `ident`
    source.stats() -> dict                # requests, bytes, retries, redirects, refreshes
    RangeFile(source, relpath[, size, tail])   # file-like view: pq.ParquetFile(RangeFile(...));
                                               # reads inside a known tail cost no request

``stats()`` counts, since the source was made: ``requests`` (local reads, or HTTP requests sent,
each redirect hop included), ``bytes`` (payload bytes received), ``retries`` (attempts after
the first), ``redirects`` (hops followed) and ``refreshes`` (remembered redirect targets that
had expired).

Errors: a missing file is :class:`MalformedDataset`; everything else is a :class:`FetchError`
naming the path or URL and the byte range (``bytes a-b``, inclusive, as in HTTP).

Identities: local ``local:size=N;mtime_ns=T``; HTTP ``etag:<ETag>`` (an ``X-Linked-Etag`` on any
redirect hop wins, as the Hub puts the content hash there and the CDN's own ETag differs), else
``last-modified:<date>``, else ``""``; ``hf://datasets`` ``commit:<sha>`` (every URL names the
commit, so the bytes cannot change under it).

HTTP rules (:class:`HTTPSource`):

* One ``requests.Session`` per request in flight, reused (keep-alive pool per host),
  ``(connect, read)`` timeouts,
  redirects followed by hand (at most :data:`MAX_REDIRECTS`), ``Authorization`` sent only to the
  origin (scheme, host, port) the token belongs to — never to a redirect target elsewhere.
  A commit-pinned source (``hf://datasets``) remembers each file's redirect target and goes
  there directly; a target answering 401/403/404/410 (expired signature) is re-resolved once.
  ``.netrc`` credentials are never picked up; environment proxies are.
* One range per request, ``Range: bytes=a-b`` (``read_tail``: the suffix ``bytes=-n``, judged by
  :func:`plan_suffix_response`: a 206 must state the size and cover exactly the last
  ``min(n, size)`` bytes; a 200 follows the rule below; a 416 or a 200 over the cap means no
  suffix support: ``HEAD`` for the size, then a plain range). A **206** is accepted only when
  ``Content-Range`` is ``bytes a-b/T`` for exactly the asked ``a-b`` and the body has exactly
  ``b-a+1`` bytes. ``T`` must equal the size seen before (else :class:`PayloadChanged`); a range
  that ends past ``T`` is :class:`ShortRead`. Any other ``Content-Range`` is
  :class:`BadRangeResponse`, as is a **200** that carries a ``Content-Range``, a **416** and a
  body longer than asked.
* A **200** to a range request (the server ignored ``Range``) is accepted only when its
  ``Content-Length`` is at most :data:`WHOLE_BODY_CAP_BYTES`: the body is read and sliced. A
  larger or unannounced body is refused with :class:`BadRangeResponse` without reading it, so a
  misconfigured server never turns every span into a whole-file download.
* Retried: connection errors, timeouts, a body cut short (:class:`ShortRead`), statuses
  :data:`RETRY_STATUSES`. The delay before retry ``k`` (k = 1, 2, …) is ``Retry-After`` when the
  response had one (seconds or an HTTP date, at most ``retry_after_cap_s``), else full jitter
  ``uniform(0, min(backoff_cap_s, backoff_base_s * 2**(k-1)))``. After ``max_attempts`` attempts
  :class:`RetriesExhausted` is raised from the last cause. 404/410 → :class:`MalformedDataset`;
  412 → :class:`PayloadChanged`; any other status → :class:`HTTPStatusError` at once.
* Sizes come from ``HEAD``: ``X-Linked-Size`` on any hop, else the final ``Content-Length``.

``hf://datasets/OWNER/NAME[@REV][/PREFIX]`` reads
``{HF_ENDPOINT}/datasets/OWNER/NAME/resolve/{commit}/{PREFIX/relpath}``; the revision (default
``main``; percent-encoded like ``refs%2Fpr%2F1``) is pinned once, at open, by
``GET {HF_ENDPOINT}/api/datasets/OWNER/NAME/revision/{REV}`` → ``"sha"`` (a 40-hex revision is
used as is). ``hf://buckets/OWNER/NAME[/PREFIX]`` reads
``{HF_ENDPOINT}/buckets/OWNER/NAME/resolve/{PREFIX/relpath}`` (no commits: ETag identities).
``HF_ENDPOINT`` defaults to ``https://huggingface.co``; the token is ``HF_TOKEN``. Tokens never
appear in messages, logs or ``repr``.
"""

from __future__ import annotations

import contextlib
import email.utils
import io
import json
import os
import random
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Protocol, TypeVar
from urllib.parse import quote, unquote, urljoin, urlsplit

import requests
from requests.adapters import HTTPAdapter
from requests.structures import CaseInsensitiveDict

from refstream.errors import (
    BadRangeResponse,
    FetchError,
    HTTPStatusError,
    MalformedDataset,
    PayloadChanged,
    RetriesExhausted,
    ShortRead,
    UsageError,
)
from refstream.meta import check_relpath

__all__ = [
    "Source",
    "LocalSource",
    "HTTPSource",
    "RetryPolicy",
    "RangeFile",
    "open_source",
    "open_hf_source",
    "parse_hf_root",
    "HfRoot",
    "plan_range_response",
    "plan_suffix_response",
    "RangePlan",
    "parse_retry_after",
    "WHOLE_BODY_CAP_BYTES",
    "RETRY_STATUSES",
]

# A server that ignores Range is tolerated for bodies up to this size (metadata-sized files);
# beyond it each span would cost a whole-file download, which we refuse.
WHOLE_BODY_CAP_BYTES = 1 << 20
# Transient statuses (RFC 9110: 408 timeout, 425 too early, 429 rate limit, 5xx server side).
RETRY_STATUSES = frozenset({408, 425, 429, *range(500, 600)})
REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
MAX_REDIRECTS = 5  # the Hub needs 1 (resolve -> CDN); more hops mean a loop
# What a remembered redirect target answers once its signature expired (S3/CloudFront: 403).
_EXPIRED_TARGET_STATUSES = frozenset({401, 403, 404, 410})
HF_DEFAULT_ENDPOINT = "https://huggingface.co"
_CHUNK_BYTES = 1 << 16  # socket read granularity for response bodies
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")
_COMMIT = re.compile(r"[0-9a-f]{40}")
_T = TypeVar("_T")


class Source(Protocol):
    """What every byte source offers (see the module docstring)."""

    def read_bytes(self, relpath: str) -> bytes: ...
    def read_range(self, relpath: str, offset: int, length: int) -> bytes: ...
    def read_tail(self, relpath: str, length: int) -> tuple[bytes, int]: ...
    def size(self, relpath: str) -> int: ...
    def identity(self, relpath: str) -> str: ...
    def expect_identity(self, relpath: str, identity: str) -> None: ...
    def stats(self) -> dict[str, int]: ...
    def close(self) -> None: ...


class _Counters:
    """Thread-safe request/byte counters of one source."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values = {"requests": 0, "bytes": 0, "retries": 0, "redirects": 0, "refreshes": 0}

    def add(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self._values[name] += delta

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._values)


def _check_span(where: str, offset: int, length: int) -> None:
    if offset < 0 or length < 0:
        raise UsageError(f"{where}: invalid byte range offset={offset} length={length}")


def _check_tail(where: str, length: int) -> None:
    if length < 1:
        raise UsageError(f"{where}: a tail read needs a positive length, got {length}")


def _tail_by_size(source: Source, relpath: str, length: int) -> tuple[bytes, int]:
    """``read_tail`` in two steps: the file's size, then a range of its last bytes."""
    size = source.size(relpath)
    count = min(length, size)
    return source.read_range(relpath, size - count, count), size


def _byte_range(offset: int, length: int) -> str:
    return f"bytes {offset}-{offset + length - 1}"


# --- local folder ----------------------------------------------------------------------------


class LocalSource:
    """A dataset in a local folder, read with ``os.pread``."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self._counters = _Counters()
        self._expected: dict[str, str] = {}

    def __repr__(self) -> str:
        return f"LocalSource({str(self.root)!r})"

    def _path(self, relpath: str) -> Path:
        return self.root / check_relpath(relpath)

    def read_bytes(self, relpath: str) -> bytes:
        return self._read(relpath, 0, None)

    def read_range(self, relpath: str, offset: int, length: int) -> bytes:
        return self._read(relpath, offset, length)

    def read_tail(self, relpath: str, length: int) -> tuple[bytes, int]:
        _check_tail(str(self._path(relpath)), length)
        return _tail_by_size(self, relpath, length)

    def _read(self, relpath: str, offset: int, length: int | None) -> bytes:
        """``length`` bytes at ``offset``; ``None`` means to the end of the file."""
        path = self._path(relpath)
        _check_span(str(path), offset, length or 0)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError as exc:
            raise MalformedDataset(f"{relpath}: missing from dataset root {self.root}") from exc
        except OSError as exc:
            raise FetchError(f"{path}: cannot open ({exc})") from exc
        try:
            status = os.fstat(fd)
            if length is None:
                length = max(0, status.st_size - offset)
            where = f"{path} {_byte_range(offset, length)}"
            parts, done = [], 0
            while done < length:
                part = os.pread(fd, length - done, offset + done)
                if not part:
                    break
                parts.append(part)
                done += len(part)
        except OSError as exc:
            raise FetchError(f"{path}: read failed at offset {offset} ({exc})") from exc
        finally:
            os.close(fd)
        # the open descriptor pins one version of the file: its identity covers these bytes
        self._check_expected(relpath, _local_identity(status), where)
        self._counters.add(requests=1, bytes=done)
        if done != length:
            raise ShortRead(f"{where}: got {done} of {length} bytes (end of file)")
        return b"".join(parts)

    def size(self, relpath: str) -> int:
        return self._stat(relpath).st_size

    def identity(self, relpath: str) -> str:
        return _local_identity(self._stat(relpath))

    def expect_identity(self, relpath: str, identity: str) -> None:
        self._expected[check_relpath(relpath)] = identity

    def stats(self) -> dict[str, int]:
        return self._counters.snapshot()

    def close(self) -> None:
        """Nothing stays open between calls."""

    def _stat(self, relpath: str) -> os.stat_result:
        path = self._path(relpath)
        try:
            return os.stat(path)
        except FileNotFoundError as exc:
            raise MalformedDataset(f"{relpath}: missing from dataset root {self.root}") from exc
        except OSError as exc:
            raise FetchError(f"{path}: cannot stat ({exc})") from exc

    def _check_expected(self, relpath: str, actual: str, where: str) -> None:
        expected = self._expected.get(relpath)
        if expected is not None and actual != expected:
            raise PayloadChanged(f"{where}: file changed since indexed ({expected} -> {actual})")


def _local_identity(st: os.stat_result) -> str:
    return f"local:size={st.st_size};mtime_ns={st.st_mtime_ns}"


# --- HTTP ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how long to retry a transient HTTP failure (seconds)."""

    max_attempts: int = 5
    backoff_base_s: float = 0.25
    backoff_cap_s: float = 8.0
    retry_after_cap_s: float = 30.0

    def delay_s(self, retry: int, retry_after_s: float | None) -> float:
        """Seconds to sleep before retry number ``retry`` (1-based)."""
        if retry_after_s is not None:
            return min(max(retry_after_s, 0.0), self.retry_after_cap_s)
        return random.uniform(0.0, min(self.backoff_cap_s, self.backoff_base_s * 2 ** (retry - 1)))


def parse_retry_after(value: str | None, now: datetime | None = None) -> float | None:
    """``Retry-After`` in seconds (delta-seconds or an HTTP date), None when absent or invalid."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return max(0.0, (when - (now or datetime.now(timezone.utc))).total_seconds())


class _Transient(Exception):
    """Internal: this attempt failed in a way worth retrying (``cause`` says how)."""

    def __init__(self, cause: Exception, retry_after_s: float | None = None) -> None:
        super().__init__(str(cause))
        self.cause = cause
        self.retry_after_s = retry_after_s


class _NoNetrc(requests.auth.AuthBase):
    """Session-level auth that adds nothing: its presence stops requests reading ~/.netrc."""

    def __call__(self, request):
        return request


def _origin(url: str) -> tuple[str, str, int | None]:
    parts = urlsplit(url)
    return parts.scheme, (parts.hostname or ""), parts.port


class HTTPSource:
    """Files under an HTTP(S) base URL, fetched with one range per request (module docstring)."""

    def __init__(
        self,
        base_url: str,
        *,
        token: str | None = None,
        token_origin: str | None = None,
        pinned_identity: str | None = None,
        connect_timeout_s: float = 10.0,
        read_timeout_s: float = 60.0,
        retry: RetryPolicy | None = None,
        whole_body_cap_bytes: int = WHOLE_BODY_CAP_BYTES,
        label: str | None = None,
    ) -> None:
        if urlsplit(base_url).username or urlsplit(base_url).password:
            raise UsageError("credentials in a URL are refused; pass a token instead")
        self.base_url = base_url.rstrip("/")
        self.label = label or self.base_url  # what messages call this source
        self._token = token
        # the token goes only to this origin (the Hub), never to a redirect target elsewhere
        self._token_origin = _origin(token_origin or base_url)
        self._pinned_identity = pinned_identity
        self._timeout = (connect_timeout_s, read_timeout_s)
        self.retry = retry or RetryPolicy()
        self._whole_body_cap_bytes = whole_body_cap_bytes
        self._counters = _Counters()
        self._sessions: list[requests.Session] = []  # every session made, closed by close()
        self._idle: list[requests.Session] = []  # sessions no request is being sent on
        self._lock = threading.Lock()  # guards the session lists, _sizes, _expected, _targets
        self._sizes: dict[str, int] = {}
        self._expected: dict[str, str] = {}
        self._targets: dict[str, str] = {}  # url -> redirect target (commit-pinned only)

    def __repr__(self) -> str:
        return f"HTTPSource({self.label!r}, token={'set' if self._token else 'none'})"

    # --- public calls -------------------------------------------------------------------------

    def url(self, relpath: str) -> str:
        return f"{self.base_url}/{quote(check_relpath(relpath), safe='/')}"

    def read_bytes(self, relpath: str) -> bytes:
        url = self.url(relpath)
        return self._fetch(url, url, relpath, None, None)

    def read_range(self, relpath: str, offset: int, length: int) -> bytes:
        url = self.url(relpath)
        _check_span(url, offset, length)
        if length == 0:
            return b""
        first, last = offset, offset + length - 1
        where = f"{url} {_byte_range(offset, length)}"
        return self._fetch(url, where, relpath, f"bytes={first}-{last}",
                           lambda status, headers, known: plan_range_response(
                               first, last, status, headers, known_size=known,
                               whole_body_cap_bytes=self._whole_body_cap_bytes, where=where))

    def read_tail(self, relpath: str, length: int) -> tuple[bytes, int]:
        url = self.url(relpath)
        _check_tail(url, length)
        where = f"{url} bytes -{length}"  # HTTP's suffix form: the last `length` bytes
        try:
            body = self._fetch(url, where, relpath, f"bytes=-{length}",
                               lambda status, headers, known: plan_suffix_response(
                                   length, status, headers, known_size=known,
                                   whole_body_cap_bytes=self._whole_body_cap_bytes,
                                   where=where))
        except SuffixUnsupported:
            return _tail_by_size(self, relpath, length)  # the size from HEAD, then a range
        with self._lock:
            return body, self._sizes[relpath]

    def size(self, relpath: str) -> int:
        with self._lock:
            known = self._sizes.get(relpath)
        if known is None:
            known = self._head(relpath)[0]
        return known

    def identity(self, relpath: str) -> str:
        if self._pinned_identity is not None:
            check_relpath(relpath)
            return self._pinned_identity
        return self._head(relpath)[1]

    def expect_identity(self, relpath: str, identity: str) -> None:
        with self._lock:
            self._expected[check_relpath(relpath)] = identity

    def stats(self) -> dict[str, int]:
        return self._counters.snapshot()

    def close(self) -> None:
        with self._lock:
            sessions, self._sessions, self._idle = self._sessions, [], []
        for session in sessions:
            session.close()

    def get_json_url(self, url: str) -> object:
        """GET an absolute URL (e.g. a Hub API call) with the same retries and auth rules."""
        body = self._fetch(url, url, None, None, None)
        try:
            return json.loads(body)
        except ValueError as exc:
            raise FetchError(f"{url}: response is not JSON") from exc

    # --- one logical request: retries around attempts -----------------------------------------

    def _fetch(self, url: str, where: str, relpath: str | None, range_header: str | None,
               judge: Callable[[int, CaseInsensitiveDict, int | None], RangePlan] | None) -> bytes:
        """GET ``url`` (with ``range_header``, whose answers ``judge`` plans) with retries."""
        return self._retrying(where, lambda: self._attempt(url, where, relpath, range_header,
                                                           judge))

    def _retrying(self, where: str, attempt: Callable[[], _T]) -> _T:
        """Run ``attempt`` until it does not raise ``_Transient``, at most max_attempts times."""
        retry_after_s = None
        for number in range(1, self.retry.max_attempts + 1):
            if number > 1:
                self._counters.add(retries=1)
                time.sleep(self.retry.delay_s(number - 1, retry_after_s))
            try:
                return attempt()
            except _Transient as exc:
                last, retry_after_s = exc.cause, exc.retry_after_s
        raise RetriesExhausted(
            f"{where}: failed {self.retry.max_attempts} times; last: {last}"
        ) from last

    def _attempt(
        self, url: str, where: str, relpath: str | None, range_header: str | None,
        judge: Callable[[int, CaseInsensitiveDict, int | None], RangePlan] | None,
    ) -> bytes:
        headers = {} if range_header is None else {"Range": range_header}
        response, hops = self._send("GET", url, headers, where)
        try:
            if judge is None:
                body = self._read_whole(response, where)
            else:
                with self._lock:
                    known = None if relpath is None else self._sizes.get(relpath)
                plan = judge(response.status_code, response.headers, known)
                body = self._read_body(response, where, plan.body_bytes)
                if len(body) < plan.body_bytes:
                    raise _Transient(ShortRead(
                        f"{where}: body has {len(body)} of {plan.body_bytes} bytes"))
                if len(body) > plan.body_bytes:
                    raise BadRangeResponse(f"{where}: body longer than {plan.body_bytes} bytes")
                body = body[plan.skip_bytes : plan.skip_bytes + plan.answer_bytes]
                if relpath is not None and plan.file_size is not None:
                    with self._lock:
                        self._sizes.setdefault(relpath, plan.file_size)
            if relpath is not None:
                self._check_expected(relpath, self._identity_of(hops), where)
            return body
        finally:
            response.close()

    def _head(self, relpath: str) -> tuple[int, str]:
        """(size, identity) of a file from a HEAD request; the size is remembered."""
        url = self.url(relpath)
        return self._retrying(f"HEAD {url}", lambda: self._head_once(relpath, url))

    def _head_once(self, relpath: str, url: str) -> tuple[int, str]:
        response, hops = self._send("HEAD", url, {}, f"HEAD {url}")
        response.close()
        if response.status_code != 200:
            raise status_error(response.status_code, response.headers, f"HEAD {url}")
        size = _linked_size(hops)
        if size is None:
            raise BadRangeResponse(f"HEAD {url}: no Content-Length")
        with self._lock:
            self._sizes[relpath] = size
        return size, self._identity_of(hops)

    # --- transport ----------------------------------------------------------------------------

    @contextlib.contextmanager
    def _session(self) -> Iterator[requests.Session]:
        """A session to send one request on: an idle one, else a new one (kept until close()).

        Not a thread-local: pyarrow calls into Python from its own I/O threads with a fresh
        thread state each time, so a thread-local session would be one new session (and open
        connection) per call. Sessions number at most the requests sent at once, and each keeps
        its connections alive for the next request.
        """
        with self._lock:
            session = self._idle.pop() if self._idle else None
        if session is None:
            session = requests.Session()
            session.auth = _NoNetrc()
            adapter = HTTPAdapter(pool_connections=4, pool_maxsize=4, max_retries=0)
            session.mount("http://", adapter)
            session.mount("https://", adapter)
            with self._lock:
                self._sessions.append(session)
        try:
            yield session
        finally:
            with self._lock:
                if session in self._sessions:  # not closed meanwhile
                    self._idle.append(session)

    def _send(
        self, method: str, url: str, headers: dict[str, str], where: str
    ) -> tuple[requests.Response, list[requests.Response]]:
        """Send, following redirects by hand; returns the final response and every hop.

        A commit-pinned source remembers where each URL redirected to (the Hub's signed CDN
        URL) and goes there directly next time; when that target answers 401/403/404/410 (an
        expired signature) it is forgotten and the request starts again from ``url``.
        """
        with self._lock:
            target = self._targets.get(url)
        if target is not None:
            response, hops = self._follow(method, target, headers, where)
            if response.status_code not in _EXPIRED_TARGET_STATUSES:
                return response, hops
            response.close()
            with self._lock:
                self._targets.pop(url, None)
            self._counters.add(refreshes=1)
        response, hops = self._follow(method, url, headers, where)
        if self._pinned_identity is not None and len(hops) > 1 and response.ok:
            with self._lock:
                self._targets[url] = response.url
        return response, hops

    def _follow(
        self, method: str, url: str, headers: dict[str, str], where: str
    ) -> tuple[requests.Response, list[requests.Response]]:
        hops: list[requests.Response] = []
        for _ in range(MAX_REDIRECTS + 1):
            # identity: byte ranges and lengths must refer to the stored bytes, not a gzip of them
            sent = {"Accept-Encoding": "identity", **headers}
            if self._token and _origin(url) == self._token_origin:
                sent["Authorization"] = f"Bearer {self._token}"
            try:
                with self._session() as session:
                    response = session.request(
                        method, url, headers=sent, timeout=self._timeout, allow_redirects=False,
                        stream=True,
                    )
            except (requests.ConnectionError, requests.Timeout) as exc:
                raise _Transient(FetchError(f"{where}: {type(exc).__name__}: {exc}")) from exc
            except requests.RequestException as exc:
                raise FetchError(f"{where}: {type(exc).__name__}: {exc}") from exc
            self._counters.add(requests=1)
            hops.append(response)
            location = response.headers.get("Location")
            if response.status_code not in REDIRECT_STATUSES or not location:
                return response, hops
            response.close()
            self._counters.add(redirects=1)
            url = urljoin(url, location)
        raise HTTPStatusError(f"{where}: more than {MAX_REDIRECTS} redirects")

    def _read_body(self, response: requests.Response, where: str, limit: int | None) -> bytes:
        """The body, stopping after ``limit + 1`` bytes; a broken connection is transient."""
        parts, done = [], 0
        try:
            for chunk in response.iter_content(_CHUNK_BYTES):
                parts.append(chunk)
                done += len(chunk)
                if limit is not None and done > limit:
                    break
        except (requests.RequestException, OSError) as exc:
            raise _Transient(
                ShortRead(f"{where}: connection failed after {done} body bytes ({exc})")
            ) from exc
        self._counters.add(bytes=done)
        return b"".join(parts)

    def _read_whole(self, response: requests.Response, where: str) -> bytes:
        """A whole-file GET: status 200 and, when announced, exactly Content-Length bytes."""
        if response.status_code != 200:
            raise status_error(response.status_code, response.headers, where)
        body = self._read_body(response, where, None)
        announced = response.headers.get("Content-Length", "")
        if announced.isdigit() and len(body) != int(announced):
            raise _Transient(ShortRead(f"{where}: body has {len(body)} of {announced} bytes"))
        return body

    def _identity_of(self, hops: list[requests.Response]) -> str:
        if self._pinned_identity is not None:
            return self._pinned_identity
        for hop in hops:
            linked = hop.headers.get("X-Linked-Etag")
            if linked:
                return f"etag:{linked}"
        final = hops[-1].headers
        if final.get("ETag"):
            return f"etag:{final['ETag']}"
        if final.get("Last-Modified"):
            return f"last-modified:{final['Last-Modified']}"
        return ""

    def _check_expected(self, relpath: str, actual: str, where: str) -> None:
        with self._lock:
            expected = self._expected.get(relpath)
        if expected is not None and actual != expected:
            raise PayloadChanged(f"{where}: file changed since indexed ({expected} -> {actual})")


@dataclass(frozen=True)
class RangePlan:
    """How to read an acceptable answer to ``Range: bytes=first-last`` (all in bytes)."""

    body_bytes: int  # the body must have exactly this length
    skip_bytes: int  # the asked bytes start this far into the body
    file_size: int | None  # the file's size the answer states, None if it does not say
    answer_bytes: int  # how many bytes, from skip_bytes on, answer the request


def plan_range_response(
    first: int, last: int, status: int, headers, *, known_size: int | None,
    whole_body_cap_bytes: int, where: str,
) -> RangePlan:
    """Judge a response's status and headers against the request (the rules of the module
    docstring) before reading its body; raise the error, or ``_Transient`` when worth retrying.

    ``headers`` is a case-insensitive mapping; ``known_size`` the file size seen before, if any.
    """
    length = last - first + 1
    if status == 206:
        got_first, got_last, total = _content_range(headers, known_size, where)
        if (got_first, got_last) != (first, last):
            if got_first == first and total is not None and got_last == total - 1 < last:
                raise ShortRead(f"{where}: file has only {total} bytes")
            raise _bad_content_range(headers, where)
        return RangePlan(body_bytes=length, skip_bytes=0, file_size=total, answer_bytes=length)
    if status == 200:  # the server ignored Range
        total = _whole_body_size(headers, known_size, whole_body_cap_bytes, where)
        if total <= last:
            raise ShortRead(f"{where}: file has only {total} bytes")
        return RangePlan(body_bytes=total, skip_bytes=first, file_size=total, answer_bytes=length)
    raise status_error(status, headers, where)


class SuffixUnsupported(Exception):
    """The server answered a suffix range with 416 or with a whole file over the cap: ask for the
    size and a plain range instead (never leaves ``read_tail``)."""


def plan_suffix_response(
    length: int, status: int, headers, *, known_size: int | None, whole_body_cap_bytes: int,
    where: str,
) -> RangePlan:
    """Judge a response to ``Range: bytes=-length`` (the last ``length`` bytes), like
    :func:`plan_range_response`: a 206 must be ``bytes F-L/T`` with a numeric ``T``,
    ``L = T - 1`` and ``F = max(0, T - length)``; a 200 is the whole file (same rules as for a
    range), answered by its last ``min(length, T)`` bytes. A 416, or a 200 of a file over the
    cap, means the server does not serve suffix ranges: :class:`SuffixUnsupported`."""
    if status == 206:
        got_first, got_last, total = _content_range(headers, known_size, where)
        if total is None or (got_first, got_last) != (max(0, total - length), total - 1):
            raise _bad_content_range(headers, where)
        answer = total - got_first
        return RangePlan(body_bytes=answer, skip_bytes=0, file_size=total, answer_bytes=answer)
    if status == 416:
        raise SuffixUnsupported(f"{where}: HTTP 416")
    if status == 200:
        total = _whole_body_size(headers, known_size, whole_body_cap_bytes, where,
                                 over_cap=SuffixUnsupported)
        answer = min(length, total)
        return RangePlan(body_bytes=total, skip_bytes=total - answer, file_size=total,
                         answer_bytes=answer)
    raise status_error(status, headers, where)


def _content_range(headers, known_size: int | None, where: str) -> tuple[int, int, int | None]:
    """``(first, last, total)`` of a 206's ``Content-Range: bytes F-L/T`` (``total`` None for
    ``*``); ``BadRangeResponse`` if it does not parse, ``PayloadChanged`` if ``T`` differs from
    the size seen before."""
    match = _CONTENT_RANGE.fullmatch(headers.get("Content-Range", "").strip())
    if match is None:
        raise _bad_content_range(headers, where)
    total = None if match[3] == "*" else int(match[3])
    if known_size is not None and total is not None and total != known_size:
        raise PayloadChanged(f"{where}: file size changed from {known_size} to {total} bytes")
    return int(match[1]), int(match[2]), total


def _bad_content_range(headers, where: str) -> BadRangeResponse:
    return BadRangeResponse(f"{where}: 206 with Content-Range {headers.get('Content-Range', '')!r}")


def _whole_body_size(headers, known_size: int | None, whole_body_cap_bytes: int, where: str,
                     over_cap: type[Exception] = BadRangeResponse) -> int:
    """The size of a 200 answer to a range request (the server ignored ``Range``), when it is
    acceptable: no ``Content-Range``, a decimal ``Content-Length`` within the cap (else
    ``over_cap``, raised before the body is read) and equal to the size seen before."""
    if "Content-Range" in headers:
        raise BadRangeResponse(f"{where}: 200 with Content-Range {headers['Content-Range']!r}")
    announced = headers.get("Content-Length", "")
    if not announced.isdigit():
        raise BadRangeResponse(f"{where}: server ignored Range, no Content-Length")
    total = int(announced)
    if total > whole_body_cap_bytes:
        raise over_cap(
            f"{where}: server ignored Range and sent the whole file ({total} bytes > "
            f"{whole_body_cap_bytes}-byte cap)"
        )
    if known_size is not None and total != known_size:
        raise PayloadChanged(f"{where}: file size changed from {known_size} to {total} bytes")
    return total


def status_error(status: int, headers, where: str) -> Exception:
    """The error for a status that carries no usable body (``_Transient`` if retried)."""
    if status in RETRY_STATUSES:
        error = HTTPStatusError(f"{where}: HTTP {status}")
        return _Transient(error, parse_retry_after(headers.get("Retry-After")))
    if status in (404, 410):
        return MalformedDataset(f"{where}: missing from the dataset (HTTP {status})")
    if status == 412:
        return PayloadChanged(f"{where}: HTTP 412, the file changed since indexed")
    if status == 416:
        extra = headers.get("Content-Range", "")
        return BadRangeResponse(f"{where}: HTTP 416 range not satisfiable {extra}".rstrip())
    return HTTPStatusError(f"{where}: HTTP {status}")


def _linked_size(hops: list[requests.Response]) -> int | None:
    for hop in hops:
        linked = hop.headers.get("X-Linked-Size", "")
        if linked.isdigit():
            return int(linked)
    announced = hops[-1].headers.get("Content-Length", "")
    return int(announced) if announced.isdigit() else None


# --- hf:// -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class HfRoot:
    """A parsed ``hf://`` root (module docstring for the syntax)."""

    kind: str  # "datasets" or "buckets"
    owner: str
    name: str
    revision: str | None  # datasets: branch, tag or commit, percent-decoded; buckets: None
    prefix: str  # a folder inside the repository, "" for its top
    endpoint: str  # e.g. https://huggingface.co, no trailing slash

    @property
    def revision_api_url(self) -> str | None:
        """Where the commit of a branch or tag is asked; None when there is nothing to pin."""
        if self.revision is None or _COMMIT.fullmatch(self.revision):
            return None
        rev = quote(self.revision, safe="")
        return f"{self.endpoint}/api/datasets/{self.owner}/{self.name}/revision/{rev}"

    def base_url(self, commit: str | None) -> str:
        """The URL that relative paths are appended to (``commit`` for datasets only)."""
        suffix = f"/{quote(self.prefix, safe='/')}" if self.prefix else ""
        if self.kind == "buckets":
            return f"{self.endpoint}/buckets/{self.owner}/{self.name}/resolve{suffix}"
        return f"{self.endpoint}/datasets/{self.owner}/{self.name}/resolve/{commit}{suffix}"


def parse_hf_root(root: str, endpoint: str) -> HfRoot:
    """Split ``hf://datasets/OWNER/NAME[@REV][/PREFIX]`` or ``hf://buckets/OWNER/NAME[/PREFIX]``."""
    kind, _, rest = root.removeprefix("hf://").partition("/")
    parts = rest.split("/")
    if not root.startswith("hf://") or kind not in ("datasets", "buckets") or len(parts) < 2 \
            or not all(parts[:2]):
        raise UsageError(
            f"{root!r}: expected hf://datasets/OWNER/NAME[@REV] or hf://buckets/OWNER/NAME"
        )
    owner, name, prefix = parts[0], parts[1], "/".join(parts[2:]).strip("/")
    if prefix:
        check_relpath(prefix)
    name, at, revision = name.partition("@")
    if kind == "buckets" and at:
        raise UsageError(f"{root!r}: buckets have no revisions")
    if not name or (at and not revision):
        raise UsageError(f"{root!r}: empty repository name or revision")
    return HfRoot(
        kind=kind, owner=owner, name=name,
        revision=None if kind == "buckets" else unquote(revision or "main"),
        prefix=prefix, endpoint=endpoint.rstrip("/"),
    )


def open_hf_source(
    root: str, *, endpoint: str | None = None, token: str | None = None, **http_options
) -> HTTPSource:
    """An :class:`HTTPSource` for ``hf://datasets/…`` or ``hf://buckets/…`` (module docstring)."""
    endpoint = endpoint or os.environ.get("HF_ENDPOINT") or HF_DEFAULT_ENDPOINT
    token = token if token is not None else os.environ.get("HF_TOKEN") or None
    hf = parse_hf_root(root, endpoint)
    options = dict(token=token, token_origin=hf.endpoint, label=root, **http_options)
    if hf.kind == "buckets":
        return HTTPSource(hf.base_url(None), **options)
    commit = hf.revision
    if hf.revision_api_url is not None:
        api = HTTPSource(hf.endpoint, **options)
        try:
            answer = api.get_json_url(hf.revision_api_url)
        finally:
            api.close()
        commit = str(answer.get("sha", "")) if isinstance(answer, dict) else ""
        if not _COMMIT.fullmatch(commit):
            raise FetchError(f"{root}: the Hub gave no commit for revision {hf.revision!r}")
    options["label"] = f"hf://datasets/{hf.owner}/{hf.name}@{commit}"
    return HTTPSource(hf.base_url(commit), pinned_identity=f"commit:{commit}", **options)


def open_source(root: str | Path, **http_options) -> Source:
    """The source for a dataset root: a folder, ``file://``, ``http(s)://`` or ``hf://``.

    ``http_options`` (timeouts, ``retry``, …) are :class:`HTTPSource` arguments; a local root
    has nothing to tune and ignores them.
    """
    text = str(root)
    if text.startswith("hf://"):
        return open_hf_source(text, **http_options)
    if text.startswith(("http://", "https://")):
        return HTTPSource(text, **http_options)
    if text.startswith("file://"):
        return LocalSource(unquote(urlsplit(text).path))
    if "://" in text:
        raise UsageError(f"{text!r}: unsupported root (folder, file://, http(s)://, hf://)")
    return LocalSource(text)


# --- file-like view ----------------------------------------------------------------------------


class RangeFile(io.RawIOBase):
    """A read-only, seekable file over one source file; every read is one ``read_range``,
    except reads that lie inside ``tail`` (the file's last bytes, already fetched).

    ``reads`` and ``bytes_read`` count what went through this view (for tests and benches).
    """

    def __init__(self, source: Source, relpath: str, size: int | None = None,
                 tail: bytes = b"") -> None:
        super().__init__()
        self.source = source
        self.relpath = relpath
        self._size = source.size(relpath) if size is None else size
        if len(tail) > self._size:
            raise UsageError(f"{relpath}: a tail of {len(tail)} bytes in a {self._size}-byte file")
        self._tail = tail
        self._position = 0
        self.reads = 0
        self.bytes_read = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def size(self) -> int:
        return self._size

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self._size}[whence]
        if base + offset < 0:
            raise UsageError(f"{self.relpath}: seek to negative offset {base + offset}")
        self._position = base + offset
        return self._position

    def readinto(self, buffer) -> int:
        view = memoryview(buffer).cast("B")
        data = self._read_at_position(len(view))
        view[: len(data)] = data
        return len(data)

    def readall(self) -> bytes:
        return self._read_at_position(self._size - self._position)

    def _read_at_position(self, limit: int) -> bytes:
        length = max(0, min(limit, self._size - self._position))
        if length == 0:
            return b""
        tail_start = self._size - len(self._tail)
        if self._position >= tail_start:
            at = self._position - tail_start
            self._position += length
            return self._tail[at : at + length]
        data = self.source.read_range(self.relpath, self._position, length)
        self._position += length
        self.reads += 1
        self.bytes_read += length
        return data
