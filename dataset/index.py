"""Indexes: the ordered list of items a Dataset draws from, and their labels.

Every kind of index (CSV/TSV, directory, tensors, ``.pt`` file, a list of
indexes) is read by :func:`open_index`, the one place that dispatches on the
kind of index, into the same :class:`Index`: per item a *source* (see
:mod:`dataset.sources`) and a tuple of label ids into ``index.labels``.

Label semantics (the same for every kind of index):

- ``index.labels`` is the sorted list of label names of the *whole* index
  (numerically when every name is an integer, so ``"10"`` comes after ``"9"``),
  computed before partitioning so a target means the same on every rank.
- An item has zero, one or several labels. Its *primary* label is its first
  (CSV column order); ``batch.target`` is the primary label's id, or -1 for an
  unlabeled item. A multi-label item belongs to every one of its labels for the
  label samplers.
- Partitioning: items are grouped by primary label (unlabeled items form one
  more group); within a group, the i-th item in index order goes to partition
  ``i % partitions``. So every item is in exactly one partition, the union of
  all partitions is the index, and each label is spread evenly over ranks.
  Index order is row order for CSV/tensors and sorted path order for folders.
- A list of indexes is a :class:`JoinedIndex`: the first gives the items, labels
  and partitions; each other index is fetched item by item alongside it, or
  drawn by its own sampler (then it is never partitioned).
"""

from __future__ import annotations

import csv
import functools
import io
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from . import sources as src
from .sources import Joined


class BadIndex(ValueError):
    """A malformed or unusable index; the message names the file and line at fault."""


class Index:
    """The items of one partition: sources, label ids, and the label names of the whole index.

    ``len(index)`` is the number of items; ``index.labels`` the sorted label names;
    ``index.source(i)`` what to fetch for item i; ``index.targets[i]`` its
    primary label id (-1: unlabeled); ``index.item_labels(i)`` all its label ids.
    """

    def __init__(
        self,
        sources: Sequence[Any],
        item_labels: Sequence[tuple[int, ...]],
        labels: Sequence[str],
        origin: str,
        names: Sequence[str] | None = None,
    ):
        if len(sources) != len(item_labels):
            raise ValueError(f"{origin}: {len(sources)} sources but {len(item_labels)} label rows")
        self.sources = sources
        self._item_labels = list(item_labels)
        self.labels: list[str] = list(labels)
        self.origin = origin
        self._names = names
        self.targets = np.fromiter(
            (lab[0] if lab else -1 for lab in self._item_labels),
            dtype=np.int64,
            count=len(self._item_labels),
        )

    def __len__(self) -> int:
        return len(self._item_labels)

    def __repr__(self) -> str:
        return f"Index({self.origin!r}, items={len(self)}, labels={len(self.labels)})"

    def source(self, i: int) -> Any:
        return self.sources[i]

    def item_labels(self, i: int) -> tuple[int, ...]:
        return self._item_labels[i]

    def name(self, i: int) -> str:
        """A human-readable name for item i (its URL or path), for logs and ``batch.urls``."""
        if self._names is not None:
            return self._names[i]
        s = self.sources[i]
        if isinstance(s, str):
            return s
        if isinstance(s, Joined):
            return " + ".join(_display(x, i) for x in s)
        return _display(s, i)

    def by_label(self) -> list[np.ndarray]:
        """Positions of the items of each label (a multi-label item is in each of its labels)."""
        members: list[list[int]] = [[] for _ in self.labels]
        for pos, labs in enumerate(self._item_labels):
            for lab in labs:
                members[lab].append(pos)
        return [np.asarray(m, dtype=np.int64) for m in members]

    def partition(self, partition: int, partitions: int) -> Index:
        """The items of `partition` (0-based) out of `partitions` (see the module docstring)."""
        if partitions < 1:
            raise ValueError(f"partitions must be >= 1, got {partitions}")
        if not 0 <= partition < partitions:
            raise ValueError(f"partition {partition} out of range for {partitions} partitions")
        if partitions == 1:
            return self
        counters: dict[int, int] = {}
        keep = []
        for pos, key in enumerate(self.targets.tolist()):
            n = counters.get(key, 0)
            counters[key] = n + 1
            if n % partitions == partition:
                keep.append(pos)
        return self.take(keep, f"{self.origin}[partition {partition}/{partitions}]")

    def take(self, positions: Sequence[int], origin: str | None = None) -> Index:
        """A new Index of the items at `positions`, with the same label names."""
        if isinstance(self.sources, torch.Tensor):
            sources: Any = self.sources[torch.as_tensor(positions, dtype=torch.long)]
        else:
            sources = [self.sources[p] for p in positions]
        names = [self._names[p] for p in positions] if self._names is not None else None
        return Index(
            sources,
            [self._item_labels[p] for p in positions],
            self.labels,
            origin or self.origin,
            names,
        )


def _display(s: Any, i: int) -> str:
    if isinstance(s, str):
        return s
    if isinstance(s, tuple) and len(s) == 3:
        return f"{s[0]}@{s[1]}+{s[2]}"
    return f"<row {i}>"


def sort_labels(names) -> list[str]:
    """Label names sorted numerically when all are integers, else as strings."""
    names = set(names)
    try:
        return sorted(names, key=int)
    except ValueError:
        return sorted(names)


# ----------------------------------------------------------------------------- dispatch


def open_index(index: Any, *, sep: str | None = None, meta: str | None = None,
               url_params: str | dict | None = None, cache: Any = None) -> Index:  # fmt: skip
    """Read any kind of index into an :class:`Index` (the whole index, unpartitioned).

    This is the single dispatch point on the kind of index: add new kinds here.
    ``cache`` (a :class:`dataset.cache.Cache`) keeps remote index files on local disk.
    """
    if isinstance(index, Index):
        return index
    if isinstance(index, torch.Tensor | dict):
        return from_tensors(index, origin="<tensor>")
    if isinstance(index, list | tuple):
        if not index:
            raise BadIndex("empty list of indexes")
        return join([open_index(i, sep=sep, meta=meta, url_params=url_params, cache=cache)
                     for i in index])  # fmt: skip
    if isinstance(index, os.PathLike):
        index = os.fspath(index)
    if not isinstance(index, str):
        raise TypeError(f"unsupported index {type(index).__name__}: expected a path, URL, "
                        "tensor, dict(x=, y=) or a list of those")  # fmt: skip
    path = src.local_path(index)
    if path is not None and os.path.isdir(path):
        return from_directory(path)
    if index.lower().endswith(".pt"):
        return from_pt(index, cache=cache)
    return from_csv(index, sep=sep, meta=meta, url_params=url_params, cache=cache)


# ----------------------------------------------------------------------------- CSV / TSV


def _meta_candidates(index: str) -> list[str]:
    """Where a meta file may sit beside `index`: ``<stem>-meta.csv`` (torch-dataset's
    name, e.g. ``train-meta.csv`` for ``train.csv``), then ``index-meta.csv``."""
    folder = src.parent_of(index)
    name = index.rsplit("/", 1)[-1].split("?", 1)[0]
    stem = name.rsplit(".", 1)[0] if "." in name else name
    names = [f"{stem}-meta.csv", "index-meta.csv"]
    return [src.resolve(folder, n) for n in dict.fromkeys(names)]


def _read_meta(index: str, meta: str | None, cache: Any = None) -> dict[str, str]:
    """The first row of the meta file beside the index (or `meta`); {} when absent."""
    if meta is not None:
        location, data = meta, src.read_bytes(meta, cache=cache)
    else:
        for location in _meta_candidates(index):
            data = src.read_bytes(location, missing_ok=True, cache=cache)
            if data is not None:
                break
    if data is None:
        return {}
    rows = list(csv.DictReader(io.StringIO(data.decode("utf-8-sig"))))
    if not rows:
        raise BadIndex(f"{location}: meta file has a header but no row")
    return {k.strip(): (v or "").strip() for k, v in rows[0].items() if k}


def from_csv(index: str, *, sep: str | None = None, meta: str | None = None,
             url_params: str | dict | None = None, cache: Any = None) -> Index:  # fmt: skip
    """A CSV/TSV index: columns ``filename``, ``label*``, optional ``offset``/``length``.

    Relative filenames join ``url_prefix`` from ``<stem>-meta.csv`` or
    ``index-meta.csv`` beside the index when present
    (columns ``url_prefix`` and optional ``url_params``), else resolve against the
    index's own folder. Absolute URLs and paths are used as they are.
    """
    try:
        data = src.read_bytes(index, cache=cache)
    except FileNotFoundError as err:
        raise FileNotFoundError(f"index not found: {index}") from err
    assert data is not None
    if sep is None:
        sep = "\t" if index.lower().endswith(".tsv") else ","
    info = _read_meta(index, meta, cache)
    prefix = info.get("url_prefix") or info.get("urlPrefix") or info.get("prefix") or ""
    params = url_params if url_params is not None else info.get("url_params") or None
    base = src.parent_of(index)

    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise BadIndex(f"{index}: not UTF-8 text ({err})") from err
    reader = csv.reader(io.StringIO(text, newline=""), delimiter=sep, strict=True)
    try:
        header = [h.strip() for h in next(reader)]
    except StopIteration:
        raise BadIndex(f"{index}: empty index (no header line)") from None
    except csv.Error as err:
        raise BadIndex(f"{index}:1: {err}") from err
    if "filename" not in header:
        raise BadIndex(f"{index}:1: no 'filename' column in header {header}")
    col_file = header.index("filename")
    label_cols = [i for i, h in enumerate(header) if h.startswith("label")]
    col_off = header.index("offset") if "offset" in header else None
    col_len = header.index("length") if "length" in header else None
    if (col_off is None) != (col_len is None):
        raise BadIndex(f"{index}:1: 'offset' and 'length' columns go together")

    sources: list[Any] = []
    raw_labels: list[list[str]] = []
    try:
        for row in reader:
            line = reader.line_num
            if not row or (len(row) == 1 and not row[0].strip()):
                continue  # blank line
            if len(row) != len(header):
                raise BadIndex(
                    f"{index}:{line}: expected {len(header)} fields {header}, got {len(row)}: {row}"
                )
            name = row[col_file].strip()
            if not name:
                raise BadIndex(f"{index}:{line}: empty filename")
            if prefix and not src.is_url(name) and not os.path.isabs(name):
                url = src.join_prefix(prefix, name)
            else:
                url = src.resolve(base, name)
            if src.is_http(url):
                url = src.add_params(url, params)
            if col_off is not None:
                try:
                    off, length = int(row[col_off]), int(row[col_len])
                except ValueError:
                    raise BadIndex(
                        f"{index}:{line}: offset/length must be integers, got "
                        f"{row[col_off]!r}/{row[col_len]!r}"
                    ) from None
                if off < 0 or length < 0:
                    raise BadIndex(f"{index}:{line}: negative offset/length")
                sources.append((url, off, length))
            else:
                sources.append(url)
            raw_labels.append([row[c].strip() for c in label_cols if row[c].strip()])
    except csv.Error as err:
        raise BadIndex(f"{index}:{reader.line_num}: {err}") from err
    if not sources:
        raise BadIndex(f"{index}: empty index (a header but no items)")
    return _labelled(sources, raw_labels, index)


def _labelled(sources, raw_labels: list[list[str]], origin: str, names=None) -> Index:
    labels = sort_labels(lab for labs in raw_labels for lab in labs)
    ids = {name: i for i, name in enumerate(labels)}
    # dict.fromkeys drops a label repeated in two columns of one row, keeping order
    item_labels = [tuple(ids[lab] for lab in dict.fromkeys(labs)) for labs in raw_labels]
    return Index(sources, item_labels, labels, origin, names)


# ----------------------------------------------------------------------------- directory


def from_directory(root: str) -> Index:
    """Files under sub-folders are labelled by the (top) sub-folder name; top files unlabeled.

    Hidden files and folders (leading dot) are skipped; paths are sorted so every
    machine sees the same order.
    """
    root = os.path.abspath(root)
    found: list[tuple[str, str | None]] = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        rel_dir = os.path.relpath(dirpath, root)
        label = None if rel_dir == "." else rel_dir.split(os.sep)[0]
        for f in filenames:
            if not f.startswith("."):
                found.append((os.path.join(rel_dir, f) if label else f, label))
    if not found:
        raise BadIndex(f"{root}: empty directory index (no visible files)")
    found.sort()
    sources = [os.path.join(root, rel) for rel, _ in found]
    return _labelled(sources, [[lab] if lab else [] for _, lab in found], root)


# ----------------------------------------------------------------------------- tensors


def from_tensors(data: torch.Tensor | dict, origin: str) -> Index:
    """Items are rows of a tensor, or of ``x`` in ``dict(x=..., y=...)`` (y: one label per row)."""
    if isinstance(data, torch.Tensor):
        x, y = data, None
    else:
        if "x" not in data:
            raise BadIndex(f"{origin}: a tensor index dict needs an 'x' entry, has {list(data)}")
        x, y = data["x"], data.get("y")
    if not isinstance(x, torch.Tensor) or x.dim() == 0 or len(x) == 0:
        raise BadIndex(f"{origin}: 'x' must be a non-empty tensor with one item per row")
    if y is None:
        return Index(x, [()] * len(x), [], origin)
    y = torch.as_tensor(y)
    if y.dim() != 1 or len(y) != len(x):
        raise BadIndex(
            f"{origin}: 'y' must be 1-D with one label per row of 'x' ({len(x)}), "
            f"got shape {tuple(y.shape)}"
        )
    if y.is_floating_point():
        raise BadIndex(f"{origin}: 'y' must hold integer labels, got {y.dtype}")
    values = sorted(set(y.tolist()))
    ids = {v: i for i, v in enumerate(values)}
    return Index(x, [(ids[v],) for v in y.tolist()], [str(v) for v in values], origin)


def from_pt(location: str, cache: Any = None) -> Index:
    """A ``.pt`` file (local or remote) holding a tensor or ``dict(x=..., y=...)``."""
    try:
        data = src.read_bytes(location, cache=cache)
    except FileNotFoundError as err:
        raise FileNotFoundError(f"index not found: {location}") from err
    try:
        obj = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as err:
        raise BadIndex(f"{location}: not a loadable tensor file ({err})") from err
    if not isinstance(obj, torch.Tensor | dict):
        raise BadIndex(f"{location}: expected a tensor or dict(x=, y=), got {type(obj)}")
    return from_tensors(obj, location)


# ----------------------------------------------------------------------------- joined


def join(indexes: list[Index]) -> Index:
    """Several indexes joined item by item (a :class:`JoinedIndex`); one index stays as it is."""
    if len(indexes) == 1:
        return indexes[0]
    return JoinedIndex(indexes)


class JoinedIndex(Index):
    """A list of indexes joined item by item; the first (the *driver*) gives the items.

    ``len()``, ``labels``, ``targets`` and partitions come from the first index:
    item i is item ``positions[i]`` of the first. Each other member is either
    *aligned* (item i fetches item ``positions[i]`` of it too, so it must have
    the first's length and is partitioned in lockstep with it) or *drawn* by its
    own sampler (see ``sampler=[...]`` in :class:`dataset.batcher.SampledBatcher`).
    Which is chosen per batcher, so ``members`` stay whole: a drawn member is
    never partitioned, every rank draws from all of it (draws are with
    replacement, so partitioning would add nothing, and a 3-item index could not
    be split over 8 ranks anyway).

    ``source(i)``/``name(i)`` join item i of the members that have the first's
    length (the ones that can be aligned), one per member, in order.
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
        self._item_labels = [first.item_labels(p) for p in self.positions.tolist()]
        self.targets = first.targets[self.positions]
        self._names = None
        # members that item i of the first can line up with
        self._alignable = [m for m in self.members if len(m) == len(first)]

    def __repr__(self) -> str:
        return f"JoinedIndex({self.origin!r}, items={len(self)}, members={len(self.members)})"

    @functools.cached_property
    def sources(self) -> list[Joined]:  # type: ignore[override]
        return [self.source(i) for i in range(len(self))]

    def source(self, i: int) -> Joined:
        p = int(self.positions[i])
        return Joined(m.source(p) for m in self._alignable)

    def name(self, i: int) -> str:
        p = int(self.positions[i])
        return " + ".join(m.name(p) for m in self._alignable)

    def take(self, positions: Sequence[int], origin: str | None = None) -> JoinedIndex:
        """The items at `positions`; members stay whole (only the driver's positions change)."""
        picked = self.positions[np.asarray(positions, dtype=np.int64)]
        return JoinedIndex(self.members, picked, origin or self.origin)
