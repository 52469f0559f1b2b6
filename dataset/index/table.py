"""Indexes: the ordered list of examples a Dataset draws from, and their labels.

Every kind of index (CSV/TSV, directory, tensors, ``.pt`` file, part files, a
list of indexes) is opened by :func:`dataset.index.kinds.open_index`, the one
dispatch on the kind of index, into an :class:`Index`: per row of the file
a *source* (see :mod:`dataset.fetch.sources`) and its label ids into
``index.labels``, and the *examples* drawn from the rows.

An index of tens of millions of rows holds no Python object per row: rows are
a table of numpy arrays (for CSV files and folders, offsets into one bytes
buffer of names, see :class:`NameRows`), labels a compressed sparse row of
integer ids (:class:`RowLabels`), examples two arrays (``rows``, ``targets``).
A partition is an index array into those. Sources are made one at a time,
when an item is dispatched.

Label semantics, torch-dataset's (tested on its own fixtures in
``tests/test_torch_dataset.py``):

- A CSV row carries only the labels it has (ragged rows: ``a.jpg,XX`` and
  ``b.jpg,XX,XY`` under a ``filename,label1,label2`` header).
- ``index.labels`` is the sorted list of label names of the *whole* index
  (numerically when every name is an integer, so ``"10"`` comes after ``"9"``),
  computed before partitioning so a target means the same on every rank.
- An item with k labels is k *examples*, one per label; ``batch.target`` is the
  label the example stands for (-1 for an unlabeled item, which is one
  example). So ``len(index)`` counts examples: torch-dataset's ``index.csv``
  (20 rows) has 25. With ``multi_hot=True`` an item is one example instead and
  ``batch.target`` a multi-hot vector over ``index.labels``.
- Example order (what ``linear`` walks): by label (in ``index.labels`` order,
  unlabeled last), within a label by filename (then offset, length) for CSV
  and folders; row order for tensors.
- Partitioning, as torch-dataset: for CSV and folders, the k-th example of a
  label (counting from 1, in that order) goes to partition ``k % partitions``,
  so torch-dataset's 1-based partition p holds what our partition p - 1 holds;
  for tensors, row j (from 0) goes to partition ``j % partitions``. Every
  example is in exactly one partition and the union is the index.
- A list of indexes is a :class:`JoinedIndex`: the first gives the examples,
  labels and partitions; each other index is fetched row by row alongside it
  (aligned), or drawn by its own sampler (then it is never partitioned).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np

from .cores import arange, take
from .rows import NameRows, RowLabels, TensorRows, _display, small_int

__all__ = ["BY_LABEL", "BY_ROW", "Index", "labelled", "partition_positions", "sort_labels"]


# How an index partitions: by label (CSV, folders) or by row (tensors).
BY_LABEL, BY_ROW = "label", "row"


class Index:
    """The examples of one partition: what to fetch, their targets, and the label names.

    ``len(index)`` is the number of examples; ``index.labels`` the sorted label
    names; ``index.source(i)`` what to fetch for example i; ``index.targets[i]``
    the label id it stands for (-1: unlabeled); ``index.item_labels(i)`` all
    label ids of its item; ``index.rows[i]`` the item's row in the file.

    Built from per-row tables (``table``: sources and names; ``row_labels``:
    label ids), shared by every partition taken from it, and per-example
    arrays ``rows`` and ``targets`` (``rows`` None: example i is row i, an array
    made on first use; a partition taken at once needs only its own).

    Args:
        table: The rows' sources and names (`NameRows`, `TensorRows`).
        row_labels: Each row's label ids.
        labels: The label names, sorted.
        origin: Where the index came from, for messages.
        rows: Each example's row, or None when example i is row i.
        targets: Each example's label id (-1: unlabeled).
        multi_hot: An item is one example whose target is every label of it.
        split: How partitions deal examples: by label (torch-dataset's) or by row.
        label_order: `targets` run label by label, as `labelled()` makes them.

    Raises:
        ValueError: The tables' lengths disagree.
    """

    label_order = False  # (see __init__)

    def __init__(
        self,
        table: Any,
        row_labels: RowLabels,
        labels: Sequence[str],
        origin: str,
        *,
        rows: np.ndarray | None,
        targets: np.ndarray,
        multi_hot: bool = False,
        split: str = BY_LABEL,
        label_order: bool = False,
    ):
        if len(table) != len(row_labels):
            raise ValueError(f"{origin}: {len(table)} rows but {len(row_labels)} label rows")
        if rows is None and len(targets) != len(table):
            raise ValueError(f"{origin}: {len(table)} rows but {len(targets)} targets in order")
        if rows is not None and len(rows) != len(targets):
            raise ValueError(f"{origin}: {len(rows)} rows but {len(targets)} targets")
        self.table, self.row_labels = table, row_labels
        self.labels: list[str] = list(labels)
        self.origin = origin
        self.multi_hot, self.split = multi_hot, split
        self._rows, self.targets = rows, targets
        # targets known to run label by label (0, 1, ..., then the unlabeled -1s), as
        # labelled() makes them: a partition then finds each label's run by binary search
        self.label_order = label_order

    def __len__(self) -> int:
        return len(self.targets)

    def __repr__(self) -> str:
        return f"Index({self.origin!r}, examples={len(self)}, labels={len(self.labels)})"

    @property
    def rows(self) -> np.ndarray:
        """Each example's row in the file."""
        if self._rows is None:  # (a 10M-row file's in order: 40 MB that a partition skips)
            self._rows = arange(len(self.targets), small_int(len(self.targets)))
        return self._rows

    @property
    def num_rows(self) -> int:
        """Rows (items) of the whole file this index was read from."""
        return len(self.table)

    @property
    def in_memory(self) -> bool:
        """Whether the items are in memory already (tensor rows): nothing to fetch."""
        return self.table.in_memory

    def _row(self, i: int) -> int:
        if not 0 <= i < len(self.rows):
            raise IndexError(f"{self.origin}: example {i} out of range [0, {len(self.rows)})")
        return int(self.rows[i])

    def row(self, i: int) -> int:
        """The row (in the file) of example i's item.

        Args:
            i: The example's position in this index.

        Returns:
            The row.

        Raises:
            IndexError: `i` is out of range.
        """
        return self._row(i)

    def source(self, i: int) -> Any:
        """What to fetch for example i.

        Args:
            i: The example's position.

        Returns:
            A path or URL, `(url, offset, length)`, or a tensor row.

        Raises:
            IndexError: `i` is out of range.
        """
        return self.table.source(self._row(i))

    def target(self, i: int) -> int:
        """The label id example i stands for (-1: unlabeled).

        Args:
            i: The example's position.

        Returns:
            The label id, a place in `labels`.

        Raises:
            IndexError: `i` is out of range.
        """
        self._row(i)
        return int(self.targets[i])

    def item_labels(self, i: int) -> tuple[int, ...]:
        """Every label id of example i's item.

        Args:
            i: The example's position.

        Returns:
            The label ids.

        Raises:
            IndexError: `i` is out of range.
        """
        return self.row_labels.of(self._row(i))

    def name(self, i: int) -> str:
        """A human-readable name for example i (its URL or path), for logs and ``batch.urls``.

        Args:
            i: The example's position.

        Returns:
            The name.

        Raises:
            IndexError: `i` is out of range.
        """
        return self.table.name(self._row(i))

    def describe(self, positions: np.ndarray) -> tuple[list, list[str], list, list[int]]:
        """What one batch's examples are.

        Args:
            positions: The examples' positions.

        Returns:
            `(sources, names, labels, targets)`, one entry per example.
        """
        table, row_labels = self.table, self.row_labels
        rows = self.rows[positions].tolist()
        sources = [table.source(r) for r in rows]
        names = [_display(s, r) for s, r in zip(sources, rows, strict=True)]
        return sources, names, [row_labels.of(r) for r in rows], self.targets[positions].tolist()

    def row_source(self, r: int) -> Any:
        return self.table.source(r)

    def row_name(self, r: int) -> str:
        return self.table.name(r)

    @property
    def sources(self) -> Any:
        """What to fetch for every example, in order (a list, or a tensor of rows)."""
        if isinstance(self.table, TensorRows):
            import torch

            return self.table.x[torch.from_numpy(self.rows.astype(np.int64))]
        return [self.table.source(r) for r in self.rows.tolist()]

    @property
    def nbytes(self) -> int:
        """Bytes held by this index's arrays (its rows' tables included)."""
        table = self.table.nbytes if isinstance(self.table, NameRows) else 0
        return table + self.rows.nbytes + self.targets.nbytes + self.row_labels.nbytes

    def by_label(self) -> list[np.ndarray]:
        """Positions of the examples of each label (label samplers draw from these).

        With ``multi_hot`` an example (an item) is in every one of its labels.

        Returns:
            One array of positions per label, in the order of `labels`.
        """
        if not self.multi_hot:
            targets = self.targets
            positions = np.arange(len(targets), dtype=np.int64)
        else:
            ptr = self.row_labels.ptr.astype(np.int64)
            cnt = (ptr[1:] - ptr[:-1])[self.rows]
            positions = np.repeat(np.arange(len(self.rows), dtype=np.int64), cnt)
            starts = np.repeat(ptr[:-1][self.rows] - np.cumsum(cnt) + cnt, cnt)
            targets = self.row_labels.ids[starts + np.arange(len(positions))]
        order = np.argsort(targets, kind="stable")
        bounds = np.searchsorted(targets[order], np.arange(len(self.labels) + 1))
        return [positions[order[bounds[k] : bounds[k + 1]]] for k in range(len(self.labels))]

    def partition(self, partition: int, partitions: int) -> Index:
        """The examples of one partition (see the module docstring for the rule).

        Args:
            partition: The partition, 0-based.
            partitions: How many partitions.

        Returns:
            A new Index sharing this one's tables (this one when `partitions` is 1).

        Raises:
            ValueError: `partitions` < 1, or `partition` out of range.
        """
        if partitions < 1:
            raise ValueError(f"partitions must be >= 1, got {partitions}")
        if not 0 <= partition < partitions:
            raise ValueError(f"partition {partition} out of range for {partitions} partitions")
        if partitions == 1:
            return self
        if self.label_order and self.split == BY_LABEL:
            lo, hi = label_runs(self.targets, len(self.labels))
            positions = _picks(lo, hi, partition, partitions)
        else:
            positions = partition_positions(self.targets, partition, partitions, self.split)
        return self.take(positions, f"{self.origin}[partition {partition}/{partitions}]")

    def take(self, positions: Sequence[int] | np.ndarray, origin: str | None = None) -> Index:
        """A new Index of the examples at `positions`, sharing this one's tables and labels.

        Args:
            positions: The examples to keep, in the new order.
            origin: The new index's origin; by default this one's.

        Returns:
            The new Index.
        """
        positions = np.asarray(positions)
        if positions.dtype.kind not in "iu":  # (a list, or an empty one: floats)
            positions = positions.astype(np.int64)
        return Index(
            self.table,
            self.row_labels,
            self.labels,
            origin or self.origin,
            rows=positions if self._rows is None else self._rows[positions],
            targets=self.targets[positions],
            multi_hot=self.multi_hot,
            split=self.split,
        )


def partition_positions(targets: np.ndarray, partition: int, partitions: int, split: str):
    """Positions of the examples of one partition, by torch-dataset's rules.

    ``BY_LABEL``: the k-th example of each label (k from 1; the unlabeled form
    one more group) goes to partition ``k % partitions``. ``BY_ROW``: example j
    (from 0) goes to partition ``j % partitions``.
    """
    if split == BY_ROW:
        return np.arange(partition, len(targets), partitions, dtype=np.int64)
    group = np.where(targets < 0, np.iinfo(targets.dtype).max, targets)
    order = None
    if len(group) and not (group[1:] >= group[:-1]).all():  # not in label order: sort
        order = np.argsort(group, kind="stable")
        group = group[order]
    # each label is a run [lo, hi); its k-th example (from 1) is at lo + k - 1, so the
    # picks of a run are lo + first, lo + first + partitions, ... (no pass per example)
    lo = np.flatnonzero(np.r_[True, group[1:] != group[:-1]])
    hi = np.r_[lo[1:], len(group)]
    picked = _picks(lo, hi, partition, partitions)
    return picked if order is None else np.sort(order[picked])


def label_runs(targets: np.ndarray, labels: int) -> tuple[np.ndarray, np.ndarray]:
    """``(lo, hi)``: the run ``[lo[k], hi[k])`` of label k in `targets` that run label by
    label (0, 1, ..., ``labels`` - 1, then the unlabeled -1s), found by binary search;
    the last run is the unlabeled one. No pass over the examples."""
    n, lo, hi = len(targets), 0, len(targets)
    while lo < hi:  # the labelled examples come first: find where the -1s start
        mid = (lo + hi) // 2
        if targets[mid] >= 0:
            lo = mid + 1
        else:
            hi = mid
    starts = np.searchsorted(targets[:lo], np.arange(labels + 1, dtype=targets.dtype))
    bounds = np.r_[starts, n].astype(np.int64)
    return bounds[:-1], bounds[1:]


def _picks(lo: np.ndarray, hi: np.ndarray, partition: int, partitions: int) -> np.ndarray:
    """Positions of one partition, given each group's run ``[lo, hi)`` in group order.

    Pick j of the partition, the i-th of its run r, is ``lo[r] + first + i * partitions``
    = ``j * partitions + shift[r]``: two arrays as long as the picks, the second the
    running sum of each run's change of shift (fresh memory is most of what this
    costs: a 10M-row index's 1.25M picks made five int64 arrays, 50 MB)."""
    first = (partition - 1) % partitions  # k = first + 1 is the first k with k % partitions == p
    lo, hi = np.asarray(lo, dtype=np.int64), np.asarray(hi, dtype=np.int64)
    count = np.maximum(0, (hi - lo - first + partitions - 1) // partitions)
    at = np.cumsum(count) - count  # each run's first pick
    total, picked = int(count.sum()), count > 0
    dt = small_int(max(int(hi[-1]) if len(hi) else 0, total * partitions))  # (j * partitions)
    shift = (lo + first - at * partitions)[picked]
    out = np.arange(total, dtype=dt)
    out *= partitions
    change = np.zeros(total, dtype=dt)
    change[at[picked]] = np.diff(shift, prepend=0)
    np.cumsum(change, out=change)
    out += change
    return out


def sort_labels(names) -> list[str]:
    """Label names sorted numerically when all are integers, else as strings (see
    :func:`_label_keys`)."""
    names = list(set(names))
    keys = _label_keys(names)
    return sorted(names) if keys is names else [name for _, name in sorted(keys)]


def _label_keys(names: list[str]) -> list:
    """What labels sort by: ``(number, text)`` when every name is an integer, names of
    one number ("5", "05", "+5") by their text (not left in a set's order, which is the
    hash seed's: ranks would give the labels different ids); else `names` themselves."""
    try:
        return [(int(name), name) for name in names]
    except ValueError:
        return names


def labelled(
    table: Any,
    ptr: np.ndarray | None,
    ids: np.ndarray,
    names: Sequence[str | None],
    origin: str,
    multi_hot: bool = False,
    descents: np.ndarray | None = None,
) -> Index:
    """An Index of rows with labels, in torch-dataset's example order.

    Row r has the labels ``names[ids[j]]`` for j in ``ptr[r]:ptr[r + 1]`` (in
    column order; a label repeated in a row counts once); ``ptr`` None: row r
    has the one label ``ids[r]``; a name None is one no id refers to. Each row with k
    labels becomes k examples (one with ``multi_hot``); examples are ordered by
    label (unlabeled last), then by the row's name (then offset, length), then
    by row. `descents` (optional): the rows r whose name is > row r + 1's, as the
    parser found them (all of them); a file already in that order then costs no sort.
    """
    n = len(table)
    labels = [name for name in names if name is not None]
    if len(labels) < len(names) or not _in_label_order(labels):  # (a reader's, sorted)
        labels = sort_labels(labels)
    label_dt = small_int(len(labels) + 1)
    if len(ids) and list(names) != labels:  # (names already sorted: ids are as they are)
        ids = np.asarray(_remap(names, labels), dtype=label_dt)[ids]
    ids = ids.astype(label_dt, copy=False)
    row_dt = small_int(n)
    if ptr is None:  # one label a row
        cnt = None
    else:
        cnt = np.diff(ptr)  # (in ptr's type: non-decreasing)
        if len(cnt) and cnt.max() > 1:
            ptr, ids, cnt = _dedupe(ptr, ids, cnt)
    # ex_rows: each example's row; None: an example per row, in row order (the array is
    # made only where no sort makes it: a fresh array as large as the index costs)
    if cnt is None or (len(ids) == n and (cnt == 1).all()):  # one label per row
        ex_rows, targets, ptr = None, ids, None
    elif multi_hot:
        ex_rows = None
        targets = np.full(n, -1, dtype=label_dt)
        has = cnt > 0
        targets[has] = ids[ptr[:-1][has]]
    elif cnt.min() > 0:  # every row labelled: its examples are its labels, in order
        ex_rows, targets = np.repeat(np.arange(n, dtype=row_dt), cnt), ids
    else:  # (signed: the arithmetic below mixes the pointers with positions)
        ptr, cnt = ptr.astype(np.int64, copy=False), cnt.astype(np.int64, copy=False)
        k = np.maximum(cnt, 1)
        ex_rows = np.repeat(np.arange(n, dtype=row_dt), k)
        targets = np.full(len(ex_rows), -1, dtype=label_dt)
        ex_start = np.cumsum(k) - k
        targets[np.repeat(ex_start - ptr[:-1], cnt) + np.arange(len(ids))] = ids
        if len(ex_rows) == n:  # (rows of no label and of one: still an example per row)
            ex_rows = None
    group = targets if targets is ids else np.where(targets < 0, len(labels), targets)
    group = group.astype(label_dt, copy=False)
    if ptr is not None:
        ptr = ptr.astype(small_int(len(ids), signed=False), copy=False)
    row_labels = RowLabels(ptr, ids)
    if descents is not None and ex_rows is None and _in_order(group, descents):
        seq = None  # already in order: no sort, no gathers (rows made if asked for)
    else:
        if descents is not None and not len(descents) and table.ranges is None:
            # every name <= the next (a sorted file, unlabeled rows or several labels a
            # row among its rows): a stable sort by label alone is the (label, name) order
            order = np.argsort(group, kind="stable")
        else:
            order = table.order(ex_rows, group)  # a row per example
        seq = order.astype(row_dt, copy=False) if ex_rows is None else take(ex_rows, order)
        targets = take(targets, order)
    return Index(table, row_labels, labels, origin, rows=seq, targets=targets,
                 multi_hot=multi_hot, label_order=True)  # fmt: skip


def _in_label_order(names: list[str]) -> bool:
    """Whether `names` are :func:`sort_labels`' order already (a pass, not a sort)."""
    return all(a < b for a, b in itertools.pairwise(_label_keys(names)))


def _in_order(group: np.ndarray, descents: np.ndarray) -> bool:
    """Whether rows are already sorted by (group, name): groups never decrease, and
    rise where a name is smaller than the one before it (`descents`)."""
    if len(group) < 2:
        return True
    if len(descents) and not (group[descents + 1] > group[descents]).all():
        return False
    return bool((group[1:] >= group[:-1]).all())


def _remap(names: Sequence[str | None], labels: list[str]) -> list[int]:
    where = {name: i for i, name in enumerate(labels)}
    return [0 if x is None else where[x] for x in names]  # None: no id refers to it


def _dedupe(ptr: np.ndarray, ids: np.ndarray, cnt: np.ndarray):
    """Drop a label repeated within a row (the first occurrence stays, in column order)."""
    most = int(cnt.max())
    dup = np.zeros(len(ids), dtype=bool)
    if most <= 8:  # a few labels a row: each one against those before it, row by row
        first = ptr[:-1]
        for j in range(1, most):
            at = first[cnt > j] + j
            for i in range(j):
                dup[at] |= ids[at] == ids[at - j + i]
    else:
        row = np.repeat(np.arange(len(cnt)), cnt)
        order = np.lexsort((np.arange(len(ids)), ids, row))
        dup[order[1:]] = (row[order[1:]] == row[order[:-1]]) & (ids[order[1:]] == ids[order[:-1]])
    if not dup.any():
        return ptr, ids, cnt
    keep = ~dup
    ptr = np.concatenate([[0], np.cumsum(keep)])[ptr]  # the labels kept before each row
    return ptr, ids[keep], np.diff(ptr)
