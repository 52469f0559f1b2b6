"""Indexes: the ordered list of examples a Dataset draws from, and their labels.

Every kind of index (CSV/TSV, directory, tensors, ``.pt`` file, a list of
indexes) is read by :func:`open_index`, the one place that dispatches on the
kind of index, into the same :class:`Index`: rows (per row of the file a
*source*, see :mod:`dataset.sources`, and its label ids into ``index.labels``)
and the *examples* drawn from them.

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

import csv
import functools
import io
import logging
import os
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch

from . import sources as src
from .errors import BadIndex, IndexNotFound
from .fetch import Fetcher, read_bytes
from .sources import Joined

__all__ = ["BadIndex", "Index", "JoinedIndex", "open_index"]

log = logging.getLogger(__name__)

# How an index partitions: by label (CSV, folders) or by row (tensors).
BY_LABEL, BY_ROW = "label", "row"


class Index:
    """The examples of one partition: what to fetch, their targets, and the label names.

    ``len(index)`` is the number of examples; ``index.labels`` the sorted label
    names; ``index.source(i)`` what to fetch for example i; ``index.targets[i]``
    the label id it stands for (-1: unlabeled); ``index.item_labels(i)`` all
    label ids of its item; ``index.rows[i]`` the item's row in the file.

    Built from per-row data (``sources``, ``item_labels``, ``names``), shared by
    every partition taken from it, and per-example arrays ``rows`` and
    ``targets`` (by default one example per row, standing for its first label).
    """

    def __init__(
        self,
        sources: Sequence[Any],
        item_labels: Sequence[tuple[int, ...]],
        labels: Sequence[str],
        origin: str,
        names: Sequence[str] | None = None,
        *,
        rows: np.ndarray | None = None,
        targets: np.ndarray | None = None,
        multi_hot: bool = False,
        split: str = BY_LABEL,
    ):
        if len(sources) != len(item_labels):
            raise ValueError(f"{origin}: {len(sources)} sources but {len(item_labels)} label rows")
        self.row_sources = sources
        self._row_labels = list(item_labels)
        self._row_names = names
        self.labels: list[str] = list(labels)
        self.origin = origin
        self.multi_hot = multi_hot
        self.split = split
        if rows is None:
            rows = np.arange(len(self._row_labels), dtype=np.int64)
        if targets is None:
            firsts = (self._row_labels[r][0] if self._row_labels[r] else -1 for r in rows.tolist())
            targets = np.fromiter(firsts, dtype=np.int64, count=len(rows))
        self.rows = np.asarray(rows, dtype=np.int64)
        self.targets = np.asarray(targets, dtype=np.int64)
        if len(self.rows) != len(self.targets):
            raise ValueError(f"{origin}: {len(self.rows)} rows but {len(self.targets)} targets")

    def __len__(self) -> int:
        return len(self.rows)

    def __repr__(self) -> str:
        return f"Index({self.origin!r}, examples={len(self)}, labels={len(self.labels)})"

    @property
    def num_rows(self) -> int:
        """Rows (items) of the whole file this index was read from."""
        return len(self._row_labels)

    @functools.cached_property
    def _lists(self) -> tuple[list[int], list[int]]:
        # python ints index python lists ~10x faster than numpy scalars (the dispatch loop)
        return self.rows.tolist(), self.targets.tolist()

    def _row(self, i: int) -> int:
        rows = self._lists[0]
        if not 0 <= i < len(rows):
            raise IndexError(f"{self.origin}: example {i} out of range [0, {len(rows)})")
        return rows[i]

    def row(self, i: int) -> int:
        """The row (in the file) of example i's item."""
        return self._row(i)

    def source(self, i: int) -> Any:
        """What to fetch for example i."""
        return self.row_sources[self._row(i)]

    def target(self, i: int) -> int:
        """The label id example i stands for (-1: unlabeled)."""
        self._row(i)
        return self._lists[1][i]

    def item_labels(self, i: int) -> tuple[int, ...]:
        """Every label id of example i's item."""
        return self._row_labels[self._row(i)]

    def name(self, i: int) -> str:
        """A human-readable name for example i (its URL or path), for logs and ``batch.urls``."""
        return self.row_name(self._row(i))

    def row_source(self, r: int) -> Any:
        return self.row_sources[r]

    def row_name(self, r: int) -> str:
        if self._row_names is not None:
            return self._row_names[r]
        return _display(self.row_sources[r], r)

    @property
    def sources(self) -> Any:
        """What to fetch for every example, in order (a list, or a tensor of rows)."""
        if isinstance(self.row_sources, torch.Tensor):
            return self.row_sources[torch.from_numpy(self.rows)]
        return [self.row_sources[r] for r in self._lists[0]]

    def by_label(self) -> list[np.ndarray]:
        """Positions of the examples of each label (label samplers draw from these).

        With ``multi_hot`` an example (an item) is in every one of its labels.
        """
        if not self.multi_hot:
            order = np.argsort(self.targets, kind="stable")
            bounds = np.searchsorted(self.targets[order], np.arange(len(self.labels) + 1))
            return [order[bounds[k] : bounds[k + 1]] for k in range(len(self.labels))]
        members: list[list[int]] = [[] for _ in self.labels]
        for pos in range(len(self)):
            for lab in self.item_labels(pos):
                members[lab].append(pos)
        return [np.asarray(m, dtype=np.int64) for m in members]

    def partition(self, partition: int, partitions: int) -> Index:
        """The examples of `partition` (0-based) out of `partitions` (see the module docstring)."""
        if partitions < 1:
            raise ValueError(f"partitions must be >= 1, got {partitions}")
        if not 0 <= partition < partitions:
            raise ValueError(f"partition {partition} out of range for {partitions} partitions")
        if partitions == 1:
            return self
        return self.take(
            partition_positions(self.targets, partition, partitions, self.split),
            f"{self.origin}[partition {partition}/{partitions}]",
        )

    def take(self, positions: Sequence[int] | np.ndarray, origin: str | None = None) -> Index:
        """A new Index of the examples at `positions`, sharing this one's rows and labels."""
        positions = np.asarray(positions, dtype=np.int64)
        return Index(
            self.row_sources,
            self._row_labels,
            self.labels,
            origin or self.origin,
            self._row_names,
            rows=self.rows[positions],
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
    order = np.argsort(targets, kind="stable")
    sorted_targets = targets[order]
    starts = np.searchsorted(sorted_targets, sorted_targets, side="left")
    k = np.arange(1, len(order) + 1) - starts  # 1-based rank within the label
    return np.sort(order[k % partitions == partition])


def _display(s: Any, i: int) -> str:
    if isinstance(s, str):
        return s
    if isinstance(s, tuple) and len(s) == 3:
        return f"{s[0]}@{s[1]}+{s[2]}"
    if isinstance(s, Joined):
        return " + ".join(_display(x, i) for x in s)
    return f"<row {i}>"


def sort_labels(names) -> list[str]:
    """Label names sorted numerically when all are integers, else as strings."""
    names = set(names)
    try:
        return sorted(names, key=int)
    except ValueError:
        return sorted(names)


def labelled(
    sources: Sequence[Any],
    raw_labels: list[list[str]],
    origin: str,
    sort_keys: Sequence[Any],
    names: Sequence[str] | None = None,
    multi_hot: bool = False,
) -> Index:
    """An Index of rows with label names, in torch-dataset's example order.

    Each row with k labels becomes k examples (one with ``multi_hot``);
    examples are ordered by label (unlabeled last), then by ``sort_keys[row]``
    (the filename, offset, length), then by row.
    """
    labels = sort_labels(lab for labs in raw_labels for lab in labs)
    ids = {name: i for i, name in enumerate(labels)}
    # dict.fromkeys drops a label repeated in two columns of one row, keeping order
    row_labels = [tuple(ids[lab] for lab in dict.fromkeys(labs)) for labs in raw_labels]
    ex_rows: list[int] = []
    ex_targets: list[int] = []
    for r, labs in enumerate(row_labels):
        if multi_hot or not labs:
            ex_rows.append(r)
            ex_targets.append(labs[0] if labs else -1)
        else:
            ex_rows.extend([r] * len(labs))
            ex_targets.extend(labs)
    rank = np.empty(len(row_labels), dtype=np.int64)
    rank[sorted(range(len(row_labels)), key=sort_keys.__getitem__)] = np.arange(len(row_labels))
    rows = np.asarray(ex_rows, dtype=np.int64)
    targets = np.asarray(ex_targets, dtype=np.int64)
    group = np.where(targets < 0, len(labels), targets)  # unlabeled after every label
    order = np.lexsort((rank[rows], group))
    return Index(
        sources,
        row_labels,
        labels,
        origin,
        names,
        rows=rows[order],
        targets=targets[order],
        multi_hot=multi_hot,
    )


# ----------------------------------------------------------------------------- dispatch


def open_index(
    index: Any,
    *,
    sep: str | None = None,
    meta: str | None = None,
    url_params: str | dict | None = None,
    cache: Any = None,
    multi_hot: bool = False,
    allow_schemes: Iterable[str] = (),
    fetch: dict | None = None,
) -> Index:
    """Read any kind of index into an :class:`Index` (the whole index, unpartitioned).

    This is the single dispatch point on the kind of index: add new kinds here.
    ``cache`` (a :class:`dataset.cache.Cache`) keeps remote index files on local
    disk; ``fetch`` holds the read policy (``timeout``, ``retries``...), the
    same as for items; ``allow_schemes`` lets a remote CSV index name items on
    other kinds of store (see :func:`dataset.sources.check_scheme`).
    """
    with Fetcher(pool_size=4, **(fetch or {})) as fetcher:
        reader = _Reader(
            sep=sep,
            meta=meta,
            url_params=url_params,
            cache=cache,
            multi_hot=multi_hot,
            allow=frozenset(s.lower() for s in allow_schemes),
            fetcher=fetcher,
        )
        return reader.open(index)


class _Reader:
    """The options of one :func:`open_index` call, and the fetcher its reads share."""

    def __init__(self, **kw: Any):
        self.__dict__.update(kw)

    def open(self, index: Any) -> Index:
        if isinstance(index, Index):
            return index
        if isinstance(index, torch.Tensor | dict):
            return from_tensors(index, origin="<tensor>")
        if isinstance(index, list | tuple):
            if not index:
                raise BadIndex("empty list of indexes")
            return join([self.open(i) for i in index])
        if isinstance(index, os.PathLike):
            index = os.fspath(index)
        if not isinstance(index, str):
            raise TypeError(
                f"unsupported index {type(index).__name__}: expected a path, URL, "
                "tensor, dict(x=, y=) or a list of those"
            )
        path = src.local_path(index)
        if path is not None and os.path.isdir(path):
            return from_directory(path, multi_hot=self.multi_hot)
        if index.lower().endswith(".pt"):
            return from_pt(index, cache=self.cache, fetcher=self.fetcher)
        return from_csv(
            index,
            sep=self.sep,
            meta=self.meta,
            url_params=self.url_params,
            cache=self.cache,
            multi_hot=self.multi_hot,
            allow_schemes=self.allow,
            fetcher=self.fetcher,
        )


# ----------------------------------------------------------------------------- CSV / TSV

# Columns of a meta file we know by name; any other single column is the URL prefix.
PREFIX_COLUMNS = ("url_prefix", "urlPrefix")
PARAMS_COLUMNS = ("url_params", "urlParams")


def _meta_candidates(index: str) -> list[str]:
    """Where a meta file may sit beside `index`: ``<stem>-meta.csv`` (torch-dataset's
    name, e.g. ``train-meta.csv`` for ``train.csv``), then ``index-meta.csv``."""
    folder = src.parent_of(index)
    name = index.rsplit("/", 1)[-1].split("?", 1)[0]
    stem = name.rsplit(".", 1)[0] if "." in name else name
    names = [f"{stem}-meta.csv", "index-meta.csv"]
    return [src.resolve(folder, n) for n in dict.fromkeys(names)]


def read_meta(
    index: str, meta: str | None, cache: Any = None, fetcher: Fetcher | None = None
) -> tuple[str, str]:
    """``(url_prefix, url_params)`` from the meta file beside the index (or `meta`).

    torch-dataset's meta file is one column of any name (``hostname``,
    ``prefix``...) with the URL prefix on line 2, taken as it is. Ours may
    instead have ``url_prefix`` and ``url_params`` columns. No meta file: ("", "").
    """
    if meta is not None:
        location, data = meta, read_bytes(meta, cache=cache, fetcher=fetcher)
    else:
        for location in _meta_candidates(index):
            data = read_bytes(location, missing_ok=True, cache=cache, fetcher=fetcher)
            if data is not None:
                break
    if data is None:
        return "", ""
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise BadIndex(f"{location}: meta file is not UTF-8 text ({err})") from err
    lines = [line for line in text.splitlines() if line.strip()]
    if len(lines) < 2:
        raise BadIndex(f"{location}: a meta file holds a header and, on line 2, the URL prefix")
    rows = list(csv.reader(lines[:2]))
    header = [h.strip() for h in rows[0]]
    values = dict(zip(header, (v.strip() for v in rows[1]), strict=False))
    known = [h for h in header if h in PREFIX_COLUMNS + PARAMS_COLUMNS]
    if known:
        for h in header:
            if h not in known:
                log.warning("%s: unknown meta column %r (ignored)", location, h)
        prefix = next((values.get(h, "") for h in PREFIX_COLUMNS if h in values), "")
        params = next((values.get(h, "") for h in PARAMS_COLUMNS if h in values), "")
        return prefix, params
    if len(header) == 1:  # torch-dataset: line 2 is the prefix, whatever the column's name
        value = rows[1][0] if len(rows[1]) == 1 else lines[1]  # a prefix holding a comma
        return value.strip(), ""
    raise BadIndex(
        f"{location}: cannot tell the URL prefix among columns {header}; a meta file is one "
        "column (any name) with the prefix on line 2, or url_prefix and url_params columns"
    )


class _Columns:
    """Where the known columns of a CSV header are; unknown ones are logged and ignored."""

    def __init__(self, header: list[str], where: str):
        self.file: int | None = None
        self.offset: int | None = None
        self.length: int | None = None
        self.labels: list[int] = []
        for pos, name in enumerate(header):
            if name in ("filename", "offset", "length"):
                if getattr(self, "file" if name == "filename" else name) is not None:
                    raise BadIndex(f"{where}:1: more than one {name!r} column")
                setattr(self, "file" if name == "filename" else name, pos)
            elif name.startswith("label"):
                self.labels.append(pos)
            else:
                log.warning("%s:1: unknown column %r (ignored)", where, name)
        if self.file is None:
            raise BadIndex(f"{where}:1: no 'filename' column in header {header}")
        if (self.offset is None) != (self.length is None):
            raise BadIndex(f"{where}:1: 'offset' and 'length' columns go together")
        # a row must reach every column it cannot do without; labels may be left out
        self.needed = 1 + max(p for p in (self.file, self.offset, self.length) if p is not None)


def from_csv(
    index: str,
    *,
    sep: str | None = None,
    meta: str | None = None,
    url_params: str | dict | None = None,
    cache: Any = None,
    multi_hot: bool = False,
    allow_schemes: frozenset[str] = frozenset(),
    fetcher: Fetcher | None = None,
) -> Index:
    """A CSV/TSV index: columns ``filename``, ``label*``, optional ``offset``/``length``.

    Rows may stop after their last label (ragged rows). Relative filenames join
    the URL prefix of the meta file beside the index (see :func:`read_meta`)
    when there is one, else resolve against the index's own folder. Absolute
    URLs and paths are used as they are, within :func:`dataset.sources.check_scheme`.
    """
    try:
        data = read_bytes(index, cache=cache, fetcher=fetcher)
    except IndexNotFound as err:
        raise IndexNotFound(f"index not found: {err}") from None
    assert data is not None
    if sep is None:
        sep = "\t" if index.lower().split("?", 1)[0].endswith(".tsv") else ","
    prefix, meta_params = read_meta(index, meta, cache, fetcher)
    query = src.query_string(url_params if url_params is not None else meta_params)
    base = src.parent_of(index)
    remote = src.scheme(index) != "file"

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
    cols = _Columns(header, index)

    sources: list[Any] = []
    raw_labels: list[list[str]] = []
    keys: list[tuple] = []
    try:
        for row in reader:
            line = reader.line_num
            if not row or (len(row) == 1 and not row[0].strip()):
                continue  # blank line
            if len(row) > len(header):
                raise BadIndex(
                    f"{index}:{line}: {len(row)} fields for a header of {len(header)} "
                    f"{header}: {row} (quote a field that holds {sep!r})"
                )
            if len(row) < cols.needed:
                raise BadIndex(f"{index}:{line}: missing fields {header[len(row) :]}: {row}")
            name = row[cols.file].strip()
            if not name:
                raise BadIndex(f"{index}:{line}: empty filename")
            if prefix and not src.is_url(name) and not os.path.isabs(name):
                url = src.join_prefix(prefix, name)
            else:
                url = src.resolve(base, name)
            if src.is_http(url):
                url = src.add_params(url, query)
            if remote:
                refused = src.check_scheme(index, url, allow_schemes)
                if refused:
                    raise BadIndex(f"{index}:{line}: {refused}")
            if cols.offset is not None:
                try:
                    off, length = int(row[cols.offset]), int(row[cols.length])
                except ValueError:
                    raise BadIndex(
                        f"{index}:{line}: offset/length must be integers, got "
                        f"{row[cols.offset]!r}/{row[cols.length]!r}"
                    ) from None
                if off < 0 or length < 0:
                    raise BadIndex(f"{index}:{line}: negative offset/length")
                sources.append((url, off, length))
                keys.append((name, off, length))
            else:
                sources.append(url)
                keys.append((name,))
            raw_labels.append([row[c].strip() for c in cols.labels if c < len(row)])
            raw_labels[-1] = [lab for lab in raw_labels[-1] if lab]
    except csv.Error as err:
        raise BadIndex(f"{index}:{reader.line_num}: {err}") from err
    if not sources:
        raise BadIndex(f"{index}: empty index (a header but no items)")
    return labelled(sources, raw_labels, index, keys, multi_hot=multi_hot)


# ----------------------------------------------------------------------------- directory


def from_directory(root: str, multi_hot: bool = False) -> Index:
    """Files under sub-folders are labelled by the (top) sub-folder name; top files unlabeled.

    Hidden files and folders (leading dot) are skipped; examples are in label,
    then path order, so every machine sees the same order.
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
    raw = [[lab] if lab else [] for _, lab in found]
    return labelled(sources, raw, root, [rel for rel, _ in found], multi_hot=multi_hot)


# ----------------------------------------------------------------------------- tensors


def from_tensors(data: torch.Tensor | dict, origin: str) -> Index:
    """Items are rows of a tensor, or of ``x`` in ``dict(x=..., y=...)`` (y: one label per row).

    As torch-dataset's IndexTensor: examples in row order, row j in partition
    ``j % partitions``.
    """
    if isinstance(data, torch.Tensor):
        x, y = data, None
    else:
        if "x" not in data:
            raise BadIndex(f"{origin}: a tensor index dict needs an 'x' entry, has {list(data)}")
        x, y = data["x"], data.get("y")
    if not isinstance(x, torch.Tensor) or x.dim() == 0 or len(x) == 0:
        raise BadIndex(f"{origin}: 'x' must be a non-empty tensor with one item per row")
    if y is None:
        return Index(x, [()] * len(x), [], origin, split=BY_ROW)
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
    return Index(x, [(ids[v],) for v in y.tolist()], [str(v) for v in values], origin, split=BY_ROW)


# torch.load(weights_only=True) could run code before 2.6 (CVE-2025-32434)
SAFE_TORCH_LOAD = (2, 6)


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split("+", 1)[0].split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def from_pt(location: str, cache: Any = None, fetcher: Fetcher | None = None) -> Index:
    """A ``.pt`` file (local or remote) holding a tensor or ``dict(x=..., y=...)``.

    Loaded with ``weights_only=True`` (tensors and plain containers only, no
    code). A remote one needs a torch whose ``weights_only`` loading is safe
    (2.6 or later); with an older torch it is refused.
    """
    if src.local_path(location) is None and _torch_version() < SAFE_TORCH_LOAD:
        raise BadIndex(
            f"{location}: a remote .pt index needs torch >= 2.6, whose weights_only loading "
            f"cannot run code (this is torch {torch.__version__}); upgrade torch, or download "
            "the file, check it and open the local copy"
        )
    try:
        data = read_bytes(location, cache=cache, fetcher=fetcher)
    except IndexNotFound as err:
        raise IndexNotFound(f"index not found: {err}") from None
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
        self.rows = first.rows[self.positions]
        self.targets = first.targets[self.positions]
        self._row_labels = first._row_labels
        # members whose rows line up with the first's
        self._alignable = [m for m in self.members if m.num_rows == first.num_rows]

    def __repr__(self) -> str:
        return f"JoinedIndex({self.origin!r}, examples={len(self)}, members={len(self.members)})"

    @property
    def sources(self) -> list[Joined]:  # type: ignore[override]
        return [self.source(i) for i in range(len(self))]

    def source(self, i: int) -> Joined:
        r = self._row(i)
        return Joined(m.row_source(r) for m in self._alignable)

    def name(self, i: int) -> str:
        r = self._row(i)
        return " + ".join(m.row_name(r) for m in self._alignable)

    def take(self, positions: Sequence[int] | np.ndarray, origin: str | None = None):
        """The examples at `positions`; members stay whole (only the driver's positions change)."""
        picked = self.positions[np.asarray(positions, dtype=np.int64)]
        return JoinedIndex(self.members, picked, origin or self.origin)
