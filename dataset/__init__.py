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

import logging
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from . import options as _options

__all__ = [
    "AllFailed",
    "BadIndex",
    "Batch",
    "Dataset",
    "DatasetError",
    "FetchError",
    "Fetcher",
    "Index",
    "IndexNotFound",
    "PartError",
    "Record",
    "SampledBatcher",
    "WorkerDied",
    "item_rng",
    "item_seed",
    "open_index",
    "register_sampler",
]

# Imported on first use (PEP 562), so `python -m distlearn.dataset.serve` and tools that only
# need a submodule start without paying for torch.
_LAZY = {
    "AllFailed": "errors",
    "BadIndex": "errors",
    "DatasetError": "errors",
    "FetchError": "errors",
    "IndexNotFound": "errors",
    "PartError": "errors",
    "WorkerDied": "errors",
    "Batch": "batcher",
    "Record": "batcher",
    "SampledBatcher": "batcher",
    "Fetcher": "fetch",
    "Index": "index",
    "open_index": "index",
    "register_sampler": "sampler",
    "item_rng": "seeding",
    "item_seed": "seeding",
}

log = logging.getLogger(__name__)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if TYPE_CHECKING:
    from .batcher import Batch, Record, SampledBatcher
    from .errors import (
        AllFailed,
        BadIndex,
        DatasetError,
        FetchError,
        IndexNotFound,
        PartError,
        WorkerDied,
    )
    from .fetch import Fetcher
    from .index import Index, open_index
    from .sampler import register_sampler
    from .seeding import item_rng, item_seed


def _env_rank() -> tuple[int, int] | None:
    """(RANK, WORLD_SIZE) from the environment (torchrun), or None when not set."""
    if "WORLD_SIZE" not in os.environ:
        return None
    try:
        rank = int(os.environ.get("RANK", "0"))
        world = int(os.environ["WORLD_SIZE"])
    except ValueError as err:
        raise ValueError(f"RANK/WORLD_SIZE must be integers ({err})") from None
    return rank, world


def choose_partition(partition: Any, partitions: int | None) -> tuple[int, int, str]:
    """(partition, partitions, where they came from) for a Dataset.

    No partition arguments under torchrun (``WORLD_SIZE`` > 1) follow
    ``RANK``/``WORLD_SIZE``, as ``DistributedSampler`` follows the process
    group; ``partition="auto"`` reads them whatever ``WORLD_SIZE``; explicit
    numbers win (``partition=0, partitions=1`` is the whole index).
    """
    if partition is None and partitions is None:
        env = _env_rank()
        if env is not None and env[1] > 1:
            return env[0], env[1], "RANK/WORLD_SIZE"
        return 0, 1, "default"
    if partition == "auto":
        env = _env_rank() or (0, 1)
        return env[0], env[1], "RANK/WORLD_SIZE"
    if partition is None:
        partition = 0
    if isinstance(partition, bool) or not isinstance(partition, int):
        raise TypeError(f"partition must be an int or 'auto', got {partition!r}")
    return partition, 1 if partitions is None else partitions, "arguments"


class Dataset:
    """An index, partitioned for one rank, that makes batchers.

    ``index``: a .csv/.tsv path or URL (local, http(s)://, any fsspec URL), a
    directory (labels = sub-folder names), a tensor, ``dict(x=, y=)``, a .pt file,
    or a list of these joined item by item (see :mod:`dataset.index`).
    ``partition`` is 0-based like a torch rank; ``"auto"`` reads RANK/WORLD_SIZE,
    and so does a Dataset given neither under torchrun (``WORLD_SIZE`` > 1).
    ``sep``, ``meta`` (a meta file location), ``url_params`` (a query string
    for every http(s) URL), ``multi_hot`` (one example per item, a multi-hot
    target) and ``allow_schemes`` tune CSV indexes. A folder or fsspec URL of
    part files (or a brace pattern) takes the options of :mod:`dataset.parts`
    (``record_format``, ``resident_parts``, ``label_key``, ``storage_options``...).
    ``cache_items=True`` caches fetched items on disk (``cache_dir``,
    ``max_cache_bytes``), and ``cache_index=True`` the remote index files, so a
    restarted job or the other ranks of a host read them from local disk.
    The fetch options (``timeout``, ``retries``, ``backoff``...) apply to every
    read, the index's included; they and the other batcher options become
    defaults for :meth:`sampled_batcher`. A misspelt option raises TypeError.
    """

    def __init__(
        self,
        index: Any,
        partition: int | str | None = None,
        partitions: int | None = None,
        *,
        sep: str | None = None,
        meta: str | None = None,
        url_params: str | dict | None = None,
        multi_hot: bool = False,
        allow_schemes: Sequence[str] = (),
        **opts: Any,
    ):
        from . import parts
        from .cache import Cache, item_cache
        from .errors import BadIndex
        from .index import open_index

        _options.check(
            "Dataset()",
            opts,
            _options.INDEX,
            _options.FETCH,
            _options.CACHE,
            _options.PARTS,
            _options.BATCHER,
        )
        self.partition, self.partitions, source = choose_partition(partition, partitions)
        fetch = {k: opts[k] for k in _options.FETCH if k in opts}
        index_cache = None
        if opts.pop("cache_index", False):  # remote index/meta/.pt files kept on local disk
            index_cache = Cache(opts.get("cache_dir"), opts.get("max_cache_bytes"))
        whole = parts.dataset_index(index, opts, fetch)  # a folder/URL of part files
        if whole is None:
            whole = open_index(
                index,
                sep=sep,
                meta=meta,
                url_params=url_params,
                cache=index_cache,
                multi_hot=multi_hot,
                allow_schemes=allow_schemes,
                fetch=fetch,
            )
        cache = item_cache(opts)  # cache_items=True, cache_dir=, max_cache_bytes=
        if cache is not None:
            opts.setdefault("cache", cache)
        self.index: Index = whole.partition(self.partition, self.partitions)
        # (part files: a partition has at least one part; len() would read one to count)
        if not isinstance(self.index, parts.PartIndex) and len(self.index) == 0:
            raise BadIndex(
                f"{whole.origin}: partition {self.partition} of {self.partitions} is empty "
                f"(the index has {len(whole)} items)"
            )
        if source != "default":
            log.info(
                "%s: partition %d of %d (from %s)",
                whole.origin,
                self.partition,
                self.partitions,
                source,
            )
        self.opts = opts

    def __repr__(self) -> str:
        return (
            f"Dataset({self.index.origin!r}, partition={self.partition}, "
            f"partitions={self.partitions}, examples={len(self.index)})"
        )

    def __len__(self) -> int:
        """Examples in this partition (for part files: records, estimated until all are read)."""
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
        ``drop_last``, ``on_error``, ``worker_timeout`` and ``mp_context`` are
        further options (see the README).
        """
        from .batcher import SampledBatcher
        from .parts import default_sampler

        _options.check(
            "sampled_batcher()", opts, _options.FETCH, _options.BATCHER, _options.BATCHER_ARGS
        )
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
