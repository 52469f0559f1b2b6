"""`Mix`: several datasets drawn by weight into one batcher, exactly at every prefix.

    from distlearn.dataset import Dataset, Mix

    web = Dataset("s3://bucket/web.csv", partition=rank, partitions=world)
    books = Dataset("/data/books", partition=rank, partitions=world)
    mix = Mix({"web": (web, 0.7), "books": (books, 0.3, {"sampler": "linear"})},
              exhausted="cycle")
    for batch in mix.sampled_batcher(batch_size=64, input_dims=(3, 224, 224),
                                     sampler="permutation", processor=Image()):
        batch.source   # long [n]: 0 for web, 1 for books (mix.names)

What is guaranteed (the contract is :mod:`dataset.sampling.mix`): after any number of
examples of the job's global order (every rank's batches of each step, in rank order),
each source's count is within one example of its weighted share; the composition of
every global batch does not depend on the world size; each source walks its own
sampler's epochs over its whole index (part files: over each rank's own parts), each
example once per epoch, whatever the weights do; the position is part of the batcher's
state and resumes at any world size.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from distlearn.common.keywords import unknown

from . import options as _options
from .batcher import SampledBatcher
from .fetch.scope import scope_for
from .processors import Mixed
from .sampling.mix import Policy, Schedule
from .sampling.mixstream import MixSource, MixStream

__all__ = ["Mix"]

# What a source's own entry may set (the rest is the batcher's, shared by every source).
SOURCE_OPTIONS = ("sampler", "sampler_opt", "processor", "processor_opt")


class Mix:
    """Several datasets, drawn by weight into one batcher (see the module docstring).

    Args:
        sources: A dict `{name: entry}` or a list of entries (named "0", "1", ...). An
            entry is `(dataset, weight)` or `(dataset, weight, options)`, `options` a
            dict of that source's own `sampler`, `sampler_opt`, `processor`,
            `processor_opt` (the batcher's are the default). A dataset is a `Dataset`
            of any index kind with a sized sampler (CSV, directory, tensor, joined),
            read whole, or of part files, read by partition (each rank its own
            parts, as one part-file dataset is).
            A mix reads each source's whole index and splits the mix between ranks:
            the rank is the sources' partition (those opened as one of several must
            agree; one opened whole, `partition=0, partitions=1`, takes any, which is
            how a source smaller than the world is opened), or `partition=`.
        exhausted: When a pass (one `for` over the batcher) ends, with the global
            batch in which: `"stop"` a source finishes an epoch, `("repeat", n)` a
            source finishes its n-th epoch of the pass, `"cycle"` every source has
            finished one. A source that runs out earlier begins its next epoch at
            once. Sources are never rewound: a pass goes on from where the one
            before stood, so each walks whole epochs, each example once in each.
        schedule: Weights that change with the step (one global batch: the batch size
            times the partitions): a list of `(step, weights)` from step 0 on, or a
            function `step -> weights` (pure: it is called for steps ahead). Weights
            are a list in source order or a dict by name. Replaces the entries' weights.
        partition: This rank (0-based), with `partitions`, the world size: by default
            the sources' partitioning.
        partitions: The world size, with `partition`.

    Attributes:
        names: The sources' names; `batch.source` holds indexes into it.
        labels: The union of the sources' label names, sorted: what `batch.target`
            indexes.

    Raises:
        ValueError: A bad entry, weight, schedule or policy, sources of different
            partitionings, or multi-hot sources, naming what is wrong.
        TypeError: A source option that is not one of the four, naming the closest.
    """

    def __init__(
        self,
        sources: Any,
        *,
        exhausted: Any = "stop",
        schedule: Any = None,
        partition: int | None = None,
        partitions: int | None = None,
    ):
        if isinstance(sources, Mapping):
            entries = [(str(name), entry) for name, entry in sources.items()]
        elif isinstance(sources, Sequence) and not isinstance(sources, str):
            entries = [(str(i), entry) for i, entry in enumerate(sources)]
        else:
            raise TypeError(f"Mix takes a dict or a list of (dataset, weight) entries, got "
                            f"{type(sources).__name__}")  # fmt: skip
        if not entries:
            raise ValueError("a mix needs at least one source")
        self.names: list[str] = []
        self.datasets: list[Any] = []
        self._own: list[dict] = []
        weights = []
        for name, entry in entries:
            dataset, weight, own = _entry(name, entry, schedule is not None)
            self.names.append(name)
            self.datasets.append(dataset)
            weights.append(weight)
            self._own.append(own)
        self.exhausted = exhausted
        Policy.parse(exhausted)  # checked where it is given
        self.schedule = schedule if schedule is not None else weights
        Schedule(self.schedule, self.names)  # checked where it is given
        for name, ds in zip(self.names, self.datasets, strict=True):
            if getattr(ds.whole, "multi_hot", False):
                raise ValueError(f"source {name!r} is multi-hot; a mix takes single-label "
                                 "targets (one label list for the batch)")  # fmt: skip
        self.partition, self.partitions = self._rank(partition, partitions)
        self.labels = sorted({lab for ds in self.datasets for lab in ds.whole.labels})

    def _rank(self, partition: int | None, partitions: int | None) -> tuple[int, int]:
        """(partition, partitions) of this rank: as given, else the sources' (the ones
        opened as one partition of several, which must agree)."""
        if (partition is None) != (partitions is None):
            raise ValueError("give partition= and partitions= together (or neither: the "
                             "sources' partitioning)")  # fmt: skip
        if partition is not None:
            for x in (partition, partitions):
                if isinstance(x, bool) or not isinstance(x, int):
                    raise TypeError(f"partition and partitions are ints, got {x!r}")
            if not 0 <= partition < partitions:
                raise ValueError(f"partition {partition} is not in [0, partitions={partitions})")
            return partition, partitions
        split = {(ds.partition, ds.partitions): name
                 for name, ds in zip(self.names, self.datasets, strict=True)
                 if ds.partitions > 1}  # fmt: skip
        if len(split) > 1:
            (a, an), (b, bn) = list(split.items())[:2]
            raise ValueError(
                f"source {an!r} is partition {a[0]} of {a[1]}, source {bn!r} partition "
                f"{b[0]} of {b[1]}: a mix's sources are opened for the same rank of the same "
                "job (or whole, partition=0, partitions=1)"
            )
        return next(iter(split)) if split else (0, 1)

    def __repr__(self) -> str:
        parts = ", ".join(f"{n}={ds.whole.origin!r}" for n, ds in zip(self.names, self.datasets,
                                                                      strict=True))  # fmt: skip
        return f"Mix({parts}, exhausted={self.exhausted!r})"

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
        """Batches of this rank's share of the mix, as `Dataset.sampled_batcher` makes them.

        `sampler`, `processor`, `processor_opt` and `sampler_opt` are every source's
        unless its entry gives its own. The fetch, cache and worker options are the
        first source's `Dataset` options with these over them. `drop_last` does not
        apply (a pass is whole global batches, ending where `exhausted` says). A
        part-file source takes a part sampler (`part-linear` by default, or its own).

        Returns:
            A `SampledBatcher` whose batches have `source`; `len()` simulates the pass.

        Raises:
            TypeError: A misspelt option, naming the closest.
            ValueError: A bad value, or a source that cannot be mixed, naming it.
        """
        _options.check_batcher_args(batch_size, seed, input_dims)
        groups = ("fetch", "cache", "workers", "sampling", "device")
        _options.check("sampled_batcher()", opts, *(_options.GROUPS[g].names() for g in groups),
                       _options.BATCHER_ARGS)  # fmt: skip
        opts.update(pool_size=pool_size, prefetch=prefetch)
        options = self.datasets[0].options.update("sampled_batcher()", opts, groups)
        if options.sampling.drop_last:
            raise ValueError("drop_last does not apply to a mix: a pass ends where its "
                             "`exhausted` policy says")  # fmt: skip
        sources, processors = [], []
        for name, ds, own in zip(self.names, self.datasets, self._own, strict=True):
            opt = own.get("sampler_opt", options.sampling.sampler_opt)
            sources.append(MixSource(name, ds.whole, own.get("sampler", sampler), opt))
            processors.append((own.get("processor", processor),
                               own.get("processor_opt", processor_opt)))  # fmt: skip
        stream = MixStream(sources, weights=self.schedule, exhausted=self.exhausted,
                           batch_size=batch_size, seed=seed, partition=self.partition,
                           partitions=self.partitions)  # fmt: skip
        named = [loc for ds in self.datasets for loc in ds._named]
        fetch = options.fetch
        scope = scope_for(named, fetch.headers, fetch.credential_origins,
                          self.datasets[0].options.index.allow_networks)  # fmt: skip
        return SampledBatcher(
            _MixIndex(self, stream),
            batch_size=batch_size,
            input_dims=input_dims,
            processor=Mixed(processors),
            seed=seed,
            partition=self.partition,
            partitions=self.partitions,
            options=options,
            scope=scope,
            stream=stream,
        )


class _MixIndex:
    """What the batcher and its workers ask of an index, for a mix."""

    multi_hot = False

    def __init__(self, mix: Mix, stream: MixStream):
        self.labels = stream.labels  # (the same list: part files' labels join it as read)
        self.origin = repr(mix)
        self.in_memory = all(getattr(ds.whole, "in_memory", False) for ds in mix.datasets)
        self.sources = list(mix.names)
        self.read_counters = stream.read_counters  # part files' reads, in batcher.stats

    def __len__(self) -> int:
        raise TypeError("a mix has no length of its own: len(batcher) is its pass's batches")


def _entry(name: str, entry: Any, scheduled: bool) -> tuple[Any, Any, dict]:
    """(dataset, weight, its own options) of a source's entry."""
    if hasattr(entry, "whole") and hasattr(entry, "options"):
        entry = (entry,)
    if not isinstance(entry, tuple | list) or not 1 <= len(entry) <= 3:
        raise ValueError(f"source {name!r}: want (dataset, weight) or (dataset, weight, "
                         f"options), got {entry!r}")  # fmt: skip
    dataset = entry[0]
    if not (hasattr(dataset, "whole") and hasattr(dataset, "options")):
        raise ValueError(f"source {name!r}: {dataset!r} is not a Dataset")
    weight = entry[1] if len(entry) > 1 else None
    if weight is None and not scheduled:
        raise ValueError(f"source {name!r} has no weight: give (dataset, weight) or a "
                         "schedule=")  # fmt: skip
    own = dict(entry[2]) if len(entry) > 2 and entry[2] is not None else {}
    for key in own:
        if key not in SOURCE_OPTIONS:
            raise unknown(f"Mix source {name!r}", key, SOURCE_OPTIONS, "option")
    return dataset, weight, own
