"""Ready processors: decode fetched bytes straight into a batch row.

A processor is ``processor(fetched, opt, out) -> bool | (bool, extra)``:
`fetched` is the item's bytes (a tensor row for tensor indexes, a list for
joined indexes), `opt` the batcher's ``processor_opt``, and `out` a view of the
item's row in the preallocated batch tensor, to be written in place. Returning
False or raising drops the item (counted in ``batcher.stats["dropped"]`` and
logged); returning None counts as success. `extra` lands in ``batch.extra``.

The classes here are plain picklable objects, so they work with process workers.
"""

from __future__ import annotations

import io
import json
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image as _PIL

_MODES = {1: "L", 2: "LA", 3: "RGB", 4: "RGBA"}
_SCALE = np.float32(1.0 / 255.0)


class Image:
    """PNG/JPEG/... bytes (via Pillow) into a float tensor ``[C, H, W]`` with values in [0, 1].

    ``mode``: Pillow mode to convert to (``"L"``, ``"RGB"``...); default from the
    channel count of ``input_dims``. ``size``: resize to ``(height, width)`` (or an
    int for a square) first; without it an image must already match ``input_dims``.
    ``mean``/``std``: per-channel normalisation applied after scaling to [0, 1].
    """

    def __init__(
        self,
        mode: str | None = None,
        size: int | Sequence[int] | None = None,
        mean: float | Sequence[float] | None = None,
        std: float | Sequence[float] | None = None,
        resample: int = _PIL.BILINEAR,
    ):
        self.mode = mode
        self.size = (size, size) if isinstance(size, int) else (tuple(size) if size else None)
        self.mean = None if mean is None else np.asarray(mean, dtype=np.float32).reshape(-1)
        self.std = None if std is None else np.asarray(std, dtype=np.float32).reshape(-1)
        if self.std is not None and (self.std == 0).any():
            raise ValueError("Image: std must be non-zero")
        # shaped (C, 1, 1) to broadcast over a CHW row
        self._mean = None if self.mean is None else self.mean[:, None, None]
        self._std = None if self.std is None else self.std[:, None, None]
        self.resample = resample

    def __repr__(self) -> str:
        return f"Image(mode={self.mode!r}, size={self.size}, mean={self.mean}, std={self.std})"

    def __call__(self, data: bytes, opt: Any, out: torch.Tensor) -> bool:
        img = _PIL.open(io.BytesIO(data))
        channels = out.shape[0] if out.dim() == 3 else 1
        mode = self.mode or _MODES.get(channels, "RGB")
        if self.size is not None:
            h, w = self.size
            if img.format == "JPEG":
                img.draft(mode, (w, h))  # let libjpeg decode at a reduced scale: much faster
            if img.mode != mode:
                img = img.convert(mode)
            if img.size != (w, h):
                img = img.resize((w, h), self.resample)
        elif img.mode != mode:
            img = img.convert(mode)
        # numpy, not torch, for the per-item arithmetic: one ufunc writing straight
        # into the batch row costs a few microseconds, a chain of torch ops ~10x more
        arr = np.asarray(img)
        dst = out.numpy()
        if arr.ndim == 3:
            arr = arr.transpose(2, 0, 1)  # HWC -> CHW
        elif dst.ndim == 3:
            arr = arr[None]
        if arr.shape != dst.shape:
            raise ValueError(
                f"image of shape {arr.shape} (C,H,W) does not fit input_dims "
                f"{tuple(out.shape)}; pass Image(size=(H, W)) to resize"
            )
        np.multiply(arr, _SCALE, out=dst)
        if self._mean is not None:
            dst -= self._mean if dst.ndim == 3 else self._mean[0]
        if self._std is not None:
            dst /= self._std if dst.ndim == 3 else self._std[0]
        return True


class Raw:
    """Bytes read as a flat array of `dtype` (default uint8) into the row, optionally scaled."""

    def __init__(self, dtype: str | np.dtype = "uint8", scale: float | None = None):
        self.dtype = np.dtype(dtype)
        self.scale = scale

    def __call__(self, data: bytes, opt: Any, out: torch.Tensor) -> bool:
        arr = np.frombuffer(data, dtype=self.dtype)
        if arr.size != out.numel():
            raise ValueError(
                f"raw item has {arr.size} {self.dtype} values, input_dims needs {out.numel()}"
            )
        out.copy_(torch.from_numpy(arr.copy()).view(out.shape))
        if self.scale is not None:
            out.mul_(self.scale)
        return True


class Json:
    """A JSON document: ``field`` (or the whole document) as numbers into the row.

    The parsed document is returned as the item's ``extra``. With ``field=None``
    and a document that is not numeric, only the extra is kept (the row is zero).
    """

    def __init__(self, field: str | None = None):
        self.field = field

    def __call__(self, data: bytes, opt: Any, out: torch.Tensor) -> tuple[bool, Any]:
        doc = json.loads(data)
        value = doc[self.field] if self.field is not None else doc
        try:
            t = torch.as_tensor(value, dtype=out.dtype)
        except (TypeError, ValueError):
            if self.field is not None:
                raise ValueError(f"JSON field {self.field!r} is not numeric: {value!r}") from None
            out.zero_()
            return True, doc
        if t.numel() != out.numel():
            raise ValueError(f"JSON value has {t.numel()} numbers, input_dims needs {out.numel()}")
        out.copy_(t.view(out.shape))
        return True, doc


def default_processor(fetched: Any, opt: Any, out: torch.Tensor) -> bool:
    """Tensor rows are copied (reshaped to ``input_dims``); bytes are decoded as images."""
    if isinstance(fetched, torch.Tensor):
        if fetched.numel() != out.numel():
            raise ValueError(
                f"tensor row of shape {tuple(fetched.shape)} does not fit input_dims "
                f"{tuple(out.shape)}"
            )
        out.copy_(fetched.reshape(out.shape))
        return True
    if isinstance(fetched, bytes | bytearray | memoryview):
        return _DEFAULT_IMAGE(bytes(fetched), opt, out)
    raise TypeError(
        f"the default processor handles tensors and image bytes, not {type(fetched).__name__}; "
        "pass processor="
    )


_DEFAULT_IMAGE = Image()
