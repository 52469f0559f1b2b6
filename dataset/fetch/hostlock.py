"""A lock between the processes of one host that a frozen holder cannot hold forever.

The cache's locks only keep processes from doing the same work twice (parsing
one index, downloading one part file) and its ledger consistent; every entry
is written whole before it has its name, so correctness never depends on
them. A plain ``flock`` makes every other process wait while its holder runs,
and also while it is stopped (SIGSTOP, a debugger, a shell's Ctrl-Z): the
ranks of a job then hang at ``Dataset(...)``, before the collectives that
would name the frozen peer. So the holder writes its pid in the lock file, and
a waiter that sees that process stopped for :data:`STOPPED_GRACE` seconds
goes on without the lock, with a warning naming it. A holder that works, however
long, is waited for, and named every :data:`REPORT_EVERY` seconds.

    with HostLock(path, "the index cache for train.csv") as held:
        ...   # held: False where the holder was frozen and we went on without it
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import time

__all__ = ["REPORT_EVERY", "STOPPED_GRACE", "HostLock"]

log = logging.getLogger("distlearn.dataset.fetch.cache")

# A holder seen stopped for this long is gone on without.
STOPPED_GRACE = 2.0
# A waiter says whom it waits for this often.
REPORT_EVERY = 60.0
# A lock file that cannot be made for these is gone on without (it only saves work).
_NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)


class HostLock:
    """An exclusive ``flock`` on `path` (created 0600), its holder's pid written in it.

    A context manager: ``__enter__`` returns True once held, False where the holder
    was stopped for :data:`STOPPED_GRACE` seconds (then nothing is held). One object
    for one ``with``; a process (or thread) takes its own.
    """

    def __init__(self, path: str, what: str):
        self.path, self.what = path, what
        self._fd: int | None = None

    def __enter__(self) -> bool:
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as err:
            if err.errno not in _NO_ROOM:
                raise
            # a full disk: the lock only saves repeated work, so go on without it
            log.debug("%s: no lock file (%s); going on without it", self.what, err.strerror)
            return False
        try:
            held = self._wait(fd)
        except BaseException:
            os.close(fd)
            raise
        if not held:
            os.close(fd)
            return False
        self._fd = fd
        with contextlib.suppress(OSError):  # (the pid is advisory: a full disk refuses it)
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return True

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)  # (no pid left behind for a waiter to look up)
            fcntl.flock(fd, fcntl.LOCK_UN)  # (before close: a forked child may share it)
            os.close(fd)

    def _wait(self, fd: int) -> bool:
        start = reported = time.monotonic()
        stopped_since = None
        pause = 0.001
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                pass
            now = time.monotonic()
            pid = _holder(fd)
            if pid is not None and _stopped(pid):
                stopped_since = now if stopped_since is None else stopped_since
                if now - stopped_since >= STOPPED_GRACE:
                    log.warning("%s: process %d holds its lock and is stopped; going on "
                                "without it", self.what, pid)  # fmt: skip
                    return False
            else:
                stopped_since = None
            if now - reported >= REPORT_EVERY:
                reported = now
                who = "an unknown process" if pid is None else f"process {pid}"
                log.warning("%s: waited %.0f s for %s, which holds its lock",
                            self.what, now - start, who)  # fmt: skip
            time.sleep(pause)
            pause = min(pause * 2, 0.05)


def _holder(fd: int) -> int | None:
    """The pid the holder wrote in the lock file (None: not yet, or not a pid)."""
    try:
        text = os.pread(fd, 32, 0)
    except OSError:
        return None
    try:
        pid = int(text)
    except ValueError:
        return None
    return pid if pid > 0 else None


def _stopped(pid: int) -> bool:
    """Whether process `pid` of this host is stopped (state T: a signal; t: a tracer).
    False where it cannot be told (no /proc, or a pid of another pid namespace)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    state = stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3]  # (the name may hold ")")
    return state in (b"T", b"t")
