"""The reader ``arrow`` (pyarrow's split) against the csv module's reader: the same index.

Index files are written by ``csv.writer`` (minimal and full quoting, LF and CRLF
line ends, a byte order mark, no newline at the end, blank lines) from names and
labels full of separators, quotes, newlines, whitespace (ASCII and not) and non-ASCII
text, with empty labels and several label columns, then opened through the readers'
seam both ways: ``readers=("arrow", "csv")`` (pyarrow where it vouches for the
result) and ``readers=("csv",)``. Ragged rows, lone CRs, NULs and quotes RFC 4180
does not allow must be declined by pyarrow, and read (or refused) by the csv module
as before. The C reader is compared with both in test_csvlines.py.
"""

from __future__ import annotations

import csv
import random
import time

import numpy as np
import pytest
from test_csvtext import summary, write_rows

from distlearn.dataset import BadIndex
from distlearn.dataset.index import rows as index_rows
from distlearn.dataset.index.csv import arrow as csvarrow
from distlearn.dataset.index.csv import contract
from distlearn.dataset.index.csv.reader import from_csv

NAME = ["a", "b", "/", ".", "é", "x y", ",", '"', "\n", "\r\n", "\t", " ", "\u00a0", "\u3000"]
LABELS = ["cat", "dog", "10", "2", "a,b", 'say "hi"', "  x  ", "x", "\u00a0é\u00a0", ""]


def _rows(rng: random.Random, n: int, plain: bool, width: int) -> list[list[str]]:
    alphabet = NAME[:6] if plain else NAME
    labels = [x for x in LABELS if not (plain and ('"' in x or "," in x))]
    rows = [["filename"] + [f"label{k}" for k in range(width)]]
    for _ in range(n):
        name = "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 6)))
        rows.append([f"n{name}z", *(rng.choice(labels) for _ in range(width))])
    return rows


class Routes:
    """Which reader gave each open: pyarrow by path, pyarrow from bytes, or neither."""

    def __init__(self, monkeypatch):
        self.taken: list[str] = []
        real = csvarrow.split

        def split(source, sep):
            got = real(source, sep)
            if got is not None:
                self.taken.append("path" if isinstance(source, str) else "bytes")
            return got

        monkeypatch.setattr(csvarrow, "split", split)


def opened(path, ways, **kw):
    """The index (or its error's text) as from_csv reads it with each of `ways`, a tuple
    of reader names each (None: every reader, as a user's open asks them)."""
    got = []
    for readers in ways:
        try:
            got.append(from_csv(str(path), readers=readers, **kw))
        except BadIndex as err:
            got.append(str(err))
    return got


# pyarrow where it vouches for the rows (else the csv module), then the csv module alone
ARROW_WAYS = [("arrow", "csv"), ("csv",)]


def both_ways(path, **kw):
    """The index as pyarrow reads it (the csv module where pyarrow declines), and as the
    csv module reads it."""
    return opened(path, ARROW_WAYS, **kw)


def same(indexes) -> None:
    first, *others = indexes
    for other in others:
        if isinstance(first, str) or isinstance(other, str):
            assert first == other
            continue
        assert first.labels == other.labels
        assert summary(first) == summary(other)
        assert first.rows.tolist() == other.rows.tolist()
        assert [first.table.raw(r) for r in range(first.num_rows)] == [
            other.table.raw(r) for r in range(other.num_rows)
        ]


@pytest.mark.parametrize("quoting", [csv.QUOTE_MINIMAL, csv.QUOTE_ALL])
@pytest.mark.parametrize("terminator", ["\n", "\r\n"])
@pytest.mark.parametrize("plain", [True, False])
def test_pyarrow_split_gives_the_csv_module_s_index(
    tmp_path, monkeypatch, quoting, terminator, plain
):
    rng = random.Random(f"{quoting}{terminator!r}{plain}")
    path = tmp_path / "index.csv"
    routes = Routes(monkeypatch)
    for trial in range(8):
        rows = _rows(rng, 150, plain, width=trial % 3)
        if trial % 2:
            rows[1:] = sorted(rows[1:], key=lambda r: (r[1:2], r[0]))  # the sorted-file shortcut
        data = write_rows(rows, quoting, terminator)
        if trial % 4 == 1:
            data = b"\xef\xbb\xbf" + data  # a byte order mark
        if trial % 4 == 2:
            data = data[: -len(terminator)]  # no newline at the end
        if trial % 4 == 3:
            data = data.replace(terminator.encode(), terminator.encode() * 2, 3)  # blank lines
        path.write_bytes(data)
        routes.taken.clear()
        got = both_ways(path)
        assert not isinstance(got[0], str), got[0]
        same(got)
        assert routes.taken == (["path"] if b'"' not in data else ["bytes"])


@pytest.mark.parametrize(
    "data",
    [
        b"filename,label\na.png,x\nb.png\nc.png,y\n",  # ragged: fewer fields
        b"filename,label1,label2\na.png,x\nb.png,y,z\n",
        b"filename,label\na.png,x\nb.png,y,z\n",  # more fields than the header
        b"filename,label\na.png,x\n   \nb.png,y\n",  # a line of spaces is blank
        b'filename,label\na.png,x\n"b.png",y\nab"c,d\n',  # a quote inside a field
        b'filename,label\na.png,x\n"x"y,d\n',  # text after a closing quote
        b"filename,label\na.png,x\rb.png,y\r\n",  # a lone CR ends a line
        b"filename,label\na.png,x\nb\0.png,y\n",  # NUL
        b"filename,label\na.png,x\n,y\n",  # an empty filename
        b"filename,label\na.png,x\n  ,y\n",
        b"filename\na.png\n\n  \nb.png\n",
        b"filename,label\n",  # no items
        b"filename,label\na.png,\xff\n",  # not UTF-8
        b"filename,label\na.png,\xed\xa0\x80\n",  # a surrogate: not UTF-8 for Python
        b"filename,offset,length\na.bin,1,2\nb.bin, 3 ,4\n",
        b'filename,label\n"a\rb.png",x\n',  # a quoted CR
        b"filename,label\na.png,x\nb.png,\t\n c.png , y \n",
        b"file,label\na.png,x\n",  # no filename column
        b"",  # empty, or a byte order mark alone
        b"\xef\xbb\xbf",
        b'"',  # a lone quote
        b'"filename\n",label\na.png,x\n',  # a quoted newline in the header
        b'\xef\xbb\xbf"filename","label"\r\n"a.png","x"\r\n',
        b'"filename","label"\r\n"a.png","x"\r',  # a lone CR after a closing quote
        b'"filename","label"\r\n"a.png","x"\r\r\n',
        b'"filename","label"\n"a.png","x"""\n',  # an escape before the closing quote
        b'"filename","label"\n"a.png"x,"y"\n',  # text after a closing quote
        b'"filename","label1","label2"\n"a.png","x"\n',  # ragged and quoted
        b'"filename","label"\n"a\x00.png","x"\n',  # NUL in a quoted name
    ],
)
def test_what_pyarrow_refuses_reads_as_before(tmp_path, monkeypatch, data):
    path = tmp_path / "i.csv"
    path.write_bytes(data)
    same(both_ways(path))


@pytest.mark.parametrize(
    ("data", "fault"),
    [
        # a short row before one with too many fields: the short one is named
        (b"label,filename\nx\na,b,c\n", "i.csv:2: missing fields ['filename']: ['x']"),
        (b"filename,offset,length\nn1,1,2\nn2,x,3\nn3,4\n",
         "i.csv:3: offset/length must be integers, got 'x'/'3'"),
        # the row's values as written, not stripped
        (b"filename,offset,length\nn1,1,2\nn33 \n",
         "i.csv:3: missing fields ['offset', 'length']: ['n33 ']"),
        (b"label,filename\n x \n", "i.csv:2: missing fields ['filename']: [' x ']"),
    ],
)  # fmt: skip
def test_a_faulty_index_is_told_its_first_faulty_row_as_written(tmp_path, monkeypatch, data, fault):
    """The error the user reads is the csv module's: the first faulty row in the file, its
    values as written (a reader that checked each kind of fault over all rows in turn, on
    stripped values, told another row: found by fuzzing the readers)."""
    path = tmp_path / "i.csv"
    path.write_bytes(data)
    got = both_ways(path)
    assert isinstance(got[0], str) and got[0].endswith(fault), got
    same(got)


@pytest.mark.parametrize(
    ("data", "filled"),
    [  # an index whose lines end with separators; the same with a value past the header
        (b"filename,label\na.png,cat,\nb.png,dog\n", b"filename,label\na.png,cat,x\n"),
        (b"filename,label\na.png,cat,,\nb.png,dog, \n", b"filename,label\na.png,cat,,x\n"),
        (b'"filename","label"\r\n"a.png","cat",\r\n"b.png","dog",""\r\n',
         b'"filename","label"\r\n"a.png","cat","x"\r\n'),
        (b"filename\ta\tlabel\nx.png\t\tcat\t\n", b"filename\ta\tlabel\nx.png\t\tcat\tx\n"),
    ],
)  # fmt: skip
def test_empty_fields_past_the_header_are_no_error(tmp_path, monkeypatch, data, filled):
    """torch-dataset's reader skips empty fields, so its indexes may end lines with a
    separator; those fields hold no data, and every route reads the rows as if they
    were not there. A field past the header that holds something is still refused."""
    kw = {"sep": "\t"} if b"\t" in data else {}
    path = tmp_path / "i.csv"
    path.write_bytes(data)
    got = both_ways(path, **kw)
    same(got)
    assert not isinstance(got[0], str), got[0]
    names = [got[0].table.raw(r) for r in range(got[0].num_rows)]
    assert names == (["x.png"] if kw else ["a.png", "b.png"])
    path.write_bytes(filled)
    got = both_ways(path, **kw)
    same(got)
    assert isinstance(got[0], str) and "for a header of" in got[0], got[0]


# what a byte-level mutation inserts: separators, quotes, line ends, NUL, whitespace,
# non-ASCII and bytes that are not UTF-8, the byte that reads lines whole
MUTATIONS = [b"a", b"0", b".", b"/", b",", b",,", b"\t", b" ", b'"', b'""', b"\n", b"\r", b"\r\n",
             b"\n\n", b"\0", "\u00e9".encode(), "\u00a0".encode(), b"\xff", b"\x1f"]  # fmt: skip


def _mutated_index(rng: random.Random) -> tuple[bytes, str]:
    """A generated index (0-3 label columns, maybe offset/length, columns in any order,
    some rows cut short), then up to 5 bytes inserted or deleted anywhere."""
    cols = ["filename"] + [f"label{k}" for k in range(rng.randrange(4))]
    if rng.random() < 0.15:
        cols += ["offset", "length"]
    if rng.random() < 0.2:
        rng.shuffle(cols)
    sep = rng.choice([",", "\t"]) if rng.random() < 0.2 else ","
    labels = [b"cat", b"dog", b"10", b"2", b" x ", b"", "\u00e9".encode(), b'"q"', b'"a,b"']
    suffixes = [b"", b".png", b" ", b"/x"]
    lines = [sep.join(cols).encode()]
    for _ in range(rng.randrange(1, 400)):
        fields = []
        for c in cols:
            if c == "filename":
                fields.append(b"n%d%s" % (rng.randrange(50), rng.choice(suffixes)))
            elif c.startswith("label"):
                fields.append(rng.choice(labels))
            else:
                fields.append(b"%d" % rng.randrange(100))
        cut = rng.randrange(1, len(fields) + 1) if rng.random() < 0.1 else len(fields)
        lines.append(sep.encode().join(fields[:cut]))
    end = rng.choice([b"\n", b"\r\n"])
    data = bytearray(end.join(lines) + (end if rng.random() < 0.8 else b""))
    if rng.random() < 0.1:
        data[:0] = b"\xef\xbb\xbf"
    for _ in range(rng.choice([0, 0, 0, 1, 2, 5])):
        at = rng.randrange(len(data) + 1)
        if rng.random() < 0.7:
            data[at:at] = rng.choice(MUTATIONS)
        elif at < len(data):
            del data[at]
    return bytes(data), sep


def test_mutated_indexes_read_as_the_csv_module_reads_them(tmp_path, monkeypatch):
    """400 generated indexes with bytes inserted and deleted at random, over many blocks:
    pyarrow's split and the csv module give the same index or the same
    error (the first faulty row, as written)."""
    monkeypatch.setattr(csvarrow, "BLOCK", 1 << 12)
    errors = compared_on_mutated(tmp_path, 400, lambda path: both_ways(path))
    assert 20 < errors < 200  # (both indexes and faults were compared)


def compared_on_mutated(tmp_path, seeds: int, ways) -> int:
    """``same(ways(path))`` for the indexes of :func:`_mutated_index`'s first `seeds`
    seeds; how many of them were errors."""
    errors = 0
    for seed in range(seeds):
        data, sep = _mutated_index(random.Random(seed))
        path = tmp_path / ("i.tsv" if sep == "\t" else "i.csv")
        path.write_bytes(data)
        got = ways(path)
        same(got)
        errors += isinstance(got[0], str)
    return errors


def test_tsv_and_many_rows_across_blocks(tmp_path, monkeypatch):
    monkeypatch.setattr(csvarrow, "BLOCK", 1 << 12)  # many blocks: chunks joined
    rng = random.Random(0)
    rows = _rows(rng, 3000, plain=True, width=2)
    path = tmp_path / "i.tsv"
    path.write_bytes(write_rows(rows, csv.QUOTE_MINIMAL, "\n", sep="\t"))
    routes = Routes(monkeypatch)
    same(both_ways(path))
    assert routes.taken[:1] == ["path"]


@pytest.mark.parametrize("sep", [",", "\t"])
def test_ragged_rows_are_pyarrow_s_lines_split_by_field(tmp_path, monkeypatch, sep):
    """Rows that stop before the header's last field (multi-label indexes), over many
    blocks, with blank and whitespace lines, CRLF and lone CR line ends: pyarrow reads
    the lines, and the index is the csv module's; a row with more fields than the
    header, or an empty name, is the csv module's (it names the line)."""
    monkeypatch.setattr(csvarrow, "BLOCK", 1 << 10)
    rng = random.Random(sep)
    routes = Routes(monkeypatch)
    for trial in range(10):
        width = 1 + trial % 3
        rows = [["filename"] + [f"label{k}" for k in range(width)]]
        for _ in range(300):
            labels = [rng.choice(["cat", "dog", " x ", "", "é"]) for _ in range(width)]
            rows.append([f"n{rng.randrange(10**6)}.png", *labels[: rng.randrange(width + 1)]])
        if trial % 2:  # names in order: examples sorted by label alone (a stable sort)
            rows[1:] = sorted(rows[1:])
        data = write_rows(rows, csv.QUOTE_MINIMAL, rng.choice(["\n", "\r\n"]), sep=sep)
        if trial % 4 == 1:
            data = data.replace(b"png\n", b"png\n\n", 5).replace(b"png\n", b"png\n  \n", 3)
        if trial % 4 == 2:
            data = data.replace(b"\n", b"\r", 7)  # lone CR line ends
        path = tmp_path / "i.tsv"
        path.write_bytes(data)
        routes.taken.clear()
        got = both_ways(path, sep=sep)
        same(got)
        assert not isinstance(got[0], str), got[0]
        if trial % 4 != 1:  # (a whitespace line is an empty name: the csv module's)
            assert routes.taken == ["path"], trial
    # 0x1f, the byte that reads lines whole, in one line or in every line (the header's too)
    for data in (b"filename,label1,label2\nn0.png,a\x1fb\nn1.png\n",
                 b"filename,label1,label2\x1f\nn0.png,a\x1fb\nn1.png\x1fc\n"):  # fmt: skip
        path = tmp_path / "unit.csv"
        path.write_bytes(data)
        routes.taken.clear()
        got = both_ways(path)
        same(got)
        assert routes.taken == [] and "a\x1fb" in got[0].labels
    for bad in (b"n1.png\n", b"n1.png,x,y,z,w\n", b",x\n"):  # too many fields, no name
        path = tmp_path / "bad.csv"
        path.write_bytes(b"filename,label1,label2\nn0.png,a\n" + bad)
        routes.taken.clear()
        got = both_ways(path)
        same(got)
        assert routes.taken == ([] if bad.count(b",") > 2 else ["path"])  # (an empty name:
        # split by pyarrow, then declined for the csv module)


def test_quoted_crs_and_mixed_line_ends_across_blocks(tmp_path, monkeypatch):
    """CRs in quoted values (alone, in CRLF, before a separator) and CRLF, LF and lone CR
    line ends, over many small blocks: the index is the csv module's, whichever reader
    reads it."""
    monkeypatch.setattr(csvarrow, "BLOCK", 1 << 9)
    rng = random.Random(5)
    values = ["a", "b\r", "\rc", "d\r\ne", "f\ng", "h,i", 'j"k', "l\r,", " m "]
    routes = Routes(monkeypatch)
    taken = set()
    for trial in range(12):
        rows = [["filename", "label"]]
        rows += [["".join(rng.choice(values) for _ in range(3)), rng.choice(["x", "y\r", ""])]
                 for _ in range(60)]  # fmt: skip
        data = write_rows(rows, csv.QUOTE_MINIMAL if trial % 2 else csv.QUOTE_ALL, "\r\n")
        if trial % 3 == 1:  # some rows end with LF or a lone CR instead
            lines = data.split(b"\r\n")
            data = b"".join(line + rng.choice([b"\r\n", b"\n", b"\r"]) for line in lines[:-1])
        path = tmp_path / "i.csv"
        path.write_bytes(data)
        routes.taken.clear()
        same(both_ways(path))
        taken.update(routes.taken)
    assert "bytes" in taken  # quoted files with CRs are pyarrow's now


@pytest.mark.parametrize(
    "late",
    [
        (b"n9\xffz", "not UTF-8"),  # pyarrow does not check UTF-8; a look at the bytes does
        (b"n9\xed\xa0\x80z", "not UTF-8"),  # a surrogate
        (b'n9"z', None),  # a quote far past the first block: not the path's to split
        ("n9\u00e9\u3000z".encode(), None),  # non-ASCII UTF-8: split by pyarrow still
    ],
)
@pytest.mark.parametrize("at", [4000, 3700])  # in the last block, or the one before it
def test_a_late_odd_value_among_many_blocks(tmp_path, monkeypatch, late, at):
    """Many blocks (their checks shared by two threads, alternate blocks each): one odd
    value in one of the last blocks is found, and the index or error is the csv
    module's."""
    monkeypatch.setattr(csvarrow, "BLOCK", 1 << 12)
    name, error = late
    rows = [b"n%06dz,c%d\n" % (i, i % 7) for i in range(4000)]
    rows.insert(at, name + b",c1\n")
    path = tmp_path / "i.csv"
    path.write_bytes(b"filename,label\n" + b"".join(rows))
    routes = Routes(monkeypatch)
    got = both_ways(path)
    same(got)
    if error:
        assert isinstance(got[0], str) and error in got[0], got[0]
    split_by_path = error is None and b'"' not in name
    assert routes.taken == (["path"] if split_by_path else [])


def test_sorted_rows_across_blocks_keep_their_chunks(tmp_path, monkeypatch):
    """A file in label-then-name order keeps its names in pyarrow's chunks (no join, no
    sort; names fall where the label changes) and reads as the csv module's; a name smaller
    than the one before it, at a chunk's first row or the next, is sorted."""
    monkeypatch.setattr(csvarrow, "BLOCK", 1 << 12)
    rows = [["filename", "label"]] + [[f"n{i:06d}z", "a"] for i in range(3000, 6000, 2)]
    rows += [[f"n{i:06d}z", "b"] for i in range(0, 3000, 2)]  # (smaller names, a later label)
    path = tmp_path / "i.csv"
    path.write_bytes(write_rows(rows, csv.QUOTE_MINIMAL, "\n"))
    with monkeypatch.context() as m:
        m.setattr(index_rows.NameRows, "order", None)  # no sort
        got = from_csv(str(path), readers=ARROW_WAYS[0])
    assert got.table._parts is not None and len(got.table._parts) > 5
    same([got, *both_ways(path)])
    assert got.rows.tolist() == list(range(len(rows) - 1))
    _, columns = csvarrow.split(str(path), ",")
    for at in (len(columns[0].chunks[0]), len(columns[0].chunks[0]) + 1):  # the chunk's first
        bent = [r[:] for r in rows]  # row, then the next: the same bytes in each block
        bent[at][0] = "n003001z"
        path.write_bytes(write_rows(bent, csv.QUOTE_MINIMAL, "\n"))
        got = both_ways(path)
        same(got)
        assert got[0].rows.tolist()[:2] == [0, at - 1]


@pytest.mark.parametrize("stripped", [False, True])
def test_unsorted_rows_across_blocks_are_joined_for_their_sort(tmp_path, monkeypatch, stripped):
    """A file whose first block is out of order has its names stripped on two threads and
    joined into one buffer there (its sort needs one): the index is the csv module's,
    stripped names included, and no join is left for the sort to make."""
    monkeypatch.setattr(csvarrow, "BLOCK", 1 << 12)
    rng = random.Random(int(stripped))
    names = [f"n{rng.randrange(10**6):06d}z" for _ in range(3000)]
    if stripped:
        names = [f"  {n}\t" if k % 7 == 0 else n for k, n in enumerate(names)]
    rows = [["filename", "label"]] + [[n, f"c{k % 5}"] for k, n in enumerate(names)]
    path = tmp_path / "i.csv"
    path.write_bytes(write_rows(rows, csv.QUOTE_MINIMAL, "\n"))
    joined = []
    real = index_rows.NameRows.__init__

    def spy(self, buf, *a, **kw):
        joined.append(isinstance(buf, list) and len(buf) == 1)
        real(self, buf, *a, **kw)

    with monkeypatch.context() as m:
        m.setattr(index_rows.NameRows, "__init__", spy)
        got = from_csv(str(path), readers=ARROW_WAYS[0])
    assert joined == [True]
    _, columns = csvarrow.split(str(path), ",")
    assert len(columns[0].chunks) > 5
    same([got, *both_ways(path)])


@pytest.mark.parametrize(
    "data",
    [
        b"filename\tlabel\na.png\tx\n\t\nb.png\ty\n",  # a line of one separator: two fields
        b"filename\tlabel\na.png\tx\n  \nb.png\ty\n",  # a line of spaces is blank
        b"filename\tlabel\na.png\tx\n \t \nb.png\ty\n",
        b"filename\tlabel\na.png\tx\nb.png\t\n",
        b"filename label\na.png x\n  \nb.png y\n",  # spaces: three empty fields
        b"filename label\na.png x\n\t\nb.png y\n",
        b"filename;label\na.png;x\n \t\nb.png;y\n",
        b"filename|label\na.png|x\n\x0b\nb.png|y\n",
        b"filename,label\na.png,x\n\x0c\nb.png,y\n",
    ],
)
def test_blank_and_separator_lines(tmp_path, monkeypatch, data):
    """Lines of whitespace, or of separators, with any separator: blank or fields, as the
    csv module reads them."""
    path = tmp_path / "i.csv"
    path.write_bytes(data)
    same(both_ways(path, sep=chr(data[8])))


def test_a_path_is_a_path(tmp_path, monkeypatch):
    """A local name a reader could take as more than a name (a compressed file by its
    suffix, "~" for the home folder) is read as its bytes, as the csv module reads them."""
    import gzip

    plain = b"filename,label\na.png,cat\nb.png,dog\n"
    (tmp_path / "i.csv.gz").write_bytes(gzip.compress(plain))
    same(both_ways(tmp_path / "i.csv.gz", sep=","))
    home = tmp_path / "home"
    home.mkdir()
    (home / "i.csv").write_bytes(b"filename,label\nother.png,cat\n")
    (tmp_path / "~").mkdir()
    (tmp_path / "~" / "i.csv").write_bytes(plain)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(tmp_path)
    index = from_csv("~/i.csv", readers=ARROW_WAYS[0])
    assert sorted(index.table.raw(r) for r in range(index.num_rows)) == ["a.png", "b.png"]


def test_an_open_imports_no_pandas(tmp_path):
    """pandas costs 0.2-0.4 s to import: some of pyarrow's conversions import it."""
    import os
    import subprocess
    import sys

    rng = random.Random(1)
    path = tmp_path / "i.csv"
    path.write_bytes(write_rows(_rows(rng, 500, plain=True, width=2), csv.QUOTE_MINIMAL, "\n"))
    code = (
        "import sys; from distlearn.dataset import Dataset; "
        "from distlearn.dataset.index.csv import arrow as csvarrow; "
        "csvarrow.BLOCK = 1 << 12; ix = Dataset(sys.argv[1]).index; "
        "assert len(ix) and 'pandas' not in sys.modules, sorted(sys.modules)"
    )
    env = {**os.environ, "DISTLEARN_CSV_READERS": "arrow,csv"}  # (pyarrow's split, measured)
    subprocess.run([sys.executable, "-c", code, str(path)], check=True, env=env)


def test_a_fault_of_the_comparing_thread_reaches_the_caller(tmp_path, monkeypatch):
    def fail(chunks, most):
        raise MemoryError("compare")

    monkeypatch.setattr(csvarrow, "_descents", fail)
    path = tmp_path / "i.csv"
    path.write_bytes(b"filename,label\na.png,x\nb.png,y\n")
    with pytest.raises(MemoryError, match="compare"):
        from_csv(str(path), readers=ARROW_WAYS[0])


def test_a_quoted_file_is_split_from_its_pages_then_unmapped(tmp_path, monkeypatch):
    rows = [["filename", "label"]] + [[f"n{i:03d}.png", f"c{i % 3}"] for i in range(300)]
    path = tmp_path / "quoted.csv"
    path.write_bytes(write_rows(rows, csv.QUOTE_ALL, "\r\n"))
    seen = []
    real = csvarrow.split
    monkeypatch.setattr(
        csvarrow,
        "split",
        lambda source, sep: seen.append(type(source).__name__) or real(source, sep),
    )
    got = from_csv(str(path), readers=ARROW_WAYS[0])
    assert seen == ["str", "mmap"]  # refused by path, then mapped
    assert got.num_rows == 300 and got.labels == ["c0", "c1", "c2"]
    # nothing of the mapping outlives the open: it goes with the last reference, which
    # pyarrow's reader may hold a moment longer (its threads drop it; under load, ms)
    deadline = time.monotonic() + 10
    while True:
        with open("/proc/self/maps") as maps:
            if str(path) not in maps.read():
                break
        assert time.monotonic() < deadline, "the index file is still mapped after 10 s"
        time.sleep(0.01)


@pytest.mark.parametrize("peek", [1 << 16, 64])  # the ragged rows in the first bytes, or after
def test_ragged_rows_seen_early_skip_the_parse_that_would_fail(tmp_path, monkeypatch, peek):
    monkeypatch.setattr(csvarrow, "PEEK", peek)
    rows = [["filename", "label1", "label2"]]
    rows += [[f"n{i:04d}.png", "a", "b"][: 2 + i % 2] for i in range(200)]
    path = tmp_path / "ragged.csv"
    path.write_bytes(write_rows(rows[:1] + [rows[2]] * 8 + rows[1:], csv.QUOTE_MINIMAL, "\n"))
    parses = []
    real = csvarrow._parse
    monkeypatch.setattr(csvarrow, "_parse", lambda *a, **k: parses.append(a[1]) or real(*a, **k))
    routes = Routes(monkeypatch)
    got = both_ways(path)
    same(got)
    assert routes.taken == ["path"]
    # seen in the first PEEK bytes: the lines at once; else pyarrow's parse fails first
    assert parses == ([csvarrow.LINE] if peek > 64 else [",", csvarrow.LINE])


@pytest.mark.parametrize("width", [2, 3, 8])
def test_a_label_repeated_in_a_row_is_dropped_before_packing(width):
    """``_drop_repeats`` keeps each row's first occurrence of a label, in column order,
    and makes the others no label (-1), as a row-by-row statement of the rule does."""
    rng = np.random.default_rng(width)
    ids = rng.integers(-1, 4, size=(500, width)).astype(np.int16)
    want = []
    for row in ids.tolist():
        seen: set[int] = set()
        want.append([-1 if v in seen else (seen.add(v) or v) for v in row])
    contract.drop_repeats(ids)
    assert ids.tolist() == want
