"""Step time of the README's plain loop: AllReduceSGD against DDP, side by side.

    python -m bench.step_time                        # both models, 2 and 4 processes
    python -m bench.step_time --models convnet --nodes 2 --reps 5
    python -m bench.step_time --rows gloo --bucket-mb 4 25 --first-bucket-mb 0.25 1

A step is what a user's loop does: `zero_grad`, forward, `backward`, then for
AllReduceSGD `sum_and_normalize_gradients(model)`, then `opt.step()` (SGD with
momentum). Rows, each a fresh job of N processes per repetition:

    none       no communication (each process trains alone): the compute floor
    ddp        torch DistributedDataParallel over gloo (its defaults: 25 MiB buckets)
    gloo       AllReduceSGD over TorchDistributed(gloo): buckets during backward
    gloo-sync  the same with overlap=False: one all-reduce after backward
    ipc        AllReduceSGD over the ipc tree (overlapped if the tree has async_op)
    ipc-sync   the same with overlap=False
    ea-gloo, ea-gloo-sync, ea-ipc, ea-ipc-sync
               AllReduceEA (tau 10, alpha 0.2) with and without its average
               overlapped with the next steps (compare their mean, not the median:
               the average costs one step in tau)

Figures: rank 0's median ms per step over the timed steps (after warm-up steps),
then the median (min-max) over repetitions; ratios to DDP are paired per
repetition (the same round of the alternating order) and their median is shown.
Models: `convnet`, 9.5M parameters (two 3x3 convolutions, three linear layers, on
3x32x32 inputs) and `mnist`, examples/mnist_lib.py's Net; batch 32 per process.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.procs import free_port, kill_group

log = logging.getLogger("bench.step_time")
BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
ROWS = (
    "none", "ddp", "gloo", "gloo-sync", "ipc", "ipc-sync",
    "ea-gloo", "ea-gloo-sync", "ea-ipc", "ea-ipc-sync",
)  # fmt: skip
MODELS = ("convnet", "mnist")
_MiB = 1 << 20


# ----------------------------------------------------------------------------- models


def make_model(name: str):
    """The model (same weights on every rank) and the shape of one input item."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    if name == "convnet":
        model = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(64 * 8 * 8, 2048),
            nn.ReLU(),
            nn.Linear(2048, 512),
            nn.ReLU(),
            nn.Linear(512, 10),
        )
        return model, (3, 32, 32)
    if name == "mnist":
        sys.path.insert(0, str(REPO / "examples"))
        import mnist_lib

        return mnist_lib.Net(), (1, 28, 28)
    raise ValueError(f"unknown model {name!r}; choose from {MODELS}")


# ----------------------------------------------------------------------------- one rank


def _worker(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    torch.set_num_threads(a.threads)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{a.port}", rank=a.rank, world_size=a.world
    )
    model, item = make_model(a.model)
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    g = torch.Generator().manual_seed(a.rank)
    batches = [
        (torch.randn(a.batch, *item, generator=g), torch.randint(0, 10, (a.batch,), generator=g))
        for _ in range(4)
    ]
    sgd = ea = tree = None
    net = model
    if a.row == "ddp":
        net = torch.nn.parallel.DistributedDataParallel(model)
    elif a.row != "none":
        from distlearn import AllReduceEA, AllReduceSGD

        if "ipc" in a.row:
            from distlearn import ipc

            comm = tree = ipc.LocalhostTree(a.rank, a.world, key=f"bench-steps-{a.port}")
        else:
            from distlearn.backends import TorchDistributed

            comm = TorchDistributed()
        overlap = not a.row.endswith("-sync")
        if a.row.startswith("ea-"):
            ea = AllReduceEA(comm, tau=10, alpha=0.2, overlap=overlap)
            ea.synchronize_parameters(model)
        else:
            sgd = AllReduceSGD(
                comm,
                overlap=overlap,
                bucket_bytes=a.bucket_bytes,
                first_bucket_bytes=a.first_bucket_bytes,
                grad_dtype=a.grad_dtype,
            )
            sgd.synchronize_parameters(model)

    def step(i: int) -> None:
        x, y = batches[i % len(batches)]
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        if sgd is not None:
            sgd.sum_and_normalize_gradients(model)
        opt.step()
        if ea is not None:
            ea.average_parameters(model)

    for i in range(a.warmup):
        step(i)
    dist.barrier()
    times = []
    for i in range(a.steps):
        t0 = time.perf_counter()
        step(i)
        times.append(time.perf_counter() - t0)
    dist.barrier()
    if a.rank == 0:
        result = {"times_s": times, "params": params}
        if sgd is not None:
            result["sgd"] = sgd.stats
        Path(a.out).write_text(json.dumps(result))
    if tree is not None:
        tree.close()
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- the runner


def run_job(cfg: dict, a: argparse.Namespace) -> dict:
    """One repetition of one configuration: N fresh processes; rank 0's step times."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    threads = a.threads or max(1, (os.cpu_count() or 1) // cfg["nodes"])
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="bench-steps-") as tmp:
        out = Path(tmp, "rank0.json")
        args = [
            "--worker", "--row", cfg["row"], "--model", cfg["model"], "--world",
            str(cfg["nodes"]), "--port", str(port), "--steps", str(a.steps), "--warmup",
            str(a.warmup), "--batch", str(a.batch), "--threads", str(threads),
            "--bucket-bytes", str(cfg["bucket_bytes"]), "--first-bucket-bytes",
            str(cfg["first_bucket_bytes"]), "--out", str(out),
        ] + (["--grad-dtype", a.grad_dtype] if a.grad_dtype else [])  # fmt: skip
        procs = [
            subprocess.Popen(
                [sys.executable, "-m", "bench.step_time", "--rank", str(r), *args],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
            for r in range(cfg["nodes"])
        ]
        deadline = time.monotonic() + a.timeout
        try:
            for p in procs:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {a.timeout:.0f}s"}
        finally:
            for p in procs:
                kill_group(p)
        logs = [p.stdout.read() for p in procs]
        for p in procs:
            p.stdout.close()
        bad = [r for r, p in enumerate(procs) if p.returncode != 0]
        if bad or not out.exists():
            r = bad[0] if bad else 0
            return {"error": f"rank {r}: " + " | ".join(logs[r].strip().splitlines()[-6:])}
        res = json.loads(out.read_text())
    res["ms"] = 1e3 * statistics.median(res["times_s"])
    res["mean_ms"] = 1e3 * statistics.fmean(res["times_s"])
    return res


def label(cfg: dict) -> str:
    row = cfg["row"]
    if row in ("none", "ddp") or row.startswith("ea-") or not cfg.get("sweep"):
        return row
    return f"{row} ({cfg['bucket_bytes'] / _MiB:g}/{cfg['first_bucket_bytes'] / _MiB:g} MiB)"


def configs(a: argparse.Namespace) -> list[dict]:
    sweep = len(a.bucket_mb) > 1 or len(a.first_bucket_mb) > 1
    out = []
    for model in a.models:
        for nodes in a.nodes:
            for row in a.rows:
                sizes = [(None, None)]
                if row not in ("none", "ddp") and not row.startswith("ea-"):
                    sizes = [(b, f) for b in a.bucket_mb for f in a.first_bucket_mb]
                for b, f in sizes:
                    out.append({
                        "model": model, "nodes": nodes, "row": row, "sweep": sweep,
                        "bucket_bytes": int((b or 25) * _MiB),
                        "first_bucket_bytes": int((f or 1) * _MiB),
                    })  # fmt: skip
    return out


def _fmt(values: list[float], digits: int = 1) -> str:
    if not values:
        return "-"
    med = statistics.median(values)
    return f"{med:.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def markdown(cfgs: list[dict], results: dict, a: argparse.Namespace, elapsed: float) -> str:
    from bench.report import machine

    m = machine()
    lines = [
        "# Step time: AllReduceSGD against DDP",
        "",
        f"`python -m bench.step_time {' '.join(a.argv)}` ({elapsed:.0f} s), {m['date_utc']}, "
        f"commit `{m['commit']}`.",
        "",
        f"Machine: {m['cpu']}, {m['cores_usable']} usable cores, {m['mem_gib']} GiB, Python "
        f"{m['python']}, load average at start {m['loadavg_start'][0]:.2f}. torch "
        f"{m['versions'].get('torch', '?')}.",
        "",
        f"Each process: batch {a.batch}, {a.steps} timed steps after {a.warmup} warm-up "
        f"steps, {a.threads or 'cores / processes'} torch thread(s). ms per step: rank 0's "
        f"median step, median (min-max) over {a.reps} repetitions in alternating order. "
        "vs DDP: median of the per-repetition ratios (below 1.00x is faster than DDP).",
        "",
        "| model | processes | row | ms per step | vs DDP | mean ms | buckets sent in backward |",
        "|---|---:|---|---:|---:|---:|---|",
    ]
    for cfg in cfgs:
        key = json.dumps(cfg, sort_keys=True)
        ok = [r for r in results[key] if "error" not in r]
        ddp_key = json.dumps(
            {**cfg, "row": "ddp", "bucket_bytes": 25 * _MiB, "first_bucket_bytes": _MiB},
            sort_keys=True,
        )
        ratio = "-"
        if cfg["row"] != "ddp" and ddp_key in results:
            pairs = [
                ours["ms"] / theirs["ms"]
                for ours, theirs in zip(results[key], results[ddp_key], strict=False)
                if "error" not in ours and "error" not in theirs
            ]
            if pairs:
                ratio = f"{statistics.median(pairs):.2f}x"
        overlap = "-"
        if ok and "sgd" in ok[0]:
            stats = ok[0]["sgd"]
            mods = stats["modules"]
            if mods:
                per_step = mods[0]["started_in_backward"] / max(1, mods[0]["steps"])
                overlap = f"{per_step:.1f} of {len(mods[0]['bucket_bytes'])}"
            else:
                overlap = "no overlap (synchronous)"
        cell = _fmt([r["ms"] for r in ok]) if ok else f"error: {results[key][0]['error'][:120]}"
        mean = _fmt([r["mean_ms"] for r in ok])
        params = f" ({ok[0]['params'] / 1e6:.2f}M)" if ok else ""
        lines.append(
            f"| {cfg['model']}{params} | {cfg['nodes']} | {label(cfg)} | {cell} | {ratio} "
            f"| {mean} | {overlap} |"
        )
    lines += ["", f"Reproduce: `python -m bench.step_time {' '.join(a.argv)}`.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.step_time", description=__doc__.split("\n")[0]
    )
    p.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    p.add_argument("--nodes", type=int, nargs="+", default=[2, 4])
    p.add_argument("--rows", nargs="+", choices=ROWS, default=["none", "ddp", "gloo", "ipc"])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: cores / processes)")
    p.add_argument("--bucket-mb", type=float, nargs="+", default=[25.0])
    p.add_argument("--first-bucket-mb", type=float, nargs="+", default=[1.0])
    p.add_argument("--grad-dtype", choices=("bfloat16", "float16"))
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per job")
    p.add_argument("--out", help="markdown report (default: print only)")
    # one rank of a job (internal)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--row", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--bucket-bytes", type=int, help=argparse.SUPPRESS)
    p.add_argument("--first-bucket-bytes", type=int, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        _worker(a)
        return 0
    a.argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    cfgs = configs(a)
    results: dict[str, list[dict]] = {json.dumps(c, sort_keys=True): [] for c in cfgs}
    started = time.time()
    for rep in range(a.reps):
        for cfg in cfgs if rep % 2 == 0 else cfgs[::-1]:
            res = run_job(cfg, a)
            results[json.dumps(cfg, sort_keys=True)].append(res)
            what = f"rep {rep + 1} {cfg['model']} x{cfg['nodes']} {label(cfg)}"
            if "error" in res:
                log.warning("%s: %s", what, res["error"])
            else:
                log.info("%-44s %8.1f ms/step", what, res["ms"])
    text = markdown(cfgs, results, a, time.time() - started)
    print(text)
    if a.out:
        Path(a.out).write_text(text)
        log.info("wrote %s", a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
