"""Where item bytes live: URL helpers shared by indexes and the fetcher.

A *source* is what the fetcher needs to get one item's bytes, kept compact and
picklable because it travels to process workers once per item:

- ``str``: a URL (``http(s)://``, ``file://``, any fsspec scheme) or a local path;
- ``(url, offset, length)``: a byte range inside a larger file (HTTP Range or seek);
- ``bytes`` / ``torch.Tensor``: the payload itself, already in memory (tensor
  rows, records read from part files): nothing to fetch.
"""

from __future__ import annotations

import os
import urllib.parse

__all__ = [
    "Joined",
    "Source",
    "add_params",
    "check_scheme",
    "is_http",
    "is_url",
    "join_prefix",
    "local_path",
    "parent_of",
    "query_string",
    "resolve",
    "scheme",
]

Source = "str | tuple[str, int, int] | bytes | torch.Tensor"


class Joined(tuple):
    """The sources of one item of a list of indexes (one per index), fetched together."""

    __slots__ = ()


def is_url(name: str) -> bool:
    """True for ``scheme://...`` names (``file://`` included), False for plain paths."""
    return "://" in name[:64]


def is_http(name: str) -> bool:
    return name.startswith(("http://", "https://"))


def local_path(name: str) -> str | None:
    """The local file path for a plain path or ``file://`` URL, else None."""
    if name.startswith("file://"):
        return urllib.parse.unquote(urllib.parse.urlparse(name).path)
    if not is_url(name):
        return name
    return None


def parent_of(location: str) -> str:
    """The folder that holds `location` (a path or URL), with a trailing separator."""
    path = local_path(location)
    if path is not None and not location.startswith("file://"):
        return os.path.dirname(os.path.abspath(path)) + os.sep
    return location.rsplit("/", 1)[0] + "/"


def resolve(base: str, name: str) -> str:
    """`name` relative to the folder `base` (from :func:`parent_of`); absolute names unchanged.

    Against an http(s) base, names resolve as a browser would (``urljoin``): a
    leading ``/`` is the root of the base's host, not a local path.
    """
    if is_url(name):
        return name
    if is_http(base):
        name = _http_path(name)
        # Index rows are nearly always plain relative paths, which join by
        # concatenation; urljoin costs ~40 us a row (0.9 s for 20,000) and was
        # most of the time to the first batch. Dot segments take the full path.
        if not name.startswith(("/", ".")) and "/." not in name:
            return base + name
        return urllib.parse.urljoin(base, name)
    if os.path.isabs(name):
        return name
    if is_url(base):  # file://, s3://, gs://...: plain string join, as fsspec expects
        return base + name.lstrip("/")
    return os.path.normpath(os.path.join(base, name))


def join_prefix(prefix: str, name: str) -> str:
    """An ``index-meta.csv`` URL prefix joined to a relative filename, one slash between."""
    if is_url(name) or not prefix:
        return name
    if is_http(prefix):
        name = _http_path(name)
    return prefix.rstrip("/") + "/" + name.lstrip("/")


def _http_path(name: str) -> str:
    """A file name as part of an http(s) URL: a '#' in it would start the fragment, which
    is never sent (``img#1.png`` fetched ``img``). A '?' stays a query, as torch-dataset's
    prefix + name made it (rows such as ``key.jpg?sig=...``)."""
    return name.replace("#", "%23") if "#" in name else name


def query_string(params: str | dict | None) -> str:
    """``url_params`` as a query string: a string as given, a dict with sorted keys.

    As torch-dataset wrote it: ``{"b": 2, "a": 1, "d": True}`` is ``a=1&b=2&d=true``
    (sorted keys, lower-case booleans), values URL-encoded.
    """
    if not params:
        return ""
    if isinstance(params, dict):
        items = []
        for key in sorted(params, key=str):
            value = params[key]
            items.append((str(key), str(value).lower() if isinstance(value, bool) else str(value)))
        return urllib.parse.urlencode(items)
    return params.lstrip("?&")


def add_params(url: str, query: str) -> str:
    """Append a query string (from :func:`query_string`) to an http(s) URL."""
    if not query:
        return url
    return url + ("&" if "?" in url else "?") + query


def scheme(location: str) -> str:
    """The scheme of a URL (``"http"``, ``"s3"``...), ``"file"`` for local paths."""
    if not is_url(location):
        return "file"
    name = location.split("://", 1)[0].lower()
    return "http" if name == "https" else name


def check_scheme(index: str, item: str, allow: frozenset[str]) -> str | None:
    """Why `item` may not be read for a remote `index`, or None when it may.

    An index read from a store may only name items on stores of its own kind:
    an http(s) index names http(s) items, an s3:// index s3:// items. So an
    index served by someone else cannot send the trainer to read its local
    files (``file://``, ``/etc/...``) or another store with its credentials.
    A local index may name anything. Schemes in `allow` are always accepted.
    """
    home = scheme(index)
    if home == "file":
        return None
    there = scheme(item)
    if there == home or there in allow:
        return None
    what = "a local path" if there == "file" else f"a {there}:// URL"
    return (
        f"names {item!r}, {what}, but the index was read from {home}://; an index may "
        f"only name items on its own kind of store (allow_schemes=[{there!r}] allows it)"
    )
