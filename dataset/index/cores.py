"""A numpy pass shared by two threads, for the passes that follow pyarrow's parse;
and the memory an index's large arrays are made in.

numpy lets go of the GIL in its loops (comparisons, reductions, gathers), so a
pass over many chunks runs on both cores when each thread takes every other
chunk; the other core is idle once pyarrow's parse is done.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import numpy as np

__all__ = ["FRESH", "arange", "fresh", "in_order", "on_two_threads", "take"]

T = TypeVar("T")

# Arrays from this size on are made in small pages of their own (see fresh()).
FRESH = 64 << 20


def fresh(shape: int | tuple, dtype) -> np.ndarray:
    """An empty array; from :data:`FRESH` bytes on, in small pages of a mapping of
    its own rather than numpy's memory. numpy asks the kernel for huge pages for
    arrays of 4 MiB or more, and where memory is fragmented (a host whose page cache
    is full of files) their first faults compact memory. Measured here, after another
    process had mapped a 440 MB file, a 10M-row index opened in 0.39-0.69 s (0.23-0.54
    s of it in the kernel); with its arrays of 64 MiB or more in small pages, 0.32-0.39
    s whatever ran before (0.24 s in huge pages on a quiet host). A 1M-row open keeps
    numpy's memory: 0.035 s either way."""
    dtype = np.dtype(dtype)
    size = int(np.prod(shape)) * dtype.itemsize
    if size < FRESH:
        return np.empty(shape, dtype=dtype)
    pages = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return np.frombuffer(pages, dtype=dtype).reshape(shape)


def arange(n: int, dtype, block: int = 1 << 20) -> np.ndarray:
    """``np.arange(n, dtype=dtype)`` in :func:`fresh` memory (a block at a time)."""
    out = fresh(n, dtype)
    for lo in range(0, n, block):
        out[lo : lo + block] = np.arange(lo, min(n, lo + block), dtype=dtype)
    return out


def on_two_threads(work: Callable[[Sequence], T], parts: Sequence, least: int = 4) -> list[T]:
    """``[work(parts[0::2]), work(parts[1::2])]``, the second in a thread of its own;
    ``[work(parts)]`` where there are fewer than `least` parts (a thread costs more
    than it saves)."""
    if len(parts) < least:
        return [work(parts)]
    with ThreadPoolExecutor(1) as helper:
        theirs = helper.submit(work, parts[1::2])
        return [work(parts[0::2]), theirs.result()]


def in_order(halves: list[list]) -> list:
    """The items of :func:`on_two_threads`'s results back in the parts' order, where
    `work` gave one item per part (the first thread took parts 0, 2, 4...)."""
    if len(halves) == 1:
        return halves[0]
    out: list = [None] * (len(halves[0]) + len(halves[1]))
    out[0::2], out[1::2] = halves
    return out


def take(a: np.ndarray, at: np.ndarray, chunk: int = 1 << 17) -> np.ndarray:
    """``a[at]`` for a 1-D array of valid positions `at`, gathered a chunk of `at` at a
    time on two threads (numpy's take lets go of the GIL)."""
    out = np.empty(len(at), dtype=a.dtype)

    def gather(lows) -> None:
        for lo in lows:
            np.take(a, at[lo : lo + chunk], out=out[lo : lo + chunk], mode="clip")  # (unbuffered)

    on_two_threads(gather, range(0, len(at), chunk))
    return out
