"""CSV/TSV indexes: columns ``filename``, ``label*``, optional ``offset``/``length``.

The file is split into fields by the first reader that vouches for its rows:
:mod:`dataset.index.csv.lines` (C, plain files), :mod:`dataset.index.csv.arrow` (pyarrow),
:func:`dataset.index.csv.scan.scan` (numpy), else the csv module; and read into an
:class:`Index` whose rows are offsets into one buffer of names
(:class:`dataset.index.rows.NameRows`): no Python object per row. Relative
filenames join the URL prefix of the meta file beside the index
(:func:`read_meta`) when there is one, else resolve against the index's own
folder, when an item is fetched.
"""

from __future__ import annotations

import csv
import logging
import mmap
import os
from typing import Any

import numpy as np

from ...errors import BadIndex, IndexNotFound
from ...fetch import sources as src
from ...fetch.fetcher import Fetcher
from ...fetch.files import read_bytes
from .. import bytesort
from ..cores import on_two_threads
from ..rows import NameRows, Resolver, fixed_width, small_int
from ..table import Index, labelled, sort_labels
from . import arrow as csvarrow
from . import lines as csvlines
from .arrow import pa, pc
from .meta import read_meta
from .scan import Fields, iter_rows, scan, scan_rows

__all__ = ["PACK_BELOW", "Columns", "from_csv", "local_identity"]

log = logging.getLogger("distlearn.dataset.index")


# Names packed into their own buffer when they are less than this share of the file
# (a file with wide columns we do not read); else the index keeps the file's bytes.
PACK_BELOW = 0.5


class Columns:
    """Where the known columns of a CSV header are; unknown ones are logged and ignored."""

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
) -> Index:
    """A CSV/TSV index: columns ``filename``, ``label*``, optional ``offset``/``length``.

    Rows may stop after their last label (ragged rows). Relative filenames join
    the URL prefix of the meta file beside the index (see :func:`read_meta`)
    when there is one, else resolve against the index's own folder. Absolute
    URLs and paths are used as they are, within :func:`dataset.fetch.sources.check_scheme`.
    """
    path = src.local_path(index)
    local = path is not None and os.path.isfile(path)  # read by pyarrow, a block at a time
    data = None if local else _read(index, cache, fetcher)
    if sep is None:
        sep = "\t" if index.lower().split("?", 1)[0].endswith(".tsv") else ","
    prefix, meta_params = read_meta(index, meta, cache, fetcher)
    query = src.query_string(url_params if url_params is not None else meta_params)
    resolver = Resolver(src.parent_of(index), prefix, query)
    got = _from_lines(_plain_bytes(path) if local else data, index, sep, resolver, path)
    if got is None:
        got = _from_arrow(path if local else data, index, sep, resolver)
    if got is None and data is None:  # (a local file with quotes: split from its pages)
        got = _from_mapped(path, index, sep, resolver)
        if got is None:
            data = _read(index, cache, fetcher)
    descents = None
    if got is not None:
        table, ptr, ids, names, line_of, descents = got
    elif (fields := scan(data, sep)) is not None:
        try:
            table, ptr, ids, names, line_of = _from_fields(fields, index, sep, resolver)
        except BadIndex as err:
            raise _first_fault(data, index, sep, err) from None
    else:
        table, ptr, ids, names, line_of = _from_rows(data, index, sep, resolver)
    if src.scheme(index) != "file":
        _check_schemes(table, index, allow_schemes, line_of)
    return labelled(table, ptr, ids, names, index, multi_hot=multi_hot, descents=descents)


def _read(index: str, cache: Any, fetcher: Fetcher | None) -> bytes:
    """The index file's bytes, checked to be UTF-8."""
    try:
        data = read_bytes(index, cache=cache, fetcher=fetcher)
    except IndexNotFound as err:
        raise IndexNotFound(f"index not found: {err}") from None
    assert data is not None
    if not data.isascii():
        try:
            data.decode("utf-8")
        except UnicodeDecodeError as err:
            line = data.count(b"\n", 0, err.start) + 1  # where to look, not a byte offset
            raise BadIndex(f"{index}:{line}: not UTF-8 text ({err})") from err
    return data


def _from_mapped(path: str, index: str, sep: str, resolver: Resolver):
    """:func:`_from_arrow` of a local file that holds quotes, its pages mapped rather
    than read into bytes (a copy that cost a sixth of a 1M-row open). Nothing of the
    mapping outlives the split, since pyarrow copies the values: it is unmapped with
    its last reference, ours at return or, a moment later, that of pyarrow's reader,
    which its own threads drop (so no close() here: it would fail while they hold
    it). A file cut short during the split would be a SIGBUS, as for any mapped
    file. None where the file holds no quote (the scanner's) or pyarrow's split
    does not hold."""
    try:
        with open(path, "rb") as f:
            pages = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError):  # (an empty file cannot be mapped)
        return None
    if pages.find(b'"') < 0:
        return None
    return _from_arrow(pages, index, sep, resolver, where=path)


def _plain_bytes(path: str) -> mmap.mmap | None:
    """A local file's pages, mapped (and read in at once), where its first lines are
    plain (see :mod:`dataset.index.csv.lines`), else None: read by the other readers (no copy
    kept of it; a file cut short while its rows are read is a SIGBUS, as for any
    mapped file)."""
    try:
        with open(path, "rb") as f:
            head = f.read(csvarrow.PEEK)
            if not head or b'"' in head or not csvlines.built():
                return None
            if os.fstat(f.fileno()).st_size >= 1 << 32:  # (uint32 offsets: not mapped)
                return None
            return mmap.mmap(
                f.fileno(), 0, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                prot=mmap.PROT_READ,
            )  # fmt: skip
    except (OSError, ValueError):
        return None  # (the caller's read names the fault)


def _from_lines(
    data: csvarrow.Buffer | None, index: str, sep: str, resolver: Resolver, where: str | None
):
    """:func:`_from_arrow`'s result for a plain file, read by :mod:`dataset.index.csv.lines`
    (its names copied into one buffer); None where it is not plain. `where`: the
    file, for the line of a row, where `data` does not outlive the call."""
    if data is None or (end := data.find(b"\n")) < 0:
        return None
    header = [v.strip() for v in csvarrow.header_names(data[:end], sep)]
    got = csvlines.split(data, header, end + 1, sep)
    if got is None:
        return None
    Columns(header, index)  # (its checks passed: it logs the unknown columns)
    ptr, ids, names = _packed(got.ids, got.labels)
    table = NameRows(got.buf, got.start, got.length, resolver)
    text = data if where is None else where
    return table, ptr, ids, names, lambda r: _line_of(text, sep, r), got.descents


def _from_arrow(
    source: str | csvarrow.Buffer,
    index: str,
    sep: str,
    resolver: Resolver,
    where: str | None = None,
):
    """The rows as :func:`_from_fields` reads them, split by pyarrow (see
    :mod:`dataset.index.csv.arrow`), and whether each name is <= the next; None where the
    scanner must read the file (what pyarrow refuses, offset/length columns, an
    empty filename: the scanner's errors name the line). `where`: the file, for the
    line of a row, where `source` does not outlive the call."""
    got = csvarrow.split(source, sep)
    if got is None:
        return None
    header, columns = got
    if "offset" in header or "length" in header or not sum(len(c) for c in columns[0].chunks):
        return None  # (before Columns, which logs the unknown columns: once)
    cols = Columns(header, index)
    n = sum(len(c) for c in columns[0].chunks)
    ptr, ids, label_names = _arrow_labels([columns[c].chunks for c in cols.labels], n)
    # rows in label order descend (by name) only where the label changes
    names = csvarrow.Names(columns[cols.file].chunks, most=len(label_names))
    if names.empty:
        return None
    table = NameRows(names.parts, names.start, names.length, resolver)  # no copy of the bytes
    descents = names.descents
    del columns, names
    csvarrow.pool().release_unused()  # what the split held, back to the system
    text = source if where is None else where
    return table, ptr, ids, label_names, lambda r: _line_of(text, sep, r), descents


def _arrow_labels(columns: list[list], n: int):
    """``(ptr, ids, names)`` for :func:`dataset.index.table.labelled`, from the chunks of pyarrow's
    label columns: the distinct values of every chunk's dictionary stripped in Python
    (a few, where the chunks' dictionaries hold thousands of strings) and looked up
    in the sorted label names; each chunk's indices mapped through that small table
    straight into the ids (no unified dictionary, no remap of every id after)."""
    if not columns:
        return _packed(np.empty((n, 0), dtype=np.int16), [])
    pool = csvarrow.pool()
    coded = []  # (column, chunk, its indices)
    for k, col in enumerate(columns):
        for c in col:
            if len(c):
                if not pa.types.is_dictionary(c.type):  # (a header with a quote: read as text)
                    c = pc.dictionary_encode(c, memory_pool=pool)
                coded.append((k, c, csvarrow.int32s(c.indices)))
    every = pa.chunked_array([c.dictionary for _, c, _ in coded], type=pa.string())
    distinct = pc.unique(every, memory_pool=pool)
    value = [v.strip() for v in distinct.to_pylist()]
    maps = pc.index_in(every, value_set=distinct, memory_pool=pool)  # -> distinct, no nulls
    maps = np.concatenate([csvarrow.int32s(m) for m in maps.chunks] or [np.empty(0, np.int32)])
    used = np.zeros(len(value), dtype=bool)
    edges = np.cumsum([0] + [len(c.dictionary) for _, c, _ in coded])
    for (_, c, at), lo, hi in zip(coded, edges[:-1], edges[1:], strict=True):
        if c.offset:  # a slice after the header: the header's value is in its dictionary
            used[maps[lo:hi][np.bincount(at, minlength=hi - lo) > 0]] = True
        else:
            used[maps[lo:hi]] = True
    found = {v for v, u in zip(value, used.tolist(), strict=True) if u}
    names = sort_labels(found - {""})
    dt = small_int(len(names) + 1)
    where = {name: i for i, name in enumerate(names)}  # "" (no label) and unused: -1
    table = np.asarray([where.get(v, -1) for v in value], dtype=dt)[maps]  # dictionary -> id
    ids = np.empty((n, len(columns)) if len(columns) > 1 else n, dtype=dt)
    jobs, pos = [], [0] * len(columns)  # (column, its rows, the chunk's ids and table)
    for (k, _, at), lo, hi in zip(coded, edges[:-1], edges[1:], strict=True):
        jobs.append((k, slice(pos[k], pos[k] + len(at)), at, table[lo:hi]))
        pos[k] += len(at)

    def fill(part) -> None:  # the chunks shared by two threads (numpy lets go of the GIL)
        for k, rows, at, small in part:
            if len(columns) == 1:
                np.take(small, at, out=ids[rows], mode="clip")  # (unbuffered)
            else:
                ids[rows, k] = small[at]

    on_two_threads(fill, jobs)
    return _packed(ids, names, missing="" in found)


def _packed(ids: np.ndarray, names: list[str], missing: bool | None = None):
    """``(ptr, ids, names)`` for :func:`dataset.index.table.labelled` from each row's label ids,
    ``(rows,)`` for one label column or ``(rows, columns)`` (none: no label column),
    -1 for no label there (`missing`: whether one label column has one; None: look);
    a label repeated in a row is kept once."""
    n, width = len(ids), 1 if ids.ndim == 1 else ids.shape[1]
    if width == 0:
        return np.zeros(n + 1, dtype=np.int64), np.empty(0, dtype=np.int64), []
    if width == 1 and not (bool((ids < 0).any()) if missing is None else missing):
        return None, ids, names
    if width > 1:
        _drop_repeats(ids)
    keep = (ids >= 0).reshape(n, width)
    ptr = np.zeros(n + 1, dtype=small_int(n * width, signed=False))
    labels = ptr[1:]  # each row's labels (a column at a time: numpy's sum along a short
    labels[:] = keep[:, 0]  # axis is 10x slower), then their running count, in place
    for k in range(1, keep.shape[1]):
        labels += keep[:, k]
    np.cumsum(labels, out=labels)  # (in ptr's type: another is a buffered cast, 5x slower)
    return ptr, ids.ravel()[keep.ravel()], names


def _drop_repeats(ids: np.ndarray) -> None:
    """A label repeated in a row (of the (rows, columns) `ids`) made no label (-1), the
    first occurrence kept: what :func:`dataset.index.table.labelled` would drop, done a column
    at a time here, before the labels are packed, for a few columns (else left to it)."""
    if ids.shape[1] > 8:
        return
    for k in range(1, ids.shape[1]):
        col = ids[:, k]
        for j in range(k):
            col[col == ids[:, j]] = -1  # (a -1 made -1 again is still no label)


def _line_of(source: str | bytes, sep: str, r: int) -> int:
    """The line on which row `r` after the header starts (for an error message)."""
    if isinstance(source, str):
        with open(source, "rb") as f:
            source = f.read()
    fields = scan(source, sep)
    if fields is not None:
        return fields.line_of(_Body(fields).row(r))
    _, rows = scan_rows(source.decode("utf-8-sig"), sep, "")
    return [line for line, row in rows if row and (len(row) > 1 or row[0].strip())][r]


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


def _value(fields: Fields, start: int, end: int) -> str:
    """One field's value (its ``""`` escapes undone), for headers and messages."""
    text = bytes(fields.buf[start:end]).decode("utf-8", "replace")
    return text.replace('""', '"') if len(fields.drop) else text


def _row_values(fields: Fields, r: int) -> list[str]:
    one = np.asarray([r])
    return [_value(fields, *(int(x[0]) for x in fields.column(k, one)))
            for k in range(int(fields.counts[r]))]  # fmt: skip


def _from_fields(fields: Fields, index: str, sep: str, resolver: Resolver):
    """The rows of a scanned file: its name table and label ids (CSR), checked."""
    if len(fields) == 0:
        raise BadIndex(f"{index}: empty index (no header line)")
    cols = Columns(_row_values(fields, 0), index)
    header = cols.header
    body = _Body(fields)
    if not body.count:
        raise BadIndex(f"{index}: empty index (a header but no items)")
    over = _filled_past(fields, body, len(header))
    if len(over):
        r = body.row(over[0])
        raise BadIndex(
            f"{index}:{fields.line_of(r)}: {int(fields.counts[r])} fields for a header of "
            f"{len(header)} {header}: {_row_values(fields, r)} (quote a field that holds {sep!r})"
        )
    short = np.flatnonzero(body.cnt < cols.needed)
    if len(short):
        r = body.row(short[0])
        got = _row_values(fields, r)
        raise BadIndex(f"{index}:{fields.line_of(r)}: missing fields {header[len(got) :]}: {got}")
    start, end = fields.column(cols.file, body.rows)
    empty = np.flatnonzero(start == end)
    if len(empty):
        raise BadIndex(f"{index}:{fields.line_of(body.row(empty[0]))}: empty filename")
    buf, start, length = _names(fields, start, end)
    ranges = None
    if cols.offset is not None:
        ranges = (_ints(fields, index, cols.offset, body), _ints(fields, index, cols.length, body))
        bad = np.flatnonzero((ranges[0] < 0) | (ranges[1] < 0))
        if len(bad):
            raise BadIndex(f"{index}:{fields.line_of(body.row(bad[0]))}: negative offset/length")
    table = NameRows(buf, start, length, resolver, ranges)
    ptr, ids, names = _labels(fields, cols, body)
    return table, ptr, ids, names, lambda r: fields.line_of(body.row(r))


def _filled_past(fields: Fields, body: _Body, width: int) -> np.ndarray:
    """The rows (of `body`) with a field past the header's `width` that holds something:
    fields past the header that are empty (a separator at the end of a line, which
    torch-dataset's reader skips) hold no data, and are not an error."""
    over = np.flatnonzero(body.cnt > width)
    if not len(over):
        return over
    rows = over + 1 if body.rows is None else body.rows[over]
    cnt = body.cnt[over]
    filled = np.zeros(len(over), dtype=bool)
    for k in range(width, int(cnt.max())):
        has = np.flatnonzero(cnt > k)
        start, end = fields.column(k, rows[has])
        filled[has[end > start]] = True
    return over[filled]


class _Body:
    """The rows after the header that hold items (blank lines left out).

    ``rows``: their numbers, or None for all of them when every row has the
    same fields (then ``cnt`` is one number); ``row(i)``: the i-th one's number.
    """

    def __init__(self, fields: Fields):
        self.rows: np.ndarray | None = None
        if fields.per_row:  # two fields or more: no row is a blank line
            self.cnt: Any = np.asarray(fields.per_row + 1)
            self.count = len(fields) - 1
            return
        rows = np.arange(1, len(fields), dtype=np.int64)
        cnt = fields.counts[1:]
        one = np.flatnonzero(cnt == 1)  # a blank line is one empty field
        if len(one):
            s0, e0 = fields.column(0, rows[one])
            keep = np.ones(len(rows), dtype=bool)
            keep[one[s0 == e0]] = False
            rows, cnt = rows[keep], cnt[keep]
        self.rows, self.cnt, self.count = rows, cnt, len(rows)

    def row(self, i: int) -> int:
        return int(i) + 1 if self.rows is None else int(self.rows[i])

    def having(self, k: int) -> np.ndarray | None:
        """Which of the rows have field k (None: all of them)."""
        has = self.cnt > k
        if has.ndim == 0:
            return None if has else np.zeros(self.count, dtype=bool)
        return None if has.all() else has


def _escaped(fields: Fields, start: np.ndarray, end: np.ndarray) -> np.ndarray:
    """Which of the fields hold a ``""`` escape."""
    if not len(fields.drop):
        return np.zeros(len(start), dtype=bool)
    return np.searchsorted(fields.drop, start) < np.searchsorted(fields.drop, end)


def _names(fields: Fields, start: np.ndarray, end: np.ndarray):
    """``(buf, start, length)`` of the names: the file's bytes, or packed when much smaller."""
    buf = fields.buf
    length = end - start
    esc = np.flatnonzero(_escaped(fields, start, end))
    if int(length.sum()) < PACK_BELOW * len(buf):
        mark = np.zeros(len(buf) + 1, dtype=np.int8)
        mark[start] += 1
        mark[end] -= 1
        inside = np.cumsum(mark[:-1], dtype=np.int8).view(bool)
        buf = buf[inside]
        start = np.cumsum(length) - length
    buf, start, length = _unescape(buf, start, length, esc)
    return (
        buf,
        start.astype(small_int(len(buf), signed=False)),
        length.astype(small_int(length.max())),
    )


def _unescape(buf: np.ndarray, start: np.ndarray, length: np.ndarray, esc: np.ndarray):
    """``(buf, start, length)`` where the strings `esc`, which hold ``""`` escapes, are
    their values, unescaped, after the other bytes."""
    if not len(esc):
        return buf, start, length
    tail = [bytes(buf[start[i] : start[i] + length[i]]).replace(b'""', b'"') for i in esc]
    at = len(buf) + np.cumsum([0] + [len(t) for t in tail[:-1]])
    buf = np.concatenate([buf, np.frombuffer(b"".join(tail), dtype=np.uint8)])
    start, length = start.copy(), length.copy()
    start[esc], length[esc] = at, [len(t) for t in tail]
    return buf, start, length


def _ints(fields: Fields, index: str, col: int, body: _Body) -> np.ndarray:
    start, end = fields.column(col, body.rows)
    values = fixed_width(fields.buf, start, end - start)
    try:
        return values.astype(np.int64)
    except ValueError:
        pass
    out = np.empty(len(values), dtype=np.int64)
    for i, v in enumerate(values.tolist()):
        try:
            out[i] = int(v.decode())
        except ValueError:
            r = body.row(i)
            got = _row_values(fields, r)
            raise BadIndex(
                f"{index}:{fields.line_of(r)}: offset/length must be integers, got {got}"
            ) from None
    return out


def _labels(fields: Fields, cols: Columns, body: _Body):
    """``(ptr, ids, names)``: each row's non-empty labels, in column order, as ids into names."""
    width = max(1, len(cols.labels))
    none = np.zeros(body.count + 1, dtype=np.int64), np.empty(0, dtype=np.int64), []
    if not cols.labels:
        return none
    if len(cols.labels) == 1 and body.having(cols.labels[0]) is None:
        start, end = fields.column(cols.labels[0], body.rows)
        key = None if (end > start).all() else np.flatnonzero(end > start)
        if key is not None:
            start, end = start[key], end[key]
    else:
        key, start, end = _label_fields(fields, cols, body)
    if not len(start):
        return none
    esc = np.flatnonzero(_escaped(fields, start, end))
    names, ids = _factorize(*_unescape(fields.buf, start, end - start, esc))
    if key is None:  # one label on every row
        return np.arange(body.count + 1, dtype=np.int64), ids, names
    ptr = np.zeros(body.count + 1, dtype=np.int64)
    np.cumsum(np.bincount(key // width, minlength=body.count), out=ptr[1:])
    return ptr, ids, names


def _label_fields(fields: Fields, cols: Columns, body: _Body):
    """``(key, start, end)`` of every non-empty label: key is row * columns + column rank."""
    where, starts, ends = [], [], []
    width = max(1, len(cols.labels))
    for rank, c in enumerate(cols.labels):
        has = body.having(c)
        if has is None:
            s, e = fields.column(c, body.rows)
            present = np.arange(body.count, dtype=np.int64)
        else:
            present = np.flatnonzero(has)
            rows = present + 1 if body.rows is None else body.rows[present]
            s, e = fields.column(c, rows)
        some = e > s
        if not some.all():
            present, s, e = present[some], s[some], e[some]
        where.append(present * width + rank)
        starts.append(s)
        ends.append(e)
    key, start, end = (np.concatenate(x) for x in (where, starts, ends))
    if len(cols.labels) > 1:
        order = np.argsort(key, kind="stable")
        key, start, end = key[order], start[order], end[order]
    return key, start, end


def _factorize(buf: np.ndarray, start: np.ndarray, length: np.ndarray):
    """``(distinct names, id of each string)``, names in bytes order."""
    first, ids = bytesort.unique(buf, start, length)
    names = [bytes(buf[s : s + n]).decode("utf-8") for s, n in zip(start[first].tolist(),
             length[first].tolist(), strict=True)]  # fmt: skip
    return names, ids


def _from_rows(data: bytes, index: str, sep: str, resolver: Resolver):
    """What :func:`scan` leaves to it: rows from ``csv.reader``, the same table after."""
    cols, items = _csv_items(data, index, sep)
    names: list[bytes] = []
    lines: list[int] = []
    offsets: list[int] = []
    lengths: list[int] = []
    label_rows: list[list[str]] = []
    for line, row, name, span in items:
        names.append(name.encode("utf-8"))
        lines.append(line)
        if span is not None:
            offsets.append(span[0])
            lengths.append(span[1])
        labs = (row[c].strip() for c in cols.labels if c < len(row))
        label_rows.append([lab for lab in labs if lab])
    if not names:
        raise BadIndex(f"{index}: empty index (a header but no items)")
    size = np.asarray([len(n) for n in names], dtype=np.int64)
    buf = np.frombuffer(b"".join(names), dtype=np.uint8)
    start = np.cumsum(size) - size
    ranges = None
    if cols.offset is not None:
        ranges = (np.asarray(offsets, dtype=np.int64), np.asarray(lengths, dtype=np.int64))
    table = NameRows(buf, start, size, resolver, ranges)
    distinct = sorted({lab for labs in label_rows for lab in labs})
    where = {lab: i for i, lab in enumerate(distinct)}
    ids = np.asarray([where[lab] for labs in label_rows for lab in labs], dtype=np.int64)
    ptr = np.zeros(len(label_rows) + 1, dtype=np.int64)
    np.cumsum([len(labs) for labs in label_rows], out=ptr[1:])
    return table, ptr, ids, distinct, lines.__getitem__


def _csv_items(data: bytes, index: str, sep: str):
    """``(cols, items)``: the header's :class:`Columns`, and an iterator of ``(line, row,
    name, (offset, length) or None)`` of each row after it that holds an item, read by
    ``csv.reader`` and checked as it comes: a fault raises :class:`BadIndex` where the
    csv module meets it, the first in the file."""
    rows = _csv_rows(data.decode("utf-8-sig"), index, sep)
    header = next(rows, (0, []))[1]
    if not header:
        raise BadIndex(f"{index}: empty index (no header line)")
    cols = Columns([h.strip() for h in header], index)
    return cols, _checked(rows, cols, index, sep)


def _csv_rows(text: str, index: str, sep: str):
    """``(line, row)`` of each row, as ``csv.reader`` reads them; its error names the line."""
    try:
        yield from iter_rows(text, sep)
    except csv.Error as err:
        raise BadIndex(f"{index}:{err.line}: {err}") from err  # type: ignore[attr-defined]


def _checked(rows, cols: Columns, index: str, sep: str):
    """:func:`_csv_items`'s items: blank lines left out, each other row checked."""
    header = cols.header
    for line, row in rows:
        if not row or (len(row) == 1 and not row[0].strip()):
            continue  # blank line
        if len(row) > len(header) and any(f.strip() for f in row[len(header) :]):
            raise BadIndex(
                f"{index}:{line}: {len(row)} fields for a header of {len(header)} "
                f"{header}: {row} (quote a field that holds {sep!r})"
            )
        if len(row) < cols.needed:
            raise BadIndex(f"{index}:{line}: missing fields {header[len(row) :]}: {row}")
        name = row[cols.file].strip()
        if not name:
            raise BadIndex(f"{index}:{line}: empty filename")
        span = None
        if cols.offset is not None:
            try:
                span = int(row[cols.offset]), int(row[cols.length])
            except ValueError:
                raise BadIndex(
                    f"{index}:{line}: offset/length must be integers, got "
                    f"{row[cols.offset]!r}/{row[cols.length]!r}"
                ) from None
            if span[0] < 0 or span[1] < 0:
                raise BadIndex(f"{index}:{line}: negative offset/length")
        yield line, row, name, span


def _first_fault(data: bytes, index: str, sep: str, found: BadIndex) -> BadIndex:
    """The fault the csv module meets first in `data`, where the scanner `found` one.

    The scanner checks each kind of fault over all rows at once (too many fields
    anywhere, then too few...) and shows a row's values stripped; the user is told
    of the first faulty row of the file, as written. The rows are read up to it,
    none kept: a fault on the last of 1M rows costs 0.5 s more. `found` where the
    csv module meets none (an index with no items)."""
    try:
        for _ in _csv_items(data, index, sep)[1]:
            pass
    except BadIndex as err:
        return err
    return found


def local_identity(path: str) -> tuple | None:
    """What identifies the version of a local file (for a cached, parsed index)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (os.path.realpath(path), st.st_size, st.st_mtime_ns, st.st_ino)
