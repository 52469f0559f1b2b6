"""Work queues and channels between processes: torch-ipc's `ipc.workqueue` and `ipc.channel`.

    q = ipc.WorkQueue("jobs")       # the first process to open "jobs" owns it
    q.write(item); result = q.read()   # owner -> workers; workers -> owner
    ch = ipc.Channel()               # any number of writers and readers; pass it to map workers
    status = ch.write(x); status, x = ch.read(block=True); ch.close()

Both are queues held by a *broker*: a thread of the owning process (the
WorkQueue's owner, the Channel's creator) that owns one link-layer Endpoint
listening on a Unix socket of the private runtime directory, with a fresh
random secret. Other processes dial it: a WorkQueue's workers find the
address and secret in a private file named after the queue; a Channel carries
them when it is pickled (to a spawned process) or forked. The owning process
itself reads and writes the queues directly, under a lock.

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
(at least once, as task queues that acknowledge late do). Nothing received is
unpickled.

Closing: a closed queue takes no more writes; its remaining items can still
be read; once it is empty, and no item is out with a reader that may still
die, it is *drained* and every read says so at once (`WorkQueue.read` returns
None, `Channel.read` returns DRAINED); until then a read waits, to take such an
item if it comes back. One that comes back when no worker is left makes the
owner's `close()` raise IPCError, naming how many. A worker that
opens a WorkQueue whose owner closed it, and still runs, is told the same:
it came late (a map worker that started after the others had done the work),
and must not take the name and wait for workers of its own.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import multiprocessing.util
import os
import re
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass, field

import zmq

from ..errors import IPCError, IPCTimeoutError, PeerError
from ..keywords import checked
from ..procs import pid_alive, start_ticks
from ..transport import Endpoint, Kind, Link, Secret, fdlimit, random_secret, runtime, wire
from . import bulk

log = logging.getLogger(__name__)

OPEN = "open"
CLOSED = "closed"
DRAINED = "drained"
EMPTY = "empty"  # a non-blocking read that finds nothing now

_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


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
            ep.close(linger=1.0)

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
        """`link`'s reader has its last item for good: no longer out."""
        entry = self.inflight.pop(link, None)
        if entry is not None and entry[0].closed:
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


class _Remote:
    """Another process's side of a broker: one link, one request at a time."""

    def __init__(self, address: str, secret_text: str, label: str):
        self.label = label
        self.bulk = bulk.Bulk()
        self.endpoint = Endpoint(
            Secret(secret_text, label),
            f"{label} user {os.getpid()}",
            info={"pid": os.getpid(), **self.bulk.info()},
        )
        self.pid = os.getpid()
        self.closed = False
        self.asked: str | None = None  # the queue of a read still unanswered
        self.held: tuple[list, bulk._Memory | None] | None = None  # the last item read
        self.closed_seen: dict[str, str] = {}  # queue -> CLOSED/DRAINED, once a read said so
        try:
            self.link = self.endpoint.dial(address, reconnect=False)
            self.endpoint.wait_up([self.link], time.monotonic() + 30, label)
            self.bulk.up(self.link)
        except BaseException:
            self.endpoint.close(linger=0)
            raise
        _REMOTES.add(self)
        _flush_at_exit()

    def put(self, name: str, obj: object) -> str:
        """Send a write without waiting for it (OPEN: the broker's answer is not awaited),
        or drop it and say so where this process has seen the queue closed already."""
        if name in self.closed_seen:
            return self.closed_seen[name]
        if self.asked is None and self.link not in self.bulk.readers:
            self._see_bulk_ok()
        frames = self.bulk.pack(obj, self.link)
        try:
            # Copied: the caller may change its tensors once write returns.
            self.link.send_frames([_ctl({"op": "put", "q": name}), *frames], copy=True)
        except BaseException:
            self.bulk.drop(frames, self.bulk.arena)
            raise
        return OPEN

    def _see_bulk_ok(self) -> None:
        """Take the broker's BULK_OK ("I mapped your arena") if it has come. It arrives as
        a message, which only a read would otherwise take: a process that only writes
        would send every large item over the link. With no read asked, nothing else is
        on the way (the broker answers reads only)."""
        ep = self.endpoint
        ep.poll(0)
        while ep.inbox and self.bulk.control(*ep.inbox[0]):
            ep.inbox.popleft()

    def close_queue(self, name: str) -> None:
        self.link.send_frames([_ctl({"op": "close", "q": name})])

    def get(self, name: str, block: bool, timeout: float | None = None) -> tuple[str, object]:
        ep, link = self.endpoint, self.link
        if self.asked is None:
            link.send_frames([_ctl({"op": "get", "q": name, "block": block})])
            self.asked = name
            self._release_held()  # asked again: the broker no longer keeps the last one
        elif self.asked != name:
            raise IPCError(f"ipc {self.label}: a read of {self.asked!r} timed out; read it again")
        # else: the answer to a read that timed out is still to come; it is this read's
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            # In slices of a second: a dead owner is noticed within one, not at the deadline.
            step = time.monotonic() + 1.0
            item = ep.recv(step if deadline is None else min(step, deadline))
            if item is not None and self.bulk.control(*item):
                continue
            if item is not None:
                self.asked = None
                _, frames = item
                try:
                    body = wire.parse_control(frames[0].bytes, {"op": str, "state": str})
                except wire.WireError as err:
                    raise IPCError(f"ipc {self.label}: a malformed reply: {err}") from None
                if body["state"] in (CLOSED, DRAINED):
                    self.closed_seen[name] = body["state"]
                if body["op"] == "item":
                    # Its shared memory stays taken until we ask again: if we die before
                    # that, the broker gives the item to another reader, bytes intact.
                    self.held = (frames[1:], self.bulk.memory_of(link))
                    return body["state"], _decode(self.bulk, self.held, self.label, release=False)
                return body["state"], None
            if link.dead is not None or link.bye is not None:
                # (Why, in the link layer's words: also when this process was the one
                # frozen past the heartbeats.)
                raise PeerError(
                    f"ipc {self.label}: its owner (the process that made it) is gone: "
                    f"{ep.dead_error(link)}"
                )
            if deadline is not None and time.monotonic() >= deadline:
                # The request stays queued at the broker; the next read takes its answer.
                raise IPCTimeoutError(f"ipc {self.label}: no item within {timeout} s")

    def close(self) -> None:
        """Say goodbye: returns once the broker has read every write (or is gone)."""
        if self.closed or self.pid != os.getpid():
            return
        self.closed = True
        _REMOTES.discard(self)
        self._release_held()
        # A read still unanswered: an item the broker sent for it is not ours, give it back.
        self.endpoint.close({"unread": True} if self.asked else None, linger=5.0)

    def _release_held(self) -> None:
        if self.held is not None:
            self.bulk.drop(*self.held)
            self.held = None


# Writes from another process are sent without waiting: closing its links flushes them, at
# the latest when the process ends (multiprocessing's children skip atexit, so `ipc.map`
# workers call close_remotes themselves).
_REMOTES: weakref.WeakSet[_Remote] = weakref.WeakSet()


def close_remotes() -> None:
    """Close this process's links to brokers of other processes (flushing its writes)."""
    for remote in list(_REMOTES):
        remote.close()


atexit.register(close_remotes)
_flushing_in: list[int] = []  # the process that registered the hook below


def _flush_at_exit() -> None:
    """A multiprocessing child ends with os._exit, skipping atexit: its writes would be
    lost. Its own exit hook (the finalizers it runs after the target returns) flushes
    them instead; registered in the process that writes (a fork's copy is cleared)."""
    if _flushing_in != [os.getpid()]:
        _flushing_in[:] = [os.getpid()]
        multiprocessing.util.Finalize(None, close_remotes, exitpriority=100)


# ---- WorkQueue ----------------------------------------------------------------------------


class WorkQueue:
    """A named work queue on this host. The first process to open `name` owns it: its
    writes go to the workers (each item to exactly one), and it reads what they write.
    Every other process that opens `name` is a worker: it reads the owner's items and
    writes results back. `read()` returns None once the queue is closed and drained.
    `maxsize` (the owner's; 0: no bound) bounds the items waiting for a worker: the
    owner's `write` then waits for room, so a fast producer cannot outgrow memory."""

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
            # Dropped without close() (a function that returns): its writes still go.
            weakref.finalize(self, self._remote.close)
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
        """Owner: one item for one worker; with `maxsize`, waits while that many items
        wait for a worker (IPCTimeoutError after `timeout` s). Worker: one result for the
        owner, sent without waiting."""
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
        """Owner: the next result. Worker: the next item, or None once the owner closed the
        queue and every item was handed out. Blocks until then."""
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
        leave the queue."""
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


# ---- Channel ------------------------------------------------------------------------------


class Channel:
    """A FIFO that any process can write to and read from, torch-ipc's `ipc.channel`.

    The creating process holds the items (keep the Channel alive there until the others
    are done); pass the Channel to other processes as an argument (`ipc.map`, or any
    multiprocessing start method: it pickles as its address and secret)."""

    OPEN = OPEN
    CLOSED = CLOSED
    DRAINED = DRAINED
    EMPTY = EMPTY

    def __init__(self):
        self._broker: _Broker | None = _Broker(("c",), "channel")
        self._creator = os.getpid()
        self._address = self._broker.address
        self._secret = self._broker.secret.text
        self._remote: _Remote | None = None
        self._finalizer = weakref.finalize(self, self._broker.stop)

    def __getstate__(self) -> dict:
        # Sent to processes of this user on this host only (pickled by multiprocessing).
        return {"address": self._address, "secret": self._secret, "creator": self._creator}

    def __setstate__(self, state: dict) -> None:
        self._broker = None
        self._creator = state["creator"]
        self._address = state["address"]
        self._secret = state["secret"]
        self._remote = None

    def _side(self) -> _Broker | _Remote:
        if os.getpid() == self._creator and self._broker is not None:
            return self._broker
        if self._remote is None or self._remote.pid != os.getpid():
            self._remote = _Remote(self._address, self._secret, "channel")
            # Dropped without the process ending (a worker's copy): its writes still go.
            weakref.finalize(self, self._remote.close)
        return self._remote

    def write(self, obj: object) -> str:
        """Append `obj`; returns OPEN, or CLOSED/DRAINED (and drops it) if the channel is
        closed. From another process the write is sent without waiting: a write racing a
        close may be dropped, and once a read there has seen the close, writes say so."""
        return self._side().put("c", obj)

    def read(self, block: bool = True, timeout: float | None = None) -> tuple[str, object]:
        """(status, item): (OPEN or CLOSED, item), (DRAINED, None) once closed and empty,
        or (EMPTY, None) for a non-blocking read that finds nothing now (an open, empty
        channel, or a closed one whose last items are still out with readers)."""
        return self._side().get("c", bool(block), timeout)

    def close(self) -> None:
        """No more writes; readers get the remaining items, then DRAINED."""
        self._side().close_queue("c")
