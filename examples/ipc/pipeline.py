"""A three-stage model pipeline over channels, as torch-ipc's examples/model-parallelism.lua.

    python examples/ipc/pipeline.py [--batches 32]

An nn.Sequential of three conv blocks is cut in three: stage s (an ipc.map
worker) reads its input from channel s, runs its block, and writes the output
to channel s + 1. The main process feeds channel 0, closes it, and reads the
last channel until it is drained: closing cascades down the pipeline, as
torch-ipc's channels do. The outputs are checked against the whole model run
in one process.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from distlearn import ipc


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv1d(20, 10, 5), nn.Tanh(),
        nn.Conv1d(10, 5, 5), nn.Tanh(),
        nn.Conv1d(5, 1, 5), nn.Tanh(),
    )  # fmt: skip


def stage(channels: list, s: int) -> int:
    torch.set_num_threads(1)
    block = make_model()[2 * s : 2 * s + 2]  # the same weights in every process (seeded)
    done = 0
    while True:
        status, item = channels[s].read()
        if status == ipc.Channel.DRAINED:
            channels[s + 1].close()  # the cascade: nothing more will come downstream
            return done
        with torch.no_grad():
            channels[s + 1].write({"id": item["id"], "x": block(item["x"])})
        done += 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=32)
    args = ap.parse_args()
    channels = [ipc.Channel() for _ in range(4)]
    inputs = [torch.randn(8, 20, 200, generator=torch.Generator().manual_seed(k))
              for k in range(args.batches)]  # fmt: skip
    start = time.perf_counter()
    stages = ipc.map(3, stage, channels)
    for k, x in enumerate(inputs):
        channels[0].write({"id": k, "x": x})
    channels[0].close()
    outputs = {}
    while True:
        status, item = channels[3].read()
        if status == ipc.Channel.DRAINED:
            break
        outputs[item["id"]] = item["x"]
    counts = stages.join(timeout=60)
    dt = time.perf_counter() - start
    model = make_model()
    with torch.no_grad():
        for k, x in enumerate(inputs):
            torch.testing.assert_close(outputs[k], model(x))
    print(
        f"pipeline.py: {args.batches} batches through 3 stages in {dt:.2f} s; per stage "
        f"{counts}; outputs equal the whole model's"
    )


if __name__ == "__main__":
    main()
