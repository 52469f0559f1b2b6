"""Real-photo JPEGs for the image bench, made from the photographs scikit-image's wheel ships.

ImageNet itself cannot be fetched here, so the bench makes an ImageNet-like set:
each image is a random crop (a quarter of the photo to all of it, an aspect
ratio between 2:3 and 1:1 either way round) of one of 16 real photographs
(astronaut, coffee, the Hubble deep field, a retina, rocks, grass...), resized
so its long side is 400-500 px, flipped half the time, and saved as a baseline
JPEG of quality 90 with 4:2:0 chroma (as most of ImageNet is). The label is
the photograph it came from. Only the wheel's data files are read, from the
zip (`pip download --no-deps`): scikit-image is never installed or imported.

Everything lands in one served folder (default bench/data/photos-N):

    index.csv                    filename,label (relative to the index), index order
    img/000000.jpg ...           one file per image
    shards/photos-000000.tar     the same images in order, `shard_size` per tar, as
                                 webdataset writes them (KEY.jpg + KEY.cls members)
    meta.json                    what was made from what, so a rerun reuses it
"""

from __future__ import annotations

import csv
import io
import json
import logging
import random
import subprocess
import sys
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

SKIMAGE = "scikit-image==0.26.0"
# colour photographs, then grey ones (stored as RGB JPEGs like ImageNet's few grey images)
PHOTOS = (
    "astronaut.png",
    "chelsea.png",
    "coffee.png",
    "hubble_deep_field.jpg",
    "ihc.png",
    "motorcycle_left.png",
    "motorcycle_right.png",
    "retina.jpg",
    "rocket.jpg",
    "camera.png",
    "brick.png",
    "grass.png",
    "gravel.png",
    "moon.png",
    "coins.png",
    "cell.png",
)
VERSION = 1  # bump when the generator changes, so old folders are rebuilt


@dataclass
class Photos:
    """A prepared folder and what it holds."""

    root: Path
    n: int
    shards: list[str]  # paths relative to root
    bytes: int
    mean_side: float  # mean of (width + height) / 2
    labels: list[str]

    def items(self) -> list[tuple[str, int]]:
        """(relative filename, label id) in index order."""
        with open(self.root / "index.csv", newline="") as f:
            return [(row["filename"], int(row["label"])) for row in csv.DictReader(f)]


def skimage_wheel(cache: Path) -> Path:
    """scikit-image's wheel in `cache`, downloaded once with pip (no dependencies, no install)."""
    cache.mkdir(parents=True, exist_ok=True)
    found = sorted(cache.glob("scikit_image-*.whl"))
    if not found:
        log.info("downloading %s (data files only are used)", SKIMAGE)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
             "--disable-pip-version-check", "-q", SKIMAGE, "-d", str(cache)],
            check=True,
        )  # fmt: skip
        found = sorted(cache.glob("scikit_image-*.whl"))
    if not found:
        raise FileNotFoundError(f"pip download {SKIMAGE} left no wheel in {cache}")
    return found[-1]


def load_photos(wheel: Path):
    """The source photographs as RGB PIL images, in PHOTOS order."""
    from PIL import Image

    with zipfile.ZipFile(wheel) as z:
        out = []
        for name in PHOTOS:
            with Image.open(io.BytesIO(z.read(f"skimage/data/{name}"))) as img:
                out.append(img.convert("RGB"))
    return out


def make_jpeg(photo, rng: random.Random, quality: int = 90) -> bytes:
    """One ImageNet-like JPEG: a random crop of `photo`, long side 400-500 px, maybe flipped."""
    from PIL import Image

    pw, ph = photo.size
    long_side = rng.randint(400, 500)
    aspect = rng.uniform(2 / 3, 1.0)  # short / long
    landscape = rng.random() < 0.7  # most photos are landscape
    out_w, out_h = (
        (long_side, round(long_side * aspect))
        if landscape
        else (round(long_side * aspect), long_side)
    )
    # the largest crop of that aspect ratio, then a quarter to all of its area
    frac = rng.uniform(0.25, 1.0) ** 0.5
    cw = min(pw, round(ph * out_w / out_h))
    ch = round(cw * out_h / out_w)
    cw, ch = max(16, round(cw * frac)), max(16, round(ch * frac))
    left, top = rng.randint(0, pw - cw), rng.randint(0, ph - ch)
    img = photo.crop((left, top, left + cw, top + ch)).resize((out_w, out_h), Image.BICUBIC)
    if rng.random() < 0.5:
        img = img.transpose(Image.FLIP_LEFT_RIGHT)
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=quality, subsampling="4:2:0")
    return buf.getvalue()


def write_shards(root: Path, rows: list[tuple[str, int]], shard_size: int) -> list[str]:
    """Tar shards as webdataset writes them: KEY.jpg then KEY.cls (the label as text)."""
    (root / "shards").mkdir(exist_ok=True)
    shards = []
    for start in range(0, len(rows), shard_size):
        rel = f"shards/photos-{start // shard_size:06d}.tar"
        with tarfile.open(root / rel, "w", format=tarfile.USTAR_FORMAT) as tar:
            for i, (name, label) in enumerate(rows[start : start + shard_size], start=start):
                for ext, data in (("jpg", (root / name).read_bytes()), ("cls", b"%d" % label)):
                    info = tarfile.TarInfo(f"{i:06d}.{ext}")
                    info.size, info.mode, info.mtime = len(data), 0o444, 0
                    tar.addfile(info, io.BytesIO(data))
        shards.append(rel)
    return shards


def prepare(root: str | Path, n: int, shard_size: int = 200, seed: int = 0) -> Photos:
    """Make (or reuse) `n` JPEGs, their CSV index and tar shards in `root`."""
    root = Path(root)
    want = {"n": n, "shard_size": shard_size, "seed": seed, "version": VERSION, "src": SKIMAGE}
    meta_path = root / "meta.json"
    if meta_path.exists():
        meta = json.loads(meta_path.read_text())
        if {k: meta.get(k) for k in want} == want:
            return Photos(root, n, meta["shards"], meta["bytes"], meta["mean_side"], meta["labels"])
    from PIL import Image

    (root / "img").mkdir(parents=True, exist_ok=True)
    photos = load_photos(skimage_wheel(root.parent / "wheels"))
    rng = random.Random(seed)
    rows, total, sides = [], 0, 0.0
    for i in range(n):
        label = i % len(PHOTOS)  # balanced classes
        data = make_jpeg(photos[label], rng)
        rel = f"img/{i:06d}.jpg"
        (root / rel).write_bytes(data)
        with Image.open(io.BytesIO(data)) as img:
            sides += (img.size[0] + img.size[1]) / 2
        total += len(data)
        rows.append((rel, label))
    with open(root / "index.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["filename", "label"])
        w.writerows(rows)
    shards = write_shards(root, rows, shard_size)
    labels = [p.rsplit(".", 1)[0] for p in PHOTOS]
    meta = dict(want, shards=shards, bytes=total, mean_side=sides / n, labels=labels)
    meta_path.write_text(json.dumps(meta, indent=1))
    log.info(
        "made %d JPEGs (%.1f MiB, mean side %.0f px) and %d shards in %s",
        n, total / 2**20, sides / n, len(shards), root,
    )  # fmt: skip
    return Photos(root, n, shards, total, sides / n, labels)
