"""A work queue feeding ipc.map workers, as torch-ipc's examples/workqueue.lua.

    python examples/ipc/workqueue_map.py [--workers 3] [--items 2000]

The owner writes --items tensors to the queue "squares"; each of --workers
map workers reads items until the queue is closed and drained, and writes
back the sum of squares with its index. The owner checks that every item came
back exactly once, and prints items/s and how the work was shared.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from distlearn import ipc


def worker(name: str, i: int) -> int:
    q = ipc.WorkQueue(name)  # the owner opened it first, so we are a worker
    done = 0
    while (item := q.read()) is not None:
        q.write({"id": item["id"], "sumsq": float((item["x"] ** 2).sum())})
        done += 1
    q.close()
    return done


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--items", type=int, default=2000)
    args = ap.parse_args()
    name = f"squares-{os.getpid()}"
    q = ipc.WorkQueue(name)
    assert q.owner
    start = time.perf_counter()
    workers = ipc.map(args.workers, worker, name)
    for k in range(args.items):
        q.write({"id": k, "x": torch.full((256,), float(k), dtype=torch.float64)})
    results = {}
    for _ in range(args.items):
        r = q.read(timeout=120)
        assert r["id"] not in results, f"item {r['id']} came back twice"
        results[r["id"]] = r["sumsq"]
    q.close(timeout=60)
    shares = workers.join(timeout=60)
    dt = time.perf_counter() - start
    assert sorted(results) == list(range(args.items))
    assert all(results[k] == 256.0 * k * k for k in results)
    print(
        f"workqueue_map.py: {args.items} items through {args.workers} map workers in "
        f"{dt:.2f} s ({args.items / dt:.0f} items/s); items per worker: {shares}"
    )


if __name__ == "__main__":
    main()
