"""Train on a folder of your own images: a CSV index, N processes, a random crop and flip.

    examples/own_images.sh PHOTOS              # the venv, the index, 2 processes under torchrun

or step by step, in the activated venv:

    python examples/own_images.py index PHOTOS --out examples/output/own_images
    torchrun --standalone --nproc-per-node=2 examples/own_images.py train \\
        examples/output/own_images/train.csv --val examples/output/own_images/val.csv

PHOTOS holds one sub-folder per class (PHOTOS/cat/*.jpg, PHOTOS/dog/*.jpg), as for
torchvision's ImageFolder; JPEG, PNG and whatever else Pillow reads. `index` writes two
CSV indexes of absolute paths (every `--val-every`-th image of a class goes to
val.csv): the same files could list URLs on a CDN or an S3 bucket instead, and every
rank opens its own partition of them. `train` trains a small convolutional network
with AllReduceSGD, each rank on its partition, with a random crop and a coin-flip
mirror drawn per image; rank 0 prints a line per epoch and saves OUT/model.pt.
"""

from __future__ import annotations

import argparse
import csv
import io
import logging
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch import nn

from distlearn import AllReduceSGD, ipc
from distlearn.dataset import Dataset, item_rng

EXTENSIONS = {".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff"}


# ----------------------------------------------------------------------- the index


def write_index(photos: Path, out: Path, val_every: int) -> tuple[int, int, int]:
    """train.csv and val.csv in `out`: filename (absolute path), label (the sub-folder).

    Returns (classes, train images, val images)."""
    classes = sorted(d for d in photos.iterdir() if d.is_dir() and not d.name.startswith("."))
    if len(classes) < 2:
        raise SystemExit(
            f"{photos}: need one sub-folder per class, at least two; found "
            f"{[d.name for d in classes]}"
        )
    out.mkdir(parents=True, exist_ok=True)
    counts = [0, 0]
    with (
        open(out / "train.csv", "w", newline="") as tf,
        open(out / "val.csv", "w", newline="") as vf,
    ):
        writers = [csv.writer(tf), csv.writer(vf)]
        for w in writers:
            w.writerow(["filename", "label"])
        for label in classes:
            files = sorted(
                p
                for p in label.rglob("*")
                if p.suffix.lower() in EXTENSIONS and not p.name.startswith(".")
            )
            for i, path in enumerate(files):
                split = 1 if val_every and i % val_every == val_every - 1 else 0
                writers[split].writerow([str(path.resolve()), label.name])
                counts[split] += 1
    return len(classes), counts[0], counts[1]


# ----------------------------------------------------------------------- the processor


# --8<-- [start:processor]
class RandomCropFlip:
    """One image into its batch row ``out`` ([3, size, size], values in [0, 1]).

    Training: the shorter side scaled to ``scale``, a random ``size`` x ``size`` crop,
    mirrored half the time. Evaluation (``train=False``): the centre crop. The draws come
    from ``item_rng()``, which is seeded per image (seed, partition, epoch, position), so
    an image gets the same crop whatever the number of workers, and again after a resume.
    A plain class: process workers receive it pickled.
    """

    def __init__(self, size: int, scale: int, train: bool = True):
        self.size, self.scale, self.train = size, scale, train

    def __call__(self, data: bytes, opt: object, out: torch.Tensor) -> bool:
        img = Image.open(io.BytesIO(data))
        img.draft("RGB", (self.scale, self.scale))  # a JPEG decodes at 1/2, 1/4, 1/8 if it can
        img = img.convert("RGB")
        k = self.scale / min(img.size)
        w, h = max(self.size, round(img.width * k)), max(self.size, round(img.height * k))
        img = img.resize((w, h), Image.BILINEAR)
        if self.train:
            rng = item_rng()
            x, y = int(rng.integers(0, w - self.size + 1)), int(rng.integers(0, h - self.size + 1))
        else:
            x, y = (w - self.size) // 2, (h - self.size) // 2
        img = img.crop((x, y, x + self.size, y + self.size))
        if self.train and rng.random() < 0.5:
            img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        # HWC bytes -> CHW floats, written straight into the batch
        np.multiply(np.asarray(img).transpose(2, 0, 1), np.float32(1 / 255), out=out.numpy())
        return True


# --8<-- [end:processor]


# ----------------------------------------------------------------------- training


def make_model(classes: int) -> nn.Module:
    def block(cin: int, cout: int) -> list[nn.Module]:
        return [nn.Conv2d(cin, cout, 3, stride=2, padding=1), nn.BatchNorm2d(cout), nn.ReLU()]

    layers = [*block(3, 32), *block(32, 64), *block(64, 128), *block(128, 128)]
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, classes))


def train(args: argparse.Namespace) -> None:
    tree = ipc.Tree.from_env()  # torchrun's RANK/WORLD_SIZE; one process without a launcher
    rank, world = tree.node_index, tree.num_nodes
    cores = len(os.sched_getaffinity(0))
    torch.set_num_threads(max(1, cores // world))
    workers = args.workers if args.workers is not None else max(1, cores // world - 1)

    ds = Dataset(args.index, partition=rank, partitions=world)
    labels = list(ds.index.labels)  # sorted names: the same on every rank
    batches = ds.sampled_batcher(
        batch_size=args.batch_size,
        input_dims=(3, args.size, args.size),
        sampler="permutation",
        processor=RandomCropFlip(args.size, args.scale),
        seed=args.seed,
        num_workers=workers,
    )
    model = make_model(len(labels))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4)
    sgd = AllReduceSGD(tree)
    sgd.synchronize_parameters(model)  # every rank starts from rank 0's weights
    if rank == 0:
        print(
            f"own_images.py: {len(labels)} classes, {world} processes, "
            f"{workers} loader worker(s) each",
            flush=True,
        )
    for epoch in range(args.epochs):
        start = time.perf_counter()
        model.train()
        seen = torch.zeros(3)  # loss sum, correct, images
        for batch in batches:  # one epoch of this rank's partition
            opt.zero_grad()
            logits = model(batch.input)
            loss = F.cross_entropy(logits, batch.target)
            loss.backward()
            sgd.sum_and_normalize_gradients(model)  # the mean over the ranks
            opt.step()
            n = len(batch.target)
            seen += torch.tensor([loss.item() * n, (logits.argmax(1) == batch.target).sum(), n])
        sgd.synchronize_parameters(model, opt)  # uneven partitions end equal (momentum too)
        tree.all_reduce(seen)
        if rank == 0:
            line = (
                f"epoch {epoch}: train loss {seen[0] / seen[2]:.4f}, "
                f"accuracy {100 * seen[1] / seen[2]:.1f}% over {seen[2]:.0f} images"
            )
            if args.val:
                correct, total = evaluate(model, args, labels)
                line += f"; val accuracy {100 * correct / total:.1f}% over {total} images"
            print(f"{line} ({time.perf_counter() - start:.1f} s)", flush=True)
        tree.barrier()  # the others wait while rank 0 evaluates
    if rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        torch.save({"model": model.state_dict(), "labels": labels}, args.out / "model.pt")
        print(f"own_images.py: saved {args.out / 'model.pt'}", flush=True)
    batches.close()
    tree.close()


@torch.no_grad()
def evaluate(model: nn.Module, args: argparse.Namespace, labels: list[str]) -> tuple[int, int]:
    """Rank 0's accuracy on the whole val index (centre crops)."""
    model.eval()
    ds = Dataset(args.val, partition=0, partitions=1)
    ids = torch.tensor([labels.index(name) for name in ds.index.labels])  # val ids -> train ids
    correct = total = 0
    with ds.sampled_batcher(
        batch_size=args.batch_size,
        input_dims=(3, args.size, args.size),
        processor=RandomCropFlip(args.size, args.scale, train=False),
        workers="thread",
        num_workers=0,
    ) as batches:
        for batch in batches:
            pred = model(batch.input).argmax(1)
            correct += int((pred == ids[batch.target]).sum())
            total += len(batch.target)
    return correct, total


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    ix = sub.add_parser("index", help="write train.csv and val.csv for a folder of images")
    ix.add_argument("photos", type=Path, help="one sub-folder per class")
    ix.add_argument("--out", type=Path, default=Path("examples/output/own_images"))
    ix.add_argument(
        "--val-every",
        type=int,
        default=10,
        help="every N-th image of a class goes to val.csv (0: none)",
    )
    tr = sub.add_parser("train", help="train on an index (under torchrun for several processes)")
    tr.add_argument("index", help="train.csv: a path or URL")
    tr.add_argument("--val", help="val.csv: evaluated by rank 0 after every epoch")
    tr.add_argument("--out", type=Path, default=Path("examples/output/own_images"))
    tr.add_argument("--epochs", type=int, default=10)
    tr.add_argument("--batch-size", type=int, default=32, help="per process")
    tr.add_argument("--lr", type=float, default=0.05)
    tr.add_argument("--size", type=int, default=64, help="the crop's side in pixels")
    tr.add_argument("--scale", type=int, help="the shorter side before cropping (size * 8/7)")
    tr.add_argument("--workers", type=int, help="loader processes per rank")
    tr.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    if args.command == "index":
        if not args.photos.is_dir():
            p.error(f"{args.photos} is not a folder")
        if args.val_every == 1 or args.val_every < 0:
            p.error("--val-every must be 0 (no val.csv) or at least 2")
        classes, n_train, n_val = write_index(args.photos, args.out, args.val_every)
        print(
            f"own_images.py: {classes} classes, {n_train} training images in "
            f"{args.out / 'train.csv'}, {n_val} in {args.out / 'val.csv'}"
        )
        if n_val == 0:
            (args.out / "val.csv").unlink()
        return
    args.scale = args.scale or round(args.size * 8 / 7)
    if args.scale < args.size:
        p.error(f"--scale {args.scale} is smaller than --size {args.size}")
    train(args)


if __name__ == "__main__":
    main(sys.argv[1:])
