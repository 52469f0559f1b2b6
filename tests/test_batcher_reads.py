"""Local and fsspec range reads through the batcher: a short read drops the item, and only
a remote store's short read is retried (it may be a transient fault; a local file's is not)."""

from __future__ import annotations

import fsspec
import pytest

from distlearn.dataset import Dataset
from distlearn.dataset.processors import Raw

ROWS = "filename,offset,length\nshard.bin,0,5\nshard.bin,5,5\nshard.bin,8,5\n"


@pytest.mark.parametrize("where", ["local", "memory"])
def test_short_range_read_drops_the_item(tmp_path, where):
    if where == "local":
        (tmp_path / "shard.bin").write_bytes(bytes(range(10)))
        (tmp_path / "index.csv").write_text(ROWS)
        index = str(tmp_path / "index.csv")
    else:
        fs = fsspec.filesystem("memory")
        root = f"/reads-{tmp_path.name}"
        fs.pipe({f"{root}/shard.bin": bytes(range(10)), f"{root}/index.csv": ROWS.encode()})
        index = f"memory://{root}/index.csv"
    ds = Dataset(index)
    with ds.sampled_batcher(batch_size=3, input_dims=(5,), processor=Raw(), workers="thread",
                            retries=2, backoff=0.001) as b:  # fmt: skip
        batch = b.next_batch()
        stats = dict(b.stats)
    assert batch.input.tolist() == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
    assert stats["failed"] == 1 and stats["fetched"] == 2
    assert stats["retried"] == (2 if where == "memory" else 0)
