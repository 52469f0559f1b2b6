"""The broker that holds the queues of a WorkQueue or a Channel, served to other processes.

The queues of a WorkQueue or a Channel are held by a *broker*: a thread of the owning process (the
WorkQueue's owner, the Channel's creator) that owns one link-layer Endpoint
listening on a Unix socket of the private runtime directory, with a fresh
random secret. Other processes dial it: a WorkQueue's workers find the
address and secret in a private file named after the queue; a Channel carries
them when it is pickled (to a spawned process) or forked. The owning process
itself reads and writes the queues directly, under a lock; other processes go through
a `_Remote` (remote.py).

Each item is one link message (an :mod:`ipc.transport.wire` value: tensors, nested
containers, scalars, bytes): the broker keeps the frames it received and
forwards them as they are, so it never decodes an item or copies its tensors.
Large tensors lie in shared memory (:mod:`ipc.services.bulk`): an item the owner writes
in the owner's arena, one a worker writes in the worker's; a reader that does
not map that arena gets the bytes copied onto the link instead.
A read from another process asks the broker for one item and waits for it,
so an item goes to exactly one reader, and none is held by a reader that did
not ask. The broker keeps the item it sent a reader until that reader asks
for the next one or leaves: if it dies first (SIGKILL, a crash), the item
goes to the next reader. So no item is lost with a reader, and one whose
reader died after working on it but before asking again is worked on twice
(at least once, as task queues that acknowledge late do). An item sent by
reference to the broker's arena keeps its block until then too, and the
broker releases it, not the reader: a reader that let go of it before its next
request had left (killed in between) took the item's bytes with it. A write
from another process is confirmed to its writer when the broker answers a
later read or acknowledges its goodbye (remote.py). Nothing received is
unpickled.

Closing: a closed queue takes no more writes; its remaining items can still
be read; once it is empty, and no item is out with a reader that may still
die, it is *drained* and every read says so at once (`WorkQueue.read` returns
None, `Channel.read` returns DRAINED); until then a read waits, to take such an
item if it comes back. One that comes back when no worker is left makes the
owner's `close()` raise IPCError, naming how many. A worker that
opens a WorkQueue whose owner closed it, and still runs, is told the same:
it came late (a map worker that started after the others had done the work),
and must not take the name and wait for workers of its own. So is one whose
read meets the broker's goodbye, which names the queues that were drained.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import zmq

from ..errors import IPCError, IPCTimeoutError, PeerError
from ..transport import Endpoint, Kind, Link, fdlimit, random_secret, wire
from . import bulk

__all__ = ["CLOSED", "DRAINED", "EMPTY", "OPEN"]

log = logging.getLogger(__name__)


OPEN = "open"
CLOSED = "closed"
DRAINED = "drained"
EMPTY = "empty"  # a non-blocking read that finds nothing now


def _ctl(body: dict) -> bytes:
    return wire.control(Kind.MESSAGE, body)


def _decode(shared: bulk.Bulk, item: tuple | None, label: str, release: bool = True) -> object:
    """The value of a stored or received item (frames, the memory its large payloads
    lie in); None for no item."""
    if item is None:
        return None
    try:
        return shared.unpack(*item, release=release)
    except wire.WireError as err:
        raise IPCError(f"ipc {label}: a malformed item: {err}") from None


@dataclass
class _Queue:
    # each: (the frames of one value, the arena its large payloads lie in or None)
    items: deque = field(default_factory=deque)
    maxsize: int = 0  # local writes wait while it holds this many (0: no bound)
    closed: bool = False
    waiting: deque = field(default_factory=deque)  # remote blocked readers: Link
    # What other processes may ask of it (a work queue's workers only read the owner's
    # items and write results: a worker that closed or read the results lost them).
    remote: frozenset = frozenset({"put", "get", "close"})
    reserved: int = 0  # local writes past the maxsize check, storing their item

    def state(self) -> str:
        return (DRAINED if not self.items else CLOSED) if self.closed else OPEN


class _Broker:
    """Named queues in this process, served to other processes by one thread.

    Requests from a link (a control frame, then for `put` the value's frames):
    {"op": "put", "q": name} -> no reply; {"op": "get", "q": name, "block": b}
    -> {"op": "item", "state": s} + frames, or {"op": "none", "state": s};
    {"op": "close", "q": name}. Local calls take the lock and go straight to the
    queues; the thread is woken through a pipe when a local write can serve a
    remote reader. The queues in `kept` are read in this process: their items stay
    readable once the thread has stopped."""

    def __init__(self, names: tuple[str, ...], label: str, kept: tuple[str, ...] = ()):
        self.secret = random_secret()
        self.queues = {n: _Queue() for n in names}
        self.kept = kept
        self.lock = threading.Condition()
        self.label = label
        self.bulk = bulk.Bulk()  # large items through shared memory, see ipc.services.bulk
        fdlimit.raise_limit()  # each other process takes files; see ipc.transport.fdlimit
        self.endpoint = Endpoint(
            self.secret,
            label,
            bind=["ipc"],
            info={"name": label, "pid": os.getpid(), **self.bulk.info()},
            accept=self._accept,
        )
        self.address = self.endpoint.addresses[0]
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._wake_lock = threading.Lock()  # the pipe is closed by the thread as it ends
        self.endpoint.watch(self._wake_r)
        self._stop = False
        self._pid = os.getpid()
        self.links: set[Link] = set()
        # link -> (queue, frames, memory) of the item it was sent last: it comes back to
        # the queue if that reader dies before it asks for the next one (or leaves)
        self.inflight: dict[Link, tuple[_Queue, list, bulk._Memory | None]] = {}
        self.polling: set[Link] = set()  # links whose waiting read is a non-blocking one
        self._thread = threading.Thread(target=self._run, name=f"ipc {label}", daemon=True)
        self._thread.start()

    def _accept(self, link: Link) -> str | None:
        # Out of files, libzmq would abort this process (the owner, and its queues with
        # it): a process past the budget is refused with the reason instead.
        why = fdlimit.full_reason(f"the process that made {self.label}")
        if why is None:
            self.links.add(link)
        return why

    # ---- local side (any thread of this process) -----------------------------------

    def put(self, name: str, obj: object, timeout: float | None = None) -> str:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.lock:
            q = self.queues[name]
            # A writer's slot is reserved before it lets go of the lock to store its
            # item: writers in other threads count it (without, each got past a full
            # queue: maxsize + writers - 1 items).
            while q.maxsize and len(q.items) + q.reserved >= q.maxsize and not q.closed:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise IPCTimeoutError(
                        f"ipc {self.label}: still {q.maxsize} items waiting after {timeout} s"
                    )
                self.lock.wait(remaining)
            if q.closed:
                return q.state()
            q.reserved += 1
        try:
            # Large tensors are copied into our arena, the rest into bytes: the caller
            # may change its tensors once write returns.
            item = self.bulk.store(obj)
        except BaseException:
            with self.lock:
                q.reserved -= 1
                self.lock.notify_all()
            raise
        with self.lock:
            q.reserved -= 1
            if q.closed:
                self.bulk.drop(*item)
                return q.state()
            q.items.append(item)
            self.lock.notify()
            wake = bool(q.waiting)
        if wake:
            self.wake()
        return OPEN

    def get(self, name: str, block: bool, timeout: float | None = None) -> tuple[str, object]:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.lock:
            q = self.queues[name]
            # Closed and empty is not drained while an item is out with a reader: it comes
            # back if that reader dies, and must find a reader then.
            while block and not q.items and (not q.closed or self._out(q)):
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise IPCTimeoutError(f"ipc {self.label}: no item within {timeout} s")
                self.lock.wait(remaining)
            if not q.items:
                drained = q.closed and not self._out(q)
                return (DRAINED if drained else EMPTY), None
            item = q.items.popleft()
            state = CLOSED if q.closed else OPEN
        return state, _decode(self.bulk, item, self.label)

    def close_queue(self, name: str) -> None:
        with self.lock:
            self.queues[name].closed = True
            self.lock.notify_all()
        self.wake()

    def wake(self) -> None:
        with self._wake_lock:
            if self._wake_w is not None:
                with contextlib.suppress(BlockingIOError):  # (full: a wake-up is pending)
                    os.write(self._wake_w, b"x")

    def stop(self) -> None:
        """End the thread and close the endpoint (peers see the link end)."""
        if self._stop or os.getpid() != self._pid:
            return  # a forked child's copy: the thread and the endpoint are the parent's
        self._stop = True
        self.wake()  # (not left to the thread's next poll: a second away)
        if threading.current_thread() is not self._thread:
            self._thread.join()

    # ---- the thread --------------------------------------------------------------------

    def _run(self) -> None:
        ep = self.endpoint
        try:
            while not self._stop:
                events = ep.wait(1.0)
                with contextlib.suppress(BlockingIOError):
                    os.read(self._wake_r, 4096)
                # Under the lock: a write is acknowledged (its sender's close() returns)
                # only once it is queued, so a local close() that follows cannot drop it.
                with self.lock:
                    ep.process(events)
                    ended = []
                    while ep.events:
                        kind, link = ep.events.popleft()
                        if kind == "accepted":
                            self.bulk.up(link)
                        else:
                            ended.append((kind, link))
                    # A link's last requests before its end, before the end: a write that
                    # came in with its writer's BYE (or death) keeps the arena it lies in.
                    while ep.inbox:
                        link, frames = ep.inbox.popleft()
                        if not self.bulk.control(link, frames):
                            self._request(link, frames)
                    for kind, link in ended:
                        self._ended(kind, link)
                    self._serve()
        finally:
            with self.lock:
                # Said in our goodbye: a reader whose request meets it (one that connected
                # as the owner's close() ended) learns the queue was drained, not "gone".
                drained = [
                    name for name, q in self.queues.items()
                    if q.closed and not q.items and not self._out(q)
                ]  # fmt: skip
                for name, q in self.queues.items():
                    # Items no other process will read now: their blocks are free again.
                    # Results the owner has still to read stay (its close() may end
                    # while another of its threads reads them).
                    while q.items and name not in self.kept:
                        self.bulk.drop(*q.items.popleft())
            with self._wake_lock:
                os.close(self._wake_r)
                os.close(self._wake_w)
                self._wake_w = None
            ep.close(bye={"drained": drained}, linger=1.0)

    def _ended(self, kind: str, link: Link) -> None:
        if kind == "dead" or (link.bye or {}).get("unread") is True:
            self._take_back(link)
        else:
            self._done_with(link)  # it left having read its item
        if kind in ("dead", "bye"):
            self.bulk.forget(link)  # its items keep the arena they lie in
            self.endpoint.forget(link)
            self.links.discard(link)
            self.polling.discard(link)
            for q in self.queues.values():
                with contextlib.suppress(ValueError):
                    q.waiting.remove(link)

    def _request(self, link: Link, frames: list) -> None:
        try:
            body = wire.parse_control(frames[0].bytes, {"op": str, "q": str})
            q = self.queues.get(body["q"])
            if q is None:
                raise wire.WireError(f"no queue {body['q'][:40]!r}")
        except wire.WireError as err:
            self.endpoint._drop(f"a bad request from {link.name}: {err}")
            return
        op = body["op"]
        if op in ("put", "get", "close") and op not in q.remote:
            self.endpoint._drop(f"a {op} of {body['q']!r} from {link.name}: not a worker's")
            return
        if op == "get" and any(link in other.waiting for other in self.queues.values()):
            # One read at a time: a second would be answered over the first's item,
            # which then could not come back if this reader died.
            self.endpoint._drop(f"a second read from {link.name} before its first's answer")
            return
        if op == "get":
            self._done_with(link)  # it asks again: it has the last one
        if op == "put":
            if len(frames) < 2:
                self.endpoint._drop(f"an empty put from {link.name}")
            elif not q.closed:  # a write racing a close is refused like a local one
                q.items.append((frames[1:], self.bulk.memory_of(link)))
                self.lock.notify()
            else:
                self.bulk.drop(frames[1:], self.bulk.memory_of(link))
        elif op == "get":
            if q.items or q.closed or body.get("block") is True:
                q.waiting.append(link)
                if body.get("block") is not True:
                    self.polling.add(link)
            else:
                self._reply(link, {"op": "none", "state": EMPTY})
        elif op == "close":
            q.closed = True
            self.lock.notify_all()
        else:
            self.endpoint._drop(f"an unknown request {op[:20]!r} from {link.name}")

    def _serve(self) -> None:
        for q in self.queues.values():
            if q.maxsize and q.waiting and q.items:
                self.lock.notify_all()  # room for a writer waiting in put
            held = []  # blocking reads that wait for an item out
            while q.waiting and (q.items or q.closed):
                link = q.waiting.popleft()
                if q.items:
                    frames, memory = q.items.popleft()
                    try:
                        # As stored, or copied out of an arena this reader does not map.
                        out = self.bulk.for_link(frames, memory, link)
                    except wire.WireError as err:
                        log.warning("ipc %s: dropped a malformed item: %s", self.label, err)
                        q.waiting.appendleft(link)
                        continue
                    state = CLOSED if q.closed else OPEN  # never DRAINED with an item
                    kept = (out, memory if out is frames else None)
                    self.polling.discard(link)
                    if self._reply(link, {"op": "item", "state": state}, out):
                        self.inflight[link] = (q, *kept)
                    else:
                        q.items.appendleft(kept)  # it died before it got it: the next one
                elif self._out(q):
                    # Not drained while an item is out with a reader (see get): a blocking
                    # read waits for it to come back, or for its reader to ask again; a
                    # non-blocking one finds nothing now.
                    if link in self.polling:
                        self.polling.discard(link)
                        self._reply(link, {"op": "none", "state": EMPTY})
                    else:
                        held.append(link)
                else:
                    self.polling.discard(link)
                    self._reply(link, {"op": "none", "state": q.state()})
            q.waiting.extendleft(reversed(held))

    def _done_with(self, link: Link) -> None:
        """`link`'s reader has its last item for good: no longer out, and its block (if it
        went by reference to our arena) is free again."""
        entry = self.inflight.pop(link, None)
        if entry is None:
            return
        q, frames, memory = entry
        self.bulk.drop(frames, memory)
        if q.closed:
            self.lock.notify_all()  # a local read may wait for the last one out (see get)

    def _out(self, q: _Queue) -> bool:
        """Whether an item of `q` is out with a reader that has not asked again yet."""
        return any(entry[0] is q for entry in self.inflight.values())

    def _take_back(self, link: Link) -> None:
        """`link`'s reader died (or left) before asking for the next item: the one it was
        sent goes to the next reader."""
        entry = self.inflight.pop(link, None)
        if entry is None:
            return
        q, frames, memory = entry
        if self.bulk.take_back(frames, memory):
            q.items.appendleft((frames, memory))
            self.lock.notify_all()
        else:
            log.warning("ipc %s: an item went with %s (its memory was released)", self.label, link)

    def _reply(self, link: Link, body: dict, frames: list = ()) -> bool:
        try:
            link.send_frames([_ctl(body), *frames])
            return True
        except (PeerError, zmq.ZMQError):
            return False
