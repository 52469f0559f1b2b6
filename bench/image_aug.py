"""The augmentation every image row applies, in plain torch tensor ops: identical for all rows.

ImageNet training's standard recipe, in the `torchvision.transforms.v2` calling
convention (a callable on a uint8 tensor [3, H, W], random draws from torch's
generator) so it reads like the pipeline a user has:

    RandomResizedCrop(224, scale=(0.08, 1), ratio=(3/4, 4/3), antialias=True)
    RandomHorizontalFlip(0.5)
    ToDtype(float32, scale=True)
    Normalize(IMAGENET_MEAN, IMAGENET_STD)

torchvision itself does not import beside this machine's CPU torch (PyPI's
torchvision 0.28.0 is a CUDA build), so the few lines are written here. The
resize runs on uint8 in channels-last layout, torch's fastest CPU path and the
one torchvision v2 takes for uint8 tensors. `crop_box` is the same draw as
torchvision's RandomResizedCrop.get_params, so rows that decide the crop before
decoding (and decode less) do the same work as the rows that decode everything.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import torch
import torch.nn.functional as F

SIZE = 224
SCALE = (0.08, 1.0)
RATIO = (3 / 4, 4 / 3)
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
# folded: (x / 255 - mean) / std == x * A - B
_A = torch.tensor([1 / (255 * s) for s in IMAGENET_STD]).view(3, 1, 1)
# Pillow's decoded arrays are read-only; they are only ever read here
warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
_B = torch.tensor([m / s for m, s in zip(IMAGENET_MEAN, IMAGENET_STD, strict=True)]).view(3, 1, 1)


def crop_box(
    height: int, width: int, generator: torch.Generator | None = None
) -> tuple[int, int, int, int]:
    """(top, left, h, w) of a RandomResizedCrop: torchvision's draw, on torch's generator."""
    area = height * width
    log_ratio = torch.log(torch.tensor(RATIO))
    for _ in range(10):
        target_area = area * torch.empty(1).uniform_(*SCALE, generator=generator).item()
        aspect = math.exp(
            torch.empty(1).uniform_(log_ratio[0], log_ratio[1], generator=generator).item()
        )
        w = round(math.sqrt(target_area * aspect))
        h = round(math.sqrt(target_area / aspect))
        if 0 < w <= width and 0 < h <= height:
            top = int(torch.randint(0, height - h + 1, size=(1,), generator=generator).item())
            left = int(torch.randint(0, width - w + 1, size=(1,), generator=generator).item())
            return top, left, h, w
    # fallback: the whole image, cropped to the nearest allowed aspect ratio, centred
    in_ratio = width / height
    if in_ratio < RATIO[0]:
        w, h = width, round(width / RATIO[0])
    elif in_ratio > RATIO[1]:
        h, w = height, round(height * RATIO[1])
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def flip_draw(generator: torch.Generator | None = None) -> bool:
    """RandomHorizontalFlip(0.5)'s draw."""
    return bool(torch.rand(1, generator=generator).item() < 0.5)


def resize_crop_flip_normalize(
    chw_u8: torch.Tensor, box: tuple[int, int, int, int], flip: bool, out: torch.Tensor
) -> torch.Tensor:
    """The work after the draws: crop `box` of a uint8 [3, H, W], resize to SIZE, flip,
    scale and normalise into `out` (float [3, SIZE, SIZE])."""
    top, left, h, w = box
    crop = chw_u8[:, top : top + h, left : left + w].unsqueeze(0)
    # uint8 channels-last: torch's vectorised antialiased bilinear (about 5x float's speed)
    crop = crop.contiguous(memory_format=torch.channels_last)
    small = F.interpolate(crop, size=(SIZE, SIZE), mode="bilinear", antialias=True)[0]
    if flip:
        small = small.flip(-1)
    torch.mul(small, _A, out=out)
    out.sub_(_B)
    return out


def augment(
    chw_u8: torch.Tensor, out: torch.Tensor | None = None, generator: torch.Generator | None = None
) -> torch.Tensor:
    """The whole recipe on a decoded uint8 [3, H, W] image -> float [3, SIZE, SIZE]."""
    box = crop_box(chw_u8.shape[1], chw_u8.shape[2], generator)
    flip = flip_draw(generator)
    if out is None:
        out = torch.empty(3, SIZE, SIZE)
    return resize_crop_flip_normalize(chw_u8, box, flip, out)


def hwc_to_chw(arr: np.ndarray) -> torch.Tensor:
    """A decoded uint8 [H, W, 3] (or [H, W]) array as a [3, H, W] view: no copy."""
    t = torch.from_numpy(arr)
    if t.dim() == 2:
        t = t.unsqueeze(-1).expand(-1, -1, 3)
    return t.permute(2, 0, 1)
