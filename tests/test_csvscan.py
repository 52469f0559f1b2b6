"""The numpy CSV splitter against the csv module: same fields, same rows, same index.

Files are written by ``csv.writer`` (minimal and full quoting, LF and CRLF
line ends) from fields full of separators, quotes, newlines, whitespace and
non-ASCII text, then read back by ``csv.reader`` (the reference) and by
:func:`dataset.csvscan.scan`. Malformed files must be left to the csv module.
"""

from __future__ import annotations

import csv
import io
import random

import numpy as np
import pytest

from distlearn.dataset import BadIndex, open_index
from distlearn.dataset.index.csv import reader as csvindex
from distlearn.dataset.index.csv import scan as csvscan

ALPHABET = ["a", "b", "z", "0", "9", ",", '"', "\n", "\r\n", " ", "\t", "é", "\u00a0", "\u3000",
            "/", ".", ";", "'", "x y"]  # fmt: skip


def random_field(rng: random.Random) -> str:
    return "".join(rng.choice(ALPHABET) for _ in range(rng.randrange(0, 8)))


def write_rows(rows, quoting, terminator, sep=",") -> bytes:
    out = io.StringIO(newline="")
    csv.writer(out, quoting=quoting, lineterminator=terminator, delimiter=sep).writerows(rows)
    return out.getvalue().encode("utf-8")


def reference(data: bytes, sep: str) -> list[list[str]]:
    text = data.decode("utf-8-sig")
    rows = csv.reader(io.StringIO(text, newline=""), delimiter=sep, strict=True)
    rows = [[f.strip() for f in row] for row in rows]
    return [row for row in rows if row and row != [""]]  # blank lines, as an index skips them


def scanned(data: bytes, sep: str) -> list[list[str]] | None:
    fields = csvscan.scan(data, sep)
    if fields is None:
        return None
    out = []
    counts = fields.counts
    for r in range(len(fields)):
        one = np.asarray([r])
        row = []
        for k in range(int(counts[r])):
            s, e = (int(x[0]) for x in fields.column(k, one))
            raw = bytes(fields.buf[s:e])
            escaped = np.searchsorted(fields.drop, s) < np.searchsorted(fields.drop, e)
            row.append((raw.replace(b'""', b'"') if escaped else raw).decode("utf-8"))
        if row != [""]:
            out.append(row)
    return out


@pytest.mark.parametrize("quoting", [csv.QUOTE_MINIMAL, csv.QUOTE_ALL])
@pytest.mark.parametrize("terminator", ["\n", "\r\n"])
@pytest.mark.parametrize("sep", [",", "\t"])
def test_fields_match_the_csv_module(quoting, terminator, sep):
    rng = random.Random(f"{quoting}{terminator!r}{sep}")
    for _ in range(60):
        rows = [[random_field(rng) for _ in range(rng.randrange(1, 5))] for _ in range(30)]
        data = write_rows(rows, quoting, terminator, sep)
        if rng.random() < 0.3:
            data = b"\xef\xbb\xbf" + data  # a byte order mark
        if rng.random() < 0.3 and data.endswith(terminator.encode()):
            data = data[: -len(terminator)]  # no newline at the end
        assert scanned(data, sep) == reference(data, sep), data


@pytest.mark.parametrize(
    "data",
    [
        b'a,b\nab"c,d\n',  # a quote inside an unquoted field: literal for csv
        b'a,b\n"x"y,d\n',  # text after a closing quote: csv.Error in strict mode
        b'a,b\n"unterminated,d\n',
        b"a,b\nx\ry,d\n",  # a lone CR ends a line for csv
        b"a,b\nx,\0\n",  # NUL: csv.Error
        b'a,b\n "x",d\n',  # a quote after a space is not an opening quote
    ],
)
def test_what_numpy_cannot_vouch_for_is_left_to_the_csv_module(data):
    assert csvscan.scan(data, ",") is None


def index_rows(rng: random.Random, n: int) -> list[list[str]]:
    rows = [["filename", "label1", "label2"]]
    for _ in range(n):
        name = "".join(rng.choice(["a", "b", ",", '"', " ", "é", "\n", "/", "x"]) for _ in range(5))
        labels = [rng.choice(["cat", "dog", 'say "hi"', "a,b", "  x  ", "10", ""])
                  for _ in range(rng.randrange(0, 3))]  # fmt: skip
        rows.append([f"n{name}z", *labels])  # ragged: 0 to 2 labels
    return rows


def summary(index) -> list:
    return [(index.source(i), index.target(i), index.item_labels(i)) for i in range(len(index))]


@pytest.mark.parametrize("quoting", [csv.QUOTE_MINIMAL, csv.QUOTE_ALL])
def test_index_is_the_same_read_by_numpy_or_by_the_csv_module(tmp_path, monkeypatch, quoting):
    rng = random.Random(quoting)
    path = tmp_path / "index.csv"
    for trial in range(5):
        rows = index_rows(rng, 200)
        if trial % 2:
            rows[1:] = sorted(rows[1:])  # the sorted-file shortcut
        path.write_bytes(write_rows(rows, quoting, "\r\n" if trial == 3 else "\n"))
        assert csvscan.scan(path.read_bytes(), ",") is not None
        fast = open_index(path)
        with monkeypatch.context() as m:
            m.setattr(csvindex, "scan", lambda data, sep: None)
            slow = open_index(path)
        assert fast.labels == slow.labels
        assert summary(fast) == summary(slow)
        want = {r[0].strip() for r in rows[1:]}
        assert {fast.table.raw(r) for r in range(fast.num_rows)} == want


def test_malformed_rows_name_their_line(tmp_path):
    path = tmp_path / "i.csv"
    path.write_bytes(b"filename,label\na.png,x\nb.png,y,z\n")
    with pytest.raises(BadIndex, match=r"i\.csv:3: 3 fields for a header of 2"):
        open_index(path)
    path.write_bytes(b'filename,label\na.png,x\n"b\nc.png",y\nd.png,x,z\n')
    with pytest.raises(BadIndex, match=r"i\.csv:5: 3 fields"):  # a quoted newline is a line
        open_index(path)
    path.write_bytes(b'filename,label\na.png,x\n"x"y,d\n')  # the csv module's own error
    with pytest.raises(BadIndex, match=r"i\.csv:3: .*','"):
        open_index(path)
    path.write_bytes(b"filename,offset,length\na.bin,1,2\nb.bin,x,2\n")
    with pytest.raises(BadIndex, match=r"i\.csv:3: offset/length must be integers"):
        open_index(path)


def test_names_much_smaller_than_the_file_are_packed(tmp_path):
    path = tmp_path / "wide.csv"
    rows = [["filename", "caption", "label"]]
    rows += [[f"{i}.png", "a long caption that we do not read " * 4, str(i % 3)] for i in range(50)]
    path.write_bytes(write_rows(rows, csv.QUOTE_MINIMAL, "\n"))
    index = open_index(path)
    assert len(index.table.buf) == sum(len(f"{i}.png") for i in range(50))
    assert sorted(index.table.raw(r) for r in range(50)) == sorted(f"{i}.png" for i in range(50))


def test_edges_clean_never_passes_a_value_strip_would_change():
    rng = random.Random(3)
    alphabet = ["a", "b", " ", "\t", "\x1c", "é", "", "x y"]
    for _ in range(2000):
        values = ["".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 4)))
                  for _ in range(rng.randrange(1, 6))]  # fmt: skip
        raw = [v.encode() for v in values]
        buf = np.frombuffer(b"".join(raw), dtype=np.uint8)
        off = np.cumsum([0] + [len(r) for r in raw]).astype(np.int32)
        if not csvscan.edges_clean(buf, off):
            continue
        s, e = csvscan.strip(buf, off[:-1], off[1:])
        assert s.tolist() == off[:-1].tolist() and e.tolist() == off[1:].tolist(), values
    # and it does pass the common case: names without whitespace at their edges
    raw = [b"n01/n01_1.JPEG", b"n01/n01_2 b.JPEG", b"x"]
    off = np.cumsum([0] + [len(r) for r in raw]).astype(np.int32)
    assert csvscan.edges_clean(np.frombuffer(b"".join(raw), dtype=np.uint8), off)
    raw[1] = b"n01/n01_2.JPEG "
    off = np.cumsum([0] + [len(r) for r in raw]).astype(np.int32)
    assert not csvscan.edges_clean(np.frombuffer(b"".join(raw), dtype=np.uint8), off)


@pytest.mark.parametrize("size", [0, 5, 4096 * 3 + 7, 4096 * 9 + 1])  # 0 to 10 chunks
def test_find_gives_every_position_in_order(size):
    a = np.random.default_rng(size).integers(0, 4, size, dtype=np.uint8)
    got = csvscan.find(a, 1, 3, chunk=4096)  # (4 chunks or more: two threads)
    assert [g.tolist() for g in got] == [np.flatnonzero(a == v).tolist() for v in (1, 3)]


def rfc4180_quotes(data: bytes, sep: bytes) -> bool:
    """The rule the quote checks apply, a byte at a time: a quote opens a field at its
    start only; a quoted field ends at a quote followed by a separator, ``\\n``,
    ``\\r\\n`` or the end (``""`` is an escape), and holds anything else."""
    i = 3 if data.startswith(b"\xef\xbb\xbf") else 0
    at_start = True
    while i < len(data):
        c = data[i : i + 1]
        if c == b'"':
            if not at_start:
                return False
            i += 1
            while True:
                j = data.find(b'"', i)
                if j < 0:
                    return False  # unterminated
                if data[j + 1 : j + 2] == b'"':
                    i = j + 2
                    continue
                if data[j + 1 : j + 2] not in (b"", sep, b"\n") and data[j + 1 : j + 3] != b"\r\n":
                    return False
                i, at_start = j + 1, False
                break
            continue
        at_start = c in (sep, b"\n")
        i += 1
    return True


def test_quote_checks_apply_rfc_4180_a_chunk_at_a_time():
    rng = random.Random(4180)
    pieces = [b'"', b'"', b",", b"\n", b"\r", b"a", b"\t"]
    for trial in range(1500):
        data = b"".join(rng.choice(pieces) for _ in range(rng.randrange(0, 30)))
        if trial % 5 == 0:
            data = b"\xef\xbb\xbf" + data
        sep = b"," if trial % 2 else b"\t"
        a = np.frombuffer(data, dtype=np.uint8)
        body = 3 if data.startswith(b"\xef\xbb\xbf") else 0
        want = rfc4180_quotes(data, sep)
        whole = csvscan.check_quotes(a, csvscan.find(a, csvscan.QUOTE)[0], body, ord(sep))
        assert (whole is not None) == want, data
        for chunk in (1, 2, 3, 7, 64):  # a quote pair or an escape across chunks
            assert csvscan.quotes_ok(a, body, ord(sep), chunk=chunk) == want, (data, chunk)


def test_check_quotes_names_the_escapes_csv_writer_wrote():
    rows = [["a", 'say "hi"'], ['""', "x"], ['"', '"a"']]
    data = write_rows(rows, csv.QUOTE_ALL, "\r\n")
    a = np.frombuffer(data, dtype=np.uint8)
    drop = csvscan.check_quotes(a, csvscan.find(a, csvscan.QUOTE)[0], 0, ord(","))
    assert drop is not None
    # each escape is two quotes: dropping the second of each leaves the values' quotes
    kept = bytes(np.delete(a, drop))
    assert kept.count(b'"') - 2 * 6 == sum(v.count('"') for row in rows for v in row)
