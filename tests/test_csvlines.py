"""The reader ``lines`` (dataset/index/csv/_lines.c, lines.py) against pyarrow's split and
the csv module's reader: the same index, or the same error, every way.

Files are written by ``csv.writer`` or cut from generated lines, then mutated; a
file the C reader must not read (a quote, NUL, a lone CR, non-ASCII bytes, a row
with more fields than the header, an empty name) must be declined, and read (or
refused) by the other readers as before. The reader is also attacked directly: junk
arguments, random bytes, a file cut short or rewritten while its index is open.
"""

from __future__ import annotations

import csv
import mmap
import os
import random

import numpy as np
import pytest
from test_csvarrow import compared_on_mutated, opened, same
from test_csvtext import write_rows

from distlearn.dataset.index import table as index
from distlearn.dataset.index.csv import lines as csvlines
from distlearn.dataset.index.csv import reader as csvindex
from distlearn.dataset.index.csv.contract import Source

pytestmark = pytest.mark.skipif(csvlines._lines is None, reason="dataset._lines is not built")


# every reader (the C reader first), then pyarrow's split and the csv module, then the
# csv module alone
EVERY_WAY = [None, ("arrow", "csv"), ("csv",)]


def every_way(path, **kw):
    """The index (or its error's text) as from_csv reads it each of :data:`EVERY_WAY`."""
    return opened(path, EVERY_WAY, **kw)


def _plain_rows(rng: random.Random, n: int, width: int) -> list[list[str]]:
    """A header and `n` rows of ASCII names and labels (spaces, numbers, empty labels)."""
    rows = [["filename"] + [f"label{k}" for k in range(width)]]
    for _ in range(n):
        name = "".join(rng.choice(["a", "b", "/", ".", "x y", "-"]) for _ in range(1, 6))
        labels = (rng.choice(["cat", "dog", "10", "2", "  x  ", "x", ""]) for _ in range(width))
        rows.append([f"n{name}z", *labels])
    return rows


class Taken:
    """Whether the C reader gave the last open."""

    def __init__(self, monkeypatch):
        self.count = 0
        real = csvlines.split

        def split(*args):
            got = real(*args)
            self.count += got is not None
            return got

        monkeypatch.setattr(csvlines, "split", split)


@pytest.mark.parametrize("halves", [1 << 20, 64])  # one thread; two halves of small files
@pytest.mark.parametrize("sep", [",", "\t"])
def test_plain_files_are_the_c_reader_s_and_read_as_the_others_read_them(
    tmp_path, monkeypatch, halves, sep
):
    monkeypatch.setattr(csvlines, "HALVES", halves)
    rng = random.Random(f"{halves}{sep}")
    taken = Taken(monkeypatch)
    for trial in range(16):
        rows = _plain_rows(rng, 120, width=trial % 4)
        if trial % 2:
            rows[1:] = sorted(rows[1:], key=lambda r: (r[1:2], r[0]))  # in order: no sort
        if trial % 8 == 3:
            rows[1:] = [r[: 1 + (i % len(r))] for i, r in enumerate(rows[1:])]  # ragged
        terminator = rng.choice(["\n", "\r\n"])
        data = write_rows(rows, csv.QUOTE_MINIMAL, terminator, sep=sep)
        if trial % 4 == 1:
            data = data[: -len(terminator)]  # no newline at the end
        if trial % 4 == 2:  # blank lines, where the halves meet too
            data = data.replace(terminator.encode(), terminator.encode() * 3, 40)
        if trial % 8 == 5:  # what str.strip() strips, around names and labels
            data = data.replace(b"z" + sep.encode(), b"z\x1c\x0b " + sep.encode())
        path = tmp_path / "i.csv"
        path.write_bytes(data)
        before = taken.count
        got = every_way(path, sep=sep)
        assert not isinstance(got[0], str), got[0]
        same(got)
        assert taken.count == before + 1, trial  # (the first open only)


def test_mutated_indexes_give_the_same_index_or_error_every_way(tmp_path, monkeypatch):
    monkeypatch.setattr(csvlines, "HALVES", 256)
    taken = Taken(monkeypatch)
    errors = compared_on_mutated(tmp_path, 300, lambda path: every_way(path))
    assert 30 < errors < 200 and taken.count > 30  # (indexes, faults and the C reader's)


@pytest.mark.parametrize(
    "late",
    [
        b'n"q"z,c1\n',  # a quote
        b"n\0z,c1\n",  # NUL
        b"n\rz,c1\n",  # a lone CR
        b"n\xffz,c1\n",  # not UTF-8: a byte no sequence starts with
        b"n\xc0\xafz,c1\n",  # an overlong "/"
        b"n\xed\xa0\x80z,c1\n",  # a surrogate
        b"n\xf4\x90\x80\x80z,c1\n",  # past U+10FFFF
        b"nz,c\xe2\x80\n",  # cut short by the line's end
        "nz,c1\u3000\n".encode(),  # a space str.strip() strips, not ASCII, at an edge
        "\u00a0nz,c1\n".encode(),
        "nz\u2028,c1\n".encode(),
        b"nz,c1,c2\n",  # more fields than the header
        b",c1\n",  # no name
        b" \t,c1\n",
        b"n" * 40_000 + b",c1\n",  # a name longer than 32,767 bytes
    ],
)
@pytest.mark.parametrize("at", [10, 2990])  # in the first bytes, or the last half
def test_what_the_c_reader_refuses_is_read_by_the_others(tmp_path, monkeypatch, late, at):
    monkeypatch.setattr(csvlines, "HALVES", 1 << 10)
    rows = [b"n%06dz,c%d\n" % (i, i % 7) for i in range(3000)]
    rows.insert(at, late)
    path = tmp_path / "i.csv"
    path.write_bytes(b"filename,label\n" + b"".join(rows))
    taken = Taken(monkeypatch)
    same(every_way(path))
    assert taken.count == 0


@pytest.mark.parametrize("first", [0, 5000])  # many labels from the first lines, or later
def test_more_labels_than_int16_codes_hold(tmp_path, monkeypatch, first):
    """Over 32,767 distinct labels in a half: int32 codes from the start where the first
    lines show many labels, else the split is done again with them."""
    rows = [f"a{i:06d}.png,w00000\n" for i in range(first)]
    rows += [f"n{i:06d}.png,w{(i * 7919) % 40_000:05d}\n" for i in range(80_000)]
    path = tmp_path / "many.csv"
    path.write_text("filename,label\n" + "".join(rows))
    taken, splits = Taken(monkeypatch), []
    real = csvlines._split
    monkeypatch.setattr(csvlines, "_split", lambda *a: splits.append(a[-1]) or real(*a))
    got = every_way(path)
    same(got)
    assert len(got[0].labels) == 40_000 and taken.count == 1
    assert splits[:2] == ([np.int32] if first == 0 else [np.int16, np.int32])


def test_an_index_outlives_its_file_cut_short_or_rewritten(tmp_path):
    """The names are copied out of the file's mapped pages and nothing stays mapped:
    truncating the file, or writing another in its place, cannot SIGBUS the index."""
    path = tmp_path / "i.csv"
    path.write_text("filename,label\n" + "".join(f"n{i:05d}.png,c{i % 3}\n" for i in range(50_000)))
    ix = csvindex.from_csv(str(path))
    names = [ix.table.raw(r) for r in range(0, ix.num_rows, 997)]
    with open(path, "r+b") as f:
        f.truncate(0)
    assert [ix.table.raw(r) for r in range(0, ix.num_rows, 997)] == names
    with open("/proc/self/maps") as f:
        assert str(path) not in f.read()
    path.write_text("filename,label\nx.png,y\n")
    assert [ix.table.raw(r) for r in range(0, ix.num_rows, 997)] == names


def test_the_halves_meet_on_blank_lines_and_across_a_descent(monkeypatch):
    """Two halves: blank lines at the end of the first (its rows move up), a name in
    the second smaller than the last of the first (a descent where they meet)."""
    monkeypatch.setattr(csvlines, "HALVES", 8)
    data = b"filename,label\nb.png,x\nc.png,y\n\n\n\r\n\na.png,x\nd.png,z\n"
    got = csvlines.split(data, ["filename", "label"], data.find(b"\n") + 1, ",")
    names = [bytes(got.buf[s : s + n]).decode() for s, n in zip(got.start, got.length, strict=True)]
    assert names == ["b.png", "c.png", "a.png", "d.png"]
    assert got.labels == ["x", "y", "z"] and got.ids.tolist() == [0, 1, 0, 2]
    assert got.descents.tolist() == [1]


def test_junk_arguments_raise_and_random_bytes_never_crash():
    lines = csvlines._lines
    buf = b"filename,label\na,b\n"
    u32, u16, i16, i64 = (np.zeros(8, t) for t in (np.uint32, np.int16, np.int16, np.int64))
    names = np.zeros(64, np.uint8)
    for args in [
        (buf, -1, 5, 44, b"\x00\x01", names, 0, u32, u16, i16, i64),  # out of the buffer
        (buf, 0, 99, 44, b"\x00\x01", names, 0, u32, u16, i16, i64),
        (buf, 15, 19, ord('"'), b"\x00\x01", names, 0, u32, u16, i16, i64),  # not a separator
        (buf, 15, 19, 0, b"\x00\x01", names, 0, u32, u16, i16, i64),
        (buf, 15, 19, 44, b"\x00\x01", names, 99, u32, u16, i16, i64),  # `at` past names
        (buf, 15, 19, 44, b"\x00\x01", names, 0, u16, u16, i16, i64),  # wrong item sizes
        (buf, 15, 19, 44, b"\x00\x01", names, 0, u32, u32, i16, i64),
        (buf, 15, 19, 44, b"\x00\x01", names, 0, u32, u16, i64, i64),
        (buf, 15, 19, 44, b"\x00\x01", names, 0, u32, u16[:2], i16, i64),  # too few
    ]:
        with pytest.raises(ValueError):
            lines.split(*args)
    with pytest.raises(BufferError):  # read-only outputs
        lines.split(buf, 15, 19, 44, b"\x00\x01", b"x" * 64, 0, u32, u16, i16, i64)
    rng = random.Random(0)
    for _ in range(3000):  # bytes of every kind, in ranges that start anywhere
        junk = bytes(rng.choice(b'ab,\t\n\r" \x00\x1f\xff') for _ in range(rng.randrange(200)))
        lo = rng.randrange(len(junk) + 1)
        n = junk.count(b"\n") + 1
        role = bytes(rng.choice([0, 1, 2, 255]) for _ in range(rng.randrange(1, 4)))
        k = max([r for r in role if r != 255], default=0)
        got = lines.split(junk, lo, len(junk), 44, role, np.zeros(len(junk) + 1, np.uint8), 0,
                          np.zeros(n, np.uint32), np.zeros(n, np.int16),
                          np.zeros((n, k), np.int16), np.zeros(4, np.int64))  # fmt: skip
        if got is not None:
            rows, labels, _, end = got
            assert 0 <= rows <= n and 0 <= end <= len(junk) and len(labels) <= len(junk)
    assert lines.count(b"a\nb\n\n", 0, 5) == 3 and lines.count(b"a\nb\n", 2, 3) == 0


def test_a_file_read_while_mapped_is_the_one_on_disk(tmp_path):
    """The local file is mapped once, read and let go: its pages hold what a read of
    the file gives (a file of one line without a newline too)."""
    path = tmp_path / "i.csv"
    for data in (b"filename,label\na.png,x", b"filename\na.png\n", b"filename,label\n"):
        path.write_bytes(data)
        pages = Source(str(path), ",", str(path)).pages(populate=True)
        assert pages[:] == data
        assert isinstance(pages, mmap.mmap)
        pages.close()
    path.write_bytes(b"")  # (an empty file cannot be mapped: its read says what it holds)
    assert Source(str(path), ",", str(path)).pages() is None
    os.chmod(path, 0)
    if os.geteuid() != 0:  # (root reads it anyway)
        assert Source(str(path), ",", str(path)).pages() is None


@pytest.mark.parametrize(
    "data",
    [
        b"label,filename\nx\ny,b.png\n",  # a row that stops before its name
        b"label,filename\nx,a.png\n" + b"y\n" * 300 + b"z,b.png\n",
        b"filename,label\n" + b"\n" * 500 + b"a.png,x\n",  # blank lines first
        b"filename,label\n" + b" \n" * 500,
    ],
)
def test_odd_first_lines_are_read_as_the_others_read_them(tmp_path, monkeypatch, data):
    monkeypatch.setattr(csvlines, "HALVES", 64)
    path = tmp_path / "i.csv"
    path.write_bytes(data)
    same(every_way(path))


@pytest.mark.parametrize(
    "labels",
    [
        ["b", "10", "9", "a", "B", "_", "10"],  # text: numpy's byte order, Python's str order
        ["10", "9", "b", "a"],  # the first an integer, not all: Python's sort
        ["10", "9", "05", "5", "+5", "1_0"],  # all integers (ties by their text)
    ],
)
def test_many_labels_sorted_by_numpy_as_sort_labels_sorts_them(tmp_path, monkeypatch, labels):
    monkeypatch.setattr(csvlines, "MANY_LABELS", 2)
    monkeypatch.setattr(csvlines, "HALVES", 32)
    path = tmp_path / "i.csv"
    path.write_text("filename,label\n" + "".join(f"n{i}.png,{x}\n" for i, x in enumerate(labels)))
    got = every_way(path)
    same(got)
    assert got[0].labels == index.sort_labels(labels)


def test_utf8_names_and_labels_are_the_c_reader_s(tmp_path, monkeypatch):
    """Names and labels in any script (2-4 byte sequences), spaces that are not ASCII
    inside them (not at an edge), ASCII spaces around them: the C reader's, read as
    the others read them."""
    monkeypatch.setattr(csvlines, "HALVES", 256)
    rng = random.Random(3)
    parts = ["a", "\u00e9", "\u00fc", "\u65e5\u672c", "\U0001f600", "\u00a0", "\u3000", "/"]
    labels = ["chat", "\u00e9t\u00e9", "\u732b", "\U0001f431", " \u00c5 ", "", "x\u2028y"]
    taken = Taken(monkeypatch)
    for trial in range(6):
        rows = [["filename", "label1", "label2"]]
        for _ in range(200):
            name = "".join(rng.choice(parts) for _ in range(rng.randrange(1, 5)))
            row = [f"n{name}z", rng.choice(labels), rng.choice(labels)]
            rows.append(row[: rng.randrange(2, 4)])
        if trial % 2:
            rows[1:] = sorted(rows[1:])
        path = tmp_path / "u.csv"
        path.write_bytes(write_rows(rows, csv.QUOTE_MINIMAL, rng.choice(["\n", "\r\n"])))
        got = every_way(path)
        assert not isinstance(got[0], str), got[0]
        same(got)
    assert taken.count == 6
