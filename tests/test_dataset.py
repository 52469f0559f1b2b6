"""End-to-end: Dataset over a real HTTP server, thread and process workers."""

from __future__ import annotations

import pickle
from collections import Counter

import pytest
import torch

from distlearn.dataset import Dataset
from distlearn.dataset.processors import Image
from tests.faulty_server import item_ids, make_pngs, running

N = 300
LINEAR = sorted(range(N), key=lambda i: (i % 3, i))  # by label, then filename


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """One HTTP server over N generated PNGs for the whole module."""
    root = tmp_path_factory.mktemp("pngs") / "root"
    make_pngs(root, N, labels=3)
    with running(root) as (url, _):
        yield url


def _epoch_ids(batcher) -> list[int]:
    return [i for batch in batcher for i in item_ids(batch.input)]


@pytest.mark.parametrize("workers", ["thread", "process"])
def test_core_path_over_http(base, workers):
    parts = 3
    seen: Counter = Counter()
    for rank in range(parts):
        ds = Dataset(base + "train.csv", partition=rank, partitions=parts)
        assert ds.index.labels == ["c0", "c1", "c2"]
        with ds.sampled_batcher(
            batch_size=16,
            input_dims=(1, 8, 8),
            sampler="permutation",
            processor=Image(mode="L"),
            seed=5,
            workers=workers,
            num_workers=2,
        ) as batcher:
            assert len(batcher) == -(-len(ds.index) // 16)
            n_batches = 0
            for batch in batcher:
                n_batches += 1
                assert batch.input.dtype == torch.float32
                assert batch.input.shape[1:] == (1, 8, 8)
                assert batch.input.min() >= 0.0 and batch.input.max() <= 1.0
                ids = item_ids(batch.input)
                # the target and url of each row belong to the item decoded in that row
                for i, t, url, labs in zip(
                    ids, batch.target.tolist(), batch.urls, batch.labels, strict=True
                ):
                    assert t == i % 3
                    assert url == f"{base}c{i % 3}/{i:05d}.png"
                    assert labs == (f"c{i % 3}",)
                seen.update(ids)
            assert n_batches == len(batcher)
            assert batcher.stats["fetched"] == len(ds.index)
            assert batcher.stats["failed"] == 0
    assert seen == Counter(range(N)), "every item exactly once across all partitions"


def test_permutation_epochs_differ_and_linear_is_ordered(base):
    ds = Dataset(base + "train.csv")
    with ds.sampled_batcher(
        batch_size=32, input_dims=(1, 8, 8), sampler="permutation", processor=Image(), seed=1,
        workers="thread",
    ) as b:  # fmt: skip
        e0, e1 = _epoch_ids(b), _epoch_ids(b)
    assert sorted(e0) == sorted(e1) == list(range(N))
    assert e0 != e1, "a new epoch of permutation is a new permutation"
    with ds.sampled_batcher(batch_size=50, input_dims=(1, 8, 8), sampler="linear",
                            processor=Image(), workers="process") as b:  # fmt: skip
        assert _epoch_ids(b) == LINEAR


def test_batches_handed_out_are_never_overwritten(base):
    ds = Dataset(base + "train.csv")
    with ds.sampled_batcher(batch_size=10, input_dims=(1, 8, 8), processor=Image(),
                            prefetch=1, workers="process", num_workers=1) as b:  # fmt: skip
        kept = list(b)  # the ring has 2 slots; 30 batches went through them
    assert [i for batch in kept for i in item_ids(batch.input)] == LINEAR


def test_same_seed_same_order_thread_vs_process(base):
    orders = []
    for workers in ("thread", "process"):
        ds = Dataset(base + "train.csv", partition=1, partitions=2)
        with ds.sampled_batcher(batch_size=8, input_dims=(1, 8, 8), sampler="permutation",
                                processor=Image(), seed=9, workers=workers) as b:  # fmt: skip
            orders.append(_epoch_ids(b))
    assert orders[0] == orders[1]


def test_spawn_context(base):
    ds = Dataset(base + "train.csv", partition=0, partitions=4)
    with ds.sampled_batcher(batch_size=32, input_dims=(1, 8, 8), processor=Image(),
                            workers="process", num_workers=1, mp_context="spawn") as b:  # fmt: skip
        ids = _epoch_ids(b)
    assert sorted(ids) == sorted(range(0, N, 1))[: len(ids)] or len(ids) == len(ds.index)
    assert len(ids) == len(ds.index)


def test_unpicklable_processor_is_a_clear_error(base):
    ds = Dataset(base + "train.csv")
    with pytest.raises(TypeError, match="picklable processor"):
        ds.sampled_batcher(input_dims=(1, 8, 8), processor=lambda d, o, out: True,
                           workers="process")  # fmt: skip
    # threads take any callable
    with ds.sampled_batcher(input_dims=(1, 8, 8), processor=lambda d, o, out: out.fill_(1),
                            workers="thread") as b:  # fmt: skip
        assert b.next_batch().input.eq(1).all()


def test_image_processor_pickles():
    img = Image(mode="L", size=(4, 4), mean=0.5, std=0.25)
    assert repr(pickle.loads(pickle.dumps(img))) == repr(img)
