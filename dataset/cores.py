"""A numpy pass shared by two threads, for the passes that follow pyarrow's parse.

numpy lets go of the GIL in its loops (comparisons, reductions, gathers), so a
pass over many chunks runs on both cores when each thread takes every other
chunk; the other core is idle once pyarrow's parse is done.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import numpy as np

T = TypeVar("T")


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
