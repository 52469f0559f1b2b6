"""The slot engine: a ring of preallocated batch slots, the workers that fill them.

:class:`SlotEngine` takes :class:`dataset.sampling.stream.Work` (one batch of items)
into a free slot of the ring, where the workers fetch and decode every item
straight into the slot's tensor, and gives batches back in the order they
went in. It knows nothing of samplers or epochs:

- ``submit(work)`` while ``has_room``: the batch goes to the workers;
- ``next()``: the oldest batch, waited for, assembled into a
  :class:`dataset.items.Batch` (failed rows left out, the failure policy
  applied), its slot freed; ``(None, n)`` when every item failed;
- ``drain()`` discards what is in flight; ``close()`` stops the workers.

A batch handed to the user owns its tensors, so holding on to a batch is always
safe. Its input is the slot's own memory, lent to it: the slot goes back to the
ring only when every tensor using that memory (views included) has been freed.
The ring holds SPARE_SLOTS slots more than are in flight for this; while that
many batches are still held, the next ones are copied out instead (as is a
batch with failed rows, which leaves them out). Not copying matters for photos:
a 64 x 3 x 224 x 224 batch is 38 MB, whose copy into fresh memory costs 20-80
ms (page faults). With ``pin_memory`` every batch is copied, into page-locked
memory ready for an asynchronous copy to the GPU (:mod:`dataset.device`).
"""

from __future__ import annotations

import os
import weakref
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..fetch.scope import Scope
from ..fetch.stats import Stats
from ..items import Batch
from ..metrics.export import stage
from ..metrics.loader import LoaderMetrics
from ..metrics.probe import now
from ..options import FetchOptions, WorkerOptions
from ..processors import default_processor
from ..sampling.stream import Work
from .failures import FailurePolicy
from .processes import ProcessWorkers
from .threads import ThreadWorkers

__all__ = ["SPARE_SLOTS", "SlotEngine", "choose_workers"]

# Ring slots beyond the ones in flight, lent to batches handed out: a batch keeps its
# slot's memory (no copy) while the user holds it. Three cover a training loop: the
# batch of the step before (its autograd graph lives until `loss` is rebound), the last
# batch of the epoch before (a `for` variable outlives its loop), and the one being
# handed out. Holding more at once is fine: the batches beyond get copies.
SPARE_SLOTS = 3


def choose_workers(opts: WorkerOptions, in_memory: bool) -> tuple[str, int]:
    """(kind, count) of workers: process workers, one per core (up to 8), unless told.

    Items already in memory (tensor rows) need no fetch: decoded inline.
    """
    processes = max(1, min(os.cpu_count() or 1, 8))
    kind, count = "process", processes
    if in_memory:
        kind, count = "thread", 0
    if opts.workers is not None:
        if opts.workers != kind:
            count = 1 if opts.workers == "thread" else processes
        kind = opts.workers
    if opts.num_workers is not None:
        if opts.num_workers < (1 if kind == "process" else 0):
            raise ValueError(f"num_workers={opts.num_workers} is too small for {kind} workers")
        count = opts.num_workers
    return kind, count


@dataclass
class _InFlight:
    """A batch handed to the workers: its job, its ring slot, and its items."""

    job: Any
    slot: int
    work: Work


class SlotEngine:
    """Fill ring slots with decoded batches, in order; see the module docstring."""

    def __init__(
        self,
        *,
        batch_size: int,
        input_dims: Sequence[int],
        processor: Any,
        processor_opt: Any,
        label_names: Sequence[str],
        multi_hot: bool,
        in_memory: bool,
        workers: WorkerOptions,
        fetch: FetchOptions,
        cache: Any = None,
        pin_memory: bool = False,
        scope: Scope | None = None,
        metrics: LoaderMetrics | None = None,
    ):
        self.pin_memory = pin_memory
        self.metrics = metrics  # each batch's wait, hand-off and probe go there
        self.input_dims = tuple(int(d) for d in input_dims)
        self.processor = processor if processor is not None else default_processor
        self.label_names, self.multi_hot = label_names, multi_hot
        self.kind, self.num_workers = choose_workers(workers, in_memory)
        # keep every process worker busy, with a batch queued behind the one it decodes
        self.inflight = (
            workers.prefetch
            if self.kind == "thread"
            else max(workers.prefetch, 2 * self.num_workers)
        )
        fetch_kw = dict(fetch.fetcher_kwargs(), pool_size=workers.pool_size or 64, cache=cache,
                        scope=scope)  # fmt: skip
        # the slots the workers fill, and SPARE_SLOTS more that batches are lent in
        shape = (self.inflight + SPARE_SLOTS, batch_size, *self.input_dims)
        if self.kind == "process":
            self.workers: Any = ProcessWorkers(shape, self.processor, processor_opt, fetch_kw,
                                               self.num_workers, workers.mp_context,
                                               workers.worker_timeout, workers.metrics)  # fmt: skip
        else:
            slots = torch.empty(shape, dtype=torch.float32)
            self.workers = ThreadWorkers(slots, self.processor, processor_opt, fetch_kw,
                                         self.num_workers, workers.worker_timeout,
                                         workers.metrics)  # fmt: skip
        self.failures = FailurePolicy(workers.on_error, workers.max_failed_batches)
        self.stats = Stats()
        self._free = list(range(self.inflight + SPARE_SLOTS))
        self._pending: deque[_InFlight] = deque()
        self._lent: set[int] = set()  # slots whose memory a batch handed out still uses
        self._returned: deque[int] = deque()  # lent slots given back (by any thread's GC)

    @property
    def has_room(self) -> bool:
        while self._returned:  # deque operations are atomic: the finalizers may run anywhere
            slot = self._returned.popleft()
            self._lent.discard(slot)
            self._free.append(slot)
        return bool(self._free) and len(self._pending) < self.inflight

    @property
    def pending(self) -> int:
        return len(self._pending)

    def submit(self, work: Work, seed: int, partition: int) -> None:
        """Hand `work` to the workers, into a free slot (``has_room`` must be true)."""
        slot = self._free.pop()
        # what item_rng() derives from: the batch's place, or each item's own key
        ctx = (seed, partition, work.epoch, work.first, work.keys)
        try:
            job = self.workers.submit(slot, work.sources, ctx)
        except BaseException:
            self._free.append(slot)
            raise
        self._pending.append(_InFlight(job, slot, work))

    def next(self) -> tuple[Batch | None, int]:
        """The oldest batch in flight and its item count; None for the batch when all failed.

        Interrupted while waiting (Ctrl-C), the batch stays in flight and the
        next call picks it up.
        """
        flight = self._pending[0]
        m = self.metrics
        if m is not None:  # queue depths, and the clock, as the batch is asked for
            ready = sum(map(self.workers.ready, (f.job for f in self._pending)))
            asked = now()
        with stage("dataset.wait_workers"):
            res = self.workers.result(flight.job)  # an interruption leaves it pending
        got = now() if m is not None else 0.0
        self._pending.popleft()
        lend = not self.pin_memory and len(self._lent) < SPARE_SLOTS
        lent = False
        try:
            with stage("dataset.handoff"):
                batch, lent = self._assemble(flight.slot, res, flight.work, lend)
        finally:
            if lent:
                self._lent.add(flight.slot)
            else:
                self._free.append(flight.slot)
        if m is not None:
            m.batch(res.probe, asked, got, now(), len(self._pending) + 1, ready)
        return batch, len(flight.work)

    def _assemble(self, index: int, res: Any, work: Work, lend: bool) -> tuple[Batch | None, bool]:
        """The batch of the rows that succeeded (None when none did), and whether it was
        lent the slot's memory (else its rows were copied out of the ring)."""
        slot = self.workers.slots[index]
        n = len(work)
        self.stats.add(res.stats)
        self.failures.check(res.errors, work.names, n, self.stats)
        ok = res.ok
        # copy out with numpy: torch's clone/index_select may wake its intra-op thread
        # pool (OpenMP), which costs more than the 400 KB copy itself on a busy machine
        keep: Sequence[int] = range(n) if all(ok) else [i for i in range(n) if ok[i]]
        if not keep:
            return None, False
        lent = lend and all(ok)
        rows = slot.numpy()[:n] if all(ok) else slot.numpy()[keep]
        if lent:
            rows = self.workers.slot_array(index)[:n]
            # no copy: the batch keeps the slot's memory, and the slot comes back to the
            # ring when the last tensor using that memory (a view too) is freed
            inp = torch.from_numpy(rows)
            weakref.finalize(rows, self._returned.append, index)
        elif self.pin_memory:  # page-locked, for an asynchronous copy to the GPU
            inp = torch.empty((len(keep), *self.input_dims), pin_memory=True)
            inp.numpy()[...] = rows
        else:
            inp = torch.from_numpy(rows.copy() if all(ok) else rows)
        names, labels = self.label_names, work.labels
        if self.multi_hot:
            target = torch.zeros(len(keep), len(names), dtype=torch.float32)
            for row, i in enumerate(keep):
                target[row, list(labels[i])] = 1.0
        else:
            target = torch.as_tensor([work.targets[i] for i in keep], dtype=torch.long)
        if self.pin_memory:
            target = target.pin_memory()
        batch = Batch(
            input=inp,
            target=target,
            labels=[tuple(names[lab] for lab in labels[i]) for i in keep],
            urls=[work.names[i] for i in keep],
            extra=[res.extras.get(i) for i in keep],
        )
        if work.tags is not None:  # a mix: the source of each row
            batch.source = torch.as_tensor([work.tags[i] for i in keep], dtype=torch.long)
        return batch, lent

    def drain(self) -> None:
        """Wait out and discard batches in flight (their slots come back)."""
        while self._pending:
            flight = self._pending[0]
            try:
                self.workers.result(flight.job)
            finally:
                self._pending.popleft()
                self._free.append(flight.slot)

    def close(self) -> None:
        self._pending.clear()
        self.workers.close()
