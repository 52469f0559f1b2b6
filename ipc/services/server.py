"""Client/server on the authenticated link layer: torch-ipc's `ipc.server` / `ipc.client`.

    server = ipc.Server("127.0.0.1", port=0)          # token=, $IPC_TOKEN, or (loopback) none
    client = ipc.Client("127.0.0.1", server.port)     # in another process
    for conn in server.clients(2): conn.send(obj)     # Connection objects, in arrival order
    obj, conn = server.recv_any()                     # the next message from any client

Values are those of :mod:`ipc.transport.wire`: tensors (any allowed dtype; CUDA ones are
staged through the host), nested lists/tuples/dicts, str, int, float, bool,
None and bytes. A message is a JSON header and raw tensor bytes; nothing
received is unpickled. `recv(into=...)` writes received tensors into yours.

The secret: `token=`, then $IPC_TOKEN / $IPC_TOKEN_FILE. A server on a loopback
address without one makes a random secret and leaves it in this user's private
runtime directory (0700) under its port, where a client of the same user on
the same host finds it: nothing is derived from public values. Over TCP every
message is encrypted and authenticated (CURVE, keys derived from the secret:
see ipc.transport.handshakes). Strangers are refused by ZeroMQ's handshake
before they can queue a byte, and every frame is capped (`Limits.max_frame`)
before it is read; large tensors travel in frames of at most 1 MiB, or,
between processes of one host, through shared memory
(:mod:`ipc.services.bulk`: a header on the link, the bytes in the sender's arena).

A client of the same user on the same host sends and receives on a direct Unix
stream socket bound to its authenticated link by a one-time nonce (:mod:`ipc.services.direct`):
a round trip is two plain socket writes, without ZeroMQ's I/O threads. Everything
runs in the caller's thread; ZeroMQ's own I/O thread answers heartbeats meanwhile,
so a dead or frozen peer is noticed while you compute. A dead client is named by
`PeerError` once its last message has been read; `broadcast` skips it.
Not thread-safe: use a Server or a Client from one thread at a time.

Here: `Server` and its `Connection`s; `Client` is in client.py, what both share in
common.py, and the server's direct sockets in server_direct.py.
"""

from __future__ import annotations

import json
import logging
import os
import select
import time
from collections import deque

import zmq

from distlearn.common.keywords import checked
from distlearn.common.net import is_loopback

from ..errors import IPCError, PeerError
from ..procs import start_ticks
from ..transport import (
    Endpoint,
    Limits,
    Link,
    Liveness,
    fdlimit,
    given_secret,
    missing_secret_error,
    random_secret,
    runtime,
    wire,
)
from . import bulk, direct, direct_setup
from .common import (
    _TRAFFIC,
    _check_timeout,
    _deadline,
    _local_name,
    _traffic,
    recv_value,
)
from .server_direct import DirectSocketsMixin

__all__ = ["Connection", "Server"]

log = logging.getLogger(__name__)


class Connection:
    """The server's side of one client.

    Attributes:
        name: What the client called itself (its handshake is authenticated).
        index: Numbers connections in arrival order.
        alive: The client is connected and has not said goodbye.
    """

    def __init__(self, server: Server, link: Link, index: int):
        self._server = server
        self.link = link
        self.index = index
        link.tag = index
        self.direct: direct.Direct | None = None  # the same-host socket, once bound
        self.said_bye = False  # on the direct socket

    @property
    def name(self) -> str:
        return self.link.name

    @property
    def alive(self) -> bool:
        return self.link.dead is None and self.link.bye is None and not self.said_bye

    def __repr__(self) -> str:
        closed = self.link.bye is not None or self.said_bye
        state = "alive" if self.alive else "closed" if closed else "dead"
        return f"Connection({self.index}, {self.name!r}, {state})"

    def send(self, obj: object) -> None:
        """Send `obj` to this client.

        Args:
            obj: A tensor, or a nested list/tuple/dict of tensors, str, int, float,
                bool, None and bytes.

        Raises:
            PeerError: The client is gone.
            IPCError: The server is closed.
        """
        self._server._check_open()
        if self.link.bye is not None or self.said_bye:
            raise PeerError(f"ipc server: {self.name} has closed its connection", self.index)
        if self.direct is not None:
            self._server._send_direct(self, obj)
        else:
            self._server._bulk.send(self.link, obj)

    def recv(self, into: object = None, timeout: float | None = None) -> object:
        """The next message from this client.

        Args:
            into: Tensors (in the message's structure) to receive into, same shapes and
                dtypes; None allocates.
            timeout: Seconds to wait; None: without end.

        Returns:
            The value.

        Raises:
            PeerError: The client is gone and its messages are read.
            IPCTimeoutError: Nothing came within `timeout`.
        """
        _check_timeout(timeout, "Connection.recv")
        frames = self._server._next_from(self, _deadline(timeout))
        return recv_value(self._server._bulk, self.link, frames, into)

    def close(self) -> None:
        """Drop this client (it sees its link end)."""
        self._server._drop(self)


class Server(DirectSocketsMixin):
    """Listens on `host:port` for clients that know the secret. See the module docstring.

    Used from one thread. On a loopback address without a secret it makes a random one
    and leaves it, with a Unix socket's path, in a private file of the runtime
    directory for clients of this user on this host.

    Args:
        host: The address to bind.
        port: The port; 0 for a free one (then in `.port`).
        token: The secret (else $IPC_TOKEN or $IPC_TOKEN_FILE).
        token_file: A private file holding the secret.
        encrypt: None (the default): CURVE (encrypted, authenticated) over TCP, the
            Unix socket of same-host clients checked by uid; True: CURVE on both;
            False: TCP in the clear, for a trusted network (warned).
        liveness: How soon a dead or frozen client is named (`ipc.Liveness`).
        max_frame: The largest frame a client may send; larger ones are refused
            before they are read.
        name: What the server calls itself.

    Attributes:
        port: The bound port.
        address: The bound address.

    Raises:
        TypeError: A misspelt option, naming the closest.
        ValueError: A port out of range.
        IPCError: An address beyond loopback without a secret, saying how to set one.
    """

    @checked
    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        *,
        token_file: str | None = None,
        encrypt: bool | None = None,
        liveness: Liveness | None = None,
        max_frame: int = (1 << 20) + 1024,
        name: str = "ipc server",
    ):
        if not isinstance(port, int) or not 0 <= port < 65536:
            raise ValueError(f"Server: port must be an int in [0, 65536), not {port!r}")
        secret = given_secret(token, token_file)
        if secret is None:
            if not is_loopback(host):
                raise missing_secret_error(f"Server({host!r}) listens beyond this host")
            secret = random_secret()
        self.host = host
        local = is_loopback(host)
        fdlimit.raise_limit()  # each client takes files; see ipc.transport.fdlimit
        self._bulk = bulk.Bulk()  # large tensors to clients on this host: shared memory
        self._endpoint = Endpoint(
            secret,
            name,
            # On loopback, also a Unix socket in the private runtime directory: clients of
            # this user on this host take it (faster than TCP for large tensors).
            bind=[f"tcp://{host}:{port or '*'}", *(["ipc"] if local else [])],
            encrypt=encrypt,
            limits=Limits(max_frame=max_frame),
            liveness=liveness,
            info={"name": name, "pid": os.getpid(), **self._bulk.info()},
            # Out of files, libzmq would abort this process: a client past the budget
            # is refused with the reason instead.
            accept=lambda link: fdlimit.full_reason(),
        )
        self.address = self._endpoint.addresses[0]
        self.port = int(self.address.rpartition(":")[2])
        self._max_frame = max_frame
        self._local_file: str | None = None
        # Same-host clients get a direct socket (ipc.services.direct), watched through one epoll.
        self._listener: direct_setup.Listener | None = None
        self._epoll: select.epoll | None = None
        self._by_fd: dict[int, Connection] = {}
        self._reading: Connection | None = None  # its socket is read by the caller
        self._serviced = 0.0  # when the endpoint was last looked after
        if local and direct.enabled() and not encrypt:
            try:
                self._listener = direct_setup.Listener(secret)
                self._epoll = select.epoll()
                self._epoll.register(self._listener.fileno(), select.EPOLLIN)
                self._listener.on_change = self._watch_waiting
                self._endpoint.watch(self._epoll.fileno())
            except BaseException:
                if self._listener is not None:
                    self._listener.close()
                if self._epoll is not None:
                    self._epoll.close()
                self._endpoint.close(linger=0)
                raise
        if local:
            # Only this user can read it. The port is ours now, so a file left under that
            # name by a server that died is stale.
            record = {
                "unix": self._endpoint.addresses[1],
                "pid": os.getpid(),
                "start": start_ticks(),
            }
            if self._listener is not None:
                record["direct"] = self._listener.path
            if secret.origin.startswith("random"):
                record["token"] = secret.text
            self._local_file = _local_name(host, self.port)
            runtime.remove(runtime.runtime_dir(), self._local_file)
            runtime.create_private(
                runtime.runtime_dir(), self._local_file, json.dumps(record).encode()
            )
        self._conns: list[Connection] = []  # connected, or gone and not yet settled
        self._accepted = 0  # connections ever: the next one's index
        self._past = dict.fromkeys(_TRAFFIC, 0)  # traffic of the settled ones (net_stats)
        self._by_link: dict[int, Connection] = {}
        self._pending: deque[tuple[Connection, list]] = deque()  # arrival order
        self._reported: set[int] = set()  # dead connections whose PeerError was raised
        # Dead connections let go of before their death was reported: what recv_any
        # raises for them (a small record each, not the connection).
        self._unreported: dict[int, PeerError] = {}
        self._ended: list[Connection] = []  # gone, not yet settled (_settle)
        self._closed = False
        self._pid = os.getpid()

    def __repr__(self) -> str:
        return f"Server({self.address}, {len(self.connections())} clients)"

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- the event loop --------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise IPCError("ipc server: closed")
        if os.getpid() != self._pid:
            raise IPCError("ipc server: a forked child cannot use its parent's server")

    def _service(self, timeout: float) -> None:
        ep = self._endpoint
        self._serviced = time.monotonic()
        ep.poll(timeout)
        while ep.events:
            kind, link = ep.events.popleft()
            if kind == "accepted":
                conn = Connection(self, link, self._accepted)
                self._accepted += 1
                self._conns.append(conn)
                self._by_link[id(link)] = conn
                self._bulk.up(link)
                self._bind_direct(conn)
            elif kind in ("dead", "bye") and id(link) in self._by_link:
                if kind == "dead":
                    log.info("ipc server: %s is gone (%s)", link.name, link.dead)
                conn = self._by_link[id(link)]
                if conn not in self._ended:
                    self._ended.append(conn)
        while ep.inbox:
            link, frames = ep.inbox.popleft()
            if self._bulk.control(link, frames):
                continue
            conn = self._by_link.get(id(link))
            if conn is not None:
                self._pending.append((conn, frames))
        if self._ended:
            self._settle()
        if self._epoll is not None:
            for fd, _ in self._epoll.poll(0):
                conn = self._by_fd.get(fd)
                if conn is None:
                    self._listener.poll()  # a new socket, or one showing its nonce
                elif conn is not self._reading:
                    self._drain_direct(conn)

    def _settle(self) -> None:
        """Let go of clients that are gone, once their last messages are read, here and on
        their direct sockets (their large payloads lie in their arena). Each arena's
        mapping holds a file: kept, they ran the server out of files after as many
        clients as its limit; and each connection kept its buffers and was walked by
        every recv_any and heartbeat (1,000 clients come and gone: 268 MB more, round
        trips 1.7x as long). A death not reported yet stays as the error to report."""
        unread = {id(conn) for conn, _ in self._pending}
        for conn in [
            c
            for c in self._ended
            if id(c) not in unread and (c.direct is None or c.direct.sock.fileno() < 0)
        ]:
            link = conn.link
            closed = link.bye is not None or conn.said_bye
            if not closed and conn.index not in self._reported:
                self._unreported[conn.index] = self._gone(conn)
            traffic = _traffic(link, conn.direct, self._bulk)
            for key in _TRAFFIC:
                self._past[key] += traffic[key]
            self._bulk.forget(link)
            self._endpoint.forget(link)
            self._ended.remove(conn)
            self._conns.remove(conn)
            self._by_link.pop(id(link), None)
            self._reported.discard(conn.index)

    # ---- the public API --------------------------------------------------------------

    def connections(self) -> list[Connection]:
        """The clients connected now (alive), in arrival order.

        Returns:
            Their connections.
        """
        return [c for c in self._conns if c.alive]

    def clients(self, n: int, timeout: float | None = None) -> list[Connection]:
        """Wait until `n` clients are connected.

        Args:
            n: How many.
            timeout: Seconds to wait; None: without end.

        Returns:
            The first `n` live connections, in arrival order.

        Raises:
            ValueError: `n` is not an int >= 0.
            IPCTimeoutError: Fewer came within `timeout`.
        """
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"Server.clients: n must be an int >= 0, not {n!r}")
        _check_timeout(timeout, "Server.clients")
        self._check_open()
        deadline = _deadline(timeout)
        self._service(0)
        while len(self.connections()) < n:
            self._wait(deadline, f"{n} clients ({len(self.connections())} connected)")
        return self.connections()[:n]

    def recv_any(
        self, into: object = None, timeout: float | None = None, skip_dead: bool = False
    ) -> tuple[object, Connection]:
        """The next message from any client, in arrival order.

        A client that closed its connection is just gone.

        Args:
            into: Tensors to receive into, as for `Connection.recv`.
            timeout: Seconds to wait; None: without end.
            skip_dead: Pass over clients that died instead of raising.

        Returns:
            `(value, connection)`.

        Raises:
            PeerError: A client died, naming it, once its messages are read.
            IPCTimeoutError: Nothing came within `timeout`.
        """
        _check_timeout(timeout, "Server.recv_any")
        self._check_open()
        deadline = _deadline(timeout)
        self._service(0)
        while True:
            if self._pending:
                conn, frames = self._pending.popleft()
                return recv_value(self._bulk, conn.link, frames, into), conn
            for conn in self._conns:
                dead = conn.link.dead is not None and conn.link.bye is None
                if dead and conn.index not in self._reported:
                    self._reported.add(conn.index)
                    if not skip_dead:
                        raise self._gone(conn)
            while self._unreported:  # (in the order they died)
                err = self._unreported.pop(next(iter(self._unreported)))
                if not skip_dead:
                    raise err
            self._wait(deadline, "a message from any client")

    def broadcast(self, obj: object) -> int:
        """Send `obj` to every live client (encoded once).

        A client that is gone is skipped: its death is reported by the receives.

        Args:
            obj: The value, as for `Connection.send`.

        Returns:
            How many clients it reached.
        """
        self._check_open()
        self._service(0)
        # Encoded once; each large buffer copied once into a ZeroMQ message that every
        # client's send shares by reference.
        frames = [zmq.Frame(f, copy=True) if len(f) >= 65536 else f for f in wire.pack_value(obj)]
        reached = 0
        sockets: dict[direct.Direct, Connection] = {}
        for conn in self.connections():
            if conn.direct is not None:
                sockets[conn.direct] = conn
                continue
            try:
                conn.link.send_frames(frames, copy=False)
                reached += 1
            except PeerError:
                continue
        if sockets:
            # Every direct socket at once, each at its reader's pace: a client that is
            # not reading holds up only its own copy.
            message = direct.tensor_message(obj) or direct.frames_message(frames)
            failed = direct.send_all(
                [(d, message) for d in sockets], lambda d: self._direct_service(sockets[d])
            )
            for d, conn in sockets.items():
                why = failed.get(d)
                if why is None:
                    reached += 1
                elif isinstance(why, direct.Closed):
                    self._end_direct(conn, why)
                elif not isinstance(why, PeerError):
                    raise why
        return reached

    def net_stats(self) -> dict:
        """Bytes and messages sent and received.

        Returns:
            The totals (clients that left included), and under `per` each client's
            (those connected, and those gone whose end is not yet settled).
        """
        per = {
            c.index: {
                "name": c.name,
                "alive": c.alive,
                **_traffic(c.link, c.direct, self._bulk),
            }
            for c in self._conns
        }
        total = {k: self._past[k] + sum(p[k] for p in per.values()) for k in _TRAFFIC}
        return {"address": self.address, "clients": len(self.connections()), **total, "per": per}

    def close(self) -> None:
        """Say goodbye to every client (each has read what we sent once it acknowledges),
        then release the port and the token file."""
        if self._closed:
            return
        self._closed = True
        if os.getpid() != self._pid:
            return
        try:
            self._close_direct()  # a BYE on each direct socket, then the link's
            self._endpoint.close()
        finally:
            if self._epoll is not None:
                self._epoll.close()  # only now: the endpoint's poll watched it
            if self._local_file is not None:
                runtime.remove(runtime.runtime_dir(), self._local_file)
