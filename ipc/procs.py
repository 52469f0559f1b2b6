"""Process facts from Linux's /proc: a process's start time, whether it lives, and runs.

A pid alone does not name a process for long: pids are reused. With its start time
(`start_ticks`, clock ticks since boot) it does, which is how the runtime directory's
records (a node 0's, a server's, a work queue owner's) are checked against the
process that wrote them (`pid_alive`, `running`). Elsewhere than Linux they know less
(a start time of None), which only turns those checks off.
"""

from __future__ import annotations

import os

__all__ = ["pid_alive", "running", "start_ticks"]


def _stat(pid: int | str) -> tuple[bytes, int, int] | None:
    """(state, parent pid, start time in clock ticks since boot) of a process, or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        fields = stat[stat.rindex(b")") + 2 :].split()
        return fields[0], int(fields[1]), int(fields[19])
    except (OSError, ValueError, IndexError):
        return None


def start_ticks(pid: int | str = "self") -> int | None:
    """A process's start time in clock ticks since boot (None if unknown): with its pid,
    what names a process across pid reuse."""
    stat = _stat(pid)
    return None if stat is None else stat[2]


def pid_alive(pid: object) -> bool:
    """Whether a process `pid` exists (another user's counts; a zombie too)."""
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def running(pid: object, start: object) -> bool:
    """Whether process `pid`, started at `start` (ticks), is there and neither stopped
    (SIGSTOP, a debugger) nor dead (a zombie its parent has not reaped)."""
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return False
    stat = _stat(pid)
    return stat is not None and stat[0] in (b"R", b"S", b"D", b"I") and stat[2] == start


def _cmdline(pid: int | str) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    return raw.decode(errors="replace").split("\0")[:-1] if raw else None
