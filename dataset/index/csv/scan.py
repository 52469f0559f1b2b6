"""CSV/TSV text split into fields with numpy, as ``csv.reader(strict=True)`` splits it.

An index of tens of millions of rows cannot afford a Python object per field:
:func:`scan` finds the rows and fields of a whole file in a few vectorized
passes over its bytes and describes each field as a ``[start, end)`` range of
the buffer (RFC 4180 quotes, ``""`` escapes, quoted separators and newlines,
``\\r\\n`` line ends). What it cannot vouch for, it leaves to the csv module:
:func:`scan` returns None for a file with NUL bytes, a lone ``\\r`` line end,
or a quote that RFC 4180 does not allow where it stands (``ab"c``, ``"a"b``,
an unterminated quote), and :func:`scan_rows` then reads it with ``csv.reader``
so its results and its errors are exactly the csv module's.

Fields are not stripped here: :meth:`Fields.column` strips them as ``str.strip``
would (``tests/test_csvscan.py`` checks both against ``csv.reader`` on
generated files).
"""

from __future__ import annotations

import codecs
import csv
import io
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from ..cores import in_order, on_two_threads

__all__ = [
    "Fields",
    "check_quotes",
    "edges_clean",
    "find",
    "iter_rows",
    "quotes_ok",
    "scan",
    "scan_rows",
    "strip",
]

QUOTE, NL, CR = 34, 10, 13
# Bytes str.strip() removes that are ASCII (the other whitespace is not ASCII).
_SPACE = np.zeros(256, dtype=bool)
_SPACE[[9, 10, 11, 12, 13, 28, 29, 30, 31, 32]] = True


@dataclass
class Fields:
    """The rows of a CSV file; :meth:`column` gives where field k of each row is.

    ``nl`` are the row ends (a newline, or the end of the data), ``seps`` the
    separators outside quotes. ``per_row``: the number of separators of every
    row when all rows have the same (most files), so row r's are ``seps[m *
    r : m * (r + 1)]`` with no search; else None. ``drop``: positions of the
    second quote of each ``""`` escape (quoted fields only), which is not part
    of the field's value.
    """

    buf: np.ndarray
    body: int  # where the first row starts (after a UTF-8 byte order mark)
    nl: np.ndarray
    seps: np.ndarray
    per_row: int | None
    drop: np.ndarray
    _row_seps: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.nl)

    @property
    def row_seps(self) -> np.ndarray:
        """Where each row's separators begin in ``seps`` (one more entry: the end)."""
        if self._row_seps is None:
            if self.per_row is not None:
                self._row_seps = np.arange(len(self.nl) + 1, dtype=np.int64) * self.per_row
            else:
                found = np.searchsorted(self.seps, self.nl)
                self._row_seps = np.concatenate([[0], found]).astype(np.int64)
        return self._row_seps

    @property
    def counts(self) -> np.ndarray:
        """Fields per row."""
        return np.diff(self.row_seps) + 1

    def column(self, k: int, rows: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """``(start, end)`` of field `k` of each of `rows` (that have it), unquoted, stripped.

        ``rows=None``: every row after the header, which must all have field k.
        """
        m = self.per_row
        if rows is None and m is not None and k <= m:  # strided views, no gathers
            start = self.nl[:-1] + 1 if k == 0 else self.seps[k - 1 + m :: m] + 1
            end = self.seps[k + m :: m] if k < m else self.nl[1:]
            return _clean(self.buf, start, end)
        if rows is None:
            rows = np.arange(1, len(self.nl), dtype=np.int64)
        first = self.row_seps[rows]
        cnt = self.row_seps[rows + 1] - first
        if k == 0:
            start = np.where(rows == 0, self.body, self.nl[np.maximum(rows - 1, 0)] + 1)
        else:
            start = self.seps[first + k - 1] + 1
        if len(self.seps):
            sep_end = self.seps[np.minimum(first + k, len(self.seps) - 1)]
        else:
            sep_end = np.zeros(len(rows), dtype=np.int64)
        end = np.where(k < cnt, sep_end, self.nl[rows])
        return _clean(self.buf, start, end.astype(np.int64, copy=False))

    def line_of(self, row: int) -> int:
        """The 1-based line of the file on which `row` (0 is the header) starts."""
        start = self.body if row == 0 else int(self.nl[row - 1]) + 1
        return int(np.count_nonzero(self.buf[:start] == NL)) + 1


def find(a: np.ndarray, *values: int, chunk: int = 1 << 22) -> list[np.ndarray]:
    """Positions of each of `values` in `a`, found a few MiB at a time.

    One mask the size of a chunk, reused, stays in the CPU's cache: three times
    faster than comparing the whole buffer at once (a mask as large as the file).
    The chunks are shared with a second thread (:func:`dataset.index.cores.on_two_threads`).
    """

    def positions(lows) -> list[list[np.ndarray]]:
        mask = np.empty(min(chunk, len(a)), dtype=bool)
        found = []  # each value's positions in each chunk
        for lo in lows:
            part = a[lo : lo + chunk]
            m = mask[: len(part)]
            found.append([np.flatnonzero(np.equal(part, v, out=m)) + lo for v in values])
        return found

    chunks = in_order(on_two_threads(positions, range(0, len(a), chunk)))
    if not chunks:
        return [np.empty(0, dtype=np.int64) for _ in values]
    return [np.concatenate([found[k] for found in chunks]) for k in range(len(values))]


def _per_row(seps: np.ndarray, nl: np.ndarray, body: int) -> int | None:
    """The separators of every row when all rows have the same number, else None."""
    if not len(nl) or len(seps) % len(nl):
        return None
    m = len(seps) // len(nl)
    if m == 0:
        return 0
    # sorted separators, m per row: the first of each row after the row before it ends,
    # the last before its own row ends
    if seps[0] < body or not (seps[m - 1 :: m] < nl).all() or not (seps[m::m] > nl[:-1]).all():
        return None
    return m


# Bytes that need a closer look at a field's edge: whitespace, a quote, a CR, non-ASCII.
_ODD = _SPACE.copy()
_ODD[[QUOTE, CR]] = True
_ODD[128:] = True
_SPACE_OR_HIGH = _SPACE.copy()
_SPACE_OR_HIGH[128:] = True


def _clean(buf: np.ndarray, start: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Field ranges without the row's ``\\r``, their quotes and surrounding whitespace.

    Most fields need none of it: one look at their first and last bytes picks
    the few that do.
    """
    n = len(buf)
    first = buf[start] if len(start) and int(start.max()) < n else buf[np.minimum(start, n - 1)]
    last = buf[end - 1]  # end >= 1 where the field is not empty (-1 reads a byte, unused)
    odd = np.flatnonzero(_ODD[first] | _ODD[last])
    odd = odd[end[odd] > start[odd]]
    if len(odd):
        start, end = start.copy(), end.copy()
        start[odd], end[odd] = _clean_some(buf, start[odd], end[odd])
    return start, end


def _clean_some(buf: np.ndarray, start: np.ndarray, end: np.ndarray):
    n = len(buf)
    last = np.maximum(end - 1, 0)
    cr = (end > start) & (buf[last] == CR) & (end < n) & (buf[np.minimum(end, n - 1)] == NL)
    end[cr] -= 1
    quoted = (end > start) & (buf[np.minimum(start, n - 1)] == QUOTE)
    start[quoted] += 1
    end[quoted] -= 1
    return _strip_some(buf, start, end)


def edges_clean(buf: np.ndarray, off: np.ndarray) -> bool:
    """Whether no value of the back-to-back values ``buf[off[i]:off[i + 1]]`` (a string
    array's bytes and offsets, ``off[0] == 0``) begins or ends with a byte <= 0x20 or
    >= 0x80 (every byte :func:`strip` looks at, and a few more): where values touch,
    a value's last byte and the next one's first are one 16-bit word, so one gather
    reads both edges (10M names: 51 -> 35 ms). False says nothing: ask :func:`strip`."""
    if len(off) < 2 or off[-1] < 2 or off[-2] == off[-1]:  # (an empty last value: see strip)
        return False
    seams = np.ndarray((int(off[-1]) - 1,), dtype="<u2", buffer=buf, strides=(1,))
    # value i's last byte and value i + 1's first (an index, not take(): numpy would
    # copy the strided view first), then the first and the last byte. -1 only after an
    # empty first value, whose edges do not matter: the word it reads is harmless.
    edge = np.concatenate([seams[off[1:-1] - 1].view(np.uint8), buf[[0, int(off[-1]) - 1]]])
    edge -= np.uint8(0x21)  # (wraps) bytes 0x21-0x7f become 0-0x5e, the others above
    return int(edge.max()) < 0x5F


def strip(
    buf: np.ndarray, start: np.ndarray, end: np.ndarray, chunk: int = 1 << 16
) -> tuple[np.ndarray, np.ndarray]:
    """Value ranges without their surrounding whitespace, as ``str.strip`` strips it
    (new arrays where some range changes; one look at the edge bytes finds them)."""
    n = len(buf)
    found = []
    for lo in range(0, len(start), chunk):  # small temporaries, reused: no fresh pages
        s, e = start[lo : lo + chunk], end[lo : lo + chunk]
        edge = _SPACE_OR_HIGH[buf[np.minimum(s, n - 1)]]
        edge |= _SPACE_OR_HIGH[buf[e - 1]]
        if edge.any():
            found.append(np.flatnonzero(edge & (e > s)) + lo)
    some = np.concatenate(found) if found else ()
    if len(some):
        start, end = start.astype(np.int64), end.astype(np.int64)
        start[some], end[some] = _strip_some(buf, start[some], end[some])
    return start, end


def _strip_some(buf: np.ndarray, start: np.ndarray, end: np.ndarray):
    n = len(buf)
    for edge, step in ((start, 1), (end, -1)):
        while True:
            at = edge if step == 1 else edge - 1
            m = (start < end) & _SPACE[buf[np.clip(at, 0, n - 1)]]
            if not m.any():
                break
            edge[m] += step
    # str.strip() also removes non-ASCII whitespace (NBSP, U+3000...): rare, done in Python
    high = (buf[np.minimum(start, n - 1)] >= 128) | (buf[np.maximum(end - 1, 0)] >= 128)
    for i in np.flatnonzero((start < end) & high).tolist():
        raw = bytes(buf[start[i] : end[i]])
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            continue  # the caller's UTF-8 check names the file
        start[i] += len(raw) - len(text.lstrip().encode("utf-8"))
        end[i] -= len(raw) - len(text.rstrip().encode("utf-8"))
        end[i] = max(end[i], start[i])
    return start, end


def scan(data: bytes, sep: str) -> Fields | None:
    """The fields of `data` (a header row first), or None where ``csv.reader`` must decide."""
    if len(sep) != 1 or ord(sep) > 127 or sep in '"\r\n':
        return None
    if b"\0" in data:
        return None  # csv.reader raises on NUL: let it say so
    a = np.frombuffer(data, dtype=np.uint8)
    body = 3 if data.startswith(codecs.BOM_UTF8) else 0
    seps, nl = find(a, ord(sep), NL)
    drop = np.empty(0, dtype=np.int64)
    quotes = find(a, QUOTE)[0] if b'"' in data else None
    if quotes is not None:
        found = check_quotes(a, quotes, body, ord(sep))
        if found is None:
            return None
        drop = found
        seps = seps[np.searchsorted(quotes, seps) % 2 == 0]  # outside quotes
        nl = nl[np.searchsorted(quotes, nl) % 2 == 0]
    if b"\r" in data:  # a CR outside quotes must end a line with the LF after it
        cr = find(a, CR)[0]
        if quotes is not None:
            cr = cr[np.searchsorted(quotes, cr) % 2 == 0]
        if len(cr) and (
            (cr + 1 >= len(a)).any() or (a[np.minimum(cr + 1, len(a) - 1)] != NL).any()
        ):
            return None
    if len(a) > body and (not len(nl) or nl[-1] != len(a) - 1):
        nl = np.append(nl, len(a))  # a last row without a newline
    seps, nl = seps.astype(np.int64, copy=False), nl.astype(np.int64, copy=False)
    return Fields(a, body, nl, seps, _per_row(seps, nl, body), drop)


def check_quotes(a: np.ndarray, quotes: np.ndarray, body: int, sep: int) -> np.ndarray | None:
    """Check the quotes are RFC 4180's; the positions of the escape quotes to drop, or None.

    Quotes alternate open/close (:func:`_roles` says what each may be). `quotes`:
    every quote's position in `a`.
    """
    if len(quotes) % 2:
        return None  # unterminated: csv.reader raises
    step = max(2, (len(quotes) + 7) // 8 * 2)  # four even spans, two on each thread
    spans = [quotes[lo : lo + step] for lo in range(0, len(quotes), step)]

    def ok(part) -> bool:
        for q in part:
            may_open, may_close = _roles(a, q, body, sep)
            if not (may_open[0::2].all() and may_close[1::2].all()):
                return False
        return True

    if not all(on_two_threads(ok, spans)):
        return None
    opens = quotes[0::2]
    return opens[(opens > 0) & (a[np.maximum(opens - 1, 0)] == QUOTE)]


def quotes_ok(a: np.ndarray, body: int, sep: int, chunk: int = 1 << 19) -> bool:
    """Whether the quotes of `a` are RFC 4180's (:func:`check_quotes` without the
    escapes' positions), half a MiB at a time on two threads: no array of the
    whole file's quotes (32 MB for a 1M-row file with every field quoted), only a
    chunk's. Its temporaries (a few hundred KB) are reused from the heap; a 4 MiB
    chunk's (3 MB each) were fresh pages every time: 15,000 page faults and
    twice the time for a 1M-row file. A chunk is checked both ways (its first
    quote opening a field, or closing one), the count of quotes before it decides."""

    def check(lows) -> list[tuple[int, bool, bool]]:
        mask = np.empty(min(chunk, len(a)), dtype=bool)
        out = []  # (quotes, ok if the first opens, ok if it closes) of each chunk
        for lo in lows:
            part = a[lo : lo + chunk]
            q = np.flatnonzero(np.equal(part, QUOTE, out=mask[: len(part)]))
            q += lo
            may_open, may_close = _roles(a, q, body, sep)
            even = bool(may_open[0::2].all() and may_close[1::2].all())
            odd = bool(may_close[0::2].all() and may_open[1::2].all())
            out.append((len(q), even, odd))
        return out

    closing = False  # an odd number of quotes before the chunk: its first one closes
    for count, even, odd in in_order(on_two_threads(check, range(0, len(a), chunk))):
        if not (odd if closing else even):
            return False
        closing ^= bool(count % 2)
    return not closing  # (unterminated: csv.reader raises)


def _roles(a: np.ndarray, q: np.ndarray, body: int, sep: int) -> tuple[np.ndarray, np.ndarray]:
    """Which of the quotes at `q` may open a field, and which may close one, by RFC
    4180: an opening quote starts a field (after a separator, a ``\\n`` or at `body`)
    or is the second quote of a ``""`` escape (a quote before it, which closed); a
    closing quote ends a field (a separator, a ``\\n``, ``\\r\\n`` or the end follows)
    or is the first of an escape (a quote after it)."""
    n = len(a)
    # (a quote at either end "sees" itself: it may open, or close, there anyway)
    prev = a[np.maximum(q - 1, 0)]
    may_open = (q == body) | (prev == sep) | (prev == NL) | (prev == QUOTE)
    nxt = a[np.minimum(q + 1, n - 1)]
    may_close = (q + 1 >= n) | (nxt == sep) | (nxt == NL) | (nxt == QUOTE)
    cr = np.flatnonzero(nxt == CR)
    if len(cr):
        at = q[cr] + 2
        may_close[cr] |= (at < n) & (a[np.minimum(at, n - 1)] == NL)
    return may_open, may_close


def scan_rows(text: str, sep: str, where: str) -> tuple[list[str], list[tuple[int, list[str]]]]:
    """``(header, [(line, row)])`` by ``csv.reader(strict=True)``: the exact csv semantics.

    For what :func:`scan` leaves to the csv module. Raises ``csv.Error`` with
    the reader's line number in ``err.line``.
    """
    rows = iter_rows(text, sep)
    header = next(rows, (0, []))[1]
    return header, list(rows)


def iter_rows(text: str, sep: str) -> Iterator[tuple[int, list[str]]]:
    """``(line, row)`` of each row of `text` (the header's too) by ``csv.reader(strict=True)``,
    as they are read; ``csv.Error`` with the reader's line number in ``err.line``."""
    reader = csv.reader(io.StringIO(text, newline=""), delimiter=sep, strict=True)
    try:
        for row in reader:
            yield reader.line_num, row
    except csv.Error as err:
        err.line = reader.line_num  # type: ignore[attr-defined]
        raise
