"""Loader rows: each turns the prepared data into float batches [128, 1, 28, 28], one epoch.

A row is a generator function `row(ctx, **params)` that yields batches (a tensor,
or a sample count for the byte-only ceilings). It runs in a fresh process (see
bench/child.py), and everything it does, start-up included, is timed: the
generator body only starts on the first `next()`. Peers are written the way their
documentation recommends, with the obvious speed-ups a careful user would make
(one HTTP session per worker, decoding in the workers, batching in the workers).
"""

from __future__ import annotations

import asyncio
import io
import multiprocessing as mp
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image as PILImage


@dataclass
class Ctx:
    """What a row needs to know about the data and the server."""

    base_url: str  # http://127.0.0.1:PORT/ serving the prepared folder
    root: str  # the prepared folder on disk
    files: list[str]  # relative filenames, index order
    labels: list[int]
    shards: list[str]  # relative shard paths
    batch_size: int = 128

    @property
    def urls(self) -> list[str]:
        return [self.base_url + f for f in self.files]


def decode_gray(data: bytes) -> np.ndarray:
    """PNG/JPEG bytes -> uint8 array [28, 28]: the decode of every peer and ceiling row."""
    with PILImage.open(io.BytesIO(data)) as img:
        return np.asarray(img.convert("L"))


def to_batch(u8: np.ndarray) -> torch.Tensor:
    """uint8 [n, 28, 28] -> float [n, 1, 28, 28] in [0, 1]."""
    return torch.from_numpy(u8).unsqueeze(1).float().div_(255.0)


ROWS: dict[str, Callable[..., Iterator]] = {}
SETUP: dict[str, Callable[[Ctx], object]] = {}


def row(name: str, setup: Callable[[Ctx], object] | None = None):
    """Register a row under `name`; `setup(ctx)` runs untimed and its result is passed in."""

    def register(fn):
        ROWS[name] = fn
        if setup is not None:
            SETUP[name] = setup
        return fn

    return register


# ---------------------------------------------------------------- ceilings


def _read_all(ctx: Ctx) -> list[bytes]:
    from pathlib import Path

    return [Path(ctx.root, f).read_bytes() for f in ctx.files]


@row("pil-decode", setup=_read_all)
def pil_decode(ctx: Ctx, prepared: list[bytes]) -> Iterator[torch.Tensor]:
    """Decode ceiling: PIL on bytes already in memory, one thread, no I/O at all."""
    bs = ctx.batch_size
    for start in range(0, len(prepared), bs):
        chunk = prepared[start : start + bs]
        u8 = np.empty((len(chunk), 28, 28), np.uint8)
        for j, data in enumerate(chunk):
            u8[j] = decode_gray(data)
        yield to_batch(u8)


async def _fetch_urls(urls: list[str], decode: bool, concurrency: int, bs: int, report) -> None:
    """Fetch `urls` with one aiohttp session and `concurrency` tasks; report(count or batch)."""
    import aiohttp

    conn = aiohttp.TCPConnector(limit=concurrency, force_close=False)
    timeout = aiohttp.ClientTimeout(total=60)
    todo = iter(range(len(urls)))
    u8 = np.empty((bs, 28, 28), np.uint8)
    filled = 0

    async def worker(session):
        nonlocal filled, u8
        for i in todo:  # a shared iterator: each task takes the next index
            async with session.get(urls[i]) as resp:
                resp.raise_for_status()
                data = await resp.read()
            if decode:
                u8[filled] = decode_gray(data)
            filled += 1
            if filled == bs:
                report(to_batch(u8) if decode else bs)
                u8 = np.empty((bs, 28, 28), np.uint8)
                filled = 0

    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
    if filled:
        report(to_batch(u8[:filled]) if decode else filled)


def _fetch_proc(urls, decode, concurrency, bs, q) -> None:
    # batches cross the process boundary as counts: the ceiling is fetch(+decode), not pickling
    try:
        asyncio.run(
            _fetch_urls(
                urls, decode, concurrency, bs, lambda b: q.put(b if isinstance(b, int) else len(b))
            )
        )
    finally:
        q.put(None)  # the parent stops waiting even when this process failed


@row("aiohttp")
def aiohttp_ceiling(
    ctx: Ctx, procs: int = 1, decode: bool = False, concurrency: int = 64
) -> Iterator[torch.Tensor | int]:
    """Fetch ceiling: bare aiohttp (and PIL) in `procs` processes, no batching machinery.

    Each process takes an equal slice of the URLs, fills uint8 batches and reports
    counts back; this process only waits, so 1 and 2 processes compare directly.
    """
    urls = ctx.urls
    mpq = mp.get_context("fork").Queue()
    workers = [
        mp.get_context("fork").Process(
            target=_fetch_proc, args=(urls[k::procs], decode, concurrency, ctx.batch_size, mpq)
        )
        for k in range(procs)
    ]
    for w in workers:
        w.start()
    try:
        done = 0
        while done < procs:
            b = mpq.get(timeout=120)
            if b is None:
                done += 1
            else:
                yield b
    finally:
        for w in workers:
            w.join(timeout=10)
            if w.is_alive():
                w.terminate()
        for w in workers:
            if w.exitcode not in (0, None):
                raise RuntimeError(f"aiohttp ceiling process exited with {w.exitcode}")


# ---------------------------------------------------------------- peers


class HTTPImages(torch.utils.data.Dataset):
    """The map-style Dataset most users write: requests + PIL per item, a Session per worker."""

    def __init__(self, urls: list[str], labels: list[int]):
        self.urls, self.labels = urls, labels
        self.session = None

    def __len__(self) -> int:
        return len(self.urls)

    def __getitem__(self, i: int):
        import requests

        if self.session is None:  # created in the worker, after fork
            self.session = requests.Session()
        resp = self.session.get(self.urls[i], timeout=60)
        resp.raise_for_status()
        x = torch.from_numpy(decode_gray(resp.content)).unsqueeze(0).float().div_(255.0)
        return x, self.labels[i]


@row("dataloader-requests")
def dataloader_requests(ctx: Ctx, num_workers: int = 4) -> Iterator[torch.Tensor]:
    """Peer: torch DataLoader over HTTPImages."""
    loader = torch.utils.data.DataLoader(
        HTTPImages(ctx.urls, ctx.labels),
        batch_size=ctx.batch_size,
        num_workers=num_workers,
        shuffle=False,
    )
    for x, _ in loader:
        yield x


def _wds_sample(sample: dict) -> tuple[torch.Tensor, int]:
    data = next(v for k, v in sample.items() if k in ("png", "jpg", "jpeg"))
    return torch.from_numpy(decode_gray(data)).unsqueeze(0), int(sample["cls"])


def _wds_collate(samples: list) -> tuple[torch.Tensor, torch.Tensor]:
    xs, ys = zip(*samples, strict=True)
    return torch.stack(xs).float().div_(255.0), torch.tensor(ys)


@row("webdataset")
def webdataset_http(ctx: Ctx, num_workers: int = 4) -> Iterator[torch.Tensor]:
    """Peer: WebDataset over the tar shards via HTTP, decode and batch in the workers."""
    import webdataset as wds

    urls = [ctx.base_url + s for s in ctx.shards]
    pipeline = (
        wds.WebDataset(urls, shardshuffle=False, empty_check=False)
        .map(_wds_sample)
        .batched(ctx.batch_size, collation_fn=_wds_collate, partial=True)
    )
    loader = wds.WebLoader(pipeline, batch_size=None, num_workers=num_workers)
    for x, _ in loader:
        yield x


# ---------------------------------------------------------------- distlearn


def _batches(ds, ctx: Ctx, sampler: str, processor, **opts) -> Iterator[torch.Tensor]:
    batcher = ds.sampled_batcher(
        batch_size=ctx.batch_size,
        input_dims=(1, 28, 28),
        sampler=sampler,
        processor=processor,
        **{k: v for k, v in opts.items() if v is not None},  # None: the library's default
    )
    try:
        for batch in batcher:
            yield batch.input
    finally:
        batcher.close()


@row("dataset-csv")
def dataset_csv(ctx: Ctx, workers: str | None = None, pool_size: int | None = None, **opts):
    """distlearn Dataset over the CSV index via HTTP (one request per file)."""
    from distlearn.dataset import Dataset, processors

    ds = Dataset(ctx.base_url + "index.csv")
    processor = processors.Image(mode="L")
    yield from _batches(ds, ctx, "linear", processor, workers=workers, pool_size=pool_size, **opts)


def shard_pattern(ctx: Ctx) -> str:
    """All shards as one brace URL (http://host/shards/mnist-{000000..000019}.tar): no listing."""
    if len(ctx.shards) == 1:
        return ctx.base_url + ctx.shards[0]
    stem, first = ctx.shards[0].removesuffix(".tar").rsplit("-", 1)
    last = ctx.shards[-1].removesuffix(".tar").rsplit("-", 1)[1]
    return f"{ctx.base_url}{stem}-{{{first}..{last}}}.tar"


@row("dataset-shards")
def dataset_shards(ctx: Ctx, workers: str | None = None, pool_size: int | None = None, **opts):
    """distlearn Dataset over the tar shards via HTTP (part files, each read in one request).

    The part cache is off, so every repetition reads over HTTP like WebDataset does.
    """
    from distlearn.dataset import Dataset, processors
    from distlearn.dataset.index import parts

    ds = Dataset(shard_pattern(ctx), cache_parts=False)
    processor = parts.SampleMember(processors.Image(mode="L"))
    yield from _batches(
        ds, ctx, "part-linear", processor, workers=workers, pool_size=pool_size, **opts
    )
