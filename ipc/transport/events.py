"""The event loop of an `Endpoint`: poll its sockets, then handle what they hold.

Handshake messages go to the handshakes, a link's own kinds (PROBE, BYE, ACK) are
answered here, and users' messages (kinds from 16 up) land in `inbox`, in arrival
order, for `recv`. A message on a dead link is dropped: nothing on it is trusted.
"""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING

import zmq

from ..errors import PeerError
from . import wire
from .handshakes import connection_of
from .wire import Kind, WireError

if TYPE_CHECKING:  # (link.py imports this module)
    from .link import Link

__all__ = ["EventLoopMixin"]

_ACK = wire.control(Kind.ACK, {})


class EventLoopMixin:
    """`Endpoint`'s event loop. It reads the endpoint's sockets (`_poller`, `router`,
    `_by_sock`, `_router_monitor`, `_by_monitor`), `links`, `_forgotten`, `_pending`,
    `_probe_until` and `liveness`; it keeps `_watched` and `_next_probe`, appends
    users' messages to `inbox` and ("bye", link) to `events`, and sets a link's
    `stats`, `bye` and `acked`. It hands the rest to the handshakes
    (`_handshake_message`, `_dialer_handshake`, `_expire_handshakes`), the liveness
    checks (`_check_monitors`, `_probe`) and `_drop`."""

    # ---- the event loop ------------------------------------------------------

    def poll(self, timeout: float) -> list:
        """Wait up to `timeout` seconds for traffic, then handle all of it: handshakes,
        liveness, BYE/ACK, and users' messages into `inbox`. Returns the poll events, in
        which the file descriptors given to `watch` show up too."""
        events = self.wait(timeout)
        self.process(events)
        return events

    def wait(self, timeout: float) -> list:
        """Wait up to `timeout` seconds for traffic without handling it: `process` the
        events it returns (a caller that must handle them under its own lock)."""
        # (not past the time a link waits to be dialed again, or to say HELLO again)
        waits = [link.redial_at for link in self._redials]
        waits += [link.hello_at for link in self._hellos]
        if waits:
            timeout = min(timeout, max(0.0, min(waits) - time.monotonic()) + 0.001)
        return self._poller.poll(max(0, int(timeout * 1000)))

    def watch(self, fd: int) -> None:
        """Wake `poll` when `fd` is readable too (a pipe another part of the program
        sleeps on); it stays watched."""
        if fd not in self._watched:
            self._poller.register(fd, zmq.POLLIN)
            self._watched.add(fd)

    def process(self, events: list) -> None:
        """Handle what `events` (from a poll over our sockets) says is ready."""
        monitors = False
        for sock, _ in events:
            if sock is self.router:
                self._drain_router()
            elif sock in self._by_sock:
                self._drain_dealer(self._by_sock[sock])
            elif sock is self._router_monitor or sock in self._by_monitor:
                monitors = True
        if monitors:
            self._check_monitors()
        if self._redials:
            self._redial_due()
        if self._hellos:
            self._hello_due()
        now = time.monotonic()
        if self.router is not None and (now < self._probe_until or now >= self._next_probe):
            self._next_probe = now + max(self.liveness.interval, 0.5)
            self._probe()
        if self._pending and now - next(iter(self._pending.values())).started > 5:
            self._expire_handshakes(now)

    def recv(self, deadline: float | None):
        """The next user message (link, frames) by `deadline` (monotonic), else None."""
        while not self.inbox:
            remaining = 0.0 if deadline is None else deadline - time.monotonic()
            if remaining <= 0:
                self.poll(0)
                break
            self.poll(min(remaining, 3600))
        return self.inbox.popleft() if self.inbox else None

    def _drain_router(self) -> None:
        router = self.router
        while True:
            try:
                frames = router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            rid = frames[0].bytes
            link = self.links.get(rid)
            if link is None and rid in self._forgotten:
                continue
            if link is None or link.dialed:
                self._handshake_message(rid, frames)
            elif connection_of(frames[0]) != link.conn:
                # Its routing id, on another connection than the one that did its handshake:
                # not that peer (dialers never reconnect). Its own connection has ended.
                self.mark_dead(link, "another connection took its routing id")
                self._drop(f"a message on {link.name}'s routing id from another connection")
            elif len(frames) < 2:
                self._drop(f"an empty message from {link.name}")
            else:
                self._deliver(link, frames[1:])

    def _drain_dealer(self, link: Link) -> None:
        while link.sock is not None:  # _deliver may find the link dead and close it
            try:
                frames = link.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if link.state != "up":
                self._dialer_handshake(link, frames)
            else:
                self._deliver(link, frames)

    def _deliver(self, link: Link, frames: list) -> None:
        """A message on an authenticated link: the link layer's own kinds, or the user's."""
        if link.dead is not None:
            return  # nothing on a dead link is trusted
        header = frames[0].bytes
        if link.bye is not None and header[:1] != bytes([Kind.ACK]):
            # After its BYE a peer sends nothing but the ACK of ours: whatever else comes
            # on its routing id is not its.
            self._drop(f"a message from {link.name} after its goodbye")
            return
        link.stats.msgs_recv += 1
        link.stats.bytes_recv += sum(len(f) for f in frames)
        kind = header[0] if header else 0
        if kind >= 16:
            self.inbox.append((link, frames))
        elif kind == Kind.PROBE:
            pass
        elif kind == Kind.BYE:
            try:
                bye = wire.parse_control(header)
            except WireError:
                bye = {}
            self.events.append(("bye", link))  # even if the ACK finds it gone
            with contextlib.suppress(PeerError, zmq.ZMQError):
                link.send(_ACK)  # everything it sent before the BYE has been read
            # The last message it gets from us: whatever followed would land on a socket
            # that is closing, and libzmq 4.3.5 aborts a process whose closing connection
            # holds unread input when the peer hangs up and a heartbeat fires
            # (zeromq/libzmq#4841). Sends on the link raise from now on.
            link.bye = bye
        elif kind == Kind.ACK:
            link.acked = True
        else:
            self._drop(f"a message of kind {kind} from {link.name} after its handshake")
