"""A dataset root to its byte source (SPEC §8.1), above the three kinds of source."""

from __future__ import annotations

import os
import re
from pathlib import Path
from urllib.parse import unquote, urlsplit

from refstream.errors import UsageError
from refstream.http import HTTPSource
from refstream.hub import open_hf_source
from refstream.source import LocalSource, Source

__all__ = ["open_source"]

# A Hub repository id as people type it: OWNER/NAME of letters, digits, '-', '_' and '.'.
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def open_source(root: str | Path, **http_options) -> Source:
    """The source for a dataset root (``~`` expanded in a folder); ``http_options`` (timeouts,
    ``retry``, …) are :class:`refstream.http.HTTPSource` arguments, which a local root ignores."""
    text = str(root)
    if text.startswith("hf://"):
        return open_hf_source(text, **http_options)
    if text.startswith(("http://", "https://")):
        return HTTPSource(text, **http_options)
    if text.startswith("file://"):
        text = unquote(urlsplit(text).path)
    elif "://" in text:
        raise UsageError(f"{text!r}: unsupported root (folder, file://, http(s)://, hf://)")
    folder = os.path.expanduser(text)
    if not os.path.isdir(folder):
        where = f" ({folder})" if folder != text else ""
        hub = (f"; a dataset on the Hugging Face Hub is written hf://datasets/{text}"
               if _REPO_ID.fullmatch(text) else "")
        raise UsageError(f"{text!r}: no such folder{where}{hub}")
    return LocalSource(folder)
