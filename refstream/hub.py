"""The Hugging Face Hub's additions to HTTP sources: ``hf://`` roots, revision pinning, shared
redirect targets and the Hub's refusals (SPEC §8.4), content identities from the listing (§10.1).

Usage::

    source = open_hf_source("hf://datasets/lerobot/pusht@v1.0")  # a HubSource on one commit
    hf = parse_hf_root(root)            # the one hf:// parser; hf.base_url(endpoint, commit)
    pinned_root(root, source.identity(relpath))   # the root @ the commit the source reads

A branch or tag is pinned once, at open, to its commit: DataLoader workers open the
:func:`pinned_root`, so every file a run reads comes from that commit.
"""

from __future__ import annotations

import calendar
import contextlib
import fcntl
import hashlib
import os
import re
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from urllib.parse import parse_qsl, quote, unquote, urljoin, urlsplit

import requests

from refstream import errors
from refstream.http import HTTPSource, parse_decimal
from refstream.meta import parse_json
from refstream.sidecar import default_cache_root, install
from refstream.source import check_relpath

__all__ = ["hub_endpoint", "open_hf_source", "parse_hf_root", "pinned_root", "target_expiry",
           "resolve_again"]

_COMMIT = re.compile(r"[0-9a-f]{40}")
_NEXT_PAGE = re.compile(r'<([^>]+)>\s*;\s*rel="?next"?')  # in a Link header
# What a remembered redirect target answers once its signature expired (S3/CloudFront: 403).
_EXPIRED_TARGET_STATUSES = frozenset({401, 403, 404, 410})
_AMZ_DATE = re.compile(r"[0-9]{8}T[0-9]{6}Z")  # S3's signing time, 20260101T000000Z
TARGET_LIFETIME_S = 3600.0  # of a target whose URL states no expiry
TARGET_MARGIN_S = 60.0  # a target is resolved again this long before it expires


@dataclass(frozen=True)
class HfRoot:
    """A parsed ``hf://KIND/OWNER/NAME[@REV][/PREFIX]`` root."""

    kind: str  # "datasets" or "buckets"
    owner: str
    name: str
    revision: str | None  # datasets: branch, tag or commit, percent-decoded; buckets: None
    prefix: str  # a folder inside the repository, "" for its top

    def revision_api_url(self, endpoint: str) -> str | None:
        """Where the commit of a branch or tag is asked; None when there is nothing to pin."""
        if self.revision is None or _COMMIT.fullmatch(self.revision):
            return None
        rev = quote(self.revision, safe="")
        return f"{endpoint}/api/datasets/{self.owner}/{self.name}/revision/{rev}"

    def base_url(self, endpoint: str, commit: str | None) -> str:
        """The URL that relative paths are appended to (``commit`` for datasets only)."""
        pinned = f"/{commit}" if self.kind == "datasets" else ""
        prefix = f"/{quote(self.prefix, safe='/')}" if self.prefix else ""
        return f"{endpoint}/{self.kind}/{self.owner}/{self.name}/resolve{pinned}{prefix}"


def parse_hf_root(root: str) -> HfRoot:
    """The parts of an ``hf://`` root (SPEC §8.4)."""
    kind, _, rest = root.removeprefix("hf://").partition("/")
    parts = rest.split("/")
    if not root.startswith("hf://") or kind not in ("datasets", "buckets") or len(parts) < 2 \
            or not all(parts[:2]):
        raise errors.UsageError(f"{root!r}: expected hf://datasets/OWNER/NAME[@REV] "
                                "or hf://buckets/OWNER/NAME")
    owner, name, prefix = parts[0], parts[1], "/".join(parts[2:]).strip("/")
    if prefix:
        check_relpath(prefix)
    name, at, revision = name.partition("@")
    if kind == "buckets" and at:
        raise errors.UsageError(f"{root!r}: buckets have no revisions")
    if not name or (at and not revision):
        raise errors.UsageError(f"{root!r}: empty repository name or revision")
    return HfRoot(kind=kind, owner=owner, name=name, prefix=prefix,
                  revision=None if kind == "buckets" else unquote(revision or "main"))


def pinned_root(root: str, identity: str) -> str:
    """An ``hf://datasets`` root on the commit of ``identity`` (``commit:<sha>``), else ``root``."""
    if not root.startswith("hf://datasets/") or not identity.startswith("commit:"):
        return root
    hf = parse_hf_root(root)
    prefix = f"/{hf.prefix}" if hf.prefix else ""
    return f"hf://datasets/{hf.owner}/{hf.name}@{identity.removeprefix('commit:')}{prefix}"


def target_expiry(target: str, issued: float) -> float:
    """When a redirect target resolved at ``issued`` expires (unix seconds, SPEC §8.4)."""
    query = dict(parse_qsl(urlsplit(target).query))
    signed, lifetime = query.get("X-Amz-Date", ""), parse_decimal(query.get("X-Amz-Expires"))
    if _AMZ_DATE.fullmatch(signed) and lifetime is not None:
        return calendar.timegm(time.strptime(signed, "%Y%m%dT%H%M%SZ")) + float(lifetime)
    expires = parse_decimal(query.get("Expires"))
    return float(expires) if expires is not None else issued + TARGET_LIFETIME_S


def resolve_again(expiry: float, now: float) -> bool:
    """Whether a target expiring at ``expiry`` is resolved again at ``now`` (SPEC §8.4)."""
    return now >= expiry - TARGET_MARGIN_S


def hub_endpoint(endpoint: str | None = None) -> str:
    """``endpoint``, else ``$HF_ENDPOINT``, else the public Hub; without a trailing ``/``."""
    return (endpoint or os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")


def open_hf_source(root: str, *, endpoint: str | None = None, token: str | None = None,
                   **http_options) -> HTTPSource:
    """The source of an ``hf://`` root; ``http_options`` are :class:`HTTPSource` arguments."""
    endpoint = hub_endpoint(endpoint)
    token = token if token is not None else os.environ.get("HF_TOKEN") or None
    hf = parse_hf_root(root)
    options = dict(token=token, label=root, **http_options)
    if hf.kind == "buckets":
        return HTTPSource(hf.base_url(endpoint, None), **options)
    commit = hf.revision
    api_url = hf.revision_api_url(endpoint)
    if api_url is not None:
        with contextlib.closing(HubSource(hf, endpoint, hf.revision, **options)) as api:
            answer = parse_json(api.get_url(api_url)[0], api_url, error=errors.FetchError)
        commit = answer.get("sha") if isinstance(answer, dict) else None
        if not isinstance(commit, str) or not _COMMIT.fullmatch(commit):
            raise errors.FetchError(f"{root}: the Hub gave no commit for revision {hf.revision!r}")
    options["label"] = pinned_root(root, f"commit:{commit}")
    return HubSource(hf, endpoint, commit, **options)


class HubSource(HTTPSource):
    """An :class:`HTTPSource` on one commit of a Hub dataset (module docstring)."""

    def __init__(self, hf: HfRoot, endpoint: str, commit: str, **options) -> None:
        super().__init__(hf.base_url(endpoint, commit), **options)
        self._commit = commit
        self._repo = f"{hf.owner}/{hf.name}"
        self._tree_url = f"{endpoint}/api/datasets/{self._repo}/tree/{commit}"
        self._prefix = f"{hf.prefix}/" if hf.prefix else ""
        # url -> (target, expiry) and url -> the lock its resolve holds (dict operations are atomic)
        self._targets: dict[str, tuple[str, float]] = {}
        self._resolving: dict[str, threading.Lock] = {}
        self._shared = default_cache_root() / "hub-targets"

    def identity(self, relpath: str) -> str:
        check_relpath(relpath)
        return f"commit:{self._commit}"

    def expect_identity(self, relpath: str, identity: str) -> None:
        """Nothing to check: every read names the commit, and a commit's files never change."""

    def content_identities(self, relpaths: Iterable[str]) -> dict[str, tuple[int, str]]:
        """``relpath -> (size, content identity)`` from the commit's tree listing (SPEC §10.1)."""
        wanted, found = set(relpaths), {}
        for folder in sorted({relpath.rpartition("/")[0].split("/")[0] for relpath in wanted}):
            path = quote((self._prefix + folder).rstrip("/"), safe="/")
            url = f"{self._tree_url}{'/' if path else ''}{path}?recursive=true"
            while url:  # one page, then the next one its Link header names
                body, headers = self.get_url(url)
                found.update(self._listed(url, body))
                after = _NEXT_PAGE.search(headers.get("Link", ""))
                url = urljoin(url, after[1]) if after else None
        missing = sorted(wanted - set(found))
        if missing:
            raise errors.MalformedDataset(f"{missing[0]}: missing from dataset root {self.label}")
        return {relpath: found[relpath] for relpath in sorted(wanted)}

    def _send(self, method: str, url: str, headers: dict[str, str],
              where: str) -> tuple[requests.Response, list[requests.Response]]:
        """To ``url``'s live redirect target, else through one resolve at a time (SPEC §8.4)."""
        if "/resolve/" not in url:  # an API call: answered, not redirected
            return super()._send(method, url, headers, where)
        target = self._live_target(url)
        if target is not None:
            response, hops = super()._send(method, target, headers, where)
            if response.status_code not in _EXPIRED_TARGET_STATUSES:
                return response, hops
            response.close()
            self._targets.pop(url, None)
            self._shared_path(url).unlink(missing_ok=True)
        with self._one_resolve(url):
            target = self._live_target(url)  # another thread or process resolved it meanwhile
            if target is None:
                response, hops = super()._send(method, url, headers, where)
                if len(hops) > 1 and response.ok:
                    self._targets[url] = response.url, target_expiry(response.url, time.time())
                    text = "{1}\n{0}".format(*self._targets[url]).encode()
                    with contextlib.suppress(OSError):  # sharing saves resolves; it is optional
                        install(self._shared_path(url), lambda out: out.write(text))
                return response, hops
        return super()._send(method, target, headers, where)

    @contextlib.contextmanager
    def _one_resolve(self, url: str) -> Iterator[None]:
        """Held by the one thread, and (by a ``flock`` when it can) the one process resolving."""
        with self._resolving.setdefault(url, threading.Lock()), contextlib.ExitStack() as held:
            with contextlib.suppress(OSError):
                self._shared.mkdir(mode=0o700, parents=True, exist_ok=True)
                fcntl.flock(held.enter_context(open(f"{self._shared_path(url)}.lock", "a")),
                            fcntl.LOCK_EX)
            yield

    def _live_target(self, url: str) -> str | None:
        """``url``'s target that needs no resolve yet, from memory or the cache folder."""
        known = self._targets.get(url)
        if known is None or resolve_again(known[1], time.time()):
            with contextlib.suppress(OSError, ValueError):
                expiry, _, target = self._shared_path(url).read_text().partition("\n")
                known = self._targets[url] = target, float(expiry)
        return None if known is None or resolve_again(known[1], time.time()) else known[0]

    def _shared_path(self, url: str):
        return self._shared / hashlib.sha256(url.encode()).hexdigest()[:32]

    def _absent(self, status: int, headers: Mapping[str, str]) -> bool:
        """A missing file, not a missing repository or revision (SPEC §8.4, *Refusals*)."""
        code = headers.get("X-Error-Code", "EntryNotFound")
        return super()._absent(status, headers) and code == "EntryNotFound"

    def _refuse(self, status: int, headers: Mapping[str, str], where: str) -> None:
        """The Hub's error for a refused request (SPEC §8.4, *Refusals*); a CDN gives none."""
        code, text = headers.get("X-Error-Code", ""), headers.get("X-Error-Message", "")
        repo, said = f"{where}: dataset {self._repo}", f"HTTP {status}: {text or code}"
        if status not in (401, 403, 404) or not (code or text):
            return
        if "credentials" in text:
            raise errors.HubAuthError(f"{repo}: the Hub refused the token ({said}); set HF_TOKEN "
                                      "to a valid token")
        if code == "RevisionNotFound":
            raise errors.HubRevisionNotFound(f"{repo} has no revision {self._commit!r}")
        if code == "EntryNotFound":
            raise errors.MalformedDataset(f"{repo} has no such file at revision {self._commit}")
        if code not in ("RepoNotFound", "GatedRepo") and status != 401:
            return
        if not self._token:
            raise errors.HubAuthError(f"{repo} is private, gated or absent, and no token was "
                                      "given: set HF_TOKEN to a token that can read it")
        if code == "GatedRepo":
            raise errors.HubAuthError(f"{repo} is gated: accept its conditions on its Hub page")
        raise errors.HubRepoNotFound(f"{repo} does not exist, or the token cannot read it ({said})")

    def _listed(self, url: str, body: bytes) -> dict[str, tuple[int, str]]:
        """The files of one page of a tree listing, by relpath."""
        entries, files = parse_json(body, url, error=errors.FetchError), {}
        for entry in entries if isinstance(entries, list) else [entries]:
            if not (isinstance(entries, list) and isinstance(entry, dict)
                    and isinstance(entry.get("path"), str)):
                raise errors.FetchError(f"{url}: not a tree listing (entry {entry!r})")
            if entry.get("type") != "file" or not entry["path"].startswith(self._prefix):
                continue
            lfs = entry.get("lfs") or entry  # an LFS file's oid is its content's sha256
            oid = lfs.get("oid") if isinstance(lfs, dict) else None
            if not isinstance(oid, str) or not errors.is_int(entry.get("size"), 0):
                raise errors.FetchError(f"{url}: not a tree listing (file {entry!r})")
            kind = "git-sha1" if lfs is entry else "sha256"
            files[entry["path"].removeprefix(self._prefix)] = (entry["size"], f"{kind}:{oid}")
        return files
