"""The handshakes of an `Endpoint`: who gets in, in three layers.

1. ZeroMQ's handshake, checked by a ZAP handler (`_Zap`) before a single message is
   accepted: PLAIN with a password derived from the job's secret, or CURVE
   (`encrypt=True`: every byte encrypted, keys derived from the secret).
   Strangers cannot queue anything in our memory, not even a message part.
2. A challenge on every connection: the dialer's and listener's fresh nonces
   and the connection's routing id go into an HMAC of the secret, so a
   recorded handshake is worthless on any other connection, and the dialer
   learns that the listener knows the secret too. A listener's side: HELLO ->
   CHALLENGE, AUTH -> WELCOME or REFUSED; a dialer's: CHALLENGE -> AUTH, then
   WELCOME (up) or REFUSED (failure).
3. Limits before parsing: ZMQ_MAXMSGSIZE on every socket, a bounded table of
   handshakes in progress, and total parsers. Receive queues are not bounded
   by a high-water mark, on purpose: only authenticated peers (members of the
   job) ever queue a message, and libzmq (4.3.5, zeromq/libzmq#3937, #4364)
   aborts the whole process when a connection whose input a full queue has
   paused is closed by its peer and a heartbeat fires before we read it.
"""

from __future__ import annotations

import contextlib
import hmac
import json
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


def _again(header: bytes) -> bool:
    """A REFUSED that asks the dialer to start its handshake over."""
    return wire.parse_control(header).get("again") is True


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


class HandshakeMixin:
    """`Endpoint`'s handshakes, both sides, and its ZAP check. It reads the endpoint's
    secret, name, info, limits, accept, _closed, _curve, _password and router; it
    keeps the handshakes in progress in `_pending`, puts each accepted link (made by
    `_new_link`) in `links` and its ("accepted", link) in `events`, and sets a
    dialed link's state, info, name and failure; strangers go to `_drop` and
    `_note_rate_limited`."""

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
        link = self._new_link(f"accepted from {peer or 'a Unix socket'}", dialed=False, rid=rid)
        link.name, link.info = p.name, p.info
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
