"""HTTP(S) byte sources: one range per request, each answer judged before its body is read,
transient failures retried (SPEC §8.2 requests and answers, §8.3 retries, §8.1 identities).

Usage::

    source = HTTPSource("https://host/dataset", token=None, retry=RetryPolicy())
    source.read_range("data/chunk-000/file-000.parquet", 0, 4096)   # the refstream.source calls

Judging is I/O-free: :func:`plan_range_response` (``Range: bytes=a-b``),
:func:`plan_suffix_response` (``bytes=-n``), :func:`plan_whole_response` (no ``Range``) and
:func:`plan_status` take what was asked and the answer's status and headers, and return a
decision — :class:`Accept` (how to read the body), :class:`Retry` or :class:`FallBack` (the server
does not serve this kind of range) — or raise the :mod:`refstream.errors` class that ends the
request. :class:`HTTPSource` does the I/O around them: a ``requests.Session`` per request in
flight, reused; redirects followed by hand; the token sent to its own origin only; ``.netrc``
never read. A connection that fails before an answer, or a body cut short, is a Retry too. Each
retry is logged at WARNING on the ``refstream.http`` logger (URL, byte range, attempt, delay);
no message carries a token or a request header.
"""

from __future__ import annotations

import contextlib
import email.utils
import logging
import random
import re
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import TypeVar
from urllib.parse import quote, urljoin, urlsplit

import requests
from requests.adapters import HTTPAdapter

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
from refstream.source import BaseSource, byte_range, check_span, check_tail

__all__ = [
    "HTTPSource",
    "RetryPolicy",
    "Accept",
    "Retry",
    "FallBack",
    "plan_range_response",
    "plan_suffix_response",
    "parse_retry_after",
]

log = logging.getLogger(__name__)

# A server that ignores Range is tolerated for bodies up to this size (metadata-sized files);
# beyond it each span would cost a whole-file download, which we refuse.
WHOLE_BODY_CAP_BYTES = 1 << 20
# Transient statuses (RFC 9110: 408 timeout, 425 too early, 429 rate limit, 5xx server side).
RETRY_STATUSES = frozenset({408, 425, 429, *range(500, 600)})
REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
MAX_REDIRECTS = 5  # the Hub needs 1 (resolve -> CDN); more hops mean a loop
# What a remembered redirect target answers once its signature expired (S3/CloudFront: 403).
_EXPIRED_TARGET_STATUSES = frozenset({401, 403, 404, 410})
_CHUNK_BYTES = 1 << 16  # socket read granularity for response bodies
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")
_T = TypeVar("_T")


# --- decisions ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Accept:
    """Read the body; the answer is a slice of it (all in bytes)."""

    body_bytes: int | None  # the body's exact length; None: unknown (no Content-Length)
    skip_bytes: int  # the answer starts this far into the body
    file_size: int | None  # the file's size the response states, None if it does not
    answer_bytes: int | None  # the answer's length from skip_bytes on; None: the whole body


@dataclass(frozen=True)
class Retry:
    """This attempt failed in a way the next one may not."""

    cause: FetchError  # what failed; chained to RetriesExhausted when no attempt is left
    after_s: float | None = None  # the server's Retry-After in seconds, None when it gave none


@dataclass(frozen=True)
class FallBack:
    """The server does not serve this kind of range: ask the size, then a plain range."""

    reason: str  # the message, should the request have no other way


def plan_range_response(
    first: int, last: int, status: int, headers, *, known_size: int | None,
    whole_body_cap_bytes: int, where: str,
) -> Accept | Retry:
    """The decision on an answer to ``Range: bytes=first-last`` (SPEC §8.2 rules 1–4);
    ``headers`` is case-insensitive, ``known_size`` the size seen before (or None)."""
    length = last - first + 1
    if status == 206:
        got_first, got_last, total = _content_range(headers, known_size, where)
        if (got_first, got_last) != (first, last):
            if got_first == first and total is not None and got_last == total - 1 < last:
                raise ShortRead(f"{where}: file has only {total} bytes")
            raise _bad_content_range(headers, where)
        return Accept(body_bytes=length, skip_bytes=0, file_size=total, answer_bytes=length)
    if status == 200:  # the server ignored Range
        total = _whole_body_size(headers, known_size, whole_body_cap_bytes, where)
        if isinstance(total, FallBack):
            raise BadRangeResponse(total.reason)
        if total <= last:
            raise ShortRead(f"{where}: file has only {total} bytes")
        return Accept(body_bytes=total, skip_bytes=first, file_size=total, answer_bytes=length)
    return plan_status(status, headers, where)


def plan_suffix_response(
    length: int, status: int, headers, *, known_size: int | None, whole_body_cap_bytes: int,
    where: str,
) -> Accept | Retry | FallBack:
    """The decision on an answer to ``Range: bytes=-length`` (SPEC §8.2, tail reads)."""
    if status == 206:
        got_first, got_last, total = _content_range(headers, known_size, where)
        if total is None or (got_first, got_last) != (max(0, total - length), total - 1):
            raise _bad_content_range(headers, where)
        answer = total - got_first
        return Accept(body_bytes=answer, skip_bytes=0, file_size=total, answer_bytes=answer)
    if status == 416:
        return FallBack(f"{where}: HTTP 416")
    if status == 200:
        total = _whole_body_size(headers, known_size, whole_body_cap_bytes, where)
        if isinstance(total, FallBack):
            return total
        answer = min(length, total)
        return Accept(body_bytes=total, skip_bytes=total - answer, file_size=total,
                      answer_bytes=answer)
    return plan_status(status, headers, where)


def plan_whole_response(status: int, headers, where: str) -> Accept | Retry:
    """The decision on an answer to a GET without ``Range``: a 200 whose body has its
    ``Content-Length`` when one is given (SPEC §8.2)."""
    if status != 200:
        return plan_status(status, headers, where)
    announced = headers.get("Content-Length", "")
    size = int(announced) if announced.isdigit() else None
    return Accept(body_bytes=size, skip_bytes=0, file_size=None, answer_bytes=None)


def plan_status(status: int, headers, where: str) -> Retry:
    """A :class:`Retry` for a retried status; for any other, its error is raised (SPEC §8.2
    rules 3–4)."""
    if status in RETRY_STATUSES:
        return Retry(HTTPStatusError(f"{where}: HTTP {status}"),
                     parse_retry_after(headers.get("Retry-After")))
    if status in (404, 410):
        raise MalformedDataset(f"{where}: missing from the dataset (HTTP {status})")
    if status == 412:
        raise PayloadChanged(f"{where}: HTTP 412, the file changed since indexed")
    if status == 416:
        extra = headers.get("Content-Range", "")
        raise BadRangeResponse(f"{where}: HTTP 416 range not satisfiable {extra}".rstrip())
    raise HTTPStatusError(f"{where}: HTTP {status}")


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


def _content_range(headers, known_size: int | None, where: str) -> tuple[int, int, int | None]:
    """``(first, last, total)`` of a 206's ``Content-Range: bytes F-L/T`` (``total`` None for
    ``*``), checked against the size seen before."""
    match = _CONTENT_RANGE.fullmatch(headers.get("Content-Range", "").strip())
    if match is None:
        raise _bad_content_range(headers, where)
    total = None if match[3] == "*" else int(match[3])
    _check_size(known_size, total, where)
    return int(match[1]), int(match[2]), total


def _bad_content_range(headers, where: str) -> BadRangeResponse:
    return BadRangeResponse(f"{where}: 206 with Content-Range {headers.get('Content-Range', '')!r}")


def _whole_body_size(headers, known_size: int | None, whole_body_cap_bytes: int,
                     where: str) -> int | FallBack:
    """The size of a 200 answer to a range request (the server ignored ``Range``), or
    :class:`FallBack` when it is over the cap (decided before the body is read)."""
    if "Content-Range" in headers:
        raise BadRangeResponse(f"{where}: 200 with Content-Range {headers['Content-Range']!r}")
    announced = headers.get("Content-Length", "")
    if not announced.isdigit():
        raise BadRangeResponse(f"{where}: server ignored Range, no Content-Length")
    total = int(announced)
    if total > whole_body_cap_bytes:
        return FallBack(f"{where}: server ignored Range and sent the whole file ({total} bytes "
                        f"> {whole_body_cap_bytes}-byte cap)")
    _check_size(known_size, total, where)
    return total


def _check_size(known_size: int | None, total: int | None, where: str) -> None:
    """PayloadChanged when a response states another size than the one seen before."""
    if known_size is not None and total is not None and total != known_size:
        raise PayloadChanged(f"{where}: file size changed from {known_size} to {total} bytes")


# --- retries -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how long to retry a transient failure (SPEC §8.3; seconds)."""

    max_attempts: int = 5
    backoff_base_s: float = 0.25
    backoff_cap_s: float = 8.0
    retry_after_cap_s: float = 30.0

    def delay_s(self, retry: int, retry_after_s: float | None) -> float:
        """Seconds to sleep before retry number ``retry`` (1-based)."""
        if retry_after_s is not None:
            return min(max(retry_after_s, 0.0), self.retry_after_cap_s)
        return random.uniform(0.0, min(self.backoff_cap_s, self.backoff_base_s * 2 ** (retry - 1)))


# --- the source --------------------------------------------------------------------------------

# A decision function of (status, headers (case-insensitive), the file size seen before).
Judge = Callable[[int, Mapping[str, str], int | None], Accept | Retry | FallBack]


def _origin(url: str) -> tuple[str, str, int | None]:
    parts = urlsplit(url)
    return parts.scheme, (parts.hostname or ""), parts.port


class HTTPSource(BaseSource):
    """Files under an HTTP(S) base URL (module docstring). ``token`` goes only to
    ``token_origin`` (default: the base URL's); ``pinned_identity`` (``commit:<sha>``) is every
    file's identity when the URLs name a commit; ``label`` is what ``repr`` shows."""

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
        super().__init__()
        self.base_url = base_url.rstrip("/")
        self.label = label or self.base_url
        self._token = token
        self._token_origin = _origin(token_origin or base_url)
        self._pinned_identity = pinned_identity
        self._timeout = (connect_timeout_s, read_timeout_s)
        self.retry = retry or RetryPolicy()
        self._whole_body_cap_bytes = whole_body_cap_bytes
        # guarded by self._lock, with the counters:
        self._sessions: list[requests.Session] = []  # every session made, closed by close()
        self._idle: list[requests.Session] = []  # sessions no request is being sent on
        self._sizes: dict[str, int] = {}  # relpath -> size seen
        self._targets: dict[str, str] = {}  # url -> redirect target (commit-pinned only)

    def __repr__(self) -> str:
        return f"HTTPSource({self.label!r}, token={'set' if self._token else 'none'})"

    # --- the Source calls ---------------------------------------------------------------------

    def url(self, relpath: str) -> str:
        return f"{self.base_url}/{quote(check_relpath(relpath), safe='/')}"

    def read_bytes(self, relpath: str) -> bytes:
        url = self.url(relpath)
        return self._get(url, url, relpath, None, None)

    def read_range(self, relpath: str, offset: int, length: int) -> bytes:
        url = self.url(relpath)
        check_span(url, offset, length)
        if length == 0:
            return b""
        first, last = offset, offset + length - 1
        where = f"{url} {byte_range(offset, length)}"
        return self._get(url, where, relpath, f"bytes={first}-{last}",
                         lambda status, headers, known: plan_range_response(
                             first, last, status, headers, known_size=known,
                             whole_body_cap_bytes=self._whole_body_cap_bytes, where=where))

    def read_tail(self, relpath: str, length: int) -> tuple[bytes, int]:
        url = self.url(relpath)
        check_tail(url, length)
        where = f"{url} bytes -{length}"  # HTTP's suffix form: the last `length` bytes
        body = self._get(url, where, relpath, f"bytes=-{length}",
                         lambda status, headers, known: plan_suffix_response(
                             length, status, headers, known_size=known,
                             whole_body_cap_bytes=self._whole_body_cap_bytes, where=where))
        if isinstance(body, FallBack):
            return self._tail_by_size(relpath, length)  # the size from HEAD, then a range
        with self._lock:
            return body, self._sizes[relpath]

    def size(self, relpath: str) -> int:
        with self._lock:
            known = self._sizes.get(relpath)
        return self._head(relpath)[0] if known is None else known

    def identity(self, relpath: str) -> str:
        if self._pinned_identity is not None:
            check_relpath(relpath)
            return self._pinned_identity
        return self._head(relpath)[1]

    def close(self) -> None:
        with self._lock:
            sessions, self._sessions, self._idle = self._sessions, [], []
        for session in sessions:
            session.close()

    def get_url(self, url: str, judge: Judge | None = None) -> bytes:
        """GET an absolute URL (a Hub API call), retried; ``judge`` may see every answer."""
        return self._get(url, url, None, None, judge)

    # --- one logical request: attempts until one is not a Retry -----------------------------

    def _get(self, url: str, where: str, relpath: str | None, range_header: str | None,
             judge: Judge | None) -> bytes | FallBack:
        """GET ``url`` with ``range_header``, whose answers ``judge`` decides (None: a whole-file
        GET, :func:`plan_whole_response`), with retries."""
        return self._retrying(where, lambda: self._attempt(url, where, relpath, range_header,
                                                           judge))

    def _retrying(self, where: str, attempt: Callable[[], _T | Retry]) -> _T:
        """Run ``attempt`` until it returns anything but a :class:`Retry`, at most
        ``max_attempts`` times; a connection that fails before any answer is a Retry too."""
        policy = self.retry
        for number in range(1, policy.max_attempts + 1):
            try:
                outcome = attempt()
            except (requests.ConnectionError, requests.Timeout) as exc:
                outcome = Retry(FetchError(f"{where}: {type(exc).__name__}: {exc}"))
            except requests.RequestException as exc:
                raise FetchError(f"{where}: {type(exc).__name__}: {exc}") from exc
            if not isinstance(outcome, Retry):
                return outcome
            if number < policy.max_attempts:
                delay_s = policy.delay_s(number, outcome.after_s)
                log.warning("%s; attempt %d of %d failed, retrying in %.2f s", outcome.cause,
                            number, policy.max_attempts, delay_s)
                self._count(retries=1)
                time.sleep(delay_s)
        raise RetriesExhausted(
            f"{where}: failed {policy.max_attempts} times; last: {outcome.cause}"
        ) from outcome.cause

    def _attempt(self, url: str, where: str, relpath: str | None, range_header: str | None,
                 judge: Judge | None) -> bytes | Retry | FallBack:
        headers = {} if range_header is None else {"Range": range_header}
        response, hops = self._send("GET", url, headers, where)
        with contextlib.closing(response):
            with self._lock:
                known = None if relpath is None else self._sizes.get(relpath)
            decision = (plan_whole_response(response.status_code, response.headers, where)
                        if judge is None else judge(response.status_code, response.headers, known))
            if not isinstance(decision, Accept):
                return decision
            body, broken = self._read_body(response, decision.body_bytes)
            expected = decision.body_bytes
            if broken or (expected is not None and len(body) < expected):
                of = "" if expected is None else f" of {expected}"
                return Retry(ShortRead(f"{where}: body has {len(body)}{of} bytes{broken}"))
            if expected is not None and len(body) > expected:
                raise BadRangeResponse(f"{where}: body longer than {expected} bytes")
            if relpath is not None:
                if decision.file_size is not None:
                    with self._lock:
                        self._sizes.setdefault(relpath, decision.file_size)
                self._check_identity(relpath, self._identity_of(hops), where)
            if decision.answer_bytes is None:
                return body
            return body[decision.skip_bytes : decision.skip_bytes + decision.answer_bytes]

    def _head(self, relpath: str) -> tuple[int, str]:
        """(size, identity) of a file from a HEAD request; the size is remembered."""
        url = self.url(relpath)
        return self._retrying(f"HEAD {url}", lambda: self._head_once(relpath, url))

    def _head_once(self, relpath: str, url: str) -> tuple[int, str] | Retry:
        where = f"HEAD {url}"
        response, hops = self._send("HEAD", url, {}, where)
        response.close()
        if response.status_code != 200:
            return plan_status(response.status_code, response.headers, where)
        size = _linked_size(hops)
        if size is None:
            raise BadRangeResponse(f"{where}: no Content-Length")
        with self._lock:
            self._sizes[relpath] = size
        return size, self._identity_of(hops)

    # --- transport ----------------------------------------------------------------------------

    @contextlib.contextmanager
    def _session(self) -> Iterator[requests.Session]:
        """A session to send one request on: an idle one, else a new one (kept until close()).
        Not a thread-local: pyarrow calls in from its I/O threads with a fresh thread state each
        time, so a thread-local session would be one new connection per call."""
        with self._lock:
            session = self._idle.pop() if self._idle else None
        if session is None:
            session = requests.Session()
            session.auth = lambda request: request  # adds nothing; stops requests reading .netrc
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
        """Send, following redirects by hand; returns the final response and every hop. A
        commit-pinned source goes straight to a remembered redirect target (SPEC §8.2)."""
        with self._lock:
            target = self._targets.get(url)
        if target is not None:
            response, hops = self._follow(method, target, headers, where)
            if response.status_code not in _EXPIRED_TARGET_STATUSES:
                return response, hops
            response.close()
            with self._lock:
                self._targets.pop(url, None)
            self._count(refreshes=1)
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
            with self._session() as session:
                response = session.request(
                    method, url, headers=sent, timeout=self._timeout, allow_redirects=False,
                    stream=True,
                )
            self._count(requests=1)
            hops.append(response)
            location = response.headers.get("Location")
            if response.status_code not in REDIRECT_STATUSES or not location:
                return response, hops
            response.close()
            self._count(redirects=1)
            url = urljoin(url, location)
        raise HTTPStatusError(f"{where}: more than {MAX_REDIRECTS} redirects")

    def _read_body(self, response: requests.Response, limit: int | None) -> tuple[bytes, str]:
        """The body, stopping after ``limit + 1`` bytes, and ``""`` — or, when the connection
        broke, what arrived and a note saying how."""
        parts, done = [], 0
        try:
            for chunk in response.iter_content(_CHUNK_BYTES):
                parts.append(chunk)
                done += len(chunk)
                if limit is not None and done > limit:
                    break
        except (requests.RequestException, OSError) as exc:
            return b"".join(parts), f" (connection failed: {exc})"
        self._count(bytes=done)
        return b"".join(parts), ""

    def _identity_of(self, hops: list[requests.Response]) -> str:
        """SPEC §8.1: the pinned identity, else the first X-Linked-Etag, ETag, Last-Modified."""
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


def _linked_size(hops: list[requests.Response]) -> int | None:
    for hop in hops:
        linked = hop.headers.get("X-Linked-Size", "")
        if linked.isdigit():
            return int(linked)
    announced = hops[-1].headers.get("Content-Length", "")
    return int(announced) if announced.isdigit() else None
