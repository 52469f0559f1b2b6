"""Image bytes to uint8 arrays, at a reduced scale where that loses nothing that is kept.

One decoder for every image processor. JPEGs go to libjpeg-turbo through
`simplejpeg` when it is installed (``pip install distlearn[jpeg]``): it decodes
straight into a numpy array, where Pillow decodes into its own 4-byte-per-pixel
storage and repacks it, so a 400 px photo decodes in about 0.5 ms instead of 1.3
(bench/RESULTS-images.md). Other formats, and JPEGs without simplejpeg, go to
Pillow. Both can decode a JPEG at 1/2, 1/4 or 1/8 scale in the DCT (libjpeg's
scaled IDCT), which is much cheaper than decoding everything and resizing:
:func:`decode` takes the smallest size the caller still needs (`min_size`) and
picks the smallest scale that keeps it.
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np
from PIL import Image as _PIL

try:  # optional: libjpeg-turbo's own decoder, bundled in the wheel
    import simplejpeg as _simplejpeg
except ImportError:  # pragma: no cover - depends on the environment
    _simplejpeg = None

__all__ = ["DECODERS", "Decoded", "check_decoder", "check_pixels"]

DECODERS = ("auto", "pil", "simplejpeg")
_JPEG_MAGIC = b"\xff\xd8\xff"
_MODES = {"L": 1, "RGB": 3}


def check_decoder(decoder: str) -> str:
    """`decoder` if valid and usable here; else an error naming what to do."""
    if decoder not in DECODERS:
        raise ValueError(f"decoder must be one of {DECODERS}, got {decoder!r}")
    if decoder == "simplejpeg" and _simplejpeg is None:
        raise ImportError("decoder='simplejpeg' needs simplejpeg: pip install distlearn[jpeg]")
    return decoder


def check_pixels(width: int, height: int, max_pixels: int | None) -> None:
    """Refuse an image larger than `max_pixels` (default Pillow's limit) before decoding it."""
    limit = max_pixels if max_pixels is not None else _PIL.MAX_IMAGE_PIXELS
    if limit and width * height > limit:
        raise _PIL.DecompressionBombError(
            f"image of {width}x{height} = {width * height} pixels exceeds the limit of "
            f"{limit} (max_pixels=... or PIL.Image.MAX_IMAGE_PIXELS)"
        )


class Decoded:
    """An image opened for decoding: its full size is known, its pixels not yet decoded."""

    def __init__(self, data: Any, mode: str, decoder: str = "auto", max_pixels: int | None = None):
        if mode not in _MODES:
            raise ValueError(f"mode must be 'L' or 'RGB', got {mode!r}")
        self.data, self.mode = data, mode
        self._pil = None
        use_simplejpeg = decoder != "pil" and _simplejpeg is not None
        if use_simplejpeg and bytes(data[:3]) == _JPEG_MAGIC:
            try:
                self.height, self.width, space = _simplejpeg.decode_jpeg_header(data)[:3]
                # CMYK/YCCK JPEGs: libjpeg-turbo gives no RGB for them, Pillow converts
                use_simplejpeg = space in ("Gray", "YCbCr", "RGB")
            except ValueError:  # a JPEG simplejpeg cannot parse: Pillow says why, or reads it
                use_simplejpeg = False
        else:
            use_simplejpeg = False
        if not use_simplejpeg:
            if decoder == "simplejpeg":
                raise ValueError("decoder='simplejpeg' reads JPEGs only; this is not one")
            self._pil = _PIL.open(io.BytesIO(data))
            self.width, self.height = self._pil.size
        check_pixels(self.width, self.height, max_pixels)

    @property
    def decoder(self) -> str:
        return "pil" if self._pil is not None else "simplejpeg"

    def decode(self, min_size: tuple[int, int] | None = None) -> np.ndarray:
        """uint8 [H, W, C] (C = 1 or 3), at the smallest DCT scale whose image is at least
        `min_size` (width, height); full size without it or for other formats."""
        channels = _MODES[self.mode]
        if self._pil is None:
            colorspace = "RGB" if channels == 3 else "GRAY"
            kw = {} if min_size is None else {"min_width": min_size[0], "min_height": min_size[1]}
            arr = _simplejpeg.decode_jpeg(self.data, colorspace=colorspace, **kw)
        else:
            img = self._pil
            if min_size is not None and img.format == "JPEG":
                img.draft(self.mode, min_size)  # picks the scale; the image is >= min_size
            if img.mode != self.mode:
                img = img.convert(self.mode)
            arr = np.asarray(img)
        return arr if arr.ndim == 3 else arr[:, :, None]

    def close(self) -> None:
        if self._pil is not None:
            self._pil.close()

    def __enter__(self) -> Decoded:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
