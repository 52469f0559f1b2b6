"""Blocking reads of local files and fsspec URLs (whole, or a byte range), run on a
thread by the Fetcher; a local path must be a regular file.
"""

from __future__ import annotations

import os
import stat
from typing import Any

from ..errors import FetchError

__all__ = ["NotRegular", "open_fsspec", "open_local", "read_at_most", "read_blocking"]


def read_blocking(
    name: str, offset: int | None, length: int | None, opener: Any, remote: bool, cap: int
) -> bytes:
    """All of `name`, or `length` bytes at `offset`, read through ``opener(name)``; at
    most `cap` + 1 bytes are read (the caller refuses more than `cap`), so a huge file or
    an endless one is never held whole.

    A remote store's errors and short reads are retried (they may be transient,
    and fsspec backends raise their own error types); a local file's are not.
    """
    if length is not None and length > cap:
        raise FetchError(name, f"a record of {length} bytes exceeds max_item_bytes={cap}")
    try:
        with opener(name) as f:
            if offset is None:
                return read_at_most(f, cap)
            f.seek(offset)
            data = f.read(length)
    except FileNotFoundError:
        raise FetchError(name, "no such file", missing=True) from None
    except IsADirectoryError:
        raise FetchError(name, "is a directory") from None
    except NotRegular:
        raise FetchError(name, "not a regular file (a FIFO or a device)") from None
    except Exception as err:
        if not (remote or isinstance(err, OSError)):
            raise  # a local read fails with OSError; anything else is a bug to see
        raise FetchError(name, f"{type(err).__name__}: {err}", remote) from None
    if len(data) != length:
        raise FetchError(
            name, f"short read: {len(data)} of {length} bytes at offset {offset}", remote
        )
    return data


def read_at_most(f: Any, cap: int) -> bytes:
    """The rest of file `f`, but no more than ``cap + 1`` bytes (the caller refuses more
    than `cap`). ``f.read(cap + 1)`` would do, but CPython allocates the whole ``cap + 1``
    up front for it: 1 GiB per item (max_item_bytes), 4 GiB per part. The file's size
    says how much to ask for; a file that grew past it is read on in bounded steps."""
    try:
        size = os.fstat(f.fileno()).st_size
    except (AttributeError, OSError, ValueError):  # (not an OS file: its read is bounded)
        return f.read(cap + 1)
    want = min(size, cap) + 1
    data = f.read(want)
    if len(data) < want or len(data) > cap:
        return data
    chunks, total = [data], len(data)
    while total <= cap:
        chunk = f.read(min(1 << 20, cap + 1 - total))
        if not chunk:
            break
        chunks.append(chunk)
        total += len(chunk)
    return b"".join(chunks)


def open_local(path: str) -> Any:
    """A local item, if it is a regular file: a FIFO would block the fetch loop (opened
    without blocking, to be looked at), a device such as /dev/zero never ends."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise IsADirectoryError if stat.S_ISDIR(os.fstat(fd).st_mode) else NotRegular
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


class NotRegular(OSError):
    """A local item that is not a regular file (a FIFO, a device, a socket)."""


def open_fsspec(url: str) -> Any:
    import fsspec

    return fsspec.open(url, "rb")
