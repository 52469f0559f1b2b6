"""`ipc.map`: run fn(*args, i) for i in range(n) in n processes and gather the results.

    results = ipc.map(4, fn, table, 0.5).join()    # [fn(table, 0.5, 0), ..., fn(table, 0.5, 3)]

torch-ipc's `ipc.map`, with 0-based indexes. The workers are forked by
default (a closure works; `context="spawn"` needs a picklable fn and args).
Each worker dials the parent over an authenticated link (a Unix socket in
the private runtime directory, a fresh random secret the child inherits) and
sends one message: its result as an :mod:`ipc.transport.wire` value (tensors, nested
containers, scalars, bytes), or the exception it raised (type, message and
traceback as text). Nothing a worker sends is unpickled.

`join()` returns the results in index order. The first failure ends the map:
`join()` stops the other workers (SIGTERM, then SIGKILL; until then they run on,
and those still starting are answered) and raises
- the worker's exception, rebuilt when it is a built-in type (ValueError,
  KeyError, ...) or ipc's IPCError or PeerError, and `WorkerError` otherwise,
  with the worker's traceback as its `__cause__` and in `.traceback`; writes to
  channels and work queues that a worker could not deliver (their owner gone, or
  frozen past the heartbeats) fail it with a PeerError that counts them, never
  a result as if they had arrived;
- `PeerError` naming a worker that died without a result (SIGKILL, os._exit)
  and the signal or exit code;
- `IPCTimeoutError` after `timeout` seconds.
Workers die with the parent process (a pidfd watched in each), so none outlives a
killed job; a worker frozen past the heartbeats (SIGSTOP) is a PeerError too.
A map still running when the parent's interpreter exits (no `join()`: an
exception, or a return before it) is stopped the same way, with a warning:
multiprocessing would otherwise wait at exit for workers that may wait on the
parent (a WorkQueue read) for ever.
Forked workers run torch with one thread (`torch.set_num_threads(1)`, as
DataLoader's workers do): torch's OpenMP pool does not survive fork(), and a
parallel op in the child would hang on the parent's threads.
"""

from __future__ import annotations

import atexit
import builtins
import contextlib
import logging
import multiprocessing
import os
import signal
import threading
import time
import traceback
import weakref
from collections.abc import Callable

import torch

from distlearn.common.errors import RemoteTraceback
from distlearn.common.keywords import checked
from distlearn.common.procs import die_with_parent

from ..errors import IPCError, IPCTimeoutError, PeerError
from ..transport import Endpoint, Link, Secret, random_secret, wire
from . import remote

__all__ = ["Map", "RemoteTraceback", "WorkerError", "map"]

log = logging.getLogger(__name__)

_MAX_TRACEBACK = 64 << 10


class WorkerError(IPCError):
    """A map worker raised an exception whose type is not a built-in one.

    Attributes:
        index: The worker's index.
        type: The exception's type name.
        traceback: The worker's traceback, as text.
    """

    def __init__(self, message: str, index: int, type_name: str, tb: str):
        super().__init__(message, index)
        self.index = index
        self.type = type_name
        self.traceback = tb


def _worker(
    address: str, secret_text: str, fn: Callable, args: tuple, i: int, forked: bool, parent: int
) -> None:
    """One worker: dial the parent, run fn, send its result or its exception."""
    die_with_parent(parent)  # (a pidfd: the parent *process*, not the forking thread)
    if forked:
        # torch's OpenMP pool does not survive fork(): a parallel op would wait forever on
        # the parent's threads. One thread, as DataLoader's forked workers run.
        torch.set_num_threads(1)
    ep = Endpoint(Secret(secret_text, "map"), f"map worker {i}", info={"i": i, "pid": os.getpid()})
    try:
        link = ep.dial(address, reconnect=False)
        ep.wait_up([link], time.monotonic() + 60, "the map's parent")
        try:
            result = fn(*args, i)
            frames = wire.pack_value({"i": i, "ok": True, "value": result})
            # Its writes to channels and work queues arrive first; writes that could not
            # be delivered (their owner gone or frozen) fail the worker, naming them.
            remote.close_remotes()
        except BaseException as exc:
            tb = traceback.format_exc()[-_MAX_TRACEBACK:]
            frames = wire.pack_value(
                {"i": i, "ok": False, "type": type(exc).__name__, "message": str(exc)[:4096],
                 "traceback": tb}
            )  # fmt: skip
            with contextlib.suppress(IPCError):
                remote.close_remotes()  # (what fn raised is the news)
        link.send_frames(frames, copy=True)
    finally:
        ep.close()  # returns once the parent has read the result (or is gone)


# ipc's own errors come back as themselves (a worker's writes that could not be
# delivered are a PeerError, as in the worker).
_IPC_ERRORS = {c.__name__: c for c in (IPCError, IPCTimeoutError, PeerError)}


def _rebuild(index: int, body: dict) -> BaseException:
    type_name = str(body.get("type", "Exception"))
    message = str(body.get("message", ""))
    tb = str(body.get("traceback", ""))
    cls = _IPC_ERRORS.get(type_name) or getattr(builtins, type_name, None)
    exc: BaseException | None = None
    if isinstance(cls, type) and issubclass(cls, Exception) and not issubclass(cls, OSError):
        with contextlib.suppress(Exception):
            exc = cls(f"map worker {index}: {message}")
    if exc is None:
        exc = WorkerError(f"map worker {index} raised {type_name}: {message}", index, type_name, tb)
    exc.__cause__ = RemoteTraceback(tb)
    return exc


def _how_it_ended(code: int | None) -> str:
    if code is None:
        return "is still running"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code} without a result"


class Map:
    """n processes running fn(*args, i); `join()` gathers their results in order.

    Made by `ipc.map`. Until `join()` the workers run on; a map not joined when its
    parent's interpreter exits is stopped, with a warning.

    Args:
        n: How many processes.
        fn: The function; picklable for `context="spawn"`.
        args: Its leading arguments.
        context: `"fork"` (torch with one thread in the workers) or `"spawn"`.

    Raises:
        ValueError: `n` is not an int >= 1.
        TypeError: `fn` is not callable, or a misspelt option.
    """

    @checked
    def __init__(self, n: int, fn: Callable, args: tuple = (), *, context: str = "fork"):
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"ipc.map: n must be an int >= 1, not {n!r}")
        if not callable(fn):
            raise TypeError(f"ipc.map: fn must be callable, not {type(fn).__name__}")
        ctx = multiprocessing.get_context(context)
        forked = ctx.get_start_method() == "fork"
        self.n = n
        self._results: list = [None] * n
        self._done = [False] * n
        self._error: BaseException | None = None
        self._joined = False
        secret = random_secret()
        self._ep = Endpoint(secret, "map", bind=["ipc"], info={"name": "map"}, accept=self._accept)
        self._links: dict[int, Link] = {}
        self._procs = []
        try:
            for i in range(n):
                p = ctx.Process(
                    target=_worker,
                    args=(self._ep.addresses[0], secret.text, fn, args, i, forked, os.getpid()),
                    name=f"ipc.map worker {i}",
                    daemon=False,  # a worker may start processes of its own
                )
                p.start()
                self._procs.append(p)
        except BaseException:
            self._stop()
            raise
        self._abort = False
        self._settled = threading.Event()  # a worker failed, or all have ended
        self._link_ended: dict[int, float] = {}  # worker -> when its link was seen ended
        self._thread = threading.Thread(target=self._watch, name="ipc.map", daemon=True)
        self._thread.start()
        _watch_exit(self)

    def _accept(self, link: Link) -> str | None:
        i = link.info.get("i")
        if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < self.n:
            return f"no map worker {i!r}"
        if i in self._links:
            return f"map worker {i} is linked already"
        link.tag = i
        link.name = f"map worker {i}"
        self._links[i] = link
        return None

    def _take(self) -> None:
        ep = self._ep
        ep.events.clear()
        while ep.inbox:
            link, frames = ep.inbox.popleft()
            i = link.tag
            try:
                body = wire.unpack_value(frames)
                if not isinstance(body, dict) or body.get("i") != i or self._done[i]:
                    raise wire.WireError("not a result of this worker")
            except wire.WireError as err:
                self._fail(IPCError(f"ipc.map: a malformed result from map worker {i}: {err}"))
                return
            self._done[i] = True
            if body.get("ok") is True:
                self._results[i] = body.get("value")
            else:
                self._fail(_rebuild(i, body))
                return

    def _fail(self, exc: BaseException) -> None:
        if self._error is None:
            self._error = exc
        self._settled.set()

    def _watch(self) -> None:
        """The map's thread: answers the workers' links (handshakes, results, goodbyes)
        while the caller does other work, until every worker has ended or `join()`
        stops it. Also after a failure: the workers still starting would otherwise wait
        for a handshake no one answers until `join()` stops them, neither stopped nor
        running (the others go on meanwhile: a WorkQueue's items are still done)."""
        while not self._abort:
            # Seen ended before the look below, so a worker that died just after the
            # previous look is still named (leaving as soon as all had ended would
            # return its result as None).
            ended = all(p.exitcode is not None for p in self._procs)
            self._ep.poll(0 if ended else 0.05)
            self._take()
            for i, link in list(self._links.items()):
                if self._done[i] or link.dead is None or self._procs[i].exitcode is not None:
                    continue
                # Alive but silent past the heartbeats' timeout: frozen (SIGSTOP, a
                # debugger) or cut off; waiting for its exit would wait for ever. (A
                # second's grace: a killed worker's link ends before its exit is seen.)
                seen = self._link_ended.setdefault(i, time.monotonic())
                if time.monotonic() - seen > 1.0:
                    pid = self._procs[i].pid
                    self._fail(
                        PeerError(
                            f"ipc.map: worker {i} (pid {pid}) is alive but its link ended "
                            f"({link.dead}): frozen past the heartbeats' timeout, or cut off",
                            i,
                        )
                    )
            for i, p in enumerate(self._procs):
                if self._done[i] or p.exitcode is None:
                    continue
                self._ep.poll(0)  # what it sent before it ended is ours
                self._take()
                if not self._done[i]:
                    how = _how_it_ended(p.exitcode)
                    self._fail(PeerError(f"ipc.map: worker {i} (pid {p.pid}) {how}", i))
                    self._done[i] = True  # said once
            if ended:
                self._settled.set()
                return

    def join(self, timeout: float | None = None) -> list:
        """The n results in index order, once every worker is done.

        Args:
            timeout: Seconds to wait; None: without end.

        Returns:
            `[fn(*args, 0), ..., fn(*args, n - 1)]`.

        Raises:
            Exception: A worker's exception (built-in types as themselves, others as
                `WorkerError`), with its traceback as `__cause__`; the others are
                stopped.
            PeerError: A worker was killed by a signal.
            IPCTimeoutError: Not every worker was done within `timeout`.
            IPCError: `join()` was called already.
        """
        if self._joined:
            raise IPCError("ipc.map: join() was called already")
        self._joined = True
        try:
            if not self._settled.wait(timeout):
                late = [i for i in range(self.n) if not self._done[i]]
                self._fail(IPCTimeoutError(f"ipc.map: workers {late} not done in {timeout} s"))
            self._abort = True
            self._thread.join()
        finally:
            self._stop()
        if self._error is not None:
            raise self._error
        return list(self._results)

    def _stop(self) -> None:
        """Acknowledge the workers that finished, stop the others, release everything."""
        _LIVE.pop(self, None)
        for p in self._procs:
            if p.is_alive() and not self._done[self._procs.index(p)]:
                p.terminate()
        end = time.monotonic() + 5
        for p in self._procs:
            while p.is_alive() and time.monotonic() < end:
                self._ep.poll(0.01)  # finished workers wait for our acknowledgement
                self._ep.inbox.clear()
                p.join(0)
            if p.is_alive():
                p.kill()
            p.join()
        self._ep.close(linger=0)


# Maps not joined yet, with the process that started them; stopped at interpreter exit
# (see the module docstring). A forked child inherits both this set and the hook.
_LIVE: weakref.WeakKeyDictionary[Map, int] = weakref.WeakKeyDictionary()
_exit_hook = False


def _watch_exit(m: Map) -> None:
    global _exit_hook
    _LIVE[m] = os.getpid()
    if not _exit_hook:
        # Registered after the first Process.start(), so after multiprocessing's own exit
        # function: atexit runs ours first, before that one waits for the workers.
        atexit.register(_stop_at_exit)
        _exit_hook = True


def _stop_at_exit() -> None:
    for m in [m for m, pid in list(_LIVE.items()) if pid == os.getpid()]:
        running = [i for i, p in enumerate(m._procs) if p.is_alive() and not m._done[i]]
        if running:
            log.warning("ipc.map: exiting before join(): stopping workers %s", running)
        m._abort = True
        m._thread.join(1.0)
        m._stop()


@checked
def map(n: int, fn: Callable, *args, context: str = "fork") -> Map:
    """Start fn(*args, i) for i in range(n) in n processes; `.join()` gathers the results.

    Args:
        n: How many processes.
        fn: The function.
        *args (Any): Its leading arguments; the worker's index comes last.
        context: `"fork"` or `"spawn"`.

    Returns:
        The running `Map`.
    """
    return Map(n, fn, args, context=context)
