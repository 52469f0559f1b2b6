"""Every part reader bounded in time and memory by what it was given: hostile or broken
parts (a class id of 3e9, megabytes of junk, a FIFO, /dev/zero, a part larger than
allowed, a download that never ends) against the real readers, stores and servers."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import tracemalloc

import fsspec
import numpy as np
import pytest
import webdataset as wds

from distlearn.dataset import Dataset, PartError
from distlearn.dataset.formats import ReadStats, read_part, write_tfrecord
from distlearn.dataset.index.parts import MAX_CLASS_IDS, open_parts
from distlearn.dataset.sampling.samplers import PART_SAMPLERS as SAMPLERS
from tests.conftest import repo_env
from tests.faulty_server import running
from tests.moto_server import moto_s3


def records(index, sampler="part-linear"):
    return list(SAMPLERS[sampler](index, 0, np.random.default_rng(0)))


def loader_threads(other: frozenset = frozenset()) -> list[threading.Thread]:
    """The part loaders alive now, but those in `other` (an earlier test's, in the same
    test worker process, may still be finishing a part of its own)."""
    return [t for t in threading.enumerate() if t.name.startswith("part-loader") and t not in other]


def wait_no_loaders(timeout: float, other: frozenset = frozenset()) -> list[threading.Thread]:
    deadline = time.monotonic() + timeout
    while loader_threads(other) and time.monotonic() < deadline:
        time.sleep(0.05)
    return loader_threads(other)


@pytest.mark.timeout(60)
def test_a_huge_class_id_is_refused_not_counted_up_to(tmp_path):
    """cls=3000000000 made the reader name 3e9 labels (MemoryError, after minutes)."""
    with wds.TarWriter(str(tmp_path / "shard-000.tar")) as sink:
        sink.write({"__key__": "a", "bin": b"x", "cls": b"2"})
        sink.write({"__key__": "b", "bin": b"y", "cls": b"3000000000"})
    index = open_parts(tmp_path, cache_parts=False, label_key="cls")
    with pytest.raises(PartError, match=r"class id 3000000000 is beyond the 65,536 .*labels="):
        records(index)
    assert len(index.labels) <= 3
    named = open_parts(tmp_path, cache_parts=False, label_key="cls",
                       labels=[str(i) for i in range(3)] + ["3000000000"])  # fmt: skip
    assert [r.labels for r in records(named)] == [(2,), (3,)]
    assert MAX_CLASS_IDS == 1 << 16


@pytest.mark.timeout(120)
@pytest.mark.parametrize("junk", ["random", "zeros"])
def test_a_tfrecord_part_of_junk_is_scanned_in_linear_time(junk):
    """Resync after a bad length CRC went a byte at a time in Python (about 2 us a
    byte: 130 s for these 64 MiB, hours for a 4 GiB part). The bound here is loose
    (a complexity check on a shared machine); bench figures are in the report."""
    size = 64 << 20
    data = os.urandom(size) if junk == "random" else bytes(size)
    good = write_tfrecord(b"payload")
    stats = ReadStats()
    t0 = time.perf_counter()
    got = list(read_part(data + good, "junk.tfrecord", stats=stats))
    took = time.perf_counter() - t0
    assert [rec for _, rec in got] == [b"payload"] and stats.corrupt == 1
    assert took < 10, f"{took:.1f} s for 64 MiB of junk"


def test_part_timeout_stops_the_download_not_only_its_waiter(tmp_path):
    """A download that never ends: the waiter raised PartError at part_timeout, and the
    loader thread went on retrying it in the background (part_retries more times)."""
    root = tmp_path / "www"
    root.mkdir()
    with wds.TarWriter(str(root / "shard-000.tar")) as sink:
        sink.write({"__key__": "a", "bin": b"x"})
    other = frozenset(loader_threads())
    with running(root, {"shard-000.tar": ["hold"]}) as (base, hits):
        index = open_parts(base + "shard-{000..000}.tar", cache_parts=False, part_timeout=1,
                           part_retries=3, backoff=0.01)  # fmt: skip
        t0 = time.monotonic()
        with pytest.raises(PartError, match="part_timeout=1"):
            records(index)
        assert time.monotonic() - t0 < 5
        left = wait_no_loaders(2.0, other)
        (root.parent / "release").touch()
        counts = hits()
    assert left == [], "the part loader outlived part_timeout"
    assert counts["shard-000.tar"] == 1, "the download was retried after part_timeout"


@pytest.mark.timeout(120)
def test_part_timeout_stops_a_parse_that_runs_long(tmp_path):
    """Junk made to be slow to scan (zeros wherever a length's high bytes would be),
    with part_timeout far shorter than its scan: the loader stops at its deadline."""
    pattern = b"\x01" + bytes(12)
    (tmp_path / "part-000.tfrecord").write_bytes(pattern * ((192 << 20) // len(pattern)))
    other = frozenset(loader_threads())
    index = open_parts(tmp_path, cache_parts=False, part_timeout=0.5)
    t0 = time.monotonic()
    with pytest.raises(PartError, match=r"part_timeout=0\.5"):
        records(index)
    assert wait_no_loaders(2.0, other) == [], "the part loader outlived part_timeout"
    assert time.monotonic() - t0 < 4


@pytest.mark.timeout(60)
def test_a_fifo_part_is_refused_not_waited_on(tmp_path):
    """A FIFO among the parts blocked its loader for ever (open() waits for a writer)."""
    os.mkfifo(tmp_path / "part-000")
    (tmp_path / "part-001").write_bytes(b"one\ntwo\n")
    ds = Dataset(tmp_path, record_format="lines", cache_parts=False, part_timeout=30)
    with ds.sampled_batcher(batch_size=2, sampler="part-linear", workers="thread",
                            processor=lambda data, opt, out: True) as b:  # fmt: skip
        got = [u for batch in b for u in batch.urls]
        stats = b.stats
    assert len(got) == 2 and stats["failed_parts"] == 1


@pytest.mark.timeout(120)
def test_dev_zero_as_a_part_does_not_fill_memory(tmp_path):
    """/dev/zero as a part was read until memory ran out; it is refused unread now.
    (In a child with 6 GiB of address space: what it did before must not reach the
    machine's other processes.)"""
    (tmp_path / "part-001").write_bytes(b"one\ntwo\n")
    pattern = "{/dev/zero," + str(tmp_path / "part-001") + "}"
    code = (
        "import resource, sys\n"
        "resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))\n"
        "from distlearn.dataset.index.parts import open_parts\n"
        "from distlearn.dataset.sampling.samplers import PART_SAMPLERS\n"
        f"ix = open_parts({pattern!r}, cache_parts=False, record_format='lines')\n"
        "recs = list(PART_SAMPLERS['part-linear'](ix, 0, None))\n"
        "print(len(recs), ix.failed_parts)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=100, env=repo_env())  # fmt: skip
    assert run.stdout.split() == ["2", "1"], run.stderr[-2000:]
    assert "not a regular file" in run.stderr


@pytest.mark.timeout(120)
def test_a_remote_part_too_large_is_refused_before_it_is_read(tmp_path, caplog):
    """fsspec parts were read whole (cat_file), then their size checked: a 48 MiB part
    against max_part_bytes=1 MiB was held whole first."""
    with moto_s3() as so:
        fs = fsspec.filesystem("s3", **so)
        fs.mkdir("bucket")
        fs.pipe("bucket/train/big.txt", b"x\n" * (24 << 20))
        fs.pipe("bucket/train/small.txt", b"a\nb\n")
        for url in ("s3://bucket/train/", "s3://bucket/train/{big,small}.txt"):  # sizes listed,
            index = open_parts(url, storage_options=so, cache_parts=False,  # or not
                               record_format="lines", max_part_bytes=1 << 20)  # fmt: skip
            tracemalloc.start()
            try:
                got = records(index)
                _, peak = tracemalloc.get_traced_memory()
            finally:
                tracemalloc.stop()
            # (the S3 client's models, loaded per client, are 10-20 MiB of it; the part
            # is 48 MiB)
            assert peak < 32 << 20, f"{peak >> 20} MiB held for a part refused by its size"
            assert [r.source for r in got] == [b"a", b"b"] and index.failed_parts == 1
            assert "50331648 bytes exceed max_part_bytes=1048576" in caplog.text


@pytest.mark.timeout(120)
def test_item_bodies_held_by_a_worker_are_bounded_by_pool_size(tmp_path):
    """Every fetched body of every batch in flight waited for a slow processor (32
    items of 4 MiB, pool_size=4: all 32 held at the peak). A worker holds at most
    pool_size now (from fetch to decoded), each twice for the moment its chunks are
    joined."""
    from distlearn.dataset import Dataset
    from tests.recording_server import recording

    size, n, pool = 4 << 20, 32, 4
    (tmp_path / "items").mkdir()
    for i in range(n):
        (tmp_path / "items" / f"{i}.bin").write_bytes(bytes([i]) * size)
    (tmp_path / "train.csv").write_text(
        "filename\n" + "".join(f"items/{i}.bin\n" for i in range(n))
    )

    def slow(data, opt, out):
        time.sleep(0.1)  # (slower than the fetches: they would run ahead)
        out[0] = data[0]

    with recording(tmp_path) as srv:
        ds = Dataset(srv.url + "train.csv")
        tracemalloc.start()
        try:
            with ds.sampled_batcher(batch_size=16, input_dims=(1,), processor=slow,
                                    workers="thread", pool_size=pool, prefetch=2) as b:  # fmt: skip
                got = sorted(int(x[0]) for batch in b for x in batch.input)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert got == list(range(n))
    assert peak <= (2 * pool + 2) * size, f"{peak / size:.1f} bodies of {size >> 20} MiB at peak"
