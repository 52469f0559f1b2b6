"""TorchDistributed's small all-reduce at node 0 against gloo's own (the ring).

    python -m bench.gloo_root                          # 2, 4 and 8 processes, 64 KiB-4 MiB
    python -m bench.gloo_root --nodes 4 --sizes-kib 160 1024

Each job starts N processes on this machine over one gloo process group. Each holds
two communicators: `TorchDistributed(gather_bytes=0)` (every all-reduce on the
process group's all-reduce, as DDP's buckets travel) and one whose bound admits every
size measured (gather at node 0, reduce there, broadcast). For each size, float32
sum, the two take turns in blocks of all-reduces, each block after a barrier; a
figure is rank 0's median time per all-reduce over the blocks, and the ratio is
root/ring (below 1.00x the root is faster). The all-reduce is the user's call,
`comm.all_reduce(tensor)`, count slot and packing included.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from bench.allreduce import _ratios, _spread
from bench.procs import free_port


def _worker(rank: int, world: int, port: int, a: argparse.Namespace, out) -> None:
    import torch
    import torch.distributed as dist

    from distlearn.backends import TorchDistributed

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    # admits every size measured, with the count slot that rides along (+1 KiB)
    largest = (max(a.sizes_kib) + 1) * 1024 * (world - 1)
    comms = {
        "ring": TorchDistributed(gather_bytes=0),
        "root": TorchDistributed(gather_bytes=largest),
    }
    rows = []
    for kib in a.sizes_kib:
        x = torch.ones(kib * 1024 // 4)
        # the buffer that travels: x and the count slot (FlatCommunicator packs them)
        if not comms["root"]._at_root(torch.empty(x.numel() + 1)):
            raise RuntimeError(f"{kib} KiB would not be reduced at the root: no comparison")
        times = {name: [] for name in comms}
        reps = max(2, min(20, 4096 // kib))
        for rnd in range(a.rounds):
            for name in comms if rnd % 2 == 0 else list(comms)[::-1]:
                comm = comms[name]
                comm.all_reduce(x)  # untimed
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(reps):
                    comm.all_reduce(x)
                times[name].append((time.perf_counter() - t0) / reps)
        rows.append((kib, times))
    if rank == 0:
        out.put(rows)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.gloo_root", description=__doc__.split("\n")[0]
    )
    p.add_argument("--nodes", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--sizes-kib", type=int, nargs="+", default=[64, 160, 512, 1024, 2048, 4096])
    p.add_argument("--rounds", type=int, default=9, help="blocks per size and communicator")
    a = p.parse_args(argv)
    if min(a.nodes) < 2 or min(a.sizes_kib) < 1:
        p.error("--nodes must be >= 2 and --sizes-kib >= 1")
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    print(f"`python -m bench.gloo_root {' '.join(sys.argv[1:] if argv is None else argv)}`, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} cores, "
          f"load average at start {os.getloadavg()[0]:.2f}.\n")  # fmt: skip
    print("| processes | size KiB | ring ms | root ms | root/ring |")
    print("|---:|---:|---:|---:|---:|")
    for n in a.nodes:
        out = ctx.SimpleQueue()
        port = free_port()
        procs = [ctx.Process(target=_worker, args=(r, n, port, a, out)) for r in range(n)]
        for proc in procs:
            proc.start()
        while out.empty():  # a rank that fails must not leave the others waiting
            if any(proc.exitcode not in (None, 0) for proc in procs):
                for proc in procs:
                    proc.kill()
                raise SystemExit(f"bench.gloo_root: a rank of the {n}-process job failed")
            time.sleep(0.05)
        rows = out.get()
        for proc in procs:
            proc.join()
        for kib, times in rows:
            ring, root = times["ring"], times["root"]
            print(
                f"| {n} | {kib} | {_spread(ring, digits=2)} | {_spread(root, digits=2)} | "
                f"{_ratios(root, ring)} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
