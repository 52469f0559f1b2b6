"""Samplers: which items an epoch visits, in which order.

A sampler is a function ``sampler(index, epoch, rng, **opts) -> Iterable`` run in
the main process only. It yields, for one epoch, either positions into
``index`` (ints, best as one numpy array: the batcher slices it batch by
batch, with no Python object per item) or *records*: objects with ``source``
(the payload in memory, or something to fetch), ``labels`` (label ids) and
``name``, which is how part-file readers feed items that need no fetch (see
:class:`dataset.items.Record`). A result with ``len()`` gives the epoch its
length; a plain generator is a stream of unknown length.

``rng`` is a ``numpy.random.Generator`` seeded by (seed, partition, epoch), so
an epoch's order is the same on every machine and a resumed job can regenerate
it and skip what it already saw.

Samplers that draw with replacement (``uniform``, ``label-*``) draw
``len(index)`` examples per epoch, or ``num_samples``. ``linear``,
``permutation`` and ``uniform`` take ``label=`` (a label name) to walk one
label's examples only, as torch-dataset's samplers did.
"""

from __future__ import annotations

import inspect
import itertools
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import numpy as np

from distlearn.common.keywords import unknown

__all__ = [
    "PART_SAMPLERS",
    "SamplerFn",
    "check_options",
    "endless",
    "epoch_rng",
    "for_index",
    "get_sampler",
    "label_cycles",
    "label_distribution",
    "label_permutation",
    "label_uniform",
    "linear",
    "part_linear",
    "part_linear_permutation",
    "part_permutation_permutation",
    "permutation",
    "register_sampler",
    "sampler_names",
    "uniform",
]

SamplerFn = Callable[..., Iterable[Any]]
_SAMPLERS: dict[str, SamplerFn] = {}


def register_sampler(name: str, factory: SamplerFn) -> None:
    """Make `sampler=name` available to every batcher.

    Args:
        name: The name `sampled_batcher(sampler=...)` will take.
        factory: `factory(index, epoch, rng, **sampler_opt) -> iterable` of positions
            (best one numpy array) or `Record`s for one epoch; `rng` is a numpy
            generator seeded by (seed, partition, epoch).

    Raises:
        TypeError: `factory` is not callable.
    """
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


def check_options(fn: SamplerFn, opt: Mapping[str, Any], name: str) -> None:
    """Raise TypeError for a `sampler_opt` key the sampler does not take, naming the
    closest one, as a keyword argument the sampler does not take would (but here, when
    the batcher is made, not at its first batch)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return  # a builtin or C callable: nothing to check against
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return
    known = [p.name for p in params[3:] if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    for key in opt:
        if key not in known:
            raise unknown(f"sampler {name!r}", key, known, noun="option")


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
    sampler: SamplerFn,
    index,
    rng: np.random.Generator,
    opt: Mapping[str, Any] | None = None,
    skip: int = 0,
) -> Iterator[Any]:
    """`sampler`'s epochs of `index` end to end, forever, all drawn from one generator,
    after the first `skip` items (whole epochs of arrays skipped by their length, the
    rest sliced: computed, not walked item by item).

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
            empty = len(items) == 0
            if skip >= len(items) and not empty:
                skip -= len(items)
                continue
            items, skip = items[skip:].tolist(), 0  # python ints iterate far faster
        elif skip:
            items = iter(items)
            for _ in itertools.islice(items, skip):
                empty = False
                skip -= 1
        for item in items:
            empty = False
            yield item
        if empty:
            name = getattr(sampler, "__name__", repr(sampler))
            raise ValueError(f"{index.origin}: sampler {name!r} drew no item (epoch {epoch})")


def _label_id(index, label: str | int) -> int:
    name = str(label)
    try:
        return index.labels.index(name)
    except ValueError:
        raise ValueError(
            f"{index.origin}: no label {name!r}; labels are {index.labels[:20]}"
        ) from None


def _positions(index, label: str | int | None) -> np.ndarray:
    """Every example, or the examples of one `label` (a name, as torch-dataset's samplers)."""
    if label is None:
        return np.arange(len(index), dtype=np.int64)
    return index.by_label()[_label_id(index, label)]


def linear(index, epoch: int, rng: np.random.Generator, label: str | None = None) -> np.ndarray:
    """Every example once, in index order (only those of `label` when given)."""
    return _positions(index, label)


def permutation(
    index, epoch: int, rng: np.random.Generator, label: str | None = None
) -> np.ndarray:
    """Every example once, in a new random order each epoch (only those of `label` when given)."""
    return rng.permutation(_positions(index, label)).astype(np.int64)


def uniform(
    index,
    epoch: int,
    rng: np.random.Generator,
    label: str | None = None,
    num_samples: int | None = None,
) -> np.ndarray:
    """Examples drawn uniformly with replacement (of `label` when given)."""
    pool = _positions(index, label)
    if not len(pool):
        raise ValueError(
            f"{index.origin}: uniform has nothing to draw from"
            + (f": label {label!r} has no example in this partition" if label is not None else "")
        )
    return pool[rng.integers(0, len(pool), size=_draws(index, num_samples))]


def _draws(index, num_samples: int | None) -> int:
    """How many draws an epoch of a sampler with replacement makes: ``len(index)`` by default."""
    if num_samples is None:
        return len(index)
    if num_samples < 0:
        raise ValueError(f"num_samples must be >= 0, got {num_samples}")
    return int(num_samples)


def _members(index) -> tuple[list[np.ndarray], np.ndarray]:
    """Per-label member positions and the ids of the labels that have members here."""
    members = index.by_label()
    present = np.asarray([i for i, m in enumerate(members) if len(m)], dtype=np.int64)
    if len(present) == 0:
        raise ValueError(f"{index.origin}: label samplers need labelled items, found none")
    return members, present


def _by_value(labels: np.ndarray) -> Iterator[tuple[int, np.ndarray]]:
    """``(label, where it is drawn)`` for each distinct label, in label order.

    One sort for all labels, not a pass over the draws per label (1,000 labels
    and 10M draws would be 10^10 comparisons).
    """
    order = np.argsort(labels, kind="stable")
    ordered = labels[order]
    bounds = np.flatnonzero(np.diff(ordered)) + 1
    for lo, hi in zip(np.r_[0, bounds], np.r_[bounds, len(order)], strict=True):
        if hi > lo:
            yield int(ordered[lo]), order[lo:hi]


def _draw_members(members, labels: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    out = np.empty(len(labels), dtype=np.int64)
    for lab, where in _by_value(labels):
        pool = members[lab]
        out[where] = pool[rng.integers(0, len(pool), size=len(where))]
    return out


def label_uniform(
    index, epoch: int, rng: np.random.Generator, num_samples: int | None = None
) -> np.ndarray:
    """A label uniformly at random, then an example of that label uniformly at random."""
    members, present = _members(index)
    labels = present[rng.integers(0, len(present), size=_draws(index, num_samples))]
    return _draw_members(members, labels, rng)


def label_cycles(
    n: int, labels: np.ndarray, rng: np.random.Generator, epoch: int | None = None
) -> np.ndarray:
    """`n` labels drawn in cycles: each run of ``len(labels)`` holds every label once.

    Each cycle is a fresh permutation, never in the same order as the cycle
    before it (torch-dataset's rule), so with two labels cycles alternate.

    With `epoch` and a generator made by :func:`epoch_rng`, the rule holds across
    epochs too: an epoch's first cycle comes from a stream of its own (seed,
    partition, epoch) that the epoch before regenerates, so that epoch's last cycle is
    drawn different from it (two labels alternate from one order per seed and
    partition). Nothing chains further back: any epoch is drawn alone, as a resume
    regenerates it.
    """
    k = len(labels)
    cycles = -(-n // k)
    if k == 1 or n == 0:
        return np.repeat(labels[:1], n)
    perms = np.argsort(rng.random((cycles, k)), axis=1)
    first = _first_cycle(rng, epoch, k, 0)
    if k == 2:
        if first is None:  # nothing known of other epochs: alternate within this one
            first, epoch = perms[0].copy(), 0
        perms[0::2] = first if (epoch * cycles) % 2 == 0 else first[::-1]
        perms[1::2] = first[::-1] if (epoch * cycles) % 2 == 0 else first
        return labels[perms.reshape(-1)[:n]]
    if first is not None:
        perms[0] = first
    after = _first_cycle(rng, epoch, k, 1)  # the next epoch's first cycle

    def clash(c: int) -> bool:
        if c > 0 and (perms[c] == perms[c - 1]).all():
            return True
        return c == cycles - 1 and c > 0 and after is not None and bool((perms[c] == after).all())

    # redraw a cycle equal to the one before (1 in k!); that can only affect the next
    todo = deque((np.nonzero((perms[1:] == perms[:-1]).all(axis=1))[0] + 1).tolist())
    if clash(cycles - 1) and (not todo or todo[-1] != cycles - 1):
        todo.append(cycles - 1)
    while todo:
        c = todo.popleft()
        while clash(c):
            perms[c] = rng.permutation(k)
        nxt = c + 1
        if nxt < cycles and clash(nxt) and (not todo or todo[0] != nxt):
            todo.appendleft(nxt)
    return labels[perms.reshape(-1)[:n]]


# The stream of an epoch's generator (a spawn key) that its first label cycle comes from.
_CYCLE_STREAM = 0x1C7C


def _first_cycle(rng: np.random.Generator, epoch: int | None, k: int, ahead: int) -> Any:
    """The first label cycle (a permutation of ``range(k)``) of epoch ``epoch + ahead``, when
    `rng` is :func:`epoch_rng`'s for `epoch`; else None (nothing is known of other
    epochs). Two labels: the order of the job's first cycle (epoch 0), whatever `ahead`."""
    seq = getattr(rng.bit_generator, "seed_seq", None)
    entropy = getattr(seq, "entropy", None)
    if epoch is None or not isinstance(entropy, list | tuple) or len(entropy) != 3:
        return None
    if int(entropy[2]) != epoch or tuple(seq.spawn_key) != ():
        return None
    at = 0 if k == 2 else epoch + ahead
    sub = np.random.SeedSequence([int(entropy[0]), int(entropy[1]), at],
                                 spawn_key=(_CYCLE_STREAM,))  # fmt: skip
    return np.random.Generator(np.random.PCG64(sub)).permutation(k)


def label_permutation(
    index, epoch: int, rng: np.random.Generator, num_samples: int | None = None
) -> np.ndarray:
    """Labels in balanced cycles, then each label's next example in a per-label permutation.

    Every run of L draws (L labels) holds each label once, across epochs too: an
    epoch is a whole number of cycles (``num_samples``, default ``len(index)``, rounded
    up to a multiple of L), and its last cycle differs from the next epoch's first.
    Each label walks through a shuffled list of its examples, reshuffled when it
    wraps, so within a label no example repeats before all have been seen.
    """
    members, present = _members(index)
    n = _draws(index, num_samples)
    n = -(-n // len(present)) * len(present) if len(present) else n
    labels = label_cycles(n, present, rng, epoch)
    out = np.empty(len(labels), dtype=np.int64)
    for lab, where in _by_value(labels):
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
    num_samples: int | None = None,
) -> np.ndarray:
    """A label drawn with probability proportional to ``weights[name]`` (``default_weight``
    for labels not named), then an example of that label uniformly at random."""
    if weights is None:
        raise ValueError("sampler 'label-distribution' needs sampler_opt={'weights': {...}}")
    unknown = set(weights) - set(index.labels)
    if unknown:
        raise ValueError(f"label-distribution: unknown labels {sorted(unknown)}")
    members, present = _members(index)
    w = np.asarray(
        [float(weights.get(index.labels[lab], default_weight)) for lab in present], dtype=float
    )
    if not np.isfinite(w).all() or (w < 0).any() or w.sum() <= 0:
        raise ValueError(
            f"label-distribution: weights must be finite, >= 0 and with a positive sum, got {w}"
        )
    size = _draws(index, num_samples)
    labels = present[rng.choice(len(present), size=size, p=w / w.sum())]
    return _draw_members(members, labels, rng)


register_sampler("linear", linear)
register_sampler("permutation", permutation)
register_sampler("uniform", uniform)
register_sampler("label-uniform", label_uniform)
register_sampler("label-permutation", label_permutation)
register_sampler("label-distribution", label_distribution)


# ----------------------------------------------------------------------------- part sources


def _epoch_of(index: Any, kind: str) -> Callable[..., Any]:
    epoch = getattr(index, "epoch", None)
    if epoch is None or not hasattr(index, "stream"):
        raise TypeError(
            f"sampler {kind!r} reads part files; the index {getattr(index, 'origin', index)!r} "
            "is not a folder of part files"
        )
    return epoch


def part_linear(index: Any, epoch: int, rng: np.random.Generator) -> Iterable[Any]:
    """Parts in order, records of each part in order."""
    return _epoch_of(index, "part-linear")(rng, "linear", "linear")


def part_linear_permutation(index: Any, epoch: int, rng: np.random.Generator) -> Iterable[Any]:
    """Parts in order, records of each part in a new random order each epoch."""
    return _epoch_of(index, "part-linear-permutation")(rng, "linear", "permutation")


def part_permutation_permutation(index: Any, epoch: int, rng: np.random.Generator) -> Iterable[Any]:
    """Parts in a new random order each epoch, records of each part permuted too."""
    return _epoch_of(index, "part-permutation-permutation")(rng, "permutation", "permutation")


# The samplers of part sources (dataset.index.parts): one epoch of records, the part
# source's ``epoch(rng, parts, items)`` (a PartEpoch: iterable, and readable from any place).
PART_SAMPLERS = {
    "part-linear": part_linear,
    "part-linear-permutation": part_linear_permutation,
    "part-permutation-permutation": part_permutation_permutation,
}
for _name, _fn in PART_SAMPLERS.items():
    register_sampler(_name, _fn)


def for_index(index: Any, sampler: Any) -> Any:
    """The sampler to use for `index`: ``linear`` (the default) means ``part-linear``
    for a part source, whose records have no positions, so any other named
    sampler of positions is refused at once (torch-dataset refused them too)."""
    if not hasattr(index, "stream"):
        return sampler
    if sampler == "linear":
        return "part-linear"
    if isinstance(sampler, str) and sampler not in PART_SAMPLERS:
        raise TypeError(
            f"{index.origin}: part-file records cannot be addressed by position, so "
            f"sampler {sampler!r} cannot draw them; use one of {', '.join(PART_SAMPLERS)}"
        )
    return sampler
