"""No restart (distlearn.survivors): a rank dies mid-epoch, the others re-form the tree,
take up its unconsumed examples and finish the job; every example exactly once, checked
on the ledger of tests/elastic_train.py (every process's steps count: none restarts)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

from tests.conftest import repo_env

HERE = Path(__file__).resolve().parent
TRAIN = HERE / "elastic_train.py"


def launch(tmp: Path, world: int, n: int = 90, timeout: float = 240, comeback: bool = False,
           comeback_args: tuple = (), hold: bool = False, **kw) -> list[list[dict]]:  # fmt: skip
    """`world` ranks of a --survive job (the torchrun variables, as examples/launch.py sets
    them); their ledgers, the survivors' last lines holding what happened. `comeback`: the
    rank killed is started again (the same command and variables, plus `comeback_args`: then
    it must fail) once it is dead. `hold`: the survivors slow down until that process has
    ended (one that is turned away), so that a loaded machine's slow start of it does not
    find the job over."""
    data = tmp / "data.pt"
    torch.save({"x": torch.arange(n, dtype=torch.float32).view(n, 1), "y": torch.arange(n) % 3},
               data)  # fmt: skip
    args = [sys.executable, str(TRAIN), "--survive", "--data", str(data), "--ckpt",
            str(tmp / "ckpt"), "--ledger", str(tmp / "ledger")]  # fmt: skip
    for k, v in kw.items():
        args += [f"--{k.replace('_', '-')}"] + ([] if v is True else [str(v)])
    held = tmp / "hold"
    if hold:
        held.touch()
        args += ["--hold", str(held)]
    port = random.randint(20000, 40000)
    envs = [repo_env(RANK=str(r), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                     MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            for r in range(world)]  # fmt: skip
    logs = [tmp / f"stderr{r}.txt" for r in range(world + 1)]
    procs = [subprocess.Popen(args, env=envs[r], stderr=logs[r].open("w")) for r in range(world)]
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if comeback and len(procs) == world:
                dead = [r for r, p in enumerate(procs) if p.poll() == -9]
                if dead:  # the rank killed comes back, as a launcher that restarts would
                    procs.append(subprocess.Popen([*args, *comeback_args], env=envs[dead[0]],
                                                  stderr=logs[world].open("w")))  # fmt: skip
            if hold and len(procs) > world and procs[world].poll() is not None:
                held.unlink(missing_ok=True)
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    errs = [f.read_text() if f.exists() else "" for f in logs]
    dead = [r for r, p in enumerate(procs[:world]) if p.returncode == -9]
    assert len(dead) == 1, [p.returncode for p in procs]
    for r, (p, err) in enumerate(zip(procs, errs, strict=False)):
        if r == world and comeback_args:
            assert p.returncode not in (0, None), err[-3000:]
            continue
        assert r in dead or p.returncode == 0, f"process {r} exited {p.returncode}:\n{err[-3000:]}"
    out = [[json.loads(line) for line in f.open()] for f in (tmp / "ledger").glob("*.jsonl")]
    return sorted([p for p in out if p], key=lambda p: (p[0]["rank"], p[0]["t"]))


def check(ledgers: list[list[dict]], n: int = 90, epochs: int = 2) -> list[dict]:
    ids = Counter(i for p in ledgers for x in p if "ids" in x for i in x["ids"])
    wrong = {i: c for i, c in ids.items() if c != epochs}
    missing = sorted(set(range(n)) - set(ids))
    assert not wrong and not missing, f"not {epochs} times: {wrong}; missing {missing}"
    done = [x for p in ledgers for x in p if "done" in x]
    assert len(done) == len(ledgers) - 1
    return [d["deaths"][0] for d in done if d["deaths"]]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("world", "victim", "at"), [(4, 2, 4), (4, 0, 7), (3, 1, 1)])
def test_a_rank_killed_mid_epoch_is_taken_over(tmp_path, world, victim, at):
    ledgers = launch(tmp_path, world, die_at=at, die_rank=victim, batch=4)
    deaths = check(ledgers)
    assert {d["dead"] for d in deaths} == {victim}
    assert all(d["world"] == [world, world - 1] for d in deaths)
    assert max(d["seconds"] for d in deaths) < 10
    # the step after the death ran on the survivors: the tree said world - 1
    worlds = [x["world"] for p in ledgers for x in p if "ids" in x and "world" in x]
    assert world - 1 in worlds


@pytest.mark.timeout(300)
def test_a_rank_killed_as_it_ends_its_epoch(tmp_path):
    """Partitions of 23, 23, 22, 22 items: rank 0 finishes with the others still stepping
    (or all at once), and dies in the end-of-epoch wait."""
    deaths = check(launch(tmp_path, 4, die_in_drain=True, die_rank=0, batch=4))
    assert {d["dead"] for d in deaths} == {0}


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_random_kills_without_restart(tmp_path):
    rnd = random.Random(5)
    for run in range(8):
        tmp = tmp_path / f"run{run}"
        tmp.mkdir()
        world, batch = rnd.choice([2, 3, 4, 5]), rnd.choice([3, 4, 5])
        steps = 2 * (90 // world // batch)  # two epochs of the smallest partition
        kw = dict(die_at=rnd.randint(1, steps), die_rank=rnd.randrange(world), batch=batch)
        if run % 3 == 2:
            kw.update(workers="process", num_workers=1)
        check(launch(tmp, world, **kw))


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("world", "victim", "workers"), [(3, 1, "thread"), (4, 0, "process")])
def test_a_killed_rank_started_again_comes_back_at_the_next_step(tmp_path, world, victim, workers):
    """The killed rank's process is started again: it knocks, the job takes it in at its next
    step (the root's parameters, a share of the rest of the epoch), and the job ends on as
    many ranks as it began with; every example still exactly once an epoch."""
    n = 600
    ledgers = launch(tmp_path, world, n=n, comeback=True, die_at=3, die_rank=victim, batch=4,
                     sleep=0.1, workers=workers, num_workers=1)  # fmt: skip
    check(ledgers, n=n)
    done = [x for p in ledgers for x in p if "done" in x]
    back = [d for d in done if d["came_back"]]
    assert len(back) == 1 and back[0]["world"] == world
    assert all(d["world"] == world for d in done)  # every rank ended in a tree of `world`
    grown = [c for d in done for c in d["comebacks"]]
    assert grown and all(c["world"] == [world - 1, world] for c in grown)
    # the process that came back trained: the ledger of its pid holds ids
    pid = next(x["pid"] for p in ledgers for x in p if x.get("came_back") and "start" in x)
    assert any("ids" in x and x["ids"] for p in ledgers for x in p if x["pid"] == pid)
    # the one that came back starts from the root's parameters (not its own fresh model's):
    # its first step's are those of the ranks that stepped in the same round (the first
    # of the grown tree's generation, for those still in their epoch then)
    (welcome,) = back[0]["comebacks"]
    gen = welcome["generation"]
    firsts = {}
    for p in ledgers:
        steps = [x for x in p if "digest" in x and x["gen"] == gen]
        if steps:
            firsts[steps[0]["pid"]] = steps[0]["digest"]
    mine = firsts.pop(pid)
    sharers = [d for d in done if not d["came_back"] and d["comebacks"]
               and d["comebacks"][0]["now"] in welcome["sharers"]]  # fmt: skip
    theirs = [firsts[d["pid"]] for d in sharers if d["pid"] in firsts]
    assert theirs and all(t == mine for t in theirs), (mine, firsts)


@pytest.mark.timeout(300)
def test_a_process_coming_back_with_another_loader_is_turned_away(tmp_path):
    """Its sampler differs: it cannot hold its share of the others' orders. It is told why
    and exits; the job goes on without it, every example still once."""
    n = 300
    ledgers = launch(tmp_path, 3, n=n, comeback=True, comeback_args=("--sampler", "linear"),
                     hold=True, die_at=3, die_rank=1, batch=4, sleep=0.05)  # fmt: skip
    check(ledgers, n=n)
    assert "sampler='permutation' there, 'linear' here" in (tmp_path / "stderr3.txt").read_text()
    done = [x for p in ledgers for x in p if "done" in x]
    assert len(done) == 2 and all(d["world"] == 2 for d in done)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("fault", ["die_when_back", "die_after_admission"])
def test_a_process_that_dies_while_coming_back_leaves_the_job_as_it_was(tmp_path, fault):
    """SIGKILLed as soon as it has joined the grown tree (the others are in the welcome's
    first collective), or once its knock is answered but before it joins (the others wait
    ADMIT_S for it: 8 s here, not 30): the job goes on without it, on the ranks it had,
    exactly once."""
    n = 600
    flag = "--" + fault.replace("_", "-")
    wait = {"admit_s": 8} if fault == "die_after_admission" else {}  # (one that joins: 30)
    ledgers = launch(tmp_path, 3, n=n, comeback=True, comeback_args=(flag,), die_at=3,
                     die_rank=1, batch=4, sleep=0.1, **wait)  # fmt: skip
    check(ledgers, n=n)
    done = [x for p in ledgers for x in p if "done" in x]
    assert len(done) == 2 and all(d["world"] == 2 for d in done)
    assert all(d["comebacks"] == [] for d in done)
    err = (tmp_path / "stderr0.txt").read_text()
    assert "going on without them" in err, err[-3000:]
