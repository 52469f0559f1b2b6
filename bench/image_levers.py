"""One core, no I/O: CPU time per image of each way to decode + augment the bench's JPEGs.

`python -m bench.image_levers ROOT [N]` prints one line, RESULT {json}: for each
variant, the median over 5 passes (alternating order) of CPU seconds per image
on one thread, on N of the images in ROOT. Run by bench.images in a fresh
process; the variants that need a package that is missing are left out, with
the reason. What each measures:

    pil-full          Pillow full decode, then bench/image_aug.py's augmentation
    pil-draft         the crop drawn first, Pillow's draft() picks the DCT scale
    simplejpeg        the crop drawn first, libjpeg-turbo via simplejpeg, scaled decode
    turbojpeg         the same via PyTurboJPEG (needs the system's libturbojpeg)
    turbojpeg-crop    PyTurboJPEG's lossless crop to the box (MCU grid), then decode
    distlearn         distlearn.dataset.processors.RandomResizedCrop, the package's own
    decode-pil, decode-simplejpeg, augment   the parts alone
    dct-scale-1/k     how many crops allowed a reduced DCT scale at all
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from bench.image_aug import SIZE, augment, crop_box, flip_draw, hwc_to_chw
from bench.image_aug import resize_crop_flip_normalize as finish
from bench.image_rows import decode_full, process, process_scaled, process_simplejpeg


def _scale_for(width: int, height: int, w: int, h: int) -> int:
    """The largest k in 1, 2, 4, 8 with the crop still >= SIZE after a 1/k decode."""
    return max(k for k in (1, 2, 4, 8) if (w / k >= SIZE and h / k >= SIZE) or k == 1)


def variants(out: torch.Tensor) -> tuple[dict, dict]:
    found, missing = {}, {}
    found["pil-full"] = lambda d: process(d, out)
    found["pil-draft"] = lambda d: process_scaled(d, out)
    found["decode-pil"] = decode_full
    try:
        import simplejpeg

        found["simplejpeg"] = lambda d: process_simplejpeg(d, out)
        found["decode-simplejpeg"] = lambda d: simplejpeg.decode_jpeg(d, colorspace="RGB")
    except ImportError as err:
        missing["simplejpeg"] = str(err)
    try:
        from turbojpeg import TJPF_RGB, TurboJPEG

        tj = TurboJPEG()

        def turbo(d: bytes, crop: bool = False) -> torch.Tensor:
            width, height = tj.decode_header(d)[:2]
            top, left, h, w = crop_box(height, width)
            flip = flip_draw()
            k = _scale_for(width, height, w, h)
            if crop:  # lossless crop on the 16 px MCU grid, enclosing the box
                x0, y0 = left // 16 * 16, top // 16 * 16
                d = tj.crop(d, x0, y0, left + w - x0, top + h - y0)
                top, left = top - y0, left - x0
            arr = tj.decode(d, pixel_format=TJPF_RGB, scaling_factor=(1, k))
            box = (top // k, left // k, min(arr.shape[0], max(1, round(h / k))),
                   min(arr.shape[1], max(1, round(w / k))))  # fmt: skip
            return finish(hwc_to_chw(arr), box, flip, out)

        found["turbojpeg"] = turbo
        found["turbojpeg-crop"] = lambda d: turbo(d, crop=True)
    except (ImportError, RuntimeError, OSError) as err:  # no package, or no libturbojpeg
        missing["turbojpeg"] = f"{type(err).__name__}: {err}".splitlines()[0]
    try:
        from bench.image_aug import IMAGENET_MEAN, IMAGENET_STD
        from distlearn.dataset.processors import RandomResizedCrop

        rrc = RandomResizedCrop(mean=IMAGENET_MEAN, std=IMAGENET_STD)
        found["distlearn"] = lambda d: rrc(d, None, out)
    except ImportError as err:
        missing["distlearn"] = str(err)
    return found, missing


def main() -> int:
    root = Path(sys.argv[1])
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 300
    torch.set_num_threads(1)
    files = sorted((root / "img").glob("*.jpg"))
    step = max(1, len(files) // n)
    data = [f.read_bytes() for f in files[::step][:n]]
    out = torch.empty(3, SIZE, SIZE)
    found, missing = variants(out)
    decoded = [decode_full(d) for d in data]
    found["augment"] = None  # on the decoded images
    times: dict[str, list[float]] = {k: [] for k in found}
    names = list(found)
    for rep in range(5):
        for name in names if rep % 2 == 0 else names[::-1]:
            torch.manual_seed(rep)
            t0 = time.process_time()
            if name == "augment":
                for img in decoded:
                    augment(img, out)
            else:
                fn = found[name]
                for d in data:
                    fn(d)
            times[name].append((time.process_time() - t0) / len(data))
    scales: Counter = Counter()
    torch.manual_seed(0)
    for img in decoded:
        _, height, width = img.shape
        _, _, h, w = crop_box(height, width)
        scales[f"1/{_scale_for(width, height, w, h)}"] += 1
    result = {
        "images": len(data),
        "ms_per_img": {k: 1e3 * statistics.median(v) for k, v in times.items()},
        "missing": missing,
        "dct_scales": dict(scales),
        "mean_pixels": float(np.mean([img.shape[1] * img.shape[2] for img in decoded])),
    }
    sys.stdout.write("RESULT " + json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
