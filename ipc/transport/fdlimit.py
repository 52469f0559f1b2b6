"""A server's budget of open files.

Each same-host client costs a server three open files: its ZeroMQ connection, its
direct socket (ipc.services.direct) and the mapping of its shared-memory arena
(ipc.services.bulk). A process out of files is not merely refused a file: libzmq 4.3's Unix-socket
listener aborts the whole process when accept() fails with EMFILE (an assertion in
src/ipc_listener.cpp; its TCP listener does not). So a server

1. raises its soft limit to the hard one when it starts (the default soft limit of
   1024 exists for select(), which distlearn does not use; systemd's advice is that
   a program that needs more files raises it itself), and
2. keeps RESERVE of its files free for libzmq: it refuses a client by name when its
   open files reach `limit() - reserve()`, and takes no direct socket past that.

A burst of more clients at once than the reserve can still exhaust the files in
libzmq's own accepts; the reserve is sized for the bursts that a file limit of that
size suggests.
"""

from __future__ import annotations

import logging
import os
import resource

__all__ = [
    "MAX_SOFT",
    "backlog",
    "full_reason",
    "limit",
    "open_files",
    "raise_limit",
    "reserve",
    "room",
]

log = logging.getLogger(__name__)

MAX_SOFT = 1 << 20  # what we raise the soft limit to at most
_raised = False


def limit() -> int:
    """The process's soft limit on open files."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return MAX_SOFT if soft == resource.RLIM_INFINITY else soft


def reserve() -> int:
    """Files kept free for libzmq's accepts and the user's own: an eighth of the limit,
    at least 32."""
    return max(32, limit() // 8)


def backlog() -> int:
    """A listening socket's queue for a burst of clients: a quarter of the file limit,
    from libzmq's default of 100 up to 4096 (the kernel caps it at net.core.somaxconn).
    Past it a Unix socket's connect fails at once (EAGAIN), and a ZeroMQ client reads
    that as nothing listening there."""
    return max(100, min(4096, limit() // 4))


def open_files() -> int:
    """How many files this process has open now (0 where /proc is not there)."""
    try:
        return len(os.listdir("/proc/self/fd")) - 1  # less the one listdir itself opened
    except OSError:
        return 0


def room(open_now: int | None = None) -> int:
    """Files that may still be opened before the reserve."""
    return limit() - reserve() - (open_files() if open_now is None else open_now)


def raise_limit() -> None:
    """Raise the soft limit to the hard one (at most MAX_SOFT), once per process."""
    global _raised
    if _raised:
        return
    _raised = True
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard if hard != resource.RLIM_INFINITY else MAX_SOFT, MAX_SOFT)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            log.debug("ipc: raised the open-file limit from %d to %d", soft, want)
        except (OSError, ValueError) as err:
            log.debug("ipc: could not raise the open-file limit from %d: %s", soft, err)


def full_reason(who: str = "the server") -> str | None:
    """Why `who` takes no more clients now (None: it has room for one)."""
    open_now = open_files()
    if room(open_now) >= 3:  # a client's three files
        return None
    return (
        f"it is at its limit of open files ({open_now} open of {limit()}, "
        f"{reserve()} kept free): raise `ulimit -n` where {who} runs"
    )
