"""A cache that fails must cost its entries, never the data: a real full disk (a 1 MiB
tmpfs) under items, parts and a parsed index; and an optional meta file's passing 404
is not remembered for ever. Servers are real (aiohttp on 127.0.0.1)."""

from __future__ import annotations

import contextlib
import subprocess

import pytest
import webdataset as wds

from distlearn.dataset import Dataset
from distlearn.dataset.processors import Raw
from tests.faulty_server import running
from tests.recording_server import recording

ITEM = 64 << 10  # 40 items of 64 KiB: 2.5 MiB through a 1 MiB cache disk


@pytest.fixture
def full_disk(tmp_path):
    """A folder on a 1 MiB tmpfs of its own (root only: mount(2) needs CAP_SYS_ADMIN)."""
    where = tmp_path / "small"
    where.mkdir()
    run = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=0700", "tmpfs",
                          str(where)], capture_output=True, text=True)  # fmt: skip
    if run.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({run.stderr.strip()}): needs root")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def items(root, n: int = 40) -> None:
    (root / "items").mkdir(parents=True, exist_ok=True)
    for i in range(n):
        (root / "items" / f"{i}.bin").write_bytes(bytes([i]) * ITEM)
    rows = "\n".join(f"items/{i}.bin" for i in range(n))
    (root / "train.csv").write_text(f"filename\n{rows}\n")


def first_bytes(ds, **kw) -> list[int]:
    errors: list[BaseException] = []
    with ds.sampled_batcher(batch_size=8, input_dims=(ITEM,), processor=Raw(),
                            workers="thread", on_error=errors.append, **kw) as b:  # fmt: skip
        got = sorted(int(x[0]) for batch in b for x in batch.input)
    assert errors == [], errors[:2]
    return got


def test_a_full_cache_disk_drops_no_item_that_was_fetched(tmp_path, full_disk, caplog):
    """Before: every item whose put hit ENOSPC was counted failed and dropped (the
    fetch had succeeded)."""
    items(tmp_path / "www")
    with recording(tmp_path / "www") as srv:
        ds = Dataset(srv.url + "train.csv", cache_items=True, cache_dir=full_disk / "c")
        assert first_bytes(ds) == list(range(40))
        assert first_bytes(ds) == list(range(40))  # (a second epoch: some from the cache)
    assert "cannot store entries (No space left on device)" in caplog.text


def test_a_full_cache_disk_costs_no_part_and_no_index(tmp_path, full_disk):
    """Before: a part whose cache entry hit ENOSPC raised out of the epoch, and a CSV
    index parsed into a full cache could not be opened."""
    www = tmp_path / "www"
    www.mkdir()
    for p in range(3):
        with wds.TarWriter(str(www / f"shard-{p}.tar")) as sink:
            for i in range(4):
                sink.write({"__key__": f"{p}-{i}", "bin": bytes([p * 4 + i]) * (200 << 10)})
    items(www, 8)
    # fill the disk (the parts are 800 KiB each: the first one no longer fits)
    with contextlib.suppress(OSError), open(full_disk / "ballast", "wb") as f:
        f.write(bytes(900 << 10))
    with recording(www) as srv:
        ds = Dataset(srv.url + "shard-{0..2}.tar", cache_dir=full_disk / "c")
        with ds.sampled_batcher(batch_size=4, input_dims=(4,), sampler="part-linear",
                                processor=lambda s, o, out: out.fill_(s["bin"][0]) is not None,
                                workers="thread") as b:  # fmt: skip
            got = sorted(int(x[0]) for batch in b for x in batch.input)
            assert b.stats["failed_parts"] == 0
        assert got == list(range(12))
        ds = Dataset(srv.url + "train.csv", cache_index=True, cache_dir=full_disk / "c")
        assert len(ds) == 8


def test_an_optional_meta_file_s_404_is_not_remembered_for_ever(tmp_path):
    """The meta file 404s (a server still starting, a CDN's hiccup, a file put in
    place late), then is there. Before: its absence was kept in the cache for ever, and
    every later open resolved the rows without its prefix (every item then failed)."""
    www = tmp_path / "www"
    items(www / "cdn", 4)
    (www / "train.csv").write_text("filename\n" + "".join(f"items/{i}.bin\n" for i in range(4)))
    cache = tmp_path / "cache"
    with running(www) as (base, _hits):
        first = Dataset(base + "train.csv", cache_index=True, cache_dir=cache)
        assert first.index.source(0) == base + "items/0.bin"  # (a 404: no prefix)
        (www / "train-meta.csv").write_text(f"prefix\n{base}cdn/\n")
        again = Dataset(base + "train.csv", cache_index=True, cache_dir=cache)
        assert again.index.source(0) == base + "cdn/items/0.bin"
        assert first_bytes(again) == [0, 1, 2, 3]
    # the store out of reach: the cached index and meta file open all the same
    down = Dataset(base + "train.csv", cache_index=True, cache_dir=cache, retries=0)
    assert down.index.source(0) == base + "cdn/items/0.bin"
    (www / "train-meta.csv").unlink()
    with running(www) as (base2, _hits):
        (www / "other.csv").write_text((www / "train.csv").read_text())
        Dataset(base2 + "other.csv", cache_index=True, cache_dir=cache)  # (absent: marked)
    # down again: a remembered absence still opens the cached index
    down = Dataset(base2 + "other.csv", cache_index=True, cache_dir=cache, retries=0)
    assert down.index.source(0) == base2 + "items/0.bin"
