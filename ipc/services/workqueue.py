"""`WorkQueue`: a named work queue on this host, torch-ipc's `ipc.workqueue`.

    q = ipc.WorkQueue("jobs")       # the first process to open "jobs" owns it
    q.write(item); result = q.read()   # owner -> workers; workers -> owner

The owner holds the queues in a broker (broker.py, which says what is guaranteed:
each item to one reader, at least once; closing and draining) and names its address
and secret in a private file of the runtime directory named after the queue; a
worker finds them there and goes through a `_Remote` (remote.py).
"""

from __future__ import annotations

import atexit
import json
import os
import re
import time
import weakref

from distlearn.common.keywords import checked

from ..errors import IPCError, IPCTimeoutError
from ..procs import pid_alive, start_ticks
from ..transport import runtime
from .broker import OPEN, _Broker
from .remote import _Remote, close_dropped

__all__ = ["WorkQueue"]

_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


class WorkQueue:
    """A named work queue on this host. The first process to open `name` owns it: its
    writes go to the workers (each item to exactly one), and it reads what they write.
    Every other process that opens `name` is a worker: it reads the owner's items and
    writes results back. `read()` returns None once the queue is closed and drained.
    `maxsize` (the owner's; 0: no bound) bounds the items waiting for a worker: the
    owner's `write` then waits for room, so a fast producer cannot outgrow memory.

    Args:
        name: The queue's name on this host (letters, digits, `._-`).
        maxsize: The owner's bound on items waiting for a worker; 0: none.

    Attributes:
        owner: Whether this process owns the queue.

    Raises:
        ValueError: A bad name or `maxsize`.
        TypeError: A misspelt option, naming the closest.
    """

    @checked
    def __init__(self, name: str, maxsize: int = 0):
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ValueError(f"WorkQueue: name must match {_NAME.pattern}, not {name!r}")
        if not isinstance(maxsize, int) or isinstance(maxsize, bool) or maxsize < 0:
            raise ValueError(f"WorkQueue: maxsize must be an int >= 0, not {maxsize!r}")
        self.name = name
        self._file = f"workqueue-{name}.json"
        self._broker: _Broker | None = None
        self._remote: _Remote | None = None
        self._closed = False
        self._late = False  # a worker that came after its owner had closed the queue
        self._opened_in = os.getpid()
        directory = runtime.runtime_dir()
        for _ in range(3):
            info = self._read_owner(directory)
            if info is not None:
                self.owner = False
                self._join(directory, info)
                return
            broker = _Broker(("down", "up"), f"work queue {name!r}", kept=("up",))
            broker.queues["down"].maxsize = maxsize
            broker.queues["down"].remote = frozenset({"get"})
            broker.queues["up"].remote = frozenset({"put"})
            record = {
                "address": broker.address,
                "secret": broker.secret.text,
                "pid": os.getpid(),
                "start": start_ticks(),
            }
            try:
                runtime.create_private(directory, self._file, json.dumps(record).encode())
            except FileExistsError:
                broker.stop()  # another process won the name meanwhile
                continue
            self._broker = broker
            self.owner = True
            self._pid = os.getpid()
            return
        raise IPCError(f"ipc: could not open the work queue {name!r} (its owner keeps changing)")

    def _join(self, directory, info: dict) -> None:
        """Become a worker of the queue `info` describes, or a late one if it is closed.

        Its owner closed it and lives on: a worker that comes now (a map worker started
        after the others had done all the work) finds no item, and read() says so at once.
        Taking the name instead, it would wait forever for workers of its own."""
        label = f"work queue {self.name!r}"
        if info.get("closed") is True:
            self._late = True
            return
        try:
            self._remote = _Remote(info["address"], info["secret"], label)
            # Dropped without close() (a function that returns): its writes still go, and
            # if they cannot, close_remotes says so (see remote.close_dropped).
            weakref.finalize(self, close_dropped, self._remote)
        except IPCError:
            again = self._read_owner(directory)
            if again is None or again.get("closed") is not True:
                raise
            self._late = True  # closed, and its broker gone, between our look and our dial

    def _read_owner(self, directory) -> dict | None:
        raw = runtime.read_private(directory, self._file)
        if raw is None:
            # Missing, or not a private file of ours (refused and logged): in our verified
            # directory that is a leftover, never a queue to join.
            runtime.remove(directory, self._file)
            return None
        try:
            info = json.loads(raw)
            # Its pid alive and started when the owner did: pids are reused, and a dead
            # owner's name would stay taken for as long as a stranger held its pid.
            ok = isinstance(info, dict) and pid_alive(info.get("pid"))
            if ok and isinstance(info.get("start"), int):
                ok = start_ticks(info["pid"]) == info["start"]
            if ok and info.get("closed") is True:
                ok = info["pid"] != os.getpid()  # our own queue, closed: ours to open anew
            elif ok:
                ok = isinstance(info.get("address"), str) and isinstance(info.get("secret"), str)
        except ValueError:
            ok = False
        if not ok:  # left by an owner that died (or closed by us): the name is free again
            runtime.remove(directory, self._file)
            return None
        return info

    def __repr__(self) -> str:
        return f"WorkQueue({self.name!r}, {'owner' if self.owner else 'worker'})"

    def _check(self) -> None:
        self._check_process()
        if self._closed:
            raise IPCError(f"ipc: the work queue {self.name!r} is closed here")

    def _check_process(self) -> None:
        if os.getpid() != self._opened_in:
            # A forked copy: its broker thread or link did not come along.
            raise IPCError(
                f"ipc: a forked child cannot use its parent's work queue {self.name!r}: "
                f"open it in the child (ipc.WorkQueue({self.name!r}) makes it a worker)"
            )

    def write(self, obj: object, timeout: float | None = None) -> None:
        """Owner: one item for one worker. Worker: one result for the owner.

        Args:
            obj: The item: a tensor, or a nested list/tuple/dict of tensors, str, int,
                float, bool and bytes (not None).
            timeout: The owner's wait for room under `maxsize`; a worker's result is
                sent without waiting.

        Raises:
            TypeError: `obj` is None (what a worker's `read()` returns at the end).
            IPCTimeoutError: No room within `timeout`.
            IPCError: The queue is closed.
        """
        self._check()
        if self._broker is not None:
            if obj is None:
                # A worker's read() says "closed and drained" with None: as an item it
                # would stop the worker that took it, and the items after it would wait.
                raise TypeError(
                    f"ipc: work queue {self.name!r}: None cannot be an item (a worker's "
                    "read() returns None once the queue is closed); send another value"
                )
            if self._broker.put("down", obj, timeout) != OPEN:
                raise IPCError(f"ipc: the work queue {self.name!r} is closed")
        elif self._late:
            raise IPCError(f"ipc: the work queue {self.name!r} was closed by its owner")
        else:
            self._remote.put("up", obj)

    def read(self, timeout: float | None = None) -> object:
        """Owner: the next result. Worker: the next item. Blocks until there is one.

        Args:
            timeout: Seconds to wait; None: without end.

        Returns:
            The value; for a worker, None once the owner closed the queue and every
            item was handed out.

        Raises:
            IPCTimeoutError: Nothing came within `timeout`.
        """
        if self._broker is not None:
            self._check_process()  # (results stay readable after close)
            return self._broker.get("up", True, timeout)[1]
        self._check()
        if self._late:
            return None
        return self._remote.get("down", True, timeout)[1]

    def close(self, timeout: float | None = None) -> None:
        """Owner: no more items; waits until every item was handed out and every worker
        has left (or `timeout`); IPCError if items came back from workers that died with
        no worker left to take them. Results still queued stay readable (read() returns
        None after the last). The name stays marked closed while this process lives (a worker
        that opens it later reads None at once); this process may open it anew. Worker:
        leave the queue.

        Args:
            timeout: The owner's wait for the items to be handed out and the workers
                to leave.

        Raises:
            IPCError: Items came back from workers that died, with no worker left to
                take them.
        """
        if self._closed:
            return
        self._check_process()
        self._closed = True
        if self._remote is not None:
            self._remote.close()
        if not self.owner:
            return
        broker = self._broker
        broker.close_queue("down")
        deadline = None if timeout is None else time.monotonic() + timeout
        marked = False
        try:
            # Items still waiting go to workers that open the queue now (map workers
            # that start after the owner's last write): the name is marked closed only
            # once every item was handed out.
            self._wait_broker(
                lambda: not broker.queues["down"].items,
                deadline,
                timeout,
                "items not yet handed out to a worker",
            )
            self._mark_closed()
            marked = True
            self._wait_broker(
                lambda: not broker.links, deadline, timeout, "workers still connected"
            )
            with broker.lock:
                left = len(broker.queues["down"].items)
            if left:
                # Out with workers that died, and back when no worker was left to take
                # them: said, not dropped without a word.
                raise IPCError(
                    f"ipc: work queue {self.name!r}: {left} item(s) came back from workers "
                    "that died, and no worker was left to take them"
                )
        finally:
            if not marked:
                self._mark_closed()
            broker.close_queue("up")  # the workers are gone: read() ends after their results
            broker.stop()

    def _mark_closed(self) -> None:
        """The name stays taken, marked closed, while this process lives: a worker that
        opens it later must learn that it came late, not become an owner nobody writes to."""
        directory = runtime.runtime_dir()
        closed = {"closed": True, "pid": os.getpid(), "start": start_ticks()}
        runtime.replace_private(directory, self._file, json.dumps(closed).encode())
        _CLOSED_NAMES.add((os.getpid(), directory, self._file))

    def _wait_broker(self, done, deadline: float | None, timeout, what: str) -> None:
        broker = self._broker
        with broker.lock:
            while not done():
                if deadline is not None and time.monotonic() > deadline:
                    raise IPCTimeoutError(
                        f"ipc: work queue {self.name!r}: {what} after {timeout} s"
                    )
                broker.lock.wait(0.05)


# The names of closed work queues this process owned: freed when it ends.
_CLOSED_NAMES: set[tuple[int, object, str]] = set()


@atexit.register
def _free_closed_names() -> None:
    for pid, directory, file in list(_CLOSED_NAMES):
        if pid == os.getpid():  # not a forked child's copy of the set
            runtime.remove(directory, file)
