"""The contract every CSV reader keeps: what it is given (:class:`Source`), what it gives
back (:class:`Rows`), and the column rules they share (:class:`Columns`).

A reader reads the whole file or declines it (None): it never gives a partial or
approximate result. Every reader that takes a file gives the same :class:`Rows` for
it as the csv module's reader (``csv.reader(strict=True)``, fields stripped as
``str.strip`` strips them, blank lines left out), and only that reader names faults:
a faulty file is declined by the fast readers, and the csv module raises
:class:`~dataset.errors.BadIndex` naming the first faulty line, as written.
``tests/test_csvarrow.py`` and ``tests/test_csvlines.py`` hold every reader to it on
generated, mutated and torch-dataset's files.
"""

from __future__ import annotations

import logging
import mmap
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...errors import BadIndex, IndexNotFound
from ...fetch import sources as src
from ...fetch.fetcher import Fetcher
from ...fetch.files import read_bytes
from ..rows import NameRows, Resolver, small_int

__all__ = ["Buffer", "Columns", "Rows", "Source", "packed_labels"]

log = logging.getLogger("distlearn.dataset.index")

# A whole file's bytes: read, or mapped.
Buffer = bytes | mmap.mmap


@dataclass
class Rows:
    """What a reader makes of a file: the rows after the header, blank lines left out.

    Attributes:
        table: The rows' names (and offset/length ranges) as
            :class:`~dataset.index.rows.NameRows`.
        ptr: Row r's labels are ``ids[ptr[r]:ptr[r + 1]]``; None: one label a row,
            ``ids[r]``.
        ids: Label ids, into `labels` (a label repeated in a row may repeat here:
            :func:`dataset.index.table.labelled` keeps it once).
        labels: The distinct labels, as :func:`dataset.index.table.sort_labels` orders them.
        line_of: The 1-based line of the file on which row r starts (for messages).
        descents: The rows r whose name is greater than row r + 1's, where the reader
            found them all (a file in order then costs no sort); None: not known.
        reader: The name of the reader that gave it (set by the selector).
    """

    table: NameRows
    ptr: np.ndarray | None
    ids: np.ndarray
    labels: list[str]
    line_of: Callable[[int], int]
    descents: np.ndarray | None = None
    reader: str = ""


class Source:
    """A CSV file, as every reader is given it.

    Attributes:
        index: Its path or URL, as the user named it (for messages).
        sep: The field separator.
        resolver: What a name resolves against (the meta file's URL prefix, or the
            index's folder).
        path: The local file's path where the index is one (readers may read it in
            blocks, or map it), else None.
    """

    def __init__(self, index: str, sep: str, path: str | None, resolver: Resolver | None = None,
                 cache: Any = None, fetcher: Fetcher | None = None):  # fmt: skip
        self.index, self.sep, self.path = index, sep, path
        self.resolver = resolver or Resolver(src.parent_of(index), "", "")
        self._cache, self._fetcher = cache, fetcher
        self._data: bytes | None = None

    def data(self) -> bytes:
        """The file's bytes (read once), checked to be UTF-8.

        Raises:
            IndexNotFound: There is no such file.
            BadIndex: The bytes are not UTF-8 (the line of the first bad byte named).
        """
        if self._data is None:
            try:
                data = read_bytes(self.index, cache=self._cache, fetcher=self._fetcher)
            except IndexNotFound as err:
                raise IndexNotFound(f"index not found: {err}") from None
            assert data is not None
            if not data.isascii():
                try:
                    data.decode("utf-8")
                except UnicodeDecodeError as err:
                    line = data.count(b"\n", 0, err.start) + 1  # where to look, not an offset
                    raise BadIndex(f"{self.index}:{line}: not UTF-8 text ({err})") from err
            self._data = data
        return self._data

    def pages(self, populate: bool = False) -> mmap.mmap | None:
        """The local file's pages, mapped read-only (read in at once with `populate`), or
        None: no local file, an empty one, or one that cannot be mapped (the bytes'
        read names the fault). Nothing keeps them: a file cut short while they are read
        is a SIGBUS, as for any mapped file, so a reader copies what it keeps."""
        if self.path is None:
            return None
        flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
        try:
            with open(self.path, "rb") as f:
                return mmap.mmap(f.fileno(), 0, flags=flags, prot=mmap.PROT_READ)
        except (OSError, ValueError):  # (an empty file cannot be mapped)
            return None

    def head(self, size: int) -> bytes:
        """The first `size` bytes (b"" where they cannot be read: the bytes' read says why)."""
        if self.path is None:
            return self.data()[:size]
        try:
            with open(self.path, "rb") as f:
                return f.read(size)
        except OSError:
            return b""

    def size(self) -> int | None:
        """The local file's size, or None."""
        try:
            return os.stat(self.path).st_size if self.path is not None else None
        except OSError:
            return None


class Columns:
    """Where the known columns of a CSV header are; unknown ones are logged and ignored.

    Args:
        header: The header's values, stripped.
        where: The index, for messages.

    Raises:
        BadIndex: No ``filename`` column, one named twice, ``offset`` without ``length``.
    """

    def __init__(self, header: list[str], where: str):
        self.header = header
        self.file: int | None = None
        self.offset: int | None = None
        self.length: int | None = None
        self.labels: list[int] = []
        for pos, name in enumerate(header):
            if name in ("filename", "offset", "length"):
                if getattr(self, "file" if name == "filename" else name) is not None:
                    raise BadIndex(f"{where}:1: more than one {name!r} column")
                setattr(self, "file" if name == "filename" else name, pos)
            elif name.startswith("label"):
                self.labels.append(pos)
            else:
                log.warning("%s:1: unknown column %r (ignored)", where, name)
        if self.file is None:
            raise BadIndex(f"{where}:1: no 'filename' column in header {header}")
        if (self.offset is None) != (self.length is None):
            raise BadIndex(f"{where}:1: 'offset' and 'length' columns go together")
        # a row must reach every column it cannot do without; labels may be left out
        self.needed = 1 + max(p for p in (self.file, self.offset, self.length) if p is not None)


def packed_labels(ids: np.ndarray, names: list[str], missing: bool | None = None):
    """``(ptr, ids, names)`` for :class:`Rows` from each row's label ids.

    Args:
        ids: ``(rows,)`` for one label column or ``(rows, columns)`` (none: no label
            column), -1 for no label there.
        names: The labels the ids index.
        missing: Whether one label column has a -1 (None: look).

    Returns:
        ``ptr`` None where every row has one label; a label repeated in a row kept once.
    """
    n, width = len(ids), 1 if ids.ndim == 1 else ids.shape[1]
    if width == 0:
        return np.zeros(n + 1, dtype=np.int64), np.empty(0, dtype=np.int64), []
    if width == 1 and not (bool((ids < 0).any()) if missing is None else missing):
        return None, ids, names
    if width > 1:
        drop_repeats(ids)
    keep = (ids >= 0).reshape(n, width)
    ptr = np.zeros(n + 1, dtype=small_int(n * width, signed=False))
    labels = ptr[1:]  # each row's labels (a column at a time: numpy's sum along a short
    labels[:] = keep[:, 0]  # axis is 10x slower), then their running count, in place
    for k in range(1, keep.shape[1]):
        labels += keep[:, k]
    np.cumsum(labels, out=labels)  # (in ptr's type: another is a buffered cast, 5x slower)
    return ptr, ids.ravel()[keep.ravel()], names


def drop_repeats(ids: np.ndarray) -> None:
    """A label repeated in a row (of the (rows, columns) `ids`) made no label (-1), the
    first occurrence kept: what :func:`dataset.index.table.labelled` would drop, done a
    column at a time here, before the labels are packed, for a few columns (else left
    to it)."""
    if ids.shape[1] > 8:
        return
    for k in range(1, ids.shape[1]):
        col = ids[:, k]
        for j in range(k):
            col[col == ids[:, j]] = -1  # (a -1 made -1 again is still no label)
