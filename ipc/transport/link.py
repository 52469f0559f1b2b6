"""Authenticated links between processes: the layer the tree (and client/server) is built on.

An `Endpoint` is one process's side: a ROUTER socket that listens (when given
addresses to bind) and one DEALER per link it dials. A `Link` is one
authenticated connection to one peer, usable both ways: the dialer sends on
its DEALER, the listener answers through its ROUTER. Messages are lists of
frames whose first frame is a header (see :mod:`ipc.transport.wire`).

An Endpoint's jobs, one module each: its handshakes (who gets in, handshakes.py),
its event loop (events.py), how it sees a peer go (liveness.py) and how it leaves
(leaving.py), as mixins of the class here, which sets it up and dials.

An Endpoint is not thread-safe: one thread at a time (the tree serialises
them with a lock).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import zmq

from ..errors import IPCError, IPCTimeoutError
from . import fdlimit, runtime, wire
from .auth import Secret, nonce
from .events import EventLoopMixin
from .handshakes import PLAIN_USER, ZAP_DOMAIN, HandshakeMixin, _Pending, _Zap
from .leaving import LeavingMixin
from .liveness import Liveness, LivenessMixin
from .wire import Kind

__all__ = ["Endpoint", "Limits", "Link", "LinkStats"]

log = logging.getLogger(__name__)

REDIAL_S = 0.1  # a dial not yet up waits this long before it dials again (as ZeroMQ did)
_NO_RECONNECT_MS = 24 * 3600 * 1000  # ZeroMQ's reconnect interval: never, in effect
_warned: set[str] = set()


def _warn_cleartext(name: str) -> None:
    if name not in _warned:
        _warned.add(name)
        log.warning(
            "ipc %s: encrypt=False: links over TCP are neither encrypted nor integrity-"
            "protected, and the job's password crosses the wire in the clear (whoever sees "
            "it can queue messages in any node's memory). For a network you trust only.",
            name,
        )


# What a dialer's monitor reports: the link's end, a refused connection (a retry
# scheduled), or a failed ZeroMQ handshake.
_DIALER_EVENTS = (
    zmq.EVENT_DISCONNECTED
    | zmq.EVENT_CONNECT_RETRIED
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


@dataclass(frozen=True)
class Limits:
    """What a peer may make us hold before we have read it."""

    max_frame: int = (1 << 20) + 1024  # ZMQ_MAXMSGSIZE: the largest frame accepted
    handshakes: int = 256  # connections in the middle of a handshake, at most
    # ZMQ_HANDSHAKE_IVL, and how long our own handshake may take: a connection that has
    # not finished within it is closed (an idle one holds a file until then).
    handshake_timeout: float = 10.0


@dataclass
class LinkStats:
    """Traffic on one link, as seen from this end."""

    bytes_sent: int = 0
    bytes_recv: int = 0
    msgs_sent: int = 0
    msgs_recv: int = 0


class Link:
    """One authenticated connection to one peer.

    `name` and `info` are what the peer said in its handshake (authenticated);
    `tag` is the owner's label for the peer (a node index), used in errors.
    States: handshake -> up -> (dead | closed). `dead` holds the reason."""

    def __init__(self, endpoint: Endpoint, address: str, dialed: bool, rid: bytes):
        self.endpoint = endpoint
        self.address = address
        self.dialed = dialed
        self.rid = rid
        self.sock: zmq.Socket | None = None  # the DEALER, for a dialed link
        self.monitor: zmq.Socket | None = None
        self.name = "?"
        self.info: dict = {}
        self.tag: object = None
        self.state = "handshake"
        self.dead: str | None = None
        self.conn = ""  # an accepted link's connection (see handshakes.connection_of)
        self.retry = False  # a dialed link that is dialed again until it is up
        self.redial_at = 0.0  # when, once its connection ended before it was up
        self.failure: Exception | None = None  # why a dial failed (refused, wrong secret)
        self.last_error: Exception | None = None  # why the last try of a retried dial failed
        self.bye: dict | None = None  # the peer's BYE, once it said it
        self.bye_sent = False
        self.acked = False  # our BYE was acknowledged
        self.stats = LinkStats()
        self._nonce = b""
        self._hello: dict = {}
        self.again = 0  # handshakes the listener lost and we started over
        self.hello_at = 0.0  # ... and when this one says HELLO again (state "again")

    def __repr__(self) -> str:
        return f"Link({self.name!r}, {self.address}, {self.state}{', dead' if self.dead else ''})"

    @property
    def up(self) -> bool:
        return self.state == "up" and self.dead is None

    def send(self, header: bytes, payload=None, *, copy: bool = True, track: bool = False):
        """Send one message: a header and optionally one payload frame (bytes, a buffer or a
        zmq.Frame). With `copy=False` the payload is sent from its own memory; `track`
        returns a MessageTracker that says when that memory may change again."""
        if self.dead is not None or self.bye is not None:
            raise self.endpoint.dead_error(self)
        size = len(header)
        # Never block: our send queues are unbounded (SNDHWM 0), so a send that would
        # block means the connection is gone (a DEALER without a pipe blocks forever).
        try:
            if self.sock is not None:
                sock = self.sock
            else:
                sock = self.endpoint.router
                sock.send(self.rid, zmq.SNDMORE | zmq.NOBLOCK)
            if payload is None:
                sock.send(header, zmq.NOBLOCK)
                tracker = None
            else:
                sock.send(header, zmq.SNDMORE | zmq.NOBLOCK)
                tracker = sock.send(payload, zmq.NOBLOCK, copy=copy, track=track)
                size += len(payload.buffer) if isinstance(payload, zmq.Frame) else len(payload)
        except zmq.ZMQError as err:
            raise self._send_error(err) from None
        self.stats.msgs_sent += 1
        self.stats.bytes_sent += size
        return tracker

    def _send_error(self, err: zmq.ZMQError) -> Exception:
        """What a failed send raises: an unroutable or full peer is gone (the link dies)."""
        if err.errno in (zmq.EHOSTUNREACH, zmq.EAGAIN):
            self.endpoint.mark_dead(self, "its connection is gone")
            return self.endpoint.dead_error(self)
        return err

    def send_control(self, kind: Kind, body: dict) -> None:
        self.send(wire.control(kind, body))

    def send_frames(self, frames: list, *, copy: bool = False) -> None:
        """Send one message of several frames (a header first, see :mod:`ipc.transport.wire`), e.g.
        `link.send_frames(wire.pack_value(obj))`; with `copy=False` (the default) large
        buffers go from their own memory, which must not change until sent."""
        if self.dead is not None or self.bye is not None:
            raise self.endpoint.dead_error(self)
        sock = self.sock if self.sock is not None else self.endpoint.router
        parts = frames if self.sock is not None else [self.rid, *frames]
        try:
            for i, f in enumerate(parts):
                last = i == len(parts) - 1
                sock.send(
                    f, zmq.NOBLOCK | (0 if last else zmq.SNDMORE), copy=copy or len(f) < 65536
                )
        except zmq.ZMQError as err:
            raise self._send_error(err) from None
        self.stats.msgs_sent += 1
        self.stats.bytes_sent += sum(len(f) for f in frames)


class Endpoint(EventLoopMixin, HandshakeMixin, LivenessMixin, LeavingMixin):
    """One process's links: listens on `bind` (if any) and dials others, all authenticated
    with `secret`. `info` is sent to every peer in the handshake. `accept(link)` decides on
    each link a peer opens to us: None admits it, a string refuses it with that reason.

    `encrypt`: None (the default) encrypts and authenticates every message on TCP
    (CURVE) and leaves Unix sockets to this user's processes (PLAIN, peer uid checked);
    True encrypts Unix sockets too; False sends TCP in the clear too (PLAIN, for a trusted
    network only: the password crosses the wire). See handshakes.py."""

    def __init__(
        self,
        secret: Secret,
        name: str,
        *,
        bind: Sequence[str] = (),
        encrypt: bool | None = None,
        limits: Limits = Limits(),
        liveness: Liveness | None = None,
        info: dict | None = None,
        accept: Callable[[Link], str | None] | None = None,
    ):
        self.secret = secret
        self.name = name
        self.encrypt = encrypt
        self.limits = limits
        self.liveness = liveness if liveness is not None else Liveness.from_env()
        self.info = {**(info or {}), "wire": wire.VERSION}
        self.accept = accept
        self._pid = os.getpid()
        self._ctx = zmq.Context()  # ours alone: terminating it flushes exactly our sockets
        if encrypt not in (None, True, False):
            raise ValueError(f"encrypt must be None, True or False, not {encrypt!r}")
        self._curve = secret.curve_keys()
        self._password = secret.password()
        self._poller = zmq.Poller()
        self._watched: set[int] = set()
        self.router: zmq.Socket | None = None
        self._router_monitor: zmq.Socket | None = None
        self.addresses: list[str] = []
        self._bound: list[str] = []  # what we listen on, kept after the names are unlinked
        self._socket_files: list[str] = []
        self._zap: _Zap | None = None
        self.links: dict[bytes, Link] = {}  # every link by routing id, dialed or accepted
        self._forgotten: dict[bytes, None] = {}  # routing ids of the last links forgotten
        self._by_sock: dict[zmq.Socket, Link] = {}
        self._by_monitor: dict[zmq.Socket, Link] = {}
        self._pending: OrderedDict[bytes, _Pending] = OrderedDict()
        self.inbox: deque[tuple[Link, list]] = deque()  # users' messages, in arrival order
        self.events: deque[tuple[str, Link]] = deque()  # ("accepted" | "dead" | "bye", link)
        self._probe_until = 0.0  # probe accepted links on every poll until then
        self._next_probe = 0.0
        self._redials: list[Link] = []  # dialed links waiting to be dialed again
        self._hellos: list[Link] = []  # links waiting to start their handshake over
        self._dropped = 0
        self._dropped_logged = -1e9
        self._unlogged = 0
        self._closed = False
        try:
            if bind:
                self._listen(bind)
        except BaseException:
            self._terminate()
            raise

    # ---- set-up ------------------------------------------------------------

    def _options(self, sock: zmq.Socket) -> None:
        sock.setsockopt(zmq.LINGER, 1000)  # flushes acknowledgements; close() waits for its own
        sock.setsockopt(zmq.SNDHWM, 0)  # our own data: never dropped, never blocks a send
        # No receive high-water mark: with one, a peer that leaves while our queue is
        # full makes libzmq's next heartbeat abort this process (see the docstring).
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self.limits.max_frame)
        sock.setsockopt(zmq.HANDSHAKE_IVL, max(1, int(self.limits.handshake_timeout * 1000)))
        if self.liveness.interval > 0:
            sock.setsockopt(zmq.HEARTBEAT_IVL, int(self.liveness.interval * 1000))
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(self.liveness.timeout * 1000))

    def _listen(self, bind: Sequence[str]) -> None:
        self._zap = _Zap(self._ctx, self._zap_check)
        self._zap.start()
        router = self.router = self._ctx.socket(zmq.ROUTER)
        self._options(router)
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an unroutable peer raises: it is gone
        router.setsockopt(zmq.BACKLOG, fdlimit.backlog())  # a burst of clients waits
        router.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
        self._router_monitor = router.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        for spec in bind:
            # A listener takes the socket's options as they are when it binds: each
            # address gets its own mechanism (CURVE on TCP, see curve_for).
            if self.curve_for("ipc://" if spec == "ipc" else spec):
                router.setsockopt(zmq.CURVE_SERVER, 1)
                router.setsockopt(zmq.CURVE_SECRETKEY, self._curve.server_secret)
            else:
                router.setsockopt(zmq.PLAIN_SERVER, 1)
            try:
                self._bind_one(router, spec)
            except zmq.ZMQError as err:
                why = "in use" if err.errno == zmq.EADDRINUSE else str(err)
                raise IPCError(f"{self.name}: cannot listen on {spec}: {why}") from None
        self._bound = list(self.addresses)
        self._poller.register(router, zmq.POLLIN)
        self._poller.register(self._router_monitor, zmq.POLLIN)

    def _bind_one(self, router: zmq.Socket, spec: str) -> None:
        if spec == "ipc":
            path = runtime.socket_path("l")
            router.bind(f"ipc://{path}")
            self._socket_files.append(path)
            self.addresses.append(f"ipc://{path}")
        elif spec.startswith("tcp://"):
            host, _, port = spec[len("tcp://") :].rpartition(":")
            if port in ("", "0", "*"):
                port = str(router.bind_to_random_port(f"tcp://{host}"))
            else:
                router.bind(spec)
            self.addresses.append(f"tcp://{host}:{port}")
        elif spec.startswith("ipc://"):
            router.bind(spec)
            self._socket_files.append(spec[len("ipc://") :])
            self.addresses.append(spec)
        else:
            raise ValueError(
                f"cannot listen on {spec!r}: want 'ipc', ipc://PATH or tcp://HOST:PORT"
            )

    def curve_for(self, address: str) -> bool:
        """Whether links at `address` speak CURVE (encrypted and authenticated messages):
        over TCP unless encrypt=False, on Unix sockets only with encrypt=True."""
        if self.encrypt is None:
            return not address.startswith("ipc://")
        if not self.encrypt and address.startswith("tcp://"):
            _warn_cleartext(self.name)
        return self.encrypt

    def unlink_socket_files(self) -> None:
        """Remove our Unix socket names (connected peers keep their connections)."""
        for path in self._socket_files:
            with contextlib.suppress(OSError):
                os.unlink(path)
        self._socket_files = []

    # ---- dialing -------------------------------------------------------------

    def _new_link(self, address: str, dialed: bool, rid: bytes) -> Link:
        """A link of ours, in its handshake: one `dial` starts, or one a peer opens to us
        (made here for the handshakes, whose module this one imports)."""
        return Link(self, address, dialed=dialed, rid=rid)

    def dial(self, address: str, *, tag: object = None, reconnect: bool = True) -> Link:
        """Start an authenticated link to the endpoint at `address`; it is usable once
        `wait_up` returns. `reconnect=True`: until the link is up, a connection that is
        refused or ends is dialed again (the peer may not listen yet). Once up, a lost
        connection ends the link either way, and the peer sees that: nothing that answers
        at the address later is taken for the same peer."""
        link = self._new_link(address, dialed=True, rid=b"")
        link.tag = tag
        link.retry = reconnect
        self._open_dealer(link)
        return link

    def _open_dealer(self, link: Link) -> None:
        """Give a dialed link a fresh DEALER (and routing id) and say HELLO on it."""
        address = link.address
        rid = b"D" + os.urandom(15)  # fresh per connection; never starts with a zero byte
        sock = self._ctx.socket(zmq.DEALER)
        self._options(sock)
        sock.setsockopt(zmq.ROUTING_ID, rid)
        # Never reconnected by ZeroMQ: a second connection on this socket would be
        # taken for the peer that did the handshake on the first. Not by turning
        # reconnecting off (-1): libzmq 4.3.5 then drops what the peer sent just
        # before it hung up (an ACK, one close of both ends in 60), but by an interval
        # long past our closing the socket when its connection ends (see liveness.py).
        sock.setsockopt(zmq.RECONNECT_IVL, _NO_RECONNECT_MS)
        if self.curve_for(address):
            sock.setsockopt(zmq.CURVE_SERVERKEY, self._curve.server_public)
            sock.setsockopt(zmq.CURVE_PUBLICKEY, self._curve.client_public)
            sock.setsockopt(zmq.CURVE_SECRETKEY, self._curve.client_secret)
        else:
            sock.setsockopt(zmq.PLAIN_USERNAME, PLAIN_USER)
            sock.setsockopt(zmq.PLAIN_PASSWORD, self._password)
        link.rid = rid
        link.sock = sock
        link.state = "handshake"
        # A refused connection ends the attempt: ZeroMQ says CONNECT_RETRIED at once
        # (then either dialed again, or the dial's failure).
        link.monitor = sock.get_monitor_socket(_DIALER_EVENTS)
        # Ours before anything can fail, so close() closes it (a context with a socket
        # left open never terminates).
        self.links[rid] = link
        self._by_sock[sock] = link
        self._by_monitor[link.monitor] = link
        self._poller.register(sock, zmq.POLLIN)
        self._poller.register(link.monitor, zmq.POLLIN)
        sock.connect(address)
        link._nonce = nonce()
        hello = {"name": self.name, "nonce": link._nonce.hex(), "info": self.info}
        # Again: the connection has already ended (on a busy host the listener can refuse
        # our credentials before this line runs): the monitor says why, wait_up raises.
        with contextlib.suppress(zmq.Again):
            sock.send(wire.control(Kind.HELLO, hello), zmq.NOBLOCK)

    def _dial_again(self, link: Link) -> None:
        """A link not yet up whose connection was refused or ended: close its socket and
        dial again REDIAL_S later, on a fresh socket (`_redial_due`)."""
        self.links.pop(link.rid, None)
        self._forget_dealer(link)
        link.redial_at = time.monotonic() + REDIAL_S
        self._redials.append(link)

    def _redial_due(self) -> None:
        now = time.monotonic()
        for link in [link for link in self._redials if link.redial_at <= now]:
            self._redials.remove(link)
            if link.failure is None and link.dead is None and not self._closed:
                self._open_dealer(link)

    def wait_up(self, links: Iterable[Link], deadline: float, what: str = "") -> None:
        """Service the endpoint until every link in `links` is up; raise AuthError if one
        was refused, PeerError if one died, IPCTimeoutError at the deadline."""
        links = list(links)
        while True:
            for link in links:
                if link.failure is not None:
                    raise link.failure
                if link.dead is not None:
                    raise self.dead_error(link)
            if all(link.state == "up" for link in links):
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                slow = [
                    f"{link.address} ({link.state}"
                    + (f"; the last try: {link.last_error}" if link.last_error else "")
                    + ")"
                    for link in links
                    if link.state != "up"
                ]
                raise IPCTimeoutError(
                    f"{self.name}: {what or 'links'} not established within the timeout: "
                    f"{', '.join(slow)}"
                )
            self.poll(min(remaining, 0.1))

    # ---- strangers -----------------------------------------------------------------

    def _drop(self, what: str) -> None:
        self._dropped += 1
        self._note_rate_limited(f"dropped {what}")

    def _note_rate_limited(self, what: str) -> None:
        now = time.monotonic()
        if now - self._dropped_logged > 10:  # a stranger, or a peer retrying, could flood us
            more = f" (and {self._unlogged} more since the last report)" if self._unlogged else ""
            self._dropped_logged = now
            self._unlogged = 0
            log.warning("ipc %s: %s%s", self.name, what, more)
        else:
            self._unlogged += 1
