"""Jobs that survive, on real launches: torchrun restarting killed workers, jobs resized
from one attempt to the next, Slurm requeueing a preempted job; every example exactly
once, checked on a ledger of the ids each rank trained on (tests/elastic_train.py).

An attempt's steps count (are *committed*) up to the save the next attempt restored
from; steps after it were lost with the process and are taken again. Over every attempt
the committed ids hold every example exactly once per epoch: no duplicate, no omission.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

from tests.conftest import repo_env

pytest_plugins = ("tests.cluster",)  # the fixtures slurm and torchrun
HERE = Path(__file__).resolve().parent
TRAIN = HERE / "elastic_train.py"
N = 90  # examples


def make_data(tmp: Path, n: int = N) -> str:
    path = tmp / "data.pt"
    torch.save({"x": torch.arange(n, dtype=torch.float32).view(n, 1), "y": torch.arange(n) % 3},
               path)  # fmt: skip
    return str(path)


def processes(ledger: Path) -> list[list[dict]]:
    """Each process's ledger lines, processes in the order they started."""
    out = [[json.loads(line) for line in f.open()] for f in ledger.glob("rank*.jsonl")]
    return sorted((p for p in out if p), key=lambda p: p[0]["t"])


def committed(ledger: Path) -> list[dict]:
    """The steps that count (see the module docstring)."""
    procs = processes(ledger)
    restored = [p[0]["restored"] for p in procs]
    out = []
    for i, lines in enumerate(procs):
        if any("done" in line for line in lines):
            out += [x for x in lines if "ids" in x]
            continue
        later = set(restored[i + 1 :])
        saves = [j for j, x in enumerate(lines) if "saved" in x and x["saved"] in later]
        if saves:
            out += [x for x in lines[: saves[-1]] if "ids" in x]
    return out


def check_exactly_once(ledger: Path, epochs: int, n: int = N) -> Counter:
    ids = Counter(i for x in committed(ledger) for i in x["ids"])
    wrong = {i: c for i, c in ids.items() if c != epochs}
    missing = sorted(set(range(n)) - set(ids))
    assert not wrong and not missing, f"ids seen not {epochs} times: {wrong}; missing {missing}"
    assert any("done" in x for p in processes(ledger) for x in p), "no attempt finished"
    return ids


def torchrun_args(port: int, nproc: int, restarts: int = 0) -> list[str]:
    return ["--nnodes=1", f"--nproc-per-node={nproc}", f"--max-restarts={restarts}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
            "--monitor-interval=0.2", str(TRAIN)]  # fmt: skip


def train_args(tmp: Path, data: str, **kw) -> list[str]:
    args = {"data": data, "ckpt": str(tmp / "ckpt"), "ledger": str(tmp / "ledger"), **kw}
    out = []
    for k, v in args.items():
        out += [f"--{k.replace('_', '-')}"] + ([] if v is True else [str(v)])
    return out


def run_torchrun(torchrun, tmp: Path, nproc: int, restarts: int = 0, timeout: float = 300,
                 **kw) -> int:  # fmt: skip
    """One torchrun job to its end; its exit status."""
    env = repo_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")  # (see tests/test_cluster.py)
    log = tmp / f"torchrun-{time.monotonic_ns()}.log"
    agent = torchrun.start(*torchrun_args(torchrun.free_port(), nproc, restarts),
                           *train_args(tmp, **kw), env=env, log=log)  # fmt: skip
    try:
        return agent.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"torchrun did not finish in {timeout}s:\n"
                             f"{log.read_text()[-4000:]}") from None  # fmt: skip


# ----------------------------------------------------------------------------- torchrun


@pytest.mark.timeout(600)
@pytest.mark.parametrize("comm", ["ipc", pytest.param("gloo", marks=pytest.mark.slow)])
def test_a_killed_rank_restarts_under_torchrun_and_every_example_is_seen_once(
    torchrun, tmp_path, comm
):
    data = make_data(tmp_path)
    rc = run_torchrun(torchrun, tmp_path, 3, restarts=2, data=data, comm=comm, epochs=2,
                      every=4, die_at=9, die_rank=1)  # fmt: skip
    assert rc == 0
    procs = processes(tmp_path / "ledger")
    assert len(procs) == 6, "3 ranks, then 3 again after the kill"
    assert procs[3][0]["restored"] is not None
    check_exactly_once(tmp_path / "ledger", 2)


@pytest.mark.timeout(900)
def test_a_job_resized_from_attempt_to_attempt(torchrun, tmp_path):
    """4 ranks, preempted (the stop flag, as a SIGTERM raises it); 3 ranks, preempted; 5;
    then 1 to the end: each attempt resumes the last one's position."""
    data = make_data(tmp_path)
    for nproc, stop in [(4, 5), (3, 7), (5, 3), (1, None)]:  # (steps of each attempt)
        kw = dict(data=data, epochs=3, every=50, batch=3)
        if stop is not None:
            kw["stop_at"] = stop
        assert run_torchrun(torchrun, tmp_path, nproc, **kw) == 0
    worlds = [p[0]["world"] for p in processes(tmp_path / "ledger")]
    assert Counter(worlds) == {4: 4, 3: 3, 5: 5, 1: 1}
    check_exactly_once(tmp_path / "ledger", 3)


@pytest.mark.slow
@pytest.mark.timeout(3000)
def test_twenty_random_kills(torchrun, tmp_path):
    """SIGKILL of a random rank at a random step, 20 runs: a kill and a restart in each
    (the step drawn among those every rank takes), exactly once in each."""
    rnd = random.Random(52)
    for run in range(20):
        tmp = tmp_path / f"run{run}"
        tmp.mkdir()
        data = make_data(tmp)
        world, batch = rnd.choice([2, 3, 4]), rnd.choice([3, 4, 5])
        steps = 2 * (N // world // batch)  # two epochs of the smallest partition
        kw = dict(data=data, epochs=2, every=rnd.choice([2, 3, 7]), batch=batch,
                  die_at=rnd.randint(1, steps), die_rank=rnd.randrange(world))  # fmt: skip
        if run % 4 == 3:
            kw.update(workers="process", num_workers=1)
        assert run_torchrun(torchrun, tmp, world, restarts=1, **kw) == 0, (run, kw)
        assert len(processes(tmp / "ledger")) == 2 * world, ("no kill and restart", run, kw)
        check_exactly_once(tmp / "ledger", 2)


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("when", ["training", "evaluation", "save"])
def test_sigterm_then_a_new_attempt(torchrun, tmp_path, when):
    """SIGTERM to every worker (a scheduler stopping the job) during training, during an
    evaluation (no collective: the flag waits for the next step) or in the middle of a
    save (rank 0 writing, nothing published): the job saves and exits 0, and the next
    attempt finishes it, every example once."""
    data = make_data(tmp_path, 300)
    kw = dict(data=data, epochs=2, batch=3, sleep=0.05)
    kw.update({"training": dict(every=1000), "evaluation": dict(every=1000, eval_s=4.0),
               "save": dict(every=10, save_s=3.0)}[when])  # fmt: skip
    env = repo_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    agent = torchrun.start(*torchrun_args(torchrun.free_port(), 3), *train_args(tmp_path, **kw),
                           env=env, log=tmp_path / "first.log")  # fmt: skip
    ledger = tmp_path / "ledger"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        lines = [x for p in processes(ledger) for x in p] if ledger.exists() else []
        steps = max((x.get("step", 0) for x in lines if "ids" in x), default=0)
        if when == "evaluation" and any("evaluating" in x for x in lines):
            time.sleep(1.0)  # inside the 4 s evaluation
            break
        if when == "save" and any("saving" in x for x in lines):
            time.sleep(1.0)  # inside the 3 s save
            break
        if when != "evaluation" and steps >= 20:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"no {when} to stop in 240 s")
    signalled = time.time()
    for p in processes(ledger):
        os.kill(p[0]["pid"], signal.SIGTERM)
    assert agent.wait(timeout=120) == 0, (tmp_path / "first.log").read_text()[-4000:]
    first = [x for p in processes(ledger) for x in p]
    if when == "save":  # the save the signal fell into was finished, and one more made
        saving = [x["t"] for x in first if "saving" in x]
        assert len(saving) >= 2 and saving[-2] < signalled < saving[-1], (saving, signalled)
    assert run_torchrun(torchrun, tmp_path, 3, **kw) == 0
    check_exactly_once(ledger, 2, n=300)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("fault", ["stopped", "killed"])
def test_the_same_world_size_resumes_the_loss_curve_bit_for_bit(torchrun, tmp_path, fault):
    """Stopped (the flag a SIGTERM raises: a save at step 11, a new job) or killed
    (SIGKILL of rank 1 at its 11th all-reduce: torchrun restarts both from the save of
    step 8, and the steps since are taken again): every committed step's loss equals
    the uninterrupted job's, as floats."""
    data = make_data(tmp_path)
    whole = tmp_path / "whole"
    whole.mkdir()
    kw = dict(data=data, epochs=2, every=4, deterministic=True)
    assert run_torchrun(torchrun, whole, 2, **kw) == 0
    split = tmp_path / "split"
    split.mkdir()
    if fault == "stopped":
        assert run_torchrun(torchrun, split, 2, stop_at=11, **kw) == 0
        assert run_torchrun(torchrun, split, 2, **kw) == 0
    else:
        assert run_torchrun(torchrun, split, 2, restarts=1, die_at=11, die_rank=1, **kw) == 0
        procs = processes(split / "ledger")
        assert len(procs) == 4 and procs[2][0]["restored"] is not None, "no restart"
        lost = max(x["step"] for x in procs[0] + procs[1] if "ids" in x) - procs[2][0]["step"]
        assert lost > 0, "the kill came before any step after the save"

    def curve(folder):
        return sorted((x["rank"], x["step"], x["loss"]) for x in committed(folder / "ledger"))

    assert curve(split) == curve(whole)  # every step's loss, equal as floats


# ----------------------------------------------------------------------------- data kinds


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_part_files_on_s3_and_a_joined_index_resize(torchrun, tmp_path):
    import webdataset as wds

    from tests.moto_server import moto_s3

    with moto_s3() as storage:
        import s3fs

        fs = s3fs.S3FileSystem(**storage)
        fs.mkdir("parts")
        sizes, at = [7, 12, 5, 9, 11, 6, 8, 10, 4, 8], 0
        for p, n in enumerate(sizes):
            local = tmp_path / f"part-{p:03d}.tar"
            with wds.TarWriter(str(local)) as sink:
                for i in range(at, at + n):
                    sink.write({"__key__": f"r{i:04d}", "txt": str(i)})
            at += n
            fs.put(str(local), f"parts/part-{p:03d}.tar")
        run = tmp_path / "parts-run"
        run.mkdir()
        kw = dict(data="s3://parts/", storage=json.dumps(storage), epochs=2, batch=3,
                  sampler="part-permutation-permutation", every=100)  # fmt: skip
        assert run_torchrun(torchrun, run, 4, stop_at=4, **kw) == 0
        assert run_torchrun(torchrun, run, 3, **kw) == 0
        check_exactly_once(run / "ledger", 2, n=at)
    joined = tmp_path / "joined-run"
    joined.mkdir()
    data = make_data(tmp_path)
    kw = dict(data=f"{data},{data}", epochs=2, batch=4, every=100)
    assert run_torchrun(torchrun, joined, 3, stop_at=6, **kw) == 0
    assert run_torchrun(torchrun, joined, 2, **kw) == 0
    check_exactly_once(joined / "ledger", 2)


# ----------------------------------------------------------------------------- Slurm


def readme_sbatch() -> str:
    """The sbatch script of the README's "Fault tolerance" section, as a user copies it."""
    text = (HERE.parent / "README.md").read_text()
    block = text.split("<!-- --8<-- [start:sbatch] -->\n", 1)[1]
    block = block.split("<!-- --8<-- [end:sbatch]", 1)[0]
    script = block.strip().removeprefix("```sh").removesuffix("```").strip() + "\n"
    assert script.startswith("#!/bin/bash\n") and "srun python train.py" in script, script
    return script


def test_the_readme_sbatch_script_is_what_the_slurm_test_submits():
    script = readme_sbatch()
    assert "#SBATCH --requeue" in script and "#SBATCH --ntasks=" in script


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_requeued_slurm_job_resumes_exactly_once(slurm, tmp_path):
    """The README's sbatch script (--requeue, 4 tasks); scontrol requeue while it trains
    (SIGTERM to the tasks: they save and exit 0); the job runs again under the same id
    and finishes from the save, every example once."""
    data = make_data(tmp_path, 300)
    args = " ".join(train_args(tmp_path, data=data, epochs=2, batch=3, sleep=0.05, every=1000))
    script = tmp_path / "job.sh"
    command = f"{sys.executable} {TRAIN} {args}"
    script.write_text(readme_sbatch().replace("python train.py", command))
    job = slurm.sbatch(script, "-o", str(tmp_path / "out-%j.txt"))
    ledger = tmp_path / "ledger"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        lines = [x for p in processes(ledger) for x in p] if ledger.exists() else []
        if sum("ids" in x for x in lines) >= 30:
            break
        time.sleep(0.2)
    slurm.requeue(job)
    fields = slurm.wait_job(job, {"COMPLETED", "FAILED", "CANCELLED"}, timeout=600)
    assert fields["JobState"] == "COMPLETED", fields
    procs = processes(ledger)
    assert {p[0]["slurm_restart"] or "0" for p in procs} == {"0", "1"}
    assert all(p[0]["restored"] for p in procs if p[0]["slurm_restart"] == "1")
    check_exactly_once(ledger, 2, n=300)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_slurms_usr1_before_the_time_limit_saves_and_a_new_job_resumes(slurm, tmp_path):
    """The README's script with a time limit of 4 minutes and ``--signal=USR1@150``
    (given to sbatch, over the script's 120): Slurm sends SIGUSR1 to the tasks 90 s in
    (up to 60 s earlier: Slurm's resolution), while they train (2 s a step, 50 steps);
    they save and exit 0 (the job COMPLETED, not killed at its limit), and a second job
    of the same script finishes from that save, every example once."""
    data = make_data(tmp_path, 300)
    args = " ".join(train_args(tmp_path, data=data, epochs=2, batch=3, sleep=2.0, every=1000))
    script = tmp_path / "job.sh"
    script.write_text(
        readme_sbatch().replace("python train.py", f"{sys.executable} {TRAIN} {args}")
    )
    first = slurm.sbatch(script, "--time=4", "--signal=USR1@150", "-o", str(tmp_path / "1.txt"))
    fields = slurm.wait_job(first, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}, timeout=300)
    assert fields["JobState"] == "COMPLETED", (fields, (tmp_path / "1.txt").read_text()[-3000:])
    assert "SIGUSR1 here" in (tmp_path / "1.txt").read_text()
    lines = [x for p in processes(tmp_path / "ledger") for x in p]
    assert not any("done" in x for x in lines), "the first job ran to its end: no signal"
    assert any("saved" in x for x in lines)
    second = slurm.sbatch(script, "-o", str(tmp_path / "2.txt"))
    fields = slurm.wait_job(second, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}, timeout=400)
    assert fields["JobState"] == "COMPLETED", (fields, (tmp_path / "2.txt").read_text()[-3000:])
    procs = processes(tmp_path / "ledger")
    assert all(p[0]["restored"] for p in procs[4:]) and len(procs) == 8
    check_exactly_once(tmp_path / "ledger", 2, n=300)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_rank_killed_under_srun_is_survived_exactly_once(slurm, tmp_path):
    """No restart under Slurm: `srun --kill-on-bad-exit=0` (Slurm's default) keeps the
    other tasks running when one is SIGKILLed mid-epoch; they re-form the tree, take over
    its examples and finish, every example once (the survivors' ledgers)."""
    from tests.test_survivors import check

    data = make_data(tmp_path)
    args = train_args(tmp_path, data=data, epochs=2, batch=4, die_at=6, die_rank=2)
    out = slurm.run("srun", "--kill-on-bad-exit=0", "-n", "4", sys.executable, str(TRAIN),
                    "--survive", *args, timeout=300, check=False)  # fmt: skip
    assert out.returncode != 0  # srun reports the killed task
    ledgers = processes(tmp_path / "ledger")
    assert len(ledgers) == 4, out.stderr[-3000:]
    deaths = check(ledgers)
    assert {d["dead"] for d in deaths} == {2}
    assert all(d["world"] == [4, 3] for d in deaths)
