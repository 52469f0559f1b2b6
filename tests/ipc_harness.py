"""Running real ipc trees from tests: worker processes started side by side, always cleaned up."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import ipc_workers
import pytest
import torch
from conftest import repo_env

WORKER = Path(__file__).with_name("ipc_workers.py")
# shm: same-host shared memory; sockets: the ZeroMQ tree (what crosses hosts).
TRANSPORTS = [pytest.param(True, id="shm"), pytest.param(False, id="sockets")]


def read_server_until(server, done, seconds: float) -> None:
    """Read `server` (what comes is dropped) until `done()` or `seconds` pass: a client's
    close() waits, up to 5 s, for the server to take its goodbye, and a server no longer
    read would make each test wait so."""
    from distlearn import ipc

    until = time.monotonic() + seconds
    while not done() and time.monotonic() < until:
        with contextlib.suppress(ipc.IPCError):
            server.recv_any(timeout=0.05, skip_dead=True)


def _forkserver():
    """Workers fork from a server that imported torch once: a 2-core box cannot afford
    a fresh torch import per node per test."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "ipc_workers"])
    return ctx


def run_tree(
    scenario: str,
    n: int,
    tmp_path: Path,
    timeout: float = 180,
    key: str | None = None,
    ipc_timeout: float | str = 60,  # generous: a loaded CI box can stall a node for seconds
    expect_rc: dict[int, int] | None = None,
    shm: bool = True,
    extra_env: list[dict[str, str]] | None = None,
    kill_last: tuple[int, ...] = (),
) -> tuple[list[dict | None], list[str]]:
    """Start n worker processes side by side, wait for all, always clean up; results per node.

    Nodes in `kill_last` (frozen on purpose) are SIGKILLed once every other node has
    exited, and are expected to exit -9."""
    key = key or f"test-{uuid.uuid4().hex[:8]}"
    ctx = _forkserver()
    procs = []
    try:
        for i in range(n):
            env = extra_env[i] if extra_env else None
            args = (scenario, i, n, str(tmp_path), key, ipc_timeout, shm, env)
            procs.append(ctx.Process(target=ipc_workers.entry, args=args, daemon=True))
            procs[-1].start()
        deadline = time.monotonic() + timeout
        for i, p in enumerate(procs):
            if i not in kill_last:
                p.join(timeout=max(0.1, deadline - time.monotonic()))
        for i in kill_last:
            procs[i].kill()
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
    rc = dict(expect_rc or {})
    rc.update({i: -9 for i in kill_last})
    return collect(tmp_path, [p.exitcode for p in procs], rc)


def collect(tmp_path: Path, codes: list, expect_rc: dict[int, int] | None = None):
    logs = [tmp_path / f"log-{i}.txt" for i in range(len(codes))]
    texts = [log.read_text() if log.exists() else "" for log in logs]
    results = []
    for i, code in enumerate(codes):
        want = (expect_rc or {}).get(i, 0)
        assert code == want, f"node {i} exited {code}:\n{texts[i]}"
        path = tmp_path / f"result-{i}.pt"
        results.append(torch.load(path, weights_only=False) if path.exists() else None)
    return results, texts


def local_reduce(op, tensors: list[torch.Tensor]) -> torch.Tensor:
    acc = tensors[0].clone()
    for t in tensors[1:]:
        acc = op(acc, t)
    return acc


def start_worker(
    scenario: str,
    node: int,
    n: int,
    outdir: Path,
    key: str = "-",
    env: dict[str, str] | None = None,
    preexec_fn=None,
) -> subprocess.Popen:
    """One worker as a fresh process (`python tests/ipc_workers.py ...`), its output in
    OUTDIR/log-NODE.txt; for tests that need an environment of their own per process."""
    log = open(outdir / f"log-{node}.txt", "wb")  # noqa: SIM115 (the child holds it)
    try:
        return subprocess.Popen(
            [sys.executable, str(WORKER), scenario, str(node), str(n), str(outdir), key],
            env=repo_env(**(env or {})),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=preexec_fn,
        )
    finally:
        log.close()


def wait_all(procs: list[subprocess.Popen], timeout: float) -> list[int | None]:
    """Wait for every process; SIGKILL (its whole session) whatever is left at the timeout."""
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return [p.returncode for p in procs]


@pytest.fixture
def netns_pair():
    """Two network namespaces joined by a veth pair (10.77.0.1 <-> 10.77.0.2); needs root."""
    if os.geteuid() != 0 or not shutil.which("ip"):
        pytest.skip("needs root and iproute2")
    tag = uuid.uuid4().hex[:6]
    names = [f"dlipc{tag}a", f"dlipc{tag}b"]
    veth = [f"dl{tag}a", f"dl{tag}b"]

    def ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True, timeout=20)

    try:
        for ns in names:
            ip("netns", "add", ns)
        ip("link", "add", veth[0], "type", "veth", "peer", "name", veth[1])
        for k in range(2):
            ip("link", "set", veth[k], "netns", names[k])
            ip("-n", names[k], "addr", "add", f"10.77.0.{k + 1}/24", "dev", veth[k])
            ip("-n", names[k], "link", "set", veth[k], "up")
            ip("-n", names[k], "link", "set", "lo", "up")
    except (subprocess.CalledProcessError, OSError) as exc:
        for ns in names:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        pytest.skip(f"ip netns unusable here: {exc}")
    yield names
    for ns in names:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)


@pytest.fixture
def netns_line():
    """Three network namespaces in a line, A - R - B, R forwarding nothing: host A
    (10.77.1.1) and host B (10.77.2.2) reach each other only through a process in R
    (10.77.1.254 towards A, 10.77.2.254 towards B), like a proxy on the path between two
    hosts. Needs root."""
    if os.geteuid() != 0 or not shutil.which("ip"):
        pytest.skip("needs root and iproute2")
    tag = uuid.uuid4().hex[:6]
    names = {k: f"dlipc{tag}{k}" for k in "arb"}

    def ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True, timeout=20)

    try:
        for ns in names.values():
            ip("netns", "add", ns)
            ip("-n", ns, "link", "set", "lo", "up")
        for side, net in (("a", 1), ("b", 2)):
            near, far = f"dl{tag}{side}0", f"dl{tag}{side}1"
            ip("link", "add", near, "type", "veth", "peer", "name", far)
            ip("link", "set", near, "netns", names[side])
            ip("link", "set", far, "netns", names["r"])
            ip("-n", names[side], "addr", "add", f"10.77.{net}.{net}/24", "dev", near)
            ip("-n", names["r"], "addr", "add", f"10.77.{net}.254/24", "dev", far)
            ip("-n", names[side], "link", "set", near, "up")
            ip("-n", names["r"], "link", "set", far, "up")
    except (subprocess.CalledProcessError, OSError) as exc:
        for ns in names.values():
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        pytest.skip(f"ip netns unusable here: {exc}")
    yield names
    for ns in names.values():
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)
