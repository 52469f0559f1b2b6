"""Sorting millions of byte strings held in one buffer, with no Python object per string.

A string is ``buf[start:start + length]``; :func:`order` gives the stable
argsort of the strings by (``major``, their bytes, ``*minor``): bytes order is
Python's order of ``bytes`` (a string before the longer ones it begins).

numpy sorts 64-bit integers many times faster than strings or several keys
(``np.lexsort`` of four words is a sort per word), so this is a radix sort,
most significant digit first, whose digit is a 64-bit word: each pass sorts
only the strings still tied, by their tie group and their next bytes packed
into one ``uint64``, after skipping the bytes every tied group shares (the
names of one label share a long prefix, ``n01440764/n01440764_``). A pass
whose keys come already sorted (a sorted file) costs a comparison, no sort.

The first pass reads the strings a chunk at a time in buffer order: a large
index pays more for fresh memory and for reading its buffer out of order than
for the arithmetic.
"""

from __future__ import annotations

import numpy as np

from .cores import on_two_threads

__all__ = ["order", "words"]

# _KEEP[k]: the k most significant bytes of a 64-bit word
_KEEP = np.array([0] + [((1 << 64) - 1) ^ ((1 << (64 - 8 * k)) - 1) for k in range(1, 9)],
                 dtype=np.uint64)  # fmt: skip
_ALL = np.arange(8)


def words(buf: np.ndarray, start: np.ndarray, length: np.ndarray, pos: int) -> np.ndarray:
    """Bytes ``pos:pos + 8`` of each string as a big-endian number (zero past its end)."""
    last = len(buf) - 8 - pos  # the last start whose word is inside the buffer
    if len(start) and last >= 0 and int(start.max()) <= last:
        # every byte offset of the buffer (from pos) read as a little-endian word, swapped
        every = np.ndarray((last + 1,), dtype="<u8", buffer=buf, offset=pos, strides=(1,))
        value = every[start].byteswap(inplace=True)
    else:  # near the end of the buffer: byte by byte (what is past the end is masked)
        at = np.minimum(start[:, None] + pos + _ALL, len(buf) - 1)
        got = buf[at] if len(buf) else np.zeros((len(start), 8), dtype=np.uint8)
        value = np.ascontiguousarray(got).view(">u8").ravel().astype(np.uint64)
    short = np.flatnonzero(length < pos + 8)
    if len(short):
        value[short] &= _KEEP[np.clip(length[short] - pos, 0, 8)]
    return value


def _ties(head: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Positions in runs of two or more (a run starts at each `head`), and their run (0, 1...)."""
    if head.all():
        return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
    heads = np.flatnonzero(head)
    size = np.diff(np.append(heads, len(head)))
    tied = np.flatnonzero(np.repeat(size > 1, size))
    return tied, np.cumsum(head[tied]) - 1


def _words_of(buf, start, length, rows, pos) -> np.ndarray:
    """:func:`words` of strings `rows`: read in buffer order when they are most strings
    (reading a buffer at random costs a cache miss a string, 5x the time)."""
    if len(rows) > len(start) // 4:
        return words(buf, start, length, pos)[rows]
    return words(buf, start[rows], length[rows], pos)


def _first_difference(buf, start, length, run, pos, chunk: int = 1 << 16) -> int | None:
    """The position :func:`_next_difference` gives, of every string, in buffer order: read
    a chunk at a time against one member of each run, so the bytes every run shares are
    skipped without a word array as large as the index (fresh memory is what a large
    index pays most for); the words there are read by the pass that packs them."""
    n = len(start)
    # A string alone in its run has nothing to differ from: only runs of two or more
    # bound the walk (a 3 MB name in a label of its own made it 375,000 passes).
    shared = np.ones(n, dtype=bool) if run is None else np.bincount(run)[run] >= 2
    if n < 2 or not shared.any():
        return None
    longest = int(length[shared].max())
    member = np.zeros(1 if run is None else int(run.max()) + 1, dtype=np.int64)
    if run is not None:  # some string of each run, from the first chunks that hold them all
        seen = np.zeros(len(member), dtype=bool)
        for lo in range(0, n, chunk):
            member[run[lo : lo + chunk]] = np.arange(lo, min(n, lo + chunk))
            seen[run[lo : lo + chunk]] = True
            if seen.all():
                break
    window = (int(length.min()) - pos) // 8  # words every string holds whole
    if window > 0:
        found = _window_difference(buf, start, run, member, pos, window, chunk)
        if found is not None:
            return found
        pos += 8 * window
    while pos < longest:
        mine = words(buf, start[member], length[member], pos)
        most = 0
        for lo in range(0, n, chunk):
            w = words(buf, start[lo : lo + chunk], length[lo : lo + chunk], pos)
            w ^= mine[0] if run is None else mine[run[lo : lo + chunk]]
            most = max(most, int(w.max()))
        if most:
            return pos + (64 - most.bit_length()) // 8
        pos += 8
    return None


def _window_difference(buf, start, run, member, pos, window, chunk) -> int | None:
    """The first byte in ``pos:pos + 8 * window`` where a string differs from its run's
    member, or None: every string holds those bytes, so its words need no mask past its
    end, nor a byte swap (the first byte of a little-endian word is its lowest), and one
    look at a chunk's rows serves every word (the names of a label share ~20 bytes).
    The chunks are shared with a second thread (:func:`dataset.index.cores.on_two_threads`):
    this pass is most of an unsorted file's sort (1M rows: 14 -> 8 ms)."""
    last = len(buf) - 8 - pos
    every = [np.ndarray((last + 1 - 8 * j,), dtype="<u8", buffer=buf, offset=pos + 8 * j,
                        strides=(1,)) for j in range(window)]  # fmt: skip
    at = start[member].astype(np.intp)
    mine = [e[at] for e in every]

    def differ(lows) -> list[int]:
        """Each word's bits where a string of chunks `lows` differs from its member."""
        bits = [0] * window
        for lo in lows:
            at = start[lo : lo + chunk].astype(np.intp)  # (converted once for every word)
            of = None if run is None else run[lo : lo + chunk].astype(np.intp)
            for j in range(window):
                if any(bits[:j]):  # a difference in an earlier word: this one cannot matter
                    break
                w = every[j][at]
                w ^= mine[j][0] if of is None else mine[j][of]
                bits[j] |= int(np.bitwise_or.reduce(w))
        return bits

    halves = on_two_threads(differ, range(0, len(start), chunk))
    found = [a | b for a, b in zip(*halves, strict=True)] if len(halves) > 1 else halves[0]
    for j, bits in enumerate(found):
        if bits:
            return pos + 8 * j + ((bits & -bits).bit_length() - 1) // 8
    return None


def _next_difference(buf, start, length, rows, run, pos):
    """``(pos, words at pos)``: the first byte at or after `pos` where a string of `rows`
    differs from another of its run (so every run shares the bytes before it, and sorting
    skips them); None where none does. Runs are contiguous (`run` does not decrease)."""
    starts = np.flatnonzero(np.r_[True, run[1:] != run[:-1]])
    longest = int(length[rows].max())
    while pos < longest:
        w = _words_of(buf, start, length, rows, pos)
        # the bytes a run shares are those its smallest and largest word share
        most = int((np.maximum.reduceat(w, starts) ^ np.minimum.reduceat(w, starts)).max())
        if most:  # the run that differs soonest says how many bytes all runs share
            skip = (64 - most.bit_length()) // 8
            return pos + skip, w if not skip else _words_of(buf, start, length, rows, pos + skip)
        pos += 8
    return None


def order(
    buf: np.ndarray,
    start: np.ndarray,
    length: np.ndarray,
    major: np.ndarray | None = None,
    minor: tuple[np.ndarray, ...] = (),
) -> np.ndarray:
    """Stable argsort of the strings by (`major`, bytes, `minor`, position).

    `major`: small non-negative integers (a label id), or None.
    """
    seq, head = _sort(buf, start, length, major)
    return _break_ties(seq, head, length, minor)


def _sort(buf, start, length, major):
    """``(seq, head)``: the strings sorted by (`major`, bytes), ``head`` where a value starts
    (strings equal to the end of the shorter one share a value).

    The first pass reads every string in buffer order with its major key as its run; each
    later pass, the strings still tied, in their runs.
    """
    n = len(start)
    start, length = np.asarray(start), np.asarray(length)  # any integer type: no copies
    if n < 2:
        return np.arange(n, dtype=np.int64), np.ones(n, dtype=bool)
    # the first pass takes every string (tied None), in buffer order (rows None)
    seq, tied, rows, run, pos = None, None, None, major, 0
    while tied is None or len(tied):
        if rows is None:
            found = _first_difference(buf, start, length, run, pos)
        else:
            found = _next_difference(buf, start, length, rows, run, pos)
        done = found is None  # equal to the end: one more pass, for the major key
        if rows is None and not done:
            pos = found
            key, width, perm = _first_pass(buf, start, length, run, pos)
        else:
            pos, w = (pos, np.zeros(n if tied is None else len(tied), np.uint64)) if done else found
            key, width, perm = _sort_pass(w, run)
        if tied is None:
            seq = np.arange(n, dtype=_place_dtype(n)) if perm is None else perm
        elif perm is not None:
            seq[tied] = rows[perm]
        change = np.empty(len(key), dtype=bool)  # where a value starts
        change[0] = True
        np.not_equal(key[1:], key[:-1], out=change[1:])
        if tied is None:
            head = change
        else:
            head[tied] = change
        if done:
            break
        pos += width
        tied, run = _ties(head)
        rows = seq[tied]
    return seq, head


def _place_dtype(n: int) -> np.dtype:
    """The dtype of the places of `n` strings: int32 where it holds them (half the memory)."""
    return np.dtype(np.int32 if n <= 2**31 else np.int64)


def _first_pass(buf, start, length, run, pos: int, chunk: int = 1 << 16):
    """:func:`_sort_pass` of every string's word at `pos`, read a chunk at a time while
    its keys are packed: no word array as large as the index."""
    return _sort_words(lambda lo, hi: words(buf, start[lo:hi], length[lo:hi], pos),
                       len(start), run, chunk)  # fmt: skip


def _sort_pass(w: np.ndarray, run: np.ndarray | None, chunk: int = 1 << 16):
    """``(key, width, perm)``: the words `w` (fresh, overwritten) sorted by (`run`, their
    first `width` bytes, place); perm, where they were (None: they were in order)."""
    return _sort_words(lambda lo, hi: w[lo:hi], len(w), run, chunk)


def _sort_words(word_of, n: int, run: np.ndarray | None, chunk: int):
    """:func:`_sort_pass` of the `n` words ``word_of(lo, hi)`` gives a chunk at a time.

    The bytes go beside the run's number, and beside each string's place where that
    leaves one or more: numpy sorts numbers twice as fast as it argsorts them. The keys
    are packed a chunk at a time (word, run and place while the chunk is in the CPU's
    cache) on two threads, straight into the one array that is sorted, and the places
    come back a chunk at a time as int32: a temporary as large as the index is fresh
    memory, which costs as much as the arithmetic on it (1M rows: 2,000 pages, 5 ms)."""
    top = 0 if run is None else int(run.max())
    place = (n - 1).bit_length()
    width = (64 - top.bit_length() - place) // 8
    if width < 1:  # no room for the place beside the run: an argsort
        width = min(8, (64 - top.bit_length()) // 8)
        key = _pack(word_of(0, n), run, width)
        if not (key[1:] < key[:-1]).any():
            return key, width, None
        perm = np.argsort(key)
        return key[perm], width, perm
    key = np.empty(n, dtype=np.uint64)
    put = np.uint64(place)

    def build(lows) -> None:
        for lo in lows:
            hi = min(n, lo + chunk)
            k = _pack(word_of(lo, hi), None if run is None else run[lo:hi], width)
            k <<= put
            k |= np.arange(lo, hi, dtype=np.uint64)
            key[lo:hi] = k

    on_two_threads(build, range(0, n, chunk))
    head = key[: chunk + 1]  # (an unsorted file is seen in its first chunk)
    if (head[1:] > head[:-1]).all() and (key[1:] > key[:-1]).all():  # in order: no sort
        key >>= put
        return key, width, None
    key.sort()
    perm = np.empty(n, dtype=_place_dtype(n))
    mask = np.uint64((1 << place) - 1)

    def unpack(lows) -> None:  # the places, then the keys without them, a chunk at a time
        for lo in lows:
            k = key[lo : lo + chunk]
            np.bitwise_and(k, mask, out=perm[lo : lo + chunk], casting="unsafe")
            k >>= put

    on_two_threads(unpack, range(0, n, chunk))
    return key, width, perm


def _pack(w: np.ndarray, run: np.ndarray | None, width: int) -> np.ndarray:
    """The words `w` (fresh: overwritten) cut to their first `width` bytes, beside `run`."""
    if width < 8:
        w >>= np.uint64(64 - 8 * width)
        if run is not None:
            high = run.astype(np.uint64)
            high <<= np.uint64(8 * width)
            w |= high
    return w


def _break_ties(seq, head, length, minor):
    """`seq` with each run of equal words sorted by (length, `minor`, position)."""
    tied, run = _ties(head)
    if len(tied):
        rows = seq[tied]
        perm = np.lexsort((rows, *(k[rows] for k in minor[::-1]), np.asarray(length)[rows], run))
        seq[tied] = rows[perm]
    return seq
