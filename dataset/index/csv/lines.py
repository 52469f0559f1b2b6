"""The reader ``lines``: plain CSV/TSV text (no quotes, UTF-8) read in one pass of C, on
two threads.

Most index files are this plain: ``filename,label`` lines of paths and label
names. :mod:`dataset.index.csv._lines` (C) reads such a file's bytes (a local file's
mapped pages, or the bytes fetched) once, a half on each core: it finds each
line's fields, strips them, copies each name into one buffer of names, and
writes each label's code in the order of its first appearance (a small hash
table per half), and where a name is smaller than the one before it. A general
CSV parser does more: pyarrow's copies every value into fresh buffers, which
then cost their own passes (:mod:`dataset.index.csv.arrow`: names stripped, labels
looked up, ragged rows split again).

The rows are the csv module's (``csv.reader(strict=True)``): a file that holds no
quote, no NUL, no ``\\r`` but in ``\\r\\n`` and is UTF-8 is split at each
separator and line end, as the csv module splits it; blank lines are no rows;
fields are stripped as ``str.strip`` strips them. :func:`read` declines (None)
anything else (a quote, bytes that are not UTF-8, a space that is not ASCII at a
field's edge, a name missing or empty, a row with more fields than the header, a
header with ``offset``/``length``), and the next reader reads the file or names its
fault. Without the compiled module (a build without a C compiler) it declines every
file.
"""

from __future__ import annotations

import itertools
import mmap
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import numpy as np

from ..cores import fresh, on_two_threads
from ..rows import NameRows, small_int
from ..table import sort_labels
from .contract import Columns, Rows, Source, packed_labels
from .csvmodule import header_names, line_of_row

__all__ = [
    "BLOCK",
    "HALVES",
    "MANY_LABELS",
    "MOST_DESCENTS",
    "NO_ROLE",
    "PEEK",
    "WIDE_CODES",
    "Split",
    "built",
    "read",
    "roles",
    "split",
]

try:
    from . import _lines
except ImportError:  # pragma: no cover - built by setup.py where a C compiler is at hand
    _lines = None

# A file smaller than this is read by one thread (a thread costs more than it saves).
HALVES = 1 << 20
# Rows a step of the label ids' remap takes (its temporaries stay in the cache).
BLOCK = 1 << 16
# Distinct labels past which they are sorted by numpy (where not all are integers).
MANY_LABELS = 4096
# Distinct labels in the first lines past which label codes are int32 from the start.
WIDE_CODES = 1000
# Descents (a name > the next one's) past this many: the file is not in order.
MOST_DESCENTS = 1 << 16
NO_ROLE = 255
# A local file whose first bytes hold a quote is declined at once (before it is mapped).
PEEK = 1 << 16


def built() -> bool:
    """Whether the C reader was built (else :func:`split` is always None)."""
    return _lines is not None


def read(source: Source) -> Rows | None:
    """The rows of a plain file, its names copied into one buffer; None where it is not
    plain (see the module's text)."""
    if _lines is None:
        return None
    if source.path is not None:  # mapped and read in at once: no copy of the file
        head = source.head(PEEK)
        if not head or b'"' in head or (source.size() or 0) >= 1 << 32:  # (uint32 offsets)
            return None
        data = source.pages(populate=True)
    else:
        data = source.data()
    if data is None or (end := data.find(b"\n")) < 0:
        return None
    header = [v.strip() for v in header_names(data[:end], source.sep)]
    got = split(data, header, end + 1, source.sep)
    if got is None:
        return None
    Columns(header, source.index)  # (its checks passed: it logs the unknown columns)
    ptr, ids, labels = packed_labels(got.ids, got.labels)
    table = NameRows(got.buf, got.start, got.length, source.resolver)
    sep = source.sep
    return Rows(table, ptr, ids, labels, lambda r: line_of_row(source.data(), sep, r),
                got.descents)  # fmt: skip


class Split(NamedTuple):
    """A plain file's rows: name r is ``buf[start[r]:start[r] + length[r]]``; ``ids``,
    the label ids (into ``labels``, sorted) of each row, ``(rows,)`` for one label
    column, ``(rows, columns)`` for several, -1 where a row has none there;
    ``descents``: the rows r whose name is > row r + 1's, or None (too many)."""

    buf: np.ndarray
    start: np.ndarray
    length: np.ndarray
    ids: np.ndarray
    labels: list[str]
    descents: np.ndarray | None


def roles(header: list[str]) -> bytes | None:
    """Each column's role for :mod:`dataset.index.csv._lines`: 0 the name, k + 1 the k-th label
    column, :data:`NO_ROLE` ignored; None where the header is not one it reads (no
    ``filename``, two of them, ``offset``/``length`` columns: the others decide)."""
    if header.count("filename") != 1 or "offset" in header or "length" in header:
        return None
    out, k = [], 0
    for name in header:
        if name == "filename":
            out.append(0)
        elif name.startswith("label") and k < NO_ROLE - 1:
            k += 1
            out.append(k)
        else:
            out.append(NO_ROLE)
    return bytes(out) if k < NO_ROLE - 1 else None


def split(data: bytes | mmap.mmap, header: list[str], body: int, sep: str) -> Split | None:
    """The rows of `data` after its header line (which ends before byte `body`), or
    None where they are not this reader's (see the module's text)."""
    role = roles(header)
    if _lines is None or role is None or len(sep) != 1 or not sep.isascii() or sep in '"\r\n':
        return None
    if len(data) >= 1 << 32 or data.find(b'"') >= 0:
        return None  # (at memchr's speed, where the C pass would find it late)
    share, distinct = _sample(data, body, sep, role)
    # int16 label codes, unless the first lines hold many labels (so may a half, more
    # than int16 holds: the split would be done again)
    wide = distinct > WIDE_CODES
    try:
        return _split(data, role, body, sep, share, np.int32 if wide else np.int16)
    except OverflowError:  # (more than 32,767 distinct labels in a half)
        return _split(data, role, body, sep, share, np.int32)


def _split(data, role: bytes, body: int, sep: str, share: float, code_type) -> Split | None:
    """:func:`split` with label codes of `code_type` (OverflowError: too narrow), the
    names' `share` of the bytes faulted in ahead: the lines counted, the arrays made,
    each half read by :mod:`dataset.index.csv._lines` on a thread of its own, the halves joined."""
    k = max((r for r in role if r != NO_ROLE), default=0)  # label columns
    cut = data.find(b"\n", body + (len(data) - body) // 2) + 1 if len(data) > HALVES else 0
    parts = [(body, cut), (cut, len(data))] if cut > body else [(body, len(data))]
    with ThreadPoolExecutor(len(parts)) as workers:  # (the C lets go of the GIL)
        counts = [workers.submit(_lines.count, data, lo, hi) for lo, hi in parts]
        first = [lo - body for lo, _ in parts]  # each half's first byte of names (no name
        names = fresh(len(data) - body, np.uint8)  # is longer than its line)
        for (lo, hi), at in zip(parts, first, strict=True):  # (while they count; the rest
            _touched(names[at : at + int((hi - lo) * share)])  # is mapped if it is used)
        caps = [c.result() + 1 for c in counts]
        at = np.cumsum([0, *caps])  # each half's first row
        start = _touched(fresh(at[-1], np.uint32))
        length = _touched(fresh(at[-1], np.int16))
        codes = _touched(fresh((at[-1], k), code_type))
        descents = np.empty((len(parts), MOST_DESCENTS), dtype=np.int64)

        def read(j: int):
            rows = slice(at[j], at[j + 1])
            return _lines.split(data, *parts[j], ord(sep), role, names, first[j],
                                start[rows], length[rows], codes[rows], descents[j])  # fmt: skip

        got = list(workers.map(read, range(len(parts))))
    if any(g is None for g in got):
        return None
    rows = [g[0] for g in got]
    n, end = sum(rows), got[0][3]
    if n == 0:
        return None  # (no rows: the others say so)
    if len(parts) == 2:  # the second half's rows and names move up to the first's
        if rows[0] < caps[0]:  # (blank lines)
            for a in (start, length, codes):
                a[rows[0] : n] = a[at[1] : at[1] + rows[1]]
        names[end : end + got[1][3] - first[1]] = names[first[1] : got[1][3]]
        start[rows[0] : n] -= first[1] - end
        end += got[1][3] - first[1]
    start, length, codes = start[:n], length[:n], codes[:n]
    labels, tables = _sorted_labels([g[1] for g in got])
    ids = _ids(codes, tables, rows)
    return Split(
        names[:end], start, length, ids, labels,
        _descents(names, start, length, got, rows, descents, most=len(labels)),
    )  # fmt: skip


def _touched(a: np.ndarray) -> np.ndarray:
    """`a`, its pages faulted in by this thread. Two threads that fault in fresh pages
    at once wait on each other: measured here, the two halves of a 1M-row split took
    50 ms into fresh row arrays, 19 ms after 4 ms of this, and a 10M-row split
    0.25-0.66 s into fresh names."""
    a.reshape(-1).view(np.uint8)[:: mmap.PAGESIZE] = 0
    return a


def _sample(data, body: int, sep: str, role: bytes, sample: int = 1 << 16) -> tuple[float, int]:
    """From the first lines: the share of the bytes the names will take, a little over
    (faulted in ahead for that share of the file only: the labels' share is never
    touched), and how many distinct labels they hold."""
    lines = data[body : body + sample].split(b"\n")[:-1]
    name, used, labels = role.index(0), 0, set()
    for fields in (line.split(sep.encode()) for line in lines):
        used += len(fields[name].strip()) if name < len(fields) else 0
        labels.update(f for f, r in zip(fields, role, strict=False) if 0 < r < NO_ROLE)
    return min(1.0, 1.1 * used / max(1, sum(len(line) + 1 for line in lines))), len(labels)


def _sorted_labels(found: list[list[str]]) -> tuple[list[str], list[np.ndarray]]:
    """The labels of every half, sorted as :func:`dataset.index.table.sort_labels` sorts
    them, and a table a half from its codes to their ids, whose last entry (-1, no
    label) code -1 takes. Many labels (a face or product index has 10^5-10^6) are
    sorted by numpy, where they are not all integers (as bytes where all are ASCII:
    a string's order, at twice the speed): Python's sort and a dict of them took
    1.5 s for 10^6."""
    every = [name for names in found for name in names]
    if len(every) <= MANY_LABELS or _integer(every[0]):  # (all integers: numeric order)
        labels = sort_labels(every)
        dt = small_int(len(labels) + 1)
        where = {name: i for i, name in enumerate(labels)}
        return labels, [np.asarray([where[v] for v in names] + [-1], dtype=dt) for names in found]
    ascii_ = all(map(str.isascii, every))
    text, at = np.unique(np.array(every, dtype=np.bytes_ if ascii_ else np.str_),
                         return_inverse=True)  # fmt: skip
    dt = small_int(len(text) + 1)
    edges = np.cumsum([0, *(len(names) for names in found)])
    tables = [np.append(at[lo:hi].astype(dt), dt.type(-1)) for lo, hi in itertools.pairwise(edges)]
    return text.astype(np.str_).tolist(), tables  # (ASCII bytes: the same as text)


def _integer(name: str) -> bool:
    try:
        int(name)
    except ValueError:
        return False
    return True


def _ids(codes: np.ndarray, tables: list[np.ndarray], rows: list[int]):
    """Each half's codes (in the order of its own first appearances) as ids, through
    its table, in place where the types match (a fresh array as large costs its page
    faults), a block of rows at a time on two threads."""
    dt = tables[0].dtype
    ids = codes if codes.dtype == dt else np.empty(codes.shape, dtype=dt)
    edges = np.cumsum([0, *rows])
    blocks = [
        (table, lo, min(lo + BLOCK, hi))
        for table, first, hi in zip(tables, edges[:-1], edges[1:], strict=True)
        for lo in range(first, hi, BLOCK)
    ]

    def remap(part) -> None:
        for table, lo, hi in part:
            ids[lo:hi] = table.take(codes[lo:hi], mode="wrap")  # (a block's temporary)

    on_two_threads(remap, blocks)
    return ids[:, 0] if ids.shape[1] == 1 else ids


def _descents(names, start, length, got, rows, found, most: int) -> np.ndarray | None:
    """The rows r whose name is > row r + 1's, over both halves (and where they meet),
    or None where there are more than `most`."""
    if sum(g[2] for g in got) > min(most, MOST_DESCENTS):
        return None
    out = [found[0][: got[0][2]].copy()]
    if len(got) == 2 and rows[0] and rows[1]:
        r = rows[0] - 1
        last = names[int(start[r]) : int(start[r]) + int(length[r])].tobytes()
        first = names[int(start[r + 1]) : int(start[r + 1]) + int(length[r + 1])].tobytes()
        if last > first:
            out.append(np.array([r], dtype=np.int64))
        out.append(found[1][: got[1][2]] + rows[0])
    got_all = np.concatenate(out)
    return got_all if len(got_all) <= most else None
