"""Part files: listing, partitioning by file, background loading, part-* samplers.

Real stores only: local folders, memory://, S3 through a moto server, HTTP
through dataset.serve.
"""

from __future__ import annotations

import gzip
import time
import tracemalloc
from pathlib import Path

import fsspec
import numpy as np
import pytest
import webdataset as wds

from distlearn.dataset import Dataset, PartError
from distlearn.dataset.fetch.cache import Cache
from distlearn.dataset.formats import write_tfrecord
from distlearn.dataset.index.part_files import (
    brace_count,
    expand_braces,
    is_part_source,
    list_parts,
)
from distlearn.dataset.index.parts import PartIndex, open_parts
from distlearn.dataset.sampling.samplers import PART_SAMPLERS as SAMPLERS
from tests.moto_server import moto_s3


def write_tar_parts(root: Path, parts: int, per_part: int, size: int = 100) -> list[str]:
    """Tar shards (webdataset's TarWriter) of samples with a payload and a class."""
    root.mkdir(parents=True, exist_ok=True)
    keys = []
    for p in range(parts):
        with wds.TarWriter(str(root / f"shard-{p:03d}.tar")) as sink:
            for i in range(per_part):
                key = f"p{p:03d}i{i:04d}"
                sink.write(
                    {"__key__": key, "bin": key.encode() * (size // 9 + 1), "cls": str(i % 7)}
                )
                keys.append(key)
    return keys


def epoch_keys(index: PartIndex, sampler: str, epoch: int = 0, seed: int = 0) -> list[str]:
    rng = np.random.default_rng([seed, index.partition_id, epoch])
    return [r.source["__key__"] for r in SAMPLERS[sampler](index, epoch, rng)]


def test_expand_braces_and_is_part_source(tmp_path):
    assert expand_braces("s-{08..11}.tar") == ["s-08.tar", "s-09.tar", "s-10.tar", "s-11.tar"]
    assert expand_braces("{a,b}/{1..2}") == ["a/1", "a/2", "b/1", "b/2"]
    assert is_part_source("http://h/x-{0..3}.tar") and is_part_source("s3://b/prefix/")
    assert not is_part_source("http://h/index.csv") and not is_part_source(tmp_path / "nope")
    write_tar_parts(tmp_path / "shards", 2, 1)
    (tmp_path / "shards" / "_SUCCESS").write_text("")
    assert is_part_source(tmp_path / "shards") and is_part_source(f"file://{tmp_path}/shards")
    (tmp_path / "labelled" / "cats").mkdir(parents=True)  # a labelled directory index
    assert not is_part_source(tmp_path / "labelled")


def test_a_pattern_of_too_many_names_is_refused_before_they_are_made():
    """{0..999999999} (a digit too many) built a billion strings, in is_part_source
    already, before anything could say so; now it is counted first and refused."""
    assert brace_count("p-{000..099}-{a,b,c}.tar") == 300 and brace_count("{9..1}") == 0
    t0 = time.monotonic()
    with pytest.raises(PartError, match="stands for 1,000,000,000 names"):
        Dataset("http://127.0.0.1:9/part-{000000000..999999999}.tar")
    assert time.monotonic() - t0 < 5


def test_list_local_skips_markers_and_sorts(tmp_path):
    write_tar_parts(tmp_path, 3, 1)
    (tmp_path / "_SUCCESS").write_text("")
    (tmp_path / ".hidden.tar").write_text("")
    parts = list_parts(str(tmp_path))
    assert [Path(p).name for p in parts] == ["shard-000.tar", "shard-001.tar", "shard-002.tar"]
    with pytest.raises(PartError, match="no such folder"):
        list_parts(str(tmp_path / "missing"))


def test_partition_by_file_and_too_few_files(tmp_path):
    write_tar_parts(tmp_path, 5, 2)
    whole = open_parts(tmp_path, cache_parts=False)
    split = [whole.partition(p, 3).parts for p in range(3)]
    assert split == [whole.parts[0::3], whole.parts[1::3], whole.parts[2::3]]
    with pytest.raises(PartError, match=r"5 part files cannot feed 6 partitions"):
        whole.partition(0, 6)


@pytest.mark.parametrize("sampler", sorted(SAMPLERS))
def test_every_record_once_per_epoch_across_partitions(tmp_path, sampler):
    keys = write_tar_parts(tmp_path, 7, 13)
    whole = open_parts(tmp_path, cache_parts=False)
    for epoch in range(2):
        seen = []
        for p in range(3):
            seen += epoch_keys(whole.partition(p, 3), sampler, epoch)
        assert sorted(seen) == sorted(keys)


def test_sampler_orders(tmp_path):
    keys = write_tar_parts(tmp_path, 4, 20)
    idx = open_parts(tmp_path, cache_parts=False)
    assert epoch_keys(idx, "part-linear") == keys
    lp = epoch_keys(idx, "part-linear-permutation")
    # parts stay in order, records move only within their part
    assert [k[:4] for k in lp] == [k[:4] for k in keys] and lp != keys
    pp0 = epoch_keys(idx, "part-permutation-permutation", epoch=0)
    pp1 = epoch_keys(idx, "part-permutation-permutation", epoch=1)
    assert pp0 != pp1 and sorted(pp0) == sorted(keys)
    # seeded: the same (seed, partition, epoch) gives the same order
    assert pp0 == epoch_keys(idx, "part-permutation-permutation", epoch=0)
    with pytest.raises(TypeError, match="not a folder of part files"):
        SAMPLERS["part-linear"]([1, 2], 0, np.random.default_rng(0))


def test_len_is_an_estimate_until_parts_are_read(tmp_path):
    """Parts of 10, 20, 30 and 40 records: not 4 (the parts) but ~100, from part sizes."""
    for p, n in enumerate((10, 20, 30, 40)):
        with wds.TarWriter(str(tmp_path / f"shard-{p:03d}.tar")) as sink:
            for i in range(n):
                sink.write({"__key__": f"p{p}i{i:03d}", "bin": bytes(2000), "cls": "1"})
    idx = open_parts(tmp_path, cache_parts=False, resident_parts=2)
    assert 90 <= len(idx) <= 110 and not idx.exact  # part 0 read, its records per byte scaled
    stream = iter(SAMPLERS["part-linear"](idx, 0, np.random.default_rng(0)))
    next(stream)
    assert 90 <= len(idx) <= 110
    list(stream)
    assert len(idx) == 100 and idx.exact


def test_memory_stays_bounded_by_resident_parts(tmp_path):
    # 24 parts of ~1 MB: a dataset far larger than the 2 parts allowed in memory
    write_tar_parts(tmp_path, 24, 100, size=10_000)
    idx = open_parts(tmp_path, cache_parts=False, resident_parts=2)
    tracemalloc.start()
    try:
        n = 0
        for rec in SAMPLERS["part-linear-permutation"](idx, 0, np.random.default_rng(0)):
            n += len(rec.source["bin"])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    total = sum(Path(p).stat().st_size for p in idx.parts)
    assert n > 20_000_000 and total > 20_000_000
    assert idx.max_resident_seen <= 2
    # a part is read whole (~1 MB), then parsed (~1 MB): a few parts' worth at most
    assert peak < 8 * total / 24, (peak, total)


def test_formats_gzip_and_corrupt_records(tmp_path, caplog):
    recs = [f"rec{i}".encode() for i in range(30)]
    (tmp_path / "part-00000.tfrecord").write_bytes(b"".join(write_tfrecord(r) for r in recs[:10]))
    data = b"".join(write_tfrecord(r) for r in recs[10:20])
    (tmp_path / "part-00001.tfrecord.gz").write_bytes(gzip.compress(data[:-3]))  # last one cut
    (tmp_path / "part-00002").write_bytes(b"\n".join(recs[20:]) + b"\n")
    idx = open_parts(tmp_path, cache_parts=False)
    got = [r.source for r in SAMPLERS["part-linear"](idx, 0, np.random.default_rng(0))]
    assert got == recs[:19] + recs[20:]
    assert idx.stats.corrupt == 1 and idx.stats.records == 29
    assert "part-00001.tfrecord.gz" in caplog.text
    # record_format overrides the extension
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "part-0").write_bytes(data)
    idx = open_parts(tmp_path / "x", cache_parts=False, record_format="tfrecord")
    assert [r.source for r in SAMPLERS["part-linear"](idx, 0, None)] == recs[10:20]


def test_labels_from_a_member(tmp_path):
    write_tar_parts(tmp_path, 2, 10)
    idx = open_parts(tmp_path, cache_parts=False, label_key="cls")
    recs = list(SAMPLERS["part-linear"](idx, 0, None))
    assert [r.labels for r in recs[:8]] == [(i % 7,) for i in range(8)]
    assert idx.labels == [str(i) for i in range(7)]
    named = open_parts(tmp_path, cache_parts=False, label_key="cls", labels=list("0123"))
    with pytest.raises(PartError, match="label '4' is not one of"):
        list(SAMPLERS["part-linear"](named, 0, None))


def test_memory_filesystem():
    keys = []
    fs = fsspec.filesystem("memory")
    for p in range(4):
        body = b"".join(f"m{p}-{i}\n".encode() for i in range(5))
        fs.pipe(f"/parts-test/part-{p:05d}", body)
        keys += [f"m{p}-{i}".encode() for i in range(5)]
    whole = open_parts("memory://parts-test/")
    assert all(p.startswith("memory://") for p in whole.parts)
    seen = []
    for p in range(2):
        seen += [r.source for r in SAMPLERS["part-linear"](whole.partition(p, 2), 0, None)]
    assert sorted(seen) == sorted(keys)
    fs.rm("/parts-test", recursive=True)


def test_s3_through_moto(tmp_path):
    keys = write_tar_parts(tmp_path / "src", 5, 8)
    with moto_s3() as so:
        fs = fsspec.filesystem("s3", **so)
        fs.mkdir("bucket")
        fs.put(str(tmp_path / "src") + "/", "bucket/train/", recursive=True)
        fs.pipe("bucket/train/_SUCCESS", b"")
        cache = tmp_path / "cache"
        whole = open_parts("s3://bucket/train/", storage_options=so, cache_dir=cache)
        assert len(whole.parts) == 5 and whole.parts[0] == "s3://bucket/train/shard-000.tar"
        seen = []
        for p in range(2):
            seen += epoch_keys(whole.partition(p, 2), "part-permutation-permutation")
        assert sorted(seen) == sorted(keys)
        files = list((tmp_path / "src").iterdir())
        assert Cache(cache).size() == sum(f.stat().st_size + 16 for f in files)  # + trailers


def test_http_brace_pattern_cache_and_missing_part(tmp_path, serve_dir, caplog):
    keys = write_tar_parts(tmp_path / "www", 4, 6)
    base = serve_dir(tmp_path / "www")
    pattern = base + "shard-{000..004}.tar"  # shard-004 does not exist: a 404
    whole = open_parts(pattern, cache_dir=tmp_path / "cache", part_retries=1)
    assert len(whole.parts) == 5
    got = epoch_keys(whole, "part-linear")
    assert got == keys and whole.failed_parts == 1
    assert "shard-004.tar" in caplog.text
    # the second epoch reads the parts from the cache
    hits = whole.cache.hits
    assert epoch_keys(whole, "part-linear", epoch=1) == keys
    assert whole.cache.hits - hits == 4
    with pytest.raises(PartError, match="brace pattern"):
        list_parts(base)
