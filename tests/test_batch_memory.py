"""Where a batch's memory lives: lent ring slots (no copy), copies beyond the spare slots,
and the batcher's one-batch-ahead copy to a device."""

from __future__ import annotations

import gc

import pytest
import torch

from distlearn.dataset import Dataset
from distlearn.dataset.workers.ring import SPARE_SLOTS

N = 40


def tensor_dataset() -> Dataset:
    x = torch.arange(N * 6, dtype=torch.float32).view(N, 6)
    return Dataset({"x": x, "y": torch.arange(N) % 3})


def in_ring(batcher, t: torch.Tensor) -> bool:
    slots = batcher.engine.workers.slots
    lo = slots.data_ptr()
    return lo <= t.data_ptr() < lo + slots.numel() * slots.element_size()


KINDS = [
    pytest.param({"workers": "thread", "num_workers": 0}, id="inline"),
    pytest.param({"workers": "thread", "num_workers": 2}, id="threads"),
    pytest.param({"workers": "process", "num_workers": 2}, id="processes"),
]


@pytest.mark.parametrize("opts", KINDS)
def test_batches_are_lent_the_ring_and_never_overwritten_while_held(opts):
    """A batch in hand keeps its slot: holding every batch of an epoch, the first
    SPARE_SLOTS are the ring's memory, the rest copies, and all keep their values."""
    b = tensor_dataset().sampled_batcher(batch_size=4, input_dims=(6,), **opts)
    try:
        held = list(b)
        assert [in_ring(b, x.input) for x in held] == [True] * SPARE_SLOTS + [False] * (
            len(held) - SPARE_SLOTS
        )
        got = torch.cat([x.input for x in held])
        assert torch.equal(got, torch.arange(N * 6, dtype=torch.float32).view(N, 6))
        # a second epoch, while every batch of the first is still held
        second = torch.cat([x.input.clone() for x in b])
        assert torch.equal(second, got)
        assert torch.equal(torch.cat([x.input for x in held]), got)
    finally:
        b.close()


@pytest.mark.parametrize("opts", KINDS)
def test_a_batch_dropped_at_once_gives_its_slot_back(opts):
    """The usual loop (use a batch, drop it) never copies: every batch is lent."""
    b = tensor_dataset().sampled_batcher(batch_size=4, input_dims=(6,), **opts)
    try:
        for _ in range(2):
            for batch in b:
                assert in_ring(b, batch.input)
                del batch
    finally:
        b.close()


def test_a_view_kept_keeps_the_slot():
    """Only when every view of the memory is gone does the slot go back to the ring."""
    b = tensor_dataset().sampled_batcher(batch_size=4, input_dims=(6,), workers="thread",
                                         num_workers=1)  # fmt: skip
    try:
        it = iter(b)
        first = next(it)
        view = first.input[1:3]
        want = view.clone()
        del first
        gc.collect()
        rest = [x.input.clone() for x in it]  # the whole epoch runs past the slot
        assert torch.equal(view, want) and len(rest) == N // 4 - 1
    finally:
        b.close()


class HostCopy:
    """A device stand-in on the host (this machine has no GPU): copies like a device
    would, so the batcher's one-ahead order and accounting are tested here; the CUDA
    copy itself is tested by the cuda tests in test_augment.py."""

    def __init__(self):
        self.started, self.finished = [], []

    def start(self, batch):
        self.started.append(batch.input[0, 0].item())
        return batch

    def finish(self, batch):
        self.finished.append(batch.input[0, 0].item())
        return batch

    def stats(self):
        return {"device_wait_s": 0.0, "device_batches": len(self.finished)}


def test_device_copy_runs_one_batch_ahead_and_state_counts_what_was_handed_out():
    ds = tensor_dataset()
    b = ds.sampled_batcher(batch_size=4, input_dims=(6,), workers="thread", num_workers=0)
    copy = HostCopy()
    b._device = copy
    try:
        it = iter(b)
        first = next(it)
        # batch 2's copy started before batch 1 was handed out
        assert copy.started == [0.0, 24.0] and copy.finished == [0.0]
        assert first.input[0, 0].item() == 0.0
        state = b.state_dict()
        rest = [x.input[0, 0].item() for x in it]
        assert rest == [24.0 * k for k in range(1, N // 4)]
        assert b.stats["device_batches"] == N // 4
    finally:
        b.close()
    # the state taken after one batch resumes at the second, though the second was copying
    again = ds.sampled_batcher(batch_size=4, input_dims=(6,), workers="thread", num_workers=0)
    try:
        again.load_state_dict(state)
        assert [x.input[0, 0].item() for x in again] == [24.0 * k for k in range(1, N // 4)]
    finally:
        again.close()
