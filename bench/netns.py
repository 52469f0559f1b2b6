"""Hosts on one machine: network namespaces on a bridge, each link limited to a rate.

    with hosts(4, "1gbit") as hs:        # [(namespace, address), ...]
        ...                              # in a child process: enter(hs[k][0]) first

Each namespace has one interface, `eth0`, with the address 10.<a>.<b>.<k+1>/24, a
veth whose other end is on a bridge in this namespace; both ends send through tbf
at `rate`, so what leaves a "host" and what reaches it are each limited like one
machine's link. They share this machine's kernel and cores: the bandwidth of
separate machines, not their CPUs, nor their latency (no netem here). A process
that enters a host also takes that host's own temporary folder (TMPDIR), as separate
machines share no /tmp: otherwise ipc finds a server's record in its runtime folder
and talks to it over a Unix socket, never crossing the link. Needs root and iproute2
(`ip`, `tc`); everything is removed on the way out.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator

CLONE_NEWNET = 0x40000000
IFNAME = "eth0"  # the interface inside every namespace (GLOO_SOCKET_IFNAME)
_jobs = itertools.count()


def missing() -> str | None:
    """Why namespaces cannot be made here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"{tool} (iproute2) is not installed"
    return None


def _run(*cmd: str) -> None:
    """An iproute2 command; its own message if it fails."""
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {done.stderr.strip() or done.returncode}")


def burst(rate: str) -> str:
    """tbf's bucket: 2 ms of bytes at `rate` (at least 64 KiB), over a timer tick's worth."""
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
    for unit, scale in units.items():
        number = rate.removesuffix(unit)
        if number != rate and number.replace(".", "", 1).isdigit() and float(number) > 0:
            return f"{max(64 << 10, int(float(number) * scale / 8 / 500))}b"
    raise ValueError(f"rate must be a number ending in one of {sorted(units)}, e.g. 1gbit, "
                     f"not {rate!r}")  # fmt: skip


@contextlib.contextmanager
def hosts(n: int, rate: str) -> Iterator[list[tuple[str, str]]]:
    """`n` namespaces joined by a bridge through links of `rate`; [(name, address)]."""
    why = missing()
    if why:
        raise RuntimeError(why)
    bucket = burst(rate)
    # names of their own per call: the kernel frees a deleted namespace's veth later,
    # so the same names again right away can still be taken
    job = next(_jobs)
    tag = f"{os.getpid()}{job}"
    net = f"10.{100 + os.getpid() % 100}.{job % 250}"
    bridge = f"bd{tag}"
    made: list[str] = []
    try:
        _run("ip", "link", "add", bridge, "type", "bridge")
        _run("ip", "link", "set", bridge, "up")
        out = []
        for k in range(n):
            name, veth = f"dl{tag}-{k}", f"vd{tag}-{k}"
            _run("ip", "netns", "add", name)
            made.append(name)
            _run("ip", "link", "add", veth, "type", "veth", "peer", "name", IFNAME, "netns", name)
            _run("ip", "link", "set", veth, "master", bridge)
            _run("ip", "link", "set", veth, "up")
            _run("ip", "-n", name, "addr", "add", f"{net}.{k + 1}/24", "dev", IFNAME)
            _run("ip", "-n", name, "link", "set", IFNAME, "up")
            _run("ip", "-n", name, "link", "set", "lo", "up")
            shape = ("root", "tbf", "rate", rate, "burst", bucket, "latency", "50ms")
            _run("tc", "qdisc", "add", "dev", veth, *shape)  # into the host
            _run("tc", "-n", name, "qdisc", "add", "dev", IFNAME, *shape)  # out of it
            out.append((name, f"{net}.{k + 1}"))
        yield out
    finally:
        for name in made:  # takes its end of the veth, and so the pair, with it
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
            shutil.rmtree(host_tmp(name), ignore_errors=True)
        subprocess.run(["ip", "link", "del", bridge], capture_output=True)


def host_tmp(name: str) -> str:
    """The temporary folder of host `name` (see `enter`)."""
    return os.path.join(tempfile.gettempdir(), f"{name}-tmp")


def enter(name: str) -> None:
    """Move this process into namespace `name` (before it opens any socket) and onto
    that host's temporary folder (TMPDIR, made 0700 by the first process to enter)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {name}: {os.strerror(err)}")
    finally:
        os.close(fd)
    os.environ["GLOO_SOCKET_IFNAME"] = IFNAME
    tmp = host_tmp(name)
    with contextlib.suppress(FileExistsError):
        os.mkdir(tmp, 0o700)
    os.environ["TMPDIR"] = tmp
    tempfile.tempdir = None  # gettempdir() reads TMPDIR again
