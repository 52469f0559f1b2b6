"""Whole files read once: index, meta and ``.pt`` files (:func:`read_bytes`), with the
Fetcher's policy for remote ones and a plain read for local ones.
"""

from __future__ import annotations

import os
import stat
from typing import Any

from ..errors import FetchError, IndexNotFound
from . import sources as src
from .fetcher import Fetcher

__all__ = ["read_bytes"]


def _read_local(location: str, path: str) -> bytes:
    """A local regular file's bytes. Anything else is refused before a byte is read: a
    FIFO would block (it is opened without blocking, to be looked at), a character
    device such as ``/dev/zero`` would be read until memory runs out."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise FetchError(location, "no such file", missing=True) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):  # (a folder opens too, read-only)
        os.close(fd)
        raise FetchError(location, "not a regular file")
    with os.fdopen(fd, "rb") as f:
        return f.read()


def read_bytes(
    location: str,
    missing_ok: bool = False,
    cache: Any = None,
    fetcher: Fetcher | None = None,
    **policy: Any,
) -> bytes | None:
    """Read a whole file (an index, a meta file, a .pt) with the fetch policy.

    Plain paths and ``file://`` are opened directly; anything else goes
    through a :class:`Fetcher` (`fetcher`, or one made from `policy` for this
    read), so it is retried like an item. A missing file raises
    :class:`IndexNotFound` (a ``FileNotFoundError``) naming it, or gives None
    with ``missing_ok``; any other failure is a :class:`FetchError` naming the
    URL. With a :class:`dataset.fetch.cache.Cache`, a remote file is read from it
    when present and kept in it once read (local files are never copied).

    An optional file (``missing_ok``: a meta file) found absent is remembered as
    absent only for when the store cannot be reached: while it can, it is asked
    again, so a 404 that passes (a server starting, a CDN's hiccup) is not kept
    for ever, and a file added later is found.
    """
    path = src.local_path(location)
    if cache is not None and path is None:
        data = cache.get(location)
        if data is None:
            absent = (location, "absent")
            try:
                data = read_bytes(location, missing_ok, None, fetcher, **policy)
            except FetchError:
                # the store is out of reach: a cached index opens all the same, with
                # the meta file as it was last seen (absent)
                if missing_ok and cache.get(absent) is not None:
                    return None
                raise
            cache.put(absent if data is None else location, b"" if data is None else data)
        return data
    try:
        if path is not None:
            return _read_local(location, path)
        if fetcher is not None:
            return fetcher.read(location)
        with Fetcher(pool_size=1, **policy) as own:
            return own.read(location)
    except FetchError as err:
        if not err.missing:
            raise
        if missing_ok:
            return None
        raise IndexNotFound(str(err)) from None
