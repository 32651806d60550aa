"""The Hugging Face Hub's additions to HTTP sources: ``hf://`` roots and revision pinning
(SPEC §8.4), and content identities from the tree listing (SPEC §10.1).

Usage::

    source = open_hf_source("hf://datasets/lerobot/pusht@v1.0")  # a HubSource on one commit
    hf = parse_hf_root(root)            # the one hf:// parser; hf.base_url(endpoint, commit)
    pinned_root(root, source.identity(relpath))   # the root @ the commit the source reads

A branch or tag is pinned once, at open, to its commit: DataLoader workers open the
:func:`pinned_root`, so every file a run reads comes from that commit. The endpoint
(:func:`hub_endpoint`) and the token (``HF_TOKEN`` by default) are SPEC §8.4's.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import quote, unquote, urljoin

import requests

from refstream.errors import FetchError, MalformedDataset, UsageError
from refstream.http import HTTPSource
from refstream.meta import check_relpath

__all__ = ["hub_endpoint", "open_hf_source", "parse_hf_root", "pinned_root"]

HF_DEFAULT_ENDPOINT = "https://huggingface.co"
_COMMIT = re.compile(r"[0-9a-f]{40}")
_NEXT_PAGE = re.compile(r'<([^>]+)>\s*;\s*rel="?next"?')  # in a Link header
# What a remembered redirect target answers once its signature expired (S3/CloudFront: 403).
_EXPIRED_TARGET_STATUSES = frozenset({401, 403, 404, 410})


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
        raise UsageError(f"{root!r}: expected hf://datasets/OWNER/NAME[@REV] "
                         "or hf://buckets/OWNER/NAME")
    owner, name, prefix = parts[0], parts[1], "/".join(parts[2:]).strip("/")
    if prefix:
        check_relpath(prefix)
    name, at, revision = name.partition("@")
    if kind == "buckets" and at:
        raise UsageError(f"{root!r}: buckets have no revisions")
    if not name or (at and not revision):
        raise UsageError(f"{root!r}: empty repository name or revision")
    return HfRoot(kind=kind, owner=owner, name=name, prefix=prefix,
                  revision=None if kind == "buckets" else unquote(revision or "main"))


def pinned_root(root: str, identity: str) -> str:
    """``hf://datasets/OWNER/NAME[@REV][/PREFIX]`` with ``REV`` replaced by the commit of
    ``identity`` (``commit:<sha>``); any other root or identity leaves ``root`` unchanged."""
    if not root.startswith("hf://datasets/") or not identity.startswith("commit:"):
        return root
    hf = parse_hf_root(root)
    prefix = f"/{hf.prefix}" if hf.prefix else ""
    return f"hf://datasets/{hf.owner}/{hf.name}@{identity.removeprefix('commit:')}{prefix}"


def hub_endpoint(endpoint: str | None = None) -> str:
    """``endpoint``, else ``$HF_ENDPOINT``, else the public Hub; without a trailing ``/``."""
    return (endpoint or os.environ.get("HF_ENDPOINT") or HF_DEFAULT_ENDPOINT).rstrip("/")


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
        with contextlib.closing(HTTPSource(endpoint, **options)) as api:
            body = api.get_url(api_url)[0]
        try:
            commit = json.loads(body)["sha"]
        except (ValueError, KeyError, TypeError):
            commit = None
        if not isinstance(commit, str) or not _COMMIT.fullmatch(commit):
            raise FetchError(f"{root}: the Hub gave no commit for revision {hf.revision!r}")
    options["label"] = pinned_root(root, f"commit:{commit}")
    return HubSource(hf, endpoint, commit, **options)


class HubSource(HTTPSource):
    """An :class:`HTTPSource` on one commit of a Hub dataset: the commit is every file's identity,
    the tree listing gives content identities, and redirect targets are remembered (SPEC §8.2)."""

    def __init__(self, hf: HfRoot, endpoint: str, commit: str, **options) -> None:
        super().__init__(hf.base_url(endpoint, commit), **options)
        self._commit = commit
        self._tree_url = f"{endpoint}/api/datasets/{hf.owner}/{hf.name}/tree/{commit}"
        self._prefix = f"{hf.prefix}/" if hf.prefix else ""
        self._targets: dict[str, str] = {}  # url -> redirect target (one dict operation is atomic)

    def identity(self, relpath: str) -> str:
        check_relpath(relpath)
        return f"commit:{self._commit}"

    def expect_identity(self, relpath: str, identity: str) -> None:
        """Nothing to check: every read names the commit, and a commit's files never change."""

    def content_identities(self, relpaths: Iterable[str]) -> dict[str, tuple[int, str]]:
        """``relpath -> (size, "sha256:<LFS oid>")`` (``"git-sha1:<oid>"`` for a file outside
        LFS) from the listing of each top folder of ``relpaths``, one request per page."""
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
            raise MalformedDataset(f"{missing[0]}: missing from dataset root {self.label}")
        return {relpath: found[relpath] for relpath in sorted(wanted)}

    def _send(self, method: str, url: str, headers: dict[str, str],
              where: str) -> tuple[requests.Response, list[requests.Response]]:
        """Straight to the remembered target of ``url``'s redirects, while it answers."""
        target = self._targets.get(url)
        if target is not None:
            response, hops = super()._send(method, target, headers, where)
            if response.status_code not in _EXPIRED_TARGET_STATUSES:
                return response, hops
            response.close()
            self._targets.pop(url, None)
        response, hops = super()._send(method, url, headers, where)
        if len(hops) > 1 and response.ok:
            self._targets[url] = response.url
        return response, hops

    def _listed(self, url: str, body: bytes) -> dict[str, tuple[int, str]]:
        """The files of one page of a tree listing, by relpath."""
        try:
            files = {}
            for entry in json.loads(body):
                if entry["type"] == "file" and entry["path"].startswith(self._prefix):
                    lfs = entry.get("lfs")
                    identity = f"sha256:{lfs['oid']}" if lfs else f"git-sha1:{entry['oid']}"
                    files[entry["path"].removeprefix(self._prefix)] = (int(entry["size"]),
                                                                       identity)
            return files
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise FetchError(f"{url}: not a tree listing ({type(exc).__name__}: {exc})") from exc

