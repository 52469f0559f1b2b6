"""CSV/TSV indexes: columns ``filename``, ``label*``, optional ``offset``/``length``; the
declared readers and the one selector that picks among them.

The readers (:data:`READERS`), asked in this order; each reads the whole file or
declines it (:mod:`dataset.index.csv.contract`), and the first that reads it gives the
rows:

    lines   C, one pass on two threads (dataset/index/csv/_lines.c): plain files, no
            quotes (most index files); absent where the C module was not built
    arrow   pyarrow's CSV reader (C++): quoted files with RFC 4180's quotes, ragged
            rows, offset/length columns
    csv     Python's csv module: everything else, and every faulty file, whose first
            faulty line it names; never declines

The rows become an :class:`~dataset.index.table.Index` whose names are offsets into
one buffer (:class:`~dataset.index.rows.NameRows`): no Python object per row.
Relative filenames join the URL prefix of the meta file beside the index
(:func:`~dataset.index.csv.meta.read_meta`) when there is one, else resolve against
the index's own folder, when an item is fetched.

Which readers are asked is a seam for tests and benchmarks, as pyzmq's backend is:
``from_csv(..., readers=("arrow", "csv"))``, or ``$DISTLEARN_CSV_READERS=arrow,csv``
in the environment of a process that opens its index through ``Dataset``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from distlearn.common.envvars import env_str
from distlearn.common.keywords import closest

from ...errors import BadIndex
from ...fetch import sources as src
from ...fetch.fetcher import Fetcher
from ..rows import NameRows, Resolver
from ..table import Index, labelled
from . import csvmodule, lines
from .contract import Rows, Source
from .meta import read_meta

__all__ = ["READERS", "READERS_ENV", "Reader", "choose", "from_csv", "local_identity", "read"]

# Which readers a process asks when from_csv() is not told (a comma-separated list).
READERS_ENV = "DISTLEARN_CSV_READERS"


@dataclass(frozen=True)
class Reader:
    """A CSV reader: ``read(source)`` gives the :class:`~.contract.Rows` of the whole file,
    or None to decline it (the next reader's, then); ``built()``: whether it can run here."""

    name: str
    read: Callable[[Source], Rows | None]
    built: Callable[[], bool]


def _arrow_read(source: Source) -> Rows | None:
    # pyarrow's import costs a tenth of a second, paid only by the files `lines` declines
    # (a job's start, where most index files are plain, waits for it otherwise).
    from . import arrow

    return arrow.read(source)


# The readers, in the order they are asked (see the module's text).
READERS: tuple[Reader, ...] = (
    Reader("lines", lines.read, lines.built),
    Reader("arrow", _arrow_read, lambda: True),
    Reader("csv", csvmodule.read, lambda: True),
)


def choose(readers: Sequence[str] | None = None) -> list[Reader]:
    """The readers to ask, in :data:`READERS`' order.

    Args:
        readers: Names of :data:`READERS` (a subset; the order is always theirs); None:
            ``$DISTLEARN_CSV_READERS`` where set, else all of them.

    Returns:
        Those of them that were built here (``lines`` needs its C module).

    Raises:
        ValueError: A name that is no reader (the closest one named), or no name at all.
    """
    if readers is None:
        text = env_str(READERS_ENV)
        if text is None:
            return [r for r in READERS if r.built()]
        readers = [name.strip() for name in text.split(",") if name.strip()]
    if isinstance(readers, str):
        raise TypeError(f"readers is a list of reader names, got {readers!r}")
    known = [r.name for r in READERS]
    for name in readers:
        if name not in known:
            near = closest(name, known)
            hint = f"did you mean {near!r}?" if near else f"the readers: {', '.join(known)}"
            raise ValueError(f"no CSV reader {name!r}; {hint}")
    if not readers:
        raise ValueError(f"no CSV reader named; the readers: {', '.join(known)}")
    return [r for r in READERS if r.name in readers and r.built()]


def read(source: Source, readers: Sequence[str] | None = None) -> Rows:
    """The rows of `source`, from the first of the chosen readers that reads it.

    Raises:
        BadIndex: The file's first fault (from the csv module's reader), or no chosen
            reader took it (a `readers` without ``csv``).
    """
    chosen = choose(readers)
    for reader in chosen:
        got = reader.read(source)
        if got is not None:
            got.reader = reader.name
            return got
    names = ", ".join(r.name for r in chosen) or "none built"
    raise BadIndex(f"{source.index}: none of the CSV readers asked ({names}) reads it")


def from_csv(
    index: str,
    *,
    sep: str | None = None,
    meta: str | None = None,
    url_params: str | dict | None = None,
    cache: Any = None,
    multi_hot: bool = False,
    allow_schemes: frozenset[str] = frozenset(),
    fetcher: Fetcher | None = None,
    readers: Sequence[str] | None = None,
) -> Index:
    """A CSV/TSV index: columns ``filename``, ``label*``, optional ``offset``/``length``.

    Rows may stop after their last label (ragged rows). Relative filenames join the URL
    prefix of the meta file beside the index (see
    :func:`~dataset.index.csv.meta.read_meta`) when there is one, else resolve against
    the index's own folder. Absolute URLs and paths are used as they are, within
    :func:`dataset.fetch.sources.check_scheme`.

    Args:
        index: A local path or a URL.
        sep: The separator (default: tab for ``.tsv``, else comma).
        meta: The meta file (default: the one beside the index, if any).
        url_params: A query string for every item (default: the meta file's).
        cache: Where index and meta files are kept (a :class:`~dataset.fetch.cache.Cache`).
        multi_hot: One example per row, its labels as a multi-hot target.
        allow_schemes: Stores a remote index may name besides its own.
        fetcher: The reads' fetcher.
        readers: Which readers to ask (:func:`choose`): a seam for tests.

    Returns:
        The whole index, in torch-dataset's example order.

    Raises:
        BadIndex: A faulty file (its first faulty line named), or a remote index naming
            items on a store it may not.
        IndexNotFound: No such file.
    """
    path = src.local_path(index)
    local = path if path is not None and os.path.isfile(path) else None
    if sep is None:
        sep = "\t" if index.lower().split("?", 1)[0].endswith(".tsv") else ","
    source = Source(index, sep, local, cache=cache, fetcher=fetcher)
    if local is None:
        source.data()  # (the index first, then its meta file: its error names the index)
    prefix, meta_params = read_meta(index, meta, cache, fetcher)
    query = src.query_string(url_params if url_params is not None else meta_params)
    source.resolver = Resolver(src.parent_of(index), prefix, query)
    rows = read(source, readers)
    if src.scheme(index) != "file":
        _check_schemes(rows.table, index, allow_schemes, rows.line_of)
    return labelled(rows.table, rows.ptr, rows.ids, rows.labels, index, multi_hot=multi_hot,
                    descents=rows.descents)  # fmt: skip


def _check_schemes(table: NameRows, index: str, allow: frozenset[str], line_of) -> None:
    """Refuse a remote index whose rows name items on another kind of store.

    Every other row resolves as the first does (the URL prefix or the index's
    folder, then its name), so only the first row and the names with a scheme
    or an absolute path are resolved here.
    """
    buf = table.buf
    colon = np.flatnonzero(buf == ord(":"))
    start = table.start.astype(np.int64)
    hits = np.searchsorted(colon, start + table.length) > np.searchsorted(colon, start)
    slash = buf[np.minimum(start, len(buf) - 1)] == ord("/")
    hits[0] = True
    for r in np.flatnonzero(hits | slash).tolist():
        url = table.source(r)
        refused = src.check_scheme(index, url[0] if isinstance(url, tuple) else url, allow)
        if refused:
            raise BadIndex(f"{index}:{line_of(r)}: {refused}")


def local_identity(path: str) -> tuple | None:
    """What identifies the version of a local file (for a cached, parsed index)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (os.path.realpath(path), st.st_size, st.st_mtime_ns, st.st_ino)
