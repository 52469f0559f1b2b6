"""The item stream: which items each batch holds, epoch after epoch, and where we are.

:class:`ItemStream` is a plain iterator of :class:`Work` (one batch of items:
what to fetch, their targets, labels and names), with no worker, ring or
tensor in sight, so it is tested alone. It owns what decides the order of
items and nothing else:

- the sampler and its options, run once per epoch in the main process with a
  generator seeded by (seed, partition, epoch);
- joined indexes: aligned members (item i of the first fetches item i of each)
  and drawn ones (each with its own sampler, seeded by the member's position);
- the epoch and the position in it, so ``state_dict()`` is a few integers (the
  order itself is regenerated on resume, never stored).

A sampler's epoch that is a numpy array of positions is cut into batches by
slicing: 10M items cost no Python object until their batch is dispatched.
"""

from __future__ import annotations

import itertools
import math
import numbers
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import BadIndex
from ..fetch.sources import Joined
from ..index.joined import JoinedIndex
from ..items import Record
from .samplers import check_options, endless, epoch_rng, get_sampler

__all__ = ["ItemStream", "Work"]


@dataclass
class Work:
    """One batch of items, in sampler order: ``first`` is the first item's place in its epoch."""

    sources: list[Any]
    targets: list[int]
    labels: list[tuple[int, ...]]
    names: list[str]
    epoch: int
    first: int

    def __len__(self) -> int:
        return len(self.sources)


@dataclass
class Draw:
    """How member k of a joined index is drawn: its sampler and options."""

    k: int
    sampler: Any
    opt: dict


class ItemStream:
    """Batches of `index`'s items in `sampler` order; ``next()`` ends with each epoch.

    ``start(epoch, skip)`` begins an epoch (skipping its first `skip` items);
    ``consumed(n)`` records items the user got (or that failed), which is
    what :meth:`state_dict` saves: an item dispatched but not handed out is
    seen again after a resume.
    """

    def __init__(
        self,
        index: Any,
        *,
        sampler: Any = "linear",
        sampler_opt: Any = None,
        batch_size: int = 32,
        seed: int = 0,
        partition: int = 0,
        drop_last: bool = False,
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.index = index
        self.batch_size, self.drop_last = batch_size, drop_last
        self.seed, self.partition = int(seed), int(partition)
        sampler, opt, self.draws = split_samplers(index, sampler, sampler_opt)
        self.sampler_name = (
            sampler if isinstance(sampler, str) else getattr(sampler, "__name__", "")
        )
        self.sampler = get_sampler(sampler)
        check_options(self.sampler, opt, self.sampler_name)
        self.sampler_opt = opt
        self.epoch = -1  # the epoch being read; -1 before the first
        self.done = 0  # items of this epoch handed out (or dropped)
        self.position = 0  # items of this epoch dispatched
        self.ended = False  # the epoch has no more items to dispatch
        self._batches: Iterator[Work] | None = None
        self._sized: tuple[int, Any] | None = None  # (epoch, its items) when they have a length

    # -- one epoch -------------------------------------------------------------------

    def items(self, epoch: int) -> Any:
        """The sampler's items for `epoch`: positions (best a numpy array) or records."""
        if self._sized is not None and self._sized[0] == epoch:
            return self._sized[1]
        rng = epoch_rng(self.seed, self.partition, epoch)
        items = self.sampler(self.index, epoch, rng, **self.sampler_opt)
        if self.draws:
            sized = hasattr(items, "__len__")
            items = (SizedDrawnJoin if sized else DrawnJoin)(self, epoch, items)
        if hasattr(items, "__len__"):
            self._sized = (epoch, items)
        return items

    def start(self, epoch: int, skip: int = 0) -> None:
        """Begin `epoch` after its first `skip` items."""
        self.epoch, self.done, self.position = epoch, skip, skip
        self.ended = False
        items = self.items(epoch)
        if isinstance(items, np.ndarray):
            self._batches = self._slices(items, skip)
        else:
            it = iter(items)
            if skip:
                it = itertools.islice(it, skip, None)
            self._batches = self._chunks(it)

    def stop(self) -> None:
        """Forget the rest of this epoch (``next()`` ends it)."""
        self._batches = None

    def __iter__(self) -> ItemStream:
        return self

    def __next__(self) -> Work:
        if self._batches is None:
            raise StopIteration
        work = next(self._batches, None)
        if work is None:
            self._batches, self.ended = None, True
            raise StopIteration
        self.position += len(work)
        return work

    def consumed(self, n: int) -> None:
        self.done += n

    def _slices(self, items: np.ndarray, skip: int) -> Iterator[Work]:
        """Batches of positions, sliced out of the epoch's array."""
        n, bs = len(items), self.batch_size
        for lo in range(skip, n, bs):
            chunk = items[lo : lo + bs]
            if self.drop_last and len(chunk) < bs:
                return
            sources, names, labels, targets = self.index.describe(chunk.astype(np.int64))
            yield Work(sources, targets, labels, names, self.epoch, lo)

    def _chunks(self, it: Iterator[Any]) -> Iterator[Work]:
        """Batches of a stream of positions and records."""
        while True:
            chunk = list(itertools.islice(it, self.batch_size))
            if not chunk or (self.drop_last and len(chunk) < self.batch_size):
                return
            yield self._work(chunk)

    def _work(self, chunk: list) -> Work:
        sources, targets, labels, names = [], [], [], []
        index = self.index
        for item in chunk:
            if isinstance(item, Record):
                labs = tuple(item.labels)
                target = item.target if item.target is not None else (labs[0] if labs else -1)
                sources.append(item.source)
                names.append(item.name)
            else:
                i = int(item)
                sources.append(index.source(i))
                labs = index.item_labels(i)
                names.append(index.name(i))
                target = index.target(i)
            labels.append(labs)
            targets.append(target)
        return Work(sources, targets, labels, names, self.epoch, self.position)

    # -- sizes -----------------------------------------------------------------------

    def __len__(self) -> int:
        """Batches in one epoch; TypeError for a stream of unknown length."""
        items = self.items(max(self.epoch, 0))
        if not hasattr(items, "__len__"):
            raise TypeError(
                f"sampler {self.sampler_name!r} yields a stream of unknown length; "
                "use batcher.num_batches() for an estimate"
            )
        return self.batches_for(len(items))

    def batches_for(self, n: int) -> int:
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)

    # -- resume ----------------------------------------------------------------------

    def state_dict(self) -> dict:
        """The epoch, how many of its items were handed out, and what the order depends on.

        Once every item of an epoch is handed out, where it stands is the start of the
        next one: a job resumed from there trains on, rather than over an empty epoch."""
        over = self.ended and self.done == self.position
        state = {
            "epoch": max(self.epoch + over, 0),
            "consumed": self.done if self.epoch >= 0 and not over else 0,
            "seed": self.seed,
            "partition": self.partition,
            "sampler": self.sampler_name,
            "batch_size": self.batch_size,
        }
        if hasattr(self.index, "__len__"):
            state["items"] = len(self.index)  # (an index that changed makes another order)
        return state

    def check_state(self, state: Any) -> tuple[int, int]:
        """``(epoch, consumed)`` of a saved state, refused if it was saved for another order
        (seed, partition, sampler or number of items) or does not say where it was."""
        if not isinstance(state, Mapping):
            raise TypeError(f"state_dict must be a dict, got {type(state).__name__}")
        for key in ("epoch", "consumed"):
            value = state.get(key)
            if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 0:
                raise ValueError(f"state_dict[{key!r}] must be an int >= 0, got {value!r}")
        now = self.state_dict()
        for key in ("seed", "partition", "sampler", "items"):
            if key in state and key in now and state[key] != now[key]:
                raise ValueError(
                    f"state_dict was saved with {key}={state[key]!r}, this batcher has "
                    f"{key}={now[key]!r}: its order would not be the one resumed"
                )
        return int(state["epoch"]), int(state["consumed"])


# ----------------------------------------------------------------------------- joined indexes


def split_samplers(index: Any, sampler: Any, sampler_opt: Any) -> tuple[Any, dict, list[Draw]]:
    """(the driver's sampler, its options, the drawn members) from ``sampler``/``sampler_opt``.

    A list/tuple ``sampler`` has one entry per joined index: entry 0 drives the
    epoch, entry k > 0 is None (aligned: item i of the first fetches item i of
    index k) or a sampler that draws index k's item for each driven item. A
    plain sampler drives with every other index aligned. Aligned members must
    have the first's length: BadIndex here, before anything is fetched.
    """
    members = index.members if isinstance(index, JoinedIndex) else None
    if isinstance(sampler, list | tuple):
        if members is None:
            raise ValueError(
                f"sampler={list(sampler)!r} is a list (one sampler per joined index), "
                f"but {index.origin} is a single index; pass one sampler"
            )
        if len(sampler) != len(members):
            raise ValueError(
                f"sampler={list(sampler)!r} has {len(sampler)} entries for "
                f"{len(members)} joined indexes ({index.origin}); give one per index"
            )
        if sampler[0] is None:
            raise ValueError("sampler[0] drives the epoch and cannot be None")
        samplers = list(sampler)
    else:
        samplers = [sampler] + [None] * (len(members) - 1 if members else 0)
    if isinstance(sampler_opt, list | tuple):
        if not isinstance(sampler, list | tuple):
            raise ValueError("a list of sampler_opt goes with a list of samplers (one per index)")
        if len(sampler_opt) != len(samplers):
            raise ValueError(
                f"sampler_opt has {len(sampler_opt)} entries for {len(samplers)} samplers"
            )
        opts = [dict(o or {}) for o in sampler_opt]
    else:
        opts = [dict(sampler_opt or {})] + [{} for _ in samplers[1:]]
    draws = []
    for k in range(1, len(samplers)):
        member = members[k]
        if samplers[k] is None:
            if opts[k]:
                raise ValueError(f"sampler_opt[{k}] given for {member.origin}, which is aligned")
            first = members[0]
            if member.num_rows != first.num_rows:
                raise BadIndex(
                    f"joined indexes differ in length: {first.origin} has {first.num_rows} "
                    f"items, {member.origin} has {member.num_rows}; item i of the first can "
                    f"only fetch item i of an index of the same length. To draw from "
                    f"{member.origin} instead, give it a sampler: sampler=[..., 'uniform'] "
                    f"(entry {k})"
                )
        else:
            fn = get_sampler(samplers[k])
            check_options(fn, opts[k], f"{samplers[k]!r} (index {k})")
            draws.append(Draw(k, fn, opts[k]))
    return samplers[0], opts[0], draws


class DrawnJoin:
    """One epoch of a joined index with drawn members: a :class:`Record` per driven item.

    Each iteration restarts the draws (each member's generator is seeded by
    (seed, partition, epoch, k)), so an epoch regenerated to resume it draws
    exactly what it drew before.
    """

    def __init__(self, stream: ItemStream, epoch: int, items: Iterable[Any]):
        self.index, self.draws = stream.index, stream.draws
        self.seed, self.partition, self.name = stream.seed, stream.partition, stream.sampler_name
        self.epoch, self.items = epoch, items

    def __iter__(self) -> Iterator[Record]:
        index = self.index
        members = index.members
        streams: list[Iterator[Any] | None] = [None] * len(members)
        for d in self.draws:
            rng = epoch_rng(self.seed, self.partition, self.epoch, stream=d.k)
            streams[d.k] = endless(d.sampler, members[d.k], rng, d.opt)
        for item in _flat(self.items):
            if isinstance(item, Record):
                if any(s is None for s in streams[1:]):
                    raise ValueError(
                        f"sampler {self.name!r} yields records, which have no position "
                        f"to align the other indexes of {index.origin} with; draw them instead"
                    )
                labels, target = tuple(item.labels), item.target
                slots, names = [item.source], [item.name]
            else:
                p = int(index.positions[item])
                labels, target = index.item_labels(item), index.target(item)
                row = members[0].row(p)
                slots, names = [members[0].source(p)], [members[0].name(p)]
            for k in range(1, len(members)):
                stream, member = streams[k], members[k]
                if stream is None:  # aligned: the member's item on the same row
                    slots.append(member.row_source(row))
                    names.append(member.row_name(row))
                    continue
                drawn = next(stream)
                if isinstance(drawn, Record):
                    slots.append(drawn.source)
                    names.append(drawn.name)
                else:
                    j = int(drawn)
                    slots.append(member.source(j))
                    names.append(member.name(j))
            yield Record(Joined(slots), labels, " + ".join(names), target)


class SizedDrawnJoin(DrawnJoin):
    """A :class:`DrawnJoin` whose driver has a length, so ``len(batcher)`` still works."""

    def __len__(self) -> int:
        return len(self.items)  # type: ignore[arg-type]


def _flat(items: Iterable[Any], step: int = 4096) -> Iterator[Any]:
    """Items one by one; a numpy array as Python ints, a slice at a time (not all at once)."""
    if isinstance(items, np.ndarray):
        for lo in range(0, len(items), step):
            yield from items[lo : lo + step].tolist()
    else:
        yield from items
