"""Dataset over part files end to end: partitions, samplers, batches, item cache.

Real stores: local folders, S3 on a moto server, HTTP via dataset.serve.
"""

from __future__ import annotations

import csv
import io
import subprocess
import sys

import fsspec
import numpy as np
import pytest
import torch
import webdataset as wds
from PIL import Image as PILImage

from distlearn.dataset import Dataset, PartError
from distlearn.dataset.index.parts import PartIndex, SampleMember
from distlearn.dataset.processors import Image
from tests.conftest import repo_env, wait_for_file
from tests.moto_server import moto_s3


def png(value: int) -> bytes:
    buf = io.BytesIO()
    PILImage.fromarray(np.full((4, 4), value, dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def write_shards(root, parts: int, per_part: int) -> dict[str, int]:
    """Tar shards of 4x4 PNGs whose pixel value is the sample number (mod 256)."""
    root.mkdir(parents=True, exist_ok=True)
    truth = {}
    n = 0
    for p in range(parts):
        with wds.TarWriter(str(root / f"train-{p:04d}.tar")) as sink:
            for _ in range(per_part):
                key = f"{n:06d}"
                sink.write({"__key__": key, "png": png(n % 256), "cls": str(n % 3)})
                truth[key] = n
                n += 1
    return truth


def read_epoch(batcher) -> tuple[list[str], list[int], list[float]]:
    keys, targets, pixels = [], [], []
    for batch in batcher:
        keys += [u.rsplit("#", 1)[0] + "#" for u in batch.urls]
        targets += batch.target.tolist()
        pixels += batch.input[:, 0, 0, 0].mul(255).round().tolist()
    return keys, targets, pixels


PROC = SampleMember(Image(mode="L"))


@pytest.mark.parametrize(
    "sampler", ["part-linear", "part-linear-permutation", "part-permutation-permutation"]
)
def test_every_record_once_per_epoch_across_partitions(tmp_path, sampler):
    truth = write_shards(tmp_path / "shards", 7, 9)
    seen = {0: [], 1: []}
    for p in range(3):
        ds = Dataset(tmp_path / "shards", partition=p, partitions=3, label_key="cls")
        assert isinstance(ds.index, PartIndex) and len(ds.index.parts) == len(range(p, 7, 3))
        b = ds.sampled_batcher(
            batch_size=4, input_dims=(1, 4, 4), sampler=sampler, processor=PROC, workers="thread"
        )
        with pytest.raises(TypeError, match="unknown length"):
            len(b)
        for epoch in range(2):
            _, targets, pixels = read_epoch(b)
            assert targets == [int(px) % 3 for px in pixels]
            seen[epoch] += pixels
        assert b.num_batches() == -(-len(ds.index) // 4) and ds.index.exact
        b.close()
    for epoch in range(2):
        assert sorted(seen[epoch]) == sorted(float(v % 256) for v in truth.values())


def test_default_sampler_is_part_linear_and_order(tmp_path):
    truth = write_shards(tmp_path / "s", 3, 5)
    ds = Dataset(tmp_path / "s", label_key="cls")
    b = ds.sampled_batcher(batch_size=4, input_dims=(1, 4, 4), processor=PROC, workers="thread")
    assert b.num_batches() == 4  # 15 records: the first part's count, scaled by part sizes
    _, _, pixels = read_epoch(b)
    assert pixels == [float(v) for v in truth.values()]
    assert b.num_batches() == 4 and ds.index.labels == ["0", "1", "2"]
    b.close()


def test_process_workers_and_errors(tmp_path):
    write_shards(tmp_path / "s", 2, 6)
    ds = Dataset(tmp_path / "s", partition=1, partitions=2)
    b = ds.sampled_batcher(
        batch_size=4, input_dims=(1, 4, 4), processor=PROC, workers="process", num_workers=1
    )
    try:
        _, targets, pixels = read_epoch(b)
    finally:
        b.close()
    assert pixels == [float(v) for v in range(6, 12)] and targets == [-1] * 6
    with pytest.raises(PartError, match="2 part files cannot feed 3 partitions"):
        Dataset(tmp_path / "s", partition=0, partitions=3)
    with pytest.raises(TypeError, match="cannot be addressed by position"):
        bad = ds.sampled_batcher(batch_size=4, input_dims=(1, 4, 4), sampler="permutation")
        next(iter(bad))


def test_s3_dataset_through_moto(tmp_path):
    truth = write_shards(tmp_path / "src", 4, 5)
    with moto_s3() as so:
        fs = fsspec.filesystem("s3", **so)
        fs.mkdir("data")
        fs.put(str(tmp_path / "src") + "/", "data/train/", recursive=True)
        got = []
        for p in range(2):
            ds = Dataset(
                "s3://data/train/",
                partition=p,
                partitions=2,
                storage_options=so,
                cache_dir=tmp_path / "cache",
            )
            b = ds.sampled_batcher(
                batch_size=3,
                input_dims=(1, 4, 4),
                processor=PROC,
                sampler="part-permutation-permutation",
                workers="thread",
            )
            got += read_epoch(b)[2]
            b.close()
    assert sorted(got) == sorted(float(v) for v in truth.values())


def test_cache_items_second_epoch_reads_from_disk(tmp_path):
    """Items of a CSV index over HTTP: after epoch 1 the server is stopped, epoch 2 still reads."""
    www = tmp_path / "www"
    www.mkdir()
    with open(www / "index.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["filename", "label"])
        for i in range(20):
            (www / f"{i}.png").write_bytes(png(i))
            w.writerow([f"{i}.png", f"c{i % 2}"])
    port_file = tmp_path / "port"
    server = subprocess.Popen(
        [sys.executable, "-m", "distlearn.dataset.serve", str(www), "--port-file", str(port_file)],
        env=repo_env(),
        stderr=subprocess.DEVNULL,
    )
    try:
        base = f"http://127.0.0.1:{wait_for_file(port_file, server)}/"
        opts = dict(cache_items=True, cache_index=True, cache_dir=tmp_path / "cache")
        ds = Dataset(base + "index.csv", **opts)
        b = ds.sampled_batcher(
            batch_size=8,
            input_dims=(1, 4, 4),
            processor=Image(mode="L"),
            workers="thread",
            retries=0,
        )
        first = read_epoch(b)[2]
        # linear: label by label, then by filename ("10.png" < "2.png")
        assert first == [float(i) for i in sorted(range(20), key=lambda i: (i % 2, f"{i}.png"))]
        server.terminate()
        server.wait(timeout=10)  # epoch 2 can only come from the cache now
        assert read_epoch(b)[2] == first
        b.close()
        # cache_index: the index itself comes from disk too, so a restarted job still opens it
        again = Dataset(base + "index.csv", **opts)
        assert again.index.sources == ds.index.sources
        with pytest.raises(OSError, match=r"127\.0\.0\.1:\d+/index\.csv: .* \(after 4 tries\)"):
            Dataset(base + "index.csv", cache_dir=tmp_path / "cache", backoff=0.01)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def test_part_options_only_for_parts():
    with pytest.raises(TypeError, match="apply to part files only"):
        Dataset(torch.zeros(3, 2), label_key="cls")


def test_thrift_media_records_in_tfrecord_parts(tmp_path):
    from distlearn.dataset.formats import write_tfrecord
    from distlearn.dataset.formats.thrift import MEDIA_SCHEMA, MediaRecord, encode

    (tmp_path / "media").mkdir()
    n = 0
    for p in range(3):
        frames = []
        for _ in range(4):
            rec = {1: png(n), 3: [4, 4]} | ({2: f"caption {n}"} if n % 2 else {})
            frames.append(write_tfrecord(encode(rec, MEDIA_SCHEMA, "compact")))
            n += 1
        (tmp_path / "media" / f"part-{p:05d}.tfrecord").write_bytes(b"".join(frames))
    ds = Dataset(tmp_path / "media")
    b = ds.sampled_batcher(
        batch_size=5,
        input_dims=(1, 4, 4),
        processor=MediaRecord("compact", mode="L"),
        workers="thread",
    )
    pixels, extras = [], []
    for batch in b:
        pixels += batch.input[:, 0, 0, 0].mul(255).round().tolist()
        extras += batch.extra
    b.close()
    assert pixels == [float(i) for i in range(12)]
    assert extras[1] == {"caption": "caption 1", "resolution": [4, 4]}
    assert extras[2] == {"caption": None, "resolution": [4, 4]}
