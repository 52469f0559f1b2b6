"""One registry of index kinds, typed option groups, part sources' own contract, no import cycle."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from distlearn.dataset import Dataset, open_index, register_index_kind
from distlearn.dataset.index import kinds
from distlearn.dataset.index.tensors import from_tensors
from distlearn.dataset.options import FetchOptions, Options, split

DATASET = Path(__file__).resolve().parent.parent / "dataset"


def test_kinds_are_asked_in_order_and_csv_is_the_catch_all():
    assert kinds.kinds() == ["index", "tensor", "list", "parts", "directory", "pt", "csv"]


def test_a_registered_kind_opens_through_dataset_and_batches():
    register_index_kind(
        "squares",
        lambda index, opening: isinstance(index, str) and index.startswith("squares:"),
        lambda index, opening: from_tensors(
            torch.arange(int(index.split(":")[1]), dtype=torch.float32) ** 2, index
        ),
    )
    try:
        ds = Dataset("squares:6", partition=1, partitions=2)
        b = ds.sampled_batcher(batch_size=4, input_dims=())
        assert sorted(b.next_batch().input.tolist()) == [1.0, 9.0, 25.0]
        b.close()
        with pytest.raises(ValueError, match="already registered"):
            register_index_kind("squares", lambda i, o: False, lambda i, o: None)
    finally:
        kinds._KINDS[:] = [k for k in kinds._KINDS if k.name != "squares"]


def test_option_values_are_checked_when_the_dataset_is_built(tmp_path):
    missing = tmp_path / "nope.csv"  # never read: the options fail first
    for bad, match in [
        (dict(retries=-1), "retries must be >= 0"),
        (dict(redirects="some"), "redirects must be one of"),
        (dict(workers="fibers"), "workers must be 'thread' or 'process'"),
        (dict(prefetch=0), "pass it to sampled_batcher"),
        (dict(on_error="ignore"), "on_error must be"),
        (dict(resident_parts=1), "resident_parts must be >= 2"),
        (dict(max_cache_bytes=0), "max_cache_bytes must be > 0"),
        (dict(sep=",,"), "sep must be one character"),
        (dict(sampler_opt=3), "sampler_opt must be a dict"),
    ]:
        with pytest.raises((ValueError, TypeError), match=match):
            Dataset(missing, **bad)


def test_sampled_batchers_own_arguments_are_checked_where_given():
    """They failed at the first batch, with numpy's or torch's message ("expected
    non-negative integer"), or not at all (seed=1.5 was truncated)."""
    ds = Dataset({"x": torch.zeros(4, 2)})
    for bad, match in [
        (dict(seed=-1), "seed must be an int >= 0, got -1"),
        (dict(seed=1.5), "seed must be an int >= 0, got 1.5"),
        (dict(seed="a"), "seed must be an int >= 0"),
        (dict(batch_size=2.5), "batch_size must be an int >= 1, got 2.5"),
        (dict(batch_size=0), "batch_size must be an int >= 1, got 0"),
        (dict(input_dims=(0,)), r"input_dims \(0,\): each size must be an int >= 1"),
        (dict(input_dims=(2, -1)), r"input_dims \(2, -1\): each size"),
    ]:
        with pytest.raises(ValueError, match=match):
            ds.sampled_batcher(**{"input_dims": (2,), **bad})
    ds.sampled_batcher(batch_size=np.int64(2), seed=np.int64(3), input_dims=(2,),
                       workers="thread").close()  # fmt: skip


def test_flat_keywords_reach_their_group_and_batchers_override_them():
    o = split("Dataset()", dict(headers={"X-Token": "t"}, max_backoff=0.5, num_workers=3))
    assert o.fetch == FetchOptions(headers={"X-Token": "t"}, max_backoff=0.5)
    assert o.workers.num_workers == 3 and o.parts.given() == {}
    over = o.update("sampled_batcher()", dict(max_backoff=1.0), ("fetch", "workers"))
    assert over.fetch.max_backoff == 1.0 and over.fetch.headers == {"X-Token": "t"}
    assert o.fetch.max_backoff == 0.5  # the Dataset's defaults stay
    assert isinstance(Options().fetch, FetchOptions)


def test_headers_and_backoff_reach_every_fetcher():
    # (headers with a local index go to the origins named: credential_origins)
    ds = Dataset({"x": torch.zeros(4, 2)}, headers={"X-Token": "t"}, max_backoff=0.25,
                 credential_origins=["https://data.example.com"])  # fmt: skip
    b = ds.sampled_batcher(batch_size=2, input_dims=(2,), workers="thread")
    fetcher = b.engine.workers.fetcher
    assert fetcher.headers == {"X-Token": "t"} and fetcher.max_backoff == 0.25
    assert fetcher.scope.credentials == {"https://data.example.com:443"}
    b.close()


def test_part_samplers_exist_without_the_parts_module():
    code = (
        "import sys\n"
        "from distlearn.dataset.sampling.samplers import get_sampler\n"
        "get_sampler('part-linear'); get_sampler('part-permutation-permutation')\n"
        "assert 'distlearn.dataset.index.parts' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_a_part_source_keeps_its_own_contract(tmp_path):
    (tmp_path / "p").mkdir()
    for i in range(2):
        (tmp_path / "p" / f"part-{i}.txt.gz").write_bytes(__import__("gzip").compress(b"a\nb\n"))
    index = open_index(tmp_path / "p", cache_parts=False, record_format="lines")
    for attr in ("sources", "source", "by_label", "item_labels"):
        assert not hasattr(index, attr), attr  # not an Index: nothing addresses records by position
    assert len(index.partition(1, 2)) == 2 and index.multi_hot is False
    with pytest.raises(TypeError, match="cannot be addressed by position"):
        Dataset(tmp_path / "p", cache_parts=False).sampled_batcher(sampler="uniform")
