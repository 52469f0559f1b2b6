"""One replica per XLA device (torch_xla.launch): AllReduceSGD over distlearn.backends.XLA.

    python tests/distlearn_xla_launch.py OUT_DIR

Each replica trains on its 1/N of every batch and writes its final state to
OUT_DIR/rank-R.pt, to compare with one process on the whole batch.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch_xla
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import distlearn_sim as sim

from distlearn import AllReduceSGD
from distlearn.backends import XLA


def replica(index: int, out: str) -> None:
    comm = XLA()
    dev = comm.device
    model = sim.make_model(seed=100 + comm.node_index).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sgd = AllReduceSGD(comm)
    sgd.synchronize_parameters(model)
    for step in range(4):
        x, y = sim.batch(step, 24)
        x, y = x[comm.node_index :: comm.num_nodes], y[comm.node_index :: comm.num_nodes]
        opt.zero_grad()
        nn.functional.cross_entropy(model(x.to(dev)), y.to(dev)).backward()
        sgd.sum_and_normalize_gradients(model)
        opt.step()
    state = {k: v.cpu() for k, v in model.state_dict().items()}
    torch.save(state, Path(out) / f"rank-{comm.node_index}.pt")


if __name__ == "__main__":
    torch_xla.launch(replica, args=(sys.argv[1],))
