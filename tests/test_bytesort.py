"""dataset.bytesort against Python's own order of bytes (sorted) on generated strings.

The sort skips the bytes each group of strings shares and packs the next ones
beside the group's number, so the cases that matter are shared prefixes of
every length around the 8-byte word, strings that end inside a word, NUL and
high bytes, duplicates, strings at the very end of their buffer, and groups
(major keys) given in any order.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from distlearn.dataset.index import bytesort

ALPHABET = [b"a", b"b", b"/", b"0", b"\x00", b"\x7f", b"\x80", b"\xc3\xa9", b"\xff"]


def strings(seed: int) -> list[bytes]:
    rng = random.Random(seed)
    alphabet = ALPHABET if seed % 3 else [b"a", b"b"]  # two letters: long equal runs
    prefix = b"".join(rng.choices(alphabet, k=rng.randrange(0, 30)))
    out = [
        (prefix if rng.random() < 0.8 else b"")
        + b"".join(rng.choices(alphabet, k=rng.randrange(0, 25)))
        for _ in range(rng.randrange(0, 400))
    ]
    return out + out[: len(out) // 5]  # duplicates


def packed(values: list[bytes]):
    size = np.array([len(v) for v in values], dtype=np.int64)
    buf = np.frombuffer(b"".join(values), dtype=np.uint8)  # the last string ends the buffer
    return buf, np.cumsum(size) - size, size


@pytest.mark.parametrize("seed", range(60))
def test_order_is_pythons_order_of_bytes_within_major_then_minor_then_position(seed):
    values = strings(seed)
    rng = random.Random(seed)
    major = np.array([rng.randrange(1 + seed % 7) for _ in values], dtype=np.int16)
    minor = np.array([rng.randrange(3) for _ in values], dtype=np.int64)
    buf, start, length = packed(values)

    got = bytesort.order(buf, start, length).tolist()
    assert got == sorted(range(len(values)), key=lambda i: (values[i], i))
    got = bytesort.order(buf, start, length, major, (minor,)).tolist()
    want = sorted(range(len(values)), key=lambda i: (major[i], values[i], minor[i], i))
    assert got == want
    # a major key already in order (a sorted file) takes the same path without a sort
    by_major = sorted(range(len(values)), key=lambda i: major[i])
    vals = [values[i] for i in by_major]
    buf, start, length = packed(vals)
    got = bytesort.order(buf, start, length, major[by_major]).tolist()
    assert got == sorted(range(len(vals)), key=lambda i: (major[by_major][i], vals[i], i))


def test_empty_one_and_all_equal():
    for values in ([], [b"x"], [b"same"] * 5, [b""] * 3, [b"ab", b"ab\x00", b"ab"]):
        buf, start, length = packed(values)
        assert bytesort.order(buf, start, length).tolist() == sorted(
            range(len(values)), key=lambda i: (values[i], i)
        )


@pytest.mark.parametrize("seed", range(30))
def test_order_of_long_names_whose_label_shares_a_prefix(seed):
    """ImageNet-like names, each label's sharing a prefix of 0-40 bytes, every name at
    least 8 bytes past it (the words every string holds are compared with no mask), in
    any row order: the first difference may fall in any byte of any of those words."""
    rng = random.Random(seed)
    labels = rng.choice([1, 3, 50])
    shared = rng.randrange(0, 41)
    prefix = [b"".join(rng.choices(ALPHABET, k=shared)) for _ in range(labels)]
    tail = rng.randrange(8, 30)
    major = np.array([rng.randrange(labels) for _ in range(rng.randrange(2, 600))], np.int16)
    values = [prefix[m] + b"".join(rng.choices([b"a", b"b"], k=tail)) for m in major.tolist()]
    if seed % 4 == 0:  # one name differs early from the rest of its label
        values[0] = b"\x00" + values[0]
    buf, start, length = packed(values)
    got = bytesort.order(buf, start, length, major).tolist()
    assert got == sorted(range(len(values)), key=lambda i: (major[i], values[i], i))


@pytest.mark.parametrize("seed", range(10))
def test_first_difference_in_chunks_shared_with_a_second_thread(seed):
    """Chunks of 7 strings (4 or more: every other one looked at by a helper thread) find the
    byte where a string first differs from the others of its run, as Python finds it."""
    rng = random.Random(seed)
    prefix = [b"".join(rng.choices(ALPHABET, k=rng.randrange(0, 20))) for _ in range(3)]
    tail = rng.randrange(8, 24)
    run = np.array([rng.randrange(3) for _ in range(rng.randrange(40, 200))], dtype=np.int16)
    values = [prefix[r] + b"".join(rng.choices([b"a", b"b"], k=tail)) for r in run.tolist()]
    if seed % 2:  # the only difference is in the second chunk (the helper's), or the last
        values = [prefix[r] + b"a" * tail for r in run.tolist()]
        odd = 8 if seed % 4 == 1 else len(values) - 1
        values[odd] = b"\xff" + values[odd][1:]  # (at byte 0: inside the window)
    buf, start, length = packed(values)

    def differs_at(a: bytes, b: bytes) -> int | None:  # (strings of one run: one length)
        return next((k for k, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)

    at = [differs_at(v, values[run.tolist().index(r)]) for v, r in zip(values, run.tolist(),
          strict=True)]  # fmt: skip
    want = min((k for k in at if k is not None), default=None)
    found = bytesort._first_difference(buf, start, length, run, 0, chunk=7)
    assert found == want


@pytest.mark.parametrize("seed", range(12))
def test_first_pass_built_in_chunks_is_the_sort_pass_of_every_word(seed):
    """The first pass packs each chunk's words, runs and places on two threads (chunks of
    5: 4 or more are shared) and sorts once: the same keys and order as packing whole
    arrays; a file already in order comes back with no order (no sort)."""
    values = strings(seed) or [b"a", b"b"]
    if seed % 3 == 0:
        values = sorted(values)
    rng = random.Random(seed)
    run = None if seed % 2 else np.array([rng.randrange(4) for _ in values], dtype=np.int16)
    if seed % 3 == 0 and run is not None:
        run = np.sort(run)
    buf, start, length = packed(values)
    pos = rng.randrange(0, 6)
    word = bytesort.words(buf, start, length, pos)
    want_key, want_width, want_perm = bytesort._sort_pass(word, run)
    key, width, perm = bytesort._first_pass(buf, start, length, run, pos, chunk=5)
    assert width == want_width and key.tolist() == want_key.tolist()
    assert (perm is None) == (want_perm is None)
    if perm is not None:
        assert perm.dtype == np.int32 and perm.tolist() == want_perm.tolist()


@pytest.mark.parametrize("late", [False, True])
def test_a_run_first_seen_in_the_last_chunk_is_compared_with_its_own(late):
    """Each run's member is taken from the first chunks that hold every run: a run whose
    strings all come last (after chunks that held the others) still has one."""
    head = [b"aaaa/" + bytes([97 + i % 2]) * 9 for i in range(40)]
    tail = [b"zzzz/" + (b"q" if late else b"p") + b"p" * 8 for _ in range(3)]
    tail[-1] = b"zzzz/pppppppp" + (b"x" if late else b"p")
    values = head + tail
    run = np.array([0] * len(head) + [1] * len(tail), dtype=np.int16)
    buf, start, length = packed(values)
    found = bytesort._first_difference(buf, start, length, run, 0, chunk=7)
    # the first run differs at byte 5; the last at byte 5 (late) or at its last byte
    assert found == 5
    got = bytesort.order(buf, start, length, run).tolist()
    assert got == sorted(range(len(values)), key=lambda i: (run[i], values[i], i))


def test_a_megabytes_long_name_alone_in_its_label_sorts_at_once(tmp_path):
    """A string alone in its run has nothing to differ from, but the walk went on to the
    longest string 8 bytes a pass: an index with one 3 MB name (a hostile or broken
    file) took minutes to open."""
    import time

    from distlearn.dataset import Dataset

    path = tmp_path / "i.csv"
    path.write_text("filename,label\n" + "a" * 3_000_000 + ",x\nb,y\n")
    start = time.monotonic()
    ds = Dataset(str(path))
    assert time.monotonic() - start < 10
    assert len(ds) == 2 and ds.index.labels == ["x", "y"]
