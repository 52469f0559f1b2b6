"""The handshakes of an `Endpoint`: who gets in, in three layers.

1. ZeroMQ's handshake, checked by a ZAP handler (`_Zap`) before a single message is
   accepted. The mechanism goes by where the link runs (`Endpoint.curve_for`):
   - TCP (another host, or loopback, which other users of this host reach too):
     CURVE, with both key pairs derived from the job's secret (auth.py). The dialer's
     HELLO is sealed to the listener's public key, and only a holder of the secret can
     answer it: the listener proves the secret before the dialer shows anything that
     lets anyone in (its own key goes in INITIATE, after that proof). Every message is
     then encrypted and authenticated (XSalsa20-Poly1305): a relay that rewrites one
     byte ends the connection, it never changes a value. ZeroMQ has no bound on the
     frames of one message, and its high-water mark counts whole messages, so only
     this keeps a stranger from growing a message in our memory without end: without
     the secret, nothing gets past the handshake (`encrypt=False` on a trusted network
     turns this off: PLAIN, whose password crosses the wire in the clear).
   - Unix sockets in the private runtime directory (0700, verified): PLAIN with a
     password derived from the secret, and the ZAP handler checks the peer's uid
     (SO_PEERCRED, which libzmq hands it): only this user's processes connect at
     all, so nothing crosses a wire and nothing needs encrypting (`encrypt=True`
     encrypts them too).
   The ZAP handler names each connection it admits (its User-Id): a message is taken
   for a link only when it comes on the connection that did the link's handshake.
2. A challenge on every connection: the dialer's and listener's fresh nonces
   and the connection's routing id go into an HMAC of the secret, so a
   recorded handshake is worthless on any other connection, and the dialer
   learns that the listener knows the secret too. A listener's side: HELLO ->
   CHALLENGE, AUTH -> WELCOME or REFUSED; a dialer's: CHALLENGE -> AUTH, then
   WELCOME (up) or REFUSED (failure).
3. Limits before parsing: ZMQ_MAXMSGSIZE on every socket, ZMQ_HANDSHAKE_IVL (a
   connection that has not finished ZeroMQ's handshake within
   `Limits.handshake_timeout` is closed, so idle connections do not hold files for
   long), a bounded table of handshakes in progress, expired after the same time,
   and total parsers. Receive queues are not bounded by a high-water mark, on
   purpose: only authenticated peers (members of the job) ever queue a message,
   and libzmq (4.3.5, zeromq/libzmq#3937, #4364) aborts the whole process when a
   connection whose input a full queue has paused is closed by its peer and a
   heartbeat fires before we read it.

A link is bound to one connection: a dialer never reconnects (a lost connection ends
its link; one that was never up is dialed again with a fresh socket and routing id),
and a listener takes nothing on a routing id from another connection than the one
that did its handshake, nor anything but an acknowledgement after a peer's BYE.
"""

from __future__ import annotations

import contextlib
import hmac
import itertools
import json
import os
import random
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import zmq
from zmq.utils import z85

from ..errors import AuthError, EndpointRefused, IPCError
from . import wire
from .auth import nonce
from .wire import Kind, WireError

if TYPE_CHECKING:  # (link.py imports this module)
    from .link import Link

__all__ = ["CLOSING", "HandshakeMixin"]

ZAP_DOMAIN = b"distlearn-ipc"
PLAIN_USER = b"distlearn"
CLOSING = "closing: it takes no more links"
MAX_AGAIN = 100  # times a dialer starts its handshake over before it gives up
# ... after a random wait of up to AGAIN_WAIT_S x 2**(times so far), at most AGAIN_MAX_S:
# a burst of dialers that all started over at once would take each other's places again.
AGAIN_WAIT_S = 0.005
AGAIN_MAX_S = 0.5


def _again(header: bytes) -> bool:
    """A REFUSED that asks the dialer to start its handshake over."""
    return wire.parse_control(header).get("again") is True


@dataclass
class _Pending:
    """A listener's half of a handshake in progress."""

    rid: bytes
    started: float
    conn: str = ""  # the connection it came on (its ZAP User-Id)
    name: str = ""
    info: dict = field(default_factory=dict)
    dialer_nonce: bytes = b""
    our_nonce: bytes = b""


class _Zap(threading.Thread):
    """ZeroMQ's authentication hook for one context: admits a connection only when its
    credentials were derived from the job's secret (`check` says so), and names each
    connection it admits with a User-Id of its own, which every message on it carries.
    Runs until the context terminates."""

    def __init__(self, ctx: zmq.Context, check: Callable[[bytes, list[bytes], str], bool]):
        super().__init__(name="ipc-zap", daemon=True)
        self.sock = ctx.socket(zmq.REP)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind("inproc://zeromq.zap.01")
        self.check = check
        self._ids = itertools.count(1)

    def run(self) -> None:
        try:
            while True:
                msg = self.sock.recv_multipart()
                if len(msg) < 6:
                    self.sock.send_multipart([b"1.0", b"", b"500", b"bad request", b"", b""])
                    continue
                version, request_id, _domain, address, _identity, mechanism = msg[:6]
                ok = self.check(mechanism, msg[6:], address.decode(errors="replace"))
                if ok:
                    reply = [b"200", b"OK", b"c%d" % next(self._ids)]
                else:
                    reply = [b"400", b"wrong token", b""]
                self.sock.send_multipart([version, request_id, *reply, b""])
        except zmq.ContextTerminated:
            pass
        finally:
            self.sock.close(linger=0)


# How libzmq names a Unix-socket peer to the ZAP handler: its credentials (SO_PEERCRED).
_UNIX_PEER = re.compile(r"localhost:(\d+):(\d+):(\d+)")


def unix_peer_uid(address: str) -> int | None:
    """The uid of a Unix-socket peer as the ZAP handler sees it; None for a TCP peer."""
    m = _UNIX_PEER.fullmatch(address)
    return int(m.group(1)) if m else None


def connection_of(frame: zmq.Frame) -> str:
    """The connection a received frame came on (the User-Id our ZAP handler gave it)."""
    try:
        return frame.get("User-Id")
    except zmq.ZMQError:
        return ""


class HandshakeMixin:
    """`Endpoint`'s handshakes, both sides, and its ZAP check. It reads the endpoint's
    secret, name, info, limits, accept, _closed, _curve, _password and router; it
    keeps the handshakes in progress in `_pending`, puts each accepted link (made by
    `_new_link`) in `links` and its ("accepted", link) in `events`, and sets a
    dialed link's state, info, name and failure; strangers go to `_drop` and
    `_note_rate_limited`."""

    def _zap_check(self, mechanism: bytes, creds: list[bytes], address: str) -> bool:
        uid = unix_peer_uid(address)
        if uid is not None and uid != os.getuid():
            # (Our runtime directory is 0700: only root could have connected.)
            self._note_rate_limited(f"refused a Unix-socket peer of uid {uid}: not ours")
            return False
        if mechanism == b"CURVE":
            ok = len(creds) == 1 and creds[0] == z85.decode(self._curve.client_public)
            why = "" if ok else "its CURVE credentials are not this job's (another secret)"
        elif mechanism == b"PLAIN" and self.encrypt is not True:
            ok = len(creds) == 2 and creds[0] == PLAIN_USER
            ok = ok and hmac.compare_digest(creds[1], self._password)
            why = "" if ok else "its PLAIN credentials are not this job's (another secret)"
            # PLAIN only on a Unix socket (a TCP listener speaks CURVE and refused it
            # already), unless encrypt=False said the network is trusted.
            if ok and self.encrypt is None and uid is None:
                ok, why = False, "PLAIN over TCP (this endpoint takes CURVE there)"
        else:
            ok = False
            why = (f"{mechanism.decode(errors='replace')[:10]} credentials (encrypt= must be "
                   "the same on every node)")  # fmt: skip
        if not ok:
            self._note_rate_limited(
                f"refused a connection{' from ' + address if address else ''}: {why}"
            )
        return ok

    # ---- handshakes --------------------------------------------------------------

    def _handshake_message(self, rid: bytes, frames: list) -> None:
        """A listener's side: HELLO -> CHALLENGE, AUTH -> WELCOME or REFUSED."""
        if rid in self.links:
            # The routing id of a link of ours (one we dialed): never another peer's.
            self._drop("a handshake on the routing id of one of our own links")
            return
        if len(frames) != 2:
            self._drop("a message of the wrong shape from an unauthenticated peer")
            return
        header = frames[1].bytes
        conn = connection_of(frames[0])
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
                self._challenge(rid, body, conn)
            elif kind == Kind.AUTH:
                body = wire.parse_control(header, {"mac": wire.hex_of(32)})
                try:
                    peer = frames[1].get("Peer-Address")
                except zmq.ZMQError:
                    peer = ""
                self._authenticate(rid, bytes.fromhex(body["mac"]), conn, peer)
            else:
                raise WireError(f"kind {kind} before authentication")
        except WireError as err:
            self._drop(f"an unauthenticated message: {err}")

    def _challenge(self, rid: bytes, hello: dict, conn: str) -> None:
        if len(self._pending) >= self.limits.handshakes:
            self._pending.popitem(last=False)  # the oldest stranger loses its place
        p = _Pending(rid, time.monotonic(), conn, hello["name"], hello["info"])
        p.dialer_nonce = bytes.fromhex(hello["nonce"])
        p.our_nonce = nonce()
        self._pending.pop(rid, None)
        self._pending[rid] = p
        proof = self.secret.mac(b"challenge", rid, p.dialer_nonce, p.our_nonce)
        self._reply(
            rid, wire.control(Kind.CHALLENGE, {"nonce": p.our_nonce.hex(), "proof": proof.hex()})
        )

    def _authenticate(self, rid: bytes, mac: bytes, conn: str, peer: str = "") -> None:
        p = self._pending.get(rid)
        if p is not None and p.conn != conn:
            # Another connection that uses the routing id of one in its handshake: not the
            # peer that said HELLO (a dialer never reconnects), whatever it proves.
            self._drop("an AUTH on another connection than its HELLO's")
            return
        self._pending.pop(rid, None)
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
        link = self._new_link(f"accepted from {peer or 'a Unix socket'}", dialed=False, rid=rid)
        link.name, link.info, link.conn = p.name, p.info, conn
        if self._closed:
            # Closing: a link taken now would get neither our BYE nor anything else before
            # its connection ends (the peer would take that for our death).
            self._reply(rid, wire.control(Kind.REFUSED, {"reason": CLOSING, "closing": True}))
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
                body = wire.parse_control(header)
                reason = str(body.get("reason", "?"))[:200]
                link.failure = EndpointRefused(
                    f"{self.name}: refused by the endpoint at {link.address}: {reason}",
                    reason,
                    closing=body.get("closing") is True,  # (a field, not the reason's words)
                )
            else:
                raise WireError(f"kind {kind} during the handshake")
        except WireError as err:
            self._drop(f"a bad handshake message from {link.address}: {err}")

    def _hello_again(self, link: Link) -> None:
        """Start the handshake over (the listener lost ours), after a random wait that
        doubles each time (`_hello_due` sends it): dialers of a burst that all started over
        at once took each other's places again, and under load one lost 100 times in a row."""
        link.again += 1
        if link.again > MAX_AGAIN:
            link.failure = IPCError(
                f"{self.name}: the endpoint at {link.address} lost our handshake "
                f"{MAX_AGAIN} times (more connections at once than it holds)"
            )
            return
        wait = min(AGAIN_MAX_S, AGAIN_WAIT_S * 2 ** min(link.again, 16))
        link.hello_at = time.monotonic() + random.uniform(0.0, wait)
        link.state = "again"
        self._hellos.append(link)

    def _hello_due(self) -> None:
        """Say HELLO again on the links whose wait (`_hello_again`) is over."""
        now = time.monotonic()
        for link in [link for link in self._hellos if link.hello_at <= now]:
            self._hellos.remove(link)
            if link.failure is None and link.dead is None and link.state == "again":
                self._hello(link)

    def _hello(self, link: Link) -> None:
        """A dialer's first handshake message, with a fresh nonce."""
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
