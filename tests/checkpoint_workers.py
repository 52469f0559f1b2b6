"""One rank of tests/test_checkpoint.py:
``python tests/checkpoint_workers.py COMM RANK WORLD KEY CONFIG.json``.

COMM is ``ipc`` (a LocalhostTree keyed by KEY) or ``gloo`` (a file store in KEY, a
folder). CONFIG says the scenario and where to write what this rank saw (OUT/rank-R.pt),
for the test to compare.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

from distlearn import ipc
from distlearn.checkpoint import Checkpoint, CheckpointError


class Elastic:
    """A value of the elastic kind: each rank's state differs, a list comes back at another
    world size (as a batcher's)."""

    elastic_state = True

    def __init__(self, rank: int):
        self.state = {"rank": rank, "consumed": 100 + rank}
        self.loaded = None

    def state_dict(self) -> dict:
        return dict(self.state)

    def load_state_dict(self, state) -> None:
        self.loaded = state


class Counter:
    def __init__(self, value: int):
        self.value = value

    def state_dict(self) -> dict:
        return {"value": torch.tensor([self.value])}

    def load_state_dict(self, state) -> None:
        self.value = int(state["value"][0])


def make_comm(kind: str, rank: int, world: int, key: str):
    if kind == "ipc":
        return ipc.LocalhostTree(rank, world, key=key, timeout=60)
    import torch.distributed as dist

    from distlearn.backends import TorchDistributed

    dist.init_process_group("gloo", init_method=f"file://{key}/store", rank=rank, world_size=world)
    return TorchDistributed()


def model_and_optim(seed: int):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    return model, opt


def train(model, opt, steps: int) -> None:
    for _ in range(steps):
        loss = model(torch.randn(4, 6)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def draws() -> list[float]:
    return [torch.rand(1).item(), float(np.random.rand()), random.random()]


def main() -> None:
    kind, rank, world, key, config = sys.argv[1], *map(int, sys.argv[2:4]), *sys.argv[4:6]
    cfg = json.loads(Path(config).read_text())
    out = Path(cfg["out"])
    comm = make_comm(kind, rank, world, key)
    ckpt = Checkpoint(cfg["dir"], comm, keep=cfg.get("keep", 2), every=cfg.get("every"),
                      storage_options=cfg.get("storage"))  # fmt: skip
    model, opt = model_and_optim(cfg.get("seed", 0))
    objects = {"model": model, "optim": opt, "data": Elastic(rank)}
    if cfg.get("per_rank"):
        objects["mine"] = Checkpoint.per_rank(Counter(1000 + rank))
    got: dict = {}
    scenario = cfg["scenario"]
    if scenario == "save":
        torch.manual_seed(rank)
        np.random.seed(rank)
        random.seed(rank)
        for step in cfg["steps"]:
            train(model, opt, 2)
            got["path"] = ckpt.save(step, objects)
        got["draws"] = draws()  # what a job resumed from the last save draws first
    elif scenario == "restore":
        try:
            got["step"] = ckpt.restore(objects)
        except CheckpointError as err:
            got["error"] = str(err)
        got["draws"] = draws()
        got["data"] = objects["data"].loaded
        if "mine" in objects:
            got["mine"] = objects["mine"].obj.value
    elif scenario == "different-steps":
        ckpt.save(5 + rank, objects)
    elif scenario == "preempt":
        (out / f"pid-{rank}").write_text(str(os.getpid()))
        step = 0
        try:
            while step < 100_000:
                train(model, opt, 1)
                step += 1
                got["last"] = step
                ckpt.step(step, objects)
                time.sleep(0.02)
        except SystemExit as stop:
            got["exit"] = stop.code
            got["stopped_at"] = step
    elif scenario in ("preempt-sgd", "preempt-ea"):
        from distlearn import AllReduceEA, AllReduceSGD, preemption

        (out / f"pid-{rank}").write_text(str(os.getpid()))
        algo = AllReduceSGD(comm) if scenario == "preempt-sgd" else AllReduceEA(comm, tau=3)
        algo.synchronize_parameters(model)
        step = 0
        try:
            while step < 100_000:
                loss = model(torch.randn(4, 6)).square().mean()
                opt.zero_grad()
                loss.backward()
                if scenario == "preempt-sgd":
                    algo.sum_and_normalize_gradients(model)
                opt.step()
                if scenario == "preempt-ea":
                    algo.average_parameters(model)
                step += 1
                got["last"] = step
                ckpt.step(step, objects)
                time.sleep(0.02)
        except SystemExit as stop:
            got["exit"] = stop.code
            got["stopped_at"] = step
            got["rides"] = preemption.exchanges()  # the flag rode the algorithm's collectives
    got["state"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    got["optim"] = opt.state_dict()
    comm.close()
    torch.save(got, out / f".rank-{rank}.pt")
    os.replace(out / f".rank-{rank}.pt", out / f"rank-{rank}.pt")
    if got.get("exit") is not None:
        raise SystemExit(got["exit"])


if __name__ == "__main__":
    main()
