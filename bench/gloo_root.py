"""TorchDistributed's small all-reduce at node 0 against gloo's own (the ring).

    python -m bench.gloo_root                          # 2, 4 and 8 processes, 64 KiB-4 MiB
    python -m bench.gloo_root --nodes 4 --sizes-kib 160 1024

Each job starts N processes on this machine over one gloo process group. Each holds
two communicators: `TorchDistributed(gather_bytes=0)` (every all-reduce on the
process group's all-reduce, as DDP's buckets travel) and one whose bound admits every
size measured (gather at node 0, reduce there, broadcast), made to take that path
whatever the host's cores (TorchDistributed takes it by itself only where the nodes
outnumber half the cores). For each size, float32
sum, the two take turns in blocks of all-reduces, each block after a barrier; a
figure is rank 0's median time per all-reduce over the blocks, and the ratio is
root/ring (below 1.00x the root is faster). The all-reduce is the user's call,
`comm.all_reduce(tensor)`, count slot and packing included.

`--hosts RATE` puts each process in a network namespace of its own, every link
limited to RATE (bench/netns.py): what node 0's one link costs the root path when
the nodes are separate machines, where TorchDistributed keeps the ring (the
namespaces share this kernel, so the root path is taken here anyway). The
processes still share this machine's cores.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

from bench import netns
from bench.allreduce import _ratios, _spread
from bench.procs import free_port


def _worker(
    rank: int, world: int, port: int, a: argparse.Namespace, out, hosts: list | None = None
) -> None:
    import torch
    import torch.distributed as dist

    from distlearn.backends import TorchDistributed

    address = "127.0.0.1"
    if hosts:  # --hosts: this rank in its own namespace, node 0's address to meet at
        netns.enter(hosts[rank][0])
        address = hosts[0][1]
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://{address}:{port}", rank=rank, world_size=world
    )
    # admits every size measured, with the count slot that rides along (+1 KiB)
    largest = (max(a.sizes_kib) + 1) * 1024 * (world - 1)
    comms = {
        "ring": TorchDistributed(gather_bytes=0),
        "root": TorchDistributed(gather_bytes=largest),
    }
    # The root path whatever TorchDistributed would pick on this host's cores (it
    # takes it only where the nodes outnumber half the cores): that is what is measured.
    comms["root"]._agree()  # (collective: every rank calls it once)
    comms["root"]._root_path = True
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
    p.add_argument(
        "--hosts",
        metavar="RATE",
        help="each process in a network namespace of its own, their links limited to RATE "
        "(e.g. 1gbit; root, iproute2): separate machines' bandwidth, on this machine's cores",
    )
    a = p.parse_args(argv)
    if min(a.nodes) < 2 or min(a.sizes_kib) < 1:
        p.error("--nodes must be >= 2 and --sizes-kib >= 1")
    if a.hosts:
        why = netns.missing()
        if why:
            p.error(f"--hosts: {why}")
        try:
            netns.burst(a.hosts)  # a malformed rate fails here, before any job
        except ValueError as err:
            p.error(f"--hosts: {err}")
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    print(f"`python -m bench.gloo_root {' '.join(sys.argv[1:] if argv is None else argv)}`, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} cores, "
          f"load average at start {os.getloadavg()[0]:.2f}"
          f"{f', each process a host on a {a.hosts} link' if a.hosts else ''}.\n")  # fmt: skip
    print("| processes | size KiB | ring ms | root ms | root/ring |")
    print("|---:|---:|---:|---:|---:|")
    for n in a.nodes:
        with netns.hosts(n, a.hosts) if a.hosts else contextlib.nullcontext() as hosts:
            rows = _job(ctx, n, a, hosts)
        for kib, times in rows:
            ring, root = times["ring"], times["root"]
            print(
                f"| {n} | {kib} | {_spread(ring, digits=2)} | {_spread(root, digits=2)} | "
                f"{_ratios(root, ring)} |",
                flush=True,
            )
    return 0


def _job(ctx, n: int, a: argparse.Namespace, hosts: list | None) -> list:
    """Rank 0's rows of one job of `n` processes."""
    out = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, n, port, a, out, hosts)) for r in range(n)]
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
    return rows


if __name__ == "__main__":
    sys.exit(main())
