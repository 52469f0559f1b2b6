"""Samplers: which items an epoch visits, in which order.

A sampler is a function ``sampler(index, epoch, rng, **opts) -> Iterable`` run in
the main process only. It yields, for one epoch, either positions into
``index`` (ints, usually as one numpy array) or *records*: objects with
``source`` (the payload in memory, or something to fetch), ``labels`` (label
ids) and ``name``, which is how part-file readers feed items that need no fetch
(see :class:`dataset.batcher.Record`). A result with ``len()`` gives the epoch
its length; a plain generator is a stream of unknown length.

``rng`` is a ``numpy.random.Generator`` seeded by (seed, partition, epoch), so
an epoch's order is the same on every machine and a resumed job can regenerate
it and skip what it already saw.

Samplers that draw with replacement (``uniform``, ``label-*``) draw
``len(index)`` items per epoch.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import numpy as np

SamplerFn = Callable[..., Iterable[Any]]
_SAMPLERS: dict[str, SamplerFn] = {}


def register_sampler(name: str, factory: SamplerFn) -> None:
    """Make ``sampler=name`` available: ``factory(index, epoch, rng, **sampler_opt)``."""
    if not callable(factory):
        raise TypeError(f"sampler {name!r}: factory must be callable")
    _SAMPLERS[name] = factory


def get_sampler(sampler: str | SamplerFn) -> SamplerFn:
    if callable(sampler):
        return sampler
    try:
        return _SAMPLERS[sampler]
    except KeyError:
        raise ValueError(
            f"unknown sampler {sampler!r}; known: {', '.join(sorted(_SAMPLERS))} "
            "(add one with dataset.register_sampler)"
        ) from None


def sampler_names() -> list[str]:
    return sorted(_SAMPLERS)


def epoch_rng(seed: int, partition: int, epoch: int, stream: int = 0) -> np.random.Generator:
    """The generator for one (seed, partition, epoch): reproducible on any machine.

    ``stream`` k > 0 gives an independent generator for the same epoch (numpy's
    spawn key), used to draw from the k-th index of a join; stream 0 is the
    epoch's own generator, the same as before streams existed.
    """
    spawn_key = (stream,) if stream else ()
    seq = np.random.SeedSequence([seed, partition, epoch], spawn_key=spawn_key)
    return np.random.Generator(np.random.PCG64(seq))


def endless(
    sampler: SamplerFn, index, rng: np.random.Generator, opt: Mapping[str, Any] | None = None
) -> Iterator[Any]:
    """`sampler`'s epochs of `index` end to end, forever, all drawn from one generator.

    This is how a joined index that does not drive the epoch is drawn from: any
    sampler works, ``linear``/``permutation`` wrap around and ``uniform`` never
    ends. Raises ValueError when an epoch of the sampler is empty (it would never
    yield an item).
    """
    opt = opt or {}
    for epoch in itertools.count():
        empty = True
        items = sampler(index, epoch, rng, **opt)
        if isinstance(items, np.ndarray):
            items = items.tolist()  # python ints iterate and index far faster
        for item in items:
            empty = False
            yield item
        if empty:
            name = getattr(sampler, "__name__", repr(sampler))
            raise ValueError(f"{index.origin}: sampler {name!r} drew no item (epoch {epoch})")


def linear(index, epoch: int, rng: np.random.Generator) -> np.ndarray:
    """Every item once, in index order."""
    return np.arange(len(index), dtype=np.int64)


def permutation(index, epoch: int, rng: np.random.Generator) -> np.ndarray:
    """Every item once, in a new random order each epoch."""
    return rng.permutation(len(index)).astype(np.int64)


def uniform(index, epoch: int, rng: np.random.Generator) -> np.ndarray:
    """Items drawn uniformly with replacement."""
    return rng.integers(0, len(index), size=len(index), dtype=np.int64)


def _members(index) -> tuple[list[np.ndarray], np.ndarray]:
    """Per-label member positions and the ids of the labels that have members here."""
    members = index.by_label()
    present = np.asarray([i for i, m in enumerate(members) if len(m)], dtype=np.int64)
    if len(present) == 0:
        raise ValueError(f"{index.origin}: label samplers need labelled items, found none")
    return members, present


def _draw_members(members, labels: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    out = np.empty(len(labels), dtype=np.int64)
    for lab in np.unique(labels):
        where = np.nonzero(labels == lab)[0]
        pool = members[lab]
        out[where] = pool[rng.integers(0, len(pool), size=len(where))]
    return out


def label_uniform(index, epoch: int, rng: np.random.Generator) -> np.ndarray:
    """A label uniformly at random, then an item of that label uniformly at random."""
    members, present = _members(index)
    labels = present[rng.integers(0, len(present), size=len(index))]
    return _draw_members(members, labels, rng)


def label_permutation(index, epoch: int, rng: np.random.Generator) -> np.ndarray:
    """A label uniformly at random, then that label's next item in a per-label permutation.

    Each label walks through a shuffled list of its items, reshuffling when it
    wraps, so within a label no item repeats before all have been seen.
    """
    members, present = _members(index)
    labels = present[rng.integers(0, len(present), size=len(index))]
    out = np.empty(len(labels), dtype=np.int64)
    for lab in np.unique(labels):
        where = np.nonzero(labels == lab)[0]
        pool = members[lab]
        reps = -(-len(where) // len(pool))
        order = np.concatenate([rng.permutation(pool) for _ in range(reps)])
        out[where] = order[: len(where)]
    return out


def label_distribution(
    index,
    epoch: int,
    rng: np.random.Generator,
    weights: Mapping[str, float] | None = None,
    default_weight: float = 0.0,
) -> np.ndarray:
    """A label drawn with probability proportional to ``weights[name]`` (``default_weight``
    for labels not named), then an item of that label uniformly at random."""
    if weights is None:
        raise ValueError("sampler 'label-distribution' needs sampler_opt={'weights': {...}}")
    unknown = set(weights) - set(index.labels)
    if unknown:
        raise ValueError(f"label-distribution: unknown labels {sorted(unknown)}")
    members, present = _members(index)
    w = np.asarray(
        [float(weights.get(index.labels[lab], default_weight)) for lab in present], dtype=float
    )
    if (w < 0).any() or w.sum() <= 0:
        raise ValueError(f"label-distribution: weights must be >= 0 with a positive sum, got {w}")
    labels = present[rng.choice(len(present), size=len(index), p=w / w.sum())]
    return _draw_members(members, labels, rng)


register_sampler("linear", linear)
register_sampler("permutation", permutation)
register_sampler("uniform", uniform)
register_sampler("label-uniform", label_uniform)
register_sampler("label-permutation", label_permutation)
register_sampler("label-distribution", label_distribution)
