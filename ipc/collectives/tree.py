"""The process tree: `Tree(rendezvous, ...)`, its collectives, and asynchronous handles.

A tree is built in three steps, one module each: a rendezvous handler
(:mod:`ipc.rendezvous`) gives the roster; every node links to its parent and
children over authenticated links (:mod:`ipc.transport.link`); the collectives run on
those links (:mod:`ipc.collectives.engine`) or, when every node is on one host, through
shared memory (:mod:`ipc.collectives.shm`).

Threads: one communication thread per tree runs asynchronous collectives
(`async_op=True`) in the order they were started and, between collectives,
answers the links (goodbyes, errors, early data, progress reports). A
synchronous call made while nothing is in flight runs in the caller's thread
instead, under the same lock, so it costs no thread hand-off; one made while
handles are in flight queues behind them. A thread that waits on a handle
runs the queued collectives up to it itself, in order, rather than sleep
while the communication thread runs them: on a host with more processes than
cores, each hand-off between the two threads (and of the interpreter's lock)
cost more than a collective of several MiB. On shared memory, large
all-reduces queued one behind another run fused, as one collective (see
`Tree._fusable` and ipc.collectives.shm.run_fused), each with its own call's results.
Collectives are issued by one thread at a time, in the same order on every
node (as with torch.distributed).

Forks: a forked child cannot use its parent's tree (every call raises), and
the tree's sockets are closed in the child, so a child that outlives its
parent does not keep the parent's links open.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import logging
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable

import torch

from ..envvars import env_float
from ..errors import IPCError
from ..keywords import check, checked, keyword_names
from ..rendezvous import Localhost, Roster, Static, check_index, is_loopback
from ..rendezvous import from_env as env_handler
from ..transport import (
    TOKEN_ENV,
    TOKEN_FILE_ENV,
    Endpoint,
    Limits,
    Link,
    Liveness,
    fdlimit,
    runtime_dir,
)
from . import hostops
from . import shm as shm_mod
from .engine import Engine
from .pack import Nested, Packed, flatten
from .shm import SHM_DIR, SharedMemoryGroup
from .topology import build_tree

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = env_float("IPC_TIMEOUT", 300.0)
DEFAULT_CHUNK = 1 << 20
DEFAULT_STALL_WARNING = env_float("IPC_STALL_WARNING", 30.0)
SERVICE_EVERY_S = 0.05  # how often the idle communication thread answers the links
# While collectives run back to back the communication thread has nothing to do; it looks
# ever less often (each wake-up takes the interpreter's lock from the caller), up to this.
SERVICE_NAP_MAX_S = 0.4
# At most this many queued all-reduces, of this many bytes together, run as one
# collective (ipc.collectives.shm.run_fused; Horovod's fusion buffer is 64 MiB too): the slots in
# /dev/shm grow to hold them, twice over.
FUSE_MAX = shm_mod.MAX_GROUPS
FUSE_BYTES = 64 << 20

Op = str | Callable[[torch.Tensor, torch.Tensor], torch.Tensor | None]
_TREES: weakref.WeakSet = weakref.WeakSet()


# The named ops: their collective's kind and in-place reducer, made once (a small
# all-reduce costs tens of microseconds, so its per-call Python counts).
_NAMED_OPS: dict[str, tuple[str, Callable[[torch.Tensor, torch.Tensor], None]]] = {
    "sum": ("all_reduce:sum", hostops.add),
    "max": ("all_reduce:max", hostops.maximum),
    "min": ("all_reduce:min", hostops.minimum),
}
# The ops whose queued all-reduces may run fused (each job's own reduce is the same).
_FUSABLE = frozenset(kind for kind, _ in _NAMED_OPS.values())


def _op(op: Op) -> tuple[str, Callable[[torch.Tensor, torch.Tensor], None]]:
    """The all-reduce's kind and its in-place `acc = op(acc, src)` on two 1-D chunks
    (torch ops release the GIL)."""
    if isinstance(op, str):
        if op in _NAMED_OPS:
            return _NAMED_OPS[op]
    elif callable(op):

        def apply(acc: torch.Tensor, src: torch.Tensor) -> None:
            out = op(acc, src)
            if out is not None and out is not acc:
                acc.copy_(out)

        return "all_reduce:callable", apply
    raise ValueError(f"all_reduce op must be 'sum', 'max', 'min' or a callable, got {op!r}")


class Handle:
    """A collective in flight. `wait()` returns what the synchronous call returns (the
    number of contributing nodes for all_reduce) or raises what it would raise.

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
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> int | None:
        """Block until the collective is done (its own timeout bounds this); `timeout`
        only bounds this wait, raising TimeoutError with the collective still running."""
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


class Tree:
    """One node of a tree of processes.

        tree = ipc.Tree(ipc.rendezvous.Localhost(node_index, num_nodes))
        tree = ipc.LocalhostTree(node_index, num_nodes)      # the same
        tree = ipc.Tree.from_env()                            # torchrun or Slurm

    Options: `base` (fan-out), `timeout` (seconds any collective may wait for a slow
    node; default 300 or $IPC_TIMEOUT), `chunk_bytes` (socket transport's chunk),
    `shm` (shared memory when every node is on one host), `encrypt` (CURVE on every
    link), `heartbeat` (ipc.Liveness: how soon a dead or frozen peer is named;
    default from $IPC_HEARTBEAT_INTERVAL/$IPC_HEARTBEAT_TIMEOUT, 1 s and 6 s),
    `stall_warning` (seconds before a waiting collective logs who it waits for).
    Every node must pass the same base, chunk_bytes, shm and encrypt."""

    @checked
    def __init__(
        self,
        rendezvous: Localhost | Static,
        *,
        base: int = 2,
        timeout: float = DEFAULT_TIMEOUT,
        chunk_bytes: int = DEFAULT_CHUNK,
        shm: bool = True,
        encrypt: bool = False,
        heartbeat: Liveness | None = None,
        stall_warning: float = DEFAULT_STALL_WARNING,
    ):
        if not isinstance(base, int) or isinstance(base, bool) or base < 1:
            raise ValueError(f"base must be an int >= 1, got {base!r}")
        if not isinstance(timeout, (int, float)) or timeout <= 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        if not isinstance(chunk_bytes, int) or not 64 <= chunk_bytes <= 1 << 28:
            raise ValueError(f"chunk_bytes must be an int in [64, 2**28], got {chunk_bytes!r}")
        if not isinstance(stall_warning, (int, float)) or stall_warning <= 0:
            raise ValueError(f"stall_warning must be a positive number, got {stall_warning!r}")
        self.node_index = rendezvous.node_index
        self.num_nodes = rendezvous.num_nodes
        self.timeout = float(timeout)
        self.chunk_bytes = chunk_bytes
        self._pid = os.getpid()
        self._closed = False
        self._lock = threading.Lock()  # the engine: one collective (or service) at a time
        self._order = threading.Lock()  # submissions: the order every node runs them in
        self._shm: SharedMemoryGroup | None = None
        self._endpoint: Endpoint | None = None
        self._engine: Engine | None = None
        self._comm: _CommThread | None = None
        self._links: dict[int, Link] = {}
        self.parent: int | None = None
        self.children: list[int] = []
        self._collectives = 0
        self._collective_time = 0.0
        self.encrypt = bool(encrypt)
        liveness = heartbeat if heartbeat is not None else Liveness.from_env()
        options = {
            "base": base,
            "chunk_bytes": chunk_bytes,
            "shm": bool(shm),
            "encrypt": self.encrypt,
        }
        # Node 0 holds a connection from every node during the rendezvous, and libzmq
        # aborts a process whose Unix-socket accept finds no file left (ipc.transport.fdlimit).
        fdlimit.raise_limit()
        limits = Limits(max_frame=chunk_bytes + 1024)
        me = self.node_index
        info = {"name": f"node {me}", "node": me, "pid": os.getpid()}

        def listen(secret, specs: list[str]) -> list[str]:
            if self._endpoint is not None:
                self._endpoint.close(linger=0)
            self._endpoint = Endpoint(
                secret,
                f"node {me}",
                bind=specs,
                encrypt=self.encrypt,
                limits=limits,
                liveness=liveness,
                info=info,
                accept=self._accept,
            )
            return list(self._endpoint.addresses)

        try:
            roster = rendezvous.rendezvous(listen, options, self.timeout)
            self.where = roster.where
            self._connect(roster, base, stall_warning)
            if shm and self.num_nodes > 1 and len(set(roster.hosts)) == 1 and SHM_DIR.is_dir():
                self._shm = self._setup_shm(stall_warning)
        except BaseException as exc:
            if self._engine is not None and isinstance(exc, IPCError):
                self._engine.fail(exc)
            self._release(linger=0)
            raise
        self._comm = _CommThread(self)
        self._comm.start()
        _TREES.add(self)

    # ---- set-up -----------------------------------------------------------------

    def _accept(self, link: Link) -> str | None:
        """Admit a link only from one of our children (the roster says which)."""
        j = link.info.get("node")
        if not isinstance(j, int) or j not in self.children:
            return f"node {j} is not a child of node {self.node_index}"
        if j in self._links and self._links[j].up:
            return f"node {j} is linked already"
        link.tag = j
        link.name = f"node {j}"
        return None

    def _connect(self, roster: Roster, base: int, stall_warning: float) -> None:
        me, ep = self.node_index, self._endpoint
        placements = build_tree(list(roster.hosts), base)
        self.parent = placements[me].parent
        self.children = placements[me].children
        subtree = [1] * self.num_nodes
        for i in sorted(range(self.num_nodes), key=lambda i: -_depth(placements, i)):
            if placements[i].parent is not None:
                subtree[placements[i].parent] += subtree[i]
        if self.parent is not None:
            p = self.parent
            same = roster.hosts[p] == roster.hosts[me]
            addrs = roster.addresses[p]
            addr = next((a for a in addrs if a.startswith("ipc://")), None) if same else None
            addr = addr or next(a for a in addrs if a.startswith("tcp://"))
            link = ep.dial(addr, tag=p, reconnect=False)
            link.name = f"node {p}"
            self._links[p] = link
        deadline = time.monotonic() + self.timeout
        while True:
            # Take the children's links; leave other events (a fast neighbour may already
            # have finished collectives and said goodbye) for the engine.
            for event in [e for e in ep.events if e[0] == "accepted"]:
                ep.events.remove(event)
                self._links[event[1].tag] = event[1]
            if self.parent is not None:
                plink = self._links[self.parent]
                if plink.failure is not None:  # refused: says why, before its link's end
                    raise plink.failure
            for what, link in ep.events:
                if what == "dead" and link.tag in self._links and link.bye is None:
                    raise ep.dead_error(link)
            neighbours = [*self.children, *([self.parent] if self.parent is not None else [])]
            if all(j in self._links and self._links[j].state == "up" for j in neighbours):
                break
            if time.monotonic() > deadline:
                down = [
                    j for j in neighbours if j not in self._links or self._links[j].state != "up"
                ]
                children = [j for j in down if j in self.children]
                what = [f"nodes {children} did not link to us"] if children else []
                if self.parent in down:
                    what.append(f"our link to node {self.parent} (our parent) did not come up")
                raise IPCError(
                    f"node {me}: {' and '.join(what)} within {self.timeout:g}s", node=down[0]
                )
            ep.poll(0.05)
        # Every neighbour is connected: the Unix socket names can go now, so even a
        # killed process leaves nothing behind.
        ep.unlink_socket_files()
        self._engine = Engine(
            me,
            self.num_nodes,
            ep,
            self.parent,
            self._links,
            {c: subtree[c] for c in self.children},
            timeout=self.timeout,
            stall_warning=stall_warning,
        )

    def _setup_shm(self, stall_warning: float) -> SharedMemoryGroup | None:
        """All nodes on one host: agree on a name and node 0's pid, then map slots and FIFOs."""
        name = torch.zeros(2, dtype=torch.int64)
        control = None
        if self.node_index == 0:
            ident = int.from_bytes(os.urandom(7), "little") | 1
            try:
                control = shm_mod.create_control(f"ipc-{ident:014x}", os.getpid(), self.num_nodes)
                name[0], name[1] = ident, os.getpid()
            except OSError as err:
                log.warning("ipc: no shared memory (%s); collectives go through the sockets", err)
        self._run_inline(name, "scatter", None, False, True)
        if int(name[0]) == 0:
            return None
        engine = self._engine
        return SharedMemoryGroup(
            self.node_index,
            self.num_nodes,
            f"ipc-{int(name[0]):014x}",
            int(name[1]),
            runtime_dir(),
            sync=lambda: self._run_inline([], "barrier", None, True, True),
            wait_readable=engine.wait_fd,
            timeout=self.timeout,
            control=control,
            on_stall=lambda waited, late: engine.log_stall(waited, late),
            stall_warning=stall_warning,
        )

    @staticmethod
    def from_env(
        *,
        token: str | None = None,
        token_file: str | None = None,
        insecure: bool = False,
        **options,
    ) -> Tree:
        """A tree from torchrun's RANK/WORLD_SIZE/LOCAL_WORLD_SIZE/MASTER_ADDR/MASTER_PORT
        or Slurm's variables (see ipc.rendezvous.from_env); `options` as for Tree. With
        no launcher (plain `python`), a one-node tree: rank 0 of 1, collectives are
        identities, logged at INFO."""
        return Tree(env_handler(token=token, token_file=token_file, insecure=insecure), **options)

    # ---- public API -------------------------------------------------------------

    @checked
    def all_reduce(
        self, tensors: Nested, op: Op = "sum", finished: bool = False, async_op: bool = False
    ) -> Handle | int:
        """Reduce `tensors` across all nodes, in place; returns how many nodes contributed.

        A node passing `finished=True` contributes nothing (so a sum sees zeros
        from it) but still receives the result; this lets ranks with uneven
        step counts finish an epoch without hanging. With `async_op=True` it
        returns a Handle at once; `handle.wait()` returns the count. Do not touch
        the tensors until then."""
        self._check()
        kind, reduce = _op(op)
        return self._submit((flatten(tensors), kind, reduce, True, not finished), async_op)

    @checked
    def scatter(self, tensors: Nested, async_op: bool = False) -> Handle | None:
        """Copy the root's `tensors` into every node's `tensors`, in place."""
        self._check()
        return self._submit((flatten(tensors), "scatter", None, False, True), async_op)

    def barrier(self, async_op: bool = False) -> Handle | None:
        """Return once every node has entered the barrier."""
        self._check()
        return self._submit(([], "barrier", None, True, True), async_op)

    def net_stats(self) -> dict:
        """Bytes and messages per link, time spent in collectives, and shared-memory traffic
        (``shm``: collectives, bytes, ``direct``: those read out of peers' tensors, and
        ``fused``: queued all-reduces that ran inside the collective before them)."""
        return {
            "node": self.node_index,
            "parent": self.parent,
            "children": list(self.children),
            "links": self._engine.link_stats() if self._engine is not None else {},
            "collectives": self._collectives,
            "collective_seconds": self._collective_time,
            "encrypt": self.encrypt,
            # same-host collectives that went through shared memory instead of the links
            "shm": None if self._shm is None else {**self._shm.stats, "cma": self._shm.cma},
        }

    def close(self) -> None:
        """Finish what is in flight, say goodbye to the neighbours and wait until they have
        read everything we sent (so the last collective is never lost), then release
        sockets and files."""
        if self._closed:
            return
        self._closed = True
        if os.getpid() != self._pid:
            return  # a forked child: nothing here is ours
        _TREES.discard(self)
        if self._comm is not None:
            self._comm.drain(self.timeout)
            self._comm.stop()
        broken = self._engine is not None and self._engine.broken is not None
        with self._lock:
            self._release(linger=min(self.timeout, 10.0 if broken else 60.0))

    def _release(self, linger: float) -> None:
        if self._shm is not None:
            self._shm.close()
            self._shm = None
        if self._endpoint is not None:
            seq = self._engine.seq if self._engine is not None else 0
            self._endpoint.close(bye={"seq": seq}, linger=linger)

    def __enter__(self) -> Tree:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(node_index={self.node_index}, num_nodes={self.num_nodes}, "
            f"parent={self.parent}, children={self.children})"
        )

    # ---- running collectives ------------------------------------------------------

    def _check(self) -> None:
        if self._closed:
            # A forked child's trees are closed at the fork (os.register_at_fork): the
            # pid, a system call, is read only to say why.
            if os.getpid() != self._pid:
                raise IPCError(
                    f"node {self.node_index}: this tree belongs to process {self._pid}; a "
                    "forked child cannot use it (make a tree in the child, or fork before "
                    "making it)",
                    node=self.node_index,
                )
            raise IPCError(f"node {self.node_index}: tree is closed", node=self.node_index)

    def _submit(self, args: tuple, async_op: bool) -> Handle | int | None:
        """Start a collective in submission order: queued behind what is in flight, or,
        synchronous with nothing in flight, run right here (no thread hand-off)."""
        comm = self._comm
        with self._order:  # another thread (an autograd hook) cannot slip in between
            if async_op:
                return comm.submit(args)
            # Idle: nothing queued and nobody running. Read without comm's mutex: under
            # _order no job can be queued meanwhile, and a runner finishing takes its job
            # off the queue and clears `runner` in one step under that mutex, so at worst
            # we see it still running and queue behind it.
            if not comm.queue and comm.runner is None:
                try:
                    with self._lock:
                        return self._collective(*args)
                finally:
                    comm.active = time.monotonic()
            handle = comm.submit(args)
        return handle.wait()

    def _run_inline(self, *args) -> int | None:
        """A collective during set-up (before the communication thread exists)."""
        return self._collective(*args)

    def _service(self) -> None:
        if self._engine is not None and not self._closed:
            self._engine.service()

    def _collective(
        self, leaves: list[torch.Tensor], kind: str, reduce, up: bool, contribute: bool
    ) -> int | None:
        return self._collective_fused([(leaves, kind, reduce, up, contribute)])[0]

    def _fusable(self, packed: Packed, jobs: list[tuple]) -> list[tuple[list, bytes]]:
        """What this node offers to run fused with `packed` (the first of `jobs`, two or
        more): the queued all-reduces right behind it with the same op and `finished`,
        each a single contiguous CPU tensor (reduced in place, nothing to pack), large
        enough that shared memory reads it out of the peers' memory (ipc.collectives.shm.fusable),
        none overlapping another. Every node offers what it has queued; they run the
        longest run that all of them offered."""
        shm = self._shm
        _, kind, _, up, contribute = jobs[0]
        if not up or kind not in _FUSABLE or len(packed.groups) != 1:
            return []
        head = packed.groups[0]
        if not head.aliased or not shm.fusable([head.flat]):
            return []
        size = shm_mod.aligned_bytes
        offers, nbytes = [([head.flat], b"")], size([head.flat])
        spans = [_span(head.flat)]
        for leaves, k, _, _, c in jobs[1:]:
            if k != kind or c != contribute or len(leaves) != 1:
                break
            t = leaves[0]
            flat = [t.view(-1)] if t.device.type == "cpu" and t.is_contiguous() else []
            if not flat or len(offers) >= FUSE_MAX or not shm.fusable(flat):
                break
            # A tensor reduced twice in a row must see the first result: not fused with it.
            lo, hi = span = _span(flat[0])
            if any(lo < b and a < hi for a, b in spans):
                break
            nbytes += size(flat)
            if nbytes > min(shm.limit, FUSE_BYTES):
                break
            spans.append(span)
            offers.append((flat, Packed([t]).signature(kind)))
        return offers if len(offers) > 1 else []

    def _collective_fused(self, jobs: list[tuple]) -> tuple[int | None, int]:
        """Run the first of `jobs` (args as for `_collective`) and, on shared memory, those
        behind it that every node has queued too, as one collective: returns its result
        and how many jobs it ran (each one's result is the same count of contributors)."""
        leaves, kind, reduce, up, contribute = jobs[0]
        engine = self._engine
        start = time.perf_counter()
        done = 1
        try:
            # begin() inside: a Ctrl-C that lands as it returns is still told to the peers
            engine.begin(kind)
            packed = Packed(leaves)
            sig = packed.signature(kind)
            total = None
            if self.num_nodes == 1:
                total = 1 if contribute else 0
                if total == 0 and up:
                    for g in packed.groups:
                        g.flat.zero_()
            elif self._shm is not None:
                offers = self._fusable(packed, jobs) if len(jobs) > 1 else None
                if offers:
                    offers[0] = (offers[0][0], sig)
                    total, done = self._shm.run_fused(offers, reduce, contribute)
                    engine.fused(done - 1)
                else:
                    total = self._shm.run(
                        [g.flat for g in packed.groups], sig, reduce, contribute, scatter=not up
                    )
            if total is None:
                total = engine.run(packed, sig, reduce, up, contribute, self.chunk_bytes)
            packed.unpack()
        except BaseException as exc:
            # Whatever made us leave (a peer's failure, a custom op that raised, Ctrl-C),
            # our neighbours hear of it now instead of waiting for us (once).
            if exc is not engine.broken:
                engine.fail(exc)
            raise
        finally:
            engine.end()
        self._collectives += done
        self._collective_time += time.perf_counter() - start
        return (None if kind == "scatter" or kind == "barrier" else total), done

    def _forked(self) -> None:
        """In a forked child (os.register_at_fork): let go of the parent's sockets."""
        self._closed = True
        if self._endpoint is not None:
            self._endpoint.close_inherited_fds()


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes a contiguous tensor covers in memory."""
    return t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()


def _depth(placements, i: int) -> int:
    d = 0
    while placements[i].parent is not None:
        i = placements[i].parent
        d += 1
    return d


def _after_fork_in_child() -> None:
    for tree in list(_TREES):
        with contextlib.suppress(Exception):
            tree._forked()
    _TREES.clear()


def _close_all_at_exit() -> None:
    # A process that ends without close() (an exception, sys.exit) still tells its
    # neighbours, who then raise naming it instead of waiting for the timeout.
    for tree in list(_TREES):
        with contextlib.suppress(Exception):
            tree.close()


os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(_close_all_at_exit)


# ---- the factories users call ------------------------------------------------------


def LocalhostTree(
    node_index: int,
    num_nodes: int,
    *,
    key: str | int | None = None,
    port: int | None = None,
    token: str | None = None,
    token_file: str | None = None,
    **options,
) -> Tree:
    """A tree of processes on this host: Unix sockets in the private runtime directory,
    nothing on TCP, and a random secret that node 0 shares through that directory.

    Processes started side by side by one shell script or one Python parent find each
    other (the parent pid keys the rendezvous, checked against start time and command
    line); pass `key=` (or set $IPC_KEY) to group processes with different parents.
    `token=` / `token_file=` (or $IPC_TOKEN / $IPC_TOKEN_FILE) set the secret yourself;
    with `port=` node 0 also accepts joins on 127.0.0.1:port from nodes that have it.
    `options` as for Tree (shm=False keeps every collective on the sockets)."""
    check("LocalhostTree()", options, keyword_names(Tree.__init__), keyword_names(LocalhostTree))
    handler = Localhost(
        node_index, num_nodes, key=key, port=port, token=token, token_file=token_file
    )
    return Tree(handler, **options)


def StaticTree(
    node_index: int,
    num_nodes: int,
    root_host: str,
    root_port: int,
    *,
    host: str | None = None,
    token: str | None = None,
    token_file: str | None = None,
    insecure: bool = False,
    **options,
) -> Tree:
    """A tree across machines: node 0 listens on `root_host:root_port`, the others dial it.

    The secret is `token`, `token_file`, $IPC_TOKEN or $IPC_TOKEN_FILE; without one an
    IPCError says how to set it (`insecure=True` derives it from the root address, for a
    trusted cluster, loudly logged). A loopback `root_host` without a secret means every
    node is on this host: they meet as LocalhostTree does, keyed by the port. `host` is
    the address this node binds and advertises. `options` as for Tree."""
    check("StaticTree()", options, keyword_names(Tree.__init__), keyword_names(StaticTree))
    check_index(node_index, num_nodes)
    if is_loopback(root_host) and not (token or token_file or insecure or _env_secret()):
        handler = Localhost(node_index, num_nodes, key=f"static:{root_host}:{root_port}")
        return Tree(handler, **options)
    handler = Static(
        node_index,
        num_nodes,
        root_host,
        root_port,
        host=host,
        token=token,
        token_file=token_file,
        insecure=insecure,
    )
    return Tree(handler, **options)


def _env_secret() -> bool:
    return bool(os.environ.get(TOKEN_ENV) or os.environ.get(TOKEN_FILE_ENV))


def from_env(**kwargs) -> Tree:
    """`Tree.from_env`: a tree configured by torchrun or Slurm."""
    return Tree.from_env(**kwargs)
