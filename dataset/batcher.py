"""The sampled batcher: sampler order in, batches of tensors out, `prefetch` in flight.

It composes two stages:

- an :class:`dataset.sampling.stream.ItemStream`, which decides what each batch holds
  (the sampler, joined and drawn indexes, the epoch and the place in it), in
  the main process only, so no item is duplicated or skipped whatever the
  number or kind of workers;
- a :class:`dataset.workers.ring.SlotEngine`, which has the workers fetch and decode
  each batch into a slot of a preallocated ring and gives batches back in
  order, with the failure policy applied.

The batcher keeps the engine's free slots filled from the stream, counts what
the user got (for ``state_dict``) and adds the user-facing parts: epochs as
``for`` loops, ``next_batch``, a progress bar, the torch adapter.

Its position does not depend on the world size: ``load_state_dict`` takes this
rank's state, or the list of every rank's states of a job of any size, and then
hands out this rank's share of what that job had not handed out (see
:mod:`dataset.sampling.elastic`). ``elastic_state`` says so to
``distlearn.Checkpoint``, which gathers every rank's state into its manifest.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from .device import DeviceCopy, check_device
from .errors import AllFailed
from .fetch.cache import item_cache
from .fetch.scope import Scope, locations_of, scope_for
from .fetch.stats import Stats
from .items import Batch, Record
from .metrics.export import exporters, stage
from .metrics.loader import LoaderMetrics
from .metrics.probe import now
from .options import DEFAULT_WORKER_TIMEOUT, Options
from .sampling.elastic import Position
from .sampling.samplers import for_index
from .sampling.stream import ItemStream
from .workers.ring import SlotEngine

__all__ = ["DEFAULT_WORKER_TIMEOUT", "AllFailed", "Batch", "Record", "SampledBatcher"]

log = logging.getLogger(__name__)


class SampledBatcher:
    """Batches of a partition, in sampler order; made by `Dataset.sampled_batcher`.

    `for batch in batcher` is one epoch; the next `for` starts the next epoch. A
    batcher is also a context manager that closes it.

    Args:
        index: The partition's index (`Dataset.index`).
        batch_size: Items per batch.
        input_dims: The shape of one item in `batch.input`.
        sampler: A sampler's name or callable (see `Dataset.sampled_batcher`).
        processor: Decodes one item into its row of the batch.
        processor_opt: Passed to the processor as `opt`.
        seed: Seeds the sampler and `item_rng()`.
        partition: The partition, for the seeds.
        partitions: How many partitions the whole index was cut into.
        whole: The index before partitioning (default `index`): the batcher
            regenerates other partitions' orders from it to resume the position of a
            job of another world size.
        options: The typed option groups (fetch, cache, workers, sampling).
        stream: The item stream, when not `index`'s own (a mix's: `distlearn.dataset.Mix`).
        **flat (Any): Flat options laid over `options`, checked here.

    Raises:
        TypeError: A misspelt option, naming the closest.
        ValueError: A bad option value or an unknown sampler.
    """

    elastic_state = True  # load_state_dict takes every rank's states (distlearn.Checkpoint)

    def __init__(
        self,
        index: Any,
        *,
        batch_size: int = 32,
        input_dims: Sequence[int] = (),
        sampler: Any = "linear",
        processor: Any = None,
        processor_opt: Any = None,
        seed: int = 0,
        partition: int = 0,
        partitions: int = 1,
        whole: Any = None,
        options: Options | None = None,
        scope: Scope | None = None,
        stream: Any = None,
        **flat: Any,
    ):
        groups = ("fetch", "cache", "workers", "sampling", "device")
        o = (options or Options()).update("SampledBatcher()", flat, groups)
        self.index = index
        if scope is None:  # (Dataset passes what the user named; else the index's origin)
            scope = scope_for(locations_of(index), o.fetch.headers, o.fetch.credential_origins)
        # a mix brings its own stream (dataset.sampling.mixstream); else one index's
        self.stream = (
            stream
            if stream is not None
            else ItemStream(
                index,
                sampler=for_index(index, sampler),
                sampler_opt=o.sampling.sampler_opt,
                batch_size=batch_size,
                seed=seed,
                partition=partition,
                partitions=partitions,
                whole=whole,
                drop_last=o.sampling.drop_last,
            )
        )
        target = check_device(o.device.device, o.device.pin_memory)
        self._metrics = (  # where the time goes (dataset.metrics): the engine feeds it too
            LoaderMetrics(o.workers.metrics_window, exporters(o.workers.metrics_export),
                          partition, stats=lambda: self.stats, device=self._device_stats)
            if o.workers.metrics else None
        )  # fmt: skip
        self.engine = SlotEngine(
            batch_size=batch_size,
            input_dims=input_dims,
            processor=processor,
            processor_opt=processor_opt,
            label_names=index.labels,
            multi_hot=getattr(index, "multi_hot", False),
            in_memory=getattr(index, "in_memory", False),
            workers=o.workers,
            fetch=o.fetch,
            cache=item_cache(o.cache),
            pin_memory=o.device.pin_memory or target is not None,
            scope=scope,  # whom credentials go to, what a remote index may reach
            metrics=self._metrics,
        )
        self._device = DeviceCopy(target) if target is not None else None
        self._ahead: tuple[Any, int] | None = None  # (copy in flight, items it accounts for)
        self.batch_size, self.input_dims = batch_size, self.engine.input_dims
        self.seed, self.partition = self.stream.seed, self.stream.partition
        self.sampler_name = self.stream.sampler_name
        self.workers_kind, self.num_workers = self.engine.kind, self.engine.num_workers
        if self._metrics is not None:
            self._metrics.workers = (self.workers_kind, self.num_workers)
        self.progress = o.workers.progress
        self._resume: Position | None = None
        self._closed = False
        self._pid = os.getpid()
        self._run = 0  # bumped by every new start of the pipeline (see __iter__)

    @property
    def stats(self) -> Stats:
        """Counters: items `fetched`, `retried`, `failed`, `dropped`, `bytes`.

        For part files, records handed out count as fetched (with their size),
        and the part reader's counters join in: ``parts``, ``part_bytes``,
        ``corrupt`` records dropped, ``failed_parts`` (part reads that failed).
        """
        out = Stats(**self.engine.stats)
        counters = getattr(self.index, "read_counters", None)
        if counters is not None:
            out.update(counters())
        if self._device is not None:  # device_wait_s: host seconds waited on copies to it
            out.update(self._device.stats())
        return out

    def metrics(self, comm: Any = None, ranks: Any = None, device: Any = None) -> dict:
        """Where the loader's time goes, as a plain dict (see :mod:`dataset.metrics`).

        ``window``: the last closed window (``metrics_window`` seconds) with its
        ``verdict`` (``source``, ``decode``, ``workers``, or ``consumer``: the loader is not
        the bottleneck) and ``why``; ``total``: the same since the batcher was made;
        ``windows``: the closed windows kept (the last 64).

        Args:
            comm: A communicator (``ipc.Tree``, ``TorchDistributed``): every rank's totals
                since its last exchange are all-reduced in one small call (every rank must
                make it), and ``ranks`` names the straggler rank and why.
            ranks: Instead of `comm`, the tensor of :meth:`metrics_tensor` after it rode in
                an all_reduce (sum) the job made anyway.
            device: Where the tensor all-reduced for `comm` lives (``"cuda"`` where the
                communicator is NCCL's); the host by default.

        Returns:
            The dict; with `comm` or `ranks`, a ``ranks`` entry too.

        Raises:
            RuntimeError: The batcher was made with ``metrics=False``.
        """
        if self._metrics is None:
            raise RuntimeError("this batcher was made with metrics=False")
        from .metrics.ranks import read_exchange

        out = self._metrics.report()
        if comm is not None:
            ranks = self.metrics_tensor(comm, device)
            comm.all_reduce(ranks)
        if ranks is not None:
            out["ranks"] = read_exchange(ranks)
        return out

    def metrics_tensor(self, comm: Any, device: Any = None) -> torch.Tensor:
        """This rank's totals since its last exchange, as its row of a ``[world, F]``
        float64 tensor of zeros: add it to an all_reduce (sum) every rank makes anyway,
        then pass it to ``metrics(ranks=...)`` (see :mod:`dataset.metrics.ranks`).

        Args:
            comm: The communicator (its ``node_index`` and ``num_nodes``).
            device: Where the tensor is made (``"cuda"`` to ride with NCCL's tensors); the
                host by default.

        Returns:
            The tensor.
        """
        if self._metrics is None:
            raise RuntimeError("this batcher was made with metrics=False")
        from .metrics.ranks import exchange_tensor

        table = exchange_tensor(self._metrics, comm.node_index, comm.num_nodes)
        return table if device is None else table.to(device)

    @property
    def epoch(self) -> int:
        """The epoch being read (0-based); -1 before the first batch.

        Returns:
            The epoch.
        """
        return self.stream.epoch

    def __len__(self) -> int:
        """Batches in one epoch.

        A batch whose every item failed is skipped, so an epoch may hand out fewer.

        Returns:
            The number of batches.

        Raises:
            TypeError: The stream's length is unknown (part files): see `num_batches`.
        """
        return len(self.stream)

    def num_batches(self) -> int:
        """Batches in one epoch, or an estimate for a stream of unknown length.

        For part files `len(index)` is estimated from the part sizes until every
        part has been read once, then exact.

        Returns:
            The number of batches, or its estimate.
        """
        try:
            return len(self)
        except TypeError:
            return self.stream.batches_for(len(self.index))

    # -- the pipeline ----------------------------------------------------------------

    def _start(self, epoch: int, skip: int = 0) -> None:
        self._ahead = None
        self.engine.drain()
        self.stream.start(epoch, skip)
        self._run += 1

    def _start_next(self) -> None:
        """Begin where a resume says, else the next epoch."""
        if self._resume is not None:
            pos, self._resume = self._resume, None
            self._ahead = None
            self.engine.drain()
            self.stream.resume(pos)
            self._run += 1
        else:
            self._start(self.stream.epoch + 1)

    def _fill(self) -> None:
        """Fill free ring slots with the next batches of the stream."""
        t0 = now() if self._metrics is not None else 0.0
        with stage("dataset.sampling"):
            while self.engine.has_room:
                work = next(self.stream, None)
                if work is None:
                    break
                self.engine.submit(work, self.seed, self.partition)
        if self._metrics is not None:
            self._metrics.sampled(now() - t0)

    def _next_or_none(self) -> Batch | None:
        """The next batch of the current epoch, or None at its end.

        A batch whose every item failed is skipped (or raises, by the failure policy).
        """
        if self._closed:
            raise RuntimeError("batcher is closed")
        if self._metrics is None:
            return self._next_timed()
        self._metrics.asked()
        batch = None
        try:
            with stage("dataset.next"):
                batch = self._next_timed()
        finally:  # (an error too: the time it took was stall)
            self._metrics.answered(0 if batch is None else len(batch.target))
        return batch

    def _next_timed(self) -> Batch | None:
        """`_next_or_none`'s work, which the metrics time as the step's stall."""
        try:
            if self._device is None:
                batch, n = self._pull()
                self.stream.consumed(n)
                return batch
            # to a device: the batch handed out now was started one call earlier, and
            # the next one starts before it is handed out, so its copy overlaps the step
            if self._ahead is None:
                self._ahead = self._pull_to_device()
            flight, n = self._ahead
            self._ahead = None
            if flight is None:
                self.stream.consumed(n)
                return None
            self._ahead = self._pull_to_device()
            self.stream.consumed(n)  # counted as the user gets it, for state_dict()
            return self._device.finish(flight)
        except Exception as err:
            if self._closed:  # close() from another thread, while this call waited
                raise RuntimeError("batcher is closed (by close() during this call)") from err
            raise

    def _pull(self) -> tuple[Batch | None, int]:
        """The next batch with a row (None at the epoch's end), and the items it took
        from the stream, batches whose every item failed included."""
        taken = 0
        while True:
            self._fill()
            if not self.engine.pending:
                return None, taken
            batch, n = self.engine.next()
            taken += n
            self._fill()  # refill before handing over, so workers never wait on the user
            if batch is not None:
                return batch, taken

    def _device_stats(self) -> dict:
        return self._device.stats() if self._device is not None else {}

    def _pull_to_device(self) -> tuple[Any, int]:
        batch, n = self._pull()
        return (None if batch is None else self._device.start(batch)), n

    # -- public iteration --------------------------------------------------------------

    def __iter__(self) -> Iterator[Batch]:
        """One epoch: the rest of an epoch being resumed, else the next epoch.

        One pipeline feeds one iteration at a time: a new `iter()` (or `next_batch()`
        starting an epoch, `reset()`, `load_state_dict()`) ends an iteration still under
        way, whose next step raises RuntimeError rather than hand out the new one's
        batches. Leaving a loop with `break` and starting the next is fine.

        Yields:
            Each `Batch` of the epoch.

        Raises:
            AllFailed: `max_failed_batches` consecutive batches in which every item
                failed.
            WorkerDied: A worker exited, or finished no batch within `worker_timeout`.
            Exception: A bug in the processor, with the worker's traceback (or any
                failure, as `on_error` decides).
        """
        self._start_next()
        run = self._run
        bar = self._progress_bar()
        try:
            while True:
                if run != self._run and not self._closed:
                    raise RuntimeError(
                        "this iteration over the batcher was ended by a newer iter() "
                        "(or next_batch(), reset(), load_state_dict()): a batcher feeds "
                        "one iteration at a time"
                    )
                batch = self._next_or_none()
                if batch is None:
                    return
                if bar is not None:
                    bar.update(1)
                yield batch
        finally:
            if bar is not None:
                bar.close()

    def _progress_bar(self) -> Any:
        if not self.progress:
            return None
        from tqdm.auto import tqdm

        try:
            total = self.num_batches()
        except Exception:
            total = None
        return tqdm(total=total, desc=f"epoch {self.epoch}", unit="batch")

    def next_batch(self) -> Batch:
        """The next batch, rolling over into the next epoch at the end of one.

        Returns:
            The next `Batch`.

        Raises:
            RuntimeError: The sampler gave an epoch with no item.
            AllFailed: As for iterating.
            WorkerDied: As for iterating.
        """
        if self._resume is not None or self.epoch < 0:
            self._start_next()
        batch = self._next_or_none()
        if batch is None:
            self._start(self.epoch + 1)
            batch = self._next_or_none()
            if batch is None:
                raise RuntimeError(
                    f"sampler {self.sampler_name!r} gave an epoch with no item "
                    f"(stats {dict(self.stats)})"
                )
        return batch

    def reset(self) -> None:
        """Drop what is in flight; the next batch starts a new epoch."""
        self._ahead = None
        self.engine.drain()
        self.stream.stop()
        self._resume = None
        self._run += 1

    # -- resume ------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Where this batcher stands: a few integers, whatever the epoch's size.

        The order is regenerated from (seed, partition, epoch) on resume. Items in
        flight but not yet handed out are not counted, so a job resumed with
        `load_state_dict` sees exactly the items it had not seen. The position does
        not depend on the world size (the format: `dataset.sampling.elastic`).

        Returns:
            A small dict of ints and strings.
        """
        if self._resume is not None:  # loaded, not started yet: where it will start
            return self.stream.state_of(self._resume)
        return self.stream.state_dict()

    def load_state_dict(self, state: dict | list[dict]) -> None:
        """Continue from this rank's state, or from every rank's states of any job.

        This rank's own state: the next batch is the first item it had not handed
        out, bit for bit as if never stopped. The list of every rank's states of a
        job of any world size, in any order: this rank hands out its share of what
        that job had not handed out (the rest of that epoch holds every example
        exactly once), then ordinary epochs of its own partitioning.

        Args:
            state: What `state_dict()` returned, or the list of what every rank's did.

        Raises:
            TypeError: `state` is not a dict or a list.
            ValueError: `state` cannot be honoured (another sampler, seed or index;
                another partition without the list; a rank's state missing from the
                list), naming what differs.
        """
        resume = self.stream.resume_position(state)
        self._ahead = None
        self.engine.drain()
        self.stream.stop()
        self._resume = resume
        self._run += 1

    def take_over(self, position: Position) -> None:
        """Go on from `position` (see :func:`dataset.sampling.elastic.take_over`) without
        ending the iteration under way: a `for` loop over the batcher hands out the
        position's pieces next, and ends with them. Batches in flight are discarded and
        come again in their turn (distlearn.survivors: a rank's share of a dead rank's
        rest, after its own). A position with no pieces ends the iteration now, and the
        next one begins its ordinary epoch. A batcher not started yet (a rank that came
        back) begins its first loop with the pieces."""
        started = self._resume is None and self.epoch >= 0
        self._ahead = None
        self.engine.drain()
        self.stream.resume(position)
        self.index, self.partition = self.stream.index, self.stream.partition
        if not position.rest or not started:
            # Nothing is left of the epoch under way. Without this the loop running now
            # would go on into the next epoch (an epoch too many), or, were it over
            # already, the next loop would start the one after (an epoch skipped). Not
            # started: the first loop would begin an epoch of its own, not the pieces.
            self.stream.stop()
            self._resume = position

    @property
    def handed_out(self) -> int:
        """Items handed out (or dropped) over this batcher's life."""
        return self.stream.handed_out

    # -- adapters and lifetime ---------------------------------------------------------

    def as_torch(self) -> torch.utils.data.IterableDataset:
        """A `torch.utils.data.IterableDataset` yielding (input, target) per batch.

        Use it with `DataLoader(batcher.as_torch(), batch_size=None)` and no
        DataLoader workers (`num_workers=0`): this batcher already has its own,
        and a DataLoader worker raises a clear error at once.

        Returns:
            The dataset.
        """
        return _TorchAdapter(self)

    def close(self) -> None:
        """Stop the workers and free the ring (idempotent)."""
        if self._closed or self._pid != os.getpid():
            return
        self._closed = True
        self._ahead = None
        self.engine.close()

    def __enter__(self) -> SampledBatcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


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
