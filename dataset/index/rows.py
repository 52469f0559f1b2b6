"""The rows of an index, with no Python object per row: names in one buffer, labels as ids.

- :class:`NameRows`: CSV and folder rows, each a name (offset and length into one bytes
  buffer, the names packed together or the file's own bytes), with an optional
  offset/length of a record inside a larger file, resolved to a source by a
  :class:`Resolver` (the URL prefix and the index's folder) only when fetched;
- :class:`TensorRows`: the rows of a tensor index, held as tensors;
- :class:`RowLabels`: each row's label ids, a compressed sparse row (one id a row
  where every row has one label).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from ..fetch import sources as src
from ..fetch.sources import Joined
from . import bytesort

__all__ = ["NameRows", "Resolver", "RowLabels", "TensorRows", "small_int"]


def small_int(top: int, signed: bool = True) -> np.dtype:
    """The smallest integer dtype that holds values up to `top` (and -1 when `signed`)."""
    for dt in (np.int16, np.int32, np.int64) if signed else (np.uint32, np.int64):
        if top <= np.iinfo(dt).max:
            return np.dtype(dt)
    return np.dtype(np.int64)


class Resolver:
    """How a name written in an index becomes a source: its folder, URL prefix and query."""

    def __init__(self, base: str, prefix: str = "", query: str = ""):
        self.base, self.prefix, self.query = base, prefix, query

    def __call__(self, name: str) -> str:
        if self.prefix and not src.is_url(name) and not os.path.isabs(name):
            url = src.join_prefix(self.prefix, name)
        else:
            url = src.resolve(self.base, name)
        if self.query and src.is_http(url):
            url = src.add_params(url, self.query)
        return url

    def state(self) -> dict:
        return {"base": self.base, "prefix": self.prefix, "query": self.query}


class NameRows:
    """Rows that name their items: name r is ``buf[start[r]:start[r] + length[r]]`` (UTF-8).

    ``buf`` is one bytes buffer (the index file itself, or names packed
    together), so a row costs its name's bytes and a few integers. It may be
    given as a list of buffers whose bytes follow each other (pyarrow's chunks
    of a column, kept as they are: a copy of the names of a 10M-row file costs
    a tenth of its open); they are joined into one where one is needed (a sort,
    the cache), else a name is read from the part that holds it. With
    ``ranges`` (offset, length arrays) a row is a record inside a larger file.
    """

    in_memory = False

    def __init__(
        self,
        buf: np.ndarray | list[np.ndarray],
        start: np.ndarray,
        length: np.ndarray,
        resolver: Resolver,
        ranges: tuple[np.ndarray, np.ndarray] | None = None,
    ):
        self._buf, self._parts, self._ends = buf, None, None
        if isinstance(buf, list):
            self._buf, self._parts = None, buf
            self._ends = np.cumsum([len(p) for p in buf])  # where each part ends in buf
        self.start, self.length = start, length
        self.resolver, self.ranges = resolver, ranges

    @property
    def buf(self) -> np.ndarray:
        """The names' one buffer (the parts joined, once)."""
        if self._buf is None:
            self._buf = np.concatenate(self._parts) if len(self._parts) > 1 else self._parts[0]
            self._parts = self._ends = None
        return self._buf

    def __len__(self) -> int:
        return len(self.start)

    def raw(self, r: int) -> str:
        s = int(self.start[r])
        buf = self._buf
        if buf is None:  # the part that holds it
            k = int(np.searchsorted(self._ends, s, side="right"))
            buf, s = self._parts[k], s - (int(self._ends[k - 1]) if k else 0)
        # (a CSV's bytes are checked UTF-8; a folder's names are the file system's)
        return bytes(buf[s : s + int(self.length[r])]).decode("utf-8", "surrogateescape")

    def source(self, r: int) -> Any:
        url = self.resolver(self.raw(r))
        if self.ranges is None:
            return url
        return (url, int(self.ranges[0][r]), int(self.ranges[1][r]))

    def name(self, r: int) -> str:
        return _display(self.source(r))

    def arrays(self) -> dict[str, np.ndarray]:
        out = {"buf": self.buf, "start": self.start, "length": self.length}
        if self.ranges is not None:
            out["range_offset"], out["range_length"] = self.ranges
        return out

    @property
    def nbytes(self) -> int:
        """Bytes its arrays hold (without joining the parts)."""
        held = [self.start, self.length, *(self.ranges or ())]
        held += [self._buf] if self._buf is not None else self._parts
        return sum(a.nbytes for a in held)

    def order(self, rows: np.ndarray | None, major: np.ndarray) -> np.ndarray:
        """The stable argsort of `rows` (None: every row, in order) by (`major`, name,
        offset, length)."""
        pick = slice(None) if rows is None else rows
        minor = () if self.ranges is None else (self.ranges[0][pick], self.ranges[1][pick])
        return bytesort.order(self.buf, self.start[pick], self.length[pick], major, minor)


class TensorRows:
    """Rows of a tensor, in memory: nothing to fetch."""

    in_memory = True

    def __init__(self, x: Any):
        self.x = x

    def __len__(self) -> int:
        return len(self.x)

    def source(self, r: int) -> Any:
        return self.x[r]

    def name(self, r: int) -> str:
        return f"<row {r}>"


class RowLabels:
    """The label ids of each row, compressed: row r has ``ids[ptr[r]:ptr[r + 1]]``.

    ``ptr`` None: every row has one label, ``ids[r]`` (most indexes); the pointers are
    then made only where asked for (an array as large as the index, in fresh memory,
    costs an open more than the arithmetic on it)."""

    def __init__(self, ptr: np.ndarray | None, ids: np.ndarray):
        self._ptr, self.ids = ptr, ids

    @property
    def ptr(self) -> np.ndarray:
        if self._ptr is None:
            self._ptr = np.arange(len(self.ids) + 1, dtype=small_int(len(self.ids), signed=False))
        return self._ptr

    @property
    def one_a_row(self) -> bool:
        """Whether every row has one label (no pointers held)."""
        return self._ptr is None

    @property
    def nbytes(self) -> int:
        return self.ids.nbytes + (0 if self._ptr is None else self._ptr.nbytes)

    def __len__(self) -> int:
        return len(self.ids) if self._ptr is None else len(self._ptr) - 1

    def of(self, r: int) -> tuple[int, ...]:
        if self._ptr is None:
            return (int(self.ids[r]),)
        return tuple(self.ids[int(self._ptr[r]) : int(self._ptr[r + 1])].tolist())

    @classmethod
    def single(cls, ids: np.ndarray) -> RowLabels:
        """One label per row (-1: none)."""
        has = ids >= 0
        ptr = np.zeros(len(ids) + 1, dtype=small_int(len(ids), signed=False))
        np.cumsum(has, out=ptr[1:])
        return cls(ptr, ids[has])


def _display(s: Any, i: int = 0) -> str:
    if isinstance(s, str):
        return s
    if isinstance(s, tuple) and len(s) == 3:
        return f"{s[0]}@{s[1]}+{s[2]}"
    if isinstance(s, Joined):
        return " + ".join(_display(x, i) for x in s)
    return f"<row {i}>"
