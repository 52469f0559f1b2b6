"""Authenticated links between processes: the layer the tree (and client/server) is built on.

An `Endpoint` is one process's side: a ROUTER socket that listens (when given
addresses to bind) and one DEALER per link it dials. A `Link` is one
authenticated connection to one peer, usable both ways: the dialer sends on
its DEALER, the listener answers through its ROUTER. Messages are lists of
frames whose first frame is a header (see :mod:`ipc.transport.wire`).

Who gets in, in three layers:
1. ZeroMQ's handshake, checked by a ZAP handler before a single message is
   accepted: PLAIN with a password derived from the job's secret, or CURVE
   (`encrypt=True`: every byte encrypted, keys derived from the secret).
   Strangers cannot queue anything in our memory, not even a message part.
2. A challenge on every connection: the dialer's and listener's fresh nonces
   and the connection's routing id go into an HMAC of the secret, so a
   recorded handshake is worthless on any other connection, and the dialer
   learns that the listener knows the secret too.
3. Limits before parsing: ZMQ_MAXMSGSIZE on every socket, a bounded table of
   handshakes in progress, and total parsers. Receive queues are not bounded
   by a high-water mark, on purpose: only authenticated peers (members of the
   job) ever queue a message, and libzmq (4.3.5, zeromq/libzmq#3937, #4364)
   aborts the whole process when a connection whose input a full queue has
   paused is closed by its peer and a heartbeat fires before we read it.

Liveness: ZeroMQ's own heartbeats (ZMTP PING/PONG, answered by libzmq's I/O
thread whatever the Python threads are doing) close a connection whose peer
has been silent for `Liveness.timeout` seconds: a dead, frozen (SIGSTOP) or
swapped-out process. A dialer sees that on its socket monitor; a listener
learns which of its peers went by probing them with ZMQ_ROUTER_MANDATORY
(an unroutable peer is gone). A dead link is dead for good: nothing on it is
trusted again.

Leaving: `close()` says BYE on every link and waits until each peer has
acknowledged it (or is gone). A peer acknowledges a BYE when it reads it,
and it reads in order, so everything sent before the BYE has arrived: the
last message before close() is never lost, whatever the receive queues hold.

An Endpoint is not thread-safe: one thread at a time (the tree serialises
them with a lock).
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import os
import socket
import stat
import struct
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import zmq
from zmq.utils import z85
from zmq.utils.monitor import recv_monitor_message

from ..envvars import env_float
from ..errors import AuthError, IPCError, IPCTimeoutError, PeerError
from . import fdlimit, runtime, wire
from .auth import Secret, nonce
from .wire import Kind, WireError

log = logging.getLogger(__name__)

ZAP_DOMAIN = b"distlearn-ipc"
PLAIN_USER = b"distlearn"
_PROBE = bytes([Kind.PROBE])
CLOSING = "closing: it takes no more links"
_ACK = wire.control(Kind.ACK, {})
# What a dialer's monitor reports: the link's end, or a failed ZeroMQ handshake.
_DIALER_EVENTS = (
    zmq.EVENT_DISCONNECTED
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


_FORGOTTEN = 4096  # routing ids of forgotten links whose late messages are dropped quietly
MAX_AGAIN = 100  # times a dialer starts its handshake over before it gives up


def _again(header: bytes) -> bool:
    """A REFUSED that asks the dialer to start its handshake over."""
    return wire.parse_control(header).get("again") is True


@dataclass(frozen=True)
class Limits:
    """What a peer may make us hold before we have read it."""

    max_frame: int = (1 << 20) + 1024  # ZMQ_MAXMSGSIZE: the largest frame accepted
    handshakes: int = 256  # connections in the middle of a handshake, at most
    handshake_timeout: float = 30.0


@dataclass(frozen=True)
class Liveness:
    """ZMTP heartbeats: a PING every `interval` s; no traffic for `timeout` s after one
    closes the connection. `interval=0` turns them off (dead processes are still seen
    when their sockets close, frozen ones no longer)."""

    interval: float = 1.0
    timeout: float = 6.0

    @staticmethod
    def from_env() -> Liveness:
        return Liveness(
            env_float("IPC_HEARTBEAT_INTERVAL", 1.0), env_float("IPC_HEARTBEAT_TIMEOUT", 6.0)
        )

    def __post_init__(self):
        if self.interval < 0 or (self.interval and self.timeout <= self.interval):
            raise ValueError(
                f"heartbeat timeout ({self.timeout}) must exceed its interval ({self.interval})"
            )


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
        self.failure: Exception | None = None  # why a dial failed (refused, wrong secret)
        self.bye: dict | None = None  # the peer's BYE, once it said it
        self.bye_sent = False
        self.acked = False  # our BYE was acknowledged
        self.stats = LinkStats()
        self._nonce = b""
        self._hello: dict = {}
        self.again = 0  # handshakes the listener lost and we started over

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


@dataclass
class _Pending:
    """A listener's half of a handshake in progress."""

    rid: bytes
    started: float
    name: str = ""
    info: dict = field(default_factory=dict)
    dialer_nonce: bytes = b""
    our_nonce: bytes = b""


class _Zap(threading.Thread):
    """ZeroMQ's authentication hook for one context: admits a connection only when its
    PLAIN password or CURVE public key was derived from the job's secret. Runs until the
    context terminates."""

    def __init__(self, ctx: zmq.Context, check: Callable[[bytes, list[bytes], str], bool]):
        super().__init__(name="ipc-zap", daemon=True)
        self.sock = ctx.socket(zmq.REP)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind("inproc://zeromq.zap.01")
        self.check = check

    def run(self) -> None:
        try:
            while True:
                msg = self.sock.recv_multipart()
                if len(msg) < 6:
                    self.sock.send_multipart([b"1.0", b"", b"500", b"bad request", b"", b""])
                    continue
                version, request_id, _domain, address, _identity, mechanism = msg[:6]
                ok = self.check(mechanism, msg[6:], address.decode(errors="replace"))
                code, text = (b"200", b"OK") if ok else (b"400", b"wrong token")
                self.sock.send_multipart([version, request_id, code, text, b"", b""])
        except zmq.ContextTerminated:
            pass
        finally:
            self.sock.close(linger=0)


class Endpoint:
    """One process's links: listens on `bind` (if any) and dials others, all authenticated
    with `secret`. `info` is sent to every peer in the handshake. `accept(link)` decides on
    each link a peer opens to us: None admits it, a string refuses it with that reason."""

    def __init__(
        self,
        secret: Secret,
        name: str,
        *,
        bind: Sequence[str] = (),
        encrypt: bool = False,
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
        self._curve = secret.curve_keys() if encrypt else None
        self._password = secret.mac(b"plain").hex().encode()
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
        if self._curve is not None:
            router.setsockopt(zmq.CURVE_SERVER, 1)
            router.setsockopt(zmq.CURVE_SECRETKEY, self._curve.server_secret)
        else:
            router.setsockopt(zmq.PLAIN_SERVER, 1)
        self._router_monitor = router.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        for spec in bind:
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

    def _zap_check(self, mechanism: bytes, creds: list[bytes], address: str) -> bool:
        if self._curve is not None:
            ok = mechanism == b"CURVE" and len(creds) == 1
            ok = ok and creds[0] == z85.decode(self._curve.client_public)
        else:
            ok = mechanism == b"PLAIN" and len(creds) == 2 and creds[0] == PLAIN_USER
            ok = ok and hmac.compare_digest(creds[1], self._password)
        if not ok:
            want = b"CURVE" if self._curve is not None else b"PLAIN"
            hint = "" if mechanism == want else " (encrypt= must be the same on every node)"
            self._note_rate_limited(
                f"refused a connection{' from ' + address if address else ''}: its "
                f"{mechanism.decode(errors='replace')} credentials are not this job's{hint}"
            )
        return ok

    def unlink_socket_files(self) -> None:
        """Remove our Unix socket names (connected peers keep their connections)."""
        for path in self._socket_files:
            with contextlib.suppress(OSError):
                os.unlink(path)
        self._socket_files = []

    # ---- dialing -------------------------------------------------------------

    def dial(self, address: str, *, tag: object = None, reconnect: bool = True) -> Link:
        """Start an authenticated link to the endpoint at `address`; it is usable once
        `wait_up` returns. `reconnect=False` when the peer is known to listen already: a
        lost connection then stays lost, and the peer sees that."""
        rid = b"D" + os.urandom(15)  # fresh per connection; never starts with a zero byte
        sock = self._ctx.socket(zmq.DEALER)
        self._options(sock)
        sock.setsockopt(zmq.ROUTING_ID, rid)
        if not reconnect:
            sock.setsockopt(zmq.RECONNECT_IVL, -1)
        if self._curve is not None:
            sock.setsockopt(zmq.CURVE_SERVERKEY, self._curve.server_public)
            sock.setsockopt(zmq.CURVE_PUBLICKEY, self._curve.client_public)
            sock.setsockopt(zmq.CURVE_SECRETKEY, self._curve.client_secret)
        else:
            sock.setsockopt(zmq.PLAIN_USERNAME, PLAIN_USER)
            sock.setsockopt(zmq.PLAIN_PASSWORD, self._password)
        link = Link(self, address, dialed=True, rid=rid)
        link.tag = tag
        link.sock = sock
        # Without reconnecting, a refused connection ends the attempt for good: ZeroMQ
        # says CLOSED at once, and waiting out the deadline would only hide it.
        link.monitor = sock.get_monitor_socket(
            _DIALER_EVENTS if reconnect else _DIALER_EVENTS | zmq.EVENT_CLOSED
        )
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
        return link

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
                slow = [f"{link.address} ({link.state})" for link in links if link.state != "up"]
                raise IPCTimeoutError(
                    f"{self.name}: {what or 'links'} not established within the timeout: "
                    f"{', '.join(slow)}"
                )
            self.poll(min(remaining, 0.1))

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

    # ---- handshakes --------------------------------------------------------------

    def _handshake_message(self, rid: bytes, frames: list) -> None:
        """A listener's side: HELLO -> CHALLENGE, AUTH -> WELCOME or REFUSED."""
        if len(frames) != 2:
            self._drop("a message of the wrong shape from an unauthenticated peer")
            return
        header = frames[1].bytes
        try:
            kind = wire.kind_of(header)
            if kind == Kind.HELLO:
                body = wire.parse_control(
                    header,
                    {
                        "name": lambda v: isinstance(v, str) and 0 < len(v) <= 128,
                        "nonce": wire.hex_of(16),
                        "info": dict,
                    },
                )
                self._challenge(rid, body)
            elif kind == Kind.AUTH:
                body = wire.parse_control(header, {"mac": wire.hex_of(32)})
                try:
                    peer = frames[1].get("Peer-Address")
                except zmq.ZMQError:
                    peer = ""
                self._authenticate(rid, bytes.fromhex(body["mac"]), peer)
            else:
                raise WireError(f"kind {kind} before authentication")
        except WireError as err:
            self._drop(f"an unauthenticated message: {err}")

    def _challenge(self, rid: bytes, hello: dict) -> None:
        if len(self._pending) >= self.limits.handshakes:
            self._pending.popitem(last=False)  # the oldest stranger loses its place
        p = _Pending(rid, time.monotonic(), hello["name"], hello["info"])
        p.dialer_nonce = bytes.fromhex(hello["nonce"])
        p.our_nonce = nonce()
        self._pending.pop(rid, None)
        self._pending[rid] = p
        proof = self.secret.mac(b"challenge", rid, p.dialer_nonce, p.our_nonce)
        self._reply(
            rid, wire.control(Kind.CHALLENGE, {"nonce": p.our_nonce.hex(), "proof": proof.hex()})
        )

    def _authenticate(self, rid: bytes, mac: bytes, peer: str = "") -> None:
        p = self._pending.pop(rid, None)
        if p is None:
            # Its handshake lost its place (the oldest of more than `limits.handshakes`
            # at once: a burst of clients) or expired: it starts again, a dialer of
            # ours at once. The answer is unauthenticated; all it can make a dialer do
            # is try again until its deadline.
            self._reply(rid, wire.control(Kind.REFUSED, {"reason": "start again", "again": True}))
            return
        parts = (b"auth", rid, p.dialer_nonce, p.our_nonce, p.name.encode(), _canon(p.info))
        if not self.secret.check(mac, *parts):
            self._note_rate_limited(f"refused {p.name!r}: it does not know this job's secret")
            self._reply(rid, wire.control(Kind.REFUSED, {"reason": "wrong token"}))
            return
        link = Link(self, f"accepted from {peer or 'a Unix socket'}", dialed=False, rid=rid)
        link.name, link.info = p.name, p.info
        if self._closed:
            # Closing: a link taken now would get neither our BYE nor anything else before
            # its connection ends (the peer would take that for our death).
            self._reply(rid, wire.control(Kind.REFUSED, {"reason": CLOSING}))
            return
        reason = _other_version(p.info, p.name, self.name)
        if reason is None and self.accept is not None:
            reason = self.accept(link)
        if reason is not None:
            # Rate-limited: a refused peer that retries in a loop (a server out of files)
            # would flood the log; the peer itself is told why.
            self._note_rate_limited(f"refused {p.name}: {reason}")
            self._reply(rid, wire.control(Kind.REFUSED, {"reason": str(reason)}))
            return
        link.state = "up"
        self.links[rid] = link
        self._reply(rid, wire.control(Kind.WELCOME, {"info": self.info}))
        self.events.append(("accepted", link))

    def _dialer_handshake(self, link: Link, frames: list) -> None:
        """A dialer's side: CHALLENGE -> AUTH, then WELCOME (up) or REFUSED (failure)."""
        header = frames[0].bytes if frames else b""
        try:
            kind = wire.kind_of(header)
            if kind == Kind.CHALLENGE and link.state == "handshake":
                body = wire.parse_control(
                    header, {"nonce": wire.hex_of(16), "proof": wire.hex_of(32)}
                )
                theirs = bytes.fromhex(body["nonce"])
                if not self.secret.check(
                    bytes.fromhex(body["proof"]), b"challenge", link.rid, link._nonce, theirs
                ):
                    link.failure = AuthError(
                        f"{self.name}: the endpoint at {link.address} does not know this job's "
                        "secret (a different job, or someone posing as it)"
                    )
                    return
                parts = (
                    b"auth",
                    link.rid,
                    link._nonce,
                    theirs,
                    self.name.encode(),
                    _canon(self.info),
                )
                mac = self.secret.mac(*parts).hex()
                with contextlib.suppress(zmq.Again):
                    link.sock.send(wire.control(Kind.AUTH, {"mac": mac}), zmq.NOBLOCK)
                link.state = "auth"
            elif kind == Kind.WELCOME and link.state == "auth":
                link.info = wire.parse_control(header, {"info": dict})["info"]
                link.name = str(link.info.get("name", link.address))
                reason = _other_version(link.info, link.name, self.name)
                if reason is not None:
                    link.failure = AuthError(f"{self.name}: {link.address}: {reason}")
                    return
                link.state = "up"
            elif kind == Kind.REFUSED and link.state == "auth" and _again(header):
                self._hello_again(link)
            elif kind == Kind.REFUSED:
                reason = wire.parse_control(header).get("reason", "?")
                link.failure = AuthError(
                    f"{self.name}: refused by the endpoint at {link.address}: {str(reason)[:200]}"
                )
                link.failure.closing = reason == CLOSING
            else:
                raise WireError(f"kind {kind} during the handshake")
        except WireError as err:
            self._drop(f"a bad handshake message from {link.address}: {err}")

    def _hello_again(self, link: Link) -> None:
        """Start the handshake over (the listener lost ours), with a fresh nonce."""
        link.again += 1
        if link.again > MAX_AGAIN:
            link.failure = IPCError(
                f"{self.name}: the endpoint at {link.address} lost our handshake "
                f"{MAX_AGAIN} times (more connections at once than it holds)"
            )
            return
        link._nonce = nonce()
        link.state = "handshake"
        hello = {"name": self.name, "nonce": link._nonce.hex(), "info": self.info}
        with contextlib.suppress(zmq.Again):
            link.sock.send(wire.control(Kind.HELLO, hello), zmq.NOBLOCK)

    def _reply(self, rid: bytes, header: bytes) -> None:
        with contextlib.suppress(zmq.ZMQError):  # a stranger may be gone already
            self.router.send_multipart([rid, header], zmq.NOBLOCK)

    def _expire_handshakes(self, now: float) -> None:
        while self._pending:
            rid, p = next(iter(self._pending.items()))
            if now - p.started < self.limits.handshake_timeout:
                return
            del self._pending[rid]

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
                if event == zmq.EVENT_DISCONNECTED:
                    self._drain_dealer(link)  # what it sent before it went is still ours
                    self.mark_dead(link, "the connection closed")  # closes the monitor
                elif link.state == "up" or link.failure is not None:
                    continue
                elif event == zmq.EVENT_CLOSED:  # a dial without reconnecting: refused
                    link.failure = PeerError(
                        f"{self.name}: the connection to {link.address} was refused "
                        "(nothing listens there: the peer is gone or not started)"
                    )
                else:
                    why = (
                        "it refused our credentials: its secret is not ours (wrong token?)"
                        if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH
                        else "a protocol error: another encrypt= setting, or not a distlearn "
                        "endpoint"
                    )
                    link.failure = AuthError(
                        f"{self.name}: the ZeroMQ handshake with {link.address} failed: {why}"
                    )

    def _probe(self) -> None:
        for link in list(self.links.values()):
            # Not a peer that is leaving (it said BYE, or acknowledged ours): its socket may
            # be closing, and a probe landing there can abort it (see _deliver).
            if link.dialed or not link.up or link.bye is not None or link.acked:
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

    # ---- leaving -----------------------------------------------------------------

    def close(self, bye: dict | None = None, linger: float = 5.0) -> None:
        """Say BYE (with `bye` as its body) on every live link, wait up to `linger` s until
        each peer acknowledged it or is gone, then close everything."""
        if self._closed:
            return
        self._closed = True
        if os.getpid() != self._pid:
            return  # a forked child: the parent's sockets are not ours to touch
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
            if waiting:
                log.warning(
                    "ipc %s: closing without an acknowledgement from %s after %.1f s",
                    self.name,
                    ", ".join(link.name for link in waiting),
                    linger,
                )
        finally:
            self._terminate()

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


def _other_version(info: dict, peer: str, us: str) -> str | None:
    """Why `peer`, whose handshake `info` names another wire version, cannot be talked to."""
    theirs = info.get("wire")
    if theirs == wire.VERSION:
        return None
    return (f"ipc wire versions differ: {peer!r} speaks {str(theirs)[:20]}, {us!r} "
            f"{wire.VERSION} (distlearn differs between them: install one version on every "
            "host)")  # fmt: skip


def _canon(info: dict) -> bytes:
    """The bytes of `info` that a handshake MAC covers."""
    return json.dumps(info, sort_keys=True, separators=(",", ":")).encode()
