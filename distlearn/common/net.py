"""Whether a host names this machine's loopback interface, and nothing reachable from
elsewhere: the test that decides whether a listener needs a secret.

A host is loopback when it is a loopback address written out (``127.0.0.0/8``,
``::1``, ``::ffff:127.0.0.1``; IPv6 in brackets too) or the name ``localhost``, whose
every address this machine's resolver gives is one of those. Nothing else is, even
where it resolves to loopback here: this machine's own name (``/etc/hosts`` on Debian
maps it to ``127.0.1.1``) is the name other machines reach it by, so a root named by it
is reached across hosts, and a listener named by it needs the secret a listener
beyond this host needs. So no name but ``localhost`` is looked up: a DNS answer is
not this machine's to vouch for.
"""

from __future__ import annotations

import ipaddress
import socket

__all__ = ["is_loopback"]


def is_loopback(host: str) -> bool:
    """Whether `host` names this machine's loopback interface only.

    Args:
        host: An address or host name, as a user gives it (``"127.0.0.1"``, ``"::1"``,
            ``"[::1]"``, ``"localhost"``, ``"gpu03"``).

    Returns:
        True for a loopback address and for ``localhost`` (where it resolves to
        loopback addresses only); False for every other name, this machine's own
        included, and for anything that is not a host.
    """
    if not isinstance(host, str):
        return False
    text = host.strip()
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1]
    try:
        return _loopback_address(ipaddress.ip_address(text))
    except ValueError:
        pass
    if text.lower().rstrip(".") != "localhost":
        return False
    try:
        found = socket.getaddrinfo("localhost", None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        return False
    return bool(found) and all(
        _loopback_address(ipaddress.ip_address(addr[4][0].split("%", 1)[0])) for addr in found
    )


def _loopback_address(addr: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    mapped = getattr(addr, "ipv4_mapped", None)
    return (mapped or addr).is_loopback
