"""Process-tree accounting from /proc: CPU seconds and memory of a process and its descendants.

Benchmarked loaders fork workers, so a figure for one pid would hide most of the
cost. Memory is reported as PSS (proportional set size) summed over the tree, so
pages shared by forked workers (torch's libraries) are counted once, and as the
plain RSS sum, which double-counts them. Linux only, like the rest of the bench.
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field

CLK_TCK = os.sysconf("SC_CLK_TCK")


def children_of() -> dict[int, list[int]]:
    """Map ppid -> child pids for every process on the host."""
    kids: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # field 2 (comm) may hold spaces or parens: split after its closing paren
        ppid = int(stat[stat.rindex(b")") + 2 :].split()[1])
        kids.setdefault(ppid, []).append(int(name))
    return kids


def tree(pid: int) -> list[int]:
    """`pid` and all its live descendants."""
    kids = children_of()
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(kids.get(p, ()))
    return out


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of one live process (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return 0.0
    fields = stat[stat.rindex(b")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds of `pid`'s live tree, not counting descendants already reaped."""
    return sum(cpu_seconds(p) for p in tree(pid))


def own_cpu_seconds() -> float:
    """This process, its reaped children and its live descendants: all CPU it caused."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    live = sum(cpu_seconds(p) for p in tree(os.getpid())[1:])
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime + live


def memory_kib(pid: int) -> tuple[int, int]:
    """(RSS, PSS) of one process in KiB, (0, 0) if it is gone."""
    rss = pss = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Rss:"):
                    rss = int(line.split()[1])
                elif line.startswith("Pss:"):
                    pss = int(line.split()[1])
    except OSError:
        pass
    return rss, pss


@dataclass
class MemorySampler:
    """Samples the memory of a process tree in a thread and keeps the peaks."""

    pid: int
    interval: float = 0.05
    peak_rss_kib: int = 0
    peak_pss_kib: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def sample(self) -> None:
        rss = pss = 0
        for p in tree(self.pid):
            r, s = memory_kib(p)
            rss += r
            pss += s
        self.peak_rss_kib = max(self.peak_rss_kib, rss)
        self.peak_pss_kib = max(self.peak_pss_kib, pss)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def __enter__(self) -> MemorySampler:
        self._thread = threading.Thread(target=self._run, name="mem-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


def kill_group(proc: subprocess.Popen, grace: float = 5.0) -> None:
    """Stop a child started with start_new_session=True and everything it started."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace)
    with contextlib.suppress(ProcessLookupError):  # workers that outlived their parent
        os.killpg(proc.pid, signal.SIGKILL)
    if proc.poll() is None:
        proc.wait()


def wait_port(host: str, port: int, proc: subprocess.Popen | None, timeout: float = 20.0) -> None:
    """Block until something accepts TCP connections on (host, port)."""
    import socket

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode} before listening")
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listens on {host}:{port} after {timeout}s")


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (for servers that cannot report the one they took)."""
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
