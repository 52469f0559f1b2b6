"""Step time of the README's plain loop: AllReduceSGD against DDP, side by side.

    python -m bench.step_time                        # both models, 2 and 4 processes
    python -m bench.step_time --models convnet --nodes 2 --reps 5
    python -m bench.step_time --rows ddp gloo gloo@4/0.25 gloo+bf16   # variants side by side
    python -m bench.step_time --device cuda --models convnet --nodes 2   # CUDA tensors
    python -m bench.step_time --models mnist --nodes 2 --reps 1 --profile prof/  # where it goes

A step is what a user's loop does: `zero_grad`, forward, `backward`, then for
AllReduceSGD `sum_and_normalize_gradients(model)`, then `opt.step()` (SGD with
momentum). Rows:

    none       no communication (each process trains alone): the compute floor
    ddp        torch DistributedDataParallel over the process group (`--backend`, gloo
               by default; its defaults: 25 MiB buckets)
    ddp-join   the same inside `ddp.join()`, DDP's support for uneven inputs (which
               AllReduceSGD always has): two one-element all-reduces more a step
    gloo       AllReduceSGD over TorchDistributed (the same process group): buckets
               during backward
    gloo-sync  the same with overlap=False: one all-reduce after backward
    gloo-ring  gloo without TorchDistributed's small all-reduce at the root
               (gather_bytes=0): every bucket on the process group's own all-reduce,
               as DDP's
    ipc        AllReduceSGD over the ipc tree (overlapped if the tree has async_op)
    ipc-sync   the same with overlap=False
    ea-gloo, ea-gloo-sync, ea-ipc, ea-ipc-sync
               AllReduceEA (tau 10, alpha 0.2) with and without its average
               overlapped with the next steps (compare their mean, not the median:
               the average costs one step in tau)

An AllReduceSGD row takes `@BUCKET_MB/FIRST_MB` (bucket sizes) and `+bfloat16` or
`+float16` (grad_dtype), e.g. `gloo@4/0.25+bfloat16`.

Every row of a job runs in the same N processes, each on its own copy of the
model, in blocks of `--block` timed steps (by default 5 for the conv net and 20 for
the MNIST model, whose step is ten times shorter: as many samples per row as
there is time for), each after one untimed step, the rows in
alternating order round after round, so a noisy neighbour slows every row alike.
A row's figure in a job is rank 0's median step, in wall time and in CPU time of
its whole process (communication threads included: on a loaded machine the CPU
figure moves far less); the table shows the median (min-max) over `--reps` jobs,
each a fresh set of processes, and of the per-job ratios to DDP. Models:
`convnet`, 9.5M parameters (two 3x3 convolutions, three linear layers, on
3x32x32 inputs), `mnist`, examples/mnist_lib.py's Net, and `transformer`, 0.4M
parameters in 98 tensors (8 encoder layers of width 64 over 16 positions); batch 32
per process.

`--device cuda` puts each rank's model and batches on GPU `rank % GPUs` and ends
every timed step with `torch.cuda.synchronize()` (the step is done when its
kernels are). The tree then carries CUDA gradients staged through pinned host
memory; gloo copies them to the host itself; `--backend nccl` reduces them on the
GPUs. NCCL refuses two ranks of one host on one GPU ("Duplicate GPU detected"), so
where the ranks outnumber the GPUs each rank gets its own `NCCL_HOSTID`: NCCL then
takes them for separate machines and carries their traffic over its socket transport
on loopback (`NCCL_SOCKET_IFNAME=lo`, InfiniBand off), the path between machines
rather than NVLink or PCIe. DDP and AllReduceSGD share that process group, so their
ratio stands; the report names the transport.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from bench.procs import free_port, wait_ranks

log = logging.getLogger("bench.step_time")
BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
KINDS = (
    "none", "ddp", "ddp-join", "gloo", "gloo-sync", "gloo-ring", "ipc", "ipc-sync",
    "ea-gloo", "ea-gloo-sync", "ea-ipc", "ea-ipc-sync",
)  # fmt: skip
MODELS = ("convnet", "mnist", "transformer")
# Timed steps per row and round: the MNIST model's ~10 ms step gets more of them.
BLOCK = {"convnet": 5, "mnist": 20, "transformer": 5}
_MiB = 1 << 20
_ROW = re.compile(r"^(?P<kind>[a-z-]+)(@(?P<bucket>[\d.]+)/(?P<first>[\d.]+))?(\+(?P<dtype>\w+))?$")


def parse_row(row: str) -> dict:
    """`gloo@4/0.25+bfloat16` -> kind, bucket sizes in bytes, grad_dtype."""
    m = _ROW.match(row)
    if not m or m["kind"] not in KINDS:
        raise argparse.ArgumentTypeError(f"{row!r}: a row is KIND[@BUCKET_MB/FIRST_MB][+DTYPE], "
                                         f"KIND one of {', '.join(KINDS)}")  # fmt: skip
    sgd = m["kind"] not in ("none", "ddp", "ddp-join") and not m["kind"].startswith("ea-")
    if (m["bucket"] or m["dtype"]) and not sgd:
        raise argparse.ArgumentTypeError(f"{row!r}: bucket sizes and dtypes are AllReduceSGD's")
    if m["dtype"] not in (None, "bfloat16", "float16"):
        raise argparse.ArgumentTypeError(f"{row!r}: the dtype is bfloat16 or float16")
    return {
        "kind": m["kind"],
        "bucket_bytes": int(float(m["bucket"] or 25) * _MiB),
        "first_bucket_bytes": int(float(m["first"] or 1) * _MiB),
        "grad_dtype": m["dtype"],
    }


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
    if name == "transformer":

        class Transformer(nn.Module):
            """8 encoder layers (width 64, 4 heads, feed-forward 256) over 16 positions,
            mean pooled into 10 classes: 0.4M parameters in 98 tensors, where the other
            two models have 10 and 8 (a cost per tensor shows here)."""

            def __init__(self) -> None:
                super().__init__()
                layer = nn.TransformerEncoderLayer(64, 4, 256, dropout=0.0, batch_first=True)
                self.encoder = nn.TransformerEncoder(layer, 8, enable_nested_tensor=False)
                self.head = nn.Linear(64, 10)

            def forward(self, x):
                return self.head(self.encoder(x).mean(1))

        return Transformer(), (16, 64)
    raise ValueError(f"unknown model {name!r}; choose from {MODELS}")


# ----------------------------------------------------------------------------- one rank


class _Row(NamedTuple):
    """One row in a rank: its step, its AllReduceSGD (if any), the model's parameter
    count, and what each block of its steps runs in (DDP's join() for ddp-join)."""

    step: Callable[[int], None]
    sgd: Any
    params: int
    block: Callable[[], contextlib.AbstractContextManager]


def _worker(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from distlearn import AllReduceEA, AllReduceSGD
    from distlearn.backends import TorchDistributed

    torch.set_num_threads(a.threads)
    device = torch.device("cpu")
    if a.device == "cuda":
        torch.cuda.set_device(a.rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group(
        a.backend, init_method=f"tcp://127.0.0.1:{a.port}", rank=a.rank, world_size=a.world
    )
    comms = {"gloo": TorchDistributed(), "gloo-ring": TorchDistributed(gather_bytes=0)}
    if any("ipc" in row for row in a.rows):
        from distlearn import ipc

        comms["ipc"] = ipc.LocalhostTree(a.rank, a.world, key=f"bench-steps-{a.port}")
    g = torch.Generator().manual_seed(a.rank)
    item = make_model(a.model)[1]
    batches = [
        (
            torch.randn(a.batch, *item, generator=g).to(device),
            torch.randint(0, 10, (a.batch,), generator=g).to(device),
        )
        for _ in range(4)
    ]
    # A CUDA step is over when its kernels are, not when they are queued.
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None

    def make_step(row: str):
        spec = parse_row(row)
        kind = spec["kind"]
        model = make_model(a.model)[0].to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        net, sgd, ea = model, None, None
        block = contextlib.nullcontext  # what a block of steps runs in
        comm = comms["ipc" if "ipc" in kind else "gloo-ring" if "ring" in kind else "gloo"]
        if kind in ("ddp", "ddp-join"):
            ids = [device.index] if device.type == "cuda" else None
            net = torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)
            if kind == "ddp-join":
                block = net.join  # (its exit, after the block's last step, is not timed)
        elif kind.startswith("ea-"):
            ea = AllReduceEA(comm, tau=10, alpha=0.2, overlap=not kind.endswith("-sync"))
            ea.synchronize_parameters(model)
        elif kind != "none":
            sgd = AllReduceSGD(
                comm,
                overlap=not kind.endswith("-sync"),
                bucket_bytes=spec["bucket_bytes"],
                first_bucket_bytes=spec["first_bucket_bytes"],
                grad_dtype=spec["grad_dtype"],
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
            sync()

        return _Row(step, sgd, sum(p.numel() for p in model.parameters()), block)

    steps = {row: make_step(row) for row in a.rows}
    times: dict[str, list[float]] = {row: [] for row in a.rows}
    cpu: dict[str, list[float]] = {row: [] for row in a.rows}
    i = 0
    for rnd in range(a.rounds):
        for row in a.rows if rnd % 2 == 0 else a.rows[::-1]:
            step = steps[row].step
            step(i)  # untimed: the other rows' blocks cooled the caches
            dist.barrier()
            with steps[row].block():
                for _ in range(a.block or BLOCK[a.model]):
                    i += 1
                    t0, c0 = time.perf_counter(), time.process_time()
                    step(i)
                    times[row].append(time.perf_counter() - t0)
                    cpu[row].append(time.process_time() - c0)
    if a.profile:
        # One more block of every row, untimed, with rank 0 under torch.profiler: where
        # a row's step goes (every rank runs it, to meet rank 0 in its collectives).
        for row in a.rows:
            with steps[row].block():
                _profile_block(a, row, steps[row].step, i, device)
            i += a.block or BLOCK[a.model]
    dist.barrier()
    if a.rank == 0:
        result = {
            row: {
                "times_s": times[row],
                "cpu_s": cpu[row],
                "params": r.params,
                "sgd": r.sgd.stats if r.sgd else None,
            }
            for row, r in steps.items()
        }
        Path(a.out).write_text(json.dumps(result))
    if "ipc" in comms:
        comms["ipc"].close()
    dist.destroy_process_group()


def _profile_block(a: argparse.Namespace, row: str, step, first: int, device) -> None:
    """Run one block of `row`'s steps; on rank 0 under torch.profiler, writing
    `MODEL-xN-ROW.txt` (the ops by self CPU time, and by device time on CUDA) and
    `MODEL-xN-ROW.trace.json` (a Chrome trace: chrome://tracing or ui.perfetto.dev)
    into `--profile`."""
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    steps = a.block or BLOCK[a.model]
    step(first)  # untimed, as in the timed rounds
    dist.barrier()
    if a.rank != 0:
        for k in range(steps):
            step(first + 1 + k)
        return
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        for k in range(steps):
            step(first + 1 + k)
    name = f"{a.model}-x{a.world}-{row.replace('/', '_')}"
    out = Path(a.profile)
    out.mkdir(parents=True, exist_ok=True)
    table = prof.key_averages()
    text = [f"{row}: {steps} steps, {a.model} model, {a.world} processes, rank 0", ""]
    text += ["By self CPU time:", table.table(sort_by="self_cpu_time_total", row_limit=30)]
    if device.type == "cuda":
        text += ["By device time:", table.table(sort_by="self_device_time_total", row_limit=30)]
    (out / f"{name}.txt").write_text("\n".join(text))
    prof.export_chrome_trace(str(out / f"{name}.trace.json"))


# ----------------------------------------------------------------------------- the runner


def gpus(device: str) -> int:
    """How many GPUs the ranks see (0 for CPU tensors)."""
    if device != "cuda":
        return 0
    import torch

    return torch.cuda.device_count()


def rank_env(backend: str, rank: int, nodes: int, n_gpus: int) -> dict[str, str]:
    """What rank `rank`'s environment adds: for NCCL on fewer GPUs than ranks, a host id
    of its own (see the module docstring); the user's NCCL settings are kept."""
    if backend != "nccl" or nodes <= n_gpus:
        return {}
    return {
        "NCCL_HOSTID": f"bench-step-time-rank{rank}",
        "NCCL_SOCKET_IFNAME": os.environ.get("NCCL_SOCKET_IFNAME", "lo"),
        "NCCL_IB_DISABLE": os.environ.get("NCCL_IB_DISABLE", "1"),
    }


def run_job(model: str, nodes: int, a: argparse.Namespace) -> dict:
    """One job: N fresh processes running every row; per row, rank 0's step times."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    threads = a.threads or max(1, (os.cpu_count() or 1) // nodes)
    port = free_port()
    n_gpus = gpus(a.device)
    with tempfile.TemporaryDirectory(prefix="bench-steps-") as tmp:
        out = Path(tmp, "rank0.json")
        args = [
            "--worker", "--model", model, "--world", str(nodes), "--port", str(port),
            "--rounds", str(a.rounds), "--block", str(a.block or BLOCK[model]),
            "--batch", str(a.batch), "--device", a.device, "--backend", a.backend,
            "--threads", str(threads), "--out", str(out), "--rows", *a.rows,
        ]  # fmt: skip
        if a.profile:
            args += ["--profile", str(Path(a.profile).resolve())]
        procs = [
            subprocess.Popen(
                [sys.executable, "-m", "bench.step_time", "--rank", str(r), *args],
                env={**env, **rank_env(a.backend, r, nodes, n_gpus)},
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
            for r in range(nodes)
        ]
        logs = wait_ranks(procs, a.timeout)
        if logs is None:
            return {"error": f"timed out after {a.timeout:.0f}s"}
        bad = [r for r, p in enumerate(procs) if p.returncode != 0]
        if bad or not out.exists():
            r = bad[0] if bad else 0
            return {"error": f"rank {r}: " + " | ".join(logs[r].strip().splitlines()[-6:])}
        res = json.loads(out.read_text())
    for rec in res.values():
        rec["ms"] = 1e3 * statistics.median(rec["times_s"])
        rec["mean_ms"] = 1e3 * statistics.fmean(rec["times_s"])
        rec["cpu_ms"] = 1e3 * statistics.median(rec["cpu_s"])
    return res


def _fmt(values: list[float], digits: int = 1, unit: str = "") -> str:
    if not values:
        return "-"
    med = statistics.median(values)
    return f"{med:.{digits}f}{unit} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def _overlap(stats: dict | None) -> str:
    if stats is None:
        return "-"
    if not stats["modules"]:
        return "none (one all-reduce after backward)"
    mod = stats["modules"][0]
    per_step = mod["started_in_backward"] / max(1, mod["steps"])
    return f"{per_step:.1f} of {len(mod['bucket_bytes'])}"


def _transport(a: argparse.Namespace) -> str:
    n_gpus = gpus(a.device)
    shared = [n for n in a.nodes if rank_env(a.backend, 0, n, n_gpus)]
    if not shared:
        return ""
    return (
        f" (with {' and '.join(map(str, shared))} processes the ranks share GPUs: one "
        "NCCL_HOSTID a rank, NCCL's socket transport on loopback)"
    )


def _device_text(device: str) -> str:
    if device == "cpu":
        return "CPU"
    import torch

    n = torch.cuda.device_count()
    return f"CUDA, {n} x {torch.cuda.get_device_name(0)}" if n else "CUDA (none visible here)"


def markdown(jobs: dict, a: argparse.Namespace, elapsed: float) -> str:
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
        f"Tensors on: {_device_text(a.device)}. Process group (rows ddp and gloo): {a.backend}"
        f"{_transport(a)}.",
        "",
        f"Each process: batch {a.batch}, {a.threads or 'cores / processes'} torch thread(s). "
        f"All rows of a job run in the same processes, {a.rounds} rounds of "
        f"{a.block or ' or '.join(f'{n} ({m})' for m, n in BLOCK.items())} timed "
        f"steps per row in alternating order. ms per step: rank 0's median step in a job, "
        f"median (min-max) over {a.reps} jobs. vs DDP: the ratio to DDP in the same job, "
        "median (min-max) over the jobs (below 1.00x is faster than DDP). CPU ms: rank 0's "
        "median step in CPU time of its whole process (every thread: the backends' "
        "communication threads too), which a loaded machine distorts far less than wall "
        "time; CPU vs DDP: its ratio, as above. mean ms: the mean step (what AllReduceEA's "
        "rows are compared on).",
        "",
        "| model | processes | row | ms per step | vs DDP | CPU ms per step | CPU vs DDP "
        "| mean ms | buckets sent in backward |",
        "|---|---:|---|---:|---:|---:|---:|---:|---|",
    ]
    for (model, nodes), results in jobs.items():
        ok = [r for r in results if "error" not in r]
        if not ok:
            lines.append(f"| {model} | {nodes} | error: {results[0]['error'][:160]} | | | | | | |")
            continue
        for row in a.rows:
            ratio = cpu_ratio = "-"
            if row != "ddp" and "ddp" in a.rows:
                ratio = _fmt([r[row]["ms"] / r["ddp"]["ms"] for r in ok], 2, "x")
                cpu_ratio = _fmt([r[row]["cpu_ms"] / r["ddp"]["cpu_ms"] for r in ok], 2, "x")
            lines.append(
                f"| {model} ({ok[0][row]['params'] / 1e6:.2f}M) | {nodes} | {row} "
                f"| {_fmt([r[row]['ms'] for r in ok])} | {ratio} "
                f"| {_fmt([r[row]['cpu_ms'] for r in ok])} | {cpu_ratio} "
                f"| {_fmt([r[row]['mean_ms'] for r in ok])} | {_overlap(ok[0][row]['sgd'])} |"
            )
    lines += ["", f"Reproduce: `python -m bench.step_time {' '.join(a.argv)}`.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.step_time", description=__doc__.split("\n")[0]
    )
    p.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    p.add_argument("--nodes", type=int, nargs="+", default=[2, 4])
    p.add_argument("--rows", nargs="+", default=["none", "ddp", "gloo", "ipc"])
    p.add_argument("--reps", type=int, default=3, help="jobs per (model, processes)")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument(
        "--block", type=int, default=0, help="timed steps per row and round (0: per model)"
    )
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: cores / processes)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per job")
    p.add_argument("--out", help="markdown report (default: print only)")
    p.add_argument(
        "--profile",
        metavar="DIR",
        help="after the timed rounds, one more block of each row with rank 0 under "
        "torch.profiler: an op table and a Chrome trace a row in DIR (the last job's)",
    )
    # one rank of a job (internal)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    for row in a.rows:
        try:
            parse_row(row)
        except argparse.ArgumentTypeError as err:
            p.error(str(err))
    if a.backend == "nccl" and a.device != "cuda":
        p.error("--backend nccl reduces CUDA tensors: add --device cuda")
    if a.device == "cuda" and not a.worker:
        import torch

        if not torch.cuda.is_available():
            p.error("--device cuda: torch sees no CUDA GPU here")
    if a.worker:
        _worker(a)
        return 0
    a.argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    jobs: dict[tuple[str, int], list[dict]] = {(m, n): [] for m in a.models for n in a.nodes}
    started = time.time()
    for rep in range(a.reps):
        for model, nodes in jobs if rep % 2 == 0 else list(jobs)[::-1]:
            res = run_job(model, nodes, a)
            jobs[(model, nodes)].append(res)
            what = f"job {rep + 1} {model} x{nodes}"
            if "error" in res:
                log.warning("%s: %s", what, res["error"])
            else:
                log.info(
                    "%s: %s",
                    what,
                    ", ".join(
                        f"{r} {res[r]['ms']:.1f} (CPU {res[r]['cpu_ms']:.1f})" for r in a.rows
                    ),
                )
    text = markdown(jobs, a, time.time() - started)
    print(text)
    if a.out:
        Path(a.out).write_text(text)
        log.info("wrote %s", a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
