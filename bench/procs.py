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


def _children(pid: int) -> list[int] | None:
    """Direct children from /proc/PID/task/*/children (cheap), None where the kernel lacks it."""
    out: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out.extend(int(x) for x in f.read().split())
    except FileNotFoundError:
        return None if os.path.exists(f"/proc/{pid}") else []
    except OSError:
        return []
    return out


def tree(pid: int) -> list[int]:
    """`pid` and all its live descendants."""
    out, todo = [], [pid]
    kids: dict[int, list[int]] | None = None
    while todo:
        p = todo.pop()
        out.append(p)
        direct = _children(p) if kids is None else None
        if direct is None:  # no children files: one scan of every process instead
            kids = kids if kids is not None else children_of()
            direct = kids.get(p, [])
        todo.extend(direct)
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


PAGE_KIB = os.sysconf("SC_PAGE_SIZE") // 1024


def rss_kib(pid: int) -> int:
    """Resident set of one process in KiB (cheap: /proc/PID/statm), 0 if it is gone."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * PAGE_KIB
    except (OSError, IndexError):
        return 0


def pss_kib(pid: int) -> int:
    """Proportional set of one process in KiB, 0 if it is gone.

    Costly (the kernel walks the page tables: tens of ms for a torch process),
    so samplers read it far less often than RSS.
    """
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


@dataclass
class MemorySampler:
    """Samples the memory of a process tree in a thread and keeps the peaks.

    RSS every `interval` s; PSS every `pss_interval` s, and sooner when the RSS
    sum reaches a new high, so its peak is caught without the sampler itself
    taking a noticeable share of the cores it measures.
    """

    pid: int
    interval: float = 0.1
    pss_interval: float = 1.0
    peak_rss_kib: int = 0
    peak_pss_kib: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _last_pss: float = 0.0

    def sample(self, force_pss: bool = False) -> None:
        pids = tree(self.pid)
        rss = sum(rss_kib(p) for p in pids)
        now = time.monotonic()
        new_high = rss > self.peak_rss_kib and now - self._last_pss >= self.pss_interval / 4
        if force_pss or new_high or now - self._last_pss >= self.pss_interval:
            self._last_pss = now
            self.peak_pss_kib = max(self.peak_pss_kib, sum(pss_kib(p) for p in pids))
        self.peak_rss_kib = max(self.peak_rss_kib, rss)

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


def wait_ranks(procs: list[subprocess.Popen], timeout: float) -> list[str] | None:
    """Wait for every rank under one deadline, kill their groups whatever happens, and
    return each rank's output (`stdout=PIPE`, text); None if the deadline passed."""
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        return None
    finally:
        for p in procs:
            kill_group(p)
    logs = [p.stdout.read() for p in procs]
    for p in procs:
        p.stdout.close()
    return logs


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
