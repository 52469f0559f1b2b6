"""ipc's client/server and work queues against the peers a user would otherwise pick.

    .venv/bin/python -m bench.ipc_services [--reps 5] [--out bench/out/ipc-services.json]

Rows, each repetition in a fresh set of processes, peers alternating inside it:
- client/server round trips between two processes: ipc.Server/Client against
  torch.distributed gloo send/recv in the SAME two processes (4 MB float32,
  and 8 bytes for latency; the client takes the server's direct Unix socket,
  ipc.services.direct, and the 4 MB tensors go through shared memory,
  ipc.services.bulk);
- work queue: N tensors from an owner through 2 workers and back, ipc.WorkQueue
  against torch.multiprocessing queues (4 KB x 10,000 and 4 MB x 200);
- async all_reduce (from bench.allreduce, mode "async"): 8 buckets of 4 MiB in
  flight against 8 synchronous calls in a row, 2 processes.
Figures are medians over the repetitions; ratios are taken within each
repetition, then their median.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


# ---- client/server vs gloo --------------------------------------------------------------


def _pingpong_rank(rank: int, port: int, ipc_port: int, token: str, sizes: dict, out) -> None:
    import torch
    import torch.distributed as dist

    from distlearn import ipc

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    if rank == 0:
        server = ipc.Server("127.0.0.1", ipc_port, token=token)
        dist.barrier()
        [conn] = server.clients(1, timeout=60)
    else:
        dist.barrier()
        client = ipc.Client("127.0.0.1", ipc_port, token=token)
    results = _trips(rank, conn if rank == 0 else client, sizes, dist)
    if rank == 0:
        out.put(results)
        server.close()
    else:
        client.close()
    dist.destroy_process_group()


def _trips(rank: int, end, sizes: dict, dist) -> dict:
    """Round trips between the two ranks: ipc (rank 0's Connection, rank 1's Client),
    gloo, ipc again; the best of the two ipc blocks. {label: {"ipc": s, "gloo": s}}."""
    import torch

    results = {}
    for label, (nbytes, rounds) in sizes.items():
        x = torch.ones(max(1, nbytes // 4))
        buf = torch.empty_like(x)

        def ipc_trip(x=x, buf=buf):
            if rank == 0:
                end.send(x)
                end.recv(into=buf)
            else:
                end.send(end.recv(into=buf))

        def gloo_trip(x=x, buf=buf):
            if rank == 0:
                dist.send(x, 1)
                dist.recv(buf, 1)
            else:
                dist.recv(buf, 0)
                dist.send(buf, 0)

        row = {}
        for name, trip in (("ipc", ipc_trip), ("gloo", gloo_trip), ("ipc", ipc_trip)):
            for _ in range(3):
                trip()  # warm-up
            dist.barrier()
            t = time.perf_counter()
            for _ in range(rounds):
                trip()
            row.setdefault(name, []).append((time.perf_counter() - t) / rounds)
        results[label] = {k: min(v) for k, v in row.items()}
    dist.barrier()
    return results


# ---- client/server across hosts: the baseline's default against this checkout's ------------


def _hosts_rank(rank: int, port: int, sizes: dict, out: str) -> None:
    """One rank on a host of its own (BENCH_HOSTS, as bench.allreduce): rank 0 a Server on
    its host's address (token from $IPC_TOKEN), rank 1 a Client over TCP. BENCH_PAIR=1
    (this checkout only): two pairs in the same processes, encrypt=False and the default
    (CURVE), timed in turn; {"plain": [trips...], "curve": [trips...]}."""
    import torch
    import torch.distributed as dist

    from bench import netns
    from distlearn import ipc

    hosts = json.loads(os.environ["BENCH_HOSTS"])
    netns.enter(hosts[rank][0])
    address = hosts[0][1]
    pair = os.environ.get("BENCH_PAIR") == "1"
    kinds = {"plain": {"encrypt": False}, "curve": {}} if pair else {"default": {}}
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{address}:{port}", rank=rank, world_size=2)
    ends, closers = {}, []
    for k, (name, opts) in enumerate(kinds.items()):
        if rank == 0:
            server = ipc.Server(address, port + 1 + k, **opts)
            dist.barrier()
            [ends[name]] = server.clients(1, timeout=60)
            closers.append(server)
        else:
            dist.barrier()
            ends[name] = ipc.Client(address, port + 1 + k, timeout=60, **opts)
            closers.append(ends[name])
    if pair:
        results: dict = {name: [] for name in kinds}
        for turn in range(3):
            for name in list(kinds)[:: 1 if turn % 2 == 0 else -1]:
                results[name].append(_trips(rank, ends[name], sizes, dist))
    else:
        results = _trips(rank, ends["default"], sizes, dist)
    for c in closers:
        c.close()
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


def hosts_once(sizes: dict, rate: str, path_first: str | None, pair: bool = False) -> dict:
    """One process set across two hosts; `path_first`: another checkout's packages first;
    `pair`: this checkout's encrypt=False and default in the same processes."""
    from bench import netns
    from bench.procs import free_port, wait_ranks

    env = dict(os.environ, OMP_NUM_THREADS="1", IPC_TOKEN=secrets.token_hex(32))
    env["BENCH_PAIR"] = "1" if pair else "0"
    # what a client on another host gets: no shared memory (the host's boot id tells
    # namespaces of one kernel apart from machines), no direct Unix socket
    env.update(IPC_BULK="0", IPC_DIRECT="0")
    first = [path_first] if path_first else []
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [*first, str(REPO), env.get("PYTHONPATH")]))
    with netns.hosts(2, rate) as hs, tempfile.TemporaryDirectory() as tmp:
        env["BENCH_HOSTS"] = json.dumps(hs)
        out, port = Path(tmp, "out.json"), free_port()
        cmd = [sys.executable, "-m", "bench.ipc_services", "--hosts-rank"]
        procs = [
            subprocess.Popen(
                [*cmd, str(r), str(port), json.dumps(sizes), str(out)],
                env=env,
                cwd=REPO,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for r in range(2)
        ]
        logs = wait_ranks(procs, 600)
        if logs is None or any(p.returncode for p in procs) or not out.exists():
            raise RuntimeError(f"client/server across hosts failed: {logs and logs[-1][-3000:]}")
        return json.loads(out.read_text())


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pingpong_once(sizes: dict) -> dict:
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    port, ipc_port, token = _free_port(), _free_port(), secrets.token_hex(16)
    procs = [
        ctx.Process(target=_pingpong_rank, args=(r, port, ipc_port, token, sizes, out))
        for r in range(2)
    ]
    for p in procs:
        p.start()
    try:
        return out.get(timeout=600)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()


# ---- work queue vs torch.multiprocessing queues ------------------------------------------


def _ours_worker(name: str, i: int) -> None:
    from distlearn import ipc

    q = ipc.WorkQueue(name)
    while (x := q.read()) is not None:
        q.write(x)
    q.close()


def _mp_worker(qi, qo) -> None:
    while (x := qi.get()) is not None:
        qo.put(x.clone())  # a received tensor's storage is the sender's; send a new one back


def workqueue_once(nbytes: int, n: int) -> dict:
    import torch
    import torch.multiprocessing as tmp

    from distlearn import ipc

    torch.set_num_threads(1)
    x = torch.ones(nbytes // 4)
    res = {}
    for impl in ("ipc", "mp"):
        if impl == "ipc":
            name = f"bench-{os.getpid()}-{nbytes}"
            q = ipc.WorkQueue(name)
            workers = ipc.map(2, _ours_worker, name)
            t = time.perf_counter()
            for _ in range(n):
                q.write(x)
            for _ in range(n):
                q.read()
            res[impl] = n / (time.perf_counter() - t)
            q.close()
            workers.join(timeout=60)
        else:
            ctx = tmp.get_context("fork")
            qi, qo = ctx.Queue(), ctx.Queue()
            procs = [ctx.Process(target=_mp_worker, args=(qi, qo)) for _ in range(2)]
            for p in procs:
                p.start()
            t = time.perf_counter()
            for _ in range(n):
                qi.put(x.clone())  # a new tensor per item, as the owner's items would be
            for _ in range(n):
                qo.get()
            res[impl] = n / (time.perf_counter() - t)
            for _ in procs:
                qi.put(None)
            for p in procs:
                p.join()
    return res


def _workqueue_child(nbytes: int, n: int) -> None:
    print(json.dumps(workqueue_once(nbytes, n)))


# ---- the report ------------------------------------------------------------------------------


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=str(REPO / "bench" / "out" / "ipc-services.json"))
    ap.add_argument("--wq-child", nargs=2, type=int, help=argparse.SUPPRESS)
    ap.add_argument("--hosts-rank", nargs=4, help=argparse.SUPPRESS)
    ap.add_argument("--skip", nargs="*", default=[],
                    choices=["pingpong", "workqueue", "async", "hosts"])  # fmt: skip
    ap.add_argument(
        "--baseline",
        default="main",
        help="git ref whose client/server runs against this checkout's across hosts",
    )
    ap.add_argument("--hosts-rate", default="10gbit", help="the links between the two hosts")
    a = ap.parse_args()
    if a.wq_child:
        _workqueue_child(*a.wq_child)
        return
    if a.hosts_rank:
        rank, port, sizes, out = a.hosts_rank
        _hosts_rank(int(rank), int(port), json.loads(sizes), out)
        return
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    report: dict = {"reps": a.reps}
    if "pingpong" not in a.skip:
        sizes = {"4 MB": (4_000_000, 50), "8 B": (8, 2000)}
        runs = [pingpong_once(sizes) for _ in range(a.reps)]
        for label in sizes:
            ipc_s = [r[label]["ipc"] for r in runs]
            gloo_s = [r[label]["gloo"] for r in runs]
            ratio = [r[label]["gloo"] / r[label]["ipc"] for r in runs]
            report[f"pingpong {label}"] = {
                "ipc_us": med(ipc_s) * 1e6, "gloo_us": med(gloo_s) * 1e6,
                "ipc_over_gloo_throughput": med(ratio),
                "ipc_MBps": sizes[label][0] * 2 / med(ipc_s) / 1e6,
                "gloo_MBps": sizes[label][0] * 2 / med(gloo_s) / 1e6,
            }  # fmt: skip
            print(label, report[f"pingpong {label}"], flush=True)
    if "hosts" not in a.skip:
        from bench import netns
        from bench.allreduce import baseline_path

        why = netns.missing()
        if why:
            print(f"client/server across hosts not measured: {why}", flush=True)
        else:
            sizes = {"4 MB": (4_000_000, 20), "8 B": (8, 500)}
            # base: the baseline's default; this: this checkout's (CURVE); again: the
            # baseline once more (A/A, the noise); pair: this checkout's encrypt=False and
            # CURVE alternating in the same processes (the cost without process noise)
            runs: dict[str, list[dict]] = {"base": [], "this": [], "again": [], "pair": []}
            with tempfile.TemporaryDirectory(prefix="bench-baseline-") as tmp:
                base = baseline_path(a.baseline, Path(tmp))
                order = [("base", base), ("this", None), ("again", base), ("pair", None)]
                for rep in range(a.reps):
                    k = rep % len(order)
                    for name, path in order[k:] + order[:k]:
                        runs[name].append(
                            hosts_once(sizes, a.hosts_rate, path, pair=name == "pair")
                        )
            for label, (nbytes, _) in sizes.items():

                def ipc_s(r: dict, label: str = label) -> float:
                    return r[label]["ipc"]

                row: dict = {
                    name: {"ipc_us": med([ipc_s(r) for r in runs[name]]) * 1e6,
                           "gloo_us": med([r[label]["gloo"] for r in runs[name]]) * 1e6}
                    for name in ("base", "this", "again")
                }  # fmt: skip
                # this checkout's time over the baseline's, repetition by repetition
                row["this_over_base"] = [
                    ipc_s(t) / ipc_s(b) for t, b in zip(runs["this"], runs["base"], strict=True)
                ]
                row["again_over_base"] = [ipc_s(t) / ipc_s(b)
                                          for t, b in zip(runs["again"], runs["base"],
                                                          strict=True)]  # fmt: skip
                # in each pair run: the median of its alternations, CURVE over plain
                row["plain_us"] = [med([ipc_s(r) for r in p["plain"]]) * 1e6 for p in runs["pair"]]
                row["curve_us"] = [med([ipc_s(r) for r in p["curve"]]) * 1e6 for p in runs["pair"]]
                row["curve_over_plain"] = [
                    med([ipc_s(c) / ipc_s(p) for c, p in zip(q["curve"], q["plain"], strict=True)])
                    for q in runs["pair"]
                ]
                row["curve_MBps"] = nbytes * 2 / (med(row["curve_us"]) / 1e6) / 1e6
                report[f"hosts {label}"] = row
                print(f"across hosts {label}", json.dumps(row), flush=True)
    if "workqueue" not in a.skip:
        for label, nbytes, n in (("4 KB x 10000", 4096, 10_000), ("4 MB x 200", 4 << 20, 200)):
            runs = []
            for _ in range(a.reps):
                proc = subprocess.run(
                    [sys.executable, "-m", "bench.ipc_services", "--wq-child", str(nbytes), str(n)],
                    env=env, cwd=REPO, capture_output=True, text=True, timeout=900,
                )  # fmt: skip
                if proc.returncode != 0:
                    raise RuntimeError(proc.stderr[-3000:])
                runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
            report[f"workqueue {label}"] = {
                "ipc_items_s": med([r["ipc"] for r in runs]),
                "mp_items_s": med([r["mp"] for r in runs]),
                "ipc_over_mp": med([r["ipc"] / r["mp"] for r in runs]),
            }
            print(label, report[f"workqueue {label}"], flush=True)
    if "async" not in a.skip:
        from bench import allreduce

        rows = allreduce.run(2, {"4 MiB": 4 << 20}, reps=a.reps, impls=("tree",), mode="async")
        report["async all_reduce"] = rows
        print("async", rows, flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
