"""The reader of last resort, and the reference: Python's csv module.

``csv.reader(strict=True)`` reads every file, a Python object per field, so it is the
slowest reader by far (1M rows: about 1 s) and the one every other reader is held to
(:mod:`dataset.index.csv.contract`). It reads what the others decline: quotes RFC 4180
does not allow where they stand, NUL bytes, lone ``\\r`` line ends, rows with more
fields than the header, and every faulty file, whose first faulty row it names, as
written. It never declines.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Iterator

import numpy as np

from ...errors import BadIndex
from ..rows import NameRows
from ..table import sort_labels
from .contract import Columns, Rows, Source

__all__ = ["header_names", "iter_rows", "line_of_row", "read"]

# The largest offset or length an index row may give (what the index's int64 arrays hold).
_MOST = np.iinfo(np.int64).max


def read(source: Source) -> Rows:
    """The rows of `source`, as ``csv.reader`` reads its bytes.

    Raises:
        BadIndex: The first faulty row of the file (or its header), named by its line.
    """
    data, index, sep = source.data(), source.index, source.sep
    cols, items = _items(data, index, sep)
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
    table = NameRows(buf, start, size, source.resolver, ranges)
    distinct = sort_labels({lab for labs in label_rows for lab in labs})
    where = {lab: i for i, lab in enumerate(distinct)}
    ids = np.asarray([where[lab] for labs in label_rows for lab in labs], dtype=np.int64)
    ptr = np.zeros(len(label_rows) + 1, dtype=np.int64)
    np.cumsum([len(labs) for labs in label_rows], out=ptr[1:])
    return Rows(table, ptr, ids, distinct, lines.__getitem__)


def iter_rows(text: str, sep: str) -> Iterator[tuple[int, list[str]]]:
    """``(line, row)`` of each row of `text` (the header's too) by
    ``csv.reader(strict=True)``, as they are read; ``csv.Error`` with the reader's line
    number in ``err.line``."""
    reader = csv.reader(io.StringIO(text, newline=""), delimiter=sep, strict=True)
    try:
        for row in reader:
            yield reader.line_num, row
    except csv.Error as err:
        err.line = reader.line_num  # type: ignore[attr-defined]
        raise


def header_names(first: bytes, sep: str) -> list[str]:
    """The header's names as the csv module reads the first line `first`, unstripped; []
    where it cannot tell (not UTF-8, or a quoted newline: the header goes on below)."""
    try:
        text = first.decode("utf-8-sig")
        return next(csv.reader([text.rstrip("\r\n")], delimiter=sep, strict=True), [])
    except (UnicodeDecodeError, csv.Error):
        return []


def line_of_row(data: bytes, sep: str, r: int) -> int:
    """The line on which row `r` after the header starts (blank lines are no rows), as the
    csv module reads `data`: for another reader's message about a row, a rare path."""
    rows = iter_rows(data.decode("utf-8-sig"), sep)
    next(rows, None)  # the header
    found = (line for line, row in rows if row and (len(row) > 1 or row[0].strip()))
    for k, line in enumerate(found):
        if k == r:
            return line
    raise IndexError(f"no row {r}")


def _items(data: bytes, index: str, sep: str):
    """``(cols, items)``: the header's :class:`Columns`, and an iterator of ``(line, row,
    name, (offset, length) or None)`` of each row after it that holds an item, checked as
    it comes: a fault raises :class:`BadIndex` where the csv module meets it."""
    rows = _rows(data.decode("utf-8-sig"), index, sep)
    header = next(rows, (0, []))[1]
    if not header:
        raise BadIndex(f"{index}: empty index (no header line)")
    cols = Columns([h.strip() for h in header], index)
    return cols, _checked(rows, cols, index, sep)


def _rows(text: str, index: str, sep: str):
    """``(line, row)`` of each row, as ``csv.reader`` reads them; its error names the line."""
    try:
        yield from iter_rows(text, sep)
    except csv.Error as err:
        raise BadIndex(f"{index}:{err.line}: {err}") from err  # type: ignore[attr-defined]


def _checked(rows, cols: Columns, index: str, sep: str):
    """:func:`_items`'s items: blank lines left out, each other row checked."""
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
            if max(span) > _MOST:
                raise BadIndex(f"{index}:{line}: offset/length past 2**63 - 1")
        yield line, row, name, span
