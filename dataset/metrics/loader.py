"""The main process's side: each ``next()``'s stall, split by stage, in windows with a verdict.

:class:`LoaderMetrics` is fed by the batcher (:meth:`~LoaderMetrics.asked`,
:meth:`~LoaderMetrics.answered`, :meth:`~LoaderMetrics.sampled`) and by the slot engine
(:meth:`~LoaderMetrics.batch`, with the batch's probe from its worker). The stall of one
``next()`` is split into the parts it was measured to have waited on:

- ``sampling_s``: the index and sampler, and handing the next batches to the workers;
- ``source_s`` and ``decode_s``: waiting on a worker still filling the batch, split by
  what that worker's time went to in the window (waiting on fetches, or processors);
- ``handoff_s``: the rest of that wait, after the worker was done (its result's way to
  the main process), and the batch's assembly;
- ``device_s``: waiting on the copy to the device.

``explained`` is their sum over the stall (what the stall timer saw that no stage
did is the batcher's own bookkeeping). See :func:`verdict` for the verdict.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from .probe import bucket, merge_hist, now, percentiles

__all__ = ["STAGES", "STALL_BOUND", "LoaderMetrics", "bound_by", "describe", "verdict"]

log = logging.getLogger("distlearn.dataset.metrics")

# The stall's parts, and the verdict each one names when it is the largest
STAGES = {
    "source_s": "source",
    "decode_s": "decode",
    "handoff_s": "workers",
    "sampling_s": "workers",
    "device_s": "workers",
}
# Below this share of the window's time spent waiting in next(), the loader kept up.
STALL_BOUND = 0.1
# Stat counters reported per window (deltas of the batcher's stats)
_COUNTERS = ("bytes", "retried", "failed", "dropped", "http_4xx", "http_5xx", "http_429",
             "cache_hits", "cache_misses")  # fmt: skip
_HISTORY = 64  # closed windows kept for metrics()["windows"]


def bound_by(stages: dict[str, float]) -> tuple[str, str]:
    """(verdict, its largest stage) of the stall's parts: the verdict whose stages add up to
    the most (the three of ``workers`` together)."""
    parts: dict[str, float] = {}
    for key, name in STAGES.items():
        parts[name] = parts.get(name, 0.0) + stages[key]
    name = max(parts, key=parts.__getitem__)
    return name, max((k for k in STAGES if STAGES[k] == name), key=stages.__getitem__)


def verdict(summary: dict) -> tuple[str, str]:
    """(verdict, why) of a window's summary.

    ``consumer`` when the training loop waited in ``next()`` less than STALL_BOUND of the
    window: the loader kept up, so the step itself (the model, a collective, a slow
    rank's wait) sets the pace. Otherwise the stage with the largest part of the stall:
    ``source`` (fetches: the server, the network, the store), ``decode`` (the
    processor), ``workers`` (the loader's own machinery: results handed to the main
    process, batches assembled, sampling, the copy to the device).
    """
    wall, stall = summary["seconds"], summary["stall_s"]
    share = stall / wall if wall > 0 else 0.0
    if summary["steps"] == 0:
        return "idle", "no batch was asked for"
    if share < STALL_BOUND:
        return "consumer", (
            f"the loop waited on the loader {100 * share:.0f}% of the time: "
            "the loader is not the bottleneck"
        )
    name, stage = bound_by(summary["stages"])
    return name, (
        f"the loop waited on the loader {100 * share:.0f}% of the time, "
        f"{100 * summary['stages'][stage] / max(stall, 1e-12):.0f}% of it on "
        f"{stage[:-2].replace('_', ' ')}"
    )


class _Window:
    """What one window (or the whole run) accumulated."""

    __slots__ = ("activity", "batches", "decode_s", "decodes", "depth", "device_s",
                 "fetch_s", "fetches", "handoff_s", "items", "lat", "ready", "sampling_s",
                 "stall_hist", "stall_s", "start", "steps", "wait", "worker_batches")  # fmt: skip

    def __init__(self, start: float):
        self.start = start
        self.steps = self.items = self.batches = self.fetches = self.decodes = 0
        self.stall_s = self.sampling_s = self.handoff_s = self.device_s = 0.0
        self.fetch_s = self.decode_s = 0.0
        self.depth = self.ready = 0
        self.lat: dict[int, int] = {}
        self.stall_hist: dict[int, int] = {}
        self.wait: dict[Any, float] = {}  # per worker: the stall spent on it still working
        self.activity: dict[Any, dict[str, float]] = {}  # per worker: its time's deltas
        self.worker_batches: dict[Any, int] = {}

    def merge(self, o: _Window) -> None:
        for k in ("steps", "items", "batches", "fetches", "decodes", "stall_s", "sampling_s",
                  "handoff_s", "device_s", "fetch_s", "decode_s", "depth", "ready"):  # fmt: skip
            setattr(self, k, getattr(self, k) + getattr(o, k))
        merge_hist(self.lat, o.lat)
        merge_hist(self.stall_hist, o.stall_hist)
        for w, s in o.wait.items():
            self.wait[w] = self.wait.get(w, 0.0) + s
        for w, n in o.worker_batches.items():
            self.worker_batches[w] = self.worker_batches.get(w, 0) + n
        for w, act in o.activity.items():
            mine = self.activity.setdefault(w, {"decode": 0.0, "fetch": 0.0, "idle": 0.0})
            for k, v in act.items():
                mine[k] += v


class LoaderMetrics:
    """One batcher's metrics: see the module docstring.

    Args:
        window: Seconds per window.
        exporters: Callables given each closed window's summary (``dataset.metrics.export``).
        rank: This rank (the batcher's partition), for the logs.
        workers: (kind, count) of the workers, for the summary.
        stats: The batcher's counters now (a callable), for the per-window fetch counts.
        device: The device copy's counters now (a callable), or None.
    """

    def __init__(
        self,
        window: float = 10.0,
        exporters: Sequence[Callable[[dict], Any]] = (),
        rank: int = 0,
        workers: tuple[str, int] = ("thread", 1),
        stats: Callable[[], dict] | None = None,
        device: Callable[[], dict] | None = None,
    ):
        self.window, self.exporters, self.rank = float(window), list(exporters), rank
        self.workers = workers
        self._stats, self._device = stats, device
        self.created = now()
        self.first_batch_s: float | None = None
        self._win = _Window(self.created)
        self._total = _Window(self.created)  # every closed window merged
        # (read lazily: the batcher makes this before the stages it reads)
        self._counters: dict[str, float] = dict.fromkeys(_COUNTERS, 0)
        self._total_counters = dict.fromkeys(_COUNTERS, 0)
        self._device_seen = 0.0
        self._last_activity: dict[Any, dict[str, float]] = {}
        self.closed: deque[dict] = deque(maxlen=_HISTORY)
        self._asked = 0.0
        self.exchanged: list[float] | None = None  # dataset.metrics.ranks: the last exchange

    # -- fed by the batcher and the slot engine -------------------------------------------

    def asked(self) -> float:
        """The training loop called next(); the clock now."""
        self._asked = t = now()
        return t

    def answered(self, items: int) -> None:
        """next() returns a batch of `items` (0 at an epoch's end)."""
        t = now()
        w = self._win
        stall = t - self._asked
        w.steps += 1
        w.items += items
        w.stall_s += stall
        b = bucket(stall)
        w.stall_hist[b] = w.stall_hist.get(b, 0) + 1
        if self.first_batch_s is None and items:
            # the start (workers starting, connections opening) is first_batch_s: the
            # first window begins after it, so its verdict is about the steady state
            self.first_batch_s = t - self.created
            self._close(t, publish=False)
        elif t - w.start >= self.window:
            self._close(t)

    def sampled(self, seconds: float) -> None:
        self._win.sampling_s += seconds

    def batch(
        self, probe: dict | None, asked: float, got: float, done: float, depth: int, ready: int
    ) -> None:
        """A batch's result: waited for from `asked` to `got`, assembled by `done`;
        `depth` batches were in flight, `ready` of them done, when it was asked for."""
        w = self._win
        w.batches += 1
        w.depth += depth
        w.ready += ready
        worker_part = 0.0
        if probe is not None:
            worker = probe.get("worker", 0)
            sent = probe.get("sent", got)
            worker_part = min(max(sent - asked, 0.0), got - asked)
            w.wait[worker] = w.wait.get(worker, 0.0) + worker_part
            w.worker_batches[worker] = w.worker_batches.get(worker, 0) + 1
            w.fetch_s += probe["fetch_s"]
            w.fetches += probe["fetches"]
            w.decode_s += probe["decode_s"]
            w.decodes += probe["decodes"]
            merge_hist(w.lat, probe["lat"])
            act = probe.get("activity")
            if act is not None:
                last = self._last_activity.get(worker)
                mine = w.activity.setdefault(worker, {"decode": 0.0, "fetch": 0.0, "idle": 0.0})
                for k, v in act.items():
                    mine[k] += v - (last[k] if last is not None else 0.0)
                self._last_activity[worker] = act
        w.handoff_s += (got - asked - worker_part) + (done - got)

    # -- windows --------------------------------------------------------------------------

    def _read_counters(self) -> dict[str, float]:
        got = self._stats() if self._stats is not None else {}
        return {k: got.get(k, 0) for k in _COUNTERS}

    def _read_device(self) -> float:
        return self._device().get("device_wait_s", 0.0) if self._device is not None else 0.0

    def _close(self, t: float, publish: bool = True) -> None:
        w = self._win
        counters = self._read_counters()
        delta = {k: counters[k] - self._counters[k] for k in _COUNTERS}
        self._counters = counters
        for k, v in delta.items():
            self._total_counters[k] += v
        dev = self._read_device()
        w.device_s += dev - self._device_seen
        self._device_seen = dev
        self._total.merge(w)
        self._win = _Window(t)
        if not publish:
            return
        summary = self._summary(w, t, delta)
        self.closed.append(summary)
        log.info("rank %d loader, %s", self.rank, describe(summary))
        for export in self.exporters:
            try:
                export(summary)
            except Exception:  # an exporter's bug must not stop training
                log.exception("metrics exporter %r failed", export)

    def _summary(self, w: _Window, t: float, counters: dict[str, float]) -> dict:
        wall = t - w.start
        source_s = decode_s = 0.0
        workers = {}
        for worker in sorted(set(w.wait) | set(w.activity), key=str):
            act = w.activity.get(worker, {"decode": 0.0, "fetch": 0.0, "idle": 0.0})
            # (a processor call is counted as it ends, the time in hand as it passes: at a
            # window's edge one may be ahead of the other by a call)
            dec, fetch = max(act["decode"], 0.0), max(act["fetch"], 0.0)
            waited = w.wait.get(worker, 0.0)
            if dec + fetch > 0:  # what the worker was doing while the loop waited on it
                decode_s += waited * dec / (dec + fetch)
                source_s += waited * fetch / (dec + fetch)
            else:
                source_s += waited
            workers[str(worker)] = {
                "batches": w.worker_batches.get(worker, 0),
                "decode_s": act["decode"],
                "fetch_s": act["fetch"],
                "idle_s": act["idle"],
                "stall_s": waited,
            }
        stages = {
            "sampling_s": w.sampling_s,
            "source_s": source_s,
            "decode_s": decode_s,
            "handoff_s": w.handoff_s,
            "device_s": w.device_s,
        }
        stall_p = percentiles(w.stall_hist, (0.5, 0.95, 0.99))
        lat_p = percentiles(w.lat, (0.5, 0.95, 0.99))
        batches = max(w.batches, 1)
        summary = {
            "rank": self.rank,
            "seconds": wall,
            "steps": w.steps,
            "items": w.items,
            "items_per_s": w.items / wall if wall > 0 else 0.0,
            "stall_s": w.stall_s,
            "stall_fraction": w.stall_s / wall if wall > 0 else 0.0,
            "stall_p50_s": stall_p[0],
            "stall_p95_s": stall_p[1],
            "stall_p99_s": stall_p[2],
            "consumer_s": max(wall - w.stall_s, 0.0),
            "stages": stages,
            "explained": sum(stages.values()) / w.stall_s if w.stall_s > 0 else 1.0,
            "fetch": {
                "items": w.fetches,
                "seconds": w.fetch_s,
                "p50_s": lat_p[0],
                "p95_s": lat_p[1],
                "p99_s": lat_p[2],
                **counters,
            },
            "decode": {"items": w.decodes, "seconds": w.decode_s},
            "queue": {"in_flight": w.depth / batches, "ready": w.ready / batches},
            "workers": {"kind": self.workers[0], "count": self.workers[1], "each": workers},
            "first_batch_s": self.first_batch_s,
        }
        summary["verdict"], summary["why"] = verdict(summary)
        return summary

    # -- reading --------------------------------------------------------------------------

    def report(self) -> dict:
        """What ``batcher.metrics()`` returns: the last closed window, the whole run so far
        (closed windows and the open one), and the closed windows kept."""
        t = now()
        whole = _Window(self.created)
        whole.merge(self._total)
        whole.merge(self._win)
        counters = self._read_counters()
        total_counters = {
            k: self._total_counters[k] + counters[k] - self._counters[k] for k in _COUNTERS
        }
        whole.device_s += self._read_device() - self._device_seen
        return {
            "window": self.closed[-1] if self.closed else None,
            "total": self._summary(whole, t, total_counters),
            "windows": list(self.closed),
            "window_seconds": self.window,
        }

    def totals(self) -> list[float]:
        """The run's totals as numbers (dataset.metrics.ranks sends their differences)."""
        whole = _Window(self.created)
        whole.merge(self._total)
        whole.merge(self._win)
        s = self._summary(whole, now(), dict.fromkeys(_COUNTERS, 0))
        st = s["stages"]
        return [s["seconds"], s["steps"], s["items"], s["stall_s"], st["sampling_s"],
                st["source_s"], st["decode_s"], st["handoff_s"], st["device_s"]]  # fmt: skip


def describe(s: dict) -> str:
    """A window's summary in a line: the verdict first."""
    f = s["fetch"]
    st = s["stages"]
    parts = ", ".join(f"{k[:-2]} {v:.2f}s" for k, v in st.items() if v >= 0.005)
    line = (
        f"{s['seconds']:.0f}s: bound by {s['verdict']} ({s['why']}); "
        f"stall {s['stall_s']:.2f}s over {s['steps']} steps"
        + (f" [{parts}]" if parts else "")
        + f"; {s['items_per_s']:.0f} items/s"
    )
    if f["p50_s"] is not None:  # (rows already in memory are not fetched)
        line += f", fetch p50 {1000 * f['p50_s']:.1f} ms p99 {1000 * f['p99_s']:.1f} ms"
    return line
