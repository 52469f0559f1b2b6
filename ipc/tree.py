"""The process tree: links to parent and children, and the collectives that run over them.

Each node binds one ROUTER socket (what it receives) and connects one DEALER
per neighbour (what it sends). Identities are HMACs of the job's secret, so a
stranger's messages are dropped, and a socket monitor on each DEALER notices
a neighbour that dies. Tensors travel as raw bytes behind a 21-byte header;
nothing received is ever unpickled or executed.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import logging
import os
import struct
import tempfile
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from .errors import IPCError, IPCTimeoutError, MismatchError, PeerError
from .pack import Nested, Packed, flatten
from .shm import SHM_DIR, SharedMemoryGroup
from .topology import build_tree

log = logging.getLogger(__name__)

# Header: kind, collective sequence number, chunk index, contributing count, signature.
HEADER = struct.Struct("<BIII8s")
UP, DOWN, ERROR, BYE, HELLO = 1, 2, 3, 4, 5

DEFAULT_TIMEOUT = float(os.environ.get("IPC_TIMEOUT", "300"))
DEFAULT_CHUNK = 1 << 20
# Below this size zmq copies anyway; tracking a zero-copy send would cost more than it saves.
ZERO_COPY_MIN = 1 << 16

Op = str | Callable[[torch.Tensor, torch.Tensor], torch.Tensor | None]


def link_identity(secret: bytes, src: int, dst: int) -> bytes:
    """The ZeroMQ identity `src` uses towards `dst`: unforgeable without the secret."""
    # ZeroMQ reserves identities that start with a zero byte: never start with one.
    return b"L" + hmac.new(secret, f"link:{src}->{dst}".encode(), hashlib.sha256).digest()[:16]


def runtime_dir() -> Path:
    """A private (0700) directory for rendezvous files, Unix sockets and FIFOs."""
    d = Path(tempfile.gettempdir()) / f"distlearn-ipc-{os.getuid()}"
    d.mkdir(mode=0o700, exist_ok=True)
    return d


def _dead(peer: int, exc: IPCError) -> IPCError:
    """Mark `exc` as coming from `peer`, which cannot hear about it any more."""
    exc.via = peer
    return exc


def _reducer(op: Op) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """In-place `acc = op(acc, src)` on two 1-D chunks (torch ops release the GIL)."""
    if op == "sum":
        return lambda acc, src: acc.add_(src)
    if op == "max":
        return lambda acc, src: torch.maximum(acc, src, out=acc)
    if op == "min":
        return lambda acc, src: torch.minimum(acc, src, out=acc)
    if callable(op):

        def apply(acc: torch.Tensor, src: torch.Tensor) -> None:
            out = op(acc, src)
            if out is not None and out is not acc:
                acc.copy_(out)

        return apply
    raise ValueError(f"all_reduce op must be 'sum', 'max', 'min' or a callable, got {op!r}")


@dataclass
class LinkStats:
    """Traffic on one link, as seen from this node."""

    bytes_sent: int = 0
    bytes_recv: int = 0
    msgs_sent: int = 0
    msgs_recv: int = 0


@dataclass
class Peer:
    """One neighbour: its index, our sending socket to it, and its monitor."""

    index: int
    address: str
    sock: zmq.Socket
    monitor: zmq.Socket
    stats: LinkStats = field(default_factory=LinkStats)


class Tree:
    """One node of the process tree; made by `LocalhostTree`, `StaticTree` or `Tree.from_env`."""

    def __init__(
        self,
        node_index: int,
        num_nodes: int,
        *,
        context: zmq.Context,
        router: zmq.Socket,
        cleanup: list[str],
        secret: bytes,
        hosts: list[str],
        addresses: list[dict[str, str]],
        base: int = 2,
        timeout: float = DEFAULT_TIMEOUT,
        chunk_bytes: int = DEFAULT_CHUNK,
        shm: bool = True,
    ):
        self.node_index = node_index
        self.num_nodes = num_nodes
        self.timeout = timeout
        self.chunk_bytes = chunk_bytes
        self._ctx = context
        self._router = router
        self._cleanup = cleanup
        self._secret = secret
        self._seq = 0
        self._broken: IPCError | None = None
        self._shm: SharedMemoryGroup | None = None
        self._polled_fds: set[int] = set()
        self._closed = False
        self._bye: set[int] = set()
        self._backlog: deque = deque()
        self._collective_time = 0.0
        self._collectives = 0
        placement = build_tree(hosts, base)[node_index]
        self.parent: int | None = placement.parent
        self.children: list[int] = placement.children
        self._peers: dict[int, Peer] = {}
        self._by_identity: dict[bytes, int] = {}
        self._poller = zmq.Poller()
        self._poller.register(router, zmq.POLLIN)
        for j in [*([self.parent] if self.parent is not None else []), *self.children]:
            addr = self._pick_address(hosts, addresses, j)
            sock = context.socket(zmq.DEALER)
            sock.setsockopt(zmq.IDENTITY, link_identity(secret, node_index, j))
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.LINGER, 2000)
            monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            sock.connect(addr)
            self._peers[j] = Peer(j, addr, sock, monitor)
            self._by_identity[link_identity(secret, j, node_index)] = j
            self._poller.register(monitor, zmq.POLLIN)
        try:
            self._handshake()
            # Every neighbour is connected: the Unix socket names can go now, so even a
            # killed process leaves nothing behind.
            self._unlink_cleanup()
            if shm and num_nodes > 1 and len(set(hosts)) == 1 and SHM_DIR.is_dir():
                self._shm = self._setup_shm()
        except BaseException as exc:
            if isinstance(exc, IPCError):
                self._fail(exc)
            self.close()
            raise

    def _setup_shm(self) -> SharedMemoryGroup:
        """All nodes on one host: agree on a name and node 0's pid, then map slots and FIFOs."""
        name = torch.zeros(2, dtype=torch.int64)
        if self.node_index == 0:
            name[0], name[1] = int.from_bytes(os.urandom(7), "little"), os.getpid()
        self._collective(name, "scatter", None, up=False, contribute=True)
        return SharedMemoryGroup(
            self.node_index,
            self.num_nodes,
            f"ipc-{int(name[0]):014x}",
            int(name[1]),
            runtime_dir(),
            sync=lambda: self._collective([], "barrier", None, up=True, contribute=True),
            wait_readable=self._wait_readable,
            timeout=self.timeout,
        )

    def _wait_readable(self, fd: int, seconds: float) -> None:
        """Wait until `fd` is readable or `seconds` pass; raise if a neighbour fails or dies."""
        if fd not in self._polled_fds:
            self._poller.register(fd, zmq.POLLIN)  # stays registered: no per-wait cost
            self._polled_fds.add(fd)
        events = dict(self._poller.poll(max(1, int(seconds * 1000))))
        if self._router in events:
            # An error or an early goodbye from a neighbour raises here.
            msg = self._read_router()
            if msg is not None:
                self._backlog.append(msg)
        elif events and fd not in events:
            self._check_monitors(0)

    def _pick_address(self, hosts: list[str], addresses: list[dict[str, str]], j: int) -> str:
        # Same host: a Unix socket skips the TCP stack; otherwise TCP.
        if hosts[j] == hosts[self.node_index] and "ipc" in addresses[j]:
            return addresses[j]["ipc"]
        return addresses[j]["tcp"]

    def _handshake(self) -> None:
        """Say hello on every link and wait for every neighbour's hello."""
        for p in self._peers.values():
            self._send(p, HELLO, 0, 0, 0, b"\0" * 8)
        waiting = set(self._peers)
        early = []
        while waiting:
            msg = self._recv()
            waiting.discard(msg[0])
            if msg[1] != HELLO:
                # A neighbour that finished its handshake first may already be reducing.
                early.append(msg)
        self._backlog.extend(early)

    @staticmethod
    def from_env(**kwargs) -> Tree:
        """A tree from torchrun's RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT or Slurm's variables."""
        from .rendezvous import from_env

        return from_env(**kwargs)

    # ---- public API -------------------------------------------------------

    def all_reduce(self, tensors: Nested, op: Op = "sum", finished: bool = False) -> int:
        """Reduce `tensors` across all nodes, in place; returns how many nodes contributed.

        A node passing `finished=True` contributes nothing (so a sum sees zeros
        from it) but still receives the result; this lets ranks with uneven
        step counts finish an epoch without hanging.
        """
        reduce = _reducer(op)
        kind = f"all_reduce:{op if isinstance(op, str) else 'callable'}"
        return self._collective(tensors, kind, reduce, up=True, contribute=not finished)

    def scatter(self, tensors: Nested) -> None:
        """Copy the root's `tensors` into every node's `tensors`, in place."""
        self._collective(tensors, "scatter", None, up=False, contribute=True)

    def barrier(self) -> None:
        """Return once every node has entered the barrier."""
        self._collective([], "barrier", None, up=True, contribute=True)

    def net_stats(self) -> dict:
        """Bytes and messages per link, time spent in collectives, and shared-memory traffic
        (``shm``: collectives, bytes, and ``direct``: those read out of peers' tensors)."""
        return {
            "node": self.node_index,
            "parent": self.parent,
            "children": list(self.children),
            "links": {j: {"address": p.address, **vars(p.stats)} for j, p in self._peers.items()},
            "collectives": self._collectives,
            "collective_seconds": self._collective_time,
            # same-host collectives that went through shared memory instead of the links
            "shm": None if self._shm is None else {**self._shm.stats, "cma": self._shm.cma},
        }

    def close(self) -> None:
        """Tell the neighbours we are leaving, then release sockets and files."""
        if self._closed:
            return
        self._closed = True
        for p in self._peers.values():
            with contextlib.suppress(zmq.ZMQError):
                self._send(p, BYE, self._seq, 0, 0, b"\0" * 8)
        for p in self._peers.values():
            p.sock.disable_monitor()
            p.monitor.close(linger=0)
            p.sock.close()
        if self._shm is not None:
            self._shm.close()
        self._router.close(linger=0)
        # Terminating our context blocks until what we queued (the last results sent
        # down the tree, the goodbyes) is in the kernel, for at most the DEALERs'
        # linger: a process that exits right after close(), even through os._exit as
        # multiprocessing children do, cannot strand a neighbour mid-collective.
        self._ctx.destroy()
        self._unlink_cleanup()

    def _unlink_cleanup(self) -> None:
        for path in self._cleanup:
            with contextlib.suppress(OSError):
                os.unlink(path)
        self._cleanup = []

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

    # ---- the collective engine -------------------------------------------

    def _collective(
        self,
        tensors: Nested,
        kind: str,
        reduce: Callable[[torch.Tensor, torch.Tensor], None] | None,
        up: bool,
        contribute: bool,
    ) -> int:
        if self._closed:
            raise IPCError(f"node {self.node_index}: tree is closed", node=self.node_index)
        if self._broken is not None:
            raise self._broken
        start = time.perf_counter()
        leaves = flatten(tensors)
        packed = Packed(leaves)
        sig = packed.signature(kind)
        self._seq += 1
        try:
            if self.num_nodes == 1:
                total = 1 if contribute else 0
                if total == 0 and up:
                    for chunk in packed.chunks(self.chunk_bytes):
                        chunk.zero_()
            elif self._shm is not None:
                flats = [g.flat for g in packed.groups]
                total = self._shm.run(flats, sig, reduce, contribute, scatter=not up)
            else:
                total = self._run(packed, sig, reduce, up, contribute)
        except IPCError as exc:
            self._fail(exc)
            raise
        packed.unpack()
        self._collectives += 1
        self._collective_time += time.perf_counter() - start
        return total

    def _run(
        self,
        packed: Packed,
        sig: bytes,
        reduce: Callable[[torch.Tensor, torch.Tensor], None] | None,
        up: bool,
        contribute: bool,
    ) -> int:
        chunks = list(packed.chunks(self.chunk_bytes))
        n = len(chunks)
        seq = self._seq
        root = self.parent is None
        children = self.children
        pending: list[list[tuple[int, int, zmq.Frame | None]]] = [[] for _ in range(n)]
        trackers: list[zmq.MessageTracker] = []
        next_up = 0
        down_done = 0
        total = 1

        def send_down(k: int, count: int, payload: object) -> None:
            for c in children:
                t = self._send(self._peers[c], DOWN, seq, k, count, sig, payload)
                if t is not None:
                    trackers.append(t)

        def advance() -> None:
            # Reduce and pass on every chunk for which all children have reported.
            nonlocal next_up, total
            while next_up < n and len(pending[next_up]) == len(children):
                k = next_up
                acc = chunks[k]
                have = contribute
                count = 1 if contribute else 0
                for _, c_count, frame in pending[k]:
                    count += c_count
                    if frame is None or acc.numel() == 0:
                        continue
                    src = torch.frombuffer(frame.buffer, dtype=acc.dtype)
                    if have:
                        reduce(acc, src)
                    else:
                        acc.copy_(src)
                        have = True
                pending[k] = []
                if root:
                    if not have:
                        acc.zero_()
                    total = count
                    send_down(k, count, acc)
                else:
                    self._send(
                        self._peers[self.parent], UP, seq, k, count, sig, acc if have else None
                    )
                next_up += 1

        if up:
            advance()
        elif root:
            for k in range(n):
                send_down(k, 1, chunks[k])
            next_up = n
        finished = (lambda: next_up == n) if root else (lambda: down_done == n)
        while not finished():
            peer, kind, m_seq, k, count, m_sig, frame = self._recv()
            if kind == HELLO:
                continue
            if m_seq != seq or m_sig != sig or k >= n:
                raise MismatchError(
                    f"node {self.node_index}: node {peer} is in a different collective "
                    f"(sequence {m_seq} vs {seq}, chunk {k} of {n}, "
                    f"{'same' if m_sig == sig else 'different'} op/shapes/dtypes)",
                    node=peer,
                )
            if kind == UP and up and peer in children:
                pending[k].append((peer, count, frame))
                advance()
            elif kind == DOWN and peer == self.parent:
                dst = chunks[k]
                if frame is not None and dst.numel():
                    dst.copy_(torch.frombuffer(frame.buffer, dtype=dst.dtype))
                total = count
                send_down(k, count, frame)
                down_done += 1
            else:
                raise MismatchError(
                    f"node {self.node_index}: unexpected message kind {kind} from node {peer}",
                    node=peer,
                )
        for t in trackers:
            # The root's chunks may still be on their way out of the caller's memory.
            self._wait_tracker(t)
        return total

    def _wait_tracker(self, tracker: zmq.MessageTracker) -> None:
        deadline = time.monotonic() + self.timeout
        while not tracker.done:
            if time.monotonic() > deadline:
                raise IPCTimeoutError(
                    f"node {self.node_index}: a send was not delivered within {self.timeout}s",
                    node=self.node_index,
                )
            self._check_monitors(0)
            with contextlib.suppress(zmq.NotDone):
                tracker.wait(0.05)

    # ---- sockets ---------------------------------------------------------

    def _send(
        self,
        peer: Peer,
        kind: int,
        seq: int,
        chunk: int,
        count: int,
        sig: bytes,
        payload: object = None,
    ) -> zmq.MessageTracker | None:
        header = HEADER.pack(kind, seq, chunk, count, sig)
        peer.stats.msgs_sent += 1
        if payload is None:
            peer.sock.send(header)
            peer.stats.bytes_sent += len(header)
            return None
        if isinstance(payload, torch.Tensor):
            buf = payload.view(torch.uint8).numpy() if payload.numel() else b""
            size = len(buf)
            peer.stats.bytes_sent += len(header) + size
            peer.sock.send(header, zmq.SNDMORE)
            if size >= ZERO_COPY_MIN:
                # copy=False: zmq reads straight from the tensor; the tracker says when it is done.
                return peer.sock.send(buf, copy=False, track=True)
            peer.sock.send(buf)
            return None
        # A zmq.Frame we received: forward it without copying (zmq refcounts it).
        size = len(payload.buffer) if isinstance(payload, zmq.Frame) else len(payload)
        peer.stats.bytes_sent += len(header) + size
        peer.sock.send(header, zmq.SNDMORE)
        peer.sock.send(payload, copy=False)
        return None

    def _check_monitors(self, timeout_ms: int) -> None:
        for p in self._peers.values():
            while p.monitor.poll(timeout_ms, zmq.POLLIN):
                event = recv_monitor_message(p.monitor, zmq.NOBLOCK)
                if event["event"] != zmq.EVENT_DISCONNECTED or p.index in self._bye:
                    continue
                # A peer that closed normally sent a goodbye first, on another
                # connection: give it a moment to arrive before calling it dead.
                deadline = time.monotonic() + 0.5
                while p.index not in self._bye and self._router.poll(
                    max(0, int((deadline - time.monotonic()) * 1000))
                ):
                    msg = self._read_router()
                    if msg is not None:
                        self._backlog.append(msg)
                if p.index not in self._bye:
                    raise _dead(
                        p.index,
                        PeerError(
                            f"node {self.node_index}: lost the connection to node {p.index} "
                            f"({p.address}); did it die?",
                            node=p.index,
                        ),
                    )
            timeout_ms = 0

    def _read_router(self) -> tuple[int, int, int, int, int, bytes, zmq.Frame | None] | None:
        """One message from the ROUTER; None for a stranger's or a harmless goodbye."""
        frames = self._router.recv_multipart(copy=False)
        peer = self._by_identity.get(frames[0].bytes)
        if peer is None or len(frames) < 2 or len(frames[1].bytes) != HEADER.size:
            self._stranger(frames[0].bytes)
            return None
        kind, seq, chunk, count, sig = HEADER.unpack(frames[1].bytes)
        payload = frames[2] if len(frames) > 2 else None
        stats = self._peers[peer].stats
        stats.msgs_recv += 1
        stats.bytes_recv += HEADER.size + (len(payload.buffer) if payload else 0)
        if kind == ERROR:
            info = json.loads(payload.bytes) if payload else {}
            origin = info.get("node", peer)
            exc = PeerError(
                f"node {self.node_index}: tree failed: {info.get('message')} "
                f"(reported via node {peer})",
                node=origin,
            )
            exc.via = peer  # no need to tell it back
            raise exc
        if kind == BYE:
            self._bye.add(peer)
            if seq < self._seq:
                # It left before finishing the collective we are in (or about to start).
                raise _dead(
                    peer,
                    PeerError(
                        f"node {self.node_index}: node {peer} closed the tree after "
                        f"{seq} collectives; this is collective {self._seq}",
                        node=peer,
                    ),
                )
            return None  # it finished everything we need from it
        return peer, kind, seq, chunk, count, sig, payload

    def _recv(self) -> tuple[int, int, int, int, int, bytes, zmq.Frame | None]:
        """Next message from a neighbour: (peer, kind, seq, chunk, count, sig, payload)."""
        if self._backlog:
            return self._backlog.popleft()
        deadline = time.monotonic() + self.timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise IPCTimeoutError(
                    f"node {self.node_index}: no message from nodes "
                    f"{sorted(self._peers)} within {self.timeout}s",
                    node=self.node_index,
                )
            events = dict(self._poller.poll(int(min(remaining, 3600) * 1000) + 1))
            if self._router in events:
                msg = self._read_router()
                if msg is not None:
                    return msg
            elif events:
                self._check_monitors(0)

    _stranger_logged = 0.0

    def _stranger(self, identity: bytes) -> None:
        now = time.monotonic()
        if now - self._stranger_logged > 10:  # rate-limited: a stranger could flood us
            self._stranger_logged = now
            log.warning(
                "ipc node %d: dropped a message from an unknown peer (identity %s): "
                "wrong token or not part of this job",
                self.node_index,
                identity.hex()[:16],
            )

    def _fail(self, exc: IPCError) -> None:
        """Remember the failure and pass it on, so every node raises instead of hanging."""
        self._broken = exc
        body = json.dumps({"node": exc.node, "message": str(exc)}).encode()
        header = HEADER.pack(ERROR, self._seq, 0, 0, b"\0" * 8)
        for j, p in self._peers.items():
            if j == getattr(exc, "via", None):
                continue
            with contextlib.suppress(zmq.ZMQError):
                p.sock.send_multipart([header, body], zmq.NOBLOCK)
