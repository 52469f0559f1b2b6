"""dataset: an index of records drives samplers, async fetching and parallel decoding.

    from distlearn.dataset import Dataset
    from distlearn.dataset.processors import Image

    ds = Dataset("http://host/mnist/train.csv", partition=rank, partitions=world)
    batcher = ds.sampled_batcher(batch_size=128, input_dims=(1, 28, 28),
                                 sampler="permutation", processor=Image(mode="L"))
    for batch in batcher:          # one epoch of this partition
        step(batch.input, batch.target)

Data flow: Index -> Sampler (main process) -> Fetcher (asyncio + aiohttp) ->
processors writing into preallocated batch tensors (threads or processes) ->
batch ring (``prefetch`` in flight) -> user, in sampler order.
"""

from __future__ import annotations

if __name__ != "distlearn.dataset":
    # The folder dataset/ of a distlearn checkout was found as a top-level module
    # (the checkout is on sys.path). Importing it under a second name would give
    # every module, and every registry in them, a second copy.
    raise ImportError(
        f"{__file__} is distlearn.dataset; import it as `from distlearn import dataset` "
        "(PyPI's `dataset` is another project)"
    )

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

__all__ = [
    "AllFailed",
    "BadIndex",
    "Batch",
    "Dataset",
    "FetchError",
    "Fetcher",
    "Index",
    "Record",
    "SampledBatcher",
    "open_index",
    "register_sampler",
]

# Imported on first use (PEP 562), so `python -m distlearn.dataset.serve` and tools that only
# need a submodule start without paying for torch.
_LAZY = {
    "AllFailed": "batcher",
    "Batch": "batcher",
    "Record": "batcher",
    "SampledBatcher": "batcher",
    "Fetcher": "fetch",
    "FetchError": "fetch",
    "BadIndex": "index",
    "Index": "index",
    "open_index": "index",
    "register_sampler": "sampler",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if TYPE_CHECKING:
    from .batcher import AllFailed, Batch, Record, SampledBatcher
    from .fetch import Fetcher, FetchError
    from .index import BadIndex, Index, open_index
    from .sampler import register_sampler


def _auto_partition(partition: Any, partitions: int | None) -> tuple[int, int]:
    if partition == "auto":
        try:
            rank = int(os.environ.get("RANK", "0"))
            world = int(os.environ.get("WORLD_SIZE", "1"))
        except ValueError as err:
            raise ValueError(
                f"partition='auto': RANK/WORLD_SIZE must be integers ({err})"
            ) from None
        return rank, world
    if isinstance(partition, bool) or not isinstance(partition, int):
        raise TypeError(f"partition must be an int or 'auto', got {partition!r}")
    return partition, 1 if partitions is None else partitions


class Dataset:
    """An index, partitioned for one rank, that makes batchers.

    ``index``: a .csv/.tsv path or URL (local, http(s)://, any fsspec URL), a
    directory (labels = sub-folder names), a tensor, ``dict(x=, y=)``, a .pt file,
    or a list of these joined item by item (see :mod:`dataset.index`).
    ``partition`` is 0-based like a torch rank; ``"auto"`` reads RANK/WORLD_SIZE.
    ``sep``, ``meta`` (an ``index-meta.csv`` location) and ``url_params`` (a query
    string for every http(s) URL) tune CSV indexes. A folder or fsspec URL of
    part files (or a brace pattern) takes the options of :mod:`dataset.parts`
    (``record_format``, ``resident_parts``, ``label_key``, ``storage_options``...).
    ``cache_items=True`` caches fetched items on disk (``cache_dir``,
    ``max_cache_bytes``), and ``cache_index=True`` the remote index files, so a
    restarted job or the other ranks of a host read them from local disk.
    Other options become defaults for :meth:`sampled_batcher`.
    """

    def __init__(
        self,
        index: Any,
        partition: int | str = 0,
        partitions: int | None = None,
        *,
        sep: str | None = None,
        meta: str | None = None,
        url_params: str | dict | None = None,
        **opts: Any,
    ):
        from . import parts
        from .cache import Cache, item_cache
        from .index import BadIndex, open_index

        self.partition, self.partitions = _auto_partition(partition, partitions)
        index_cache = None
        if opts.pop("cache_index", False):  # remote index/meta/.pt files kept on local disk
            index_cache = Cache(opts.get("cache_dir"), opts.get("max_cache_bytes"))
        whole = parts.dataset_index(index, opts)  # a folder/URL of part files
        if whole is None:
            whole = open_index(index, sep=sep, meta=meta, url_params=url_params, cache=index_cache)
        cache = item_cache(opts)  # cache_items=True, cache_dir=, max_cache_bytes=
        if cache is not None:
            opts.setdefault("cache", cache)
        self.index: Index = whole.partition(self.partition, self.partitions)
        if len(self.index) == 0:
            raise BadIndex(
                f"{whole.origin}: partition {self.partition} of {self.partitions} is empty "
                f"(the index has {len(whole)} items)"
            )
        self.opts = opts

    def __repr__(self) -> str:
        return (
            f"Dataset({self.index.origin!r}, partition={self.partition}, "
            f"partitions={self.partitions}, items={len(self.index)})"
        )

    def __len__(self) -> int:
        return len(self.index)

    def sampled_batcher(
        self,
        batch_size: int = 32,
        input_dims: Sequence[int] = (),
        sampler: Any = "linear",
        processor: Any = None,
        processor_opt: Any = None,
        pool_size: int | None = None,
        prefetch: int = 2,
        seed: int = 0,
        **opts: Any,
    ) -> SampledBatcher:
        """Batches of this partition in sampler order; see :class:`SampledBatcher` for options.

        ``sampler``: a registered name (``linear``, ``permutation``, ``uniform``,
        ``label-uniform``, ``label-permutation``, ``label-distribution``) or a
        callable ``(index, epoch, rng, **sampler_opt) -> iterable``. For a list
        of indexes, a list with one entry per index: entry 0 drives the epoch,
        entry k is None (item i of the first fetches item i of index k) or a
        sampler that draws index k's item, from all of index k whatever the
        partition (``sampler=["permutation", "uniform"]``, ``sampler_opt`` a
        list too or a dict for the first).
        ``processor(fetched, opt, out) -> bool | (bool, extra)`` decodes one item
        into ``out``. ``pool_size``: concurrent fetches per worker. ``prefetch``:
        batches in flight. ``workers="thread" | "process"``, ``num_workers``,
        ``sampler_opt``, ``timeout``, ``retries``, ``cache``, ``progress``,
        ``drop_last`` and ``mp_context`` are further options.
        """
        from .batcher import SampledBatcher
        from .parts import default_sampler

        kw = {**self.opts, **opts}
        sampler = default_sampler(self.index, sampler)
        return SampledBatcher(
            self.index,
            batch_size=batch_size,
            input_dims=input_dims,
            sampler=sampler,
            processor=processor,
            processor_opt=processor_opt,
            pool_size=pool_size,
            prefetch=prefetch,
            seed=seed,
            partition=self.partition,
            **kw,
        )
