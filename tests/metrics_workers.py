"""One rank of the metrics' across-ranks test: a loader per rank, an all_reduce per step.

    python tests/metrics_workers.py RANK WORLD KEY OUT.json SLOW_RANK STEPS

Every rank reads its partition of in-memory rows; SLOW_RANK's processor sleeps 10 ms
an item, the others' not at all. Each step all-reduces a small tensor, as a gradient
would, so every rank waits for the slowest. At step STEPS // 2 the loader metrics ride
in that step's all_reduce (`metrics_tensor`); after STEPS, an explicit
`metrics(comm=)` call. Both results go to OUT.json.
"""

from __future__ import annotations

import json
import sys
import time

import torch

from distlearn import ipc
from distlearn.dataset import Dataset


class Sleepy:
    """Copies the row, after `seconds`: a processor as slow as a big image's decode."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def __call__(self, data, opt, out):
        if self.seconds:
            time.sleep(self.seconds)
        out.copy_(data)


def main() -> None:
    rank, world, key, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    slow, steps = int(sys.argv[5]), int(sys.argv[6])
    tree = ipc.LocalhostTree(rank, world, key=key)
    x = torch.arange(30000 * 4, dtype=torch.float32).view(-1, 4)
    ds = Dataset({"x": x, "y": torch.zeros(30000, dtype=torch.long)}, partition=rank,
                 partitions=world)  # fmt: skip
    grad = torch.zeros(1000)
    results = {}
    with ds.sampled_batcher(batch_size=8, input_dims=(4,), workers="thread", num_workers=1,
                            processor=Sleepy(0.01 if rank == slow else 0.0)) as b:  # fmt: skip
        for step in range(steps):
            b.next_batch()
            if step == steps // 2:  # the metrics ride in this step's all_reduce
                ranks = b.metrics_tensor(tree)
                tree.all_reduce([grad, ranks])
                results["rode"] = b.metrics(ranks=ranks)["ranks"]
            else:
                tree.all_reduce(grad)
        results["explicit"] = b.metrics(comm=tree)["ranks"]
    tree.close()
    with open(out, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
