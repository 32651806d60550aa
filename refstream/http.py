"""HTTP(S) byte sources: ranges, answers, retries and identities (SPEC §8.1–8.3).

Usage::

    source = HTTPSource("https://host/dataset", token=None, retry=RetryPolicy())
    source.read_range("data/chunk-000/file-000.parquet", 0, 4096)   # the refstream.source calls

:func:`judge_response` is I/O-free: a request and its answer's status and headers give a decision
or an error. :class:`HTTPSource` does the I/O around it and logs each retry and wait at WARNING
on ``refstream.http``, never a token or a request header.
"""

from __future__ import annotations

import contextlib
import email.utils
import logging
import os
import random
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from http.cookiejar import DefaultCookiePolicy
from urllib.parse import quote, urljoin, urlsplit

import requests

from refstream import errors
from refstream.source import Source, byte_range, check_relpath, check_span, check_tail

__all__ = ["HTTPSource", "RetryPolicy", "Accept", "Retry", "FallBack", "judge_response",
           "parse_retry_after", "parse_decimal"]

log = logging.getLogger(__name__)

# A server that ignores Range is tolerated for bodies up to this size (metadata-sized files);
# beyond it each span would cost a whole-file download, which we refuse.
WHOLE_BODY_CAP_BYTES = 1 << 20
# Transient statuses (RFC 9110: 408 timeout, 425 too early, 429 rate limit, 5xx server side).
RETRY_STATUSES = frozenset({408, 425, 429, *range(500, 600)})
ABSENT_STATUSES = frozenset({404, 410})
REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
MAX_REDIRECTS = 5  # the Hub needs 1 (resolve -> CDN); more hops mean a loop
MAX_ORIGINS = 64  # origins whose environment settings a source keeps (see HTTPSource._environment)
_CHUNK_BYTES = 1 << 16  # socket read granularity for response bodies
_CONTENT_RANGE = re.compile(r"bytes ([0-9]+)-([0-9]+)/([0-9]+|\*)")
_RATE_LIMIT = re.compile(r'"([^"]*)"\s*;\s*r\s*=\s*0+\s*;\s*t\s*=\s*([0-9]+)')  # quota spent
_OBSOLETE_YEAR = re.compile(r"-([0-9]{2}) ")  # RFC 850's two-digit year: 06-Nov-94
_WEEKDAYS = ("Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun")
RATE_LIMIT_WAIT_ENV = "REFSTREAM_RATE_LIMIT_WAIT_S"


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

    cause: errors.FetchError  # what failed; chained to RetriesExhausted when no attempt is left
    after_s: float | None = None  # the server's Retry-After or RateLimit reset, None: neither
    quota: str = ""  # the quota a RateLimit header names as spent, "" when none


@dataclass(frozen=True)
class FallBack:
    """The server does not serve suffix ranges: ask the size, then a plain range."""


def judge_response(status: int, headers: Mapping[str, str], *,
                   first_last: tuple[int, int] | None = None, suffix: int | None = None,
                   known_size: int | None = None, whole_body_cap_bytes: int = WHOLE_BODY_CAP_BYTES,
                   where: str = "", now: datetime | None = None) -> Accept | Retry | FallBack:
    """The decision on an answer to ``Range: bytes=first-last``, ``bytes=-suffix`` or (both None)
    no ``Range`` (SPEC §8.2); ``headers`` case-insensitive, ``known_size`` the size seen before."""
    asked_range = first_last is not None or suffix is not None
    if status in RETRY_STATUSES:
        return _retry(status, headers, where, now)
    if status == 200 and not asked_range:
        size = parse_decimal(headers.get("Content-Length"))
        return Accept(body_bytes=size, skip_bytes=0, file_size=None, answer_bytes=None)
    if status == 206 and asked_range:
        return _partial(headers, first_last, suffix, known_size, where)
    if status == 200 and asked_range:  # the server ignored Range
        return _whole_file(headers, first_last, suffix, known_size, whole_body_cap_bytes, where)
    if status == 416 and suffix is not None:
        return FallBack()
    if status in ABSENT_STATUSES:
        raise errors.MalformedDataset(f"{where}: missing from the dataset (HTTP {status})")
    if status == 412:
        raise errors.PayloadChanged(f"{where}: HTTP 412, the file changed since indexed")
    if status == 416:
        extra = headers.get("Content-Range", "")
        raise errors.BadRangeResponse(f"{where}: HTTP 416 range not satisfiable {extra}".rstrip())
    raise errors.HTTPStatusError(f"{where}: HTTP {status}")


def _retry(status: int, headers: Mapping[str, str], where: str, now: datetime | None) -> Retry:
    """A transient status: when the server says to come back, and which quota it spent."""
    after_s = parse_retry_after(headers.get("Retry-After"), now)
    spent = _RATE_LIMIT.match(headers.get("RateLimit", "").strip(" \t"))
    if status in (429, 503) and spent:
        return Retry(errors.HTTPStatusError(f"{where}: HTTP {status}"),
                     max(float(spent[2]), after_s or 0.0), spent[1])
    return Retry(errors.HTTPStatusError(f"{where}: HTTP {status}"), after_s)


def _partial(headers: Mapping[str, str], first_last: tuple[int, int] | None,
             suffix: int | None, known_size: int | None, where: str) -> Accept:
    """A 206 answer: its ``Content-Range`` must be the range asked."""
    match = _CONTENT_RANGE.fullmatch(headers.get("Content-Range", "").strip(" \t"))
    if match is None or (first_last is None and match[3] == "*"):  # a suffix needs the size
        raise _bad_content_range(headers, where)
    got_first, got_last = int(match[1]), int(match[2])
    total = None if match[3] == "*" else int(match[3])
    _check_size(known_size, total, where)
    first, last = first_last or _suffix_range(suffix, total)
    if (got_first, got_last) != (first, last):
        if got_first == first and total is not None and got_last == total - 1 < last:
            raise errors.ShortRead(f"{where}: file has only {total} bytes")
        raise _bad_content_range(headers, where)
    length = last - first + 1
    return Accept(body_bytes=length, skip_bytes=0, file_size=total, answer_bytes=length)


def _whole_file(headers: Mapping[str, str], first_last: tuple[int, int] | None,
                suffix: int | None, known_size: int | None, cap_bytes: int,
                where: str) -> Accept | FallBack:
    """A 200 answer to a range: the range is cut from the whole file, when it is small."""
    if "Content-Range" in headers:
        raise errors.BadRangeResponse(
            f"{where}: 200 with Content-Range {headers['Content-Range']!r}")
    total = parse_decimal(headers.get("Content-Length"))
    if total is None:
        raise errors.BadRangeResponse(f"{where}: server ignored Range, no Content-Length")
    if total > cap_bytes and suffix is not None:
        return FallBack()
    if total > cap_bytes:
        raise errors.BadRangeResponse(f"{where}: server ignored Range and sent the whole file "
                                      f"({total} bytes > {cap_bytes}-byte cap)")
    _check_size(known_size, total, where)
    first, last = first_last or _suffix_range(suffix, total)
    if total <= last:
        raise errors.ShortRead(f"{where}: file has only {total} bytes")
    return Accept(body_bytes=total, skip_bytes=first, file_size=total,
                  answer_bytes=last - first + 1)


def _suffix_range(suffix: int, size: int) -> tuple[int, int]:
    """The first and last byte of a file's last ``suffix`` bytes (last < first when empty)."""
    return max(0, size - suffix), size - 1


def parse_retry_after(value: str | None, now: datetime | None = None) -> float | None:
    """``Retry-After`` in seconds after ``now`` (SPEC §8.2 rule 3), None when absent or invalid."""
    value = (value or "").strip()
    if parse_decimal(value) is not None:
        return float(value)
    now = now or datetime.now(timezone.utc)
    try:  # an impossible date (Feb 30, second 60) raises ValueError
        when = email.utils.parsedate_to_datetime(value)
        when = when if when.tzinfo else when.replace(tzinfo=timezone.utc)
        if two_digits := _OBSOLETE_YEAR.search(value):  # RFC 9110: at most 50 years ahead
            year = now.year // 100 * 100 + int(two_digits[1])
            when = when.replace(year=year - 100 if year > now.year + 50 else year)
    except (TypeError, ValueError):
        return None
    if value[:3] != _WEEKDAYS[when.weekday()] and not value[:3].isdigit():
        return None  # the weekday disagrees with the date
    return max(0.0, (when - now).total_seconds())


def parse_decimal(text: str | None) -> int | None:
    """``text`` as an integer when, spaces and tabs around it removed, it is a decimal (§8.2)."""
    text = (text or "").strip(" \t")
    return int(text) if text.isascii() and text.isdigit() else None


def _bad_content_range(headers, where: str) -> errors.BadRangeResponse:
    content_range = headers.get("Content-Range", "")
    return errors.BadRangeResponse(f"{where}: 206 with Content-Range {content_range!r}")


def _check_size(known_size: int | None, total: int | None, where: str) -> None:
    if known_size is not None and total is not None and total != known_size:
        raise errors.PayloadChanged(
            f"{where}: file size changed from {known_size} to {total} bytes")


# --- retries -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class RetryPolicy:
    """How one request retries and waits out rate limits, in seconds (SPEC §8.3)."""

    max_attempts: int = 5
    backoff_base_s: float = 0.25
    backoff_cap_s: float = 8.0
    rate_limit_wait_s: float = field(
        default_factory=lambda: float(os.environ.get(RATE_LIMIT_WAIT_ENV) or 360.0))

    def delay_s(self, retry: int) -> float:
        """Seconds to sleep before retry number ``retry`` (1-based) when the server said none."""
        return random.uniform(0.0, min(self.backoff_cap_s, self.backoff_base_s * 2 ** (retry - 1)))


@dataclass(frozen=True)
class _Request:
    """One logical request of :class:`HTTPSource`; ``where`` is how messages name it."""

    url: str
    where: str
    relpath: str | None = None  # the file whose size and identity the answer is checked against
    method: str = "GET"
    first_last: tuple[int, int] | None = None  # Range: bytes=first-last
    suffix: int | None = None  # Range: bytes=-suffix
    absent_ok: bool = False  # an absent file is None, not MalformedDataset

    def headers(self) -> dict[str, str]:
        if self.first_last is not None:
            return {"Range": f"bytes={self.first_last[0]}-{self.first_last[1]}"}
        return {} if self.suffix is None else {"Range": f"bytes=-{self.suffix}"}


@dataclass(frozen=True)
class _Answer:
    body: bytes  # the bytes asked (none for a HEAD)
    hops: list[requests.Response]  # the redirect chain, the final response last


# --- the source --------------------------------------------------------------------------------


def _origin(url: str) -> tuple[str, str, int | None]:
    parts = urlsplit(url)
    return parts.scheme, (parts.hostname or ""), parts.port


class HTTPSource(Source):
    """Files under an HTTP(S) base URL (module docstring); ``label`` is what ``repr`` shows."""

    def __init__(self, base_url: str, *, token: str | None = None, connect_timeout_s: float = 10.0,
                 read_timeout_s: float = 60.0, retry: RetryPolicy | None = None,
                 label: str | None = None) -> None:
        if urlsplit(base_url).username or urlsplit(base_url).password:
            raise errors.UsageError("credentials in a URL are refused; pass a token instead")
        super().__init__()
        self.base_url = base_url.rstrip("/")
        self.label = label or self.base_url
        self._token = token
        self._token_origin = _origin(base_url)
        self._timeout = (connect_timeout_s, read_timeout_s)
        self.retry = retry or RetryPolicy()
        # One session for every thread: its connection pool is thread-safe, and with no cookie
        # kept it holds no other state that requests change. It never retries (max_retries 0).
        self._session = requests.Session()
        self._session.auth = lambda request: request  # adds nothing; stops requests reading .netrc
        self._session.cookies.set_policy(DefaultCookiePolicy(allowed_domains=[]))  # keeps none
        self._sizes: dict[str, int] = {}  # relpath -> size seen (one dict operation is atomic)
        self._settings: dict[tuple, dict] = {}  # origin -> what requests reads of the environment

    def __repr__(self) -> str:
        return f"HTTPSource({self.label!r}, token={'set' if self._token else 'none'})"

    # --- the Source calls ---------------------------------------------------------------------

    def url(self, relpath: str) -> str:
        return f"{self.base_url}/{quote(check_relpath(relpath), safe='/')}"

    def read_bytes(self, relpath: str) -> bytes:
        url = self.url(relpath)
        return self._get(_Request(url, url, relpath)).body

    def read_if_present(self, relpath: str) -> bytes | None:
        url = self.url(relpath)  # one GET, not a HEAD first
        answer = self._get(_Request(url, url, relpath, absent_ok=True))
        return None if answer is None else answer.body

    def read_range(self, relpath: str, offset: int, length: int) -> bytes:
        url = self.url(relpath)
        check_span(url, offset, length)
        if length == 0:
            return b""
        return self._get(_Request(url, f"{url} {byte_range(offset, length)}", relpath,
                                  first_last=(offset, offset + length - 1))).body

    def read_tail(self, relpath: str, length: int) -> tuple[bytes, int]:
        url = self.url(relpath)
        check_tail(url, length)
        where = f"{url} bytes -{length}"  # HTTP's suffix form: the last `length` bytes
        answer = self._get(_Request(url, where, relpath, suffix=length))
        if isinstance(answer, FallBack):
            return super().read_tail(relpath, length)  # the size from HEAD, then a range
        return answer.body, self._sizes[relpath]

    def size(self, relpath: str) -> int:
        known = self._sizes.get(relpath)
        return self._head(relpath)[0] if known is None else known

    def size_if_present(self, relpath: str) -> int | None:
        return self._head(relpath, absent_ok=True)[0]

    def identity(self, relpath: str) -> str:
        return self._head(relpath)[1]

    def close(self) -> None:
        self._session.close()

    def get_url(self, url: str) -> tuple[bytes, Mapping[str, str]]:
        """GET an absolute URL (a Hub API call), retried: its body and headers."""
        answer = self._get(_Request(url, url))
        return answer.body, answer.hops[-1].headers

    # --- one logical request: attempts until one is not a Retry -----------------------------

    def _head(self, relpath: str, absent_ok: bool = False) -> tuple[int, str] | tuple[None, None]:
        """(size, identity) from a HEAD (SPEC §8.2), the size remembered; (None, None): absent."""
        url = self.url(relpath)
        where = f"HEAD {url}"
        answer = self._get(_Request(url, where, method="HEAD", absent_ok=absent_ok))
        if answer is None:
            return None, None
        size = parse_decimal(_on_chain(answer.hops, "X-Linked-Size", "Content-Length"))
        if size is None:
            raise errors.BadRangeResponse(f"{where}: no Content-Length")
        self._sizes[relpath] = size
        return size, _identity_of(answer.hops)

    def _attempt(self, request: _Request) -> _Answer | Retry | FallBack | None:
        response, hops = self._send(request.method, request.url, request.headers(), request.where)
        with contextlib.closing(response):
            status, headers = response.status_code, response.headers
            if request.absent_ok and self._absent(status, headers):
                _let_go(response, request.method)
                return None
            self._refuse(status, headers, request.where)
            decision = judge_response(status, headers, first_last=request.first_last,
                                      suffix=request.suffix, where=request.where,
                                      known_size=self._sizes.get(request.relpath))
            if not isinstance(decision, Accept) or request.method == "HEAD":
                _let_go(response, request.method)
                return _Answer(b"", hops) if isinstance(decision, Accept) else decision
            body, broken = self._read_body(response, decision.body_bytes)
        expected, where = decision.body_bytes, request.where
        if broken or (expected is not None and len(body) < expected):
            of = "" if expected is None else f" of {expected}"
            return Retry(errors.ShortRead(f"{where}: body has {len(body)}{of} bytes{broken}"))
        if expected is not None and len(body) > expected:
            raise errors.BadRangeResponse(f"{where}: body longer than {expected} bytes")
        if request.relpath is not None:
            if decision.file_size is not None:
                self._sizes.setdefault(request.relpath, decision.file_size)
            self._check_identity(request.relpath, _identity_of(hops), where)
        if decision.answer_bytes is not None:
            body = body[decision.skip_bytes : decision.skip_bytes + decision.answer_bytes]
        return _Answer(body, hops)

    def _get(self, request: _Request) -> _Answer | FallBack | None:
        """``request`` attempted until the answer is no :class:`Retry` (SPEC §8.3)."""
        policy, number, waited_s = self.retry, 1, 0.0
        while number <= policy.max_attempts:
            try:
                outcome = self._attempt(request)
            except (requests.ConnectionError, requests.Timeout) as exc:
                outcome = Retry(errors.FetchError(f"{request.where}: {type(exc).__name__}: {exc}"))
            except requests.RequestException as exc:
                raise errors.FetchError(f"{request.where}: {type(exc).__name__}: {exc}") from exc
            if not isinstance(outcome, Retry):
                return outcome
            quota = f'quota "{outcome.quota}"' if outcome.quota else "Retry-After"
            if outcome.after_s is not None:  # at least 1 s: a server saying 0 is not a busy loop
                delay_s = max(1.0, outcome.after_s)
                if waited_s + delay_s > policy.rate_limit_wait_s:
                    raise errors.RateLimited(
                        f"{outcome.cause}: rate limited ({quota}, resets in {delay_s:.0f} s), "
                        f"past the {policy.rate_limit_wait_s:.0f} s a request may wait; raise "
                        f"{RATE_LIMIT_WAIT_ENV}") from outcome.cause
                log.warning("%s: rate limited (%s, resets in %.0f s); waiting", outcome.cause,
                            quota, delay_s)
                waited_s += delay_s
            elif number < policy.max_attempts:
                delay_s = policy.delay_s(number)
                log.warning("%s; attempt %d of %d failed, retrying in %.2f s", outcome.cause,
                            number, policy.max_attempts, delay_s)
                number += 1
            else:
                break
            time.sleep(delay_s)
        raise errors.RetriesExhausted(f"{request.where}: failed {policy.max_attempts} times; "
                                      f"last: {outcome.cause}") from outcome.cause

    def _refuse(self, status: int, headers: Mapping[str, str], where: str) -> None:
        """Raise the server's own explanation of a refused request (:class:`HubSource`'s)."""

    def _absent(self, status: int, headers: Mapping[str, str]) -> bool:
        """Whether an answer says the file does not exist (SPEC §8.2)."""
        return status in ABSENT_STATUSES

    # --- transport ----------------------------------------------------------------------------

    def _send(self, method: str, url: str, headers: dict[str, str],
              where: str) -> tuple[requests.Response, list[requests.Response]]:
        """Send, following redirects by hand (SPEC §8.2): the final response and every hop."""
        hops: list[requests.Response] = []
        for _ in range(MAX_REDIRECTS + 1):
            # identity: byte ranges and lengths must refer to the stored bytes, not a gzip of them
            sent = {"Accept-Encoding": "identity", **headers}
            if self._token and _origin(url) == self._token_origin:
                sent["Authorization"] = f"Bearer {self._token}"
            prepared = self._session.prepare_request(requests.Request(method, url, headers=sent))
            response = self._session.send(prepared, timeout=self._timeout, allow_redirects=False,
                                          **self._environment(url))
            hops.append(response)
            location = response.headers.get("Location")
            if response.status_code not in REDIRECT_STATUSES or not location:
                return response, hops
            _let_go(response, method)
            response.close()
            url = urljoin(url, location)
        raise errors.HTTPStatusError(f"{where}: more than {MAX_REDIRECTS} redirects")

    def _environment(self, url: str) -> dict:
        """The proxies (``*_PROXY``, ``NO_PROXY``), CA bundle and client certificate requests
        takes from the environment for ``url``, read once per origin: requests reads them on
        every request, a quarter of a range request's CPU. Origins are the base URL's and those
        it redirects to, a handful; past MAX_ORIGINS they are read again."""
        origin = _origin(url)
        settings = self._settings.get(origin)
        if settings is None:
            if len(self._settings) >= MAX_ORIGINS:
                self._settings.clear()
            settings = self._settings[origin] = self._session.merge_environment_settings(
                url, {}, True, None, None)  # proxies, stream, verify, cert
        return settings

    def _read_body(self, response: requests.Response, limit: int | None) -> tuple[bytes, str]:
        """The body up to ``limit + 1`` bytes, and how the connection broke (``""`` if not)."""
        body = bytearray()
        try:
            for chunk in response.iter_content(_CHUNK_BYTES):
                body += chunk
                if limit is not None and len(body) > limit:
                    break
        except (requests.RequestException, OSError) as exc:
            return bytes(body), f" (connection failed: {exc})"
        return bytes(body), ""


def _let_go(response: requests.Response, method: str) -> None:
    """Read the unwanted body of an answer (a HEAD's, a redirect's, an error's) when it is short,
    so that closing the answer keeps its connection for the next request rather than closing it:
    a new connection costs a handshake, over TLS several round trips."""
    length = parse_decimal(response.headers.get("Content-Length"))
    if method == "HEAD" or (length is not None and length <= _CHUNK_BYTES):
        with contextlib.suppress(requests.RequestException, OSError):
            response.content  # noqa: B018 - read for its effect: the connection is released


def _identity_of(hops: list[requests.Response]) -> str:
    """SPEC §8.1: the ETag of the chain, else the final Last-Modified, else ""."""
    etag = _on_chain(hops, "X-Linked-Etag", "ETag")
    if etag:
        return f"etag:{etag}"
    modified = hops[-1].headers.get("Last-Modified")
    return f"last-modified:{modified}" if modified else ""


def _on_chain(hops: list[requests.Response], linked: str, final: str) -> str | None:
    for hop in hops:
        if hop.headers.get(linked):
            return hop.headers[linked]
    return hops[-1].headers.get(final)
