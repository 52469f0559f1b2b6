"""The kinds of index, and :func:`open_index`, the one dispatch on them.

Each kind is a *matcher* (does this argument name an index of mine?) and an
*opener* (read it); :func:`open_index` asks the registered kinds in order and
opens with the first that matches. The kinds, in that order:

    index       an Index (or part source) already opened: as it is
    tensor      a tensor, or dict(x=, y=)                  -> Index (rows in memory)
    list        a list of indexes, joined item by item     -> JoinedIndex
    parts       a folder/URL/brace pattern of part files   -> dataset.index.parts.PartIndex
    directory   a local folder (labels: sub-folder names)  -> Index
    pt          a .pt file, local or remote                -> Index
    csv         anything else: a CSV/TSV path or URL       -> Index

:func:`register_index_kind` adds one (before another, or before ``csv``, the
catch-all). An opener returns an :class:`dataset.index.table.Index` or a *part
source*, whose own contract is written in :mod:`dataset.index.parts`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..errors import BadIndex
from ..fetch import sources as src
from ..fetch.cache import disk_cache
from ..fetch.fetcher import Fetcher
from ..fetch.files import read_bytes
from ..fetch.scope import locations_of, scope_for
from ..options import Options, split
from .csv.meta import read_meta
from .csv.reader import from_csv, local_identity
from .directory import from_directory
from .joined import join
from .part_files import is_part_source
from .parts import PartIndex, open_parts
from .rows import NameRows, Resolver, RowLabels
from .table import Index
from .tensors import from_pt, from_tensors

__all__ = ["IndexKind", "Opening", "kinds", "open_index", "register_index_kind"]


@dataclass
class Opening:
    """What an opener gets: the option groups, one fetcher for every read, the index cache."""

    options: Options
    fetcher: Fetcher
    cache: Any = None  # a dataset.fetch.cache.Cache for index files (cache_index=True), or None

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
    """Add a kind of index, asked before the kind named `before`.

    Args:
        name: The kind's name.
        matches: `matches(index, opening) -> bool`: is this argument an index of mine?
        open: `open(index, opening)`: read it, returning an `Index` or a part source.
        before: The kind to be asked before (default: `"csv"`, the catch-all).

    Raises:
        ValueError: A kind of that name is registered already.
    """
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

    Args:
        index: What `Dataset` accepts as its index.
        options: The typed option groups.
        **flat (Any): Or flat keywords of the index group (`sep`, `meta`, `url_params`,
            `multi_hot`, `allow_schemes`, `cache_index`), the read policy (`timeout`,
            `retries`...), the cache (`cache_dir`...) and the part options.

    Returns:
        An `Index`, or a part source for part files (`index.partition(p, n)` gives a
        partition of either).

    Raises:
        TypeError: An index of no registered kind, or a misspelt option.
        BadIndex: A malformed index, naming the file and line.
        IndexNotFound: A file that does not exist.
        FetchError: A read that failed after its retries.
    """
    if options is None:
        options = split("open_index()", flat, ("index", "fetch", "cache", "parts"))
    elif flat:
        options = options.update("open_index()", flat, ("index", "fetch", "cache", "parts"))
    cache = disk_cache(options.cache) if options.index.cache_index else None
    # (the index, meta and .pt files are the ones the user named: not guarded)
    fetch = options.fetch
    named = locations_of(index, options.index.meta)
    scope = scope_for(named, fetch.headers, fetch.credential_origins, guard=False)
    with Fetcher(pool_size=4, scope=scope, **fetch.fetcher_kwargs()) as fetcher:
        return Opening(options, fetcher, cache).open(index)


def _is_path(index: Any) -> bool:
    return isinstance(index, str)


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
