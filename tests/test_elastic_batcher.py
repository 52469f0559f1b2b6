"""Batchers resumed at another world size: every example of the interrupted epoch exactly
once, summed over the old job's handed-out batches and the new job's rest, for tensor,
CSV, joined and part-file indexes, with thread and process workers; the same world size
bit for bit; refusals by name."""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest
import torch

from distlearn.dataset import Dataset, item_rng

N = 103  # examples: not a multiple of anything below


def tensor_data(n: int = N, labels: int = 4) -> dict:
    return {"x": torch.arange(n, dtype=torch.float32).view(n, 1), "y": torch.arange(n) % labels}


def batchers(data, world: int, **kw):
    opts = dict(batch_size=5, input_dims=(1,), workers="thread", num_workers=0) | kw
    return [Dataset(data, partition=p, partitions=world).sampled_batcher(**opts)
            for p in range(world)]  # fmt: skip


def ids(batch) -> list[int]:
    return [int(v) for v in batch.input[:, 0].tolist()]


def run_old_job(data, world: int, steps: list[int], **kw) -> tuple[list[dict], list[tuple]]:
    """`world` ranks; rank r takes steps[r] batches (rolling into the next epoch); returns
    their states and the (epoch, id) of every example they handed out."""
    seen, states = [], []
    for b, k in zip(batchers(data, world, **kw), steps, strict=True):
        with b:
            for _ in range(k):
                batch = b.next_batch()
                seen += [(b.epoch, i) for i in ids(batch)]
            states.append(b.state_dict())
    return states, seen


def run_new_job(data, world: int, states: list[dict], **kw) -> tuple[list[tuple], list]:
    """`world` ranks load the old states (shuffled); each hands out its rest (one `for`
    loop), then one ordinary epoch; returns (epoch, id) of the rest and the next epoch's
    ids per rank."""
    rest, nxt = [], []
    shuffled = list(states)
    random.Random(world).shuffle(shuffled)
    for b in batchers(data, world, **kw):
        with b:
            b.load_state_dict(shuffled)
            for batch in b:
                rest += [(b.epoch, i) for i in ids(batch)]
            nxt.append(sorted(i for batch in b for i in ids(batch)))
    return rest, nxt


def assert_exactly_once(seen: list[tuple], epochs: range, n: int = N) -> None:
    for e in epochs:
        got = Counter(i for ep, i in seen if ep == e)
        dup = sorted(i for i, c in got.items() if c > 1)
        missing = sorted(set(range(n)) - set(got))
        assert not dup and not missing, f"epoch {e}: repeated {dup}, missing {missing}"


@pytest.mark.parametrize("sampler", ["linear", "permutation"])
@pytest.mark.parametrize(("old", "new"), [(4, 3), (3, 5), (4, 1), (1, 4), (5, 2)])
def test_the_interrupted_epoch_holds_every_example_once(sampler, old, new):
    rnd = random.Random(old * 10 + new)
    per_rank = -(-N // old) // 5  # batches in a rank's epoch, about
    steps = [rnd.randint(0, per_rank) for _ in range(old)]
    states, seen = run_old_job(tensor_data(), old, steps, sampler=sampler, seed=3)
    rest, nxt = run_new_job(tensor_data(), new, states, sampler=sampler, seed=3)
    assert_exactly_once(seen + rest, range(1))
    # the next epoch is an ordinary epoch of the new partitioning
    assert sorted(i for rank in nxt for i in rank) == list(range(N))
    for q, got in enumerate(nxt):
        want = Dataset(tensor_data(), partition=q, partitions=new).index
        assert len(got) == len(want)


def test_ranks_an_epoch_apart_finish_both_epochs():
    """Rank 0 rolled into epoch 1 (next_batch), rank 1 is still in epoch 0."""
    states, seen = run_old_job(tensor_data(), 2, [13, 4], sampler="permutation")
    assert [s["epoch"] for s in states] == [1, 0]
    rest, _ = run_new_job(tensor_data(), 3, states, sampler="permutation")
    # (the rest's batches mix both epochs: each example twice over the two)
    assert Counter(i for _, i in seen + rest) == Counter(2 * list(range(N)))


@pytest.mark.parametrize("sampler", ["uniform", "label-uniform", "label-distribution"])
def test_samplers_with_replacement_keep_their_draws(sampler):
    """The rest is exactly the old job's undrawn draws: the interrupted epoch's draws (ids
    with their counts) are those of the uninterrupted job, len(index) in all."""
    weights = {"weights": {"0": 1, "1": 2, "2": 3, "3": 4}}
    kw = dict(sampler=sampler, seed=5, **({"sampler_opt": weights} if "dist" in sampler else {}))
    full = []
    for b in batchers(tensor_data(), 4, **kw):
        with b:
            full += [i for batch in b for i in ids(batch)]
    states, seen = run_old_job(tensor_data(), 4, [2, 0, 5, 3], **kw)
    rest, _ = run_new_job(tensor_data(), 3, states, **kw)
    assert len(seen) + len(rest) == N
    assert Counter(i for _, i in seen + rest) == Counter(full)


def test_label_permutation_keeps_its_draws_and_each_labels_count():
    """label-permutation draws len(index) examples in balanced label cycles (with
    repeats): the interrupted epoch's draws are the uninterrupted job's, so every label
    is drawn as often as it would have been."""
    kw = dict(sampler="label-permutation", seed=2)
    full = Counter()
    for b in batchers(tensor_data(), 3, **kw):
        with b:
            full += Counter(i for batch in b for i in ids(batch))
    states, seen = run_old_job(tensor_data(), 3, [3, 1, 2], **kw)
    rest, _ = run_new_job(tensor_data(), 2, states, **kw)
    assert Counter(i for _, i in seen + rest) == full


def test_chain_four_three_five_one():
    kw = dict(sampler="permutation", seed=11)
    data = tensor_data(1000)
    seen: list[tuple] = []
    states, got = run_old_job(data, 4, [9, 20, 3, 14], **kw)
    seen += got
    for world, steps in [(3, [7, 0, 11]), (5, [2, 9, 4, 0, 6])]:
        new_states = []
        for b, k in zip(batchers(data, world, **kw), steps, strict=True):
            with b:
                b.load_state_dict(states)
                it = iter(b)
                for _ in range(k):
                    seen += [(b.epoch, i) for i in ids(next(it))]
                new_states.append(b.state_dict())
        states = new_states
    rest, nxt = run_new_job(data, 1, states, **kw)
    assert_exactly_once(seen + rest, range(1), n=1000)
    assert nxt[0] == list(range(1000))


@pytest.mark.parametrize(("workers", "num_workers"), [("thread", 0), ("thread", 3),
                                                       ("process", 1), ("process", 3)])  # fmt: skip
def test_workers_do_not_change_what_was_consumed(tmp_path, workers, num_workers):
    """CSV index over files, prefetching workers: what was in flight at the save comes back."""
    from distlearn.dataset.processors import Image
    from tests.faulty_server import item_ids, make_pngs

    idx = make_pngs(tmp_path, 60, labels=3)
    kw = dict(batch_size=4, input_dims=(1, 8, 8), sampler="permutation", seed=3,
              processor=Image(), workers=workers, num_workers=num_workers, prefetch=3)  # fmt: skip

    def batchers_(world):
        return [Dataset(str(idx), partition=p, partitions=world).sampled_batcher(**kw)
                for p in range(world)]  # fmt: skip

    seen, states = [], []
    for b, k in zip(batchers_(3), [2, 4, 1], strict=True):
        with b:
            it = iter(b)
            for _ in range(k):
                seen += item_ids(next(it).input)
            states.append(b.state_dict())
    for b in batchers_(2):
        with b:
            b.load_state_dict(states)
            seen += [i for batch in b for i in item_ids(batch.input)]
    assert sorted(seen) == list(range(60))


def test_the_same_world_size_resumes_bit_for_bit():
    kw = dict(sampler="permutation", seed=4)
    whole = []
    for b in batchers(tensor_data(), 3, **kw):
        with b:
            whole.append([ids(x) for _ in range(2) for x in b])  # two epochs
    states = []
    for b, k in zip(batchers(tensor_data(), 3, **kw), [2, 5, 3], strict=True):
        with b:
            it = iter(b)
            for _ in range(k):
                next(it)
            states.append(b.state_dict())
    for q, b in enumerate(batchers(tensor_data(), 3, **kw)):
        with b:
            b.load_state_dict(states if q % 2 else states[q])  # the list, or its own
            got = [ids(x) for _ in range(2) for x in b]
        k = [2, 5, 3][q]
        assert got == whole[q][k:], q


def test_per_item_generators_are_the_old_jobs():
    """item_rng() in a processor draws, for an example of the rest, what the old job would
    have drawn for it: its key is its place in the order it comes from."""

    def noisy(x, opt, out):
        out[0] = x[0]
        out[1] = float(item_rng().random())
        return True

    kw = dict(input_dims=(2,), processor=noisy, sampler="permutation", seed=9)
    want = {}
    for b in batchers(tensor_data(), 4, **kw):
        with b:
            want |= {int(r[0]): float(r[1]) for batch in b for r in batch.input.tolist()}
    states, _ = run_old_job(tensor_data(), 4, [1, 2, 0, 3], **kw)
    got = {}
    for b in batchers(tensor_data(), 3, **kw):
        with b:
            b.load_state_dict(states)
            got |= {int(r[0]): float(r[1]) for batch in b for r in batch.input.tolist()}
    assert got and all(got[i] == want[i] for i in got)


def test_drop_last_hands_out_what_the_old_job_would_have():
    kw = dict(sampler="permutation", seed=1, drop_last=True)
    kept = set()
    for b in batchers(tensor_data(), 4, **kw):
        with b:
            kept |= {i for batch in b for i in ids(batch)}
    states, seen = run_old_job(tensor_data(), 4, [1, 3, 0, 2], **kw)
    rest, _ = run_new_job(tensor_data(), 3, states, **kw)
    got = [i for _, i in seen + rest]
    assert sorted(got) == sorted(kept) and len(got) == len(kept)


def test_a_joined_index_with_a_drawn_member(tmp_path):
    rows = "".join(f"a{i}.png,x\n" for i in range(41))
    (tmp_path / "a.csv").write_text("filename,label\n" + rows)
    (tmp_path / "b.csv").write_text("filename\n" + "".join(f"b{i}.png\n" for i in range(5)))
    index = [str(tmp_path / "a.csv"), str(tmp_path / "b.csv")]
    kw = dict(batch_size=4, sampler=["permutation", "uniform"], seed=6)

    def pairs_of(world, load=None, steps=None):
        out, states = [], []
        for p in range(world):
            ds = Dataset(index, partition=p, partitions=world)
            from distlearn.dataset.sampling.stream import ItemStream

            s = ItemStream(ds.index, sampler=kw["sampler"], batch_size=4, seed=6,
                           partition=p, partitions=world, whole=ds.whole)  # fmt: skip
            if load is not None:
                s.resume(s.resume_position(load))
            else:
                s.start(0)
            for k, work in enumerate(s):
                if steps is not None and k == steps[p]:
                    break
                out += [tuple(x.rsplit("/", 1)[1] for x in src) for src in work.sources]
                s.consumed()
            states.append(s.state_dict())
        return out, states

    full, _ = pairs_of(3)
    head, states = pairs_of(3, steps=[1, 3, 2])
    rest, _ = pairs_of(2, load=states)
    assert sorted(head + rest) == sorted(full)  # every driven item once, with its old draw


def write_tar_parts(root, parts: int, per: list[int]) -> list[str]:
    import webdataset as wds

    keys = []
    for p in range(parts):
        with wds.TarWriter(str(root / f"part-{p:03d}.tar")) as sink:
            for i in range(per[p]):
                key = f"p{p}i{i:03d}"
                sink.write({"__key__": key, "txt": key, "cls": str(p % 3)})
                keys.append(key)
    return keys


def test_part_files_a_half_read_part_is_finished_once(tmp_path):
    from distlearn.dataset.index.parts import open_parts
    from distlearn.dataset.sampling.stream import ItemStream

    keys = write_tar_parts(tmp_path, 7, [5, 9, 3, 8, 6, 2, 7])
    whole = open_parts(tmp_path, cache_parts=False)

    def stream(p, world):
        sampler = "part-permutation-permutation"
        return ItemStream(whole.partition(p, world), sampler=sampler, batch_size=3, seed=2,
                          partition=p, partitions=world, whole=whole)  # fmt: skip

    seen, states = [], []
    for p, k in enumerate([2, 0, 1]):  # 3 ranks; rank 0 stops inside its second part
        s = stream(p, 3)
        s.start(0)
        for _ in range(k):
            seen += [r["__key__"] for r in next(s).sources]
            s.consumed()
        states.append(s.state_dict())
    assert any(st["record"] for st in states)  # a part half read
    for q in range(2):
        s = stream(q, 2)
        s.resume(s.resume_position(states))
        for work in s:
            seen += [r["__key__"] for r in work.sources]
            s.consumed()
    assert sorted(seen) == sorted(keys)


def test_part_files_resume_reads_only_the_part_it_is_in(tmp_path):
    """A position inside part k of an epoch resumes by reading part k alone."""
    write_tar_parts(tmp_path, 6, [4] * 6)
    kw = dict(batch_size=3, input_dims=(), sampler="part-permutation-permutation", seed=1,
              processor=lambda d, o, out: True, workers="thread")  # fmt: skip
    with Dataset(str(tmp_path), cache_parts=False).sampled_batcher(**kw) as b:
        full = [x.urls for x in b]
    with Dataset(str(tmp_path), cache_parts=False).sampled_batcher(**kw) as b:
        it = iter(b)
        head = [next(it).urls for _ in range(5)]  # 15 records: 3 parts and 3 of the 4th
        state = b.state_dict()
    assert (state["part"], state["record"]) == (3, 3)
    with Dataset(str(tmp_path), cache_parts=False).sampled_batcher(**kw) as b:
        b.load_state_dict(state)
        tail = [x.urls for x in b]
        assert b.stats["parts"] <= 3  # part 3, and the ones after it (not the 3 before)
    assert head + tail == full


def test_refusals_name_what_differs():
    states, _ = run_old_job(tensor_data(), 2, [1, 2], sampler="permutation", seed=3)
    (b,) = batchers(tensor_data(), 1, sampler="permutation", seed=4)
    with b, pytest.raises(ValueError, match=r"state_dict\[0\] \(partition 0 of 2\) was saved "
                                            r"with seed=3, this batcher has seed=4"):  # fmt: skip
        b.load_state_dict(states)
    (b,) = batchers(tensor_data(N + 1), 1, sampler="permutation", seed=3)
    with b, pytest.raises(ValueError, match="saved with items=103, this batcher has items=104"):
        b.load_state_dict(states)
    (b,) = batchers(tensor_data(), 1, sampler="permutation", seed=3)
    with b, pytest.raises(ValueError, match="partition 1 is missing"):
        b.load_state_dict(states[:1])
    with b, pytest.raises(ValueError, match="pass the list of every old rank's state"):
        b.load_state_dict(states[1])
    assert np.all(True)


@pytest.mark.parametrize("when", ["in the last batch's step", "after the loop"])
def test_a_take_over_with_nothing_to_take_ends_the_epoch_under_way(when):
    """A survivor whose share of a dead rank's rest is empty, at the end of its epoch
    (distlearn.survivors): the loop under way ends, and the next loop is the next epoch
    of the new partitioning, once. (It used to run on into that epoch, so the job took
    an epoch too many; taken over after its loop, the next loop skipped an epoch.)"""
    from distlearn.dataset.sampling.elastic import Position

    (b,) = batchers(tensor_data(), 1)
    with b:
        seen = []
        for batch in b:
            seen += ids(batch)
            if when == "in the last batch's step" and len(seen) == N:
                b.take_over(Position(2, 1, 1))
        if when == "after the loop":
            b.take_over(Position(2, 1, 1))
        assert sorted(seen) == list(range(N))  # epoch 0, and nothing of epoch 1
        state = b.state_dict()
        assert (state["epoch"], state["consumed"], state["rest"]) == (1, 0, [])
        assert (state["partition"], state["partitions"]) == (1, 2)
        nxt = [i for batch in b for i in ids(batch)]
        assert b.epoch == 1
    first, other = batchers(tensor_data(), 2)
    first.close()
    with other:
        other.load_state_dict(state)
        assert sorted(nxt) == sorted(i for batch in other for i in ids(batch))
