"""Collectives over a node's links: the chunked reduce up the tree and the broadcast down.

The engine owns one node's links (to its parent and children) and runs one
collective at a time on them, in the order the nodes entered them: it is
what `Tree` calls under its lock, from the caller's thread or its
communication thread. Between collectives `service()` keeps the links
answered: it acknowledges goodbyes, passes errors on and keeps messages that
arrive early for the collective they belong to.

Every frame from a peer is checked against the collective's layout before
it touches memory: sequence number and signature (op, dtypes, shapes), chunk
index, no chunk twice, a payload of exactly the chunk's size, and no more
contributors than the sender's subtree holds.

Failures are named: a neighbour whose link dies (a dead or frozen process,
see :mod:`ipc.transport.link`) or that leaves early raises `PeerError` naming it; a
node that leaves a collective through any exception (a custom op that
raises, Ctrl-C) sends ERROR to its neighbours, who pass it on, so every node
raises at once naming it. A slow node is waited for, up to `timeout`; once a
collective has waited `stall_warning` seconds the engine logs which nodes
have not reached it (Horovod's stall inspector), from the progress every
node reports once a second up the tree, and the root's view that comes back
down.

Here: the collectives and their failures; what the engine receives is
engine_receive.py, the stall inspector engine_stall.py.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable

import torch
import zmq

from ..errors import IPCError, IPCTimeoutError, MismatchError, PeerError
from ..transport import Endpoint, Kind, Link, wire
from .engine_receive import ReceivingMixin
from .engine_stall import StallInspectorMixin
from .hostops import copy
from .pack import Packed

__all__ = ["Engine", "Reduce"]

# Below this size zmq copies anyway; tracking a zero-copy send would cost more than it saves.
ZERO_COPY_MIN = 1 << 16
_EMPTY_SIG = b"\0" * 8

Reduce = Callable[[torch.Tensor, torch.Tensor], None]


def _payload(t: torch.Tensor):
    return t.view(torch.uint8).numpy() if t.numel() else b""


class Engine(ReceivingMixin, StallInspectorMixin):
    """One node's side of the tree's collectives over its links."""

    def __init__(
        self,
        node: int,
        num_nodes: int,
        endpoint: Endpoint,
        parent: int | None,
        links: dict[int, Link],
        subtree: dict[int, int],
        *,
        timeout: float,
        stall_warning: float,
    ):
        self.node = node
        self.num_nodes = num_nodes
        self.ep = endpoint
        self.parent = parent
        self.children = sorted(j for j in links if j != parent)
        self.links = links
        self.subtree = subtree  # nodes in each child's subtree
        self.timeout = timeout
        self.stall_warning = stall_warning
        self.stash: deque = deque()
        self._stash_bytes = 0
        self.seq = 0  # collectives entered
        self.kind = ""
        self.busy = False
        self.entered_at = 0.0
        self.broken: IPCError | None = None
        self.left: dict[int, int] = {}  # neighbour -> collectives it finished before its BYE
        self._failure: IPCError | None = None  # raised once the data before it is used
        self._later: IPCError | None = None  # a failure in a later collective: next begin()
        # Progress for the stall inspector: each child's subtree minimum, and the root's view.
        self._sub: dict[int, tuple[int, list[int]]] = {}
        self._root_view: tuple[int, list[int]] | None = None
        # Progress goes with the heartbeats: off when they are off.
        interval = endpoint.liveness.interval
        self._progress_every = interval if interval > 0 else float("inf")
        self._next_progress = 0.0
        self._next_stall = 0.0

    # ---- collectives ----------------------------------------------------------

    def begin(self, kind: str) -> None:
        """Enter the next collective: raises if the tree is broken or a neighbour left.

        It does not poll the links (a small collective over shared memory costs tens of
        microseconds, a poll several): what arrived meanwhile is seen by the
        communication thread's service or as soon as this collective waits."""
        failure = self._failure or self._later
        if failure is not None and self.broken is None:
            self.fail(failure)
        if self.broken is not None:
            raise self.broken
        self.seq += 1
        self.kind = kind
        self.busy = True
        self.entered_at = time.monotonic()
        self._next_stall = self.entered_at + self.stall_warning
        for j, done in self.left.items():
            if done < self.seq:
                raise self._left_error(j, done)

    def fused(self, extra: int) -> None:
        """`extra` more collectives ran inside the one entered last (see
        ipc.collectives.shm.run_fused, where every node took part in all of them): count
        them as entered."""
        self.seq += extra

    def end(self) -> None:
        self.busy = False

    def run(
        self,
        packed: Packed,
        sig: bytes,
        reduce: Reduce | None,
        up: bool,
        contribute: bool,
        chunk_bytes: int,
    ) -> int:
        """One collective over the links: reduce up (`up`) and send the result down, or
        broadcast the root's values. Returns the number of contributing nodes."""
        chunks = list(packed.chunks(chunk_bytes))
        n = len(chunks)
        seq = self.seq
        root = self.parent is None
        children = self.children
        links = self.links
        pending: list[list[tuple[int, zmq.Frame | None]]] = [[] for _ in range(n)]
        seen: set[tuple[int, int]] = set()
        trackers: list[zmq.MessageTracker] = []
        next_up = 0
        down_done = 0
        total = 1

        def send_down(k: int, count: int, payload: object) -> None:
            header = wire.data_header(Kind.DOWN, seq, k, count, sig)
            for c in children:
                if isinstance(payload, torch.Tensor):
                    buf = _payload(payload)
                    big = len(buf) >= ZERO_COPY_MIN
                    t = links[c].send(header, buf, copy=not big, track=big)
                    if t is not None:
                        trackers.append(t)
                else:  # a frame we received: forwarded without a copy (zmq refcounts it)
                    links[c].send(header, payload, copy=False)

        def advance() -> None:
            # Reduce and pass on every chunk for which all children have reported.
            nonlocal next_up, total
            while next_up < n and len(pending[next_up]) == len(children):
                k = next_up
                acc = chunks[k]
                have = contribute
                count = 1 if contribute else 0
                for c_count, frame in pending[k]:
                    count += c_count
                    if frame is None or acc.numel() == 0:
                        continue
                    src = torch.frombuffer(frame.buffer, dtype=acc.dtype)
                    if have:
                        reduce(acc, src)
                    else:
                        copy(acc, src)
                        have = True
                pending[k] = []
                if root:
                    if not have:
                        acc.zero_()
                    total = count
                    send_down(k, count, acc)
                else:
                    header = wire.data_header(Kind.UP, seq, k, count, sig)
                    if have:
                        buf = _payload(acc)
                        big = len(buf) >= ZERO_COPY_MIN
                        t = links[self.parent].send(header, buf, copy=not big, track=big)
                        if t is not None:
                            trackers.append(t)
                    else:
                        links[self.parent].send(header)
                next_up += 1

        if up:
            advance()
        elif root:
            for k in range(n):
                send_down(k, 1, chunks[k])
            next_up = n
        finished = (lambda: next_up == n) if root else (lambda: down_done == n)
        while not finished():
            peer, kind, m_seq, k, count, m_sig, frame = self._next(
                children if up and next_up < n else [self.parent]
            )
            if m_seq != seq or m_sig != sig or k >= n:
                raise MismatchError(
                    f"node {self.node}: node {peer} is in a different collective "
                    f"(sequence {m_seq} vs {seq}, chunk {k} of {n}, "
                    f"{'same' if m_sig == sig else 'different'} op/shapes/dtypes)",
                    node=peer,
                )
            size = 0 if frame is None else len(frame.buffer)
            want = chunks[k].numel() * chunks[k].element_size()
            if kind == Kind.UP and up and peer in children:
                if (peer, k) in seen:
                    raise self._malformed(peer, f"chunk {k} of collective {seq} twice")
                if (
                    count > self.subtree[peer]
                    or (count > 0) != (frame is not None)
                    or (frame is not None and size != want)
                ):
                    raise self._malformed(
                        peer,
                        f"chunk {k}: {size} bytes from {count} contributors "
                        f"(want {want} bytes, at most {self.subtree[peer]} contributors)",
                    )
                seen.add((peer, k))
                pending[k].append((count, frame))
                advance()
            elif kind == Kind.DOWN and peer == self.parent:
                if k != down_done or frame is None or size != want or count > self.num_nodes:
                    raise self._malformed(
                        peer,
                        f"result chunk {k} ({size} bytes, {count} contributors) where "
                        f"chunk {down_done} of {want} bytes was due",
                    )
                dst = chunks[k]
                if size:
                    copy(dst, torch.frombuffer(frame.buffer, dtype=dst.dtype))
                total = count
                send_down(k, count, frame)
                down_done += 1
            else:
                raise MismatchError(
                    f"node {self.node}: unexpected message kind {kind} from node {peer}",
                    node=peer,
                )
        for t in trackers:
            # Our chunks may still be on their way out of the caller's memory.
            self._wait_tracker(t)
        return total

    def _malformed(self, peer: int, what: str) -> PeerError:
        return PeerError(f"node {self.node}: node {peer} sent {what}", node=peer)

    def _wait_tracker(self, tracker: zmq.MessageTracker) -> None:
        deadline = time.monotonic() + self.timeout
        while not tracker.done:
            if time.monotonic() > deadline:
                raise IPCTimeoutError(
                    f"node {self.node}: a send was not delivered within {self.timeout}s",
                    node=self.node,
                )
            self._pump(0)
            with contextlib.suppress(zmq.NotDone):
                tracker.wait(0.05)

    # ---- failures -------------------------------------------------------------------

    def _left_error(self, j: int, done: int) -> PeerError:
        exc = PeerError(
            f"node {self.node}: node {j} closed the tree after {done} collectives; this is "
            f"{self.kind or 'collective'} #{self.seq}",
            node=j,
        )
        exc.via = j
        return exc

    def fail(self, exc: BaseException) -> IPCError:
        """Remember that the tree is broken and tell every neighbour (but the one that told
        us), so every node raises instead of hanging. Returns the error later calls raise."""
        if isinstance(exc, IPCError):
            origin, message = exc.node, str(exc)
            broken = exc
        else:
            origin = self.node
            message = (
                f"node {self.node} left {self.kind} #{self.seq} through {type(exc).__name__}: {exc}"
            )
            broken = IPCError(
                f"node {self.node}: the tree is broken: {self.kind} #{self.seq} raised "
                f"{type(exc).__name__}: {exc}",
                node=self.node,
            )
            broken.__cause__ = exc
        if self.broken is None:
            self.broken = broken
        body = {"node": origin, "seq": self.seq, "message": message[:4000]}
        header = wire.control(Kind.ERROR, body)
        for j, link in self.links.items():
            if j == getattr(exc, "via", None) or not link.up or j in self.left:
                continue
            with contextlib.suppress(IPCError, zmq.ZMQError):
                link.send(header)
        return self.broken

    def _timeout_error(self, waiting_on: list) -> IPCTimeoutError:
        late = self._laggards()
        if late:
            who = f"nodes {late[1]} never reached it (they are at #{late[0]}, and alive)"
            node = late[1][0]
        else:
            who = f"waiting on node(s) {waiting_on}, which are alive"
            node = waiting_on[0] if waiting_on else self.node
        return IPCTimeoutError(
            f"node {self.node}: {self.kind} #{self.seq} did not complete within "
            f"{self.timeout:g}s: {who}",
            node=node,
        )

    # ---- statistics --------------------------------------------------------------------

    def link_stats(self) -> dict:
        return {j: {"address": link.address, **vars(link.stats)} for j, link in self.links.items()}
