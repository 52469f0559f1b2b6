"""Workers for tests/test_cluster.py, launched by srun, sbatch or torchrun:
``python tests/cluster_workers.py SCENARIO OUTDIR [ARGS]``.

Each writes what it saw as JSON lines into OUTDIR (one file per rank and launch), for
the test to check; nothing here decides whether the test passed.

- ``tree``: one all-reduce over ``ipc.Tree.from_env()``;
- ``gloo``: one all-reduce over ``TorchDistributed.from_env()`` (gloo);
- ``steps N``: N steps of a tree all-reduce, a line per step (a ledger of steps done);
- ``elastic``: a tree and a gloo all-reduce, then wait for OUTDIR/release (so the test
  can kill a worker of a known generation while the others wait).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

from distlearn import ipc


def launch() -> dict:
    """Who launched this process, as the launcher said."""
    env = os.environ
    keys = ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT",
            "SLURM_PROCID", "SLURM_NTASKS", "SLURM_JOB_ID", "SLURM_STEP_ID",
            "SLURM_RESTART_COUNT")  # fmt: skip
    return {k: env[k] for k in keys if k in env} | {"pid": os.getpid()}


def record(out: Path, rank: int, **fields) -> None:
    line = json.dumps({"rank": rank, "t": time.time(), **launch(), **fields})
    with open(out / f"rank{rank}-{os.getpid()}.jsonl", "a") as f:
        f.write(line + "\n")
        f.flush()
        os.fsync(f.fileno())


def tree_sum(tree: ipc.Tree) -> tuple[int, float]:
    x = torch.tensor([float(tree.node_index + 1)])
    n = tree.all_reduce(x)
    return n, x.item()


def gloo_sum():
    from distlearn.backends import TorchDistributed

    comm = TorchDistributed.from_env(backend="gloo", timeout=60)
    x = torch.tensor([float(comm.node_index + 1)])
    n = comm.all_reduce(x)
    return comm, n, x.item()


def main() -> None:
    scenario, out = sys.argv[1], Path(sys.argv[2])
    if scenario == "tree":
        with ipc.Tree.from_env(timeout=60) as tree:
            n, total = tree_sum(tree)
            record(out, tree.node_index, nodes=tree.num_nodes, count=n, sum=total)
    elif scenario == "gloo":
        comm, n, total = gloo_sum()
        record(out, comm.node_index, nodes=comm.num_nodes, count=n, sum=total)
        comm.close()
    elif scenario == "steps":
        steps = int(sys.argv[3])
        with ipc.Tree.from_env(timeout=60) as tree:
            for step in range(steps):
                n, total = tree_sum(tree)
                record(out, tree.node_index, step=step, count=n, sum=total)
                time.sleep(0.2)
    elif scenario == "elastic":
        with ipc.Tree.from_env(timeout=60) as tree:
            n, total = tree_sum(tree)
            comm, gn, gtotal = gloo_sum()
            record(out, tree.node_index, nodes=tree.num_nodes, count=n, sum=total,
                   gloo_count=gn, gloo_sum=gtotal)  # fmt: skip
            deadline = time.monotonic() + 240
            while not (out / "release").exists() and time.monotonic() < deadline:
                time.sleep(0.1)
            comm.close()
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")


if __name__ == "__main__":
    main()
