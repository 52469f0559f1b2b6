"""Shared fixtures: real servers and processes, always cleaned up."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# A suite started in the background of a non-interactive shell (`tests/run.sh &`) inherits
# SIGINT ignored, and Python then never raises KeyboardInterrupt: the Ctrl-C tests need it
# back, here and in the processes the tests start (a handler becomes SIG_DFL across exec).
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


# The fast tier (tests/run.sh --fast): the functions tests/heavy.txt lists are marked
# `heavy` and left out. The list is made from a timed run (tests/heavy.py says how).
_HEAVY_LIST = Path(__file__).with_name("heavy.txt")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    with open(_HEAVY_LIST) as f:
        names = {line.strip() for line in f if line.strip() and not line.startswith("#")}
    for item in items:
        if item.nodeid.split("[", 1)[0] in names:
            item.add_marker(pytest.mark.heavy)


def repo_env(**extra: str) -> dict[str, str]:
    """The environment for child processes: this checkout first on PYTHONPATH."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A fresh directory (0700) right under /tmp, removed afterwards: a TMPDIR whose Unix
    socket paths stay under their 107 bytes, where tmp_path's do not (longer still under
    pytest-xdist's popen-gwN)."""
    path = Path(tempfile.mkdtemp(prefix="dlt-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def shm_files(pid: int) -> set[str]:
    """The files in /dev/shm that process `pid` maps.

    A test asks this of its own processes, not of /dev/shm as a whole: that is
    shared with whatever else runs here (another test worker's trees, too).
    """
    with open(f"/proc/{pid}/maps") as f:
        return {line.split(None, 5)[5].strip() for line in f if " /dev/shm/" in line}


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (from /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            if int(stat.rpartition(")")[2].split()[1]) == pid:
                out.append(int(entry))
    return out


def wait_for_file(path: Path, proc: subprocess.Popen, timeout: float = 30.0) -> str:
    """Wait until `proc` writes `path`; fail fast if it dies first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            return path.read_text().strip()
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode} before writing {path}")
        time.sleep(0.02)
    raise TimeoutError(f"{proc.args!r} did not write {path} within {timeout}s")


@pytest.fixture
def serve_dir(tmp_path_factory):
    """Start `python -m distlearn.dataset.serve DIR` in a subprocess; returns its base URL."""
    procs: list[subprocess.Popen] = []
    tmp = tmp_path_factory.mktemp("serve")

    def start(root: str | os.PathLike, port: int = 0, *args: str) -> str:
        port_file = tmp / f"port-{len(procs)}"
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "distlearn.dataset.serve",
                str(root),
                "--port",
                str(port),
                "--port-file",
                str(port_file),
                *args,
            ],
            env=repo_env(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        procs.append(proc)
        bound = wait_for_file(port_file, proc)
        return f"http://127.0.0.1:{bound}/"

    yield start
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
