"""Joined indexes: aligned members, members drawn by their own sampler, partitions, resume."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from distlearn.dataset import BadIndex, Dataset, Record, open_index
from distlearn.dataset.index.joined import JoinedIndex
from distlearn.dataset.sampling.samplers import epoch_rng

CHI2_999_2DOF = 13.82  # chi-square critical value at p = 0.001, 2 degrees of freedom


def numbers(fetched, opt, out) -> bool:
    """Each joined item holds one integer per index: write them side by side."""
    for col, data in enumerate(fetched):
        out[col] = int(data)
    return True


def write_index(root, name: str, values, labels=None):
    """`name`.csv listing files that each hold one of `values` (optionally labelled)."""
    root.mkdir(parents=True, exist_ok=True)
    rows = ["filename,label" if labels else "filename"]
    for n, v in enumerate(values):
        (root / f"{name}-{v}.txt").write_text(str(v))
        rows.append(f"{name}-{v}.txt,{labels[n]}" if labels else f"{name}-{v}.txt")
    (root / f"{name}.csv").write_text("\n".join(rows) + "\n")
    return str(root / f"{name}.csv")


@pytest.fixture
def files(tmp_path):
    """images: 40 items 0..39 labelled a/b/c/d; backgrounds: 3 items 100..102; masks: 40 aligned."""
    labels = ["abcd"[i % 4] for i in range(40)]
    return {
        "images": write_index(tmp_path, "images", range(40), labels),
        "backgrounds": write_index(tmp_path, "backgrounds", range(100, 103)),
        "masks": write_index(tmp_path, "masks", range(200, 240)),
        "root": tmp_path,
    }


# the images' linear order: by label (i % 4), then by filename ("images-12.txt" < "images-4.txt")
LINEAR = sorted(range(40), key=lambda i: (i % 4, f"images-{i}.txt"))


def pairs(batcher, epochs=1) -> list[tuple[int, ...]]:
    out = []
    for _ in range(epochs):
        for batch in batcher:
            out += [tuple(int(v) for v in row) for row in batch.input.tolist()]
    return out


def test_drawn_member_driver_once_per_epoch_uniform_draws(files):
    ds = Dataset([files["images"], files["backgrounds"]])
    assert isinstance(ds.index, JoinedIndex) and len(ds.index) == 40
    with ds.sampled_batcher(batch_size=8, input_dims=(2,), sampler=["linear", "uniform"],
                            processor=numbers, workers="thread") as b:  # fmt: skip
        assert len(b) == 5, "the first index drives the count"
        first = next(iter(b))
        assert first.labels == [("a",)] * 8  # linear: label by label, then by filename
        assert first.target.tolist() == [0] * 8
        for url, (img, bg) in zip(first.urls, first.input.tolist(), strict=True):
            left, right = url.split(" + ")
            assert left.endswith(f"/images-{img:.0f}.txt") and right.endswith(f"-{bg:.0f}.txt")
        draws = Counter()
        for _ in range(25):
            got = pairs(b)
            assert [d for d, _ in got] == LINEAR, "every driver item once, in order"
            draws.update(bg for _, bg in got)
    assert set(draws) == {100, 101, 102}
    expected = 25 * 40 / 3
    chi2 = sum((draws[v] - expected) ** 2 / expected for v in (100, 101, 102))
    assert chi2 < CHI2_999_2DOF, draws


def test_seeds_partitions_and_epochs_draw_differently(files):
    def run(seed=0, partition=0, partitions=1, epochs=1):
        ds = Dataset([files["images"], files["backgrounds"]], partition, partitions)
        with ds.sampled_batcher(batch_size=10, input_dims=(2,), sampler=["permutation", "uniform"],
                                processor=numbers, workers="thread", seed=seed) as b:  # fmt: skip
            return [pairs(b) for _ in range(epochs)]

    e0, e1 = run(epochs=2)
    assert run()[0] == e0, "same seed, same pairs"
    assert [bg for _, bg in run(seed=1)[0]] != [bg for _, bg in e0]
    assert [bg for _, bg in e1] != [bg for _, bg in e0], "a new epoch draws anew"
    p0, p1 = run(partition=0, partitions=2)[0], run(partition=1, partitions=2)[0]
    assert sorted(d for d, _ in p0 + p1) == list(range(40))
    assert [bg for _, bg in p0] != [bg for _, bg in p1], "each rank has its own draws"


def test_epoch_rng_stream_zero_is_the_epoch_generator():
    plain = np.random.Generator(np.random.PCG64(np.random.SeedSequence([7, 2, 5])))
    assert epoch_rng(7, 2, 5).integers(0, 2**62, 8).tolist() == plain.integers(0, 2**62, 8).tolist()
    assert epoch_rng(7, 2, 5, stream=1).integers(0, 2**62, 8).tolist() != (
        epoch_rng(7, 2, 5).integers(0, 2**62, 8).tolist()
    )


@pytest.mark.timeout(120)
def test_resume_mid_epoch_over_http_process_workers(files, serve_dir):
    base = serve_dir(files["root"])
    index = [base + "images.csv", base + "backgrounds.csv"]
    kw = dict(batch_size=4, input_dims=(2,), sampler=["permutation", "uniform"],
              processor=numbers, workers="process", num_workers=1, seed=3)  # fmt: skip
    with Dataset(index).sampled_batcher(**kw) as b:
        whole = pairs(b, epochs=2)
    with Dataset(index).sampled_batcher(**kw) as b:
        seen = [tuple(int(v) for v in row) for row in b.next_batch().input.tolist()]
        seen += [tuple(int(v) for v in row) for row in b.next_batch().input.tolist()]
        state = b.state_dict()
    assert seen == whole[:8]
    with Dataset(index).sampled_batcher(**kw) as b:
        b.load_state_dict(state)
        rest = pairs(b, epochs=2)
    assert rest == whole[8:], "the rest of the epoch, then the same next epoch"


def test_aligned_and_drawn_in_one_join_partitioned(files, tmp_path):
    # backgrounds labelled so that label-distribution options can be routed to them
    bgs = write_index(tmp_path / "bg", "bg", range(300, 306), ["x", "y", "x", "y", "x", "y"])
    index = [files["images"], bgs, files["masks"]]
    seen, drawn = [], Counter()
    for rank in range(4):
        ds = Dataset(index, partition=rank, partitions=4)
        assert [len(m) for m in ds.index.members] == [40, 6, 40], "members stay whole"
        with ds.sampled_batcher(batch_size=4, input_dims=(3,), processor=numbers,
                                sampler=["permutation", "label-distribution", None],
                                sampler_opt=[None, {"weights": {"x": 1}}, None],
                                workers="thread") as b:  # fmt: skip
            assert len(b) == -(-len(ds.index) // 4)  # 12, 12, 8, 8 items
            for img, bg, mask in pairs(b, epochs=3):
                assert mask == img + 200, "aligned member follows the driver's item"
                seen.append(img)
                drawn[bg] += 1
    assert sorted(seen) == sorted(list(range(40)) * 3), "union of partitions = the first index"
    assert set(drawn) == {300, 302, 304}, "only label x, from the whole index on every rank"


def test_drawn_streams_wrap_restart_and_report_empty_draws(files):
    ds = Dataset([files["images"], files["backgrounds"]])

    def nothing(index, epoch, rng):
        return []

    empty = r"backgrounds\.csv: sampler 'nothing' drew no item"
    with (ds.sampled_batcher(batch_size=8, input_dims=(2,), sampler=["linear", nothing],
                             processor=numbers, workers="thread") as b,
          pytest.raises(ValueError, match=empty)):  # fmt: skip
        b.next_batch()

    # linear wraps around the drawn index (the Lua loop-back), and restarts each epoch
    with ds.sampled_batcher(batch_size=8, input_dims=(2,), sampler=["linear", "linear"],
                            processor=numbers, workers="thread") as b:  # fmt: skip
        for _ in range(2):
            assert [bg for _, bg in pairs(b)] == [100 + i % 3 for i in range(40)]


def test_bad_joins_raise_clear_errors(files):
    ds = Dataset([files["images"], files["backgrounds"]])
    with pytest.raises(BadIndex, match=r"images\.csv has 40 items, .*backgrounds\.csv has 3"):
        ds.sampled_batcher(processor=numbers, workers="thread")
    with pytest.raises(BadIndex, match="uniform"):
        ds.sampled_batcher(sampler=["linear", None], workers="thread")
    with pytest.raises(ValueError, match="3 entries for 2 joined indexes"):
        ds.sampled_batcher(sampler=["linear", "uniform", "uniform"], workers="thread")
    with pytest.raises(ValueError, match="drives the epoch"):
        ds.sampled_batcher(sampler=[None, "uniform"], workers="thread")
    with pytest.raises(ValueError, match="single index"):
        Dataset(files["images"]).sampled_batcher(sampler=["linear", "uniform"], workers="thread")
    with pytest.raises(ValueError, match="unknown sampler 'nope'"):
        ds.sampled_batcher(sampler=["linear", "nope"], workers="thread")


def test_joined_index_partition_keeps_members_whole(files):
    whole = open_index([files["images"], files["backgrounds"], files["masks"]])
    part = whole.partition(1, 2)
    assert isinstance(part, JoinedIndex) and len(part) == 20
    assert part.members == whole.members
    assert part.targets.tolist() == whole.targets[part.positions].tolist()
    # source/name join the members that line up with the first (not the 3-item one)
    assert part.source(0) == (whole.members[0].source(int(part.positions[0])),
                              whole.members[2].source(int(part.positions[0])))  # fmt: skip
    assert part.name(0).count(" + ") == 1


def test_failed_drawn_fetch_drops_the_item(files):
    (files["root"] / "backgrounds-102.txt").unlink()  # every third linear draw fails
    ds = Dataset([files["images"], files["backgrounds"]])
    with ds.sampled_batcher(batch_size=10, input_dims=(2,), sampler=["linear", "linear"],
                            processor=numbers, workers="thread") as b:  # fmt: skip
        got = pairs(b)
        stats = dict(b.stats)
    assert got == [(i, 100 + k % 3) for k, i in enumerate(LINEAR) if k % 3 != 2]
    assert stats["failed"] == 13


def test_driver_yielding_records(files):
    def in_memory(index, epoch, rng):
        """A driver that hands over its payloads itself (as part-file readers do)."""
        return [Record(str(500 + i).encode(), (i % 2,), f"mem-{i}") for i in range(6)]

    ds = Dataset([files["images"], files["backgrounds"], files["masks"]])
    with ds.sampled_batcher(batch_size=6, input_dims=(3,), processor=numbers,
                            sampler=[in_memory, "uniform", "permutation"],
                            workers="thread") as b:  # fmt: skip
        batch = b.next_batch()
    assert [row[0] for row in batch.input.tolist()] == [500, 501, 502, 503, 504, 505]
    assert all(100 <= bg <= 102 and 200 <= m < 240 for _, bg, m in batch.input.tolist())
    assert batch.target.tolist() == [0, 1, 0, 1, 0, 1]
    assert batch.urls[0].startswith("mem-0 + ")
    aligned = ds.sampled_batcher(
        batch_size=6, input_dims=(3,), processor=numbers,
        sampler=[in_memory, "uniform", None], workers="thread",
    )  # fmt: skip
    with aligned, pytest.raises(ValueError, match="no position"):
        aligned.next_batch()


def test_sampler_opt_dict_is_the_drivers(files):
    ds = Dataset([files["images"], files["backgrounds"]])
    with ds.sampled_batcher(batch_size=40, input_dims=(2,), processor=numbers, workers="thread",
                            sampler=("label-distribution", "uniform"),
                            sampler_opt={"weights": {"c": 1}}) as b:  # fmt: skip
        got = pairs(b)
    assert len(got) == 40 and {img % 4 for img, _ in got} == {2}, "only label c drives"
    with pytest.raises(ValueError, match="sampler_opt has 1 entries for 2 samplers"):
        ds.sampled_batcher(sampler=["linear", "uniform"], sampler_opt=[{}], workers="thread")
    with pytest.raises(ValueError, match="which is aligned"):
        Dataset([files["images"], files["masks"]]).sampled_batcher(
            sampler=["linear", None], sampler_opt=[None, {"weights": {}}], workers="thread"
        )
