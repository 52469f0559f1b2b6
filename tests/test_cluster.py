"""Launches under real schedulers (slow tier): Slurm's srun and sbatch --requeue, and
torchrun's elastic agent, with the tree and gloo as users start them (``from_env``).

The cluster is scripts/slurm-cluster.sh's (tests/cluster.py); the workers are
tests/cluster_workers.py. Every check reads what the workers wrote.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import repo_env

pytest_plugins = ("tests.cluster",)  # the fixtures slurm and torchrun
PYTHON = sys.executable
WORKERS = Path(__file__).with_name("cluster_workers.py")
pytestmark = pytest.mark.slow


def records(out: Path) -> list[dict]:
    return [json.loads(line) for f in sorted(out.glob("rank*.jsonl")) for line in f.open()]


def wait_for(what, timeout: float, every: float = 0.2, procs=()):
    """`what()` once it is truthy; fails at `timeout`, or when one of `procs` has ended."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = what()
        if got:
            return got
        for p in procs:
            if p.poll() is not None:
                raise AssertionError(f"{p.args!r} ended with {p.returncode} while waiting")
        time.sleep(every)
    raise TimeoutError(f"not within {timeout}s")


# ----------------------------------------------------------------------------- srun


@pytest.mark.timeout(300)
def test_srun_runs_a_tree_all_reduce(slurm, tmp_path):
    slurm.srun("-n", "4", PYTHON, str(WORKERS), "tree", str(tmp_path))
    got = records(tmp_path)
    assert sorted(r["rank"] for r in got) == [0, 1, 2, 3]
    assert {(r["nodes"], r["count"], r["sum"]) for r in got} == {(4, 4, 10.0)}
    assert {r["SLURM_PROCID"] for r in got} == {"0", "1", "2", "3"}


@pytest.mark.timeout(300)
def test_srun_runs_a_gloo_all_reduce(slurm, tmp_path):
    """TorchDistributed.from_env reads Slurm's variables under srun, as the tree does."""
    slurm.srun("-n", "4", PYTHON, str(WORKERS), "gloo", str(tmp_path))
    got = records(tmp_path)
    assert sorted(r["rank"] for r in got) == [0, 1, 2, 3]
    assert {(r["nodes"], r["count"], r["sum"]) for r in got} == {(4, 4, 10.0)}


@pytest.mark.timeout(300)
def test_a_rank_killed_under_srun_is_named_by_the_others_at_once(slurm, tmp_path):
    """SIGKILL of one task: the tree's survivors raise naming it (not a hang until the
    timeout), and srun ends the step."""
    script = tmp_path / "kill.py"
    script.write_text(
        "import os, signal, sys, time, torch\n"
        "from distlearn import ipc\n"
        "t = ipc.Tree.from_env(timeout=120)\n"
        "for step in range(1000):\n"
        "    if t.node_index == 1 and step == 5:\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n"
        "    t0 = time.monotonic()\n"
        "    try:\n"
        "        t.all_reduce(torch.ones(1))\n"
        "    except Exception as e:\n"
        f"        open(f'{tmp_path}/err{{t.node_index}}', 'w').write(\n"
        "            f'{step} {time.monotonic() - t0:.3f} {type(e).__name__}: {e}')\n"
        "        sys.exit(3)\n"
        "    time.sleep(0.05)\n"
    )
    out = slurm.srun("-n", "3", PYTHON, str(script), check=False)
    assert out.returncode != 0
    for rank in (0, 2):
        step, took, err = (tmp_path / f"err{rank}").read_text().split(" ", 2)
        assert int(step) == 5 and float(took) < 5, err
        assert "node 1" in err


# ----------------------------------------------------------------------------- sbatch


@pytest.mark.timeout(400)
def test_a_requeued_batch_job_runs_again(slurm, tmp_path):
    """``sbatch --requeue``, preempted by ``scontrol requeue`` mid-run: the job's tasks
    get SIGTERM, the job is queued again under the same id and runs to its end, and the
    tree forms again in the second run (same job id, same step id)."""
    job_script = tmp_path / "job.sh"
    job_script.write_text(f"#!/bin/bash\nexec srun -n 2 {PYTHON} {WORKERS} steps {tmp_path} 30\n")
    job = slurm.sbatch(job_script, "--requeue", "-n", "2", "-o", str(tmp_path / "out-%j.txt"))

    def steps_of(restart: str) -> list[dict]:
        return [r for r in records(tmp_path) if r.get("SLURM_RESTART_COUNT", "0") == restart]

    wait_for(lambda: len(steps_of("0")) >= 6, timeout=180)
    slurm.requeue(job)
    fields = slurm.wait_job(job, {"COMPLETED", "FAILED", "CANCELLED"}, timeout=240)
    assert fields["JobState"] == "COMPLETED", fields
    assert fields["Restarts"] == "1"
    first, second = steps_of("0"), steps_of("1")
    assert max(r["step"] for r in first) < 29, "the first run was not preempted"
    assert sorted((r["rank"], r["step"]) for r in second) == [
        (rank, step) for rank in (0, 1) for step in range(30)
    ]
    assert {(r["count"], r["sum"]) for r in second} == {(2, 3.0)}


# ----------------------------------------------------------------------------- torchrun


def _elastic_args(port: int, nproc: int, run_id: str) -> list[str]:
    return [
        "--nnodes=1:2",
        f"--nproc-per-node={nproc}",
        "--max-restarts=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        f"--rdzv-id={run_id}",
        # with --nnodes=1:2 a round waits this long for a second agent once one is in
        "--rdzv-conf=last_call_timeout=2",
        "--monitor-interval=0.2",
        str(WORKERS),
        "elastic",
    ]


def _env(**extra: str) -> dict[str, str]:
    """The agents' environment. TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: with the agent's
    store shared (torch's default), a restarted worker's init_process_group may read the
    key of the worker it replaces (the keys are not per attempt) and dial a dead
    address; gloo then fails with "connectFullMesh failed ... Connection refused"
    (pytorch#135712; seen here with torch 2.13 at the first restart)."""
    return repo_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE=os.environ.get("TEST_SHARE_STORE_OFF", "1"),
                    **extra)  # fmt: skip


@pytest.mark.timeout(400)
def test_torchrun_restarts_a_killed_worker(torchrun, tmp_path):
    """One elastic agent (--nnodes=1:2) with two workers; SIGKILL one: the agent
    restarts both (TORCHELASTIC_RESTART_COUNT=1), and the tree and gloo form again."""
    port = torchrun.free_port()
    agent = torchrun.start(*_elastic_args(port, 2, "one"), str(tmp_path), env=_env(),
                           log=tmp_path / "agent.log")  # fmt: skip
    first = wait_for(lambda: len(records(tmp_path)) == 2 and records(tmp_path), 180, procs=[agent])
    victim = next(r for r in first if r["rank"] == 1)
    os.kill(victim["pid"], signal.SIGKILL)
    again = wait_for(lambda: (g := [r for r in records(tmp_path) if r not in first]) and
                     len(g) == 2 and g, 180, procs=[agent])  # fmt: skip
    (tmp_path / "release").touch()
    assert agent.wait(timeout=120) == 0, (tmp_path / "agent.log").read_text()[-3000:]
    assert {r["TORCHELASTIC_RESTART_COUNT"] for r in first} == {"0"}
    assert {r["TORCHELASTIC_RESTART_COUNT"] for r in again} == {"1"}
    assert not {r["pid"] for r in again} & {r["pid"] for r in first}
    for r in first + again:
        assert (r["count"], r["sum"], r["gloo_count"], r["gloo_sum"]) == (2, 3.0, 2, 3.0)


@pytest.mark.timeout(400)
def test_torchrun_two_agents_restart_every_worker_after_a_kill(torchrun, tmp_path):
    """Two agents on this host (--nnodes=1:2, two workers each): SIGKILL one worker and
    every worker of both agents starts again, and the 4-node tree (across "hosts": it
    needs IPC_TOKEN) and gloo form again. The agents' TORCHELASTIC_RESTART_COUNT then
    differ (the failed agent's counts the restart, the other's does not), so a job
    cannot take it for the number of the attempt."""
    port = torchrun.free_port()
    env = _env(IPC_TOKEN=secrets.token_hex(32))
    args = _elastic_args(port, 2, "two")
    agents = [torchrun.start(*args, str(tmp_path), env=env, log=tmp_path / f"agent{i}.log")
              for i in range(2)]  # fmt: skip
    first = wait_for(lambda: len(records(tmp_path)) == 4 and records(tmp_path), 240, procs=agents)
    os.kill(next(r for r in first if r["rank"] == 3)["pid"], signal.SIGKILL)
    again = wait_for(lambda: (g := [r for r in records(tmp_path) if r not in first]) and
                     len(g) == 4 and g, 240, procs=agents)  # fmt: skip
    (tmp_path / "release").touch()
    for i, agent in enumerate(agents):
        assert agent.wait(timeout=120) == 0, (tmp_path / f"agent{i}.log").read_text()[-3000:]
    assert sorted(r["rank"] for r in again) == [0, 1, 2, 3]
    assert not {r["pid"] for r in again} & {r["pid"] for r in first}
    for r in first + again:
        assert (r["count"], r["sum"], r["gloo_count"], r["gloo_sum"]) == (4, 10.0, 4, 10.0)
    assert {r["TORCHELASTIC_RESTART_COUNT"] for r in again} == {"0", "1"}
