"""The job's secret and what is built from it: connection challenges and CURVE keys.

Nothing here is derived from public values unless the caller asks for
`insecure`: a secret is a token the user gives (`token=`, $IPC_TOKEN, a
secret file named by `token_file=` or $IPC_TOKEN_FILE) or 32 random bytes
that node 0 shares through the private runtime directory. A token the user
gives must carry at least 128 bits (`MIN_BITS`): what a listener's CURVE key
is derived from must not be guessable offline by a squatter that recorded a
dialer's first message (see handshakes.py), so a shorter one is refused.

Keys are derived with HKDF-SHA256 (RFC 5869): the secret is the input keying
material, the protocol name the salt, and each key has a label of its own
(the CURVE server and client pairs, the Unix-socket password), so no key
tells anything about another or about the secret.

Every connection proves knowledge of the secret with a challenge: the
dialer's and the listener's fresh nonces and the connection's routing id go
into an HMAC, so a recorded handshake is worthless on any other connection.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import secrets
import string
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
    "check_token",
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
MIN_BITS = 128  # what a token the user gives must carry, at least
MIN_DISTINCT = 8  # distinct characters in a token, at least ("x" * 40 is no secret)


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

    def derive(self, label: bytes) -> bytes:
        """32 bytes for `label`, derived from the secret with HKDF-SHA256 (RFC 5869: one
        block of HKDF-Expand after HKDF-Extract with the protocol name as salt)."""
        prk = hmac.new(PROTOCOL, self._key, hashlib.sha256).digest()
        return hmac.new(prk, label + b"\x01", hashlib.sha256).digest()

    def curve_keys(self) -> CurveKeys:
        """Key pairs derived from the secret: only holders of the secret can compute the
        server's secret key, which a CURVE listener needs to answer a dialer's HELLO,
        nor the client's, which a CURVE dialer needs to be let in (see handshakes.py)."""

        def pair(label: bytes) -> tuple[bytes, bytes]:
            sk = z85.encode(self.derive(b"curve " + label))
            return zmq.curve_public(sk), sk

        sp, ss = pair(b"server")
        cp, cs = pair(b"client")
        return CurveKeys(sp, ss, cp, cs)

    def password(self) -> bytes:
        """The PLAIN password of Unix-socket links (they never leave the host)."""
        return self.derive(b"plain").hex().encode()


def random_secret() -> Secret:
    return Secret(secrets.token_hex(32), "random, shared through the runtime directory")


def given_secret(token: str | None = None, token_file: str | None = None) -> Secret | None:
    """The secret the user gave: `token`, `token_file`, $IPC_TOKEN or $IPC_TOKEN_FILE, in
    that order; None if none was given."""
    if token is not None:
        return _given(token, "token=")
    if token_file is not None:
        return _given(read_secret_file(token_file), f"token_file={token_file}")
    if (text := env_str(TOKEN_ENV)) is not None:
        return _given(text, f"${TOKEN_ENV}")
    if (path := env_str(TOKEN_FILE_ENV)) is not None:
        return _given(read_secret_file(path), f"${TOKEN_FILE_ENV}={path}")
    return None


def _given(text: object, origin: str) -> Secret:
    if not isinstance(text, str):
        raise IPCError(f"ipc: the token ({origin}) must be a str, not {type(text).__name__}")
    check_token(text, origin)
    return Secret(text, origin)


def _alphabet(text: str) -> int:
    """The size of the smallest usual alphabet that `text` is written in."""
    chars = set(text)
    if chars <= set(string.hexdigits) and not (chars & set("abcdef") and chars & set("ABCDEF")):
        return 10 if chars <= set(string.digits) else 16
    size = 0
    for group, n in ((string.digits, 10), (string.ascii_lowercase, 26),
                     (string.ascii_uppercase, 26)):  # fmt: skip
        if chars & set(group):
            size += n
    if chars - set(string.digits + string.ascii_letters):
        size += 33 if all(c.isascii() for c in chars) else 1 << 16
    return size


def check_token(text: str, origin: str) -> None:
    """Refuse a token that cannot carry MIN_BITS bits: fewer characters than the alphabet
    it is written in needs (32 hex digits, 22 of base64, 20 printable ASCII), or fewer than
    MIN_DISTINCT distinct ones. The length is an upper bound on what a token carries: a
    token a person made up carries far less than its length suggests."""
    distinct = len(set(text))
    bits = len(text) * math.log2(max(2, _alphabet(text)))
    if bits >= MIN_BITS and distinct >= MIN_DISTINCT:
        return
    why = (
        f"{len(text)} characters of that kind carry at most {bits:.0f} bits"
        if bits < MIN_BITS
        else f"it repeats {distinct} distinct characters"
    )
    raise IPCError(
        f"ipc: the token from {origin} is too weak to be the job's secret: {why}, and at "
        f"least {MIN_BITS} random bits are needed (a listener's keys derive from it: a "
        "guessable token lets anyone who saw one connection attempt find it offline). "
        "Make one with `python -c 'import secrets; print(secrets.token_hex(32))'`"
    )


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
