"""Indexes held as tensors: a tensor, ``dict(x=, y=)``, or a ``.pt`` file (local or remote).

Rows are the tensor's first dimension and partition by row; a ``.pt`` file is loaded
with ``weights_only=True`` (a remote one only on a torch whose ``weights_only``
loading cannot run code).
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import torch

from ..errors import BadIndex, IndexNotFound
from ..fetch import sources as src
from ..fetch.fetcher import Fetcher
from ..fetch.files import read_bytes
from .rows import RowLabels, TensorRows
from .table import BY_ROW, Index

__all__ = ["SAFE_TORCH_LOAD", "from_pt", "from_tensors"]


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
