"""The direct sockets of a `Server`'s same-host clients, and reading or dropping one client.

A client of the same user on this host shows a nonce on the server's direct listener
and names it in its authenticated handshake; the server then binds that socket to the
client's Connection (`_bind_direct`), reads it straight in the caller's thread while
it waits for that client (`_next_from`), watches it with one epoll otherwise, and
looks after the link layer between slices of every wait (see services/direct.py).
"""

from __future__ import annotations

import contextlib
import logging
import select
import socket
import time
from collections import deque
from typing import TYPE_CHECKING

import zmq

from ..errors import IPCTimeoutError, PeerError
from ..transport import Kind
from . import direct

if TYPE_CHECKING:  # (server.py imports this module)
    from .server import Connection

__all__ = ["DirectSocketsMixin"]

log = logging.getLogger(__name__)


class DirectSocketsMixin:
    """`Server`'s direct sockets and its reads and drops of one client. It reads the
    server's `_listener`, `_epoll`, `_endpoint`, `_bulk`, `_max_frame`, `_conns` and
    `_serviced`; it keeps `_by_fd` and `_reading`, takes messages off `_pending` (and
    queues those its sockets hold), records reported deaths in `_reported` and
    `_unreported`, and sets a Connection's `direct` and `said_bye`, marking its link
    dead when its socket ends. Between slices of a wait it calls the server's
    `_service`; `_check_open` guards every read."""

    # ---- the direct sockets ------------------------------------------------------------

    def _watch_waiting(self, sock: socket.socket, add: bool) -> None:
        if add:
            self._epoll.register(sock.fileno(), select.EPOLLIN)
        else:
            with contextlib.suppress(OSError, ValueError):
                self._epoll.unregister(sock.fileno())

    def _bind_direct(self, conn: Connection) -> None:
        """Give an accepted client the direct socket that showed its handshake's nonce."""
        nonce = conn.link.info.get("direct")
        if nonce is None or self._listener is None:
            return
        sock = self._listener.claim(nonce)
        if sock is None:
            # Its socket went (the oldest of too large a burst, or gone before the
            # handshake): the authenticated link serves it alone, and the client, whose
            # socket ends unanswered, does the same.
            log.info("ipc server: %s showed no direct socket for its nonce", conn.name)
            return
        conn.direct = direct.Direct(sock, self._max_frame)
        self._by_fd[sock.fileno()] = conn
        self._epoll.register(sock.fileno(), select.EPOLLIN)

    def _end_direct(self, conn: Connection, why: Exception) -> None:
        """The direct socket ended (`why`: direct.Closed) or broke (DirectError)."""
        d = conn.direct
        if d is None or d.sock.fileno() < 0:
            return
        self._by_fd.pop(d.fileno(), None)
        with contextlib.suppress(OSError, ValueError):
            self._epoll.unregister(d.fileno())
        if isinstance(why, direct.Closed) and why.bye:
            conn.said_bye = True
            d.close(bye=False)
            return
        d.close(bye=False)
        if isinstance(why, direct.Closed):
            self._endpoint.mark_dead(conn.link, "its connection closed")
        else:
            log.warning("ipc server: dropped %s: %s", conn.name, why)
            self._endpoint.mark_dead(conn.link, f"it broke the framing ({why})")

    def _drain_direct(self, conn: Connection) -> None:
        """Queue every whole message its socket holds now."""
        d = conn.direct
        try:
            while (msg := d.read(block=False)) is not None:
                self._pending.append((conn, direct.copy_of(msg)))
        except (direct.Closed, direct.DirectError) as why:
            self._end_direct(conn, why)

    def _direct_service(self, conn: Connection) -> None:
        """Between slices of a wait on `conn`'s socket: the link layer and the others."""
        self._service(0)
        if conn.link.dead is not None:
            raise self._endpoint.dead_error(conn.link)

    def _send_direct(self, conn: Connection, obj: object) -> None:
        d = conn.direct
        if conn.link.dead is not None:
            raise self._endpoint.dead_error(conn.link)
        try:
            if d.send_tensor(obj, lambda: self._direct_service(conn)):
                return
            if self._bulk.arena is not None and conn.link not in self._bulk.readers:
                self._service(0)  # its BULK_OK may be waiting on the link
            frames = self._bulk.pack(obj, conn.link)
            try:
                d.send_frames(frames, lambda: self._direct_service(conn))
            except BaseException:
                self._bulk.drop(frames, self._bulk.arena)
                raise
        except direct.Closed as why:
            self._end_direct(conn, why)
            raise self._gone(conn) from None

    def _close_direct(self) -> None:
        for conn in self._conns:
            if conn.direct is not None:
                conn.direct.close(bye=True)
        if self._listener is not None:
            self._listener.close()

    def _wait(self, deadline: float | None, what: str) -> None:
        remaining = 3600.0 if deadline is None else deadline - time.monotonic()
        if remaining <= 0:
            raise IPCTimeoutError(f"ipc server: timed out waiting for {what}")
        self._service(min(remaining, 1.0))

    def _gone(self, conn: Connection) -> PeerError:
        link = conn.link
        if link.bye is not None or conn.said_bye:
            return PeerError(f"ipc server: {conn.name} has closed its connection", conn.index)
        return self._endpoint.dead_error(link)

    def _next_from(self, conn: Connection, deadline: float | None) -> list | tuple:
        """The next message from `conn` (valid until the next read from it)."""
        self._check_open()
        d = conn.direct
        if d is None or time.monotonic() - self._serviced > direct.SLICE:
            # Handshakes, other clients, liveness: at least every SLICE, even while a
            # direct client keeps us busy
            self._service(0)
        while True:
            for k, (c, frames) in enumerate(self._pending):
                if c is conn:
                    del self._pending[k]
                    return frames
            if d is not None and d.sock.fileno() >= 0:
                # Straight from its socket, in this thread; the rest is looked after
                # between slices of the wait.
                self._reading = conn
                try:
                    msg = d.read(True, lambda: self._direct_service(conn), deadline)
                except (direct.Closed, direct.DirectError) as why:
                    self._end_direct(conn, why)
                    continue
                except PeerError:
                    # Its link died while we read its socket: reported here too, or
                    # recv_any raised it a second time.
                    self._reported.add(conn.index)
                    self._unreported.pop(conn.index, None)
                    raise
                finally:
                    self._reading = None
                if msg is not None:
                    return msg
                raise IPCTimeoutError(
                    f"ipc server: timed out waiting for a message from {conn.name}"
                )
            if not conn.alive:
                # Reported here: recv_any does not raise it again.
                self._reported.add(conn.index)
                self._unreported.pop(conn.index, None)
                raise self._gone(conn)
            self._wait(deadline, f"a message from {conn.name}")

    def _drop(self, conn: Connection) -> None:
        if conn.direct is not None and conn.direct.sock.fileno() >= 0:
            self._by_fd.pop(conn.direct.fileno(), None)
            with contextlib.suppress(OSError, ValueError):
                self._epoll.unregister(conn.direct.fileno())
            conn.direct.close(bye=True)
        if conn.link.dead is None and conn.link.bye is None:
            with contextlib.suppress(PeerError, zmq.ZMQError):
                conn.link.send_control(Kind.BYE, {})  # its recv raises PeerError
            conn.link.bye_sent = True
            self._endpoint.mark_dead(conn.link, "the server dropped it")
        self._reported.add(conn.index)  # dropped on purpose: not an error to report
        memory = self._bulk.memory_of(conn.link)
        for c, frames in self._pending:
            if c is conn:
                self._bulk.drop(frames, memory)  # never read: the client may reuse the memory
        self._pending = deque((c, f) for c, f in self._pending if c is not conn)
