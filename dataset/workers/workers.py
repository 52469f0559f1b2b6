"""Workers: fetch and decode one batch of sources into a slot of the batch ring.

Two kinds with one interface (``submit(slot, sources) -> job``, ``result(job)``,
``close()``), both running the same coroutine, :func:`fill`:

- :class:`ThreadWorkers`: one Fetcher loop thread in this process; processors
  run on a pool of `num_workers` threads, handed over in runs (:class:`Handoff`),
  or inline on the loop thread (0). Cheap to start, but the GIL caps decoding at
  about one core.
- :class:`ProcessWorkers`: `num_workers` processes, each with its own event
  loop and HTTP session, decoding straight into the ring, which lives in shared
  memory allocated once (:class:`RingMemory`, a file without a name). The main
  process sends one small message per batch (slot and sources) and gets back
  which rows succeeded; it never touches the bytes. Works with the fork,
  forkserver and spawn start methods.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import math
import mmap
import multiprocessing as mp
import os
import pickle
import signal
import tempfile
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from multiprocessing import reduction
from typing import Any

import numpy as np
import torch

from ..errors import FetchError, WorkerDied
from ..fetch.fetcher import Fetcher, Stats
from ..seeding import call_with_item, seed_worker
from .failures import FETCH, PROCESS, ItemFailure

log = logging.getLogger(__name__)


@dataclass
class BatchResult:
    """What happened to each row of a batch: small, so it pickles fast."""

    ok: list[bool]
    extras: dict[int, Any] = field(default_factory=dict)
    errors: list[ItemFailure] = field(default_factory=list)
    stats: dict = field(default_factory=Stats)


# What a batch is decoded under: (seed, partition, epoch, position of its first item)
Context = tuple[int, int, int, int]


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


async def fill(
    fetcher: Fetcher,
    sources: list[Any],
    out: torch.Tensor,
    processor: Any,
    opt: Any,
    handoff: Handoff | None = None,
    ctx: Context | None = None,
) -> BatchResult:
    """Fetch every source and let `processor` decode item i into ``out[i]``, concurrently.

    With `ctx`, item i is decoded as item ``ctx[3] + i`` of its epoch (what
    :func:`dataset.seeding.item_rng` derives its generator from).
    """
    res = BatchResult(ok=[False] * len(sources))
    stats = res.stats
    seed, partition, epoch, first = ctx if ctx is not None else (0, 0, 0, 0)

    async def one(i: int, source: Any) -> None:
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
        key = (seed, partition, epoch, first + i)
        try:
            if handoff is None:
                ret = call_with_item(key, processor, data, opt, out[i])
            else:
                ret = await handoff.submit(key, data, out[i])
            kept, extra = _verdict(ret)
        except (Exception, SystemExit) as err:  # (SystemExit: it would end the loop's thread)
            stats["dropped"] += 1
            kind = type(err).__name__
            cause = f"processor raised {kind}: {err}"
            res.errors.append(ItemFailure(i, PROCESS, cause, kind, err, traceback.format_exc()))
            return
        if not kept:
            stats["dropped"] += 1
            res.errors.append(ItemFailure(i, PROCESS, "processor returned False"))
            return
        res.ok[i] = True
        if extra is not None:
            res.extras[i] = extra

    await asyncio.gather(*(one(i, s) for i, s in enumerate(sources)))
    return res


class Handoff:
    """Fetched items to `threads` decode threads, in runs: a run takes every item
    fetched since the last run started (of any batch in flight), so the two thread
    switches of a hand-off (tens of microseconds, more than a small PNG takes to
    decode) are paid per run, not per item. At most one run per thread is in flight;
    the rest wait in `pending`. Used from the fetcher's loop thread only.
    """

    def __init__(self, threads: int, processor: Any, opt: Any):
        self.executor = concurrent.futures.ThreadPoolExecutor(
            threads, thread_name_prefix="dataset-decode"
        )
        self.threads, self.processor, self.opt = threads, processor, opt
        self.running = 0
        self.pending: list[tuple[Any, Any, torch.Tensor, asyncio.Future]] = []

    def submit(self, key: Any, data: Any, row: torch.Tensor) -> asyncio.Future:
        """`processor(data, opt, row)` as item `key`; a future of what it returned."""
        done = asyncio.get_running_loop().create_future()
        self.pending.append((key, data, row, done))
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
            for *_, done in run:
                done.set_exception(err)
            return
        self.running += 1
        job.add_done_callback(lambda job: self._back(loop, run, job))

    def _decode(self, run: list) -> list[tuple[Any, BaseException | None]]:
        """On a decode thread: each item's return value or exception."""
        results = []
        for key, data, row, _ in run:
            try:
                results.append((call_with_item(key, self.processor, data, self.opt, row), None))
            except Exception as err:
                results.append((None, err))
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
            results = [(None, job.exception())] * len(run)
        else:
            results = job.result()
        for i, (*_, done) in enumerate(run):
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


def _stuck(what: str, timeout: float) -> WorkerDied:
    return WorkerDied(
        f"{what} finished no batch in worker_timeout={timeout}s: it is stuck (a processor or "
        "read that hangs, a stopped process); raise worker_timeout if a batch takes longer"
    )


class ThreadWorkers:
    """Fetch on one event loop thread, decode on `num_workers` threads, all in this process."""

    kind = "thread"

    def __init__(self, slots: torch.Tensor, processor: Any, opt: Any, fetch_kw: dict,
                 num_workers: int = 1, timeout: float | None = None):  # fmt: skip
        self.slots = slots
        self.processor, self.opt, self.timeout = processor, opt, timeout
        self.fetcher = Fetcher(**fetch_kw)
        self.handoff = Handoff(num_workers, processor, opt) if num_workers > 0 else None

    def submit(
        self, slot: int, sources: list[Any], ctx: Context | None = None
    ) -> concurrent.futures.Future:
        out = self.slots[slot]
        return self.fetcher.submit(
            fill(self.fetcher, sources, out, self.processor, self.opt, self.handoff, ctx)
        )

    def result(self, job: concurrent.futures.Future) -> BatchResult:
        try:
            return job.result(timeout=self.timeout)
        except concurrent.futures.TimeoutError:
            raise _stuck("the thread workers", self.timeout) from None

    def close(self) -> None:
        self.fetcher.close()
        if self.handoff is not None:
            self.handoff.close()


class RingMemory:
    """Shared memory for the batch ring: a file that never has a name.

    A named /dev/shm segment outlives a creator killed with SIGKILL (the OOM
    killer, a preempted job), and enough of them fill the host's RAM. This is
    a ``memfd`` (an unlinked temporary file where there is none), handed to the
    workers by descriptor: forked workers inherit it, spawned ones receive a
    duplicate when the process object is pickled. It is freed with the last
    process that maps it, however that process ends.
    """

    def __init__(self, nbytes: int, fd: int | None = None):
        if fd is None:
            if hasattr(os, "memfd_create"):
                fd = os.memfd_create("dataset-ring")
            else:
                with tempfile.TemporaryFile() as f:
                    fd = os.dup(f.fileno())
            os.ftruncate(fd, nbytes)
        self.fd, self.nbytes = fd, nbytes
        self.buf = mmap.mmap(fd, nbytes)

    def __reduce__(self):
        # Pickled only for spawn/forkserver workers, while the process starts.
        return _attach_ring, (reduction.DupFd(self.fd), self.nbytes)

    def close(self) -> None:
        # BufferError: a batch view still maps it; the mapping goes with the last reference
        with contextlib.suppress(BufferError):
            self.buf.close()
        with contextlib.suppress(OSError):
            os.close(self.fd)


def _attach_ring(dup: Any, nbytes: int) -> RingMemory:
    return RingMemory(nbytes, dup.detach())


class ProcessWorkers:
    """`num_workers` processes filling a ring of batch slots in shared memory."""

    kind = "process"

    def __init__(
        self,
        shape: tuple[int, ...],
        processor: Any,
        opt: Any,
        fetch_kw: dict,
        num_workers: int,
        mp_context: str | None = None,
        timeout: float | None = None,
    ):
        try:
            payload = pickle.dumps((processor, opt), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as err:
            raise TypeError(
                f"workers='process' needs a picklable processor and processor_opt, but "
                f"{processor!r} cannot be pickled ({type(err).__name__}: {err}); use a "
                "module-level function or a class instance such as dataset.processors.Image, "
                "or workers='thread'"
            ) from err
        if fetch_kw.get("cache") is not None:
            try:
                pickle.dumps(fetch_kw["cache"])
            except Exception as err:
                raise TypeError(f"workers='process' needs a picklable cache: {err}") from err
        ctx = mp.get_context(mp_context)
        forks = ctx.get_start_method() == "fork"
        nbytes = max(1, math.prod(shape) * 4)
        self._ring = RingMemory(nbytes)
        self.slots = torch.frombuffer(self._ring.buf, dtype=torch.float32, count=math.prod(shape))
        self.slots = self.slots.view(shape)
        self._procs: list[Any] = []
        self._conns: list[Any] = []
        self._outstanding: list[deque] = []
        self._answers: dict[int, Any] = {}  # received, not yet taken (an interrupted result())
        self._next_job = 0
        self._closed = False
        self._pid = os.getpid()  # a forked copy (a DataLoader worker) must not close them
        self.timeout = timeout
        try:
            for w in range(num_workers):
                parent, child = ctx.Pipe(duplex=True)
                # A forked worker inherits our ends of its pipe and of the earlier
                # workers' pipes; it closes them, or a pipe would never read as
                # closed and a worker would outlive a main process that was killed.
                ours = [c.fileno() for c in [*self._conns, parent]] if forks else []
                proc = ctx.Process(
                    target=_worker_main,
                    args=(child, self._ring, shape, payload, fetch_kw, w, ours),
                    name=f"dataset-worker-{w}",
                    daemon=True,
                )
                proc.start()
                child.close()  # so a dead worker reads as EOF here
                self._procs.append(proc)
                self._conns.append(parent)
                self._outstanding.append(deque())
        except BaseException:
            self.close()
            raise

    def submit(self, slot: int, sources: list[Any], ctx: Context | None = None) -> tuple[int, int]:
        # least loaded worker; ties go to the lowest index
        w = min(range(len(self._procs)), key=lambda i: len(self._outstanding[i]))
        job = self._next_job
        self._next_job += 1
        try:
            self._conns[w].send((job, slot, sources, ctx))
        except (BrokenPipeError, ConnectionResetError, OSError) as err:
            raise self._died(w, err) from None
        self._outstanding[w].append(job)
        return w, job

    def result(self, handle: tuple[int, int]) -> BatchResult:
        """The answer to job `handle`; safe to call again after an interruption (Ctrl-C)."""
        w, job = handle
        # each worker answers its jobs in order, and jobs are consumed in global
        # order, so the answers on this worker's pipe come in its jobs' order
        conn, proc = self._conns[w], self._procs[w]
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        while job not in self._answers:
            while not conn.poll(0.5):
                if not proc.is_alive():
                    raise self._died(w, None)
                if deadline is not None and time.monotonic() > deadline:
                    raise _stuck(f"dataset worker process {w} (pid {proc.pid})", self.timeout)
            try:
                got, res = conn.recv()
            except (EOFError, ConnectionResetError, OSError) as err:
                raise self._died(w, err) from None
            expected = self._outstanding[w].popleft()
            if got != expected:
                raise WorkerDied(f"dataset worker process {w} answered job {got}, not {expected}")
            self._answers[got] = res
        res = self._answers.pop(job)
        if isinstance(res, BaseException):
            raise res
        return res

    def _died(self, w: int, err: BaseException | None) -> WorkerDied:
        proc = self._procs[w]
        proc.join(timeout=1)
        return WorkerDied(
            f"dataset worker process {w} (pid {proc.pid}) died with exit code "
            f"{proc.exitcode}" + (f" ({err})" if err else "")
        )

    def close(self) -> None:
        if self._closed or self._pid != os.getpid():
            return
        self._closed = True
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.send(None)
        for proc in self._procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self._conns:
            conn.close()
        del self.slots
        self._ring.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


def _worker_main(
    conn, ring: RingMemory, shape, payload: bytes, fetch_kw: dict, rank: int, inherited: list[int]
) -> None:
    """A process worker: its own event loop and session, decoding into shared memory.

    It exits when its pipe closes: at ``close()``, or when the main process dies.
    """
    for fd in inherited:
        with contextlib.suppress(OSError):
            os.close(fd)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the main process's to handle
    torch.set_num_threads(1)
    processor, opt = pickle.loads(payload)
    slots = torch.frombuffer(ring.buf, dtype=torch.float32, count=math.prod(shape)).view(shape)
    try:
        asyncio.run(_worker_loop(conn, slots, processor, opt, fetch_kw, rank))
    finally:
        del slots
        ring.close()
        conn.close()
        os._exit(0)  # skip atexit (the resource tracker, torch) in a worker


async def _worker_loop(conn, slots: torch.Tensor, processor, opt, fetch_kw: dict, rank: int):
    loop = asyncio.get_running_loop()
    fetcher = Fetcher(**fetch_kw)
    done = asyncio.Event()
    previous: asyncio.Future | None = None
    tasks: set[asyncio.Task] = set()
    seeded: list[Any] = [None]  # the (seed, partition, epoch) the globals were seeded for

    async def run(job: int, slot: int, sources: list, ctx, before) -> None:
        try:
            res: Any = await fill(fetcher, sources, slots[slot], processor, opt, None, ctx)
            for failure in res.errors:
                _keep_if_picklable(failure)
        except BaseException as err:  # report, so the main process raises it
            res = RuntimeError(f"worker failed on a batch: {type(err).__name__}: {err}")
        try:
            payload = reduction.ForkingPickler.dumps((job, res))
        except Exception as err:  # an extra the processor returned that cannot travel
            res = RuntimeError(
                f"worker failed on a batch: its result cannot be sent to the main process "
                f"({type(err).__name__}: {err}): with workers='process' a processor's extra "
                "must be picklable (or use workers='thread')"
            )
            payload = reduction.ForkingPickler.dumps((job, res))
        if before is not None:
            await before  # answers go back in job order
        conn.send_bytes(payload)

    def readable() -> None:
        nonlocal previous
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            msg = None
        if msg is None:
            loop.remove_reader(conn.fileno())
            done.set()
            return
        job, slot, sources, ctx = msg
        if ctx is not None and ctx[:3] != seeded[0]:
            seeded[0] = ctx[:3]  # a new epoch: this worker's own random streams
            seed_worker(*ctx[:3], rank)
        task = loop.create_task(run(job, slot, sources, ctx, previous))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        previous = task

    loop.add_reader(conn.fileno(), readable)
    try:
        await done.wait()
        if tasks:
            await asyncio.wait(tasks, timeout=5)
    finally:
        await fetcher.aclose()


def _keep_if_picklable(failure: ItemFailure) -> None:
    """Drop an exception that cannot cross to the main process (its type and traceback stay)."""
    if failure.error is None:
        return
    try:
        pickle.dumps(failure.error)
    except Exception:
        failure.error = None
