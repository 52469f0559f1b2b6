"""The kinds of index, and :func:`open_index`, the one dispatch on them.

Each kind is a *matcher* (does this argument name an index of mine?) and an
*opener* (read it); :func:`open_index` asks the registered kinds in order and
opens with the first that matches. The kinds, in that order:

    index       an Index (or part source) already opened: as it is
    tensor      a tensor, or dict(x=, y=)                  -> Index (rows in memory)
    list        a list of indexes, joined item by item     -> JoinedIndex
    parts       a folder/URL/brace pattern of part files   -> dataset.parts.PartIndex
    directory   a local folder (labels: sub-folder names)  -> Index
    pt          a .pt file, local or remote                -> Index
    csv         anything else: a CSV/TSV path or URL       -> Index

:func:`register_index_kind` adds one (before another, or before ``csv``, the
catch-all). An opener returns an :class:`dataset.index.Index` or a *part
source*, whose own contract is written in :mod:`dataset.parts`.
"""

from __future__ import annotations

import io
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..errors import BadIndex, IndexNotFound
from ..fetch import sources as src
from ..fetch.cache import disk_cache
from ..fetch.fetcher import Fetcher, read_bytes
from ..options import Options, split
from .csv.reader import from_csv, local_identity, read_meta
from .joined import join
from .parts import PartIndex, is_part_source, open_parts
from .rows import NameRows, Resolver, RowLabels, TensorRows
from .table import BY_ROW, Index, labelled

log = logging.getLogger("distlearn.dataset.index")

__all__ = ["IndexKind", "Opening", "kinds", "open_index", "register_index_kind"]


@dataclass
class Opening:
    """What an opener gets: the option groups, one fetcher for every read, the index cache."""

    options: Options
    fetcher: Fetcher
    cache: Any = None  # a dataset.cache.Cache for index files (cache_index=True), or None

    def open(self, index: Any) -> Any:
        """Open `index` with the first kind that matches it."""
        if isinstance(index, os.PathLike):
            index = os.fspath(index)
        for kind in _KINDS:
            if kind.matches(index, self):
                return kind.open(index, self)
        raise TypeError(
            f"unsupported index {type(index).__name__}: expected a path, URL, "
            "tensor, dict(x=, y=) or a list of those"
        )


@dataclass(frozen=True)
class IndexKind:
    """A kind of index: ``matches(index, opening) -> bool``, ``open(index, opening)``."""

    name: str
    matches: Callable[[Any, Opening], bool]
    open: Callable[[Any, Opening], Any]


_KINDS: list[IndexKind] = []


def register_index_kind(
    name: str,
    matches: Callable[[Any, Opening], bool],
    open: Callable[[Any, Opening], Any],
    before: str = "csv",
) -> None:
    """Add a kind of index, asked before the kind named `before` (default: the CSV catch-all)."""
    names = [k.name for k in _KINDS]
    if name in names:
        raise ValueError(f"index kind {name!r} is already registered")
    at = names.index(before) if before in names else len(_KINDS)
    _KINDS.insert(at, IndexKind(name, matches, open))


def kinds() -> list[str]:
    """The registered kinds, in the order they are asked."""
    return [k.name for k in _KINDS]


def open_index(index: Any, *, options: Options | None = None, **flat: Any) -> Any:
    """Read any kind of index (the whole index, unpartitioned).

    Options come as typed groups (`options`) or flat keywords: the index
    group (``sep``, ``meta``, ``url_params``, ``multi_hot``, ``allow_schemes``,
    ``cache_index``), the read policy (``timeout``, ``retries``...), the
    cache (``cache_dir``...) and, for part files, the part options.
    """
    if options is None:
        options = split("open_index()", flat, ("index", "fetch", "cache", "parts"))
    elif flat:
        options = options.update("open_index()", flat, ("index", "fetch", "cache", "parts"))
    cache = disk_cache(options.cache) if options.index.cache_index else None
    with Fetcher(pool_size=4, **options.fetch.fetcher_kwargs()) as fetcher:
        return Opening(options, fetcher, cache).open(index)


def _is_path(index: Any) -> bool:
    return isinstance(index, str)


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
    n = len(x)
    rows = np.arange(n, dtype=np.int64)
    if y is None:
        no = RowLabels(np.zeros(n + 1, dtype=np.int64), np.empty(0, dtype=np.int64))
        targets = np.full(n, -1, dtype=np.int64)
        return Index(TensorRows(x), no, [], origin, rows=rows, targets=targets, split=BY_ROW)
    y = torch.as_tensor(y)
    if y.dim() != 1 or len(y) != n:
        raise BadIndex(
            f"{origin}: 'y' must be 1-D with one label per row of 'x' ({n}), "
            f"got shape {tuple(y.shape)}"
        )
    if y.is_floating_point():
        raise BadIndex(f"{origin}: 'y' must hold integer labels, got {y.dtype}")
    values, ids = np.unique(y.numpy(), return_inverse=True)
    ids = ids.astype(np.int64)
    return Index(TensorRows(x), RowLabels.single(ids), [str(v) for v in values.tolist()], origin,
                 rows=rows, targets=ids, split=BY_ROW)  # fmt: skip


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


# ----------------------------------------------------------------------------- directory


def from_directory(root: str, multi_hot: bool = False) -> Index:
    """Files under sub-folders are labelled by the (top) sub-folder name; top files unlabeled.

    Hidden files and folders (leading dot) are skipped; examples are in label,
    then path order, so every machine sees the same order. Symbolic links are
    followed, as torchvision's ImageFolder follows them (a class may be a link, two
    may share a folder), except a link back to a folder above it: a loop, skipped
    with a warning. Names that are not UTF-8 are kept as the file system gives them
    (``os.fsdecode``: undecodable bytes as surrogates), so every file is found and
    opened, as ``os.walk`` and ``open`` find them.
    """
    root = os.path.abspath(root)
    found: list[tuple[str, str | None]] = []
    # each folder walked: the (device, inode) of it and of the folders above it
    above = {root: frozenset([_identity(root)])}

    def unreadable(err: OSError) -> None:
        # os.walk skips a folder it cannot list: a whole label (or part of one) would
        # vanish from the index, and the label ids after it shift.
        raise BadIndex(f"{err.filename}: cannot list this folder of the index ({err.strerror})")

    for dirpath, dirnames, filenames in os.walk(root, onerror=unreadable, followlinks=True):
        keep = []
        for d in dirnames:
            if d.startswith("."):
                continue
            path = os.path.join(dirpath, d)
            key = _identity(path)
            if key is not None and key in above[dirpath]:  # (os.walk: round until ELOOP)
                log.warning("%s: a link to a folder above it (a loop); not walked", path)
                continue
            above[path] = above[dirpath] | {key}
            keep.append(d)
        dirnames[:] = keep
        rel_dir = os.path.relpath(dirpath, root)
        label = None if rel_dir == "." else rel_dir.split(os.sep)[0]
        for f in filenames:
            if not f.startswith("."):
                found.append((os.path.join(rel_dir, f) if label else f, label))
    if not found:
        raise BadIndex(f"{root}: empty directory index (no visible files)")
    found.sort()
    names = [os.fsencode(rel) for rel, _ in found]
    size = np.asarray([len(n) for n in names], dtype=np.int64)
    buf = np.frombuffer(b"".join(names), dtype=np.uint8)
    table = NameRows(buf, np.cumsum(size) - size, size, Resolver(root + os.sep))
    distinct = sorted({lab for _, lab in found if lab})
    where = {lab: i for i, lab in enumerate(distinct)}
    ids = np.asarray([where[lab] for _, lab in found if lab], dtype=np.int64)
    ptr = np.zeros(len(found) + 1, dtype=np.int64)
    np.cumsum([lab is not None for _, lab in found], out=ptr[1:])
    return labelled(table, ptr, ids, distinct, root, multi_hot=multi_hot)


def _identity(path: str) -> tuple[int, int] | None:
    """A folder's (device, inode), its links followed; None where it cannot be read."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


# ----------------------------------------------------------------------------- CSV


# The parsed form of a CSV index in the cache: bumped when the layout changes.
_FORMAT = b"DLIX0002"
_ALIGN = 64


def _csv(index: str, opening: Opening) -> Index:
    opt = opening.options.index
    kw = dict(sep=opt.sep, meta=opt.meta, url_params=opt.url_params, cache=opening.cache,
              multi_hot=opt.multi_hot, allow_schemes=frozenset(opt.allow_schemes),
              fetcher=opening.fetcher)  # fmt: skip
    if opening.cache is None:
        return from_csv(index, **kw)
    return _cached_csv(index, opening, kw)


def _cached_csv(index: str, opening: Opening, kw: dict) -> Index:
    """A CSV index parsed once per host: kept in the cache as one file, memory-mapped.

    Every rank of a host maps the same file, so they share one copy of the
    index. The key holds what identifies the file's version (a local file's
    path, size, mtime and inode; for a remote file, the cache entry of its
    bytes) and every option that changes what is parsed.
    """
    cache = opening.cache
    path = src.local_path(index)
    if path is not None:
        identity = local_identity(path)
    else:
        if index not in cache:  # the bytes, fetched (and kept) once
            read_bytes(index, cache=cache, fetcher=opening.fetcher)
        identity = local_identity(str(cache.path(index)))
    if identity is None:
        return from_csv(index, **kw)  # a missing file: its error
    prefix, params = read_meta(index, kw["meta"], cache, opening.fetcher)
    key = ("parsed-index", _FORMAT.decode(), index, identity, kw["sep"], prefix, params,
           repr(kw["url_params"]), kw["multi_hot"], sorted(kw["allow_schemes"]))  # fmt: skip
    view = cache.map_fill(key, lambda: _pack(from_csv(index, **kw)))
    return _unpack(view)


def _pack(ix: Index) -> list:
    """An Index of named rows as buffers: a JSON header, then each array, aligned."""
    table: NameRows = ix.table
    labels = ix.row_labels  # (no "ptr": one label a row)
    ptr = {} if labels.one_a_row else {"ptr": labels.ptr}
    arrays = dict(table.arrays(), **ptr, ids=labels.ids, rows=ix.rows, targets=ix.targets)
    meta: dict[str, Any] = {
        "labels": ix.labels,
        "origin": ix.origin,
        "multi_hot": ix.multi_hot,
        "label_order": ix.label_order,
        "resolver": table.resolver.state(),
        "arrays": {},
    }
    at = 0  # where each array starts, after the header
    for name, a in arrays.items():
        meta["arrays"][name] = [a.dtype.str, len(a), at]
        at += -(-a.nbytes // _ALIGN) * _ALIGN
    head = json.dumps(meta).encode()
    first = _FORMAT + len(head).to_bytes(8, "little") + head
    out: list = [first + bytes(-len(first) % _ALIGN)]
    for a in arrays.values():
        data = np.ascontiguousarray(a)
        out += [memoryview(data).cast("B"), bytes(-data.nbytes % _ALIGN)]
    return out


def _unpack(view: memoryview) -> Index:
    """The Index of a :func:`_pack` buffer (memory-mapped: its arrays are views of it)."""
    if bytes(view[: len(_FORMAT)]) != _FORMAT:
        raise BadIndex("cached index: unknown format")
    n = int.from_bytes(view[len(_FORMAT) : len(_FORMAT) + 8], "little")
    meta = json.loads(bytes(view[len(_FORMAT) + 8 : len(_FORMAT) + 8 + n]))
    start = -(-(len(_FORMAT) + 8 + n) // _ALIGN) * _ALIGN
    arrays = {name: np.frombuffer(view, dtype=np.dtype(dt), count=count, offset=start + at)
              for name, (dt, count, at) in meta["arrays"].items()}  # fmt: skip
    ranges = None
    if "range_offset" in arrays:
        ranges = (arrays["range_offset"], arrays["range_length"])
    table = NameRows(arrays["buf"], arrays["start"], arrays["length"],
                     Resolver(**meta["resolver"]), ranges)  # fmt: skip
    labels = RowLabels(arrays.get("ptr"), arrays["ids"])
    return Index(table, labels, meta["labels"], meta["origin"], rows=arrays["rows"],
                 targets=arrays["targets"], multi_hot=meta["multi_hot"],
                 label_order=meta.get("label_order", False))  # fmt: skip


# ----------------------------------------------------------------------------- the registry


def _is_list(index: Any, opening: Opening) -> bool:
    return isinstance(index, list | tuple)


def _open_list(index: list, opening: Opening) -> Index:
    if not index:
        raise BadIndex("empty list of indexes")
    members = [opening.open(i) for i in index]
    for m in members:
        if not isinstance(m, Index):  # a part source: its records have no rows to line up
            raise BadIndex(
                f"{m.origin}: part files cannot be joined item by item with other indexes"
            )
    return join(members)


def _is_parts(index: Any, opening: Opening) -> bool:
    # naming a part option (record_format=...) makes any path or URL a part source
    return _is_path(index) and (is_part_source(index) or bool(opening.options.parts.given()))


def _open_parts(index: str, opening: Opening) -> PartIndex:
    o = opening.options
    return open_parts(index, options=o.parts, fetch=o.fetch, cache=o.cache)


def _is_directory(index: Any, opening: Opening) -> bool:
    path = src.local_path(index) if _is_path(index) else None
    return path is not None and os.path.isdir(path)


def _open_directory(index: str, opening: Opening) -> Index:
    return from_directory(src.local_path(index) or index, opening.options.index.multi_hot)


register_index_kind("index", lambda i, o: isinstance(i, Index | PartIndex), lambda i, o: i)
register_index_kind(
    "tensor",
    lambda i, o: isinstance(i, torch.Tensor | dict),
    lambda i, o: from_tensors(i, origin="<tensor>"),
)
register_index_kind("list", _is_list, _open_list)
register_index_kind("parts", _is_parts, _open_parts)
register_index_kind("directory", _is_directory, _open_directory)
register_index_kind(
    "pt",
    lambda i, o: _is_path(i) and i.lower().endswith(".pt"),
    lambda i, o: from_pt(i, cache=o.cache, fetcher=o.fetcher),
)
register_index_kind("csv", lambda i, o: _is_path(i), _csv)
