"""Real schedulers for the slow tier: a one-node Slurm cluster and torchrun's elastic agent.

``slurm`` (a fixture) brings up the cluster of ``scripts/slurm-cluster.sh`` once per
test process and stops it when the last test process that holds it is done; a test
gets a :class:`Slurm` whose jobs are cancelled when the test ends, pass or fail. It
skips, saying why, where it cannot run: not root, or Slurm missing with no apt-get
to install it (or apt-get failing). Any other failure to start is an error, not a
skip: a cluster that should come up and does not is a bug to see.

``torchrun`` (a fixture) starts torchrun agents as process groups and kills every one
left when the test ends.

A test module takes the fixtures with ``pytest_plugins = ("tests.cluster",)``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO, repo_env

SCRIPT = REPO / "scripts" / "slurm-cluster.sh"
PYTHON = sys.executable


def free_port() -> int:
    """A TCP port on 127.0.0.1 nobody listens on now (and, as far as one can tell, the
    next one too: torchrun's MASTER_PORT + 1 is the tree's)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no two free ports in a row on 127.0.0.1")


def _cannot(reason: str) -> None:
    pytest.skip(f"no Slurm cluster: {reason}")


class Slurm:
    """The cluster as a test uses it: ``env`` for its clients (SLURM_CONF, this checkout
    on PYTHONPATH), and the commands with a timeout each."""

    def __init__(self, conf: str):
        self.env = repo_env(SLURM_CONF=conf)
        self.jobs: list[str] = []
        self.free_port = free_port

    def run(self, *args: str, timeout: float = 60, check: bool = True, **kw):
        out = subprocess.run(
            list(args), env=self.env, capture_output=True, text=True, timeout=timeout, **kw
        )
        if check and out.returncode != 0:
            raise AssertionError(
                f"{' '.join(args)} exited with {out.returncode}\n"
                f"stdout: {out.stdout[-3000:]}\nstderr: {out.stderr[-3000:]}"
            )
        return out

    def srun(self, *args: str, timeout: float = 240, check: bool = True):
        """``srun ARGS`` to its end (killed with its tasks after `timeout`)."""
        return self.run("srun", "--kill-on-bad-exit=1", *args, timeout=timeout, check=check)

    def sbatch(self, script: Path, *args: str) -> str:
        """Submit `script`; the job's id (cancelled when the test ends)."""
        job = self.run("sbatch", "--parsable", *args, str(script)).stdout.strip().split(";")[0]
        self.jobs.append(job)
        return job

    def job(self, job: str) -> dict[str, str]:
        """``scontrol show job``'s fields (JobState, Restarts, ExitCode...)."""
        text = self.run("scontrol", "show", "job", "--oneliner", job).stdout
        return dict(f.split("=", 1) for f in text.split() if "=" in f)

    def wait_job(self, job: str, states: set[str], timeout: float = 240) -> dict[str, str]:
        """Wait until `job` is in one of `states`; its fields then."""
        deadline = time.monotonic() + timeout
        fields: dict[str, str] = {}
        while time.monotonic() < deadline:
            fields = self.job(job)
            if fields.get("JobState") in states:
                return fields
            time.sleep(0.5)
        raise TimeoutError(f"job {job} not in {sorted(states)} after {timeout}s: {fields}")

    def requeue(self, job: str) -> None:
        """Preempt `job` as a scheduler does (SIGTERM, then SIGKILL after KillWait) and
        requeue it, eligible at once: a requeued job otherwise waits out a fixed delay
        (two minutes in Slurm 22.05) before it may start again."""
        self.run("scontrol", "requeue", job)
        deadline = time.monotonic() + 60
        while True:  # StartTime can be set once the job is pending again
            now = self.run("scontrol", "update", f"JobId={job}", "StartTime=now", check=False)
            if now.returncode == 0:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job} did not become pending after scontrol requeue")
            time.sleep(0.5)

    def cancel_all(self) -> None:
        if self.jobs:
            self.run("scancel", "--full", *self.jobs, check=False)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                states = {self.job(j).get("JobState") for j in self.jobs}
                if states <= {"CANCELLED", "COMPLETED", "FAILED", "PREEMPTED", "NODE_FAIL",
                              "TIMEOUT", "OUT_OF_MEMORY", None}:  # fmt: skip
                    return
                time.sleep(0.5)


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[str]:
    """The cluster's SLURM_CONF, up for this test process (see the module docstring)."""
    if os.geteuid() != 0:
        _cannot("scripts/slurm-cluster.sh installs and starts daemons, which needs root")
    have = all(shutil.which(b) or os.path.exists(f"/usr/sbin/{b}") for b in ("slurmctld", "srun"))
    if not have and shutil.which("apt-get") is None:
        _cannot("slurm-wlm is not installed and there is no apt-get to install it")
    if shutil.which("flock") is None:
        _cannot("the script needs flock (util-linux)")
    holder = str(os.getpid())
    up = subprocess.run(
        [str(SCRIPT), "up", "--holder", holder], capture_output=True, text=True, timeout=900
    )
    if up.returncode != 0:
        if "apt-get" in up.stderr:
            _cannot(up.stderr.strip().splitlines()[-1])
        raise RuntimeError(f"scripts/slurm-cluster.sh up failed:\n{up.stderr}")
    conf = subprocess.run([str(SCRIPT), "env"], capture_output=True, text=True, check=True)
    try:
        yield conf.stdout.strip().split("=", 1)[1]
    finally:
        subprocess.run([str(SCRIPT), "down", "--holder", holder], capture_output=True, timeout=120)


@pytest.fixture
def slurm(slurm_cluster: str) -> Iterator[Slurm]:
    """The cluster for one test; its jobs are cancelled at the end."""
    s = Slurm(slurm_cluster)
    try:
        yield s
    finally:
        s.cancel_all()


class Torchrun:
    """torchrun agents started by one test, each in a process group of its own."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []
        self.free_port = free_port

    def start(self, *args: str, env: dict | None = None, log: Path | None = None):
        out = open(log, "w") if log is not None else subprocess.DEVNULL  # noqa: SIM115
        proc = subprocess.Popen(
            [PYTHON, "-m", "torch.distributed.run", *args],
            env=env or repo_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        if log is not None:
            out.close()
        self.procs.append(proc)
        return proc

    def stop_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        for proc in self.procs:  # the workers, in the agents' groups
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)


@pytest.fixture
def torchrun() -> Iterator[Torchrun]:
    t = Torchrun()
    try:
        yield t
    finally:
        t.stop_all()
