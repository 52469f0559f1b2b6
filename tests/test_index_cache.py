"""A CSV index parsed once per host: kept in the cache, memory-mapped by every process."""

from __future__ import annotations

import logging
import multiprocessing as mp

import numpy as np
import pytest

from distlearn.dataset import Dataset


def write_index(path, n: int, offset: int = 0) -> None:
    rows = "".join(f"d{i % 7}/{i + offset:05d}.png,l{i % 3}\n" for i in range(n))
    path.write_text("filename,label\n" + rows)


def summary(ds) -> list:
    ix = ds.index
    return [(ix.source(i), ix.target(i), ix.item_labels(i)) for i in range(len(ix))]


def mapped(ds) -> bool:
    """Whether the index's names live in a memory-mapped cache entry."""
    base = ds.index.table.buf
    while getattr(base, "base", None) is not None and not isinstance(base, memoryview):
        base = base.base
    return isinstance(base, memoryview)


def test_the_second_open_maps_the_parsed_index(tmp_path):
    write_index(tmp_path / "i.csv", 500)
    opts = dict(cache_index=True, cache_dir=tmp_path / "cache")
    plain = Dataset(tmp_path / "i.csv", partition=1, partitions=3)
    first = Dataset(tmp_path / "i.csv", partition=1, partitions=3, **opts)
    second = Dataset(tmp_path / "i.csv", partition=1, partitions=3, **opts)
    assert summary(plain) == summary(first) == summary(second)
    assert not mapped(plain) and mapped(second)
    assert not second.index.table.buf.flags.writeable  # the shared pages are read-only
    assert second.index.labels == plain.index.labels == ["l0", "l1", "l2"]


def test_a_changed_file_is_parsed_again(tmp_path):
    opts = dict(cache_index=True, cache_dir=tmp_path / "cache")
    write_index(tmp_path / "i.csv", 50)
    before = summary(Dataset(tmp_path / "i.csv", **opts))
    write_index(tmp_path / "i.csv", 60, offset=1000)
    after = Dataset(tmp_path / "i.csv", **opts)
    assert summary(after) == summary(Dataset(tmp_path / "i.csv")) != before
    assert len(after.index) == 60


def test_a_damaged_entry_is_rebuilt(tmp_path, caplog):
    opts = dict(cache_index=True, cache_dir=tmp_path / "cache")
    write_index(tmp_path / "i.csv", 80)
    want = summary(Dataset(tmp_path / "i.csv", **opts))
    for entry in (tmp_path / "cache" / "objects").rglob("*"):
        if entry.is_file():
            data = entry.read_bytes()
            entry.write_bytes(data[: len(data) // 2])  # a torn or truncated file
    with caplog.at_level(logging.WARNING):
        assert summary(Dataset(tmp_path / "i.csv", **opts)) == want
    assert "damaged" in caplog.text


def _open(args) -> tuple[int, list]:
    path, cache, p = args
    ds = Dataset(path, partition=p, partitions=4, cache_index=True, cache_dir=cache)
    return p, [ds.index.source(i) for i in range(len(ds.index))]


@pytest.mark.timeout(120)
def test_processes_opening_at_once_parse_once_and_agree(tmp_path):
    write_index(tmp_path / "i.csv", 2000)
    args = [(str(tmp_path / "i.csv"), str(tmp_path / "cache"), p) for p in range(4)]
    with mp.get_context("spawn").Pool(4) as pool:
        got = dict(pool.map(_open, args, chunksize=1))
    want = {p: _open((args[0][0], str(tmp_path / "other"), p))[1] for p in range(4)}
    assert got == want
    assert sorted(s for p in got for s in got[p]) == sorted(
        str(tmp_path / f"d{i % 7}" / f"{i:05d}.png") for i in range(2000)
    )
    entries = [e for e in (tmp_path / "cache" / "objects").rglob("*") if e.is_file()]
    assert len(entries) == 1  # one parsed index, written once


def test_partitions_are_index_arrays_over_one_table(tmp_path):
    write_index(tmp_path / "i.csv", 300)
    whole = Dataset(tmp_path / "i.csv").index
    parts = [whole.partition(p, 4) for p in range(4)]
    assert all(p.table is whole.table and p.row_labels is whole.row_labels for p in parts)
    rows = np.sort(np.concatenate([p.rows for p in parts]))
    assert (rows == np.arange(300)).all()
    assert whole.nbytes / whole.num_rows < 100


def test_partition_positions_match_the_definition():
    """The k-th example of each label (from 1) goes to partition k % n, whatever the order."""
    from distlearn.dataset.index.table import BY_LABEL, partition_positions

    rng = np.random.default_rng(0)
    for trial in range(200):
        targets = rng.integers(-1, int(rng.integers(1, 6)), int(rng.integers(1, 60)))
        if trial % 2:  # label order, unlabeled last, as an opened index holds them
            targets = np.asarray(sorted(targets.tolist(), key=lambda t: (t < 0, t)))
        targets = targets.astype(np.int16)
        for n in (1, 2, 3, 8):
            seen = {}
            want = {p: [] for p in range(n)}
            for i, t in enumerate(targets.tolist()):
                seen[t] = seen.get(t, 0) + 1
                want[seen[t] % n].append(i)
            for p in range(n):
                assert partition_positions(targets, p, n, BY_LABEL).tolist() == want[p]


def test_names_kept_in_pyarrow_s_chunks_are_cached_whole(tmp_path, monkeypatch):
    from distlearn.dataset.index.csv import arrow as csvarrow
    from distlearn.dataset.index.csv import reader

    monkeypatch.setattr(csvarrow, "BLOCK", 1 << 12)  # many chunks, in label-then-name order
    monkeypatch.setenv(reader.READERS_ENV, "arrow,csv")  # (pyarrow's chunks, not a C copy)
    rows = "".join(f"l{i // 700}/{i:05d}.png,l{i // 700}\n" for i in range(2000))
    (tmp_path / "i.csv").write_text("filename,label\n" + rows)
    opts = dict(cache_index=True, cache_dir=tmp_path / "cache")
    plain = Dataset(tmp_path / "i.csv")
    assert len(plain.index.table._parts) > 5  # not joined: no sort, no cache
    first, second = Dataset(tmp_path / "i.csv", **opts), Dataset(tmp_path / "i.csv", **opts)
    assert summary(plain) == summary(first) == summary(second)
    assert plain.index.nbytes == second.index.nbytes and mapped(second)
