"""The csv module's rules as the fast CSV readers check them on whole arrays
(:mod:`dataset.index.csv.text`: ``str.strip``'s whitespace, RFC 4180's quotes), each
against a plain statement of its rule; and the helpers the reader tests share.
"""

from __future__ import annotations

import csv
import io
import random

import numpy as np
import pytest

from distlearn.dataset import BadIndex, open_index
from distlearn.dataset.index.csv import text as csvtext


def write_rows(rows, quoting, terminator, sep=",") -> bytes:
    out = io.StringIO(newline="")
    csv.writer(out, quoting=quoting, lineterminator=terminator, delimiter=sep).writerows(rows)
    return out.getvalue().encode("utf-8")


def summary(index) -> list:
    return [(index.source(i), index.target(i), index.item_labels(i)) for i in range(len(index))]


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
        if not csvtext.edges_clean(buf, off):
            continue
        s, e = csvtext.strip(buf, off[:-1], off[1:])
        assert s.tolist() == off[:-1].tolist() and e.tolist() == off[1:].tolist(), values
    # and it does pass the common case: names without whitespace at their edges
    raw = [b"n01/n01_1.JPEG", b"n01/n01_2 b.JPEG", b"x"]
    off = np.cumsum([0] + [len(r) for r in raw]).astype(np.int32)
    assert csvtext.edges_clean(np.frombuffer(b"".join(raw), dtype=np.uint8), off)
    raw[1] = b"n01/n01_2.JPEG "
    off = np.cumsum([0] + [len(r) for r in raw]).astype(np.int32)
    assert not csvtext.edges_clean(np.frombuffer(b"".join(raw), dtype=np.uint8), off)


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
        for chunk in (1, 2, 3, 7, 64):  # a quote pair or an escape across chunks
            assert csvtext.quotes_ok(a, body, ord(sep), chunk=chunk) == want, (data, chunk)
