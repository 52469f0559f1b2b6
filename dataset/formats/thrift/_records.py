"""Ready processors for Thrift records: ``processor(fetched, opt, out) -> (bool, extra)``.

Both write the decoded item into ``out``, a view of the item's row in the
preallocated batch, as every processor does (see ``dataset.processors``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ._wire import Schema, ThriftError

if TYPE_CHECKING:  # decoding records needs no torch; a processor's `out` is a tensor
    import torch

__all__ = ["FEATURE_FIELDS", "MEDIA_SCHEMA", "FeatureRecord", "MediaRecord"]

MEDIA_SCHEMA: dict[int, Schema] = {1: "binary", 2: "string", 3: ("list", "i32")}
"""A media record: 1: binary image, 2: optional string caption, 3: optional list<i32> resolution."""

FEATURE_FIELDS = (1, 2, 3)
"""A feature record's numeric fields, as in Twitter's DataRecord: 1: set<i64> of binary
feature ids, 2: map<i64, double> of continuous features, 3: map<i64, i64> of discrete ones."""


class MediaRecord:
    """Processor for Thrift media records: the image goes into the batch slot.

    ``processor(fetched, opt, out) -> (True, {"caption": str | None,
    "resolution": list[int] | None})``. The image (PNG, JPEG, ... anything
    Pillow reads) is decoded by :class:`dataset.processors.Image`, which
    ``image_opts`` configure (``mode``, ``size``, ``mean``, ``std``).

    Args:
        protocol: `"binary"` or `"compact"`.
        **image_opts (Any): For `processors.Image`.

    Raises:
        ValueError: An unknown protocol.
    """

    def __init__(self, protocol: str = "binary", **image_opts: Any):
        from ... import processors
        from . import _check_protocol

        _check_protocol(protocol)
        self.protocol = protocol
        self.image = processors.Image(**image_opts)

    def __call__(self, fetched: bytes, opt: Any, out: torch.Tensor) -> tuple[bool, dict[str, Any]]:
        from . import decode

        rec = decode(fetched, self.protocol, MEDIA_SCHEMA)
        image = rec.get(1)
        if not isinstance(image, bytes):
            raise ThriftError("media record has no binary image in field 1")
        ret = self.image(image, opt, out)
        ok = ret[0] if isinstance(ret, tuple) else ret
        return ok is not False, {"caption": rec.get(2), "resolution": rec.get(3)}


class FeatureRecord:
    """Processor for feature records: sparse numeric features into a dense or sparse row.

    A feature record holds features as containers keyed by a 64-bit feature id:
    a set (or list) of ids whose value is 1, and maps from id to a number. The
    ``fields`` listed (default :data:`FEATURE_FIELDS`) are decoded as numpy
    arrays and each feature id becomes a column: its position in ``vocab`` (ids
    not in it are skipped and counted), or ``id mod dim`` (the hashing trick;
    features that share a column add up). No Python object is made per feature.

    ``layout="dense"``: ``out`` holds one value per column (``input_dims=(C,)``,
    C = ``dim`` or ``len(vocab)``); features that land on one column add up.
    ``layout="sparse"``: ``out`` is ``[2, K]`` (``input_dims=(2, K)``): row 0 the
    columns, row 1 the values, in field order, padded with column -1 and value 0.
    A record with more than K features raises (the item is dropped and counted)
    unless ``overflow="truncate"``, which keeps the first K.

    Returns ``(True, {"features": n, "skipped": m})``: features written, and
    features not written (ids outside ``vocab``, or cut by ``overflow="truncate"``).
    A listed field that is not a set/list of integers or a map from integers to
    numbers raises :class:`ThriftError`.

    Args:
        protocol: `"binary"` or `"compact"`.
        dim: Columns for the hashing trick (`id mod dim`); or give `vocab`.
        vocab: The feature ids, in column order.
        fields: The record's fields that hold features.
        layout: `"dense"` or `"sparse"`.
        overflow: `"error"` or `"truncate"`, for a sparse row too short.

    Raises:
        ValueError: An unknown protocol, layout or overflow, or neither (or both)
            of `dim` and `vocab`.
    """

    def __init__(
        self,
        protocol: str = "binary",
        *,
        dim: int | None = None,
        vocab: Sequence[int] | np.ndarray | None = None,
        fields: Sequence[int] = FEATURE_FIELDS,
        layout: str = "dense",
        overflow: str = "error",
    ):
        from . import _check_protocol

        _check_protocol(protocol)
        if (dim is None) == (vocab is None):
            raise ValueError("FeatureRecord needs exactly one of dim= (hashing) or vocab=")
        if layout not in ("dense", "sparse"):
            raise ValueError(f"layout must be 'dense' or 'sparse', got {layout!r}")
        if overflow not in ("error", "truncate"):
            raise ValueError(f"overflow must be 'error' or 'truncate', got {overflow!r}")
        self.protocol = protocol
        self.fields = tuple(int(f) for f in fields)
        if not self.fields:
            raise ValueError("FeatureRecord needs at least one field")
        self.layout = layout
        self.overflow = overflow
        self.dim = None
        self._vocab_sorted = self._vocab_cols = None
        if dim is not None:
            if not isinstance(dim, int) or dim < 1:
                raise ValueError(f"dim must be a positive int, got {dim!r}")
            self.dim = dim
            self.columns = dim
        else:
            ids = np.asarray(vocab, dtype=np.int64).reshape(-1)
            if len(ids) == 0:
                raise ValueError("vocab is empty")
            order = np.argsort(ids, kind="stable")
            self._vocab_sorted = ids[order]
            if (np.diff(self._vocab_sorted) == 0).any():
                raise ValueError("vocab has repeated feature ids")
            self._vocab_cols = order.astype(np.int64)
            self.columns = len(ids)
        if layout == "sparse" and self.columns > 1 << 24:
            raise ValueError("a sparse row stores columns as float32: at most 2**24 columns")

    def __repr__(self) -> str:
        how = f"dim={self.dim}" if self.dim is not None else f"vocab=<{self.columns} ids>"
        return (
            f"FeatureRecord({self.protocol!r}, {how}, fields={self.fields}, layout={self.layout!r})"
        )

    def features(self, fetched: bytes) -> tuple[np.ndarray, np.ndarray, int]:
        """The record's features as (columns int64, values float64) and how many were skipped."""
        from . import decode

        rec = decode(fetched, self.protocol, numpy=True)
        ids_parts, val_parts = [], []
        for fid in self.fields:
            v = rec.get(fid)
            if v is None or (isinstance(v, dict) and not v):  # absent, or an empty compact map
                continue
            if isinstance(v, np.ndarray) and v.dtype.kind == "i":
                ids_parts.append(v.astype(np.int64, copy=False))
                val_parts.append(np.ones(len(v)))
            elif isinstance(v, tuple) and v[0].dtype.kind == "i" and v[1].dtype.kind in "fib":
                ids_parts.append(v[0].astype(np.int64, copy=False))
                val_parts.append(v[1].astype(np.float64, copy=False))
            else:
                raise ThriftError(
                    f"feature field {fid} is not a set/list of integers or a map from "
                    f"integers to numbers (got {type(v).__name__})"
                )
        if not ids_parts:
            return np.empty(0, np.int64), np.empty(0), 0
        ids = np.concatenate(ids_parts) if len(ids_parts) > 1 else ids_parts[0]
        vals = np.concatenate(val_parts) if len(val_parts) > 1 else val_parts[0]
        if self.dim is not None:
            if self.dim & (self.dim - 1) == 0:  # a power of two: the same columns, no division
                return np.bitwise_and(ids, self.dim - 1), vals, 0
            return np.mod(ids, self.dim), vals, 0
        pos = np.searchsorted(self._vocab_sorted, ids)
        pos[pos == len(self._vocab_sorted)] = 0
        hit = self._vocab_sorted[pos] == ids
        return self._vocab_cols[pos[hit]], vals[hit], int(len(ids) - hit.sum())

    def __call__(self, fetched: bytes, opt: Any, out: torch.Tensor) -> tuple[bool, dict[str, int]]:
        cols, vals, skipped = self.features(fetched)
        row = out.numpy()
        if self.layout == "dense":
            if row.size != self.columns:
                raise ValueError(
                    f"FeatureRecord: a dense row needs input_dims of {self.columns} values, "
                    f"got {tuple(out.shape)}"
                )
            if not row.flags.c_contiguous:
                raise ValueError("FeatureRecord: the batch row is not contiguous")
            flat = row.reshape(-1)  # a view, as the row is contiguous
            flat[:] = 0
            # features on one column add up; values in the row's dtype keep add.at fast
            np.add.at(flat, cols, vals.astype(flat.dtype, copy=False))
            return True, {"features": len(cols), "skipped": skipped}
        if row.ndim != 2 or row.shape[0] != 2:
            raise ValueError(
                f"FeatureRecord: a sparse row is [2, K] (input_dims=(2, K)), got {tuple(out.shape)}"
            )
        k = row.shape[1]
        n = len(cols)
        if n > k:
            if self.overflow == "error":
                raise ThriftError(f"record has {n} features; the sparse row holds {k}")
            skipped += n - k
            n = k
        row[0, :n] = cols[:n]
        row[1, :n] = vals[:n]
        row[0, n:] = -1
        row[1, n:] = 0
        return True, {"features": n, "skipped": skipped}
