"""Fill one batch slot: fetch each item and run the processor into its row.

:func:`fill` is the coroutine both kinds of workers run (:mod:`.threads`, :mod:`.processes`):
it fetches the batch's sources on the event loop and hands each fetched item to the
processor with its row of the slot as ``out`` (on the loop, or in runs on a thread pool:
:class:`Handoff`), and reports which rows succeeded (:class:`BatchResult`), each failure
as an :class:`ItemFailure`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import re
import traceback
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..errors import FetchError, WorkerDied
from ..fetch.fetcher import Fetcher
from ..fetch.stats import Stats
from ..metrics.export import stage
from ..metrics.probe import Activity, add_items, new_probe, now
from ..seeding import call_with_item
from .failures import FETCH, PROCESS, ItemFailure

__all__ = ["BatchResult", "Context", "Handoff", "fill", "stuck"]


@dataclass
class BatchResult:
    """What happened to each row of a batch: small, so it pickles fast."""

    ok: list[bool]
    extras: dict[int, Any] = field(default_factory=dict)
    errors: list[ItemFailure] = field(default_factory=list)
    stats: dict = field(default_factory=Stats)
    probe: dict | None = None  # the batch's timings (dataset.metrics.probe), when measured


# What a batch is decoded under: (seed, partition, epoch, position of its first item),
# and optionally each item's own (partition, epoch, position) where the batch holds items
# of other orders (the pieces of an interrupted epoch, part-file records).
Context = tuple[int, int, int, int] | tuple[int, int, int, int, list | None]


def _verdict(ret: Any) -> tuple[bool, Any]:
    """(keep the item?, its extra) from what a processor returned: `ret` or `(ret, extra)`.

    False drops the item, and so does numpy's False or a one-element torch bool that is
    False (`return out.sum() > 0`); anything else keeps it (None, True, the `out` tensor
    that `out.copy_(...)` returns; 0 too, as in torch-dataset's Lua, where 0 is true).
    """
    extra = None
    if isinstance(ret, tuple):
        if len(ret) != 2:
            raise TypeError(
                f"the processor returned a tuple of {len(ret)}; want (keep, extra) or a bool"
            )
        ret, extra = ret
    if ret is False or isinstance(ret, np.bool_):
        return bool(ret), extra
    if isinstance(ret, torch.Tensor) and ret.dtype == torch.bool and ret.numel() == 1:
        return bool(ret), extra
    return True, extra


_IN_PLACE = (
    ": a processor writes the item into out in place, in its shape (out.copy_(x), "
    "np.copyto(out.numpy(), x)); a torch op given out=out resizes it instead"
)
# Where torch's and numpy's shape errors give the whole shape that was written, or one
# of its dimensions. Read for the note only: what the error does never depends on it.
_WHOLE = (
    re.compile(r"Tensor sizes: \[([\d, ]*)\]"),  # out[...] = x
    re.compile(r"from shape \(([\d, ]*)\)"),  # numpy: np.copyto, out.numpy()[...] = x
    re.compile(r"broadcast shape [\[(]([\d, ]*)[\])]"),  # an op into out
)
_ONE_DIM = re.compile(
    r"size of tensor a \((\d+)\) must match the size of tensor b \((\d+)\) "
    r"at non-singleton dimension (\d+)"  # out.copy_(x)
)


def _wrote(want: Any, what: str) -> str:
    return f"out is {list(want)} (input_dims) but the processor wrote {what}"


def shape_note(err: BaseException, want: Any) -> str | None:
    """For a processor's shape error, what it wrote against what ``out`` is, in the
    contract's words ("out is [1, 28, 28] (input_dims) but the processor wrote
    [3, 224, 224]"); None for any other error."""
    if not isinstance(err, RuntimeError | ValueError):
        return None
    text = str(err)
    for pattern in _WHOLE:
        m = pattern.search(text)
        if m:
            wrote = [int(d) for d in m.group(1).replace(" ", "").split(",") if d]
            return _wrote(want, f"{wrote}") if wrote != list(want) else None
    if "resize storage that is not resizable" in text:  # out= on a batch in shared memory
        return _wrote(want, "a larger tensor through a torch op's out=, which resizes out")
    m = _ONE_DIM.search(text)
    if m and len(want) > int(m.group(3)) and int(m.group(1)) == want[int(m.group(3))]:
        return _wrote(want, f"a tensor whose dimension {m.group(3)} is {m.group(2)}")
    return None


async def fill(
    fetcher: Fetcher,
    sources: list[Any],
    out: torch.Tensor,
    processor: Any,
    opt: Any,
    handoff: Handoff | None = None,
    ctx: Context | None = None,
    activity: Activity | None = None,
) -> BatchResult:
    """Fetch every source and let `processor` decode item i into ``out[i]``, concurrently.

    With `ctx`, item i is decoded as item ``ctx[3] + i`` of its epoch, or as ``ctx[4][i]``
    when the batch gives each item's key (what :func:`dataset.seeding.item_rng` derives
    its generator from).

    Memory: an item holds one of the fetcher's ``pool_size`` hands from the start of
    its fetch until its processor returns, so a worker holds at most ``pool_size``
    item bodies at once, whatever the batches in flight (each at most
    ``max_item_bytes``, and twice that for the moment its last chunk is joined). A
    slow processor used to leave every fetched body of every batch in flight waiting.

    With `activity` (the worker's, :mod:`dataset.metrics.probe`), each item's fetch and
    processor call are timed into ``res.probe``, and the worker's time is accounted.
    """
    res = BatchResult(ok=[False] * len(sources))
    stats = res.stats
    probe = res.probe = new_probe() if activity is not None else None
    # each item's seconds, appended as they come and summed once the batch is done: an
    # append is the cheapest record (the timers' cost per item is the bench's concern)
    fetched: list[float] = []
    decoded: list[float] = []
    seed, partition, epoch, first = ctx[:4] if ctx is not None else (0, 0, 0, 0)
    keys = ctx[4] if ctx is not None and len(ctx) > 4 else None

    hands = fetcher.hands()

    async def one(i: int, source: Any) -> None:
        async with hands:
            await item(i, source)

    async def item(i: int, source: Any) -> None:
        # (a payload already in memory, a tensor row, is not fetched: nothing to time)
        t0 = now() if probe is not None and isinstance(source, str | tuple) else None
        try:
            data = await fetcher.fetch(source, stats)
        except FetchError as err:
            stats["failed"] += 1
            res.errors.append(ItemFailure(i, FETCH, err.cause, type(err).__name__, err))
            return
        except Exception as err:  # a bug or an odd backend error: still only this item
            stats["failed"] += 1
            kind = type(err).__name__
            res.errors.append(
                ItemFailure(i, FETCH, f"{kind}: {err}", kind, err, traceback.format_exc())
            )
            return
        finally:
            if t0 is not None:  # (a failed fetch's time counts: the source took it)
                fetched.append(now() - t0)
        key = (seed, *keys[i]) if keys is not None else (seed, partition, epoch, first + i)
        row = out[i]
        try:
            if handoff is None and activity is None:
                ret = call_with_item(key, processor, data, opt, row)
            elif handoff is None:  # inline, on this loop's thread
                t1 = now()
                try:
                    ret = call_with_item(key, processor, data, opt, row)
                finally:
                    dt = now() - t1
                    decoded.append(dt)
                    activity.decoded(dt)  # (now, not at the batch's end: windows are short)
            else:
                ret = await handoff.submit(key, data, row, probe)
            if row.shape != out.shape[1:]:  # a torch op given out=row resized it
                raise ValueError(_wrote(out.shape[1:], f"{list(row.shape)}") + _IN_PLACE)
            kept, extra = _verdict(ret)
        except (Exception, SystemExit) as err:  # (SystemExit: it would end the loop's thread)
            stats["dropped"] += 1
            kind = type(err).__name__
            cause = f"processor raised {kind}: {err}"
            note = shape_note(err, out.shape[1:])
            if note is not None:
                err.add_note(note)
                cause += f" ({note})"
            res.errors.append(ItemFailure(i, PROCESS, cause, kind, err, traceback.format_exc()))
            return
        if not kept:
            stats["dropped"] += 1
            res.errors.append(ItemFailure(i, PROCESS, "processor returned False"))
            return
        res.ok[i] = True
        if extra is not None:
            res.extras[i] = extra

    if activity is None:
        await asyncio.gather(*(one(i, s) for i, s in enumerate(sources)))
        return res
    activity.job(1)
    try:
        await asyncio.gather(*(one(i, s) for i, s in enumerate(sources)))
    finally:
        activity.job(-1)
        add_items(probe, fetched, decoded)
    probe["sent"] = now()  # the batch is done: what follows is its hand-off
    return res


class Handoff:
    """Fetched items to `threads` decode threads, in runs: a run takes every item
    fetched since the last run started (of any batch in flight), so the two thread
    switches of a hand-off (tens of microseconds, more than a small PNG takes to
    decode) are paid per run, not per item. At most one run per thread is in flight;
    the rest wait in `pending`. Used from the fetcher's loop thread only.
    """

    def __init__(self, threads: int, processor: Any, opt: Any, activity: Activity | None = None):
        self.executor = concurrent.futures.ThreadPoolExecutor(
            threads, thread_name_prefix="dataset-decode"
        )
        self.threads, self.processor, self.opt = threads, processor, opt
        self.activity = activity  # the decode threads' time, when measured
        self.running = 0
        self.pending: list[tuple[Any, Any, torch.Tensor, asyncio.Future, dict | None]] = []

    def submit(
        self, key: Any, data: Any, row: torch.Tensor, probe: dict | None = None
    ) -> asyncio.Future:
        """`processor(data, opt, row)` as item `key`; a future of what it returned (its
        time is added to `probe`)."""
        done = asyncio.get_running_loop().create_future()
        self.pending.append((key, data, row, done, probe))
        if self.running < self.threads:
            self._start()
        return done

    def _start(self) -> None:
        run = [item for item in self.pending if not item[3].cancelled()]
        self.pending = []
        if not run:
            return
        loop = asyncio.get_running_loop()
        try:
            job = self.executor.submit(self._decode, run)
        except RuntimeError as err:  # the pool was shut down: every item of the run fails
            for _, _, _, done, _ in run:
                done.set_exception(err)
            return
        self.running += 1
        job.add_done_callback(lambda job: self._back(loop, run, job))

    def _decode(self, run: list) -> list[tuple[Any, BaseException | None, float]]:
        """On a decode thread: each item's return value or exception, and its seconds."""
        results = []
        activity = self.activity
        t = activity.decode(1) if activity is not None else None
        with stage("dataset.decode"):  # a range in a PyTorch trace, on this thread
            try:
                for key, data, row, _, _ in run:
                    try:
                        ret, err = call_with_item(key, self.processor, data, self.opt, row), None
                    except Exception as e:
                        ret, err = None, e
                    seconds = 0.0
                    if t is not None:
                        t1 = now()
                        seconds, t = t1 - t, t1
                    results.append((ret, err, seconds))
            finally:
                if activity is not None:
                    activity.decode(-1)
        return results

    def _back(self, loop: asyncio.AbstractEventLoop, run: list, job) -> None:
        """On the decode thread, as a run ends: its results to the loop."""
        with contextlib.suppress(RuntimeError):  # a closed loop (shutting down): nobody waits
            loop.call_soon_threadsafe(self._done, run, job)

    def _done(self, run: list, job: concurrent.futures.Future) -> None:
        """On the loop: settle each item's future, then start the next run."""
        self.running -= 1
        if job.cancelled():  # the pool shut down before the run began
            results = None
        elif job.exception() is not None:
            results = [(None, job.exception(), 0.0)] * len(run)
        else:
            results = job.result()
        for i, (_, _, _, done, probe) in enumerate(run):
            if probe is not None and results is not None:
                probe["decode_s"] += results[i][2]
                probe["decodes"] += 1
            if done.done():
                continue
            if results is None:
                done.cancel()
            elif results[i][1] is None:
                done.set_result(results[i][0])
            else:
                done.set_exception(results[i][1])
        if self.pending and self.running < self.threads:
            self._start()

    def close(self) -> None:
        self.executor.shutdown(wait=True, cancel_futures=True)


def stuck(what: str, timeout: float) -> WorkerDied:
    return WorkerDied(
        f"{what} finished no batch in worker_timeout={timeout}s: it is stuck (a processor or "
        "read that hangs, a stopped process); raise worker_timeout if a batch takes longer"
    )
