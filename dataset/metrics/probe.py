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
    "add_items",
    "bucket",
    "bucket_value",
    "merge_hist",
    "new_probe",
    "now",
    "percentiles",
]

now = time.perf_counter

# Latency histogram: 4 buckets per doubling (linear inside it), so a bucket's middle is
# within 12.5% of any latency in it; from 1 us (bucket 0 below) to 2**20 s; sparse
# (bucket -> count), so a batch sends what it saw. From math.frexp: one C call an item.
BUCKETS_PER_DOUBLING = 4
_LOW = 20  # 2**-20 s, about 1 us
_MAX_BUCKET = 40 * BUCKETS_PER_DOUBLING


def bucket(seconds: float) -> int:
    """The histogram bucket of a latency in seconds."""
    m, e = math.frexp(seconds)  # seconds = m * 2**e, m in [0.5, 1)
    b = (e + _LOW) * 4 + int(m * 8) - 4
    return 0 if b < 0 or seconds <= 0 else min(b, _MAX_BUCKET)


def bucket_value(b: int) -> float:
    """A latency (seconds) standing for bucket `b`: the middle of its bounds."""
    e, sub = divmod(b, 4)
    return (0.5 + (sub + 0.5) / 8) * 2.0 ** (e - _LOW)


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


def add_items(probe: dict, fetched: list[float], decoded: list[float]) -> None:
    """Add a batch's fetch and processor seconds, one an item, to its probe."""
    if fetched:
        probe["fetch_s"] += sum(fetched)
        probe["fetches"] += len(fetched)
        lat = probe["lat"]
        for dt in fetched:
            b = bucket(dt)
            lat[b] = lat.get(b, 0) + 1
    if decoded:
        probe["decode_s"] += sum(decoded)
        probe["decodes"] += len(decoded)


def new_probe() -> dict:
    """A batch's numbers, empty (see the module docstring)."""
    return {"fetch_s": 0.0, "fetches": 0, "lat": {}, "decode_s": 0.0, "decodes": 0}


class Activity:
    """What one worker's time went to: ``decode`` (a processor ran), ``fetch`` (a batch
    was in hand and no processor ran: waiting on the source, or the fetch's own work),
    ``idle`` (no batch in hand: the worker waited for work).

    Batches come and go on the worker's loop thread (:meth:`job`). Processors run either
    inline on that thread, timed by the caller and added with :meth:`decoded` (no lock:
    one thread), or in runs on decode threads (:meth:`decode`, locked, once a run), whose
    union over time is what counts: decoding on two threads at once is decode time once.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._t = self._born = now()
        self._jobs = self._decoding = 0
        self._active = self._threads = 0.0  # time with a batch in hand; with a run going
        self._inline = 0.0  # processor time on the loop thread itself

    def _tick(self, t: float) -> None:
        dt = t - self._t
        if self._jobs:
            self._active += dt
        if self._decoding:
            self._threads += dt
        self._t = t

    def job(self, delta: int) -> None:
        """A batch came into the worker's hands (+1) or left them (-1)."""
        with self._lock:
            self._tick(now())
            self._jobs += delta

    def decode(self, delta: int) -> float:
        """A run of processor calls on a decode thread began (+1) or ended (-1); the clock."""
        t = now()
        with self._lock:
            self._tick(t)
            self._decoding += delta
        return t

    def decoded(self, seconds: float) -> None:
        """A processor call of `seconds` ran inline, on the loop thread."""
        self._inline += seconds

    def snapshot(self) -> dict[str, float]:
        """The totals up to now: ``decode``, ``fetch`` and ``idle`` seconds."""
        with self._lock:
            t = now()
            self._tick(t)
            decode = min(self._threads + self._inline, self._active)
            return {
                "decode": decode,
                "fetch": self._active - decode,
                "idle": (t - self._born) - self._active,
            }
