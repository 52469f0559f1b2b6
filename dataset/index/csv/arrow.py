"""The reader ``arrow``: CSV/TSV text split by pyarrow's CSV reader, where it gives
``csv.reader(strict=True)``'s rows.

pyarrow's reader (C++, both cores) hands each column over as one buffer of values and
an array of offsets into it, a chunk per block: the layout of
:class:`dataset.index.rows.NameRows`, which keeps the chunks (:class:`Names`). It
reads a file only where its rows are provably the csv module's
(:mod:`dataset.index.csv.contract`). A file without quotes is split with quotes off
(a local one read by pyarrow a block at a time): NUL, lone ``\\r`` line ends and
blank lines are then read as the csv module reads them. A file with quotes is split
as quoted only when its quotes are RFC 4180's (:func:`dataset.index.csv.text.quotes_ok`)
and it holds no NUL; a ``\\r`` is then read as the csv module reads it; a local one
is mapped, not read. Rows with fewer fields than the header (ragged rows, which
pyarrow's parse refuses) are split again from pyarrow's lines when the file holds no
quote. ``offset``/``length`` columns are read as integers by pyarrow's cast, where
every value is one (decimal digits, an optional sign, ASCII spaces around).
:func:`read` declines (None) the rest: ragged rows in a quoted file, more fields
than the header, text that is not UTF-8, an empty name, offsets that are not
non-negative integers, a separator that is not one ASCII byte; the csv module's
reader reads those or names their fault.

:func:`split`'s values come unquoted, their ``""`` escapes undone, NOT stripped:
:func:`read` strips them (:func:`dataset.index.csv.text.strip`; :class:`Names` does for
the column of names). pyarrow is a requirement of the package (setup.py).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import numpy as np

from ..cores import in_order, on_two_threads
from ..rows import NameRows, small_int
from ..table import sort_labels
from .contract import Buffer, Columns, Rows, Source, packed_labels
from .csvmodule import header_names, line_of_row
from .text import QUOTE, edges_clean, quotes_ok, strip

__all__ = [
    "BLOCK",
    "LINE",
    "PEEK",
    "Column",
    "Names",
    "flags",
    "int32s",
    "pool",
    "read",
    "split",
]

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pcsv

# pyarrow parses the file a block of this many bytes at a time (in parallel), a
# column comes back as a chunk per block. Small blocks reuse the parser's buffers
# from the heap: blocks of 16 MiB cost 1.8x the page faults of the parse (most of
# what a split of millions of rows spends) and leave 1.4x the memory.
BLOCK = 1 << 20
# A local file whose first bytes after the header hold a quote is handed back at once.
PEEK = 1 << 16


# The bytes of an offset/length value pyarrow's cast reads as Python's int() does: its
# cast also reads "0x10" (int() refuses it), so a value holding any other byte is the csv
# module's to read or refuse.
_INTEGER_BYTES = np.zeros(256, dtype=bool)
_INTEGER_BYTES[list(b"0123456789+- \t\n\x0b\x0c\r")] = True


def read(source: Source) -> Rows | None:
    """The rows of `source` as pyarrow splits it, the names left in pyarrow's chunks; None
    where they are not provably the csv module's (see the module's text)."""
    if source.path is None:
        return _rows(split(source.data(), source.sep), source)
    got = _rows(split(source.path, source.sep), source)  # a block at a time, no copy
    if got is not None:
        return got
    # a local file refused for its quotes: split from its pages, mapped rather than read
    # (a copy that cost a sixth of a 1M-row open). Nothing of the mapping outlives the
    # split (pyarrow copies the values): it goes with its last reference, ours at
    # return or, a moment later, that of pyarrow's reader, which its own threads drop.
    pages = source.pages()
    if pages is None or pages.find(b'"') < 0:  # (no quote: refused for another reason)
        return None
    return _rows(split(pages, source.sep), source)


def _rows(got: tuple[list[str], list[Column]] | None, source: Source) -> Rows | None:
    """:func:`read`'s result from :func:`split`'s."""
    if got is None:
        return None
    header, columns = got
    n = sum(len(c) for c in columns[0].chunks)
    if not n:
        return None  # (no rows: the csv module's reader says so)
    cols = Columns(header, source.index)
    ranges = None
    if cols.offset is not None:
        ranges = _ranges(columns[cols.offset].chunks, columns[cols.length].chunks)
        if ranges is None:
            return None
    ptr, ids, labels = _labels([columns[c].chunks for c in cols.labels], n)
    # rows in label order descend (by name) only where the label changes
    names = Names(columns[cols.file].chunks, most=len(labels))
    if names.empty:
        return None
    table = NameRows(names.parts, names.start, names.length, source.resolver, ranges)
    # (the names' descents say nothing of the offsets under one name: sorted, then)
    descents = names.descents if ranges is None else None
    del columns, names
    pool().release_unused()  # what the split held, back to the system
    sep = source.sep
    return Rows(table, ptr, ids, labels, lambda r: line_of_row(source.data(), sep, r),
                descents)  # fmt: skip


def _ranges(offsets: list, lengths: list) -> tuple[np.ndarray, np.ndarray] | None:
    """The offset and length columns as int64 arrays, where every value is a
    non-negative integer as Python's int() reads it; else None."""
    out = []
    for chunks in (offsets, lengths):
        values = [np.empty(0, dtype=np.int64)]
        for c in chunks:
            if not len(c):
                continue
            off = int32s(c, extra=1)  # (the values' bytes: a slice's, not its neighbours')
            buf = c.buffers()[2]
            data = np.frombuffer(buf if buf is not None else b"", dtype=np.uint8)
            if not _INTEGER_BYTES[data[off[0] : off[-1]]].all():
                return None
            try:
                trimmed = pc.ascii_trim_whitespace(c, memory_pool=pool())
                ints = pc.cast(trimmed, pa.int64(), memory_pool=pool())
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
                return None
            got = np.frombuffer(ints.buffers()[1], dtype=np.int64,
                                count=ints.offset + len(ints))[ints.offset :]  # fmt: skip
            if len(got) and int(got.min()) < 0:
                return None
            values.append(got)
        out.append(np.concatenate(values))
    return out[0], out[1]


def _labels(columns: list[list], n: int):
    """``(ptr, ids, names)`` for :class:`Rows`, from the chunks of pyarrow's label columns:
    the distinct values of every chunk's dictionary stripped in Python (a few, where the
    chunks' dictionaries hold thousands of strings) and looked up in the sorted label
    names; each chunk's indices mapped through that small table straight into the ids
    (no unified dictionary, no remap of every id after)."""
    if not columns:
        return packed_labels(np.empty((n, 0), dtype=np.int16), [])
    coded = []  # (column, chunk, its indices)
    for k, col in enumerate(columns):
        for c in col:
            if len(c):
                if not pa.types.is_dictionary(c.type):  # (a header with a quote: read as text)
                    c = pc.dictionary_encode(c, memory_pool=pool())
                coded.append((k, c, int32s(c.indices)))
    every = pa.chunked_array([c.dictionary for _, c, _ in coded], type=pa.string())
    distinct = pc.unique(every, memory_pool=pool())
    value = [v.strip() for v in distinct.to_pylist()]
    maps = pc.index_in(every, value_set=distinct, memory_pool=pool())  # -> distinct, no nulls
    maps = np.concatenate([int32s(m) for m in maps.chunks] or [np.empty(0, np.int32)])
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
    return packed_labels(ids, names, missing="" in found)


def pool():
    """The C library's allocator: with pyarrow's default (mimalloc) a 10M-row split
    spent 2.5-5x the kernel time (fresh pages), more than its parse."""
    return pa.system_memory_pool()


class Column:
    """One column of the body (the rows after the header), as pyarrow gives it:
    ``chunks``, a string array per block of the file."""

    def __init__(self, chunks: list):
        self.chunks = chunks


class Names:
    """The values of a column, stripped (:func:`dataset.index.csv.text.strip`), as
    :class:`dataset.index.rows.NameRows` holds them.

    Value r is ``start[r]:start[r] + length[r]`` of the bytes of ``parts`` one after
    the other: each chunk's values as pyarrow holds them (no copy), or, where the
    first chunk is out of order (the names will be sorted, which needs one buffer),
    those bytes joined into one. ``descents``: the
    rows r whose value is > value r + 1, where no value was stripped and there are
    at most `most` of them (else None: the rows are not in order, or not known to be).
    ``empty``: some value is empty (stripped), and the rest is unset.
    """

    def __init__(self, chunks: list, most: int):
        chunks = [c for c in chunks if len(c)]
        # an unsorted file shows it in its first chunk: its names are then stripped on
        # both cores; else pyarrow compares them all (GIL released) on the other core
        # while numpy strips them here (descents kept only where nothing was stripped)
        sorted_first = len(chunks) < 2 or _descents(chunks[:1], most) is not None
        compare = _Compare(chunks, most) if sorted_first else None
        try:
            self._split(chunks, both=not sorted_first)
        finally:
            descents = compare.result() if compare is not None else None
        if not self.empty:
            self.descents = None if self.stripped else descents

    def _split(self, chunks: list, both: bool) -> None:
        # each chunk on its own (its small temporaries are reused: no fresh pages), on
        # two threads (`both`, dataset.index.cores) where the other core is free
        least = 4 if both else len(chunks) + 1
        pieces = in_order(on_two_threads(lambda part: [_piece(c) for c in part], chunks, least))
        self.empty = any(p is None for p in pieces)
        if self.empty:
            return
        self.stripped = any(p.stripped for p in pieces)
        self.parts = [p.buf for p in pieces]
        at = np.cumsum([0] + [len(p.start) for p in pieces])  # each piece's first row
        base = np.cumsum([0] + [len(b) for b in self.parts])  # and first byte
        self.start = np.empty(int(at[-1]), dtype=small_int(int(base[-1]), signed=False))
        self.length = np.empty(int(at[-1]), dtype=small_int(max(p.longest for p in pieces)))

        # an unsorted file's names will be sorted, which needs them in one buffer: joined
        # here, a chunk at a time on both cores, rather than in one copy later
        joined = np.empty(int(base[-1]), dtype=np.uint8) if both and len(pieces) > 1 else None

        def fill(part) -> None:
            for k in part:
                p, rows = pieces[k], slice(int(at[k]), int(at[k + 1]))
                np.add(p.start, int(base[k]), out=self.start[rows], casting="unsafe")  # (< 2 GiB)
                np.subtract(p.end, p.start, out=self.length[rows], casting="unsafe")
                if joined is not None:
                    joined[int(base[k]) : int(base[k + 1])] = p.buf

        on_two_threads(fill, range(len(pieces)), least=least)
        if joined is not None:
            self.parts = [joined]


class _Piece(NamedTuple):
    """A chunk's values, stripped: ``buf[start[i]:end[i]]``, local to its bytes (where
    nothing was stripped, views of pyarrow's offsets: nothing as large as the chunk is
    made); the longest's length; whether any was stripped."""

    buf: np.ndarray
    start: np.ndarray
    end: np.ndarray
    longest: int
    stripped: bool


def _piece(c) -> _Piece | None:
    """The chunk's :class:`_Piece`; None where a value is empty."""
    off = int32s(c, extra=1)  # a string array's offsets: one more than its values
    if off[-1] == off[0]:
        return None
    buf = np.frombuffer(c.buffers()[2], dtype=np.uint8)[off[0] : off[-1]]
    if off[0]:  # a slice after the header: its bytes come first
        off = off - off[0]
    start, end = off[:-1], off[1:]
    s, e = (start, end) if edges_clean(buf, off) else strip(buf, start, end)
    d = e - s
    if not d.min():
        return None
    return _Piece(buf, s, e, int(d.max()), s is not start or e is not end)


class _Compare(threading.Thread):
    """:func:`_descents` in a thread of its own."""

    def __init__(self, chunks: list, most: int):
        super().__init__(daemon=True)
        self.chunks, self.most = chunks, most
        self.got: np.ndarray | None = None
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            self.got = _descents(self.chunks, self.most)
        except BaseException as err:  # (raised in the caller's thread)
            self.error = err

    def result(self) -> np.ndarray | None:
        self.join()
        if self.error is not None:
            raise self.error
        return self.got


def _descents(chunks: list, most: int) -> np.ndarray | None:
    """The rows r (of the chunks, one after the other) whose value is > value r + 1, or
    None where there are more than `most` (all in one call: pyarrow lines the chunks up)."""
    found = [np.empty(0, dtype=np.int64)]
    if chunks:
        every = pa.chunked_array(chunks)
        row = 0
        for less in pc.less_equal(every[:-1], every[1:], memory_pool=pool()).chunks:
            if len(less):
                found.append(np.flatnonzero(~flags(less)) + row)
                row += len(less)
    if sum(len(f) for f in found) > most:
        return None
    return np.concatenate(found)


def split(source: str | Buffer, sep: str) -> tuple[list[str], list[Column]] | None:
    """``(header, columns)``: the header's values and each column of the rows after it
    (blank lines left out), or None where the csv module's reader must decide.

    `source`: a local file's path (pyarrow reads it a block at a time: no copy of
    the whole file) or the file's bytes (``bytes``, or an ``mmap`` of the file:
    nothing of it is kept). A file read by path is split with quotes
    off and refused (None) if any value holds a quote (at once where its first
    :data:`PEEK` bytes hold one); the caller then hands over its bytes, whose
    quotes are checked before pyarrow reads them as quotes.
    """
    if len(sep) != 1 or ord(sep) > 127 or sep in '"\r\n':
        return None
    if isinstance(source, str):
        try:
            with open(source, "rb") as f:
                if os.fstat(f.fileno()).st_size >= 2**31:  # int32 offsets
                    return None
                first = f.readline()
                head = f.read(PEEK)
            if b'"' in first or b'"' in head:
                return None  # refused below after a split: the caller hands over the bytes
            # (a file: pyarrow would decompress a ".gz" path)
            return _read(lambda: pa.OSFile(source), sep, first, quotes=False,
                         refuse_quotes=True, ragged=_uneven(first, head, sep))  # fmt: skip
        except OSError:
            return None  # the caller's read names the fault
    # (find and slices, not `in` and startswith: an mmap has neither for several bytes)
    if len(source) >= 2**31:
        return None
    end = source.find(b"\n")
    first = source[:end] if end >= 0 else source[:]
    if source.find(b'"') < 0:
        return _read(lambda: pa.py_buffer(source), sep, first, quotes=False)
    if source.find(b"\0") >= 0:
        return None
    # RFC 4180 quotes only (a quote opens a field after a separator or a "\n", closes one
    # before a separator, "\n" or "\r\n"). A "\r" is read as the csv module reads it: a
    # quoted one is the value's, another ends a line. (Checked while pyarrow parses, the
    # two took as long as one after the other: both use both cores.)
    if not _quotes_ok(source, sep):
        return None
    return _read(lambda: pa.py_buffer(source), sep, first, quotes=True)


def _quotes_ok(source: Buffer, sep: str) -> bool:
    """Whether the quotes of `source` are RFC 4180's (:func:`dataset.index.csv.text.quotes_ok`)."""
    body = 3 if source[:3] == b"\xef\xbb\xbf" else 0
    return quotes_ok(np.frombuffer(source, dtype=np.uint8), body, ord(sep))


def _read(opener, sep: str, first: bytes, quotes: bool, refuse_quotes: bool = False,
          ragged: bool = False):  # fmt: skip
    """`split`'s result from what ``opener()`` opens (a file or a buffer), read by
    pyarrow's CSV reader; a file without quotes whose rows may stop early, by
    :func:`_ragged` (at once with `ragged`: its first lines do)."""
    width = first.count(sep.encode()) + 1  # at least the header's fields
    types = {f"f{k}": pa.string() for k in range(width)}
    for k, name in enumerate(header_names(first, sep)):  # label columns as ids into a
        if name.strip().startswith("label"):  # dictionary: no copy of their text
            types[f"f{k}"] = pa.dictionary(pa.int32(), pa.string())
    try:
        table = _ragged(opener, sep, types) if ragged else _parse(opener, sep, types, quotes)
    except pa.ArrowException:  # a row with fewer fields than the header (or more), or
        # one longer than a block ("straddles two block boundaries"): without quotes
        # _ragged reads both, with quotes a parse in one block reads the long row
        table = _parse_whole(opener, sep, types) if quotes else _ragged(opener, sep, types)
    # `refuse_quotes`: a file read with quotes off whose bytes were not looked at; a
    # value holding a quote is the csv module's (it reads it as a quote). Not UTF-8: the
    # csv module's reader names the line. Ragged rows in a file with quotes, more fields
    # than the header: the csv module reads them, or names the fault.
    if table is None or table.num_rows == 0 or not _values_ok(table, refuse_quotes):
        return None
    header = [str(v).strip() for v in table.slice(0, 1).to_pylist()[0].values()]
    columns = [Column(c.slice(1).chunks) for c in table.columns]
    return header, columns


def _uneven(first: bytes, head: bytes, sep: str) -> bool:
    """Whether a whole line of `head` (the bytes after the header line `first`) has
    more or fewer fields than the header, as a file without quotes: pyarrow's parse
    would fail on it (after parsing the blocks before), so :func:`_ragged` reads it."""
    lines = head.splitlines()
    if len(head) == PEEK:
        lines = lines[:-1]  # (cut short)
    sep_b = sep.encode()
    fields = first.count(sep_b)
    return any(line.count(sep_b) != fields for line in lines if line)


def _parse(opener, sep: str, types: dict, quotes: bool, block: int | None = None):
    """pyarrow's read of what ``opener()`` opens, columns ``f0, f1...`` of `types`, in
    blocks of `block` bytes (:data:`BLOCK`)."""
    source = opener()
    try:
        return pcsv.read_csv(
            source,
            memory_pool=pool(),
            read_options=pcsv.ReadOptions(
                autogenerate_column_names=True, block_size=block or BLOCK
            ),
            parse_options=pcsv.ParseOptions(
                delimiter=sep, quote_char='"' if quotes else False, newlines_in_values=quotes
            ),
            # UTF-8 is checked after, where a byte is not ASCII: pyarrow checks every value
            convert_options=pcsv.ConvertOptions(column_types=types, check_utf8=False),
        )
    finally:
        if isinstance(source, pa.NativeFile):
            source.close()


def _parse_whole(opener, sep: str, types: dict, quotes: bool = True):
    """:func:`_parse` in one block, for a file larger than a block (else None): a row
    longer than a block fails the parse in blocks, and is read in one (pyarrow says only
    "straddling object" for it: this is the parse after any failed one, so it runs for
    ragged quoted files too, which fail it again and are the csv module's)."""
    source = opener()
    try:
        size = source.size() if isinstance(source, pa.NativeFile) else len(source)
    finally:
        if isinstance(source, pa.NativeFile):
            source.close()
    if size <= BLOCK:
        return None
    try:
        return _parse(opener, sep, types, quotes, block=min(size + 1, 2**31 - 1))
    except pa.ArrowException:
        return None


# The delimiter that reads a file's lines whole: a byte no index line holds (a line
# that does holds two fields, which pyarrow refuses: the csv module's then).
LINE = "\x1f"


def _ragged(opener, sep: str, types: dict):
    """The table of a file without quotes whose rows may stop before the header's last
    field (ragged rows: the csv module reads them, pyarrow's reader refuses them), as
    pyarrow would give it with the missing fields empty (an empty label is no label; an
    empty name is the csv module's, which names its line); None for a row with more fields
    than the header. pyarrow reads the lines whole (one column, with its line ends,
    blank lines and blocks, both cores), then ``split_pattern`` splits each line and
    ``take`` gathers each column, a block per task on both cores."""
    if sep == LINE:
        return None
    try:
        lines = _parse(opener, LINE, {"f0": pa.string()}, quotes=False)
    except pa.ArrowException:  # a line longer than a block, or one that holds LINE
        lines = _parse_whole(opener, LINE, {"f0": pa.string()}, quotes=False)
        if lines is None:
            return None
    if lines.num_columns != 1:  # every line holds LINE (the header decides the columns)
        return None
    lines = lines.column(0)
    names = list(types)

    def columns(chunk) -> list | None:
        fields = pc.split_pattern(chunk, pattern=sep, memory_pool=pool())
        off = int32s(fields, extra=1)
        count = np.diff(off)
        if int(count.max()) > len(names):
            return None
        values, first = fields.values, off[:-1]  # (offsets into values, sliced or not)
        out = []
        for k, name in enumerate(names):
            has = count > k
            valid = None if has.all() else pa.py_buffer(np.packbits(has, bitorder="little"))
            at = pa.Array.from_buffers(pa.int32(), len(chunk), [valid, pa.py_buffer(first + k)])
            col = pc.take(values, at, memory_pool=pool())
            if valid is not None:  # a missing field: a null of no bytes, read as "" without
                # its validity bitmap (fill_null's "" goes through pyarrow's conversion of
                # Python values, which imports pandas: 0.1 s in a fresh process)
                if (np.diff(int32s(col, extra=1))[~has] != 0).any():
                    return None  # (take leaves no bytes in a null: never seen)
                _, offsets, data = col.buffers()
                col = pa.StringArray.from_buffers(len(col), offsets, data, offset=col.offset)
            if pa.types.is_dictionary(types[name]):
                col = pc.dictionary_encode(col, memory_pool=pool())
            out.append(col)
        return out

    chunks = [c for c in lines.chunks if len(c)]
    if not chunks:
        return None
    with ThreadPoolExecutor(2) as workers:  # (pyarrow's kernels let go of the GIL)
        got = list(workers.map(columns, chunks))
    if any(g is None for g in got):
        return None
    return pa.table({n: pa.chunked_array([g[k] for g in got]) for k, n in enumerate(names)})


def _values_ok(table, refuse_quotes: bool) -> bool:
    """Whether every value of `table` is UTF-8 (and holds no quote, with
    `refuse_quotes`): a look at each chunk's bytes, and pyarrow's full UTF-8 check
    only of a chunk whose bytes are not all ASCII (several times faster than
    pyarrow's check of every value, a fifth of a 10M-row parse), the chunks shared
    by two threads (:func:`dataset.index.cores.on_two_threads`)."""
    chunks = []
    for column in table.columns:
        for chunk in column.chunks:
            if pa.types.is_dictionary(chunk.type):
                chunk = chunk.dictionary
            data = chunk.buffers()[2]
            if data is not None and data.size:
                chunks.append((chunk, np.frombuffer(data, dtype=np.uint8)))

    def ok(part) -> bool:
        for chunk, data in part:
            if refuse_quotes and (data == QUOTE).any():
                return False
            if np.bitwise_or.reduce(data) & 0x80:
                try:
                    chunk.validate(full=True)
                except pa.ArrowInvalid:
                    return False
        return True

    return all(on_two_threads(ok, chunks, least=8))


def int32s(array, extra: int = 0) -> np.ndarray:
    """The first int32 buffer of a pyarrow array without nulls (an int32 array's values, a
    string array's offsets with `extra=1`) as numpy's, no copy (pyarrow's own conversion
    of a chunked array imports pandas)."""
    n = array.offset + len(array) + extra
    return np.frombuffer(array.buffers()[1], dtype=np.int32, count=n)[array.offset :]


def flags(array) -> np.ndarray:
    """A pyarrow boolean array (no nulls) as numpy bools (pyarrow's own conversion
    imports pandas)."""
    bits = np.frombuffer(array.buffers()[1], dtype=np.uint8)
    return np.unpackbits(bits, bitorder="little")[array.offset : array.offset + len(array)].view(
        bool
    )
