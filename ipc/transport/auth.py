"""The job's secret and what is built from it: connection challenges and CURVE keys.

Nothing here is derived from public values unless the caller asks for
`insecure`: a secret is a token the user gives (`token=`, $IPC_TOKEN, a
secret file named by `token_file=` or $IPC_TOKEN_FILE) or 32 random bytes
that node 0 shares through the private runtime directory.

Every connection proves knowledge of the secret with a challenge: the
dialer's and the listener's fresh nonces and the connection's routing id go
into an HMAC, so a recorded handshake is worthless on any other connection.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import struct
from dataclasses import dataclass

import zmq
from zmq.utils import z85

from distlearn.common.envvars import env_str

from ..errors import IPCError
from .runtime import read_secret_file

__all__ = [
    "TOKEN_ENV",
    "TOKEN_FILE_ENV",
    "CurveKeys",
    "Secret",
    "given_secret",
    "insecure_secret",
    "missing_secret_error",
    "nonce",
    "random_secret",
]

log = logging.getLogger(__name__)

TOKEN_ENV = "IPC_TOKEN"
TOKEN_FILE_ENV = "IPC_TOKEN_FILE"
PROTOCOL = b"distlearn-ipc/2"
NONCE_BYTES = 16


@dataclass(frozen=True)
class CurveKeys:
    """Z85 CURVE key pairs: every listener is the server pair, every dialer the client pair."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes


class Secret:
    """The job's shared secret. Its repr never shows it."""

    __slots__ = ("_key", "origin", "text")

    def __init__(self, text: str, origin: str):
        if not isinstance(text, str) or not text:
            raise IPCError("ipc: a token must be a non-empty string")
        self.text = text  # written to the private runtime directory for same-host peers
        self._key = text.encode()
        self.origin = origin  # where it came from, for messages: "IPC_TOKEN", "random", ...

    def __repr__(self) -> str:
        return f"Secret(<{self.origin}>)"

    def mac(self, *parts: bytes) -> bytes:
        """HMAC-SHA256 of length-prefixed parts (no two part lists give the same input)."""
        m = hmac.new(self._key, PROTOCOL, hashlib.sha256)
        for p in parts:
            m.update(struct.pack("<I", len(p)))
            m.update(p)
        return m.digest()

    def check(self, mac: bytes, *parts: bytes) -> bool:
        return hmac.compare_digest(mac, self.mac(*parts))

    def curve_keys(self) -> CurveKeys:
        """Key pairs derived from the secret: only holders of the secret can compute the
        server's public key, which a CURVE client must know to connect at all."""

        def pair(label: bytes) -> tuple[bytes, bytes]:
            raw = hmac.new(self._key, PROTOCOL + b" curve " + label, hashlib.sha256).digest()
            sk = z85.encode(raw)
            return zmq.curve_public(sk), sk

        sp, ss = pair(b"server")
        cp, cs = pair(b"client")
        return CurveKeys(sp, ss, cp, cs)


def random_secret() -> Secret:
    return Secret(secrets.token_hex(32), "random, shared through the runtime directory")


def given_secret(token: str | None = None, token_file: str | None = None) -> Secret | None:
    """The secret the user gave: `token`, `token_file`, $IPC_TOKEN or $IPC_TOKEN_FILE, in
    that order; None if none was given."""
    if token is not None:
        return Secret(token, "token=")
    if token_file is not None:
        return Secret(read_secret_file(token_file), f"token_file={token_file}")
    if (text := env_str(TOKEN_ENV)) is not None:
        return Secret(text, f"${TOKEN_ENV}")
    if (path := env_str(TOKEN_FILE_ENV)) is not None:
        return Secret(read_secret_file(path), f"${TOKEN_FILE_ENV}={path}")
    return None


def insecure_secret(public: str, who: str) -> Secret:
    """A secret made of public values, for `insecure=True` on a trusted cluster only."""
    log.warning(
        "ipc %s: insecure=True: the tree's secret is derived from public values (%s); any "
        "process that can reach this job's ports can join it, read what it sends and add "
        "its own values. Set $%s or $%s on every node instead.",
        who,
        public,
        TOKEN_ENV,
        TOKEN_FILE_ENV,
    )
    return Secret(f"distlearn-insecure:{public}", "insecure=True (public values)")


def missing_secret_error(what: str) -> IPCError:
    """The error for a multi-host tree started without a secret: says how to give one."""
    return IPCError(
        f"ipc: {what}, so the tree needs a secret shared by every node and nobody else. "
        f"Set {TOKEN_ENV} to the same random value on every node (for example "
        f"`export {TOKEN_ENV}=$(python -c 'import secrets; print(secrets.token_hex(32))')` "
        f"before torchrun or srun), or {TOKEN_FILE_ENV} to a file only you can read "
        f"(chmod 600) on a shared file system, or pass token= / token_file=. On a trusted "
        "cluster insecure=True skips this (anyone who can reach the ports can then join)."
    )


def nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)
