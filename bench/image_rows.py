"""Image loader rows: each makes a loader whose every `for` is one epoch of float [n, 3, 224, 224].

A row is `make(ctx, **params) -> loader`, registered with `@row`; `iter(loader)`
starts an epoch, so the child (bench/image_child.py) times a cold first epoch
(construction included) and a warm second one on the same loader, as a training
job sees them. Rows run in the venv their peer needs (`venv`), so this module
imports only numpy, Pillow and torch at the top; each peer is imported inside its
row. Every row decodes with Pillow (the scaled rows with Pillow's draft mode) and
applies bench/image_aug.py's augmentation, so only the loading differs. Peers are
written the way their documentation shows, with the settings a careful user
would pick (persistent workers, decoding in the workers, one HTTP session per
worker), and no shuffling anywhere, so every row reads the same bytes in order.
"""

from __future__ import annotations

import io
import math
import multiprocessing as mp
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from PIL import Image as PILImage

from bench.image_aug import SIZE, augment, crop_box, flip_draw, hwc_to_chw
from bench.image_aug import resize_crop_flip_normalize as finish

BUCKET = "bench-images"


@dataclass
class Ctx:
    """What a row needs to know about the data and the servers."""

    base_url: str  # nginx serving the prepared folder
    root: str  # the prepared folder on disk
    files: list[str]  # relative filenames, index order
    labels: list[int]
    shards: list[str]  # relative tar shard paths
    batch_size: int = 64
    s3_endpoint: str = ""  # moto's http://127.0.0.1:PORT, holding BUCKET
    cache_dir: str = ""  # a fresh empty folder per run, for the peers' local caches
    s3: dict = field(default_factory=dict)  # prefixes in BUCKET: {"mds": ..., "litdata": ...}

    @property
    def urls(self) -> list[str]:
        return [self.base_url + f for f in self.files]


@dataclass
class Row:
    make: Callable[..., Iterable]
    venv: str | None = None  # None: the project's .venv; else ".venv-<peer>"
    setup: Callable[[Ctx], object] | None = None  # untimed; its result is the 2nd argument


ROWS: dict[str, Row] = {}


def row(name: str, venv: str | None = None, setup: Callable[[Ctx], object] | None = None):
    def register(fn):
        ROWS[name] = Row(fn, venv, setup)
        return fn

    return register


# ---------------------------------------------------------------- the work of every row


def decode_full(data: bytes) -> torch.Tensor:
    """JPEG bytes -> uint8 [3, H, W] (a view of Pillow's full-size decode)."""
    with PILImage.open(io.BytesIO(data)) as img:
        if img.mode != "RGB":
            img = img.convert("RGB")
        return hwc_to_chw(np.asarray(img))


def process(data: bytes, out: torch.Tensor | None = None) -> torch.Tensor:
    """The naive work: full decode, then RandomResizedCrop + flip + normalise."""
    return augment(decode_full(data), out)


def process_scaled(data: bytes, out: torch.Tensor | None = None) -> torch.Tensor:
    """The same work with the crop drawn first and the JPEG decoded at the smallest DCT scale
    (1/2, 1/4, 1/8) that still leaves the crop at least SIZE px a side (Pillow's draft)."""
    with PILImage.open(io.BytesIO(data)) as img:
        width, height = img.size
        top, left, h, w = crop_box(height, width)
        flip = flip_draw()
        img.draft("RGB", (math.ceil(width * SIZE / w), math.ceil(height * SIZE / h)))
        sx, sy = img.size[0] / width, img.size[1] / height
        if img.mode != "RGB":
            img = img.convert("RGB")
        chw = hwc_to_chw(np.asarray(img))
    box = (int(top * sy), int(left * sx), max(1, round(h * sy)), max(1, round(w * sx)))
    if out is None:
        out = torch.empty(3, SIZE, SIZE)
    return finish(chw, box, flip, out)


def process_simplejpeg(data: bytes, out: torch.Tensor | None = None) -> torch.Tensor:
    """process_scaled with libjpeg-turbo called by simplejpeg: it decodes straight into a
    numpy array (Pillow decodes into its own RGBX storage, then repacks it to RGB)."""
    import simplejpeg

    height, width = simplejpeg.decode_jpeg_header(data)[:2]
    top, left, h, w = crop_box(height, width)
    flip = flip_draw()
    arr = simplejpeg.decode_jpeg(
        data, colorspace="RGB", min_width=math.ceil(width * SIZE / w),
        min_height=math.ceil(height * SIZE / h),
    )  # fmt: skip
    sy, sx = arr.shape[0] / height, arr.shape[1] / width
    box = (int(top * sy), int(left * sx), max(1, round(h * sy)), max(1, round(w * sx)))
    if out is None:
        out = torch.empty(3, SIZE, SIZE)
    return finish(hwc_to_chw(arr), box, flip, out)


WORK = {"full": process, "scaled": process_scaled, "simplejpeg": process_simplejpeg}


def collate(samples: list) -> tuple[torch.Tensor, torch.Tensor]:
    xs, ys = zip(*samples, strict=True)
    return torch.stack(xs), torch.tensor(ys)


class Epochs:
    """A loader made of a function: each `iter()` calls it for a new epoch."""

    def __init__(self, fn: Callable[[], Iterator], close: Callable[[], None] | None = None):
        self.fn, self._close = fn, close

    def __iter__(self) -> Iterator:
        return self.fn()

    def close(self) -> None:
        if self._close is not None:
            self._close()


# ---------------------------------------------------------------- ceilings: no I/O at all


def _read_all(ctx: Ctx) -> list[bytes]:
    return [Path(ctx.root, f).read_bytes() for f in ctx.files]


def _ceiling_proc(chunk: list[bytes], work: str, bs: int, q) -> None:
    try:
        torch.set_num_threads(1)
        batch = torch.empty(bs, 3, SIZE, SIZE)
        fn = WORK[work]
        for start in range(0, len(chunk), bs):
            part = chunk[start : start + bs]
            for j, data in enumerate(part):
                fn(data, batch[j])
            q.put(len(part))
    finally:
        q.put(None)


@row("ceiling", setup=_read_all)
def ceiling(ctx: Ctx, prepared: list[bytes], procs: int = 1, work: str = "full") -> Epochs:
    """Decode + augment of bytes already in memory: in this process, or in `procs` forked
    processes each taking an equal slice and reporting counts (no hand-off at all)."""
    bs, fn = ctx.batch_size, WORK[work]
    torch.set_num_threads(1)

    def inline() -> Iterator[torch.Tensor]:
        for start in range(0, len(prepared), bs):
            part = prepared[start : start + bs]
            batch = torch.empty(len(part), 3, SIZE, SIZE)
            for j, data in enumerate(part):
                fn(data, batch[j])
            yield batch

    def forked() -> Iterator[int]:
        fork = mp.get_context("fork")
        q = fork.Queue()
        chunk = math.ceil(len(prepared) / procs)
        ps = [
            fork.Process(target=_ceiling_proc, args=(prepared[k * chunk : (k + 1) * chunk],
                                                     work, bs, q))
            for k in range(procs)
        ]  # fmt: skip
        for p in ps:
            p.start()
        try:
            done = 0
            while done < procs:
                n = q.get(timeout=300)
                if n is None:
                    done += 1
                else:
                    yield n
        finally:
            for p in ps:
                p.join(timeout=10)
                if p.is_alive():
                    p.terminate()
            bad = [p.exitcode for p in ps if p.exitcode not in (0, None)]
            if bad:
                raise RuntimeError(f"ceiling process exited with {bad}")

    return Epochs(inline if procs == 1 else forked)


# ---------------------------------------------------------------- peers over HTTP (nginx)


class HTTPImages(torch.utils.data.Dataset):
    """The map-style Dataset most users write: requests + PIL per item, a Session per worker."""

    def __init__(self, urls: list[str], labels: list[int], work: str = "full"):
        self.urls, self.labels, self.work = urls, labels, work
        self.session = None

    def __len__(self) -> int:
        return len(self.urls)

    def __getitem__(self, i: int):
        import requests

        if self.session is None:  # made in the worker, after the fork
            self.session = requests.Session()
        resp = self.session.get(self.urls[i], timeout=60)
        resp.raise_for_status()
        return WORK[self.work](resp.content), self.labels[i]


def _dataloader(dataset, ctx: Ctx, num_workers: int, **kw) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(
        dataset,
        batch_size=ctx.batch_size,
        num_workers=num_workers,
        persistent_workers=num_workers > 0,  # the second epoch keeps its workers
        **kw,
    )


def _inputs(loader: Iterable) -> Epochs:
    """Each epoch of `loader`, its batches' inputs only."""

    def epoch() -> Iterator[torch.Tensor]:
        for batch in loader:
            yield batch[0] if isinstance(batch, list | tuple) else batch

    return Epochs(epoch)


@row("dataloader-http")
def dataloader_http(ctx: Ctx, num_workers: int = 2, work: str = "full") -> Epochs:
    """Peer: torch DataLoader over per-file URLs (requests), PIL + the augmentation."""
    return _inputs(_dataloader(HTTPImages(ctx.urls, ctx.labels, work), ctx, num_workers))


def _wds_sample(sample: dict) -> tuple[torch.Tensor, int]:
    return process(sample["jpg"]), int(sample["cls"])


@row("webdataset")
def webdataset_http(ctx: Ctx, num_workers: int = 2) -> Epochs:
    """Peer: WebDataset over the tar shards via HTTP; decode, augment, batch in the workers."""
    import webdataset as wds

    urls = [ctx.base_url + s for s in ctx.shards]
    pipeline = (
        wds.WebDataset(urls, shardshuffle=False, empty_check=False)
        .map(_wds_sample)
        .batched(ctx.batch_size, collation_fn=collate, partial=True)
    )
    loader = wds.WebLoader(
        pipeline, batch_size=None, num_workers=num_workers, persistent_workers=num_workers > 0
    )
    return _inputs(loader)


class _FetchProcess:
    """torchdata's map function: index -> (augmented image, label), a Session per worker."""

    def __init__(self, urls: list[str], labels: list[int]):
        self.urls, self.labels, self.session = urls, labels, None

    def __call__(self, i: int):
        import requests

        if self.session is None:
            self.session = requests.Session()
        resp = self.session.get(self.urls[i], timeout=60)
        resp.raise_for_status()
        return process(resp.content), self.labels[i]


@row("torchdata", venv="torchdata")
def torchdata_nodes(ctx: Ctx, num_workers: int = 2, method: str = "thread") -> Epochs:
    """Peer: torchdata.nodes (0.11) over per-file URLs: ParallelMapper (threads or processes),
    Batcher, collate, Loader, in order."""
    from torchdata import nodes

    node = nodes.IterableWrapper(range(len(ctx.files)))
    node = nodes.ParallelMapper(node, map_fn=_FetchProcess(ctx.urls, ctx.labels),
                                num_workers=num_workers, method=method, in_order=True)  # fmt: skip
    node = nodes.Batcher(node, batch_size=ctx.batch_size, drop_last=False)
    node = nodes.Mapper(node, collate)
    return _inputs(nodes.Loader(node))


# ---------------------------------------------------------------- peers over S3 (moto)


def s3_env(endpoint: str) -> dict[str, str]:
    """What boto3, Mosaic and LitData read to reach moto (no real credentials exist here)."""
    return {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": endpoint,  # boto3 >= 1.28
        "S3_ENDPOINT_URL": endpoint,  # Mosaic Streaming
    }


def mosaic():
    """Mosaic Streaming's `streaming.base`, the part that reads and writes MDS.

    `import streaming` runs the package's __init__, which imports streaming.vision
    and with it torchvision, and PyPI's torchvision (a CUDA build) fails to import
    beside a CPU torch ("operator torchvision::nms does not exist"). So the
    package is entered without its __init__: Mosaic's own dataset, reader and
    writer code runs unchanged, only its vision helpers (unused here) are skipped.
    """
    import importlib.util
    import sys
    import types

    if "streaming" not in sys.modules:
        spec = importlib.util.find_spec("streaming")
        if spec is None or spec.submodule_search_locations is None:
            raise ImportError("mosaicml-streaming is not installed (scripts/peer-venv.sh mosaic)")
        pkg = types.ModuleType("streaming")
        pkg.__path__ = list(spec.submodule_search_locations)
        pkg.__file__ = spec.origin
        sys.modules["streaming"] = pkg
    import streaming.base

    return streaming.base


def write_mds(root: str, out: str, size_limit: int) -> None:
    """The images as Mosaic MDS shards (raw JPEG bytes + label), written by Mosaic itself."""
    import csv

    writer = mosaic().MDSWriter

    with open(Path(root, "index.csv"), newline="") as f:
        items = [(r["filename"], int(r["label"])) for r in csv.DictReader(f)]
    cols = {"jpg": "bytes", "cls": "int"}
    with writer(out=out, columns=cols, size_limit=size_limit, compression=None) as w:
        for name, label in items:
            w.write({"jpg": Path(root, name).read_bytes(), "cls": label})


class _MosaicImages:
    """Mosaic's documented way: subclass StreamingDataset, decode in __getitem__."""

    @staticmethod
    def make(remote: str, local: str, batch_size: int):
        class MosaicImages(mosaic().StreamingDataset):
            def __getitem__(self, i):
                sample = super().__getitem__(i)
                return process(sample["jpg"]), sample["cls"]

        return MosaicImages(remote=remote, local=local, shuffle=False, batch_size=batch_size)


@row("mosaic", venv="mosaic")
def mosaic_s3(ctx: Ctx, num_workers: int = 2) -> Epochs:
    """Peer: Mosaic Streaming reading MDS shards from S3 (moto) into a local cache."""
    remote = f"s3://{BUCKET}/{ctx.s3['mds']}"
    ds = _MosaicImages.make(remote, os.path.join(ctx.cache_dir, "mosaic"), ctx.batch_size)
    return _inputs(_dataloader(ds, ctx, num_workers))


def write_litdata(root: str, out: str, chunk_bytes: str) -> None:
    """The images as LitData chunks (raw JPEG bytes + label), written by litdata.optimize."""
    import csv

    from litdata import optimize

    with open(Path(root, "index.csv"), newline="") as f:
        items = [(str(Path(root, r["filename"])), int(r["label"])) for r in csv.DictReader(f)]
    optimize(
        fn=_litdata_item,
        inputs=items,
        output_dir=out,
        chunk_bytes=chunk_bytes,
        num_workers=1,
        mode="overwrite",
    )


def _litdata_item(item: tuple[str, int]) -> dict:
    return {"jpg": Path(item[0]).read_bytes(), "cls": item[1]}


@row("litdata", venv="litdata")
def litdata_s3(ctx: Ctx, num_workers: int = 2) -> Epochs:
    """Peer: LitData's StreamingDataset + StreamingDataLoader from S3 (moto), local cache."""
    import litdata

    allow_plain_http_s3()

    class LitImages(litdata.StreamingDataset):
        def __getitem__(self, i):
            sample = super().__getitem__(i)
            return process(sample["jpg"]), sample["cls"]

    ds = LitImages(
        f"s3://{BUCKET}/{ctx.s3['litdata']}",
        cache_dir=os.path.join(ctx.cache_dir, "litdata"),
        shuffle=False,
        storage_options={"endpoint_url": ctx.s3_endpoint},
    )
    loader = litdata.StreamingDataLoader(
        ds, batch_size=ctx.batch_size, num_workers=num_workers, persistent_workers=num_workers > 0
    )
    return _inputs(loader)


def allow_plain_http_s3() -> None:
    """Let LitData's obstore reads reach an http:// S3 endpoint (moto on 127.0.0.1).

    LitData reads index.json with boto3 but chunks with obstore, whose client
    refuses a plain-http endpoint ("BadScheme") unless its client options hold
    `allow_http`. LitData builds that client from a module constant and takes no
    option for it (storage_options go to boto3; obstore's S3Store reads no
    AWS_ALLOW_HTTP from the environment), so the constant gets the flag here,
    before the loader's workers fork. Over https nothing changes.
    """
    from litdata.streaming import downloader

    downloader._OBSTORE_CLIENT_OPTIONS = {**downloader._OBSTORE_CLIENT_OPTIONS, "allow_http": True}


# ---------------------------------------------------------------- distlearn


class BenchImage:
    """distlearn processor doing exactly the peers' work (bytes, or a tar sample's jpg)."""

    def __init__(self, work: str = "full"):
        self.work = work

    def __call__(self, fetched, opt, out: torch.Tensor) -> bool:
        data = fetched["jpg"] if isinstance(fetched, dict) else fetched
        WORK[self.work](data, out)
        return True


class JpgMember:
    """A tar sample's jpg member to `processor` (plain bytes pass through)."""

    def __init__(self, processor):
        self.processor = processor

    def __call__(self, fetched, opt, out: torch.Tensor):
        return self.processor(fetched["jpg"] if isinstance(fetched, dict) else fetched, opt, out)


def distlearn_processor(work: str):
    """`work` "package": the package's own RandomResizedCrop (the crop drawn before the
    decode, libjpeg-turbo via simplejpeg when installed, written into the batch row);
    else the peers' exact work (BenchImage)."""
    if work != "package":
        return BenchImage(work)
    from bench.image_aug import IMAGENET_MEAN, IMAGENET_STD, RATIO, SCALE
    from distlearn.dataset.processors import RandomResizedCrop

    return JpgMember(RandomResizedCrop(scale=SCALE, ratio=RATIO, flip=0.5, mean=IMAGENET_MEAN,
                                       std=IMAGENET_STD))  # fmt: skip


def _batcher_epochs(ds, ctx: Ctx, sampler: str, processor, **opts) -> Epochs:
    batcher = ds.sampled_batcher(
        batch_size=ctx.batch_size,
        input_dims=(3, SIZE, SIZE),
        sampler=sampler,
        processor=processor,
        **{k: v for k, v in opts.items() if v is not None},  # None: the library's default
    )

    def epoch() -> Iterator[torch.Tensor]:
        for batch in batcher:
            yield batch.input

    return Epochs(epoch, batcher.close)


@row("distlearn-csv")
def distlearn_csv(ctx: Ctx, work: str = "full", **opts) -> Epochs:
    """distlearn over the CSV index via HTTP: one request per file."""
    from distlearn.dataset import Dataset

    ds = Dataset(ctx.base_url + "index.csv")
    return _batcher_epochs(ds, ctx, "linear", distlearn_processor(work), **opts)


def shard_pattern(ctx: Ctx) -> str:
    """All shards as one brace URL (http://host/shards/photos-{000000..000009}.tar)."""
    stem, first = ctx.shards[0].removesuffix(".tar").rsplit("-", 1)
    last = ctx.shards[-1].removesuffix(".tar").rsplit("-", 1)[1]
    return f"{ctx.base_url}{stem}-{{{first}..{last}}}.tar"


@row("distlearn-shards")
def distlearn_shards(ctx: Ctx, work: str = "full", **opts) -> Epochs:
    """distlearn over the tar shards via HTTP, each shard read in one request; the part
    cache (its default) keeps them on local disk for the second epoch, as Mosaic's and
    LitData's caches do."""
    from distlearn.dataset import Dataset

    opts.setdefault("cache_dir", os.path.join(ctx.cache_dir, "distlearn"))
    ds = Dataset(shard_pattern(ctx), cache_dir=opts.pop("cache_dir"))
    return _batcher_epochs(ds, ctx, "part-linear", distlearn_processor(work), **opts)
