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
import urllib.parse
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from distlearn.common import launchers

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
    "Mix",
    "PartError",
    "Record",
    "SampledBatcher",
    "WorkerDied",
    "item_rng",
    "item_seed",
    "item_source",
    "open_index",
    "register_index_kind",
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
    "Batch": "items",
    "Record": "items",
    "SampledBatcher": "batcher",
    "Mix": "mix",
    "Fetcher": "fetch.fetcher",
    "Index": "index.table",
    "open_index": "index.kinds",
    "register_index_kind": "index.kinds",
    "register_sampler": "sampling.samplers",
    "item_rng": "seeding",
    "item_seed": "seeding",
    "item_source": "seeding",
}

log = logging.getLogger(__name__)
# The (partition, partitions) this process has logged at INFO (see Dataset.__init__).
_PARTITIONS_SAID: set[tuple[int, int]] = set()


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if TYPE_CHECKING:
    from .batcher import SampledBatcher
    from .errors import (
        AllFailed,
        BadIndex,
        DatasetError,
        FetchError,
        IndexNotFound,
        PartError,
        WorkerDied,
    )
    from .fetch.fetcher import Fetcher
    from .index.kinds import open_index, register_index_kind
    from .index.table import Index
    from .items import Batch, Record
    from .mix import Mix
    from .sampling.samplers import register_sampler
    from .seeding import item_rng, item_seed, item_source


def _no_answer(url: str, fetch: _options.FetchOptions) -> str:
    """What to check when reading the index got no answer, and the options that wait longer."""
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme in ("http", "https") and parsed.hostname:
        port = parsed.port or (443 if parsed.scheme == "https" else 80)
        where = f"is a server running at {parsed.hostname}:{port}, and reachable from this host?"
    else:
        where = "is the store reachable from this host?"
    timeout = "no limit" if fetch.timeout is None else f"{fetch.timeout:g} s"
    return (
        f". Nothing answered: {where} The index was read with retries={fetch.retries} "
        f"(backoff={fetch.backoff:g} s doubling up to max_backoff={fetch.max_backoff:g} s) "
        f"and timeout={timeout} a try; for a server still starting, give Dataset() more, "
        "e.g. retries=10, max_backoff=10"
    )


def choose_partition(partition: Any, partitions: int | None) -> tuple[int, int, str]:
    """(partition, partitions, where they came from) for a Dataset.

    No partition arguments under a launcher of several processes follow its ranks, as
    `DistributedSampler` follows the process group; `partition="auto"` follows them
    whatever their number; explicit numbers win (`partition=0, partitions=1` is the
    whole index). The launchers are `distlearn.common.launchers`' (the ones
    `ipc.Tree.from_env` follows): torchrun's `RANK`/`WORLD_SIZE`, then Slurm's
    `SLURM_PROCID`/`SLURM_NTASKS` inside an `srun` step (not in a batch script's own
    process, which sees the allocation's task count).

    Args:
        partition: As given to `Dataset`: an int, `"auto"` or None.
        partitions: As given to `Dataset`: an int or None.

    Returns:
        `(partition, partitions, source)`, `source` saying where they came from.

    Raises:
        TypeError: `partition` is neither an int nor `"auto"`.
        ValueError: `"auto"` with `partitions`.
        LaunchError: Launcher variables half set, not integers or out of range (a
            `ValueError`).
    """
    if partition is None and partitions is None:
        launch = launchers.detect()
        if launch is not None and launch.world > 1:
            return launch.rank, launch.world, launch.variables
        return 0, 1, "default"
    if partition == "auto":
        if partitions is not None:
            raise ValueError(
                f'partition="auto" reads the partition count from the environment too: '
                f"leave out partitions={partitions!r}"
            )
        launch = launchers.detect()
        if launch is None:
            return 0, 1, "no launcher variables: the whole index"
        return launch.rank, launch.world, launch.variables
    if partition is None:
        partition = 0
    if isinstance(partition, bool) or not isinstance(partition, int):
        raise TypeError(f"partition must be an int or 'auto', got {partition!r}")
    return partition, 1 if partitions is None else partitions, "arguments"


class Dataset:
    """An index, partitioned for one rank, that makes batchers.

    Options are flat keywords, sorted into typed groups and checked here, before
    anything is read (`distlearn.dataset.options`): the index group (`sep`, `meta`,
    `url_params`, `multi_hot`, `allow_schemes`, `cache_index`), the read policy of
    every read (`timeout`, `retries`...), the disk cache (`cache_items`,
    `cache_dir`...), part files (`record_format`, `resident_parts`...), and the
    batcher's workers and sampling options, which become defaults for
    `sampled_batcher`. The table of every option and its default is in the guide.

    Args:
        index: A .csv/.tsv path or URL (local, http(s)://, any fsspec URL), a directory
            (labels: the sub-folder names), a tensor, `dict(x=, y=)`, a .pt file, a
            folder, URL or brace pattern of part files, or a list of these joined item
            by item.
        partition: This rank's partition, 0-based like a torch rank. `"auto"` reads
            the launcher's ranks: RANK/WORLD_SIZE, else Slurm's SLURM_PROCID/SLURM_NTASKS
            inside an srun step. Left out (with `partitions`) under a launcher of
            several processes it follows them too; otherwise the whole index.
        partitions: How many partitions (the world size).
        **opts (Any): Options of the fetch, index, cache, parts, workers and sampling
            groups.

    Attributes:
        index: This partition of the index: `len(index)` examples, `index.labels`
            the sorted label names.
        partition: This rank's partition.
        partitions: How many partitions.
        options: The typed option groups.

    Raises:
        TypeError: A misspelt option (naming the closest), a batcher's argument
            (`pool_size`, `prefetch`), or part-file options for another kind of index.
        ValueError: A bad option value, naming the option; RANK/WORLD_SIZE half set.
        BadIndex: A malformed index (naming the file and line), or an empty partition.
        IndexNotFound: The index, its meta file or a .pt file does not exist.
        FetchError: The index could not be read after the retries; where nothing
            answered, the message asks whether the server runs.
    """

    def __init__(
        self,
        index: Any,
        partition: int | str | None = None,
        partitions: int | None = None,
        **opts: Any,
    ):
        from .errors import BadIndex, FetchError
        from .index.kinds import open_index
        from .index.parts import PartIndex

        for name in ("pool_size", "prefetch"):  # the batcher's own arguments
            if name in opts:
                raise TypeError(f"Dataset() got {name!r}: pass it to sampled_batcher()")
        from .fetch.scope import locations_of

        self.options = _options.split("Dataset()", opts)
        self.partition, self.partitions, source = choose_partition(partition, partitions)
        # what the user named: whom credentials go to, whether targets are guarded
        self._named = locations_of(index, self.options.index.meta)
        try:
            whole = open_index(index, options=self.options)
        except FetchError as err:
            if not err.unanswered:
                raise
            hint = _no_answer(err.url, self.options.fetch)
            raise FetchError(
                err.url, err.cause + hint, err.retryable, err.missing, err.wait, True
            ) from err
        parts_given = self.options.parts.given()
        if parts_given and not isinstance(whole, PartIndex):
            raise TypeError(f"{sorted(parts_given)} apply to part files only, not to {index!r}")
        self.index: Index = whole.partition(self.partition, self.partitions)
        self.whole = whole  # (a batcher regenerates other partitions' orders from it)
        # (part files: a partition has at least one part; len() would read one to count)
        if not isinstance(self.index, PartIndex) and len(self.index) == 0:
            raise BadIndex(
                f"{whole.origin}: partition {self.partition} of {self.partitions} is empty "
                f"(the index has {len(whole)} items)"
            )
        if source != "default" and not (source == "arguments" and self.partitions == 1):
            # One INFO line per rank: a rank that opens more indexes with the same
            # partition (train and test) says the rest at DEBUG; the whole index asked
            # for by name (partition=0, partitions=1) goes unsaid.
            said = (self.partition, self.partitions)
            level = logging.DEBUG if said in _PARTITIONS_SAID else logging.INFO
            _PARTITIONS_SAID.add(said)
            log.log(
                level,
                "%s: partition %d of %d (from %s)",
                whole.origin,
                self.partition,
                self.partitions,
                source,
            )

    def __repr__(self) -> str:
        return (
            f"Dataset({self.index.origin!r}, partition={self.partition}, "
            f"partitions={self.partitions}, examples={len(self.index)})"
        )

    def __len__(self) -> int:
        """Examples in this partition (part files: records, estimated until all were read).

        Returns:
            The number of examples.
        """
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
        """Batches of this partition, in sampler order.

        Args:
            batch_size: Items per batch.
            input_dims: The shape of one item in `batch.input`, e.g. `(3, 224, 224)`.
            sampler: A registered name (`linear`, `permutation`, `uniform`,
                `label-uniform`, `label-permutation`, `label-distribution`, and
                `part-*` for part files) or a callable
                `(index, epoch, rng, **sampler_opt) -> iterable`. For a list of
                indexes, one entry per index: entry 0 drives the epoch, entry k is
                None (item i of the first fetches item i of index k) or a sampler
                that draws index k's item from all of it, whatever the partition.
            processor: `processor(fetched, opt, out) -> bool | (bool, extra)` decodes
                one item into `out`, its row of the batch; None copies tensor rows
                and decodes bytes as images.
            processor_opt: Passed to the processor as `opt`.
            pool_size: Concurrent fetches per worker (64 when None).
            prefetch: Batches in flight (process workers keep at least 2 each).
            seed: Seeds the sampler and `item_rng()`.
            **opts (Any): Options of the fetch, cache, workers and sampling groups
                (`workers`, `num_workers`, `sampler_opt`, `drop_last`, `on_error`,
                `retries`...), over those given to `Dataset`.

        Returns:
            A `SampledBatcher`: `for batch in batcher` is one epoch.

        Raises:
            TypeError: A misspelt option (naming the closest), or one of `Dataset`'s.
            ValueError: A bad value (`batch_size=0`, `input_dims=(3, 0)`, an unknown
                sampler or `sampler_opt` key), naming it.
        """
        from .batcher import SampledBatcher
        from .fetch.scope import scope_for

        _options.check_batcher_args(batch_size, seed, input_dims)
        groups = ("fetch", "cache", "workers", "sampling", "device")
        _options.check("sampled_batcher()", opts, *(_options.GROUPS[g].names() for g in groups),
                       _options.BATCHER_ARGS)  # fmt: skip
        opts.update(pool_size=pool_size, prefetch=prefetch)
        options = self.options.update("sampled_batcher()", opts, groups)
        fetch = options.fetch
        scope = scope_for(self._named, fetch.headers, fetch.credential_origins,
                          self.options.index.allow_networks)  # fmt: skip
        return SampledBatcher(
            self.index,
            batch_size=batch_size,
            input_dims=input_dims,
            sampler=sampler,
            processor=processor,
            processor_opt=processor_opt,
            seed=seed,
            partition=self.partition,
            partitions=self.partitions,
            whole=self.whole,
            options=options,
            scope=scope,
        )
