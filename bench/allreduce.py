"""Allreduce rows: torch.distributed gloo vs the ipc tree, side by side in the same processes.

`run(world, sizes, ...)` starts `world` processes (`python -m bench.allreduce`);
each joins a gloo group and, when `ipc` is importable, an `ipc.LocalhostTree`.
For every size both are checked for a correct sum once, then timed in
alternating order (gloo, tree, then tree, gloo, ...) so drift on a shared
machine hits both alike. A repetition times `iters` back-to-back ops after a
barrier; the figure is rank 0's seconds per op. algbw = bytes / time, busbw =
algbw * 2 (n - 1) / n (the NCCL convention: what each link carries).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.procs import free_port, kill_group

SIZES = {"1 elem": 4, "64 KiB": 64 << 10, "1 MiB": 1 << 20, "16 MiB": 16 << 20, "64 MiB": 64 << 20}


def busbw_factor(world: int) -> float:
    return 2.0 * (world - 1) / world if world > 1 else 1.0


def run(
    world: int,
    sizes: dict[str, int],
    reps: int = 3,
    target_s: float = 0.5,
    impls: tuple[str, ...] = ("gloo", "tree"),
    timeout: float = 600.0,
) -> list[dict]:
    """Run the allreduce rows for `world` processes; one dict per (impl, size)."""
    repo = Path(__file__).resolve().parent.parent
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(repo), env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="bench-allreduce-") as tmp:
        out = Path(tmp, "result.json")
        args = [
            "--world", str(world), "--port", str(port), "--reps", str(reps),
            "--target-s", str(target_s), "--sizes", json.dumps(sizes),
            "--impls", ",".join(impls), "--out", str(out),
        ]  # fmt: skip
        procs = [
            subprocess.Popen(
                [sys.executable, "-m", "bench.allreduce", "--rank", str(r), *args],
                env=env,
                start_new_session=True,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for r in range(world)
        ]
        deadline = time.monotonic() + timeout
        try:
            for p in procs:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"allreduce with {world} processes ran past {timeout}s") from None
        finally:
            for p in procs:
                kill_group(p)
        logs = [p.stdout.read() for p in procs]
        for p in procs:
            p.stdout.close()
        bad = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode != 0]
        if bad or not out.exists():
            detail = "\n".join(f"--- rank {r}:\n{logs[r][-3000:]}" for r, _ in bad or [(0, 0)])
            raise RuntimeError(f"allreduce ranks failed {bad}:\n{detail}")
        return json.loads(out.read_text())


def _worker(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{a.port}", rank=a.rank, world_size=a.world
    )
    ops = {}
    errors = {}
    if "gloo" in a.impls:
        ops["gloo"] = lambda t: dist.all_reduce(t)
    if "tree" in a.impls:
        try:
            from distlearn import ipc

            tree = ipc.LocalhostTree(a.rank, a.world, key=f"bench-allreduce-{a.port}")
            ops["tree"] = lambda t: tree.all_reduce(t)
        except Exception as err:  # the tree may not be built yet: report gloo alone
            errors["tree"] = f"{type(err).__name__}: {err}"
    # every rank must agree on which implementations run
    have = torch.tensor([1 if "tree" in ops else 0])
    dist.all_reduce(have, op=dist.ReduceOp.MIN)
    if not have.item() and "tree" in ops:
        del ops["tree"]

    results = []
    for label, nbytes in a.sizes.items():
        numel = max(1, nbytes // 4)
        buf = torch.empty(numel, dtype=torch.float32)
        for name, op in ops.items():  # correctness once: the sum of the ranks everywhere
            buf.fill_(float(a.rank + 1))
            op(buf)
            want = a.world * (a.world + 1) / 2
            if not torch.all(buf == want):
                raise AssertionError(f"{name} {label}: got {buf[:4].tolist()}, want {want}")
        buf.zero_()  # time on zeros: repeated sums of ones would overflow to inf
        # iterations per repetition: rank 0 sizes it on gloo (or the first impl) and tells all
        first = next(iter(ops.values()))
        dist.barrier()
        t0 = time.perf_counter()
        first(buf)
        one = time.perf_counter() - t0
        iters = torch.tensor([max(3, min(2000, int(a.target_s / max(one, 1e-6))))])
        dist.broadcast(iters, 0)
        iters = int(iters.item())
        times: dict[str, list[float]] = {name: [] for name in ops}
        names = list(ops)
        for rep in range(a.reps):
            for name in names if rep % 2 == 0 else names[::-1]:
                op = ops[name]
                op(buf)  # one untimed op: connections and buffers warm
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(iters):
                    op(buf)
                times[name].append((time.perf_counter() - t0) / iters)
        for name, ts in times.items():
            results.append(
                {"impl": name, "size": label, "bytes": numel * 4, "iters": iters, "times_s": ts}
            )
    for name, err in errors.items():
        results.append({"impl": name, "error": err})
    if a.rank == 0:
        Path(a.out).write_text(json.dumps(results))
    dist.barrier()
    if "tree" in ops:
        tree.close()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.allreduce")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--target-s", type=float, default=0.5)
    p.add_argument("--sizes", type=json.loads, default=SIZES)
    p.add_argument("--impls", type=lambda s: tuple(s.split(",")), default=("gloo", "tree"))
    p.add_argument("--out", required=True)
    _worker(p.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
