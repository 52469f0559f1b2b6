"""A child process that dies with its parent, however the parent dies (SIGKILL too).

Linux offers two ways, and each fails somewhere:

- ``prctl(PR_SET_PDEATHSIG)`` signals the child when the *thread* that forked it
  ends, not the process: a child forked from a thread pool's thread died with that
  thread. It is kept across ``exec``, so it is the way for a child that execs next
  (``subprocess.Popen(preexec_fn=...)``).
- a pidfd of the parent (Linux 5.3 and later) becomes readable when the parent
  *process* has exited: a thread of the child that waits on it ends the child. A
  thread does not survive ``exec``, so it is the way for a child that runs on in Python
  (a forked worker).

:func:`die_with_parent` takes the second where it can and the first where it must, and
ends the child at once where the parent died before either was in place.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import signal
import threading

__all__ = ["die_with_parent"]

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int, sig: int = signal.SIGKILL, *, before_exec: bool = False) -> None:
    """Have this process sent `sig` when process `parent` ends.

    Call it first thing in the child (a forked worker, or ``preexec_fn``).

    Args:
        parent: The parent's pid, as the parent read it before it forked (``os.getpid()``
            there): a parent that is already gone is seen by ``os.getppid()`` differing.
        sig: What the child is sent: SIGKILL (nothing of it runs on), or SIGTERM for a
            child that cleans up on it.
        before_exec: The child execs next: the death signal (kept across exec), not a
            thread (lost at exec).

    The child exits at once (status 0 with a `sig` it would clean up on, else 1) when
    the parent has already ended. Elsewhere than Linux only that check is made: the
    parent's own cleanup still applies.
    """
    fd = None
    if not before_exec:
        with contextlib.suppress(AttributeError, OSError):  # (Linux < 5.3; the parent gone)
            fd = os.pidfd_open(parent)
    if fd is not None:
        threading.Thread(target=_watch, args=(fd, sig), name="die with parent", daemon=True).start()
    else:
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, sig)
    if os.getppid() != parent:  # it ended before the watch was set (its pid reused, even)
        os._exit(0 if sig == signal.SIGTERM else 1)


def _watch(fd: int, sig: int) -> None:
    select.select([fd], [], [])  # readable once the parent process has exited
    os.kill(os.getpid(), sig)
