"""dataset.cores: a numpy pass shared by two threads gives what one pass gives."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from distlearn.dataset.index import cores


def test_on_two_threads_splits_the_parts_between_two_threads():
    seen: list[tuple[list[int], str]] = []
    out = cores.on_two_threads(
        lambda part: seen.append((list(part), threading.current_thread().name)) or sum(part),
        range(10),
    )
    assert out == [0 + 2 + 4 + 6 + 8, 1 + 3 + 5 + 7 + 9]
    assert len({name for _, name in seen}) == 2
    assert cores.on_two_threads(sum, range(3)) == [3]  # (fewer than 4 parts: one thread)


@pytest.mark.parametrize("chunk", [1, 3, 7, 1 << 17])
def test_take_in_chunks_on_two_threads_is_numpys_gather(chunk):
    rng = np.random.default_rng(chunk)
    a = rng.integers(-1, 1000, size=500).astype(np.int16)
    at = rng.integers(0, len(a), size=2000).astype(np.int32)
    got = cores.take(a, at, chunk=chunk)
    assert got.dtype == a.dtype and got.tolist() == a[at].tolist()
    assert cores.take(a, at[:0], chunk=chunk).tolist() == []


@pytest.mark.parametrize("n", [0, 1, 3, 4, 9])
def test_in_order_puts_each_part_s_item_back_in_place(n):
    parts = list(range(n))
    halves = cores.on_two_threads(lambda part: [p * 10 for p in part], parts)
    assert cores.in_order(halves) == [p * 10 for p in parts]


@pytest.mark.parametrize("shape", [0, 7, (5, 3), 1 << 20, (1 << 18, 3)])
@pytest.mark.parametrize("dtype", [np.uint8, np.int16, np.uint32, np.int64])
def test_fresh_arrays_below_and_past_the_threshold(monkeypatch, shape, dtype):
    """Small pages of a mapping of its own from FRESH bytes on: an ordinary writable
    array of that shape and type, which outlives the call that made it."""
    monkeypatch.setattr(cores, "FRESH", 1 << 16)
    a = cores.fresh(shape, dtype)
    assert a.shape == np.empty(shape).shape and a.dtype == dtype and a.flags.writeable
    a[...] = 3
    assert (a == 3).all()
    b = np.copy(a)
    del a
    assert (b == 3).all()


@pytest.mark.parametrize("n", [0, 1, (1 << 20) - 1, 1 << 20, 3 * (1 << 20) + 5])
def test_arange_in_fresh_memory_is_numpy_s(monkeypatch, n):
    monkeypatch.setattr(cores, "FRESH", 1 << 16)
    assert np.array_equal(cores.arange(n, np.int32), np.arange(n, dtype=np.int32))
