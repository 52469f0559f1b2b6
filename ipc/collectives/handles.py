"""Asynchronous collectives: `Handle`, and the communication thread that runs them in order.

One communication thread per tree runs asynchronous collectives (`async_op=True`) in
the order they were started and, between collectives, answers the links (goodbyes,
errors, early data, progress reports). A thread that waits on a handle runs the queued
collectives up to it itself, in order, rather than sleep while the communication
thread runs them: on a host with more processes than cores, each hand-off between the
two threads (and of the interpreter's lock) cost more than a collective of several MiB.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
import weakref
from collections import deque
from typing import TYPE_CHECKING

from ..errors import IPCError
from .running import FUSE_MAX

if TYPE_CHECKING:  # (tree.py imports this module)
    from .tree import Tree

__all__ = ["Handle"]

SERVICE_EVERY_S = 0.05  # how often the idle communication thread answers the links
# While collectives run back to back the communication thread has nothing to do; it looks
# ever less often (each wake-up takes the interpreter's lock from the caller), up to this.
SERVICE_NAP_MAX_S = 0.4


class Handle:
    """A collective in flight, from `all_reduce`, `scatter` or `barrier` with `async_op`.

    `wait()` returns what the synchronous call returns (the number of contributing
    nodes for all_reduce) or raises what it would raise.

    A thread that waits without a `timeout` runs the queued collectives, up to and
    including this one, in its own thread (in order, as the communication thread would)
    instead of sleeping while the communication thread does: handing each collective
    from thread to thread, and the interpreter's lock back and forth, cost more than the
    collective on a busy host."""

    __slots__ = ("_done", "_error", "_queue", "_result")

    def __init__(self, queue: _CommThread | None = None):
        self._done = threading.Event()
        self._result: int | None = None
        self._error: BaseException | None = None
        self._queue = queue

    def is_completed(self) -> bool:
        """Whether the collective is done (`wait()` would not block).

        Returns:
            True once done, or failed.
        """
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> int | None:
        """Block until the collective is done (the tree's own timeout bounds it).

        Args:
            timeout: Seconds to wait at most; the collective goes on running after.

        Returns:
            What the synchronous call returns: the contributor count for all_reduce,
            None for scatter and barrier.

        Raises:
            TimeoutError: `timeout` passed with the collective still running.
            IPCError: What the synchronous call would have raised (`PeerError`...).
        """
        if timeout is None and self._queue is not None and not self._done.is_set():
            self._queue.help(self)
        if not self._done.wait(timeout):
            raise TimeoutError(f"the collective is still running after {timeout}s")
        if self._error is not None:
            raise self._error
        return self._result

    def _finish(self, result: int | None, error: BaseException | None) -> None:
        self._result, self._error = result, error
        self._queue = None
        self._done.set()


class _Job:
    __slots__ = ("args", "handle")

    def __init__(self, args: tuple, handle: Handle):
        self.args = args
        self.handle = handle


class _CommThread(threading.Thread):
    """Runs queued collectives in order; answers the links while there are none.

    The queue's head is the collective running or next to run; whoever runs it (this
    thread, or a thread waiting on a handle: see `help`) is its `runner` and leaves it
    at the head until it is done, so collectives run one at a time, in submission order.
    Two conditions on one lock: this thread is woken only when the queue is its to run
    (or the tree closes), waiters only when a collective finishes; a wake-up that finds
    nothing to do costs a hand-off of the interpreter's lock all the same.
    The links are answered once nothing has run for SERVICE_EVERY_S: a collective
    answers them itself, and a service between two back-to-back collectives would only
    hold the caller up. While collectives keep coming, this thread looks at doubling
    intervals (up to SERVICE_NAP_MAX_S), so a busy loop wakes it a few times a second."""

    def __init__(self, tree: Tree):
        super().__init__(name=f"ipc-tree-{tree.node_index}", daemon=True)
        self.tree = weakref.proxy(tree)
        self.lock = tree._lock
        mutex = threading.Lock()
        self.mutex = mutex
        self.to_comm = threading.Condition(mutex)  # the queue is ours to run; closing
        self.to_waiters = threading.Condition(mutex)  # a collective finished
        self.queue: deque[_Job] = deque()
        self.runner: int | None = None  # the thread running the queue's head
        self.helpers = 0  # threads in help(): they run the queue, not this thread
        self.stopping = False
        self.active = time.monotonic()  # when a collective (or a service) last ended
        self.nap = SERVICE_EVERY_S

    def submit(self, args: tuple) -> Handle:
        handle = Handle(self)
        with self.mutex:
            if self.stopping:
                raise IPCError("the tree is closing", node=None)
            self.queue.append(_Job(args, handle))
            if self.runner is None and not self.helpers:
                self.to_comm.notify()
        return handle

    def drain(self, timeout: float) -> None:
        """Wait until every queued collective has run."""
        deadline = time.monotonic() + timeout
        with self.mutex:
            while (self.queue or self.runner is not None) and time.monotonic() < deadline:
                self.to_waiters.wait(0.1)

    def stop(self) -> None:
        with self.mutex:
            self.stopping = True
            self.to_comm.notify()

    def _run_head(self, reraise: bool) -> None:
        """Run the collective at the head of the queue (the caller is its `runner`) and
        take it off, with those queued behind it that ran fused with it (see
        Tree._collective). Its error goes to its handle (the ones behind it stay queued
        and raise what their own calls would); a KeyboardInterrupt in a helping main
        thread (`reraise`) goes on to that thread too, as from a synchronous call."""
        done, jobs = 1, [self.queue[0]]
        try:
            with self.lock:
                with self.mutex:  # what is queued once we hold the engine (appends go on)
                    jobs = list(itertools.islice(self.queue, FUSE_MAX))
                result, done = self.tree._collective_fused([job.args for job in jobs])
        except BaseException as exc:
            jobs[0].handle._finish(None, exc)
            if reraise and not isinstance(exc, Exception):
                raise
        else:
            for job in jobs[:done]:
                job.handle._finish(result, None)
        finally:
            self.active = time.monotonic()
            with self.mutex:
                for _ in range(done):
                    self.queue.popleft()
                self.runner = None
                self.to_waiters.notify_all()

    def _let_submitters_finish(self) -> None:
        """Woken by a submission: give the interpreter's lock back while the submitting
        thread is still queueing (a step's buckets come in a burst), so the run starts
        with all of them queued and they can run fused. Costs one yield when nothing
        more comes (a bucket hook that returns to backward)."""
        queued = -1
        while queued != len(self.queue) < FUSE_MAX and not self.helpers:
            queued = len(self.queue)
            time.sleep(0)

    def help(self, handle: Handle) -> None:
        """Run queued collectives in this thread, in order, until `handle`'s is done. While
        a thread helps, the communication thread leaves the queue to it (it only finishes
        the collective it is running): two runners racing for each next collective would
        bring the hand-offs back."""
        if os.getpid() != self.tree._pid:
            self.tree._check()  # a forked child: raises, naming the parent
        me = threading.get_ident()
        counted = False
        try:
            with self.mutex:
                self.helpers += 1
                counted = True
            while not handle.is_completed():
                with self.mutex:
                    if self.runner is not None:
                        self.to_waiters.wait(SERVICE_EVERY_S)
                        continue
                    if handle.is_completed():
                        break
                    self.runner = me  # the queue holds our job: it is not empty
                self._run_head(reraise=True)
        finally:
            with self.mutex:
                self.helpers -= counted
                if self.runner == me:  # interrupted before the head ran: it stays queued
                    self.runner = None
                    self.to_waiters.notify_all()
                # What is still queued is this thread's again; it looks within
                # SERVICE_EVERY_S. No wake-up here: the waiter usually comes right back
                # for the next handle, and waking this thread for nothing costs a hand-off.

    def run(self) -> None:
        try:
            while True:
                service = False
                with self.mutex:
                    if self.stopping and not self.queue and self.runner is None:
                        return
                    if self.queue and self.runner is None and not self.helpers:
                        self.runner = self.ident
                    else:
                        # A helper runs the queue, or answer the links once quiet.
                        busy = self.runner is not None or bool(self.queue)
                        quiet = time.monotonic() - self.active
                        if busy:  # within SERVICE_EVERY_S of a helper leaving work here
                            self.to_comm.wait(SERVICE_EVERY_S)
                            continue
                        if quiet < SERVICE_EVERY_S:
                            self.to_comm.wait(self.nap)
                            self.nap = min(2 * self.nap, SERVICE_NAP_MAX_S)
                            continue
                        self.nap = SERVICE_EVERY_S
                        service = True
                if service:
                    if self.lock.acquire(blocking=False):
                        try:
                            self.tree._service()
                        finally:
                            self.lock.release()
                    self.active = time.monotonic()
                    continue
                self._let_submitters_finish()
                self._run_head(reraise=False)
        except ReferenceError:
            return  # the tree was collected
