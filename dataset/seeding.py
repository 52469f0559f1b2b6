"""Randomness in processors: per-worker global seeds, and a generator per item.

Two guarantees, from the batcher's ``seed``:

- Each process worker seeds ``torch``, ``numpy.random`` and ``random`` from
  (seed, partition, epoch, worker) at the start of every epoch, as DataLoader
  does per worker, so two workers never repeat each other's random crops.
  Thread workers share the main process's generators (there is one per
  process), like ``DataLoader(num_workers=0)``.
- Inside a processor, :func:`item_rng` (a ``numpy.random.Generator``) and
  :func:`item_seed` (an int, e.g. for ``torch.Generator().manual_seed``)
  derive from (seed, partition, epoch, the item's position in the epoch): an
  augmentation drawn from them does not depend on the number or kind of
  workers, nor on which worker decodes the item, and a job resumed with
  ``load_state_dict`` draws exactly what it would have drawn. An item of a mix
  is keyed by (seed, its source, the source's epoch, its place in it), and
  :func:`item_source` says which source it is.

    from distlearn.dataset import item_rng

    def augment(data, opt, out):
        Image()(data, opt, out)
        if item_rng().random() < 0.5:
            out.copy_(out.flip(-1))
        return True
"""

from __future__ import annotations

import contextvars
import random
from typing import Any

import numpy as np

__all__ = ["MIX_KEY", "call_with_item", "item_rng", "item_seed", "item_source", "seed_worker"]

# Separates item generators from the epoch's sampler generators (same entropy words).
_ITEM_STREAM = 0x17E4
_WORKER_STREAM = 0x3A0B

# The first word after the seed of a mixed item's key: (seed, MIX_KEY, source, epoch,
# place), its source's epoch and its place in that epoch's order (dataset.sampling.mix).
MIX_KEY = 0x313C

# (seed, partition, epoch, position) of the item a processor is decoding now
_CURRENT: contextvars.ContextVar[tuple[int, ...] | None] = contextvars.ContextVar(
    "distlearn_dataset_item", default=None
)


def item_seed() -> int:
    """A 63-bit seed for the item being decoded (call it inside a processor).

    It derives from (seed, partition, epoch, the item's place in the epoch): the same
    for that item whatever the number or kind of workers, and after a resume.

    Returns:
        The seed, e.g. for `torch.Generator().manual_seed`.

    Raises:
        RuntimeError: Called outside a processor run by a batcher.
    """
    key = _CURRENT.get()
    if key is None:
        raise RuntimeError("item_seed()/item_rng() are for use inside a processor of a batcher")
    seq = np.random.SeedSequence(list(key), spawn_key=(_ITEM_STREAM,))
    return int(seq.generate_state(1, np.uint64)[0] >> np.uint64(1))


def item_rng() -> np.random.Generator:
    """A numpy generator for the item being decoded: the same for that item on any setup.

    Returns:
        A `numpy.random.Generator` seeded with `item_seed()`.

    Raises:
        RuntimeError: Called outside a processor run by a batcher.
    """
    return np.random.default_rng(item_seed())


def item_source() -> int | None:
    """In a processor, which source of a mix the item being decoded comes from.

    Returns:
        Its index in the mix's sources (what `batch.source` holds), or None for an item
        that is not of a mix.

    Raises:
        RuntimeError: Called outside a processor run by a batcher.
    """
    key = _CURRENT.get()
    if key is None:
        raise RuntimeError("item_source() is for use inside a processor of a batcher")
    return int(key[2]) if len(key) == 5 and key[1] == MIX_KEY else None


def call_with_item(key: tuple[int, ...], fn: Any, *args: Any) -> Any:
    """``fn(*args)`` with `key` as the current item (what :func:`item_seed` reads)."""
    token = _CURRENT.set(key)
    try:
        return fn(*args)
    finally:
        _CURRENT.reset(token)


def seed_worker(seed: int, partition: int, epoch: int, worker: int) -> None:
    """Seed this process's torch, numpy and random generators for one worker and epoch."""
    import torch

    seq = np.random.SeedSequence([seed, partition, epoch, worker], spawn_key=(_WORKER_STREAM,))
    s64 = int(seq.generate_state(1, np.uint64)[0])
    torch.manual_seed(s64 & ((1 << 63) - 1))
    np.random.seed(s64 & 0xFFFFFFFF)
    random.seed(s64)
