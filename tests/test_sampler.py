"""Samplers: permutations, seeding, label distributions (chi-square), plugins, resume."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from distlearn import dataset
from distlearn.dataset import Dataset, Record, open_index
from distlearn.dataset.sampling.samplers import epoch_rng, get_sampler

# chi-square critical values at p = 0.001 for the degrees of freedom used below
CHI2_999 = {2: 13.82, 3: 16.27, 4: 18.47}


def labelled(n: int, weights=(0.7, 0.2, 0.1)):
    """A tensor index of n rows whose labels are very unbalanced; row i holds i."""
    rng = np.random.default_rng(0)
    y = rng.choice(len(weights), size=n, p=weights)
    return open_index({"x": torch.arange(n, dtype=torch.float32), "y": torch.as_tensor(y)})


def draw(name, index, epoch=0, seed=0, partition=0, **opt):
    return np.asarray(
        list(get_sampler(name)(index, epoch, epoch_rng(seed, partition, epoch), **opt))
    )


def chi2(observed, expected) -> float:
    observed, expected = np.asarray(observed, float), np.asarray(expected, float)
    return float(((observed - expected) ** 2 / expected).sum())


def test_linear_and_permutation():
    ix = labelled(500)
    assert draw("linear", ix).tolist() == list(range(500))
    p0, p1 = draw("permutation", ix, epoch=0), draw("permutation", ix, epoch=1)
    assert sorted(p0.tolist()) == sorted(p1.tolist()) == list(range(500))
    assert p0.tolist() != p1.tolist()
    assert draw("permutation", ix, epoch=0).tolist() == p0.tolist(), "same seed, same order"
    assert draw("permutation", ix, seed=1).tolist() != p0.tolist()
    assert draw("permutation", ix, partition=1).tolist() != p0.tolist()


def test_uniform_is_uniform_over_items():
    ix = labelled(4)
    counts = Counter()
    for e in range(2000):
        counts.update(draw("uniform", ix, epoch=e).tolist())
    assert chi2([counts[i] for i in range(4)], [2000] * 4) < CHI2_999[3]


@pytest.mark.parametrize("name", ["label-uniform", "label-permutation"])
def test_label_samplers_are_uniform_over_labels(name):
    ix = labelled(3000)
    labels = ix.targets[draw(name, ix)]
    assert chi2(np.bincount(labels, minlength=3), [1000] * 3) < CHI2_999[2]


def test_label_permutation_walks_each_label_without_repeats():
    ix = labelled(3000)
    order = draw("label-permutation", ix)
    rare = [p for p in order.tolist() if ix.targets[p] == 2]  # ~300 members, ~1000 draws
    members = int((ix.targets == 2).sum())
    first = rare[:members]
    assert len(set(first)) == members, "no repeat before every item of the label was drawn"


def test_label_distribution_follows_weights():
    ix = labelled(6000)
    w = {"0": 1.0, "1": 2.0}
    labels = ix.targets[draw("label-distribution", ix, weights=w, default_weight=3.0)]
    counts = np.bincount(labels, minlength=3)
    assert chi2(counts, np.array([1, 2, 3]) / 6 * 6000) < CHI2_999[2]
    with pytest.raises(ValueError, match="unknown labels"):
        draw("label-distribution", ix, weights={"nope": 1})
    with pytest.raises(ValueError, match="needs sampler_opt"):
        draw("label-distribution", ix)
    for bad in (float("nan"), float("inf")):  # numpy's "probabilities contain NaN" before
        with pytest.raises(ValueError, match="weights must be finite"):
            draw("label-distribution", ix, weights={"0": bad, "1": 1.0})


def test_sampler_options_are_checked_where_given():
    """A misspelt sampler_opt key failed at the first batch with Python's TypeError
    ("got an unexpected keyword argument"), naming no valid option; then with a
    ValueError where every other misspelt keyword was a TypeError. Now a TypeError
    naming the closest, when the batcher is made."""
    from distlearn.dataset import Dataset

    ds = Dataset({"x": torch.zeros(6, 1), "y": torch.tensor([0, 1, 0, 1, 0, 1])})
    with pytest.raises(TypeError, match=r"unknown option 'weight'; did you mean 'weights'\?"):
        ds.sampled_batcher(input_dims=(1,), sampler="label-distribution",
                           sampler_opt={"weight": {"0": 1.0}})  # fmt: skip
    with pytest.raises(TypeError, match=r"'part-linear' got an unknown option 'x'; valid: none"):
        ds.sampled_batcher(input_dims=(1,), sampler="part-linear", sampler_opt={"x": 1})
    b = ds.sampled_batcher(input_dims=(1,), sampler="uniform", sampler_opt={"label": "1"},
                           workers="thread")  # fmt: skip
    b.close()


def test_uniform_over_a_label_with_no_example_says_so():
    ix = labelled(10)
    empty = ix.partition(1, 20)  # 10 items over 20 partitions: partition 1 has none of "2"
    with pytest.raises(ValueError, match="uniform has nothing to draw from"):
        draw("uniform", empty, label="2")


def test_register_sampler_and_unknown_name():
    def evens(index, epoch, rng, start=0):
        return np.arange(start, len(index), 2)

    dataset.register_sampler("test-evens", evens)
    ds = Dataset({"x": torch.arange(10.0).view(10, 1)})
    with ds.sampled_batcher(batch_size=3, input_dims=(1,), sampler="test-evens",
                            sampler_opt={"start": 1}) as b:  # fmt: skip
        assert len(b) == 2
        assert [x for batch in b for x in batch.input.view(-1).tolist()] == [1, 3, 5, 7, 9]
    with pytest.raises(ValueError, match=r"unknown sampler 'nope'.*permutation"):
        ds.sampled_batcher(sampler="nope")


def test_stream_of_records_with_unknown_length():
    """The part-file seam: a sampler yields records whose payload is already in memory."""

    def records(index, epoch, rng):
        for i in range(7):
            yield Record(torch.full((2,), float(i + epoch * 10)), labels=(i % 2,), name=f"r{i}")

    ds = Dataset({"x": torch.zeros(4, 2), "y": torch.tensor([0, 1, 0, 1])})
    with ds.sampled_batcher(batch_size=3, input_dims=(2,), sampler=records) as b:
        with pytest.raises(TypeError, match=r"unknown length.*num_batches"):
            len(b)
        assert b.num_batches() == 2  # estimated from len(index)
        batches = list(b)
        assert [len(x) for x in batches] == [3, 3, 1]
        assert batches[0].input[:, 0].tolist() == [0, 1, 2]
        assert batches[0].urls == ["r0", "r1", "r2"]
        assert batches[0].target.tolist() == [0, 1, 0]
        assert next(iter(b)).input[0, 0] == 10.0  # next epoch


@pytest.mark.parametrize("workers", ["thread", "process"])
def test_state_dict_resume_sees_exactly_the_unseen_items(tmp_path, workers):
    from tests.faulty_server import item_ids, make_pngs

    idx = make_pngs(tmp_path, 100, labels=2)
    from distlearn.dataset.processors import Image

    def batcher():
        return Dataset(str(idx)).sampled_batcher(
            batch_size=8, input_dims=(1, 8, 8), sampler="permutation", seed=3,
            processor=Image(), workers=workers, num_workers=1, prefetch=3,
        )  # fmt: skip

    with batcher() as b:
        full = [[i for x in b for i in item_ids(x.input)] for _ in range(2)]
    with batcher() as b:
        list(b)  # epoch 0
        it = iter(b)
        head = [i for _ in range(5) for i in item_ids(next(it).input)]
        state = b.state_dict()
    assert state["epoch"] == 1 and state["consumed"] == 40
    with batcher() as b2:
        b2.load_state_dict(state)
        tail = [i for x in b2 for i in item_ids(x.input)]
        after = [i for x in b2 for i in item_ids(x.input)]
    assert head + tail == full[1]
    assert sorted(after) == list(range(100)) and after != full[1]  # epoch 2 follows


def test_a_state_saved_for_another_order_is_refused(tmp_path):
    """A state resumes the order it was saved in: another sampler, seed or partition,
    or an index that gained or lost items, would skip `consumed` items of another
    order (silently: the old check looked at the seed and the partition only); a state
    that does not say where it was is refused by name."""
    x = torch.arange(40.0).view(20, 2)

    def batcher(n=20, sampler="permutation", seed=3):
        return Dataset({"x": x[:n], "y": torch.zeros(n, dtype=torch.long)}).sampled_batcher(
            batch_size=4, input_dims=(2,), sampler=sampler, seed=seed)  # fmt: skip

    with batcher() as b:
        next(iter(b))
        state = b.state_dict()
    assert state["items"] == 20
    for kw, key in [({"sampler": "linear"}, "sampler"), ({"n": 19}, "items"),
                    ({"seed": 4}, "seed")]:  # fmt: skip
        with batcher(**kw) as b, pytest.raises(ValueError, match=f"saved with {key}="):
            b.load_state_dict(state)
    for bad in [{**state, "consumed": -4}, {**state, "epoch": "1"}, {"seed": 3}]:
        with batcher() as b, pytest.raises(ValueError, match=r"state_dict\['(epoch|consumed)'\]"):
            b.load_state_dict(bad)
    with batcher() as b:
        b.load_state_dict({**state, "consumed": np.int64(4)})  # (a number numpy made)
        assert next(iter(b)).input.shape == (4, 2)
