"""The sampled batcher: sampler order in, batches of tensors out, `prefetch` in flight.

Per epoch the sampler yields a stream of items (index positions, or
:class:`Record` objects that may carry their payload in memory); the batcher
cuts it into batches, hands each batch's sources to the workers (which fill
a slot of a preallocated ring of batch tensors) and gives batches back in
sampler order. Sampling happens here, in the main process only, so no item is
duplicated or skipped whatever the number or kind of workers. For a list of
indexes with drawn members (``sampler=["permutation", "uniform"]``), each
driven item becomes a :class:`Record` joining the items drawn for it.

A batch handed to the user owns its tensors: they are copied out of the ring
(and failed rows dropped) before the slot is reused, so holding on to a batch
is always safe (the copy costs ~40 us for a 128 x 28 x 28 MNIST batch).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .errors import AllFailed, BadIndex
from .failures import FailurePolicy
from .fetch import Stats
from .index import Index, JoinedIndex
from .processors import default_processor
from .sampler import endless, epoch_rng, get_sampler
from .sources import Joined
from .workers import ProcessWorkers, ThreadWorkers

__all__ = ["AllFailed", "Batch", "Record", "SampledBatcher"]

log = logging.getLogger(__name__)

DEFAULT_WORKER_TIMEOUT = 600.0


@dataclass
class Record:
    """An item handed over by a sampler instead of an index position.

    ``source``: what to fetch (a URL, ``(url, offset, length)``) or the payload
    itself (bytes, a tensor) when it is already in memory, e.g. a record read
    from a part file. ``labels``: label ids into ``index.labels``. ``target``:
    the label this example stands for (default: the first label, -1 if none).
    ``name``: for ``batch.urls`` and logs.
    """

    source: Any
    labels: tuple[int, ...] = ()
    name: str = ""
    target: int | None = None


@dataclass
class Batch:
    """One batch: ``input`` [n, *input_dims] float, ``target`` [n] long (-1: unlabeled).

    ``target[i]`` is the label example i stands for (an item with several
    labels is one example per label); with ``multi_hot`` datasets it is a float
    [n, len(labels)] tensor with a 1 for each label of the item.
    ``labels[i]``: the names of all labels of item i (a tuple; empty when
    unlabeled), ``urls[i]``: where it came from, ``extra[i]``: what the
    processor returned (None when nothing). Rows whose fetch or processor
    failed are left out, so n may be less than the batch size, never 0.
    """

    input: torch.Tensor
    target: torch.Tensor
    labels: list[tuple[str, ...]] = field(default_factory=list)
    urls: list[str] = field(default_factory=list)
    extra: list[Any] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.input)


def default_workers() -> tuple[str, int]:
    """(kind, count) used when not given: process workers, one per core (see README)."""
    return "process", max(1, min(os.cpu_count() or 1, 8))


@dataclass
class _InFlight:
    """A batch handed to the workers: its job, ring slot, and what the main process keeps."""

    job: Any
    slot: int
    targets: list[int]
    labels: list[tuple[int, ...]]
    names: list[str]


class SampledBatcher:
    """Iterate batches of a partition; see :meth:`dataset.Dataset.sampled_batcher`."""

    def __init__(
        self,
        index: Index,
        *,
        batch_size: int = 32,
        input_dims: Sequence[int] = (),
        sampler: Any = "linear",
        sampler_opt: dict | None = None,
        processor: Any = None,
        processor_opt: Any = None,
        pool_size: int | None = None,
        prefetch: int = 2,
        seed: int = 0,
        partition: int = 0,
        workers: str | None = None,
        num_workers: int | None = None,
        drop_last: bool = False,
        timeout: float = 30.0,
        retries: int = 3,
        backoff: float = 0.05,
        max_backoff: float = 2.0,
        headers: dict[str, str] | None = None,
        redirects: str = "same-host",
        max_item_bytes: int | None = None,
        cache: Any = None,
        max_failed_batches: int = 3,
        on_error: str | Callable[[BaseException], Any] | None = None,
        worker_timeout: float | None = DEFAULT_WORKER_TIMEOUT,
        progress: bool = False,
        mp_context: str | None = None,
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if prefetch < 1:
            raise ValueError(f"prefetch must be >= 1, got {prefetch}")
        if worker_timeout is not None and worker_timeout <= 0:
            raise ValueError(f"worker_timeout must be > 0 or None, got {worker_timeout}")
        self.index = index
        self.batch_size = batch_size
        self.input_dims = tuple(int(d) for d in input_dims)
        sampler, sampler_opt, self._draws = _split_samplers(index, sampler, sampler_opt)
        self.sampler_name = (
            sampler if isinstance(sampler, str) else getattr(sampler, "__name__", "")
        )
        self._sampler = get_sampler(sampler)
        self._sampler_opt = dict(sampler_opt or {})
        self.processor = processor if processor is not None else default_processor
        self.processor_opt = processor_opt
        self.seed, self.partition = int(seed), int(partition)
        self.drop_last = drop_last
        self.progress = progress
        self._failures = FailurePolicy(on_error, max_failed_batches)
        self._stats = Stats()
        self._pid = os.getpid()

        kind, count = default_workers()
        if isinstance(getattr(index, "row_sources", None), torch.Tensor):
            kind, count = "thread", 0  # rows are in memory already: nothing to offload
        if workers is not None:
            if workers not in ("thread", "process"):
                raise ValueError(f"workers must be 'thread' or 'process', got {workers!r}")
            if workers != kind:
                count = 1 if workers == "thread" else count
            kind = workers
        if num_workers is not None:
            if num_workers < (1 if kind == "process" else 0):
                raise ValueError(f"num_workers={num_workers} is too small for {kind} workers")
            count = num_workers
        self.workers_kind, self.num_workers = kind, count
        # keep every process worker busy, with a batch queued behind the one it decodes
        self.inflight = prefetch if kind == "thread" else max(prefetch, 2 * count)
        fetch_kw = dict(
            pool_size=pool_size or 64,
            timeout=timeout,
            retries=retries,
            backoff=backoff,
            max_backoff=max_backoff,
            headers=headers,
            redirects=redirects,
            cache=cache,
        )
        if max_item_bytes is not None:
            fetch_kw["max_item_bytes"] = max_item_bytes
        shape = (self.inflight, batch_size, *self.input_dims)
        if kind == "process":
            self._workers: Any = ProcessWorkers(
                shape, self.processor, processor_opt, fetch_kw, count, mp_context, worker_timeout
            )
        else:
            slots = torch.empty(shape, dtype=torch.float32)
            self._workers = ThreadWorkers(
                slots, self.processor, processor_opt, fetch_kw, count, worker_timeout
            )
        self._free = list(range(self.inflight))
        self._pending: deque[_InFlight] = deque()
        self._stream: Iterator[list] | None = None
        self._epoch = -1  # the epoch being read; -1 before the first
        self._consumed = 0  # items of this epoch already handed out (or dropped)
        self._dispatched = 0  # items of this epoch handed to the workers
        self._resume: dict | None = None
        self._closed = False

    @property
    def stats(self) -> Stats:
        """Counters: items ``fetched``, ``retried``, ``failed``, ``dropped``, ``bytes``.

        For part files, records handed out count as fetched (with their size),
        and the part reader's counters join in: ``parts``, ``part_bytes``,
        ``corrupt`` records dropped, ``failed_parts`` (part reads that failed).
        """
        out = Stats(**self._stats)
        counters = getattr(self.index, "read_counters", None)
        if counters is not None:
            out.update(counters())
        return out

    # -- epochs --------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        """The epoch being read (0-based); -1 before the first batch."""
        return self._epoch

    def _epoch_items(self, epoch: int) -> Iterable[Any]:
        rng = epoch_rng(self.seed, self.partition, epoch)
        items = self._sampler(self.index, epoch, rng, **self._sampler_opt)
        if self._draws:
            sized = hasattr(items, "__len__")
            return (_SizedDrawnJoin if sized else _DrawnJoin)(self, epoch, items)
        return items

    def _start_epoch(self, epoch: int, skip: int = 0) -> None:
        self._drain()
        self._epoch, self._consumed, self._dispatched = epoch, skip, skip
        items = iter(self._epoch_items(epoch))
        if skip:
            items = itertools.islice(items, skip, None)
        self._stream = self._chunks(items)

    def _chunks(self, items: Iterator[Any]) -> Iterator[list]:
        while True:
            chunk = list(itertools.islice(items, self.batch_size))
            if not chunk or (self.drop_last and len(chunk) < self.batch_size):
                return
            yield chunk

    def __len__(self) -> int:
        """Batches in one epoch; TypeError for a stream of unknown length (see num_batches).

        A batch whose every item failed is skipped, so an epoch may hand out fewer.
        """
        items = self._epoch_items(max(self._epoch, 0))
        if not hasattr(items, "__len__"):
            raise TypeError(
                f"sampler {self.sampler_name!r} yields a stream of unknown length; "
                "use batcher.num_batches() for an estimate"
            )
        return self._batches_for(len(items))

    def _batches_for(self, n: int) -> int:
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)

    def num_batches(self) -> int:
        """Batches in one epoch, or an estimate from ``len(index)`` for an unknown-length stream.

        For part files ``len(index)`` is estimated from the part sizes until
        every part has been read once, then exact.
        """
        try:
            return len(self)
        except TypeError:
            return self._batches_for(len(self.index))

    # -- the pipeline ----------------------------------------------------------------

    def _dispatch(self) -> None:
        """Fill free ring slots with the next batches of the stream."""
        while self._free and self._stream is not None:
            chunk = next(self._stream, None)
            if chunk is None:
                self._stream = None
                return
            slot = self._free.pop()
            sources, targets, labels, names = [], [], [], []
            index = self.index
            for item in chunk:
                if isinstance(item, Record):
                    sources.append(item.source)
                    labs = tuple(item.labels)
                    names.append(item.name)
                    target = item.target
                    if target is None:
                        target = labs[0] if labs else -1
                else:
                    i = int(item)
                    sources.append(index.source(i))
                    labs = index.item_labels(i)
                    names.append(index.name(i))
                    target = index.target(i)
                labels.append(labs)
                targets.append(target)
            ctx = (self.seed, self.partition, self._epoch, self._dispatched)
            job = self._workers.submit(slot, sources, ctx)
            self._dispatched += len(chunk)
            self._pending.append(_InFlight(job, slot, targets, labels, names))

    def _drain(self) -> None:
        """Wait out and discard batches in flight (their slots come back)."""
        while self._pending:
            flight = self._pending[0]
            try:
                self._workers.result(flight.job)
            finally:
                self._pending.popleft()
                self._free.append(flight.slot)
        self._stream = None

    def _next_or_none(self) -> Batch | None:
        """The next batch of the current epoch, or None at its end.

        A batch whose every item failed is skipped (or raises, by the failure
        policy). Interrupted while waiting (Ctrl-C), the batch stays in flight
        and the next call picks it up.
        """
        if self._closed:
            raise RuntimeError("batcher is closed")
        while True:
            self._dispatch()
            if not self._pending:
                return None
            flight = self._pending[0]
            res = self._workers.result(flight.job)  # an interruption leaves it pending
            self._pending.popleft()
            try:
                batch = self._assemble(self._workers.slots[flight.slot], res, flight)
            finally:
                self._free.append(flight.slot)
            self._dispatch()  # refill before handing over, so workers never wait on the user
            if batch is not None:
                return batch

    def _assemble(self, slot: torch.Tensor, res, flight: _InFlight) -> Batch | None:
        """The batch of the rows that succeeded (None when none did), copied out of the ring."""
        targets, labels, names = flight.targets, flight.labels, flight.names
        n = len(targets)
        self._stats.add(res.stats)
        self._consumed += n
        self._failures.check(res.errors, names, n, self._stats)
        ok = res.ok
        # copy out with numpy: torch's clone/index_select may wake its intra-op thread
        # pool (OpenMP), which costs more than the 400 KB copy itself on a busy machine
        if all(ok):
            keep: Sequence[int] = range(n)
            inp = torch.from_numpy(slot.numpy()[:n].copy())
        else:
            keep = [i for i in range(n) if ok[i]]
            if not keep:
                return None
            inp = torch.from_numpy(slot.numpy()[keep])
        names_ = self.index.labels
        if getattr(self.index, "multi_hot", False):
            target = torch.zeros(len(keep), len(names_), dtype=torch.float32)
            for row, i in enumerate(keep):
                target[row, list(labels[i])] = 1.0
        else:
            target = torch.as_tensor([targets[i] for i in keep], dtype=torch.long)
        return Batch(
            input=inp,
            target=target,
            labels=[tuple(names_[lab] for lab in labels[i]) for i in keep],
            urls=[names[i] for i in keep],
            extra=[res.extras.get(i) for i in keep],
        )

    # -- public iteration --------------------------------------------------------------

    def __iter__(self) -> Iterator[Batch]:
        """One epoch: the rest of an epoch being resumed, else the next epoch."""
        if self._resume is not None:
            state, self._resume = self._resume, None
            self._start_epoch(state["epoch"], state["consumed"])
        else:
            self._start_epoch(self._epoch + 1)
        bar = None
        if self.progress:
            from tqdm.auto import tqdm

            try:
                total = self.num_batches()
            except Exception:
                total = None
            bar = tqdm(total=total, desc=f"epoch {self._epoch}", unit="batch")
        try:
            while True:
                batch = self._next_or_none()
                if batch is None:
                    return
                if bar is not None:
                    bar.update(1)
                yield batch
        finally:
            if bar is not None:
                bar.close()

    def next_batch(self) -> Batch:
        """The next batch, rolling over into the next epoch at the end of one."""
        if self._resume is not None:
            state, self._resume = self._resume, None
            self._start_epoch(state["epoch"], state["consumed"])
        elif self._epoch < 0:
            self._start_epoch(0)
        batch = self._next_or_none()
        if batch is None:
            self._start_epoch(self._epoch + 1)
            batch = self._next_or_none()
            if batch is None:
                raise RuntimeError(
                    f"sampler {self.sampler_name!r} gave an epoch with no item "
                    f"(stats {dict(self.stats)})"
                )
        return batch

    def reset(self) -> None:
        """Drop what is in flight; the next batch starts a new epoch."""
        self._drain()
        self._resume = None

    # -- resume ------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Where this batcher stands: the epoch and how many of its items were handed out.

        Items in flight but not yet handed out are not counted, so a job resumed
        with :meth:`load_state_dict` sees exactly the items it had not seen.
        """
        return {
            "epoch": max(self._epoch, 0),
            "consumed": self._consumed if self._epoch >= 0 else 0,
            "seed": self.seed,
            "partition": self.partition,
            "sampler": self.sampler_name,
            "batch_size": self.batch_size,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from `state`: the next batch is the first item not yet seen then."""
        for key in ("seed", "partition"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(
                    f"state_dict was saved with {key}={state[key]}, this batcher has "
                    f"{key}={getattr(self, key)}"
                )
        self._drain()
        self._resume = {"epoch": int(state["epoch"]), "consumed": int(state["consumed"])}

    # -- adapters and lifetime ---------------------------------------------------------

    def as_torch(self) -> torch.utils.data.IterableDataset:
        """A ``torch.utils.data.IterableDataset`` yielding (input, target) per batch.

        Use it with ``DataLoader(batcher.as_torch(), batch_size=None)`` and no
        DataLoader workers (``num_workers=0``): this batcher already has its own,
        and a DataLoader worker raises a clear error at once.
        """
        return _TorchAdapter(self)

    def close(self) -> None:
        """Stop the workers and free the ring (idempotent)."""
        if self._closed or self._pid != os.getpid():
            return
        self._closed = True
        self._pending.clear()
        self._workers.close()

    def __enter__(self) -> SampledBatcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


# ----------------------------------------------------------------------------- joined indexes


@dataclass
class _Draw:
    """How member k of a joined index is drawn: its sampler and options."""

    k: int
    sampler: Any
    opt: dict


def _split_samplers(index: Index, sampler: Any, sampler_opt: Any) -> tuple[Any, dict, list]:
    """(the driver's sampler, its options, the drawn members) from ``sampler``/``sampler_opt``.

    A list/tuple ``sampler`` has one entry per joined index: entry 0 drives the
    epoch, entry k > 0 is None (aligned: item i of the first fetches item i of
    index k) or a sampler that draws index k's item for each driven item. A
    plain sampler drives with every other index aligned. Aligned members must
    have the first's length: BadIndex here, before anything is fetched.
    """
    members = index.members if isinstance(index, JoinedIndex) else None
    if isinstance(sampler, list | tuple):
        if members is None:
            raise ValueError(
                f"sampler={list(sampler)!r} is a list (one sampler per joined index), "
                f"but {index.origin} is a single index; pass one sampler"
            )
        if len(sampler) != len(members):
            raise ValueError(
                f"sampler={list(sampler)!r} has {len(sampler)} entries for "
                f"{len(members)} joined indexes ({index.origin}); give one per index"
            )
        if sampler[0] is None:
            raise ValueError("sampler[0] drives the epoch and cannot be None")
        samplers = list(sampler)
    else:
        samplers = [sampler] + [None] * (len(members) - 1 if members else 0)
    if isinstance(sampler_opt, list | tuple):
        if not isinstance(sampler, list | tuple):
            raise ValueError("a list of sampler_opt goes with a list of samplers (one per index)")
        if len(sampler_opt) != len(samplers):
            raise ValueError(
                f"sampler_opt has {len(sampler_opt)} entries for {len(samplers)} samplers"
            )
        opts = [dict(o or {}) for o in sampler_opt]
    else:
        opts = [dict(sampler_opt or {})] + [{} for _ in samplers[1:]]
    draws = []
    for k in range(1, len(samplers)):
        member = members[k]
        if samplers[k] is None:
            if opts[k]:
                raise ValueError(f"sampler_opt[{k}] given for {member.origin}, which is aligned")
            first = members[0]
            if member.num_rows != first.num_rows:
                raise BadIndex(
                    f"joined indexes differ in length: {first.origin} has {first.num_rows} "
                    f"items, {member.origin} has {member.num_rows}; item i of the first can "
                    f"only fetch item i of an index of the same length. To draw from "
                    f"{member.origin} instead, give it a sampler: sampler=[..., 'uniform'] "
                    f"(entry {k})"
                )
        else:
            draws.append(_Draw(k, get_sampler(samplers[k]), opts[k]))
    return samplers[0], opts[0], draws


class _DrawnJoin:
    """One epoch of a joined index with drawn members: a :class:`Record` per driven item.

    Each iteration restarts the draws (each member's generator is seeded by
    (seed, partition, epoch, k)), so an epoch regenerated to resume it draws
    exactly what it drew before.
    """

    def __init__(self, batcher: SampledBatcher, epoch: int, items: Iterable[Any]):
        self.batcher, self.epoch, self.items = batcher, epoch, items

    def __iter__(self) -> Iterator[Record]:
        b, index = self.batcher, self.batcher.index
        members = index.members
        streams: list[Iterator[Any] | None] = [None] * len(members)
        for d in b._draws:
            rng = epoch_rng(b.seed, b.partition, self.epoch, stream=d.k)
            streams[d.k] = endless(d.sampler, members[d.k], rng, d.opt)
        positions = index.positions.tolist()  # python ints: 10x faster to index than numpy's
        items = self.items
        if isinstance(items, np.ndarray):
            items = items.tolist()
        for item in items:
            if isinstance(item, Record):
                if any(s is None for s in streams[1:]):
                    raise ValueError(
                        f"sampler {b.sampler_name!r} yields records, which have no position "
                        f"to align the other indexes of {index.origin} with; draw them instead"
                    )
                labels, target = tuple(item.labels), item.target
                slots, names = [item.source], [item.name]
            else:
                i = int(item)
                p, labels, target = positions[i], index.item_labels(i), index.target(i)
                row = members[0].row(p)
                slots, names = [members[0].source(p)], [members[0].name(p)]
            for k in range(1, len(members)):
                stream, member = streams[k], members[k]
                if stream is None:  # aligned: the member's item on the same row
                    slots.append(member.row_source(row))
                    names.append(member.row_name(row))
                    continue
                drawn = next(stream)
                if isinstance(drawn, Record):
                    slots.append(drawn.source)
                    names.append(drawn.name)
                else:
                    j = int(drawn)
                    slots.append(member.source(j))
                    names.append(member.name(j))
            yield Record(Joined(slots), labels, " + ".join(names), target)


class _SizedDrawnJoin(_DrawnJoin):
    """A :class:`_DrawnJoin` whose driver has a length, so ``len(batcher)`` still works."""

    def __len__(self) -> int:
        return len(self.items)


class _TorchAdapter(torch.utils.data.IterableDataset):
    """``batcher.as_torch()``: the batches as (input, target), for a DataLoader without workers."""

    def __init__(self, batcher: SampledBatcher):
        self.batcher = batcher

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        info = torch.utils.data.get_worker_info()
        if info is not None or os.getpid() != self.batcher._pid:
            raise RuntimeError(_IN_DATALOADER_WORKER)
        for batch in self.batcher:
            yield batch.input, batch.target

    def __len__(self) -> int:
        return len(self.batcher)

    def __reduce__(self):
        # DataLoader workers started by spawn/forkserver get the dataset pickled
        raise TypeError(_IN_DATALOADER_WORKER)


_IN_DATALOADER_WORKER = (
    "batcher.as_torch() runs in the process that made the batcher: it has its own "
    "workers (workers=, num_workers=), so use DataLoader(batcher.as_torch(), "
    "batch_size=None) with num_workers=0 (the default)"
)
