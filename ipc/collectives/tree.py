"""The process tree: `Tree(rendezvous, ...)`, its set-up and its collectives' public API.

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
`Tree._fusable` and ipc.collectives.shm.run_fused), each with its own call's
results.
Collectives are issued by one thread at a time, in the same order on every
node (as with torch.distributed).

Forks: a forked child cannot use its parent's tree (every call raises), and
the tree's sockets are closed in the child, so a child that outlives its
parent does not keep the parent's links open.

Here: `Tree`, its set-up and public API; how it runs a collective is running.py,
the handles and the communication thread handles.py, the factories users call
(`LocalhostTree`, `StaticTree`, `from_env`) factories.py.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import threading
import time
import weakref
from collections.abc import Iterable, Sequence

import torch

from distlearn.common.envvars import env_float
from distlearn.common.keywords import checked

from ..errors import IPCError
from ..rendezvous import Localhost, Roster, Static
from ..rendezvous import from_env as env_handler
from ..rendezvous.lobby import Admission, Knock, Lobby
from ..transport import Endpoint, Limits, Link, Liveness, fdlimit, runtime_dir
from . import shm as shm_mod
from .engine import Engine
from .handles import Handle, _CommThread
from .pack import Nested, flatten
from .running import Op, RunningMixin, _op
from .shm import SHM_DIR, SharedMemoryGroup
from .topology import build_tree

__all__ = ["Tree"]

log = logging.getLogger(__name__)


DEFAULT_TIMEOUT = env_float("IPC_TIMEOUT", 300.0, low=0)
DEFAULT_CHUNK = 1 << 20
DEFAULT_STALL_WARNING = env_float("IPC_STALL_WARNING", 30.0, low=0)
RELEASE_S = 5.0  # how long a re-formed tree waits for its old peers' acknowledgements

_TREES: weakref.WeakSet = weakref.WeakSet()


class Tree(RunningMixin):
    """One node of a tree of processes.

        tree = ipc.Tree(ipc.rendezvous.Localhost(node_index, num_nodes))
        tree = ipc.LocalhostTree(node_index, num_nodes)      # the same
        tree = ipc.Tree.from_env()                            # torchrun or Slurm

    Every node must pass the same `base`, `chunk_bytes`, `shm` and `encrypt`; node 0
    checks.

    Args:
        rendezvous: How the nodes find each other: `ipc.rendezvous.Localhost`,
            `ipc.rendezvous.Static`, or `ipc.rendezvous.from_env()`.
        base: The tree's fan-out.
        timeout: Seconds any collective may wait for a slow node (default 300, or
            $IPC_TIMEOUT).
        chunk_bytes: The socket transport's chunk: large buffers travel in pieces of
            this size, reduced on the way up.
        shm: Collectives through shared memory when every node is on one host.
        encrypt: None (the default): links over TCP encrypted and authenticated
            (CURVE, keys derived from the job's secret), Unix sockets of one host left
            to this user's processes; True: every link; False: none, for a network
            trusted not to be read or rewritten.
        heartbeat: An `ipc.Liveness`: how soon a dead or frozen peer is named
            (default from $IPC_HEARTBEAT_INTERVAL/$IPC_HEARTBEAT_TIMEOUT, 1 s and 6 s).
        stall_warning: Seconds before a waiting collective logs who it waits for.

    Attributes:
        node_index: This node, 0-based; node 0 is the root.
        num_nodes: How many nodes the tree has.

    Raises:
        TypeError: A misspelt option, naming the closest.
        ValueError: An option out of range, naming it.
        IPCError: The rendezvous failed (nodes with different options, a node 0 that
            gave up...), naming the node at fault.
        IPCTimeoutError: Not every node arrived within `timeout`.
    """

    @checked
    def __init__(
        self,
        rendezvous: Localhost | Static,
        *,
        base: int = 2,
        timeout: float = DEFAULT_TIMEOUT,
        chunk_bytes: int = DEFAULT_CHUNK,
        shm: bool = True,
        encrypt: bool | None = None,
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
        # A process started again into a launch whose tree still runs (distlearn.survivors
        # opened its lobby) is taken back in: it joins the next generation, last.
        come_back = getattr(rendezvous, "come_back", None)
        if come_back is not None and getattr(rendezvous, "generation", 0) == 0:
            rendezvous = come_back() or rendezvous
        self.came_back = bool(getattr(rendezvous, "returned", False))
        self._lobby: Lobby | None = None
        self.node_index = rendezvous.node_index
        self.num_nodes = rendezvous.num_nodes
        # What reform() needs to make the survivors' tree: the handler, the options,
        # where each node listened, and how many times this job's tree was re-formed.
        self._rendezvous = rendezvous
        self._tree_options = {"base": base, "timeout": timeout, "chunk_bytes": chunk_bytes,
                              "shm": shm, "encrypt": encrypt, "heartbeat": heartbeat,
                              "stall_warning": stall_warning}  # fmt: skip
        self._addresses: tuple = ()
        self.generation = getattr(rendezvous, "generation", 0)
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
        if encrypt not in (None, True, False):
            raise ValueError(f"encrypt must be None, True or False, not {encrypt!r}")
        self.encrypt = encrypt
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
            # (a grown tree meets within ADMIT_S: one that came back and died does not hold
            # the others up for the whole timeout)
            meet = getattr(rendezvous, "meet_within", None) or self.timeout
            roster = rendezvous.rendezvous(listen, options, meet)
            self.where = roster.where
            self._addresses = roster.addresses
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
        """A tree from the launcher's environment: torchrun's or Slurm's.

        torchrun's RANK/WORLD_SIZE/LOCAL_WORLD_SIZE/MASTER_ADDR/MASTER_PORT, or Slurm's
        SLURM_PROCID/SLURM_NTASKS/... (see `ipc.rendezvous.from_env`). All ranks on one
        host meet through the private runtime directory; across hosts, node 0 listens
        at MASTER_ADDR. With no launcher (plain `python`), a one-node tree: rank 0 of 1,
        collectives are identities, logged at INFO.

        Args:
            token: The job's secret across hosts (else $IPC_TOKEN).
            token_file: A private file holding it (else $IPC_TOKEN_FILE).
            insecure: Derive the secret from the root's address (a trusted cluster
                only; logged loudly).
            **options (Any): As for `Tree`.

        Returns:
            This process's node of the tree.

        Raises:
            IPCError: Half a launcher's variables, a value that is not an integer, or
                several hosts without a secret (saying how to set one).
        """
        return Tree(env_handler(token=token, token_file=token_file, insecure=insecure), **options)

    # ---- public API -------------------------------------------------------------

    @checked
    def all_reduce(
        self, tensors: Nested, op: Op = "sum", finished: bool = False, async_op: bool = False
    ) -> Handle | int:
        """Reduce `tensors` across all nodes, in place.

        A node passing `finished=True` contributes nothing (so a sum sees zeros
        from it) but still receives the result; this lets ranks with uneven
        step counts finish an epoch without hanging.

        Args:
            tensors: A tensor or a nested list/tuple/dict of tensors, the same shapes
                and dtypes on every node (CUDA tensors travel through pinned memory).
            op: `"sum"`, `"max"`, `"min"`, or a function `op(acc, x)` that folds `x`
                into `acc` (in place, or by returning the result).
            finished: This node has run out of data.
            async_op: Return a `Handle` at once; do not touch the tensors until it
                is done.

        Returns:
            How many nodes contributed; with `async_op`, a `Handle` whose `wait()`
            returns it.

        Raises:
            PeerError: A node died, froze or left the collective, naming it.
            MismatchError: The nodes' shapes, dtypes or collectives differ.
            IPCTimeoutError: A slow node did not arrive within the tree's `timeout`.
            IPCError: The tree is closed, or used from a forked child.
            ValueError: An unknown `op`.
        """
        self._check()
        kind, reduce = _op(op)
        return self._submit((flatten(tensors), kind, reduce, True, not finished), async_op)

    @checked
    def scatter(self, tensors: Nested, async_op: bool = False) -> Handle | None:
        """Copy the root's `tensors` into every node's `tensors`, in place.

        Args:
            tensors: A tensor or a nested list/tuple/dict of tensors, the same shapes
                and dtypes on every node.
            async_op: Return a `Handle` at once.

        Returns:
            None, or with `async_op` a `Handle`.

        Raises:
            PeerError: A node died, froze or left, naming it.
            MismatchError: The nodes' shapes or dtypes differ.
            IPCTimeoutError: A slow node did not arrive within `timeout`.
        """
        self._check()
        return self._submit((flatten(tensors), "scatter", None, False, True), async_op)

    def barrier(self, async_op: bool = False) -> Handle | None:
        """Return once every node has entered the barrier.

        Args:
            async_op: Return a `Handle` at once.

        Returns:
            None, or with `async_op` a `Handle`.

        Raises:
            PeerError: A node died, froze or left, naming it.
            IPCTimeoutError: A slow node did not arrive within `timeout`.
        """
        self._check()
        return self._submit(([], "barrier", None, True, True), async_op)

    def net_stats(self) -> dict:
        """What this node has sent and received.

        Returns:
            Bytes and messages per link, time spent in collectives, and shared-memory
            traffic (``shm``: collectives, bytes, ``direct``: those read out of peers'
            tensors, and ``fused``: queued all-reduces that ran inside the collective
            before them).
        """
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

    def reform(self, dead: Iterable[int]) -> Tree:
        """The tree of this tree's nodes but `dead`, which every survivor calls with the
        same set (a PeerError's `node` names a dead one), numbered in their old order.

        The survivors meet again as they met first, under a new generation: on one host
        by the rendezvous key plus ``/gen<g>``; across hosts at the lowest survivor's
        address, on the root port plus g, with the same secret. This tree is closed. A
        survivor whose peers see another set does not meet them and raises after the
        timeout (IPCError), rather than join a tree of the wrong size."""
        dead = set(dead)
        if self.node_index in dead:
            raise ValueError(f"node {self.node_index} cannot re-form a tree it is dead in")
        survivors = [i for i in range(self.num_nodes) if i not in dead]
        index, n = survivors.index(self.node_index), len(survivors)
        return self._succeed(self._successor(index, n, survivors[0]))

    def open_lobby(self) -> None:
        """Take back in the processes of this launch that died and were started again (as
        distlearn.survivors does): node 0 of a one-host tree opens the launch's lobby
        (`ipc.rendezvous.lobby`), where such a process, in `Tree.from_env`, knocks and
        waits; `knocks` lists them and `admit` takes them in. Elsewhere (other nodes,
        trees across hosts) nothing: a process started again there makes a tree of its
        own launch, as before."""
        if self.node_index != 0 or self._lobby is not None or self._closed:
            return
        if isinstance(self._rendezvous, Localhost) and self.num_nodes > 1:
            self._lobby = Lobby(self._rendezvous.lobby_key)
            self._lobby.publish(self.generation, self.num_nodes)

    def knocks(self, fresh: bool = False) -> list[Knock]:
        """On node 0 of a tree with an open lobby: the returning processes waiting to be
        taken in (looked up at most every 0.25 s unless `fresh`). Elsewhere []."""
        return self._lobby.knocks(fresh) if self._lobby is not None else []

    def admit(self, knocks: Sequence[Knock]) -> Tree:
        """The tree of this tree's nodes, numbered as now, and the processes of `knocks`
        after them (node 0's list: every node calls this with it, at the same point). Node
        0 answers each knock with where to join; the returning processes meet the others
        under the next generation. This tree is closed, unless they do not all join within
        ADMIT_S (one died, or froze): then every node raises IPCError and this tree, which
        nobody left, goes on."""
        if not knocks:
            raise ValueError("admit: no knocks to take in")
        n = self.num_nodes + len(knocks)
        handler = self._successor(self.node_index, n, 0)
        handler.meet_within = min(self.timeout, Lobby.admit_s)
        if self._lobby is not None:
            assert isinstance(handler, Localhost)
            for j, knock in enumerate(knocks):
                where = Admission(handler.key, self.num_nodes + j, n, handler.generation)
                self._lobby.admit(knock, where)
        return self._succeed(handler)

    def _successor(self, index: int, n: int, root: int) -> Localhost | Static:
        """The handler of the next generation: node `index` of `n`, node 0 being this
        tree's node `root`. On one host they meet by the rendezvous key plus ``/gen<g>``;
        across hosts at `root`'s address, on the root port plus g, with the same secret."""
        g = self.generation + 1
        old = self._rendezvous
        if isinstance(old, Localhost):
            token = old.given.text if old.given is not None else None
            handler: Localhost | Static = Localhost(index, n, key=f"{old.key}/gen{g}", token=token,
                                                    lobby_key=old.lobby_key)  # fmt: skip
        else:
            address = next((a for a in self._addresses[root] if a.startswith("tcp://")), "")
            host = address[len("tcp://") :].rsplit(":", 1)[0].strip("[]")
            handler = Static(index, n, host, old.root_port + g, token=old.secret.text)
        handler.generation = g
        return handler

    def _succeed(self, handler: Localhost | Static) -> Tree:
        # The new tree first, the old one released after: a survivor still inside the
        # failed collective must not see this node leave it (it would take this node for
        # the dead one); by the time every survivor has joined the new tree, each has seen
        # the real failure.
        tree = Tree(handler, **self._tree_options)
        lobby, self._lobby = self._lobby, None
        if lobby is not None:  # node 0 stays node 0: the lobby goes on, never closed between
            tree._lobby = lobby
            lobby.publish(tree.generation, tree.num_nodes)
        self._closed = True
        _TREES.discard(self)
        if self._comm is not None:
            self._comm.stop()
        # The old tree is left as close() leaves one: BYE on every live link, and its
        # sockets closed only once each peer has acknowledged (every survivor releases its
        # own old tree here, so the answers come within moments). Closed at once, a peer's
        # BYE landed on our closing socket, and its hang-up then a heartbeat aborted this
        # process in libzmq 4.3.5 (zeromq/libzmq#4841): node 0 died so when a killed
        # process came back, in 1 full-suite run of about 20.
        locked = self._lock.acquire(timeout=RELEASE_S)  # (the comm thread's last service)
        try:
            with contextlib.suppress(Exception):  # a broken tree: release what is left of it
                self._release(linger=RELEASE_S if locked else 0)
        finally:
            if locked:
                self._lock.release()
        return tree

    def close(self) -> None:
        """Leave the tree.

        Finish what is in flight, say goodbye to the neighbours and wait until they
        have read everything sent (so the last collective is never lost), then release
        the sockets and files. Closing twice does nothing.
        """
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
        if self._lobby is not None:
            with contextlib.suppress(Exception):
                self._lobby.close()
            self._lobby = None
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
