"""Several indexes joined item by item: :class:`JoinedIndex`.

The first index gives the examples, labels and partitions; each other index is
fetched row by row alongside it (aligned), or drawn by its own sampler (then it
is never partitioned).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..fetch.sources import Joined
from .table import Index

__all__ = ["JoinedIndex", "join"]


def join(indexes: list[Index]) -> Index:
    """Several indexes joined item by item (a :class:`JoinedIndex`); one index stays as it is."""
    if len(indexes) == 1:
        return indexes[0]
    return JoinedIndex(indexes)


class JoinedIndex(Index):
    """A list of indexes joined item by item; the first (the *driver*) gives the examples.

    ``len()``, ``labels``, ``targets`` and partitions come from the first index:
    example i is example ``positions[i]`` of the first. Each other member is
    either *aligned* (example i fetches the member's item on the same row of
    its file, so it must have as many rows and is partitioned in lockstep) or
    *drawn* by its own sampler (see ``sampler=[...]`` in
    :class:`dataset.batcher.SampledBatcher`). Which is chosen per batcher, so
    ``members`` stay whole: a drawn member is never partitioned, every rank
    draws from all of it (draws are with replacement, so partitioning would
    add nothing, and a 3-item index could not be split over 8 ranks anyway).

    ``source(i)``/``name(i)`` join the row of example i in the members that
    have as many rows as the first (the ones that can be aligned), in order.
    """

    def __init__(
        self,
        members: Sequence[Index],
        positions: Sequence[int] | np.ndarray | None = None,
        origin: str | None = None,
    ):
        if len(members) < 2:
            raise ValueError("a joined index needs at least two indexes")
        self.members: list[Index] = list(members)
        first = self.members[0]
        if positions is None:
            positions = np.arange(len(first), dtype=np.int64)
        self.positions = np.asarray(positions, dtype=np.int64)
        self.labels = first.labels
        self.origin = origin or " + ".join(m.origin for m in self.members)
        self.multi_hot, self.split = first.multi_hot, first.split
        self.table, self.row_labels = first.table, first.row_labels
        self._rows = first.rows[self.positions]
        self.targets = first.targets[self.positions]
        # members whose rows line up with the first's
        self._alignable = [m for m in self.members if m.num_rows == first.num_rows]

    def __repr__(self) -> str:
        return f"JoinedIndex({self.origin!r}, examples={len(self)}, members={len(self.members)})"

    @property
    def in_memory(self) -> bool:
        return False

    @property
    def sources(self) -> list[Joined]:  # type: ignore[override]
        return [self.source(i) for i in range(len(self))]

    def source(self, i: int) -> Joined:
        r = self._row(i)
        return Joined(m.row_source(r) for m in self._alignable)

    def name(self, i: int) -> str:
        r = self._row(i)
        return " + ".join(m.row_name(r) for m in self._alignable)

    def describe(self, positions: np.ndarray) -> tuple[list, list[str], list, list[int]]:
        rows = self.rows[positions].tolist()
        sources = [Joined(m.row_source(r) for m in self._alignable) for r in rows]
        names = [" + ".join(m.row_name(r) for m in self._alignable) for r in rows]
        labels = [self.row_labels.of(r) for r in rows]
        return sources, names, labels, self.targets[positions].tolist()

    def take(self, positions: Sequence[int] | np.ndarray, origin: str | None = None):
        """The examples at `positions`; members stay whole (only the driver's positions change)."""
        picked = self.positions[np.asarray(positions, dtype=np.int64)]
        return JoinedIndex(self.members, picked, origin or self.origin)
