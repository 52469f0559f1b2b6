"""Process workers: `num_workers` processes decoding straight into a shared batch ring.

Each process has its own event loop and HTTP session and writes into the ring, which
lives in shared memory allocated once (:class:`RingMemory`, a file without a name). The
main process sends one small message per batch (slot and sources) and gets back which
rows succeeded; it never touches the bytes. Works with the fork, forkserver and spawn
start methods.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import mmap
import multiprocessing as mp
import os
import pickle
import signal
import tempfile
import time
from collections import deque
from multiprocessing import reduction
from typing import Any

import numpy as np
import torch

from ..errors import WorkerDied
from ..fetch.fetcher import Fetcher
from ..metrics.probe import Activity
from ..seeding import seed_worker
from .failures import ItemFailure
from .fill import BatchResult, Context, fill, stuck

__all__ = ["ProcessWorkers", "RingMemory"]


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
        measure: bool = True,
    ):
        try:
            payload = pickle.dumps((processor, opt, measure), protocol=pickle.HIGHEST_PROTOCOL)
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
                    raise stuck(f"dataset worker process {w} (pid {proc.pid})", self.timeout)
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

    def ready(self, handle: tuple[int, int]) -> bool:
        """Whether job `handle`'s answer has come (or waits in its pipe): a queue depth."""
        w, job = handle
        if job in self._answers:
            return True
        # answers come in job order: this one is in when every earlier job of the
        # worker's is answered and something waits in the pipe
        queue = self._outstanding[w]
        return bool(queue) and queue[0] == job and self._conns[w].poll(0)

    def _died(self, w: int, err: BaseException | None) -> WorkerDied:
        proc = self._procs[w]
        proc.join(timeout=1)
        return WorkerDied(
            f"dataset worker process {w} (pid {proc.pid}) died with exit code "
            f"{proc.exitcode}" + (f" ({err})" if err else "")
        )

    def slot_array(self, slot: int) -> np.ndarray:
        """Slot `slot` as a numpy array holding a buffer export of the shared memory, so
        the mapping outlives close() while the array lives (a batch lent the slot)."""
        shape = tuple(self.slots.shape[1:])
        count = math.prod(shape)
        offset = slot * count * self.slots.element_size()
        return np.frombuffer(self._ring.buf, np.float32, count, offset).reshape(shape)

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
    processor, opt, measure = pickle.loads(payload)
    slots = torch.frombuffer(ring.buf, dtype=torch.float32, count=math.prod(shape)).view(shape)
    try:
        asyncio.run(_worker_loop(conn, slots, processor, opt, fetch_kw, rank, measure))
    finally:
        del slots
        ring.close()
        conn.close()
        os._exit(0)  # skip atexit (the resource tracker, torch) in a worker


async def _worker_loop(
    conn, slots: torch.Tensor, processor, opt, fetch_kw: dict, rank: int, measure: bool
):
    loop = asyncio.get_running_loop()
    fetcher = Fetcher(**fetch_kw)
    activity = Activity() if measure else None  # this worker's time, for the metrics
    done = asyncio.Event()
    previous: asyncio.Future | None = None
    tasks: set[asyncio.Task] = set()
    gone = [False]  # the main process's end of the pipe is closed
    seeded: list[Any] = [None]  # the (seed, partition, epoch) the globals were seeded for

    async def run(job: int, slot: int, sources: list, ctx, before) -> None:
        try:
            res: Any = await fill(
                fetcher, sources, slots[slot], processor, opt, None, ctx, activity
            )
            for failure in res.errors:
                _keep_if_picklable(failure)
        except BaseException as err:  # report, so the main process raises it
            res = RuntimeError(f"worker failed on a batch: {type(err).__name__}: {err}")
        if before is not None:
            await asyncio.wait([before])  # answers go back in job order
        if getattr(res, "probe", None) is not None:
            # stamped as it leaves: until now the loop was busy with other batches' items
            res.probe["sent"] = time.perf_counter()
            res.probe["worker"] = rank
            res.probe["activity"] = activity.snapshot()
        try:
            payload = reduction.ForkingPickler.dumps((job, res))
        except Exception as err:  # an extra the processor returned that cannot travel
            res = RuntimeError(
                f"worker failed on a batch: its result cannot be sent to the main process "
                f"({type(err).__name__}: {err}): with workers='process' a processor's extra "
                "must be picklable (or use workers='thread')"
            )
            payload = reduction.ForkingPickler.dumps((job, res))
        if gone[0]:
            return
        try:
            conn.send_bytes(payload)
        except (BrokenPipeError, ConnectionResetError):
            # The main process is gone (its rank died or was killed): no one is left to
            # answer, and a traceback per batch in flight would bury the rank's own error.
            gone[0] = True
            done.set()

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
