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

from .augment import RandomResizedCrop, Transform
from .seeding import item_source

__all__ = ["Image", "Json", "Mixed", "RandomResizedCrop", "Raw", "Transform", "default_processor"]

_MODES = {1: "L", 2: "LA", 3: "RGB", 4: "RGBA"}
_SCALE = np.float32(1.0 / 255.0)
_SCALE16 = np.float32(1.0 / 65535.0)
# 16-bit grey (PNG, TIFF): PIL's convert("L") would clip every value over 255 to white.
_MODES16 = ("I;16", "I;16L", "I;16B", "I;16N", "I")


class Image:
    """PNG/JPEG/... bytes (via Pillow) into a float tensor `[C, H, W]` with values in [0, 1].

    16-bit grey images are scaled by their own depth. A JPEG that is resized is
    decoded at a reduced scale first where libjpeg can.

    Args:
        mode: The Pillow mode to convert to (`"L"`, `"RGB"`...); by default from the
            channel count of `input_dims`.
        size: Resize to `(height, width)` (or an int, for a square) first; without it
            an image must already match `input_dims`.
        mean: Per-channel mean subtracted after scaling to [0, 1].
        std: Per-channel deviation divided by after that.
        resample: Pillow's resampling filter for `size`.
        max_pixels: Larger images raise `PIL.Image.DecompressionBombError` before they
            are decoded (default: Pillow's `Image.MAX_IMAGE_PIXELS`, which Pillow
            itself only warns about below twice that size).

    Raises:
        ValueError: A zero in `std`; when called, an image that does not fit
            `input_dims` (naming the dimension that differs and the option that fixes
            it), or a 16-bit grey image asked to become colour.
    """

    def __init__(
        self,
        mode: str | None = None,
        size: int | Sequence[int] | None = None,
        mean: float | Sequence[float] | None = None,
        std: float | Sequence[float] | None = None,
        resample: int = _PIL.BILINEAR,
        max_pixels: int | None = None,
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
        self.max_pixels = max_pixels

    def __repr__(self) -> str:
        return f"Image(mode={self.mode!r}, size={self.size}, mean={self.mean}, std={self.std})"

    def __call__(self, data: bytes, opt: Any, out: torch.Tensor) -> bool:
        img = _PIL.open(io.BytesIO(data))
        limit = self.max_pixels if self.max_pixels is not None else _PIL.MAX_IMAGE_PIXELS
        if limit and img.size[0] * img.size[1] > limit:
            raise _PIL.DecompressionBombError(
                f"image of {img.size[0]}x{img.size[1]} = {img.size[0] * img.size[1]} pixels "
                f"exceeds the limit of {limit} "
                "(Image(max_pixels=...) or PIL.Image.MAX_IMAGE_PIXELS)"
            )
        channels = out.shape[0] if out.dim() == 3 else 1
        mode = self.mode or _MODES.get(channels, "RGB")
        scale = _SCALE
        if img.mode in _MODES16:
            if mode != "L":
                raise ValueError(
                    f"a 16-bit grey image (mode {img.mode}) cannot become mode {mode} without "
                    "losing its depth: pass Image(mode='L') and one channel in input_dims"
                )
            # Kept in float, scaled by its own depth (a PNG's "I" holds 16-bit values too).
            img, mode, scale = img.convert("F"), "F", _SCALE16
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
            raise ValueError(_mismatch(tuple(arr.shape), tuple(dst.shape), img.mode))
        np.multiply(arr, scale, out=dst)
        if self._mean is not None:
            dst -= self._mean if dst.ndim == 3 else self._mean[0]
        if self._std is not None:
            dst /= self._std if dst.ndim == 3 else self._std[0]
        return True


def _mismatch(got: tuple[int, ...], want: tuple[int, ...], mode: str) -> str:
    """Why a decoded image does not fit its batch row, and the option that fixes it."""
    image = f"a mode-{mode} image of shape {got} ({'C,H,W' if len(got) == 3 else 'H,W'})"
    if len(want) <= 1:
        chw = got if len(got) == 3 else (1, *got)
        return (
            f"{image} does not fit the flat input_dims {want}: give input_dims={chw} "
            "(channels, height, width), or flatten in your own processor"
        )
    if len(want) == 3 and len(got) == 3 and got[0] != want[0]:
        fix = f"Image(mode={_MODES.get(want[0], '...')!r})"
        if got[1:] != want[1:]:
            fix = fix[:-1] + f", size={want[1:]})"
        return f"{image} has {got[0]} channels, input_dims {want} has {want[0]}: pass {fix}"
    if len(got) != len(want):
        return (
            f"{image} does not fit input_dims {want}: pass Image(mode='L') for one channel, "
            f"or input_dims=(C, H, W) such as {(got[0], *want[-2:]) if len(got) == 3 else got}"
        )
    return (
        f"{image} is {got[-2]}x{got[-1]} (HxW), input_dims {want} wants "
        f"{want[-2]}x{want[-1]}: pass Image(size={want[-2:]}) to resize"
    )


class Raw:
    """Bytes read as a flat array of `dtype` into the row, optionally scaled.

    Args:
        dtype: The numpy dtype of the bytes.
        scale: A factor applied after the copy (e.g. `1 / 255`).

    Raises:
        ValueError: When called, bytes holding another number of values than the row.
    """

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
    """A JSON document: `field` (or the whole document) as numbers into the row.

    The parsed document is returned as the item's `extra`. With `field=None` and a
    document that is not numeric, only the extra is kept (the row is zero).

    Args:
        field: The key whose value goes into the row; None: the whole document.

    Raises:
        ValueError: When called, a field that is not numeric or does not fit the row.
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
    """The processor when none is given: tensor rows are copied, bytes decoded as images.

    Args:
        fetched: A tensor row, or an image's bytes.
        opt: The batcher's `processor_opt`.
        out: The item's row of the batch.

    Returns:
        True: the item is kept.

    Raises:
        ValueError: A tensor row of another size than `input_dims`.
        TypeError: Anything but a tensor or bytes (pass `processor=`).
    """
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


class Mixed:
    """The processor of a mix: each item decoded by its own source's processor and option.

    A mix's batcher runs this in its workers (picklable when every source's processor
    is); the item's source comes from its key (what `item_source()` reads).
    """

    def __init__(self, processors: Sequence[tuple[Any, Any]]):
        self.processors = [(p if p is not None else default_processor, opt)
                           for p, opt in processors]  # fmt: skip

    def __call__(self, fetched: Any, opt: Any, out: torch.Tensor) -> Any:
        i = item_source()
        if i is None:
            raise RuntimeError("Mixed decodes the items of a mix only")
        processor, own = self.processors[i]
        return processor(fetched, own, out)
