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
the same host finds it: nothing is derived from public values. Strangers are
refused by ZeroMQ's handshake before they can queue a byte, and every frame is
capped (`Limits.max_frame`) before it is read; large tensors travel in frames
of at most 1 MiB, or, between processes of one host, through shared memory
(:mod:`ipc.services.bulk`: a header on the link, the bytes in the sender's arena).

A client of the same user on the same host sends and receives on a direct Unix
stream socket bound to its authenticated link by a one-time nonce (:mod:`ipc.services.direct`):
a round trip is two plain socket writes, without ZeroMQ's I/O threads. Everything
runs in the caller's thread; ZeroMQ's own I/O thread answers heartbeats meanwhile,
so a dead or frozen peer is noticed while you compute. A dead client is named by
`PeerError` once its last message has been read; `broadcast` skips it.
Not thread-safe: use a Server or a Client from one thread at a time.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import logging
import os
import select
import socket
import time
from collections import deque

import zmq

from ..errors import IPCError, IPCTimeoutError, PeerError
from ..keywords import checked
from ..procs import start_ticks
from ..transport import (
    Endpoint,
    Kind,
    Limits,
    Link,
    Liveness,
    Secret,
    fdlimit,
    given_secret,
    missing_secret_error,
    random_secret,
    runtime,
    wire,
)
from . import bulk, direct

log = logging.getLogger(__name__)


def _local_name(host: str, port: int) -> str:
    """The private file where a loopback server on `host`:`port` leaves its Unix socket
    address (and its random token, when it made one) for clients of the same user. Keyed
    by the address too: 127.0.0.1:P and 127.0.0.2:P are two servers (by port alone, a
    client of one reached the other, and the second server's start removed the first's
    record)."""
    try:
        where = "127.0.0.1" if host == "localhost" else str(ipaddress.ip_address(host))
    except ValueError:
        where = host
    return f"server-{where.replace(':', '_')}-{port}.json"


def _local_record(host: str, port: int) -> dict:
    """What a loopback server of ours on `host`:`port` left for our clients: {} where there is
    nothing, nothing well-formed, or its server is gone (a killed server cannot remove
    its file). Its token and Unix socket then mean nothing: a client without a token is
    told so, and one with a token reaches whoever listens on the port now over TCP."""
    raw = runtime.read_private(runtime.runtime_dir(), _local_name(host, port))
    try:
        record = json.loads(raw) if raw is not None else {}
    except ValueError:
        return {}
    if not isinstance(record, dict):
        return {}
    keep = ("unix", "token", "direct")
    kept = {k: v for k, v in record.items() if k in keep and isinstance(v, str)}
    if kept and not _still_serving(record):
        log.info("ipc: the server that left %s (pid %s) is gone; using TCP",
                 _local_name(host, port), record.get("pid"))  # fmt: skip
        return {}
    return kept


def _still_serving(record: dict) -> bool:
    """Whether the server that wrote `record` runs: its pid, with the start time it wrote
    (pids are reused). A pid not seen from here (another pid namespace sharing this
    directory) counts while something listens on its Unix socket."""
    pid, start = record.get("pid"), record.get("start")
    if isinstance(pid, int) and isinstance(start, int) and start_ticks(pid) == start:
        return True
    unix = record.get("unix")
    return (
        isinstance(unix, str)
        and unix.startswith("ipc://")
        and runtime.listened_on(unix.removeprefix("ipc://"))
    )


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _check_timeout(timeout: float | None, what: str) -> float | None:
    if timeout is not None and not timeout >= 0:
        raise ValueError(f"{what}: timeout must be None or >= 0, not {timeout!r}")
    return timeout


def _deadline(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + timeout


def recv_value(shared: bulk.Bulk, link: Link, frames: list | tuple, into: object) -> object:
    """The value of a received message: frames of ipc.transport.wire, or a direct TENSOR."""
    try:
        if isinstance(frames, tuple):
            return direct.tensor_of(frames, into)
        return shared.unpack(frames, shared.memory_of(link), into=into)
    except wire.WireError as err:
        raise IPCError(f"ipc: a malformed message from {link.name}: {err}") from None


class Connection:
    """The server's side of one client. `name` is what the client called itself (its
    handshake is authenticated); `index` numbers connections in arrival order."""

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
        """Send `obj` to this client; PeerError if it is gone."""
        self._server._check_open()
        if self.link.bye is not None or self.said_bye:
            raise PeerError(f"ipc server: {self.name} has closed its connection", self.index)
        if self.direct is not None:
            self._server._send_direct(self, obj)
        else:
            self._server._bulk.send(self.link, obj)

    def recv(self, into: object = None, timeout: float | None = None) -> object:
        """The next message from this client (tensors written into `into`'s where it has
        them); PeerError once it is gone and its messages are read, IPCTimeoutError after
        `timeout` seconds."""
        _check_timeout(timeout, "Connection.recv")
        frames = self._server._next_from(self, _deadline(timeout))
        return recv_value(self._server._bulk, self.link, frames, into)

    def close(self) -> None:
        """Drop this client (it sees its link end)."""
        self._server._drop(self)


class Server:
    """Listens on `host:port` (port 0: a free port, in `.port`) for clients that know the
    secret. See the module docstring."""

    @checked
    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        *,
        token_file: str | None = None,
        encrypt: bool = False,
        liveness: Liveness | None = None,
        max_frame: int = (1 << 20) + 1024,
        name: str = "ipc server",
    ):
        if not isinstance(port, int) or not 0 <= port < 65536:
            raise ValueError(f"Server: port must be an int in [0, 65536), not {port!r}")
        secret = given_secret(token, token_file)
        if secret is None:
            if not _is_loopback(host):
                raise missing_secret_error(f"Server({host!r}) listens beyond this host")
            secret = random_secret()
        self.host = host
        local = _is_loopback(host)
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
        self._listener: direct.Listener | None = None
        self._epoll: select.epoll | None = None
        self._by_fd: dict[int, Connection] = {}
        self._reading: Connection | None = None  # its socket is read by the caller
        self._serviced = 0.0  # when the endpoint was last looked after
        if local and direct.enabled() and not encrypt:
            try:
                self._listener = direct.Listener(secret)
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

    # ---- the public API --------------------------------------------------------------

    def connections(self) -> list[Connection]:
        """The clients connected now (alive), in arrival order."""
        return [c for c in self._conns if c.alive]

    def clients(self, n: int, timeout: float | None = None) -> list[Connection]:
        """Wait until `n` clients are connected; the first `n` live connections."""
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
        """(value, connection) of the next message from any client, in arrival order. A
        client that died raises PeerError naming it once its messages are read (or is
        skipped with `skip_dead=True`); one that closed its connection is just gone."""
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
        """Send `obj` to every live client (encoded once); returns how many it reached. A
        client that is gone is skipped: its death is reported by the receives."""
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
        """Bytes and messages sent and received, in all (clients that left included) and
        per client (those connected, and those gone whose end is not yet settled)."""
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


_TRAFFIC = (
    "bytes_sent", "bytes_recv", "msgs_sent", "msgs_recv", "shm_bytes_sent", "shm_msgs_sent",
)  # fmt: skip


def _traffic(link: Link, d: direct.Direct | None, shared: bulk.Bulk) -> dict:
    """A link's traffic counts plus its direct socket's, and what went through shared
    memory (`_TRAFFIC`'s last two, and whether the peer reads it)."""
    stats = dict(vars(link.stats))
    if d is not None:
        for key in ("bytes_sent", "bytes_recv", "msgs_sent", "msgs_recv"):
            stats[key] += getattr(d, key)
    return {**stats, **shared.stats(link)}


class Client:
    """One authenticated connection to a Server at `host:port`."""

    @checked
    def __init__(
        self,
        host: str,
        port: int,
        token: str | None = None,
        *,
        token_file: str | None = None,
        encrypt: bool = False,
        liveness: Liveness | None = None,
        max_frame: int = (1 << 20) + 1024,
        timeout: float = 30.0,
        name: str | None = None,
    ):
        if not isinstance(port, int) or not 0 < port < 65536:
            raise ValueError(f"Client: port must be an int in (0, 65536), not {port!r}")
        secret = given_secret(token, token_file)
        record = _local_record(host, port) if _is_loopback(host) else {}
        if secret is None:
            if not record and _is_loopback(host):
                # No server of ours there (a live one leaves a record even when it was
                # given its token): most likely nobody listens; say that, not "set a token".
                raise PeerError(
                    f"Client({host!r}, {port}): no server of this user listens on port "
                    f"{port} of this host (not started, or closed); for another user's "
                    "server, pass its token (token=, $IPC_TOKEN or $IPC_TOKEN_FILE)"
                )
            if "token" not in record:
                raise missing_secret_error(
                    f"Client({host!r}, {port}) has no token (and no server of ours on this "
                    "host left one)"
                )
            secret = Secret(record["token"], f"the token file of the server on port {port}")
        # A server of ours on this host listens on a Unix socket too; the link's challenge
        # still proves that whoever answers there knows the secret.
        address = record.get("unix", f"tcp://{host}:{port}")
        if not address.startswith("ipc://"):
            address = f"tcp://{host}:{port}"
        name = name or f"client {socket.gethostname()}/{os.getpid()}"
        self.name = name
        deadline = time.monotonic() + timeout
        # A server of ours on this host: first show a fresh nonce on its direct socket,
        # then name the nonce in the (authenticated) handshake; see ipc.services.direct.
        raw = None
        if "direct" in record and direct.enabled() and not encrypt:
            raw = direct.connect(record["direct"], timeout)
        self._direct: direct.Direct | None = None
        self._direct_end: PeerError | None = None  # why the direct socket ended
        self._serviced = 0.0  # when the link layer was last looked after
        self._bulk = bulk.Bulk()
        info = {"pid": os.getpid(), **self._bulk.info()}
        if raw is not None:
            info["direct"] = raw[1].hex()
        try:
            self._endpoint = Endpoint(
                secret,
                name,
                encrypt=encrypt,
                limits=Limits(max_frame=max_frame),
                liveness=liveness,
                info=info,
            )
        except BaseException:
            if raw is not None:
                raw[0].close()
            raise
        self._pid = os.getpid()
        self._closed = False
        try:
            self._link = self._endpoint.dial(address, reconnect=False)
            self._endpoint.wait_up([self._link], deadline, f"the server at {host}:{port}")
            self._bulk.up(self._link)
            if raw is not None:
                answer = direct.await_ack(*raw, secret, deadline, self._service_refused)
                if answer is None:
                    raise IPCError(
                        f"{name}: the server at {host}:{port} did not take our direct socket"
                    )
                if answer == direct.ACKED:
                    self._direct = direct.Direct(raw[0], max_frame)
                else:
                    raw[0].close()  # ended unanswered: the link alone carries the messages
                raw = None
        except BaseException:
            self._closed = True
            if raw is not None:
                raw[0].close()
            self._endpoint.close(linger=0)
            raise

    def __repr__(self) -> str:
        return f"Client({self._link.address})"

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check(self) -> None:
        if self._closed:
            raise IPCError("ipc client: closed")
        if os.getpid() != self._pid:
            raise IPCError("ipc client: a forked child cannot use its parent's client")

    def _service_link(self) -> None:
        """The link layer's work (heartbeats, BYE, BULK_OK) while the direct socket carries
        the messages; raises once the link is dead."""
        ep = self._endpoint
        self._serviced = time.monotonic()
        ep.poll(0)
        ep.events.clear()
        while ep.inbox:
            link, frames = ep.inbox.popleft()
            if not self._bulk.control(link, frames):
                log.warning("%s: dropped a message on the link beside the direct socket", self.name)
        if self._link.dead is not None:
            raise ep.dead_error(self._link)

    def _service_refused(self) -> None:
        self._service_link()
        if self._link.bye is not None:
            raise PeerError(f"{self.name}: the server dropped the connection")

    def _direct_gone(self, why: Exception) -> PeerError:
        """What the end (direct.Closed) or breakage (DirectError) of the socket means."""
        d, link, ep = self._direct, self._link, self._endpoint
        d.close(bye=False)
        if isinstance(why, direct.Closed) and why.bye:
            # Its BYE on the link follows: acknowledge it (its close() waits for that).
            until = time.monotonic() + 1.0
            while link.bye is None and link.dead is None and time.monotonic() < until:
                ep.poll(0.02)
                ep.inbox.clear()
            self._direct_end = PeerError(f"{self.name}: the server has closed the connection")
        else:
            ep.mark_dead(
                link,
                "its connection closed"
                if isinstance(why, direct.Closed)
                else f"it broke the framing ({why})",
            )
            self._direct_end = ep.dead_error(link)
        return self._direct_end

    def send(self, obj: object) -> None:
        """Send `obj` to the server; PeerError if it is gone."""
        self._check()
        if self._link.bye is not None:
            raise PeerError(f"{self.name}: the server has closed the connection")
        d = self._direct
        if d is None:
            self._bulk.send(self._link, obj)
            return
        if self._direct_end is not None:
            raise self._direct_end
        try:
            if d.send_tensor(obj, self._service_link):
                return
            if self._bulk.arena is not None and self._link not in self._bulk.readers:
                self._service_link()  # the server's BULK_OK may be waiting on the link
            frames = self._bulk.pack(obj, self._link)
            try:
                d.send_frames(frames, self._service_link)
            except BaseException:
                self._bulk.drop(frames, self._bulk.arena)
                raise
        except direct.Closed as why:
            raise self._direct_gone(why) from None

    def recv(self, into: object = None, timeout: float | None = None) -> object:
        """The next message from the server (tensors written into `into`'s where it has
        them); PeerError once the server is gone and its messages read."""
        _check_timeout(timeout, "Client.recv")
        self._check()
        ep = self._endpoint
        deadline = _deadline(timeout)
        d = self._direct
        if d is not None:
            if self._direct_end is not None:
                raise self._direct_end
            try:
                if time.monotonic() - self._serviced > direct.SLICE:
                    self._service_link()  # BYE, BULK_OK, liveness, even while busy
                msg = d.read(True, self._service_link, deadline)
            except (direct.Closed, direct.DirectError) as why:
                raise self._direct_gone(why) from None
            if msg is None:
                raise IPCTimeoutError(f"{self.name}: timed out waiting for the server")
            return recv_value(self._bulk, self._link, msg, into)
        while True:
            item = ep.recv(None)  # polls once
            ep.events.clear()  # the link's own state says what happened to it
            if item is not None:
                if self._bulk.control(*item):
                    continue
                return recv_value(self._bulk, self._link, item[1], into)
            if self._link.bye is not None:
                raise PeerError(f"{self.name}: the server has closed the connection")
            if self._link.dead is not None:
                raise ep.dead_error(self._link)
            remaining = 3600.0 if deadline is None else deadline - time.monotonic()
            if remaining <= 0:
                raise IPCTimeoutError(f"{self.name}: timed out waiting for the server")
            ep.poll(min(remaining, 1.0))

    def net_stats(self) -> dict:
        return {
            "server": self._link.address,
            **_traffic(self._link, self._direct, self._bulk),
        }

    def close(self) -> None:
        """Say goodbye; returns once the server has read everything we sent (or is gone)."""
        if self._closed:
            return
        self._closed = True
        if os.getpid() != self._pid:
            return
        if self._direct is not None:
            self._direct.close(bye=True)  # everything we sent is in the server's socket
        self._endpoint.close()
