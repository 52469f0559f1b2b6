"""No restart (distlearn.survivors): a rank dies mid-epoch, the others re-form the tree,
take up its unconsumed examples and finish the job; every example exactly once, checked
on the ledger of tests/elastic_train.py (every process's steps count: none restarts)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from tests.conftest import repo_env

HERE = Path(__file__).resolve().parent
TRAIN = HERE / "elastic_train.py"


def launch(tmp: Path, world: int, n: int = 90, timeout: float = 240, **kw) -> list[list[dict]]:
    """`world` ranks of a --survive job (the torchrun variables, as examples/launch.py sets
    them); their ledgers, the survivors' last lines holding what happened."""
    data = tmp / "data.pt"
    torch.save({"x": torch.arange(n, dtype=torch.float32).view(n, 1), "y": torch.arange(n) % 3},
               data)  # fmt: skip
    args = [sys.executable, str(TRAIN), "--survive", "--data", str(data), "--ckpt",
            str(tmp / "ckpt"), "--ledger", str(tmp / "ledger")]  # fmt: skip
    for k, v in kw.items():
        args += [f"--{k.replace('_', '-')}"] + ([] if v is True else [str(v)])
    port = random.randint(20000, 40000)
    procs = [subprocess.Popen(args, env=repo_env(RANK=str(r), WORLD_SIZE=str(world),
                              LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=str(port)), stderr=subprocess.PIPE, text=True)
             for r in range(world)]  # fmt: skip
    try:
        errs = [p.communicate(timeout=timeout)[1] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    dead = [r for r, p in enumerate(procs) if p.returncode == -9]
    assert len(dead) == 1, [p.returncode for p in procs]
    for r, (p, err) in enumerate(zip(procs, errs, strict=True)):
        assert r in dead or p.returncode == 0, f"rank {r} exited {p.returncode}:\n{err[-3000:]}"
    out = [[json.loads(line) for line in f.open()] for f in (tmp / "ledger").glob("*.jsonl")]
    return sorted(out, key=lambda p: p[0]["rank"])


def check(ledgers: list[list[dict]], n: int = 90, epochs: int = 2) -> list[dict]:
    ids = Counter(i for p in ledgers for x in p if "ids" in x for i in x["ids"])
    wrong = {i: c for i, c in ids.items() if c != epochs}
    missing = sorted(set(range(n)) - set(ids))
    assert not wrong and not missing, f"not {epochs} times: {wrong}; missing {missing}"
    done = [x for p in ledgers for x in p if "done" in x]
    assert len(done) == len(ledgers) - 1
    return [d["deaths"][0] for d in done]


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
