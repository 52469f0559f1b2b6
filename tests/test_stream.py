"""The item stream alone: no worker, no ring, no tensor; epochs, resume and joins as plain data."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch

from distlearn.dataset import Record, open_index
from distlearn.dataset.fetch.sources import Joined
from distlearn.dataset.sampling.stream import ItemStream


def tensor_index(n: int, labels: int = 3):
    return open_index({"x": torch.arange(n, dtype=torch.float32), "y": torch.arange(n) % labels})


def epoch(stream: ItemStream, e: int, skip: int = 0) -> list:
    stream.start(e, skip)
    out = []
    for work in stream:
        out.append(work)
        stream.consumed(len(work))
    return out


def values(works) -> list[float]:
    return [float(s) for w in works for s in w.sources]


def test_batches_of_an_epoch_in_sampler_order():
    s = ItemStream(tensor_index(10), batch_size=4)
    works = epoch(s, 0)
    assert [len(w) for w in works] == [4, 4, 2]
    assert [w.first for w in works] == [0, 4, 8] and {w.epoch for w in works} == {0}
    assert values(works) == [float(i) for i in range(10)]
    assert [t for w in works for t in w.targets] == [i % 3 for i in range(10)]
    assert len(s) == 3
    s2 = ItemStream(tensor_index(10), batch_size=4, drop_last=True)
    assert [len(w) for w in epoch(s2, 0)] == [4, 4] and len(s2) == 2


def test_epochs_reshuffle_and_are_reproducible():
    a = ItemStream(tensor_index(50), sampler="permutation", batch_size=8, seed=3)
    b = ItemStream(tensor_index(50), sampler="permutation", batch_size=8, seed=3)
    e0, e1 = values(epoch(a, 0)), values(epoch(a, 1))
    assert e0 != e1 and sorted(e0) == sorted(e1) == [float(i) for i in range(50)]
    assert values(epoch(b, 1)) == e1  # epoch 1 alone, without epoch 0 before it


def test_resume_from_a_state_dict_sees_exactly_the_rest():
    s = ItemStream(tensor_index(30), sampler="permutation", batch_size=7, seed=1)
    whole = values(epoch(s, 2))
    s.start(2)
    seen = []
    for _ in range(2):
        work = next(s)
        seen += values([work])
        s.consumed(len(work))
    next(s)  # dispatched, never handed out: not counted
    state = s.state_dict()
    assert state["epoch"] == 2 and state["consumed"] == 14
    again = ItemStream(tensor_index(30), sampler="permutation", batch_size=7, seed=1)
    rest = values(epoch(again, *again.check_state(state)))
    assert seen + rest == whole
    with pytest.raises(ValueError, match="seed=9"):
        ItemStream(tensor_index(30), seed=9).check_state(state)


def test_a_state_saved_at_the_end_of_an_epoch_resumes_into_the_next():
    """It said (epoch e, every item consumed): a job resumed from it ran an empty epoch
    e before the next, one epoch short of the job that was not stopped."""
    s = ItemStream(tensor_index(30), sampler="permutation", batch_size=7, seed=1)
    s.start(2)
    for work in s:
        s.consumed(len(work))
    last = s.state_dict()
    assert last == {**last, "epoch": 3, "consumed": 0}
    again = ItemStream(tensor_index(30), sampler="permutation", batch_size=7, seed=1)
    assert values(epoch(again, *again.check_state(last))) == values(epoch(s, 3))
    s.start(4)
    work = next(s)
    assert s.state_dict()["epoch"] == 4  # dispatched, not handed out: epoch 4 stands
    s.stop()
    assert s.state_dict()["epoch"] == 4  # an epoch stopped early is not over


@pytest.mark.parametrize("n", [1_000_000, pytest.param(10_000_000, marks=pytest.mark.slow)])
def test_millions_of_items_stay_numpy_and_the_state_stays_small(n):
    index = open_index({"x": torch.empty(n, 0), "y": torch.arange(n) % 1000})
    for sampler in ("permutation", "label-permutation"):
        s = ItemStream(index, sampler=sampler, batch_size=256, seed=0)
        assert isinstance(s.items(0), np.ndarray) and len(s) == -(-n // 256)
        s.start(0)
        t0 = time.process_time()
        for _ in range(3):
            s.consumed(len(next(s)))
        assert time.process_time() - t0 < 5  # three batches, not a pass over every item
        state = s.state_dict()
        # integers whatever the epoch's size (the format: dataset.sampling.elastic)
        assert len(json.dumps(state)) < 300 and state["consumed"] == 3 * 256
        # resuming slices the epoch's array: the next batch is item 768 of the same order
        order = s.items(0)
        s.start(*s.check_state(state))
        assert next(s).targets == [int(i) % 1000 for i in order[768:1024]]


def test_records_and_streams_of_unknown_length():
    def records(index, epoch, rng):
        for i in range(5):
            yield Record(f"payload-{i}".encode(), (i % 2,), f"rec{i}")

    s = ItemStream(tensor_index(4), sampler=records, batch_size=2)
    works = epoch(s, 0)
    assert [w.names for w in works] == [["rec0", "rec1"], ["rec2", "rec3"], ["rec4"]]
    assert [w.targets for w in works] == [[0, 1], [0, 1], [0]]
    with pytest.raises(TypeError, match="unknown length"):
        len(s)


def test_drawn_members_join_each_item_and_redraw_the_same_on_resume(tmp_path):
    (tmp_path / "a.csv").write_text("filename,label\n" + "".join(f"a{i}.png,x\n" for i in range(9)))
    (tmp_path / "b.csv").write_text("filename\n" + "".join(f"b{i}.png\n" for i in range(3)))
    index = open_index([tmp_path / "a.csv", tmp_path / "b.csv"])
    s = ItemStream(index, sampler=["permutation", "uniform"], batch_size=4, seed=5)
    works = epoch(s, 0)
    sources = [src for w in works for src in w.sources]
    assert all(isinstance(j, Joined) and len(j) == 2 for j in sources)
    assert sorted(j[0].rsplit("/", 1)[1] for j in sources) == sorted(f"a{i}.png" for i in range(9))
    assert {j[1].rsplit("/", 1)[1] for j in sources} <= {"b0.png", "b1.png", "b2.png"}
    again = ItemStream(index, sampler=["permutation", "uniform"], batch_size=4, seed=5)
    assert [src for w in epoch(again, 0, skip=4) for src in w.sources] == sources[4:]
