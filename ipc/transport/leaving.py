"""How an `Endpoint` leaves: BYE on every link, acknowledged, then everything closed.

`close()` says BYE on every link and waits until each peer has acknowledged it (or
is gone). A peer acknowledges a BYE when it reads it, and it reads in order, so
everything sent before the BYE has arrived: the last message before close() is
never lost, whatever the receive queues hold. A forked child closes only its copies
of the parent's sockets (`close_inherited_fds`), never the parent's ZeroMQ state.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import stat
import struct
import time

import zmq

from ..errors import PeerError
from . import wire
from .wire import Kind

__all__ = ["LeavingMixin"]

log = logging.getLogger(__name__)


class LeavingMixin:
    """`Endpoint`'s close. It reads `links`, `name`, `_pid`, `_bound` and the sockets
    (`router`, `_router_monitor`, `_ctx`); it sends BYE on the live links (setting
    `bye_sent`), polls (`poll`) for their ACKs, clearing `inbox`, then closes every
    socket (`_forget_dealer`, `unlink_socket_files`) and the context, and sets
    `_closed`. A forked child clears `links`, `_by_sock` and `_by_monitor` instead."""

    # ---- leaving -----------------------------------------------------------------

    def close(self, bye: dict | None = None, linger: float = 5.0) -> list:
        """Say BYE (with `bye` as its body) on every live link, wait up to `linger` s until
        each peer acknowledged it or is gone, then close everything. Returns the links
        that were up and did not acknowledge (gone, or not in time): what was sent on them
        may not have arrived."""
        if self._closed:
            return []
        self._closed = True
        if os.getpid() != self._pid:
            return []  # a forked child: the parent's sockets are not ours to touch
        live: list = []
        try:
            live = [link for link in self.links.values() if link.up and link.bye is None]
            for link in live:
                with contextlib.suppress(PeerError, zmq.ZMQError):
                    link.send(wire.control(Kind.BYE, bye or {}))
                    link.bye_sent = True
            deadline = time.monotonic() + linger
            while True:
                # Our BYE's acknowledgement is awaited even from a peer that said BYE too
                # (both closing at once): arriving after our sockets began to close, it
                # would stall that connection's input, and libzmq 4.3.5 aborts the process
                # when the peer then hangs up and a heartbeat fires (zeromq/libzmq#4841; a
                # node 0 died so at the rendezvous). The peer acknowledges as it reads our
                # BYE, which precedes our answer to its own.
                waiting = [
                    link for link in live if link.bye_sent and not link.acked and link.dead is None
                ]
                remaining = deadline - time.monotonic()
                if not waiting or remaining <= 0:
                    break
                self.poll(min(remaining, 0.05))
                self.inbox.clear()  # we are leaving: users' messages no longer matter
            if waiting and linger > 0:  # (at 0 the caller chose not to wait: no news)
                log.warning(
                    "ipc %s: closing without an acknowledgement from %s after %.1f s",
                    self.name,
                    ", ".join(link.name for link in waiting),
                    linger,
                )
        finally:
            self._terminate()
        return [link for link in live if not link.acked]

    def _terminate(self) -> None:
        self._closed = True
        self.unlink_socket_files()
        for link in list(self.links.values()):
            if link.sock is not None:
                self._forget_dealer(link)
        if self._router_monitor is not None:
            with contextlib.suppress(zmq.ZMQError):
                self.router.disable_monitor()
            self._router_monitor.close(linger=0)
        if self.router is not None:
            self.router.close()
        # Blocks until what we queued (acknowledgements) is out, for at most the linger,
        # and ends the ZAP thread.
        self._ctx.term()

    def close_inherited_fds(self) -> None:
        """In a forked child: close our copies of this endpoint's connections and listening
        sockets (found by address, port and peer process), without touching ZeroMQ, so a
        child that outlives its parent does not keep the parent's links open."""
        self._closed = True
        paths = {a[len("ipc://") :] for a in self._bound if a.startswith("ipc://")}
        ports = {int(a.rpartition(":")[2]) for a in self._bound if a.startswith("tcp://")}
        dialed = {link.address for link in self.links.values() if link.dialed}
        pids = {link.info.get("pid") for link in self.links.values()} - {None, os.getppid()}
        for fd in _socket_fds():
            try:
                s = socket.socket(fileno=os.dup(fd))
            except OSError:
                continue
            try:
                mine = False
                if s.family == socket.AF_UNIX:
                    name = s.getsockname()
                    mine = isinstance(name, str) and name in paths
                    if not mine:
                        cred = s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
                        mine = struct.unpack("3i", cred)[0] in pids
                elif s.family in (socket.AF_INET, socket.AF_INET6):
                    mine = s.getsockname()[1] in ports
                    if not mine:
                        with contextlib.suppress(OSError):
                            host, port = s.getpeername()[:2]
                            mine = f"tcp://{host}:{port}" in dialed
            except OSError:
                mine = False
            finally:
                s.close()
            if mine:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.links.clear()
        self._by_sock.clear()
        self._by_monitor.clear()


def _socket_fds() -> list[int]:
    out = []
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError, ValueError):
                if stat.S_ISSOCK(os.fstat(int(name)).st_mode):
                    out.append(int(name))
    return out
