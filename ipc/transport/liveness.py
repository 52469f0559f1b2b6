"""How an `Endpoint` sees a peer go: heartbeats, monitors and probes.

ZeroMQ's own heartbeats (ZMTP PING/PONG, answered by libzmq's I/O thread whatever
the Python threads are doing) close a connection whose peer has been silent for
`Liveness.timeout` seconds: a dead, frozen (SIGSTOP) or swapped-out process. A
dialer sees that on its socket monitor; a listener learns which of its peers went
by probing them with ZMQ_ROUTER_MANDATORY (an unroutable peer is gone). A dead
link is dead for good: nothing on it is trusted again.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import zmq
from zmq.utils.monitor import recv_monitor_message

from distlearn.common.envvars import env_float

from ..errors import AuthError, PeerError
from .wire import Kind

if TYPE_CHECKING:  # (link.py imports this module)
    from .link import Link

__all__ = ["Liveness", "LivenessMixin"]

_PROBE = bytes([Kind.PROBE])
_FORGOTTEN = 4096  # routing ids of forgotten links whose late messages are dropped quietly


@dataclass(frozen=True)
class Liveness:
    """ZMTP heartbeats: how soon a dead or frozen peer is named.

    Args:
        interval: Seconds between PINGs; 0 turns heartbeats off (dead processes are
            still seen when their sockets close, frozen ones no longer).
        timeout: Seconds without traffic after a PING that close the connection.

    Raises:
        ValueError: `timeout` does not exceed `interval`.
    """

    interval: float = 1.0
    timeout: float = 6.0

    @staticmethod
    def from_env() -> Liveness:
        """The heartbeat of $IPC_HEARTBEAT_INTERVAL and $IPC_HEARTBEAT_TIMEOUT (1 s, 6 s).

        Returns:
            The Liveness.

        Raises:
            ValueError: A value that is not a finite number, naming the variable.
        """
        return Liveness(
            env_float("IPC_HEARTBEAT_INTERVAL", 1.0, low=0),
            env_float("IPC_HEARTBEAT_TIMEOUT", 6.0, low=0),
        )

    def __post_init__(self):
        if self.interval < 0 or (self.interval and self.timeout <= self.interval):
            raise ValueError(
                f"heartbeat timeout ({self.timeout}) must exceed its interval ({self.interval})"
            )


class LivenessMixin:
    """`Endpoint`'s liveness. It reads the endpoint's monitors (`_router_monitor`,
    `_by_monitor`), `links`, `liveness`, `name` and `router`; it sets `_probe_until`,
    marks links dead (`dead`, and ("dead", link) in `events`), sets a dialed link's
    `failure` when its ZeroMQ handshake fails, remembers forgotten links in
    `_forgotten`, and closes a dead dialer's socket and monitor (`_by_sock`,
    `_by_monitor`, `_poller`). What a dying dialer sent is read first
    (`_drain_dealer`)."""

    # ---- liveness --------------------------------------------------------------

    def _check_monitors(self) -> None:
        if self._router_monitor is not None:
            while self._router_monitor.poll(0):
                recv_monitor_message(self._router_monitor, zmq.NOBLOCK)
                # Some connection to our ROUTER ended: find out whose over the next second.
                self._probe_until = time.monotonic() + 1.0
        for monitor, link in list(self._by_monitor.items()):
            while not monitor.closed and monitor.poll(0):
                event = recv_monitor_message(monitor, zmq.NOBLOCK)["event"]
                retry = link.retry and link.state != "up" and link.failure is None
                if event in (zmq.EVENT_DISCONNECTED, zmq.EVENT_CONNECT_RETRIED) and retry:
                    # Refused, or ended before it was up (a listener not ready, one that
                    # was closing, a handshake past its time): dial again, afresh.
                    self._dial_again(link)  # closes the monitor
                elif event == zmq.EVENT_DISCONNECTED:
                    self._drain_dealer(link)  # what it sent before it went is still ours
                    self.mark_dead(link, "the connection closed")  # closes the monitor
                elif link.state == "up" or link.failure is not None:
                    continue
                elif event == zmq.EVENT_CONNECT_RETRIED:  # refused (nothing listens)
                    link.failure = PeerError(
                        f"{self.name}: the connection to {link.address} was refused "
                        "(nothing listens there: the peer is gone or not started)"
                    )
                else:
                    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                        why = "it refused our credentials: its secret is not ours (wrong token?)"
                    elif self.curve_for(link.address):
                        # A CURVE listener without our secret cannot answer our HELLO: it
                        # can only hang up (or, past the handshake timeout, we do).
                        why = (
                            "it did not answer our encrypted HELLO: its secret is not ours "
                            "(wrong token?), another encrypt= setting, or not a distlearn "
                            "endpoint"
                        )
                    else:
                        why = "a protocol error: another encrypt= setting, or not a distlearn "
                        why += "endpoint"
                    error = AuthError(
                        f"{self.name}: the ZeroMQ handshake with {link.address} failed: {why}"
                    )
                    if retry and event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
                        # Hung up on, or no answer in time: a listener without our secret,
                        # or one too busy (out of files, our connection waiting in its
                        # backlog) to answer yet. Dialed again; the reason is kept for the
                        # dialer's messages (`last_error`).
                        link.last_error = error
                        self._dial_again(link)
                    else:
                        link.failure = error

    def _probe(self) -> None:
        for link in list(self.links.values()):
            # Not a peer that is leaving (it said BYE, or acknowledged ours) nor one we said
            # BYE to (after it, a peer takes nothing but ACKs from us): its socket may be
            # closing, and a probe landing there can abort it (see _deliver).
            if link.dialed or not link.up or link.bye is not None or link.bye_sent or link.acked:
                continue
            try:
                self.router.send_multipart([link.rid, _PROBE], zmq.NOBLOCK)
            except zmq.Again:
                pass  # its queue is full: alive but slow
            except zmq.ZMQError as err:
                if err.errno == zmq.EHOSTUNREACH:
                    self.mark_dead(link, "the connection closed")

    def mark_dead(self, link: Link, reason: str) -> None:
        if link.dead is not None:
            return
        link.dead = reason
        if link.sock is not None:
            # Stop it reconnecting: the peer must see this link end too.
            self._forget_dealer(link)
        self.events.append(("dead", link))

    def forget(self, link: Link) -> None:
        """Drop an accepted link that has ended (BYE, or dead) once its owner is done with
        it: a long-lived listener would otherwise keep every link it ever took, and walk
        them all on every heartbeat. A later message on its routing id is a stranger's."""
        if link.dialed or (link.dead is None and link.bye is None):
            raise ValueError(f"{self.name}: forget() takes an accepted link that has ended")
        if self.links.get(link.rid) is link:
            del self.links[link.rid]
            # What it still sends (the ACK of our BYE) is dropped quietly: a dialer picks
            # a random routing id for each connection (`dial`), so only that peer has it.
            self._forgotten[link.rid] = None
            if len(self._forgotten) > _FORGOTTEN:
                del self._forgotten[next(iter(self._forgotten))]

    def dead_error(self, link: Link) -> PeerError:
        detail = (
            "it said goodbye"
            if link.bye is not None
            else f"{link.dead}: the process died, or was frozen for more than "
            f"{self.liveness.timeout:g} s"
        )
        return PeerError(f"{self.name}: lost the link to {link.name} ({detail})", node=link.tag)

    def _forget_dealer(self, link: Link) -> None:
        sock, monitor = link.sock, link.monitor
        link.sock = link.monitor = None
        self._by_sock.pop(sock, None)
        self._by_monitor.pop(monitor, None)
        with contextlib.suppress(KeyError, zmq.ZMQError):
            self._poller.unregister(sock)
            self._poller.unregister(monitor)
        with contextlib.suppress(zmq.ZMQError):
            sock.disable_monitor()
        monitor.close(linger=0)
        sock.close(linger=0)
