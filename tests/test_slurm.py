"""Launcher detection under a real Slurm (slurmctld, slurmd and munged of this machine's
Debian packages, a private one-node cluster in a temporary folder): what a batch
script's own process sees, and what the tasks of an ``srun`` step see.

Skipped where the Slurm daemons are not installed or this is not root (slurmd runs jobs
as their user, which takes root).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "sinfo")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        os.geteuid() != 0 or not all(shutil.which(d) for d in DAEMONS),
        reason="needs root and Slurm's daemons (slurm-wlm, munge)",
    ),
]

CONF = """\
ClusterName=distlearntest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
AuthType=auth/munge
AuthInfo=socket={dir}/munge.sock
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd.log
PlugStackConfig={dir}/plugstack.conf
SlurmUser=root
MpiDefault=none
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=test Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""

# What each process reports: the shared launcher detection, and what the Dataset and
# the tree's rendezvous make of it.
REPORT = """
import json, os, sys
from distlearn.common import launchers
from distlearn.dataset import Dataset
from distlearn.ipc.rendezvous import env
path = os.path.join(sys.argv[1], f"i-{os.getpid()}.csv")
with open(path, "w") as f:
    f.write("filename\\n" + "".join(f"{i}\\n" for i in range(8)))
launch = launchers.detect()
ds = Dataset(path, partition="auto")
handler = env.from_env()
print(json.dumps({"where": sys.argv[2], "launch": launch and [launch.rank, launch.world],
                  "dataset": [ds.partition, ds.partitions],
                  "tree": [handler.node_index, handler.num_nodes]}), flush=True)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pid(path: Path) -> int | None:
    with contextlib.suppress(OSError, ValueError):
        return int(path.read_text().split()[0])
    return None


@pytest.fixture
def slurm(tmp_path):
    """A private cluster: its config's path (for $SLURM_CONF); its daemons stopped after."""
    d = tmp_path / "slurm"
    for sub in ("state", "spool"):
        (d / sub).mkdir(parents=True)
    key = d / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    (d / "plugstack.conf").write_text("")
    conf = d / "slurm.conf"
    conf.write_text(CONF.format(host=socket.gethostname(), dir=d, ctld_port=_free_port(),
                                d_port=_free_port(), cpus=os.cpu_count() or 1))  # fmt: skip
    env = {**os.environ, "SLURM_CONF": str(conf)}
    pids = [d / "munged.pid", d / "slurmctld.pid", d / "slurmd.pid"]
    try:
        subprocess.run(["munged", "-f", f"--socket={d}/munge.sock", f"--key-file={key}",
                        f"--log-file={d}/munged.log", f"--pid-file={pids[0]}",
                        f"--seed-file={d}/munge.seed"], check=True, timeout=30)  # fmt: skip
        subprocess.run(["slurmctld", "-i"], env=env, check=True, timeout=30)
        subprocess.run(["slurmd"], env=env, check=True, timeout=30)
        deadline = time.monotonic() + 60
        while True:
            out = subprocess.run(["sinfo", "-h", "-o", "%t"], env=env, capture_output=True,
                                 text=True, timeout=30).stdout.strip()  # fmt: skip
            if out in ("idle", "mix", "alloc"):
                break
            if time.monotonic() > deadline:
                logs = "".join(p.read_text()[-2000:] for p in d.glob("*.log"))
                pytest.skip(f"the private Slurm cluster did not come up ({out!r}): {logs}")
            time.sleep(0.5)
        yield env
    finally:
        for pid_file in reversed(pids):  # our daemons, by the pids they wrote
            pid = _pid(pid_file)
            if pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
        time.sleep(1)
        for pid_file in pids:
            pid = _pid(pid_file)
            if pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


def test_a_batch_script_is_one_process_and_its_srun_step_is_the_job(slurm, tmp_path):
    """`sbatch -n 2`: the script's own shell sees SLURM_PROCID=0 and SLURM_NTASKS=2 but is
    no task of the job (no SLURM_STEP_ID): Dataset and Tree.from_env take it for a single
    process, as they do every process without a launcher. Its `srun` starts the two
    tasks, ranks 0 and 1 of 2 for both."""
    out = tmp_path / "job.out"
    data = tmp_path / "data"
    data.mkdir()
    env = {**slurm, "PYTHONPATH": str(REPO)}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    script = tmp_path / "job.sh"
    report = tmp_path / "report.py"
    report.write_text(REPORT)
    py = sys.executable
    script.write_text(f"#!/bin/bash\n{py} {report} {data} batch\nsrun {py} {report} {data} step\n")
    job = subprocess.run(["sbatch", "-n", "2", "-o", str(out), "-W", str(script)], env=env,
                         timeout=240, capture_output=True, text=True)  # fmt: skip
    assert job.returncode == 0, (job.stderr, out.read_text() if out.exists() else "")
    reports = [json.loads(line) for line in out.read_text().splitlines() if line.startswith("{")]
    batch = [r for r in reports if r["where"] == "batch"]
    steps = sorted((r for r in reports if r["where"] == "step"), key=lambda r: r["launch"])
    assert batch == [{"where": "batch", "launch": None, "dataset": [0, 1], "tree": [0, 1]}], (
        out.read_text()
    )
    assert [(r["launch"], r["dataset"], r["tree"]) for r in steps] == [
        ([0, 2], [0, 2], [0, 2]),
        ([1, 2], [1, 2], [1, 2]),
    ], out.read_text()
