"""Thread workers: one Fetcher loop thread in this process, processors on a thread pool.

Processors run on a pool of `num_workers` threads, handed over in runs
(:class:`dataset.workers.fill.Handoff`), or inline on the loop thread (0). Cheap to start,
but the GIL caps decoding at about one core.
"""

from __future__ import annotations

import concurrent.futures
from typing import Any

import numpy as np
import torch

from ..fetch.fetcher import Fetcher
from ..metrics.probe import Activity, now
from .fill import BatchResult, Context, Handoff, fill, stuck

__all__ = ["ThreadWorkers"]


class ThreadWorkers:
    """Fetch on one event loop thread, decode on `num_workers` threads, all in this process."""

    kind = "thread"

    def __init__(self, slots: torch.Tensor, processor: Any, opt: Any, fetch_kw: dict,
                 num_workers: int = 1, timeout: float | None = None,
                 measure: bool = True):  # fmt: skip
        self.slots = slots
        self.processor, self.opt, self.timeout = processor, opt, timeout
        self.fetcher = Fetcher(**fetch_kw)
        # one worker for the metrics: the loop and its decode threads together
        self.activity = Activity() if measure else None
        self.handoff = (
            Handoff(num_workers, processor, opt, self.activity) if num_workers > 0 else None
        )

    def submit(
        self, slot: int, sources: list[Any], ctx: Context | None = None
    ) -> concurrent.futures.Future:
        out = self.slots[slot]
        job = fill(self.fetcher, sources, out, self.processor, self.opt, self.handoff, ctx,
                   self.activity)  # fmt: skip
        future = self.fetcher.submit(job)
        if self.activity is not None:
            # stamped as it reaches this thread: a loop decoding inline (num_workers=0) may
            # finish the next batch's items before it hands this one over
            future.add_done_callback(_stamp_sent)
        return future

    def result(self, job: concurrent.futures.Future) -> BatchResult:
        try:
            res = job.result(timeout=self.timeout)
        except concurrent.futures.TimeoutError:
            raise stuck("the thread workers", self.timeout) from None
        if res.probe is not None:
            res.probe["worker"] = 0
            res.probe["activity"] = self.activity.snapshot()
        return res

    def ready(self, job: concurrent.futures.Future) -> bool:
        """Whether `job`'s batch is done (a queue depth for the metrics)."""
        return job.done()

    def slot_array(self, slot: int) -> np.ndarray:
        """Slot `slot` as a numpy array (it keeps the slots' storage alive while it lives)."""
        return self.slots[slot].numpy()

    def close(self) -> None:
        self.fetcher.close()
        if self.handoff is not None:
            self.handoff.close()


def _stamp_sent(future: concurrent.futures.Future) -> None:
    if not future.cancelled() and future.exception() is None:
        future.result().probe["sent"] = now()
