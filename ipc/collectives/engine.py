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
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable

import torch
import zmq

from ..errors import IPCError, IPCTimeoutError, MismatchError, PeerError
from ..transport import Endpoint, Kind, Link, WireError, wire
from .hostops import copy
from .pack import Packed

log = logging.getLogger(__name__)

# Below this size zmq copies anyway; tracking a zero-copy send would cost more than it saves.
ZERO_COPY_MIN = 1 << 16
# Messages read ahead of their collective (between collectives) are kept up to this
# many bytes; beyond it the links' receive queues hold the rest (backpressure).
STASH_BYTES = 256 << 20
MAX_LAGGARDS = 16  # node indices carried in a progress report
_EMPTY_SIG = b"\0" * 8

Reduce = Callable[[torch.Tensor, torch.Tensor], None]


def _payload(t: torch.Tensor):
    return t.view(torch.uint8).numpy() if t.numel() else b""


class Engine:
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

    # ---- receiving ---------------------------------------------------------------

    def _next(self, waiting_on: list) -> tuple:
        """The next data message, in arrival order. Data already received comes first; then
        a failure that arrived is raised; otherwise wait, up to the collective's timeout."""
        stash = self.stash
        deadline = self.entered_at + self.timeout
        while True:
            if stash:
                msg = stash.popleft()
                self._stash_bytes -= msg[-2]
                return msg[:-2] + msg[-1:]
            if self._failure is not None:
                raise self._failure
            now = time.monotonic()
            if now >= self._next_progress:
                self._report_progress(now)
            if now >= self._next_stall:
                self._log_stall(now, waiting_on)
            if now >= deadline:
                raise self._timeout_error(waiting_on)
            wake = min(deadline, self._next_progress, self._next_stall)
            self.ep.poll(min(wake - now, 3600))
            self._absorb()

    def _pump(self, timeout: float) -> None:
        self.ep.poll(timeout)
        self._absorb()
        if self._failure is not None:
            raise self._failure

    def _absorb(self) -> None:
        """Take in what the endpoint collected: data into the stash, progress reports, and
        failures into `_failure` (raised once the data received before them is used).

        An ERROR from a neighbour already in a later collective waits for the next one:
        what it sent for this one has arrived."""
        ep = self.ep
        while ep.inbox:
            link, frames = ep.inbox.popleft()
            j = link.tag
            if j not in self.links:
                continue
            header = frames[0].bytes
            kind = header[0]
            try:
                if kind in (Kind.UP, Kind.DOWN):
                    _, seq, chunk, count, sig = wire.parse_data(header)
                    if len(frames) > 2:
                        raise WireError(f"{len(frames)} frames in a data message")
                    payload = frames[1] if len(frames) == 2 else None
                    size = len(payload.buffer) if payload is not None else 0
                    self.stash.append((j, kind, seq, chunk, count, sig, size, payload))
                    self._stash_bytes += size
                elif kind == Kind.ERROR:
                    body = wire.parse_control(header, {"seq": wire.small_int()})
                    origin = body.get("node")
                    if not (isinstance(origin, int) and 0 <= origin < self.num_nodes):
                        origin = j
                    exc = PeerError(
                        f"node {self.node}: {str(body.get('message'))[:2000]} "
                        f"(reported via node {j})",
                        node=origin,
                    )
                    exc.via = j  # no need to tell it back
                    if body["seq"] > self.seq or (body["seq"] == self.seq and not self.busy):
                        self._later = self._later or exc
                    else:
                        self._failure = self._failure or exc
                elif kind == Kind.PROGRESS:
                    self._progress(j, wire.parse_control(header))
            except WireError as err:
                self._failure = self._failure or self._malformed(j, f"a malformed message: {err}")
        while ep.events:
            what, link = ep.events.popleft()
            j = link.tag
            if j not in self.links or self.links[j] is not link:
                continue
            if what == "dead" and j not in self.left:
                exc = ep.dead_error(link)
                exc.node = j
                exc.via = j  # it cannot hear about it any more
                self._failure = self._failure or exc
            elif what == "bye":
                done = link.bye.get("seq") if isinstance(link.bye, dict) else None
                self.left[j] = done if isinstance(done, int) else -1
                if self.busy and self.left[j] < self.seq:
                    self._failure = self._failure or self._left_error(j, self.left[j])

    def wait_fd(self, fd: int, seconds: float) -> None:
        """Wait until `fd` is readable or `seconds` pass (shared memory's barrier), keeping
        the links answered; raises if a neighbour fails or dies."""
        self.ep.watch(fd)
        now = time.monotonic()
        if now >= self._next_progress:
            self._report_progress(now)
        self.ep.poll(seconds)
        self._absorb()
        if self._failure is not None:
            raise self._failure

    def service(self) -> None:
        """Between collectives: answer the links, keep early data, pass failures on. A
        failure found here breaks the tree; the next collective raises it."""
        if self.broken is not None:
            return
        try:
            now = time.monotonic()
            if now >= self._next_progress:
                self._report_progress(now)
            if self._stash_bytes < STASH_BYTES:
                self.ep.poll(0)
            self._absorb()
            failure = self._failure or self._later
            if failure is not None:
                raise failure
        except IPCError as exc:
            self.fail(exc)

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

    # ---- progress and the stall inspector ---------------------------------------------

    def _subtree_min(self) -> tuple[int, list[int]]:
        best, nodes = self.seq, [self.node]
        for c in self.children:
            m, who = self._sub.get(c, (0, [c]))
            if m < best:
                best, nodes = m, list(who)
            elif m == best:
                nodes.extend(who)
        return best, sorted(nodes)[:MAX_LAGGARDS]

    def _report_progress(self, now: float) -> None:
        """Once a second: our subtree's progress to the parent, the root's view down."""
        self._next_progress = now + self._progress_every
        sub = self._subtree_min()
        if self.parent is None:
            self._root_view = sub
        else:
            self._tell(self.parent, wire.control(Kind.PROGRESS, {"sub": list(sub)}))
        if self._root_view is not None and self.children:
            down = wire.control(Kind.PROGRESS, {"root": list(self._root_view)})
            for c in self.children:
                self._tell(c, down)

    def _tell(self, j: int, header: bytes) -> None:
        link = self.links.get(j)
        if link is not None and link.up and j not in self.left:
            with contextlib.suppress(IPCError, zmq.ZMQError):
                link.send(header)

    def _progress(self, j: int, body: dict) -> None:
        for name in ("sub", "root"):
            v = body.get(name)
            if (
                isinstance(v, list)
                and len(v) == 2
                and isinstance(v[0], int)
                and isinstance(v[1], list)
                and all(isinstance(x, int) for x in v[1][:MAX_LAGGARDS])
            ):
                value = (v[0], [x for x in v[1][:MAX_LAGGARDS] if 0 <= x < self.num_nodes])
                if name == "sub" and j in self.children:
                    self._sub[j] = value
                elif name == "root" and j == self.parent:
                    self._root_view = value

    def _laggards(self) -> tuple[int, list[int]] | None:
        """(collective, nodes) of the nodes furthest behind, if any is behind us."""
        # The root's view as reported down the tree (a second or so old per level), and
        # our own subtree's, fresh; the root has only the latter.
        views = [self._subtree_min()]
        if self.parent is not None and self._root_view is not None:
            views.insert(0, self._root_view)
        for m, nodes in views:
            if m < self.seq and nodes:
                return m, nodes
        return None

    def _log_stall(self, now: float, waiting_on: list) -> None:
        waited = now - self.entered_at
        self._next_stall = now + max(self.stall_warning, 60.0)
        late = self._laggards()
        self.log_stall(waited, late[1] if late else None, waiting_on, late[0] if late else None)

    def log_stall(
        self, waited: float, late: list[int] | None, waiting_on: list = (), at: int | None = None
    ) -> None:
        if late:
            detail = f"nodes {late} have not reached it" + (f" (they are at #{at})" if at else "")
        else:
            detail = f"waiting on node(s) {list(waiting_on)}"
        log.warning(
            "ipc node %d: %s #%d has waited %.0f s; %s. They are alive (their links answer "
            "heartbeats); the collective times out after %g s",
            self.node,
            self.kind,
            self.seq,
            waited,
            detail,
            self.timeout,
        )

    # ---- statistics --------------------------------------------------------------------

    def link_stats(self) -> dict:
        return {j: {"address": link.address, **vars(link.stats)} for j, link in self.links.items()}
