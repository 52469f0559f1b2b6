"""CSV/TSV text split by pyarrow's CSV reader, where it gives ``csv.reader(strict=True)``'s rows.

pyarrow's reader (C++, both cores) splits a file several times faster than the
numpy passes of :mod:`dataset.csvscan`, and hands each column over as one
buffer of values and an array of offsets into it: the layout of
:class:`dataset.index.NameRows`. It is used only where its rows are provably
the csv module's. A file without quotes is split with quotes off (a local one
read by pyarrow a block at a time): NUL, lone ``\r`` line ends and blank lines
are then read as the csv module reads them. A file with quotes is split as
quoted only when its quotes are RFC 4180's (:func:`dataset.csvscan.check_quotes`)
and it holds no ``\r`` or NUL (a quoted ``\r`` and a lone one differ there).
Otherwise, and for rows with fewer or more fields than the header (ragged
rows, which pyarrow refuses) or text that is not UTF-8, :func:`split` returns
None and the caller falls back to :func:`dataset.csvscan.scan`.

Values come unquoted, their ``""`` escapes undone, NOT stripped: the caller
strips them (:func:`dataset.csvscan.strip`). No pyarrow: :func:`split` is
always None.
"""

from __future__ import annotations

import os

import numpy as np

from .csvscan import QUOTE, check_quotes, find

try:
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.csv as pcsv
except ImportError:  # pragma: no cover - pyarrow is optional; csvscan does the work
    pa = pc = None

# pyarrow parses the file a block of this many bytes at a time (in parallel), a
# column comes back as a chunk per block. Small blocks reuse the parser's buffers
# from the heap: blocks of 16 MiB cost 1.8x the page faults of the parse (most of
# what a split of millions of rows spends) and leave 1.4x the memory.
BLOCK = 1 << 20
# A local file whose first bytes after the header hold a quote is handed back at once.
PEEK = 1 << 16


def pool():
    """The C library's allocator: with pyarrow's default (mimalloc) a 10M-row split
    spent 2.5-5x the kernel time (fresh pages), more than its parse."""
    return pa.system_memory_pool()


class Column:
    """One column of the body (the rows after the header), as pyarrow gives it:
    ``chunks``, a string array per block of the file; ``joined()``, one array."""

    def __init__(self, chunks: list):
        self.chunks = chunks

    def joined(self) -> Names:
        """The values as one buffer and offsets into it (a copy where the file was
        read in several blocks)."""
        array = pa.concat_arrays(self.chunks, memory_pool=pool()) if len(self.chunks) > 1 else (
            self.chunks[0])  # fmt: skip
        return Names(array)


class Names:
    """Value r is ``buf[start[r]:end[r]]``; ``array``, pyarrow's (for its compares)."""

    def __init__(self, array):
        self.array = array
        n = len(array)
        off = np.frombuffer(array.buffers()[1], dtype=np.int32, count=array.offset + n + 1)
        off = off[array.offset :]
        data = array.buffers()[2]
        # from the first value on (a slice after the header still holds its bytes)
        if off[-1] > off[0]:
            self.buf = np.frombuffer(data, dtype=np.uint8)[off[0] : off[-1]]
        else:
            self.buf = np.zeros(1, dtype=np.uint8)  # every value empty
        if off[0]:
            off = off - off[0]
        self.start, self.end = off[:-1], off[1:]


def split(source: str | bytes, sep: str) -> tuple[list[str], list[Column]] | None:
    """``(header, columns)``: the header's values and each column of the rows after it
    (blank lines left out), or None where :func:`dataset.csvscan.scan` must decide.

    `source`: a local file's path (pyarrow reads it a block at a time: no copy of
    the whole file) or the file's bytes. A file read by path is split with quotes
    off and refused (None) if any value holds a quote (at once where its first
    :data:`PEEK` bytes hold one); the caller then hands over its bytes, whose
    quotes are checked before pyarrow reads them as quotes.
    """
    if pa is None or len(sep) != 1 or ord(sep) > 127 or sep in '"\r\n':
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
            with pa.OSFile(source) as f:  # (a file: pyarrow would decompress a ".gz" path)
                got = _read(f, sep, first, quotes=False)
        except OSError:
            return None  # the caller's read names the fault
        if (
            got is None
            or any('"' in h for h in got[0])
            or any(_has_quote(chunk) for col in got[1] for chunk in col.chunks)
        ):
            return None
        return got
    if len(source) >= 2**31:
        return None
    quotes = b'"' in source
    if quotes:  # RFC 4180 quotes only, no "\r" (a quoted one is a value's, a lone one ends
        # a line: the scanner tells them apart), no NUL
        a = np.frombuffer(source, dtype=np.uint8)
        body = 3 if source.startswith(b"\xef\xbb\xbf") else 0
        if b"\r" in source or b"\0" in source:
            return None
        if check_quotes(a, find(a, QUOTE)[0], body, ord(sep)) is None:
            return None
    first = source[: source.find(b"\n")] if b"\n" in source else source
    return _read(pa.py_buffer(source), sep, first, quotes)


def _has_quote(chunk) -> bool:
    if pa.types.is_dictionary(chunk.type):
        chunk = chunk.dictionary
    data = chunk.buffers()[2]
    return data is not None and (np.frombuffer(data, dtype=np.uint8) == QUOTE).any()


def _read(source, sep: str, first: bytes, quotes: bool):
    width = first.count(sep.encode()) + 1  # at least the header's fields
    types = {f"f{k}": pa.string() for k in range(width)}
    if b'"' not in first:  # label columns as ids into a dictionary: no copy of their text
        try:
            header = first.decode("utf-8-sig").split(sep)
        except UnicodeDecodeError:
            header = []
        for k, name in enumerate(header):
            if name.strip().startswith("label"):
                types[f"f{k}"] = pa.dictionary(pa.int32(), pa.string())
    try:
        table = pcsv.read_csv(
            source,
            memory_pool=pool(),
            read_options=pcsv.ReadOptions(autogenerate_column_names=True, block_size=BLOCK),
            parse_options=pcsv.ParseOptions(
                delimiter=sep, quote_char='"' if quotes else False, newlines_in_values=quotes
            ),
            convert_options=pcsv.ConvertOptions(column_types=types),
        )
    except pa.ArrowException:
        return None  # ragged rows, not UTF-8: the scanner reads them, or names the fault
    if table.num_rows == 0:
        return None
    header = [str(v).strip() for v in table.slice(0, 1).to_pylist()[0].values()]
    columns = [Column(c.slice(1).chunks) for c in table.columns]
    return header, columns


def flags(array) -> np.ndarray:
    """A pyarrow boolean array (no nulls) as numpy bools (pyarrow's own conversion
    imports pandas)."""
    bits = np.frombuffer(array.buffers()[1], dtype=np.uint8)
    return np.unpackbits(bits, bitorder="little")[array.offset : array.offset + len(array)].view(
        bool
    )
