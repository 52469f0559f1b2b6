"""`Client`: one authenticated connection to a `Server` (see server.py for the whole story).

A client of the same user on the same host finds the server's private record (its Unix
socket, its direct socket, its token if it made one), shows a fresh nonce on the direct
socket and names it in the link's handshake; everything else goes over the link.
"""

from __future__ import annotations

import logging
import os
import socket
import time

from distlearn.common.keywords import checked
from distlearn.common.net import is_loopback

from ..errors import IPCError, IPCTimeoutError, PeerError
from ..transport import Endpoint, Limits, Liveness, Secret, given_secret, missing_secret_error
from . import bulk, direct, direct_setup
from .common import _check_timeout, _deadline, _local_record, _traffic, recv_value

__all__ = ["Client"]

log = logging.getLogger(__name__)


class Client:
    """One authenticated connection to a Server at `host:port`, used from one thread.

    A client of the same user on the same host finds a loopback server's secret (and
    its direct socket) in the server's private record file.

    Args:
        host: The server's address.
        port: The server's port.
        token: The secret (else $IPC_TOKEN, $IPC_TOKEN_FILE, or a loopback server's
            record).
        token_file: A private file holding the secret.
        encrypt: As the server's: None (the default) is CURVE over TCP, True CURVE
            everywhere, False TCP in the clear.
        liveness: How soon a dead or frozen server is named (`ipc.Liveness`).
        max_frame: The largest frame the server may send.
        timeout: Seconds the handshake may take.
        name: What this client calls itself to the server.

    Raises:
        TypeError: A misspelt option, naming the closest.
        ValueError: A port out of range.
        PeerError: Nobody listens there (a refused connection).
        IPCTimeoutError: The server did not finish the handshake within `timeout`.
        IPCError: No secret for a server that needs one, saying how to give it.
    """

    @checked
    def __init__(
        self,
        host: str,
        port: int,
        token: str | None = None,
        *,
        token_file: str | None = None,
        encrypt: bool | None = None,
        liveness: Liveness | None = None,
        max_frame: int = (1 << 20) + 1024,
        timeout: float = 30.0,
        name: str | None = None,
    ):
        if not isinstance(port, int) or not 0 < port < 65536:
            raise ValueError(f"Client: port must be an int in (0, 65536), not {port!r}")
        secret = given_secret(token, token_file)
        record = _local_record(host, port) if is_loopback(host) else {}
        if secret is None:
            if not record and is_loopback(host):
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
            raw = direct_setup.connect(record["direct"], timeout)
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
                answer = direct_setup.await_ack(*raw, secret, deadline, self._service_refused)
                if answer is None:
                    raise IPCError(
                        f"{name}: the server at {host}:{port} did not take our direct socket"
                    )
                if answer == direct_setup.ACKED:
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
        """Send `obj` to the server.

        Args:
            obj: A tensor, or a nested list/tuple/dict of tensors, str, int, float,
                bool, None and bytes.

        Raises:
            PeerError: The server is gone.
        """
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
        """The next message from the server.

        Args:
            into: Tensors (in the message's structure) to receive into, same shapes and
                dtypes; None allocates.
            timeout: Seconds to wait; None: without end.

        Returns:
            The value.

        Raises:
            PeerError: The server is gone and its messages are read.
            IPCTimeoutError: Nothing came within `timeout`.
        """
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
        """Bytes and messages sent and received.

        Returns:
            The traffic, with the server's address.
        """
        return {
            "server": self._link.address,
            **_traffic(self._link, self._direct, self._bulk),
        }

    def close(self) -> None:
        """Say goodbye; returns once the server has read everything sent (or is gone)."""
        if self._closed:
            return
        self._closed = True
        if os.getpid() != self._pid:
            return
        if self._direct is not None:
            self._direct.close(bye=True)  # everything we sent is in the server's socket
        self._endpoint.close()
