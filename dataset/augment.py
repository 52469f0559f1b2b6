"""Training augmentations as processors, with random draws that belong to the item.

Two processors (re-exported by :mod:`dataset.processors`):

- :class:`RandomResizedCrop`: ImageNet training's decode + RandomResizedCrop +
  horizontal flip + normalise, fused. The crop is drawn from the image's size
  (read from its header) before any pixel is decoded, so a JPEG is decoded at
  the smallest DCT scale that still leaves the crop at least the output size,
  and the result is written straight into the batch row.
- :class:`Transform`: decode, then any tensor pipeline in the
  ``torchvision.transforms.v2`` calling convention (a callable on a uint8
  tensor ``[C, H, W]`` drawing from torch's generator), so a user's torchvision
  pipeline drops in as it is.

Random draws are the item's own: derived from :func:`dataset.item_seed`, i.e.
(seed, partition, epoch, position in the epoch), so an epoch draws the same
crops and flips with 0, 1 or 16 workers, threads or processes, and after a
resume. Called outside a batcher (a test, a notebook), they come from torch's
global generator.
"""

from __future__ import annotations

import math
import random
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from .imagedecode import Decoded, check_decoder
from .seeding import item_seed

__all__ = ["RandomResizedCrop", "Transform"]

_CHANNEL_MODES = {1: "L", 3: "RGB"}


def _item_seed_or_none() -> int | None:
    try:
        return item_seed()
    except RuntimeError:  # not inside a batcher's processor call
        return None


def _mode_for(out: torch.Tensor, mode: str | None) -> str:
    if mode is not None:
        return mode
    channels = out.shape[0] if out.dim() == 3 else 0
    if channels not in _CHANNEL_MODES:
        raise ValueError(
            f"an image row needs input_dims (1 or 3, H, W), got {tuple(out.shape)}; pass mode="
        )
    return _CHANNEL_MODES[channels]


def _as_chw(arr, writable: bool) -> torch.Tensor:
    """A decoded uint8 [H, W, C] array as a [C, H, W] tensor sharing its memory (channels-last).

    Pillow's arrays are read-only views of a bytes object: copied when the tensor
    goes to code that may write in place (a user's transform), else only read.
    """
    if not arr.flags.writeable:
        if writable:
            arr = arr.copy()
        else:
            with warnings.catch_warnings():  # torch warns that it could write; it will not
                warnings.simplefilter("ignore", UserWarning)
                return torch.from_numpy(arr).permute(2, 0, 1)
    return torch.from_numpy(arr).permute(2, 0, 1)


def _global_seed() -> int:
    """A seed drawn from torch's global generator (outside a batcher: torch.manual_seed rules)."""
    return int(torch.randint(0, 2**62, ()).item())


class RandomResizedCrop:
    """Image bytes into a random crop of the row's size, maybe flipped, normalised.

    ImageNet training's augmentation, fused with the decode: the draw of
    `torchvision.transforms.v2.RandomResizedCrop(size, scale, ratio)` (ten tries
    at a random area and log-uniform aspect ratio, then the centred largest crop
    of an allowed ratio), a horizontal flip, antialiased bilinear resizing
    (torch's uint8 path), scaling to [0, 1] and `(x - mean) / std`, written
    straight into the batch row. The crop is drawn from the size in the image's
    header, so a JPEG is decoded at the smallest DCT scale (1/2, 1/4, 1/8) that
    leaves the crop at least the row's size. The output size is the row's
    (`input_dims`, `(C, H, W)`); the draws are the item's own (module docstring).

    Args:
        scale: Bounds of the crop's area, as a fraction of the image's.
        ratio: Bounds of the crop's aspect ratio (width / height).
        flip: Probability of a horizontal flip.
        mean: Per-channel mean subtracted after scaling to [0, 1] (one value: all).
        std: Per-channel deviation divided by after that.
        mode: `"RGB"` or `"L"`; by default from the row's channel count (3 or 1).
        decoder: `"auto"` (libjpeg-turbo through simplejpeg for JPEGs when it is
            installed, `pip install distlearn[jpeg]`; else Pillow), `"pil"` or
            `"simplejpeg"`.
        max_pixels: Larger images raise `PIL.Image.DecompressionBombError` before
            they are decoded (default: Pillow's `Image.MAX_IMAGE_PIXELS`).

    Raises:
        ValueError: Bounds out of order or out of range, a zero in `std`, an unknown
            `mode` or `decoder`; when called, a row that is not `(1 or 3, H, W)`.
        ImportError: `decoder="simplejpeg"` without simplejpeg installed.
    """

    def __init__(
        self,
        scale: Sequence[float] = (0.08, 1.0),
        ratio: Sequence[float] = (3 / 4, 4 / 3),
        flip: float = 0.5,
        mean: float | Sequence[float] | None = None,
        std: float | Sequence[float] | None = None,
        mode: str | None = None,
        decoder: str = "auto",
        max_pixels: int | None = None,
    ):
        self.scale = tuple(float(s) for s in scale)
        self.ratio = tuple(float(r) for r in ratio)
        if len(self.scale) != 2 or not 0 < self.scale[0] <= self.scale[1] <= 1:
            raise ValueError(f"scale must be (lo, hi) with 0 < lo <= hi <= 1, got {scale}")
        if len(self.ratio) != 2 or not 0 < self.ratio[0] <= self.ratio[1]:
            raise ValueError(f"ratio must be (lo, hi) with 0 < lo <= hi, got {ratio}")
        if not 0 <= flip <= 1:
            raise ValueError(f"flip is a probability, got {flip}")
        self.flip = float(flip)
        self.mean = None if mean is None else torch.tensor(mean, dtype=torch.float32).reshape(-1)
        self.std = None if std is None else torch.tensor(std, dtype=torch.float32).reshape(-1)
        if self.std is not None and bool((self.std == 0).any()):
            raise ValueError("RandomResizedCrop: std must be non-zero")
        # (x / 255 - mean) / std == x * a - b, per channel (one value: every channel)
        std_ = self.std if self.std is not None else torch.ones(1)
        self._a = (1 / (255.0 * std_)).view(-1, 1, 1)
        self._b = (self.mean / std_ if self.mean is not None else torch.zeros(1)).view(-1, 1, 1)
        self.mode = mode
        if mode is not None and mode not in _CHANNEL_MODES.values():
            raise ValueError(f"mode must be 'RGB' or 'L', got {mode!r}")
        self.decoder = check_decoder(decoder)
        self.max_pixels = max_pixels

    def __repr__(self) -> str:
        return (
            f"RandomResizedCrop(scale={self.scale}, ratio={self.ratio}, flip={self.flip}, "
            f"mean={self.mean}, std={self.std}, decoder={self.decoder!r})"
        )

    def draw(self, width: int, height: int, rng: random.Random) -> tuple[int, int, int, int, bool]:
        """(top, left, h, w) of the crop in the full image, and whether to flip."""
        area = width * height
        log_lo, log_hi = math.log(self.ratio[0]), math.log(self.ratio[1])
        for _ in range(10):
            target = area * rng.uniform(*self.scale)
            aspect = math.exp(rng.uniform(log_lo, log_hi))
            w = round(math.sqrt(target * aspect))
            h = round(math.sqrt(target / aspect))
            if 0 < w <= width and 0 < h <= height:
                top, left = rng.randint(0, height - h), rng.randint(0, width - w)
                return top, left, h, w, rng.random() < self.flip
        in_ratio = width / height  # fallback: the centred largest crop of an allowed ratio
        if in_ratio < self.ratio[0]:
            w, h = width, round(width / self.ratio[0])
        elif in_ratio > self.ratio[1]:
            w, h = round(height * self.ratio[1]), height
        else:
            w, h = width, height
        return (height - h) // 2, (width - w) // 2, h, w, rng.random() < self.flip

    def __call__(self, data: Any, opt: Any, out: torch.Tensor) -> bool:
        mode = _mode_for(out, self.mode)
        if out.dim() != 3 or out.shape[0] != len(mode):
            raise ValueError(
                f"mode {mode} gives {len(mode)} channel(s); the row is {tuple(out.shape)}: "
                f"input_dims=({len(mode)}, H, W)"
            )
        out_h, out_w = out.shape[1], out.shape[2]
        seed = _item_seed_or_none()
        rng = random.Random(seed if seed is not None else _global_seed())
        with Decoded(data, mode, self.decoder, self.max_pixels) as img:
            width, height = img.width, img.height
            top, left, h, w, flip = self.draw(width, height, rng)
            # the smallest decode that keeps the crop at least out_h x out_w
            need = (math.ceil(width * out_w / w), math.ceil(height * out_h / h))
            arr = img.decode(need if need[0] < width and need[1] < height else None)
        sy, sx = arr.shape[0] / height, arr.shape[1] / width
        top, left = int(top * sy), int(left * sx)
        h = min(arr.shape[0] - top, max(1, round(h * sy)))
        w = min(arr.shape[1] - left, max(1, round(w * sx)))
        crop = _as_chw(arr, writable=False)[:, top : top + h, left : left + w].unsqueeze(0)
        # uint8 in channels-last: torch's vectorised antialiased resize, ~5x float's speed
        crop = crop.contiguous(memory_format=torch.channels_last)
        small = F.interpolate(crop, size=(out_h, out_w), mode="bilinear", antialias=True)[0]
        if flip:
            small = small.flip(-1)
        torch.mul(small, self._a, out=out)  # straight into the batch row
        out.sub_(self._b)
        return True


# torch's default generator is one per process: a Transform's seeded call holds it alone
_GLOBAL_RNG = threading.Lock()


class Transform:
    """Image bytes, decoded to a uint8 tensor `[C, H, W]`, through a tensor pipeline.

    `transform` is any callable in the `torchvision.transforms.v2` convention: it
    takes the uint8 image tensor and returns a float tensor of the row's shape
    (end it with `ToDtype(torch.float32, scale=True)`), drawing its randomness
    from torch's default generator. For each item that generator is seeded from
    `item_seed()` for the call, and restored after, so the draws do not depend
    on the workers. Thread workers therefore run transforms one at a time (they
    share the generator; the GIL mostly serialises them anyway); process
    workers, the default, run in parallel.

        from torchvision.transforms import v2
        Transform(v2.Compose([v2.RandomResizedCrop(224), v2.RandomHorizontalFlip(),
                              v2.ToDtype(torch.float32, scale=True),
                              v2.Normalize(mean, std)]))

    Args:
        transform: The pipeline: uint8 tensor in, float tensor of the row's shape out.
        mode: `"RGB"` or `"L"`; by default from the row's channel count (3 or 1).
        decoder: As for `RandomResizedCrop`.
        max_pixels: As for `RandomResizedCrop`.

    Raises:
        TypeError: `transform` is not callable; when called, it returned something
            other than a float tensor.
        ValueError: An unknown `mode` or `decoder`; when called, a result whose shape
            is not the row's.
    """

    def __init__(
        self,
        transform: Callable[[torch.Tensor], torch.Tensor],
        mode: str | None = None,
        decoder: str = "auto",
        max_pixels: int | None = None,
    ):
        if not callable(transform):
            raise TypeError(f"transform must be callable, got {transform!r}")
        if mode is not None and mode not in _CHANNEL_MODES.values():
            raise ValueError(f"mode must be 'RGB' or 'L', got {mode!r}")
        self.transform, self.mode = transform, mode
        self.decoder = check_decoder(decoder)
        self.max_pixels = max_pixels

    def __repr__(self) -> str:
        return f"Transform({self.transform!r}, decoder={self.decoder!r})"

    def __call__(self, data: Any, opt: Any, out: torch.Tensor) -> bool:
        mode = _mode_for(out, self.mode)
        with Decoded(data, mode, self.decoder, self.max_pixels) as img:
            image = _as_chw(img.decode(), writable=True)
        seed = _item_seed_or_none()
        if seed is None:
            result = self.transform(image)
        else:
            with _GLOBAL_RNG:
                gen = torch.default_generator
                state = gen.get_state()
                gen.manual_seed(seed)
                try:
                    result = self.transform(image)
                finally:
                    gen.set_state(state)
        if not isinstance(result, torch.Tensor):
            raise TypeError(f"transform returned {type(result).__name__}, not a tensor")
        if not result.is_floating_point():
            raise TypeError(
                f"transform returned {result.dtype} values; end it with "
                "ToDtype(torch.float32, scale=True) so the batch holds [0, 1] floats"
            )
        if tuple(result.shape) != tuple(out.shape):
            raise ValueError(
                f"transform returned shape {tuple(result.shape)}, the row is "
                f"{tuple(out.shape)} (input_dims)"
            )
        out.copy_(result)
        return True
