"""Setting up the direct socket of a same-host client: bound to its link by a nonce.

1. The loopback server listens on a Unix socket in this user's verified private
   runtime directory (0700) and names it in its private record file.
2. A client of the same user connects there, writes a fresh random nonce (32 bytes),
   then dials the ZeroMQ link with the nonce in its handshake info, which the link's
   challenge authenticates. The nonce is in the socket before the handshake starts.
3. When the server accepts that link it takes the socket that showed the same nonce
   (once: a nonce is never taken twice) and answers on it an HMAC of the nonce with
   the job's secret, which the client checks (whoever answers on that path knows the
   secret); from then on every message between the two goes over it. A socket whose
   nonce no link claims gets nothing and is closed; strangers of another user cannot
   reach the directory.
"""

from __future__ import annotations

import hmac
import os
import select
import socket
import time
from collections.abc import Callable

from ..transport import Secret, fdlimit, runtime
from .direct import _FLAGS, _POLLIN, SLICE, _open

__all__ = ["ACKED", "Listener", "await_ack", "connect"]

NONCE = 32
ACK = b"distlearn-ipc direct ack"  # the server answers secret.mac(ACK, nonce)
ACK_BYTES = 32
HELLO_TIMEOUT = 5.0  # an accepted socket has this long to show a nonce
MAX_WAITING = 64  # sockets that have not shown a nonce, at most (the oldest go first)
QUEUE_WAIT = 2.0  # how long a client waits for room in a full accept queue
MAX_TAKEN = 1 << 16


def _max_shown() -> int:
    """Nonces shown and not yet claimed by a handshake, at most (the oldest go first):
    every client of a burst that connects before the server looks at the handshakes is
    there at once, each an open file: as many as the listening socket's backlog
    (`fdlimit.backlog`). A client whose socket went first is served over ZeroMQ alone."""
    return fdlimit.backlog()


class Listener:
    """The server's listening socket, and the accepted sockets whose nonce no link has
    claimed yet."""

    def __init__(self, secret: Secret):
        self.secret = secret
        self.path = runtime.socket_path("d")
        self.max_shown = _max_shown()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(self.path)
            sock.listen(self.max_shown)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        self.sock = sock
        self.waiting: dict[socket.socket, tuple[bytearray, float]] = {}
        self.shown: dict[bytes, tuple[socket.socket, float]] = {}  # nonces not yet claimed
        # Claimed (or replayed) nonces, the latest MAX_TAKEN: a replay is refused. (Only a
        # handshake with the secret can claim a nonce at all; this is defence in depth.)
        self.taken: dict[bytes, None] = {}
        self.on_change: Callable[[socket.socket, bool], None] | None = None
        _open.add(self)

    def fileno(self) -> int:
        return self.sock.fileno()

    def _forget(self, s: socket.socket) -> None:
        self.waiting.pop(s, None)
        if self.on_change is not None:
            self.on_change(s, False)
        s.close()

    def _take(self, nonce: bytes) -> None:
        self.taken[nonce] = None
        if len(self.taken) > MAX_TAKEN:
            del self.taken[next(iter(self.taken))]

    def _sockets(self) -> list[socket.socket]:
        return [*self.waiting, *(s for s, _ in self.shown.values())]

    def poll(self) -> None:
        """Accept what is queued, read the nonces shown so far, drop the expired."""
        now = time.monotonic()
        # At most MAX_WAITING a call: under a flood of connections the caller gets back
        # to its own work (and deadline); the rest wait in the kernel's queue.
        free = None  # counted once a socket is there (most calls accept none)
        for _ in range(MAX_WAITING):
            try:
                s, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                break
            if free is None:
                free = fdlimit.room() + 1  # (the one just accepted is counted)
            if free <= 0:
                # Into the files kept free for libzmq (ipc.transport.fdlimit): let it go at once
                # (left queued, it would wake us up again and again); the client's link
                # is refused with the reason.
                s.close()
                continue
            free -= 1
            s.setblocking(False)
            # Read its nonce now: a client writes it right after connecting, so in a
            # burst most never wait (and never push an older one out of `waiting`).
            self._read_nonce(s, bytearray(), now)
            if s in self.waiting:
                if len(self.waiting) > MAX_WAITING:
                    self._forget(next(iter(self.waiting)))
                if self.on_change is not None:
                    self.on_change(s, True)
        for s, (got, since) in list(self.waiting.items()):
            self._read_nonce(s, got, since)
            if s in self.waiting and now - since > HELLO_TIMEOUT:
                self._forget(s)
        # A nonce that no handshake claimed soon after it was shown is a stranger's.
        for nonce, (s, since) in list(self.shown.items()):
            if now - since > HELLO_TIMEOUT or len(self.shown) > self.max_shown:
                del self.shown[nonce]
                s.close()

    def _read_nonce(self, s: socket.socket, got: bytearray, since: float) -> None:
        """Read what `s` has of its nonce: a whole one moves it to `shown` (or closes it:
        a replay), an end of stream closes it, a part keeps it in `waiting`."""
        try:
            chunk = s.recv(NONCE - len(got))
        except (BlockingIOError, InterruptedError):
            chunk = None
        except OSError:
            chunk = b""
        if chunk == b"":  # gone before showing a whole nonce
            if s in self.waiting:
                self._forget(s)
            else:
                s.close()
            return
        if chunk:
            got += chunk
        if len(got) < NONCE:
            self.waiting[s] = (got, since)
            return
        nonce = bytes(got)
        if s in self.waiting:
            self.waiting.pop(s)
            if self.on_change is not None:
                self.on_change(s, False)
        if nonce in self.taken or nonce in self.shown:
            s.close()  # a replay, or a copy racing the first: neither is served
            old = self.shown.pop(nonce, None)
            if old is not None:
                old[0].close()
            self._take(nonce)
        else:
            self.shown[nonce] = (s, since)

    def claim(self, nonce_hex: object) -> socket.socket | None:
        """The socket that showed this nonce (which the link's handshake carried), acked;
        None when none did."""
        if not isinstance(nonce_hex, str) or len(nonce_hex) != 2 * NONCE:
            return None
        try:
            nonce = bytes.fromhex(nonce_hex)
        except ValueError:
            return None
        self.poll()
        if nonce in self.taken:
            return None
        self._take(nonce)
        s, _ = self.shown.pop(nonce, (None, 0.0))
        if s is None:
            return None
        try:
            s.send(self.secret.mac(ACK, nonce), _FLAGS)
        except OSError:
            s.close()
            return None
        return s

    def close(self) -> None:
        for s in self._sockets():
            s.close()
        self.waiting.clear()
        self.shown.clear()
        self.sock.close()
        runtime.remove(runtime.runtime_dir(), os.path.basename(self.path))

    def close_inherited(self) -> None:
        for s in self._sockets():
            s.close()
        self.sock.close()


def connect(path: object, timeout: float) -> tuple[socket.socket, bytes] | None:
    """A client's first step: connect to the server's socket and show a fresh nonce.
    None when the path is not one in our private runtime directory, nobody listens, or
    its queue stayed full for QUEUE_WAIT seconds (or `timeout`, if shorter): the client
    then goes without (the server may be busy elsewhere for long, or flooded)."""
    if not isinstance(path, str) or os.path.dirname(path) != str(runtime.runtime_dir()):
        return None
    nonce = os.urandom(NONCE)
    deadline = time.monotonic() + min(timeout, QUEUE_WAIT)
    pause = 0.001
    while True:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.settimeout(timeout)
            s.connect(path)
            s.sendall(nonce)
            s.setblocking(False)
            return s, nonce
        except BlockingIOError:
            # A Unix socket's connect does not wait for room in a full accept queue (a
            # burst of clients, a server busy elsewhere): it fails with EAGAIN. Wait for
            # the server, as a TCP connect would.
            s.close()
            if time.monotonic() + pause > deadline:
                return None
            time.sleep(pause)
            pause = min(2 * pause, 0.05)
        except OSError:
            s.close()
            return None


ACKED, ENDED = "acked", "ended"


def await_ack(
    s: socket.socket, nonce: bytes, secret: Secret, deadline: float, service: Callable[[], None]
) -> str | None:
    """The client's last step: wait for the server's answer, calling `service` between
    slices (it raises if the link failed). ACKED: it proved the secret. ENDED: the socket
    ended unanswered (the server let it go, as it does the oldest of a burst too large
    to hold; the link still works without it). None: a wrong answer (not our server), or
    none by the deadline."""
    p = select.poll()
    p.register(s, _POLLIN)
    got = b""
    while len(got) < ACK_BYTES:
        if p.poll(int(SLICE * 1000)):
            try:
                chunk = s.recv(ACK_BYTES - len(got))
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                return ENDED
            if not chunk:
                return ENDED if not got else None
            got += chunk
            continue
        service()
        if time.monotonic() > deadline:
            return None
    return ACKED if hmac.compare_digest(got, secret.mac(ACK, nonce)) else None
