"""The worker side: each item's fetch and decode timed, and what a worker's time went to.

A batch's numbers are a plain dict (:func:`new_probe`) that :func:`dataset.workers.fill.fill`
fills and the batch's result carries back to the main process (it pickles in a few
hundred bytes): ``fetch_s`` and ``fetches`` (each item's fetch, retries and cache
included), ``lat`` (those latencies as a sparse histogram, :func:`bucket`), ``decode_s``
and ``decodes`` (processor calls), ``worker`` (which worker), ``sent`` (the clock when the
result left the worker) and ``activity`` (that worker's :class:`Activity` totals then).

Clocks: ``time.perf_counter``, which on Linux is CLOCK_MONOTONIC, one clock for every
process of the host, so a stamp taken in a worker process is compared with the main
process's own.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterable, Mapping

__all__ = [
    "BUCKETS_PER_DOUBLING",
    "Activity",
    "bucket",
    "bucket_value",
    "merge_hist",
    "new_probe",
    "now",
    "percentiles",
]

now = time.perf_counter

# Latency histogram: 4 buckets per doubling from 1 us (a bucket's value is within 9% of
# any latency in it), 0 below; sparse (bucket -> count), so a batch sends what it saw.
BUCKETS_PER_DOUBLING = 4
_LOG_BASE = BUCKETS_PER_DOUBLING / math.log(2)
_MAX_BUCKET = 40 * BUCKETS_PER_DOUBLING  # 2**40 us: longer latencies land in the last


def bucket(seconds: float) -> int:
    """The histogram bucket of a latency in seconds."""
    if seconds <= 1e-6:
        return 0
    return min(_MAX_BUCKET, 1 + int(math.log(seconds * 1e6) * _LOG_BASE))


def bucket_value(b: int) -> float:
    """A latency (seconds) standing for bucket `b`: the geometric middle of its bounds."""
    if b <= 0:
        return 1e-6
    return 1e-6 * 2 ** ((b - 0.5) / BUCKETS_PER_DOUBLING)


def merge_hist(into: dict[int, int], other: Mapping[int, int]) -> None:
    for b, n in other.items():
        into[b] = into.get(b, 0) + n


def percentiles(hist: Mapping[int, int], qs: Iterable[float]) -> list[float | None]:
    """The `qs` quantiles (0-1) of a histogram, in seconds; None where it is empty."""
    qs = list(qs)
    total = sum(hist.values())
    if not total:
        return [None] * len(qs)
    out = []
    items = sorted(hist.items())
    for q in qs:
        rank, seen = q * total, 0
        for b, n in items:
            seen += n
            if seen >= rank:
                out.append(bucket_value(b))
                break
    return out


def new_probe() -> dict:
    """A batch's numbers, empty (see the module docstring)."""
    return {"fetch_s": 0.0, "fetches": 0, "lat": {}, "decode_s": 0.0, "decodes": 0}


class Activity:
    """What one worker's time went to: ``decode`` (a processor ran), ``fetch`` (a batch
    was in hand and no processor ran: waiting on the source, or the fetch's own work),
    ``idle`` (no batch in hand: the worker waited for work).

    Transitions come from the worker's loop thread and, for thread workers, from the
    decode threads, hence the lock; its cost is paid per batch and per processor call.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._t = now()
        self._jobs = 0
        self._decoding = 0
        self.totals = {"decode": 0.0, "fetch": 0.0, "idle": 0.0}

    def _tick(self, t: float) -> None:
        state = "decode" if self._decoding else "fetch" if self._jobs else "idle"
        self.totals[state] += t - self._t
        self._t = t

    def job(self, delta: int) -> None:
        """A batch came into the worker's hands (+1) or left them (-1)."""
        with self._lock:
            self._tick(now())
            self._jobs += delta

    def decode(self, delta: int) -> float:
        """A processor call (or a run of them) began (+1) or ended (-1); the clock then."""
        t = now()
        with self._lock:
            self._tick(t)
            self._decoding += delta
        return t

    def snapshot(self) -> dict[str, float]:
        """The totals up to now."""
        with self._lock:
            self._tick(now())
            return dict(self.totals)
