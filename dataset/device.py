"""Batches to the accelerator: pinned host memory, and a copy one batch ahead on a side stream.

The last stage, after the batch ring (``sampled_batcher(pin_memory=, device=)``):

- ``pin_memory=True``: each batch is copied out of the ring into page-locked
  host memory (torch's caching host allocator recycles it), which the GPU reads
  by DMA, so a copy to it can run asynchronously (DataLoader's ``pin_memory``).
- ``device="cuda"`` (or ``"cuda:1"``, a ``torch.device``): the batcher hands out
  batches whose ``input`` and ``target`` are on that device. The copy of batch
  k+1 is started on a side CUDA stream before batch k is handed out, so it runs
  while the user's step on batch k does; pinning is implied. When a batch is
  handed out and its copy has not finished, the host waits for it: that time is
  ``stats["device_wait_s"]`` (with ``device_batches``), the part of the copies
  the steps did not hide. The tensors are marked as used by the consumer's
  stream, so their memory is not reused while the step still reads them.

``device="cpu"`` (or None) changes nothing. Without CUDA, ``pin_memory=True`` and
a CUDA device raise at once, naming the option.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any

import torch

from .items import Batch
from .metrics.export import stage

__all__ = ["DeviceCopy", "check_device"]


def check_device(device: Any, pin_memory: bool) -> torch.device | None:
    """The target device (None: stay on the host), or an error naming the option at fault."""
    if not isinstance(pin_memory, bool):
        raise TypeError(f"pin_memory must be True or False, got {pin_memory!r}")
    dev = None
    if device is not None:
        try:
            dev = torch.device(device)
        except (RuntimeError, TypeError) as err:
            raise ValueError(f"device={device!r} is not a torch device: {err}") from None
        if dev.type == "cpu":
            dev = None
        elif dev.type != "cuda":
            raise ValueError(f"device={device!r}: only CUDA devices (or 'cpu') are supported")
        elif not torch.cuda.is_available():
            raise RuntimeError(f"device={device!r} needs CUDA, and torch.cuda.is_available() is "
                               "False here (a CPU build of torch, or no GPU)")  # fmt: skip
        elif dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(
                f"device={device!r}: this host has {torch.cuda.device_count()} CUDA device(s)"
            )
    if pin_memory and not torch.cuda.is_available():
        raise RuntimeError(
            "pin_memory=True needs CUDA (page-locked memory is for copies to a GPU), and "
            "torch.cuda.is_available() is False here"
        )
    return dev


@dataclass
class _InFlight:
    batch: Batch  # already holding the device tensors
    event: Any  # torch.cuda.Event recorded after the copies


class DeviceCopy:
    """Starts batches' copies to `device` on a side stream; hands them out once copied."""

    def __init__(self, device: torch.device):
        self.device = device
        if device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.stream = torch.cuda.Stream(self.device)
        self.wait_s = 0.0
        self.batches = 0

    def start(self, batch: Batch) -> _InFlight:
        """Enqueue the copies of `batch` (its input should be pinned) on the side stream."""
        # the side stream must not read the host batch before work already queued by the
        # consumer on it (none, normally), and must see the consumer's allocations
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            inp = batch.input.to(self.device, non_blocking=True)
            target = batch.target.to(self.device, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        return _InFlight(replace(batch, input=inp, target=target), event)

    def finish(self, flight: _InFlight) -> Batch:
        """The batch, once its copy is done; the time waited for it is counted."""
        if not flight.event.query():
            t0 = time.perf_counter()
            with stage("dataset.device_wait"):
                flight.event.synchronize()
            self.wait_s += time.perf_counter() - t0
        self.batches += 1
        consumer = torch.cuda.current_stream(self.device)
        # made on the side stream, used on the consumer's: keep the caching allocator
        # from reusing their memory until the consumer's work on them is done
        flight.batch.input.record_stream(consumer)
        flight.batch.target.record_stream(consumer)
        return flight.batch

    def stats(self) -> dict[str, float]:
        return {"device_wait_s": self.wait_s, "device_batches": self.batches}
