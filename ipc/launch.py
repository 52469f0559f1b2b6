"""What tells the processes of one launch from those of another, without a key.

Processes that one parent (a shell script, a Python driver) starts side by side meet
under a key derived from the parent's pid (see `ipc.rendezvous.Localhost`). The same
parent may run several launches, so node 0 admits a process only if it looks like one of
its own: started within LAUNCH_WINDOW_S of node 0, with the same command line up to its
node index (`same_command_line`), and, when the parent runs more processes like these
than the launch has nodes (`twin_launch`: two launches of one script at once, a sweep
told apart by environment variables), with the same environment and working directory
up to its node index (`environment_digests`, `environment_differs`).

Also the process facts that the runtime directory's records are checked against:
`start_ticks`, `pid_alive`, `running`. Linux's /proc; elsewhere they know less (a start
time of None, no siblings found), which only turns the checks off.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re

# Processes of one launch by a shell or a Python parent start within this many seconds
# of each other; a node 0 that started further away belongs to another launch.
LAUNCH_WINDOW_S = 30.0

# Variables a launcher sets to a value of its own in each process (not only the node
# index); `_` is what a shell sets to the command's path or last argument.
_PER_PROCESS_ENV = ("SLURM_", "PMI_", "PMIX_", "OMPI_", "HYDRA_", "I_MPI_", "MV2_")


# ---- process facts ------------------------------------------------------------------


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


# ---- command lines ------------------------------------------------------------------


def _blank(text: str, index: int) -> str:
    """`text` with the number `index` blanked where it stands whole ("w-1.log", not "10")."""
    return re.sub(rf"(?<!\d){index}(?!\d)", "#", text)


def same_command_line(root: list[str], other: list[str], index: int) -> bool:
    """True when two command lines differ only where each names its own node index.

    `w.py 0 4 out` and `w.py 2 4 out` are one launch; `w.py 0 4 outA` and
    `w.py 1 4 outB` are two. Only positions that differ are compared, after
    the node's own index (as a whole number) is blanked in each."""
    if len(root) != len(other):
        return False
    return all(a == b or _blank(a, 0) == _blank(b, index) for a, b in zip(root, other, strict=True))


def _shape(argv: list[str]) -> list[str]:
    """A command line with every number blanked: what the nodes of one launch share."""
    return [re.sub(r"\d+", "#", a) for a in argv]


def twin_launch(start: int, hz: int, num_nodes: int) -> bool:
    """Whether this process's parent runs more processes with a command line like this
    one's (numbers aside), started within LAUNCH_WINDOW_S of `start`, than a launch of
    `num_nodes` has: another launch of it beside this one.

    One look at every process's /proc entry (about 2 ms for 65 processes)."""
    mine = _cmdline("self")
    if mine is None:
        return False
    ppid, shape, count = os.getppid(), _shape(mine), 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        stat = _stat(pid)
        if stat is None or stat[1] != ppid or abs(stat[2] - start) / hz > LAUNCH_WINDOW_S:
            continue
        argv = _cmdline(pid)
        count += argv is not None and _shape(argv) == shape
    return count > num_nodes


# ---- environments -------------------------------------------------------------------


def _environment() -> dict[str, str]:
    """This process's environment and working directory, as a launch's nodes share them."""
    env = {k: v for k, v in os.environ.items() if k != "_" and not k.startswith(_PER_PROCESS_ENV)}
    with contextlib.suppress(OSError):  # (a directory removed under us)
        env["(cwd)"] = os.getcwd()
    return env


def _digest(name: str, value: str) -> str:
    return hashlib.blake2b(f"{name}={value}".encode(errors="replace"), digest_size=4).hexdigest()


def environment_digests(index: int) -> dict[str, str]:
    """What a joiner tells node 0 of its environment (see `environment_differs`): an
    8-hex digest of each variable, and of each variable with the node's index blanked
    where that changes it; each set as one string, so a JOIN stays small (a few KiB
    for hundreds of variables)."""
    env = _environment()
    raw = "".join(sorted(_digest(k, v) for k, v in env.items()))
    blanked = "".join(
        sorted(_digest(k, _blank(v, index)) for k, v in env.items() if _blank(v, index) != v)
    )
    return {"raw": raw, "blanked": blanked}


def _digest_set(text: object) -> set[str] | None:
    if not isinstance(text, str) or len(text) % 8 or not re.fullmatch(r"[0-9a-f]*", text):
        return None
    return {text[i : i + 8] for i in range(0, len(text), 8)}


def environment_differs(theirs: object) -> str | None:
    """Why a joiner's environment (its `environment_digests`) is not node 0's (this
    process's), or None: every variable must be equal, or equal once each side's node
    index is blanked (RANK=0 and RANK=2), as `same_command_line` compares arguments."""
    raw = _digest_set(theirs.get("raw")) if isinstance(theirs, dict) else None
    blanked = _digest_set(theirs.get("blanked")) if isinstance(theirs, dict) else None
    if raw is None or blanked is None:
        return "it sent no environment"
    env = _environment()
    differ = sorted(
        k
        for k, v in env.items()
        if _digest(k, v) not in raw and _digest(k, _blank(v, 0)) not in blanked
    )
    extra = len(raw) - len(env)  # each of ours matched one of theirs, or is in `differ`
    if not differ and extra <= 0:
        return None
    what = ", ".join(differ[:5]) + (" ..." if len(differ) > 5 else "")
    if extra > 0:
        what += f"{' and ' if differ else ''}{extra} variable(s) node 0 has not"
    return f"its environment differs from node 0's in {what}"
