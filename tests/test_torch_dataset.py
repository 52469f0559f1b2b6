"""torch-dataset conformance, on torch-dataset's own fixtures (tests/torch_dataset/).

Ports the expectations of its test/test_Index.lua and test/test_Sampler.lua
(and the index-files.csv case of test/test_Dataset.lua). torch-dataset counts
from 1 (partition p of P, item i); we count from 0, so its partition p is our
partition p - 1 and its item i our example i - 1. Where we differ on purpose,
the test says so.
"""

from __future__ import annotations

import itertools
import logging
import os
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from distlearn.dataset import Dataset, IndexNotFound, open_index
from distlearn.dataset.formats import read_part
from distlearn.dataset.index.parts import PartIndex
from distlearn.dataset.sampling.samplers import PART_SAMPLERS as SAMPLERS
from distlearn.dataset.sampling.samplers import epoch_rng, get_sampler

FIX = Path(__file__).parent / "torch_dataset"
PARTS = FIX / "hdfs" / "files"
PART_SIZES = {"part-r-00000": 21, "part-r-00001": 24, "part-r-00002": 17, "part-r-00003": 16}


def fixture(name: str) -> str:
    return str(FIX / name)


def short(index, p: int) -> str:
    """An example's filename as the index names it (torch-dataset's itemAt without prefix)."""
    return os.path.relpath(index.name(p), FIX)


def examples_of(index, label: str | None) -> list[int]:
    if label is None:
        return np.nonzero(index.targets == -1)[0].tolist()
    return index.by_label()[index.labels.index(label)].tolist()


def verify(index, items: list[str], label: str | None, name=short) -> None:
    """test_Index.lua's verify: the label has these items, in sorted order, each standing for it."""
    got = examples_of(index, label)
    assert len(got) == len(items), f"label {label} must have {len(items)}, saw {len(got)}"
    assert [name(index, p) for p in got] == sorted(items)
    want = -1 if label is None else index.labels.index(label)
    assert [index.target(p) for p in got] == [want] * len(got)


def out_of_range(index, *positions: int) -> None:
    for p in positions:
        with pytest.raises(IndexError):
            index.source(p)


# ----------------------------------------------------------------------------- test_Index.lua


def test_load():
    """index.csv: 20 ragged rows, 25 examples (an item with k labels is k examples)."""
    index = open_index(fixture("index.csv"))
    assert index.labels == ["A", "B", "C"]  # labelIndex A=1, B=2, C=3 (from 0 here)
    assert len(index) == 25
    verify(index, ["1", "2", "3", "5", "6", "9", "10", "11", "12", "13", "14", "16", "18",
                   "19", "20"], "A")  # fmt: skip
    verify(index, ["3", "4", "7", "8", "9", "13", "14", "15", "17"], "B")
    verify(index, ["9"], "C")
    out_of_range(index, -13, -1, 25)  # Lua: itemAt(-13), itemAt(0), itemAt(26)
    assert len(get_sampler("linear")(index, 0, None, label="B")) == 9  # itemAt(10, 'B') fails


def test_load_partition():
    """IndexCSV(index.csv, 1, 5): the k-th example of a label (from 1) goes to partition k % 5."""
    index = Dataset(fixture("index.csv"), partition=0, partitions=5).index
    assert index.labels == ["A", "B", "C"]
    assert len(index) == 4
    verify(index, ["13", "2", "9"], "A")
    verify(index, ["3"], "B")
    verify(index, [], "C")
    out_of_range(index, -13, -1, 4)  # Lua: itemAt(-13), itemAt(0), itemAt(7)


def test_all_partitions():
    whole = open_index(fixture("index.csv"))
    union: Counter = Counter()
    for p in range(3):
        part = Dataset(fixture("index.csv"), partition=p, partitions=3).index
        union.update((part.name(i), part.target(i)) for i in range(len(part)))
    assert sum(union.values()) == len(whole) == 25
    assert union == Counter((whole.name(i), whole.target(i)) for i in range(len(whole)))


def test_load_no_labels():
    index = open_index(fixture("nolabels.csv"))
    assert index.labels == []
    assert len(index) == 8
    verify(index, ["1", "2", "3", "4", "5", "6", "7", "8"], None)
    out_of_range(index, -13, -1, 8)


def test_load_meta():
    """index2-meta.csv: one column (`prefix`) whose second line is the URL prefix."""
    index = open_index(fixture("index2.csv"))
    assert len(index.labels) == 2 and len(index) == 2
    assert index.source(0) == "http://prefix.com/go/here/1"


def test_url_params():
    params = {"a": 1, "b": 2, "c": "three", "d": True}
    index = open_index(fixture("index2.csv"), url_params=params)
    assert len(index.labels) == 2 and len(index) == 2
    assert index.source(0) == "http://prefix.com/go/here/1?a=1&b=2&c=three&d=true"


def test_directory():
    p = FIX / "files" / "local"
    index = open_index(str(p))
    assert index.labels == ["cats", "dogs"]
    assert len(index) == 5  # two cats, a dog, two unlabeled files at the top

    def absolute(ix, i):
        return ix.name(i)

    verify(index, [str(p / "cats" / "cat1.txt"), str(p / "cats" / "cat2.txt")], "cats", absolute)
    verify(index, [str(p / "dogs" / "dog1.txt")], "dogs", absolute)
    verify(index, [str(p / "unlabeled1.txt"), str(p / "unlabeled2.txt")], None, absolute)


def test_slowfs_initial_load():
    """Four part files. torch-dataset's itemCount() said 4 (the files) before reading any;
    we estimate the records instead, from the first part and the part sizes."""
    ds = Dataset(str(PARTS))
    assert isinstance(ds.index, PartIndex) and len(ds.index.parts) == 4
    assert abs(len(ds) - 78) <= 78 * 0.1, len(ds)


def test_slowfs_access_all():
    index = Dataset(str(PARTS)).index
    for n in range(4):
        index.load_part(n)
    assert index.exact and len(index) == 78


def test_slowfs_all_partitions():
    total = 0
    for p in range(2):
        index = Dataset(str(PARTS), partition=p, partitions=2).index
        for n in range(len(index.parts)):
            index.load_part(n)
        total += len(index)
    assert total == 78


def test_slowfs_part_index_count():
    index = Dataset(str(PARTS)).index
    for n, part in enumerate(index.parts):
        assert len(index.load_part(n)) == PART_SIZES[Path(part).name]


def test_slowfs_part_index_items():
    """Newline-delimited records: (offset, length) of the first two are (0, 175), (176, 105)."""
    data = (PARTS / "part-r-00000").read_bytes()
    records = list(read_part(data, "part-r-00000"))
    assert [(off, len(rec)) for off, rec in records[:2]] == [(0, 175), (176, 105)]
    assert len(records) == 21


def test_tensor():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(100, 3, 3, generator=g)
    index = open_index(x)
    assert len(index) == 100
    assert all(torch.equal(index.source(i), x[i]) for i in range(100))
    y = torch.where(torch.randn(100, generator=g) < 0, 1, 2)
    x = torch.randn(100, 2, 2, generator=g)
    index = open_index({"x": x, "y": y})
    assert len(index) == 100 and index.labels == ["1", "2"]
    by = index.by_label()
    assert len(by[0]) + len(by[1]) == 100
    for k, label in enumerate((1, 2)):  # items of a label in row order, returning that label
        rows = (y == label).nonzero().view(-1).tolist()
        assert [index.row(p) for p in by[k]] == rows
        assert all(torch.equal(index.source(p), x[r]) for p, r in zip(by[k], rows, strict=True))
        assert {index.target(p) for p in by[k]} == {k}


def test_tensor_partition():
    """IndexTensor(x, 2, 10): tensors partition by row, row j to partition j % partitions."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(100, 3, 3, generator=g)
    index = Dataset(x, partition=1, partitions=10).index
    assert len(index) == 10
    assert all(torch.equal(index.source(i), x[i * 10 + 1]) for i in range(10))
    y = torch.where(torch.randn(100, generator=g) < 0, 1, 2)
    index = Dataset({"x": torch.randn(100, 2, 2, generator=g), "y": y}, 0, 7).index
    assert len(index) == 15 and len(index.labels) == 2
    assert sum(len(m) for m in index.by_label()) == 15


@pytest.mark.parametrize("labelled", [False, True])
def test_tensor_partition_and_shuffle(labelled):
    """IndexTensor(..., {shuffle = true, perm = p}): we take the permuted tensor itself."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(100, 3, 3, generator=g)
    y = torch.randint(1, 11, (100,), generator=g)
    perm = torch.randperm(100, generator=g)
    data = {"x": x[perm], "y": y[perm]} if labelled else x[perm]
    whole = Dataset(data).index
    halves = [Dataset(data, partition=p, partitions=2).index for p in range(2)]
    assert (len(whole), len(halves[0]), len(halves[1])) == (100, 50, 50)
    for i in range(50):
        for p in range(2):
            assert torch.equal(whole.source(2 * i + p), halves[p].source(i))
            assert whole.item_labels(2 * i + p) == halves[p].item_labels(i)


def test_batched_tensor_partition_and_shuffle_with_labels():
    """Batch i of the whole is the union of batch i of each of P partitions (B/P items each)."""
    n, parts, size = 8192, 8, 1024
    g = torch.Generator().manual_seed(1)
    perm = torch.randperm(n, generator=g)
    data = {"x": torch.randn(n, 3, 3, generator=g)[perm],
            "y": torch.randint(1, 11, (n,), generator=g)[perm]}  # fmt: skip

    def means(partition, partitions, batch):
        ds = Dataset(data, partition=partition, partitions=partitions)
        with ds.sampled_batcher(batch_size=batch, input_dims=(3, 3)) as b:
            return [x.input.double().mean(0) for x in b]

    whole = means(0, 1, size)
    split = [means(p, parts, size // parts) for p in range(parts)]
    for i, expected in enumerate(whole):
        got = sum(split[p][i] for p in range(parts)) / parts
        assert torch.allclose(got, expected, atol=1e-10), i


# ----------------------------------------------------------------------------- test_Sampler.lua


def draw(name: str, index, epoch: int = 0, **opt) -> list[int]:
    return [int(p) for p in get_sampler(name)(index, epoch, epoch_rng(0, 0, epoch), **opt)]


def label_of(index, p: int) -> str:
    return index.labels[index.target(p)]


def test_permutation_sampler():
    index = open_index(fixture("index.csv"))
    per_label = {lab: len(m) for lab, m in zip(index.labels, index.by_label(), strict=True)}
    prev = None
    for epoch in range(3):
        seen = draw("permutation", index, epoch)
        assert len(seen) == 25  # going past the end ends the epoch
        assert Counter(label_of(index, p) for p in seen) == per_label
        names = [index.name(p) for p in seen]
        if prev is not None:
            assert names != prev, "the lists must have different orders"
            assert sorted(names) == sorted(prev)
        prev = names


def test_label_permutation_sampler():
    """135 draws hold 45 of each label; every 3 consecutive draws one of each, in an order
    different from the 3 before."""
    index = open_index(fixture("index.csv"))
    full = 135
    seen = draw("label-permutation", index, num_samples=3 * full)
    labels = [label_of(index, p) for p in seen]
    triples = [labels[i : i + 3] for i in range(0, len(labels), 3)]
    for before, now in itertools.pairwise(triples):
        assert sorted(now) == ["A", "B", "C"]
        assert now != before, "the lists must have different orders"
    loops = [seen[i : i + full] for i in range(0, len(seen), full)]
    for before, now in itertools.pairwise(loops):
        assert now != before
        assert sorted(index.name(p) for p in now) == sorted(index.name(p) for p in before)
    for loop in loops:
        assert Counter(label_of(index, p) for p in loop) == {"A": 45, "B": 45, "C": 45}


def test_label_permutation_sampler_across_epochs():
    """test_Sampler.lua's own shape: its sampler never ends, ours has epochs. 3 x 135 draws
    over epoch after epoch of index.csv (25 examples, 3 labels): every run of 3 draws holds
    each label once and differs from the run before, across every epoch boundary (an
    epoch is a whole number of cycles: 27 draws), and each 135 holds 45 of each label."""
    index = open_index(fixture("index.csv"))
    for seed in range(20):
        seen, epoch = [], 0
        while len(seen) < 3 * 135:
            order = get_sampler("label-permutation")(index, epoch, epoch_rng(seed, 0, epoch))
            assert len(order) == 27
            seen += [int(p) for p in order]
            epoch += 1
        labels = [label_of(index, p) for p in seen[: 3 * 135]]
        triples = [labels[i : i + 3] for i in range(0, len(labels), 3)]
        for before, now in itertools.pairwise(triples):
            assert sorted(now) == ["A", "B", "C"] and now != before, seed
        for loop in range(3):
            got = Counter(labels[loop * 135 : (loop + 1) * 135])
            assert got == {"A": 45, "B": 45, "C": 45}


def test_label_permutation_cycles_hold_through_a_resume():
    """A batcher stopped mid-epoch and resumed from its state goes on with the same draws:
    the cycles stay whole through the stop and the epoch boundaries after it."""
    kw = dict(batch_size=4, input_dims=(1,), sampler="label-permutation", seed=7)
    # index.csv's shape (8, 9 and 8 examples of 3 labels) as tensor rows: nothing to fetch
    data = {"x": torch.arange(25.0)[:, None], "y": torch.tensor([0] * 8 + [1] * 9 + [2] * 8)}

    def rows(batches):
        return [
            (int(x), int(y)) for b in batches for x, y in zip(b.input[:, 0], b.target, strict=True)
        ]

    with Dataset(data).sampled_batcher(**kw) as b:
        whole = rows(b.next_batch() for _ in range(40))
    with Dataset(data).sampled_batcher(**kw) as b:
        first = rows(b.next_batch() for _ in range(9))
        state = b.state_dict()
    with Dataset(data).sampled_batcher(**kw) as b:
        b.load_state_dict(state)
        rest = rows(b.next_batch() for _ in range(31))
    assert first + rest == whole
    targets = [y for _, y in whole]
    for i in range(0, len(targets) - 2, 3):
        assert sorted(targets[i : i + 3]) == [0, 1, 2]


def test_permutation_sampler_with_label():
    index = open_index(fixture("index.csv"))
    prev = None
    for epoch in range(3):
        seen = draw("permutation", index, epoch, label="B")
        assert len(seen) == 9 and {label_of(index, p) for p in seen} == {"B"}
        names = [index.name(p) for p in seen]
        assert len(set(names)) == 9, "should not see any dupes"
        if prev is not None:
            assert names != prev and sorted(names) == sorted(prev)
        prev = names


def test_linear_sampler():
    index = open_index(fixture("index.csv"))
    members = examples_of(index, "B")
    for epoch in range(3):
        seen = draw("linear", index, epoch, label="B")
        assert seen == members, "must sample in index order"
        assert {label_of(index, p) for p in seen} == {"B"}


def test_label_uniform_sampler():
    index = open_index(fixture("index.csv"))
    n = 300_000
    hist = Counter(label_of(index, p) for p in draw("label-uniform", index, num_samples=n))
    for label in "ABC":
        assert abs(3 * hist[label] / n - 1) < 0.1, hist


def test_uniform_sampler():
    index = open_index(fixture("index3.csv"))
    n = 100_000  # 5000 per item: 10% is 7 standard deviations
    hist = Counter(short(index, p) for p in draw("uniform", index, num_samples=n))
    assert len(hist) == 20
    assert max(abs(c / (n / 20) - 1) for c in hist.values()) < 0.1


def part_epochs(sampler: str, epochs: int) -> list[list[bytes]]:
    index = Dataset(str(PARTS)).index
    return [[r.source for r in SAMPLERS[sampler](index, e, epoch_rng(0, 0, e))]
            for e in range(epochs)]  # fmt: skip


def test_part_linear_sampler_slowfs():
    epochs = part_epochs("part-linear", 4)
    assert all(len(e) == 78 for e in epochs)
    assert all(e == epochs[0] for e in epochs), "the lists must have the same order"
    lines = [line for n in sorted(PART_SIZES) for line in (PARTS / n).read_bytes().splitlines()]
    assert epochs[0] == lines


@pytest.mark.parametrize("sampler", ["part-linear-permutation", "part-permutation-permutation"])
def test_part_permutation_samplers_slowfs(sampler):
    epochs = part_epochs(sampler, 3)
    for before, now in itertools.pairwise(epochs):
        assert len(now) == len(before) == 78
        assert sorted(now) == sorted(before)
        assert now != before


def test_part_files_through_a_batcher():
    """The same part files end to end: every record once per epoch, counted in stats."""
    ds = Dataset(str(PARTS), partition=1, partitions=2)  # parts 1 and 3: 24 + 16 records

    def length(data, opt, out):
        out.fill_(len(data))
        return True

    with ds.sampled_batcher(batch_size=10, input_dims=(1,), processor=length,
                            workers="thread") as b:  # fmt: skip
        assert b.num_batches() == 4  # estimated before the first epoch from part sizes
        sizes = [int(v) for batch in b for v in batch.input.view(-1).tolist()]
        stats = b.stats
    assert len(sizes) == 40 and len(ds) == 40
    assert stats["fetched"] == 40 and stats["bytes"] == sum(sizes)
    assert stats["parts"] >= 2 and stats["failed_parts"] == 0


@pytest.mark.parametrize(
    "sampler", ["uniform", "label-uniform", "permutation", "label-permutation",
                "label-distribution"],
)  # fmt: skip
def test_unsupported_samplers_slowfs(sampler):
    """Position samplers cannot draw part-file records. (torch-dataset refused `linear` too;
    ours is the default sampler and means part-linear for part files.)"""
    ds = Dataset(str(PARTS))
    with pytest.raises(TypeError, match="cannot be addressed by position"):
        ds.sampled_batcher(sampler=sampler, workers="thread")


# ----------------------------------------------------------------------------- test_Dataset.lua


def test_multi_file_dataset():
    """index-files.csv: records at offsets in shared files, walked label by label, then by
    filename and offset; the batches roll over epochs of 6 examples."""
    expected = [("A", "AB"), ("A", "EF"), ("A", "ST"), ("B", "LMN"), ("B", "QRS"), ("C", "IJKL")]

    def text(data, opt, out):
        out.zero_()
        out[: len(data)] = torch.tensor(list(data), dtype=torch.float32)
        return True

    ds = Dataset(fixture("index-files.csv"))
    got = []
    with ds.sampled_batcher(batch_size=4, input_dims=(4,), sampler="linear", processor=text,
                            workers="thread") as b:  # fmt: skip
        for _ in range(5):
            batch = b.next_batch()
            for row, target, labels in zip(batch.input, batch.target, batch.labels, strict=True):
                word = bytes(int(v) for v in row.tolist() if v).decode()
                got.append((ds.index.labels[int(target)], word))
                assert labels == (ds.index.labels[int(target)],)
    assert got == (expected * 3)[: len(got)] and len(got) == 16  # 4 + 2 per epoch


def test_multi_label_items_are_one_example_per_label(tmp_path):
    """index.csv through a real batcher: item 9 (labels A, B, C) is handed out three times
    per epoch, once as each label, and label C is a target (it never was before)."""
    shutil.copy(fixture("index.csv"), tmp_path / "index.csv")
    for i in range(1, 21):
        (tmp_path / str(i)).write_text(str(i))

    def number(data, opt, out):
        out.fill_(int(data))
        return True

    ds = Dataset(str(tmp_path / "index.csv"))
    seen: Counter = Counter()
    with ds.sampled_batcher(batch_size=8, input_dims=(1,), sampler="permutation",
                            processor=number, workers="thread") as b:  # fmt: skip
        for batch in b:
            for value, target in zip(batch.input.view(-1).tolist(), batch.target.tolist(),
                                     strict=True):  # fmt: skip
                seen[(int(value), ds.index.labels[target])] += 1
    assert seen[(9, "A")] == seen[(9, "B")] == seen[(9, "C")] == 1
    assert sum(seen.values()) == 25 and {lab for _, lab in seen} == {"A", "B", "C"}
    # multi_hot: one example per item, its labels as a multi-hot target
    ds = Dataset(str(tmp_path / "index.csv"), multi_hot=True)
    assert len(ds) == 20
    with ds.sampled_batcher(batch_size=20, input_dims=(1,), processor=number,
                            workers="thread") as b:  # fmt: skip
        batch = b.next_batch()
    rows = {int(v): t.tolist() for v, t in zip(batch.input.view(-1).tolist(), batch.target,
                                               strict=True)}  # fmt: skip
    assert rows[9] == [1.0, 1.0, 1.0] and rows[3] == [1.0, 1.0, 0.0] and rows[4] == [0, 1, 0]


# ----------------------------------------------------------------------------- README


README_INDEX = """filename,label1,label2
aa367ddd157f42baf2949f9416ca0311.jpg,XX
07c67f7c341975cdc6a014f09be801a0.jpg,XX,XY
0fff04dfb4a67540bff880fd7f143534.jpg,AA
57c892b5743874b40b1ab1c7b126ab0b.jpg,XX
d5e11c10c3e1edabae9e1713471b866f.jpg,AA,BB
"""


def test_readme_example_ragged_index_and_hostname_meta(tmp_path, serve_dir):
    """torch-dataset's README: a ragged index.csv and an index-meta.csv with a `hostname`
    column naming the CDN folder. The images are on a real HTTP server."""
    from PIL import Image as PILImage

    from distlearn.dataset.processors import Image

    cdn = tmp_path / "cdn" / "some" / "directory" / "128"
    cdn.mkdir(parents=True)
    names = [line.split(",")[0] for line in README_INDEX.splitlines()[1:]]
    for i, name in enumerate(names):
        PILImage.new("RGB", (4, 4), (i * 40, 0, 0)).save(cdn / name, format="JPEG", quality=100)
    base = serve_dir(tmp_path / "cdn")
    (tmp_path / "index.csv").write_text(README_INDEX)
    (tmp_path / "index-meta.csv").write_text(f"hostname\n{base}some/directory/128\n")

    ds = Dataset(str(tmp_path / "index.csv"))
    assert ds.index.labels == ["AA", "BB", "XX", "XY"]
    assert len(ds) == 7  # 1 + 2 + 1 + 1 + 2 examples
    assert all(s.startswith(f"{base}some/directory/128/") for s in ds.index.sources)
    with ds.sampled_batcher(batch_size=7, input_dims=(3, 4, 4), processor=Image(),
                            workers="thread") as b:  # fmt: skip
        batch = b.next_batch()
    assert len(batch) == 7 and b.stats["failed"] == 0
    pairs = sorted((url.rsplit("/", 1)[1], ds.index.labels[t])
                   for url, t in zip(batch.urls, batch.target.tolist(), strict=True))  # fmt: skip
    assert pairs == sorted([(names[0], "XX"), (names[1], "XX"), (names[1], "XY"),
                            (names[2], "AA"), (names[3], "XX"), (names[4], "AA"),
                            (names[4], "BB")])  # fmt: skip


def test_unknown_columns_warn_and_meta_formats(tmp_path, caplog):
    (tmp_path / "i.csv").write_text("filename,label,weight\na.png,x,0.5\nb.png\n")
    caplog.set_level(logging.WARNING, logger="distlearn.dataset")
    index = open_index(str(tmp_path / "i.csv"))
    assert "unknown column 'weight'" in caplog.text and len(index) == 2
    (tmp_path / "i-meta.csv").write_text("url_prefix,url_params\nhttp://h/p,sig=1\n")
    assert open_index(str(tmp_path / "i.csv")).source(0) == "http://h/p/a.png?sig=1"
    (tmp_path / "i-meta.csv").write_text("a,b\nhttp://h/p,x\n")
    with pytest.raises(ValueError, match=r"i-meta\.csv: cannot tell the URL prefix"):
        open_index(str(tmp_path / "i.csv"))
    with pytest.raises(IndexNotFound, match=r"nope\.csv"):
        open_index(str(tmp_path / "nope.csv"))
