"""The bench's data: N labelled images as files + a CSV index, and the same samples as tar shards.

Everything lands in one folder that the HTTP server serves (default bench/data/www):

    index.csv                  filename,label  (filenames relative to the index)
    img/000000.png ...         the samples (hard links to the source where possible)
    shards/mnist-000000.tar    the same samples, `shard_size` per tar (webdataset.TarWriter)
    meta.json                  what was built from what, so a rerun reuses it

The first n items, evenly spaced over the source, are used. The source is the
MNIST PNGs of examples/prepare_mnist.py by default, any folder (labels =
sub-folder names) or CSV (`filename`, `label` columns) given, or, with
`synthetic`, digits drawn with Pillow (for smoke tests without MNIST).
"""

from __future__ import annotations

import csv
import io
import json
import logging
import os
import random
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parent.parent
MNIST_CSV = REPO / "examples" / "data" / "mnist" / "train.csv"
PREPARE_MNIST = REPO / "examples" / "prepare_mnist.py"
IMAGE_EXTS = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp"}


@dataclass
class BenchData:
    """The prepared folder and what it holds."""

    root: Path
    n: int
    source: str
    shards: list[str]  # paths relative to root
    bytes: int

    @property
    def index(self) -> Path:
        return self.root / "index.csv"

    def items(self) -> list[tuple[str, int]]:
        """(relative filename, label) in index order."""
        with open(self.index, newline="") as f:
            return [(row["filename"], int(row["label"])) for row in csv.DictReader(f)]


def read_source(source: str | os.PathLike) -> list[tuple[Path, str]]:
    """(file, label) pairs from a folder (labels = sub-folders) or a CSV index."""
    src = Path(source)
    if src.is_dir():
        out = []
        for label_dir in sorted(p for p in src.iterdir() if p.is_dir() and p.name[0] != "."):
            for f in sorted(label_dir.rglob("*")):
                if f.suffix.lower() in IMAGE_EXTS and not f.name.startswith("."):
                    out.append((f, label_dir.name))
        if not out:
            raise ValueError(f"{src}: no images in label sub-folders")
        return out
    if not src.is_file():
        raise FileNotFoundError(f"bench data source not found: {src}")
    delim = "\t" if src.suffix == ".tsv" else ","
    with open(src, newline="") as f:
        reader = csv.DictReader(f, delimiter=delim)
        if not reader.fieldnames or "filename" not in reader.fieldnames:
            raise ValueError(f"{src}: needs a 'filename' column, has {reader.fieldnames}")
        label_col = next((c for c in reader.fieldnames if c.startswith("label")), None)
        out = []
        for line, row in enumerate(reader, start=2):
            name = row["filename"]
            if not name:
                raise ValueError(f"{src}:{line}: empty filename")
            path = Path(name) if os.path.isabs(name) else src.parent / name
            out.append((path, row[label_col] if label_col else "0"))
    if not out:
        raise ValueError(f"{src}: empty index")
    return out


def synthetic_digits(n: int, seed: int = 0) -> list[tuple[bytes, str]]:
    """n 28x28 grayscale PNGs of drawn digits, about MNIST's file size."""
    from PIL import Image, ImageDraw, ImageFont

    rng = random.Random(seed)
    font = ImageFont.load_default()
    out = []
    for i in range(n):
        label = i % 10
        glyph = Image.new("L", (8, 12))
        ImageDraw.Draw(glyph).text((1, 0), str(label), fill=255, font=font)
        size = rng.randint(14, 20)
        glyph = glyph.resize((size * 2 // 3, size), Image.BILINEAR)
        glyph = glyph.rotate(rng.uniform(-15, 15), Image.BILINEAR, expand=True)
        img = Image.new("L", (28, 28))
        img.paste(glyph, (rng.randint(2, 28 - glyph.width), rng.randint(0, 28 - glyph.height)))
        buf = io.BytesIO()
        img.save(buf, format="PNG")
        out.append((buf.getvalue(), str(label)))
    return out


def default_source() -> Path | None:
    """examples/data/mnist/train.csv, running examples/prepare_mnist.py once if needed."""
    if MNIST_CSV.exists():
        return MNIST_CSV
    if PREPARE_MNIST.exists():
        log.info("preparing MNIST with %s", PREPARE_MNIST)
        subprocess.run([sys.executable, str(PREPARE_MNIST)], cwd=REPO, check=True)
        if MNIST_CSV.exists():
            return MNIST_CSV
        log.warning("%s ran but %s is missing", PREPARE_MNIST, MNIST_CSV)
    return None


def prepare(
    out: str | os.PathLike,
    n: int,
    source: str | os.PathLike | None = None,
    synthetic: bool = False,
    shard_size: int = 1000,
) -> BenchData:
    """Build (or reuse) the served folder with n samples as files and as tar shards."""
    out = Path(out)
    if synthetic:
        src_name = "synthetic"
    else:
        source = Path(source) if source else default_source()
        if source is None:
            raise FileNotFoundError(
                f"no MNIST at {MNIST_CSV} and no {PREPARE_MNIST}: pass --data or --synthetic"
            )
        src_name = str(Path(source).resolve())
    want = {"source": src_name, "n": n, "shard_size": shard_size, "version": 1}
    meta_path = out / "meta.json"
    if meta_path.exists():
        meta = json.loads(meta_path.read_text())
        if {k: meta.get(k) for k in want} == want:
            return BenchData(out, meta["count"], src_name, meta["shards"], meta["bytes"])
    if out.exists():
        shutil.rmtree(out)
    (out / "img").mkdir(parents=True)
    (out / "shards").mkdir()

    if synthetic:
        samples = [(data, label, None) for data, label in synthetic_digits(n)]
    else:
        pairs = read_source(source)
        if len(pairs) < n:
            log.warning("%s has %d items, fewer than %d: using all", source, len(pairs), n)
        # evenly spaced, so a subset of a label-sorted index still holds every label
        picks = [i * len(pairs) // n for i in range(n)] if len(pairs) > n else range(len(pairs))
        samples = [(None, pairs[i][1], pairs[i][0]) for i in picks]

    labels = sorted({label for _, label, _ in samples})
    label_id = {label: i for i, label in enumerate(labels)}
    rows, total = [], 0
    for i, (data, label, path) in enumerate(samples):
        suffix = path.suffix.lower() if path is not None else ".png"
        rel = f"img/{i:06d}{suffix}"
        dest = out / rel
        if data is not None:
            dest.write_bytes(data)
        else:
            try:  # a hard link costs no space and no copy time
                os.link(path, dest)
            except OSError:
                shutil.copyfile(path, dest)
        total += dest.stat().st_size
        rows.append((rel, label_id[label]))
    with open(out / "index.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["filename", "label"])
        w.writerows(rows)

    shards = write_shards(out, rows, shard_size)
    meta = dict(want, count=len(rows), shards=shards, bytes=total, labels=labels)
    meta_path.write_text(json.dumps(meta, indent=1))
    log.info(
        "prepared %d samples (%.1f MiB) and %d shards in %s",
        len(rows),
        total / 2**20,
        len(shards),
        out,
    )
    return BenchData(out, len(rows), src_name, shards, total)


def write_shards(out: Path, rows: list[tuple[str, int]], shard_size: int) -> list[str]:
    """Pack the samples, in index order, into tar shards of `shard_size` with webdataset."""
    import webdataset as wds

    shards = []
    for start in range(0, len(rows), shard_size):
        rel = f"shards/mnist-{start // shard_size:06d}.tar"
        with wds.TarWriter(str(out / rel)) as sink:
            for i, (name, label) in enumerate(rows[start : start + shard_size], start=start):
                ext = Path(name).suffix.lstrip(".")
                sink.write({"__key__": f"{i:06d}", ext: (out / name).read_bytes(), "cls": label})
        shards.append(rel)
    return shards
