"""`python -m bench.elastic`: what surviving costs: resuming mid-epoch, saving, a lost rank.

    python -m bench.elastic                    # -> bench/RESULTS-elastic.md
    python -m bench.elastic --reps 3 --quick --out-dir bench/out   # smoke

Three measurements, each against its own baseline in the same run:

- **Time to the first batch after a resume** at 90% of an epoch against at its start
  (goal: at most 1.1x, since the position is computed, never fast-forwarded): a 2M-item
  tensor index (``permutation``), the same resumed from 8 ranks' states by 3 (pooling and
  splitting included), 24 part files of 20,000 lines each (``part-permutation-permutation``:
  at 90% the resume reads one part), and a joined index (two tensor files) whose second
  member is drawn by ``uniform``. A measurement makes a batcher on an open Dataset,
  loads the state, and takes the first batch; 0% and 90% alternate, repetition after
  repetition.
- **The cost of one save** of the 9.5M-parameter conv net of bench/step_time.py with its
  Adam state and a batcher, by ``Checkpoint.save`` on one node, to a local folder and to
  S3 (moto's server on 127.0.0.1: what the S3 protocol costs, not a network), with the
  restore of the same.
- **Steps lost to a kill**: 4 ranks of tests/elastic_train.py, rank 1 SIGKILLed at step
  35; with a restart (torchrun ``--max-restarts=1`` restores the checkpoint of step 20:
  the steps since are taken again) against without (distlearn.survivors: the failed step
  is redone, at most), and the seconds from the kill to the next step taken (the
  restart: processes, imports, rendezvous, restore; without: re-forming the tree).

Figures are medians (min-max) of the repetitions on this machine, shared with other
work: compare the ratios, taken side by side, not the absolute times.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent


def _median(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3f} ({min(xs):.3f}-{max(xs):.3f})"


# ----------------------------------------------------------------------------- resume


def _resume_rows(tmp: Path, quick: bool) -> list[dict]:
    """Each row: a name, how to make its batcher, and the states at 0% and 90%."""
    import torch

    from distlearn.dataset import Dataset

    n = 200_000 if quick else 2_000_000
    tensors = {"x": torch.arange(n, dtype=torch.float32).view(n, 1), "y": torch.arange(n) % 1000}
    parts = tmp / "parts"
    parts.mkdir(exist_ok=True)
    per, nparts = (2_000, 12) if quick else (20_000, 24)
    for p in range(nparts):
        lines = "".join(f"part{p}-line{i}\n" for i in range(per))
        (parts / f"part-{p:03d}.txt").write_text(lines)
    pt_a, pt_b = tmp / "a.pt", tmp / "b.pt"
    m = n // 10
    torch.save({"x": torch.arange(m, dtype=torch.float32).view(m, 1), "y": torch.arange(m) % 10},
               pt_a)  # fmt: skip
    torch.save({"x": torch.zeros(1000, 1), "y": torch.zeros(1000, dtype=torch.long)}, pt_b)

    def nothing(data, opt, out):
        return True

    base = dict(batch_size=128, workers="thread", num_workers=0, processor=nothing)
    rows = [
        dict(name=f"tensor index, {n:,} items, `permutation`", data=tensors, parts=1,
             kw=dict(base, input_dims=(1,), sampler="permutation", processor=None)),
        dict(name=f"tensor index, {n:,} items, 8 ranks' states resumed by 3", data=tensors,
             parts=8, new=3, kw=dict(base, input_dims=(1,), sampler="permutation",
                                     processor=None)),
        dict(name=f"{nparts} part files x {per:,} lines, `part-permutation-permutation`",
             data=str(parts), parts=1, open=dict(record_format="lines", cache_parts=False),
             kw=dict(base, input_dims=(), sampler="part-permutation-permutation")),
        dict(name=f"joined index, {m:,} items + a member drawn by `uniform`",
             data=[str(pt_a), str(pt_b)], parts=1,
             kw=dict(base, input_dims=(), sampler=["permutation", "uniform"])),
    ]  # fmt: skip
    for row in rows:
        old = row["parts"]
        states = {0: [], 90: []}
        for p in range(old):
            ds = Dataset(row["data"], partition=p, partitions=old, **row.get("open", {}))
            with ds.sampled_batcher(**row["kw"]) as b:
                states[0].append(b.state_dict())
                length = b.num_batches()
                it = iter(b)
                target = int(length * 0.9)
                if "part" in str(row["kw"]["sampler"]):
                    for _ in range(target):
                        next(it)
                    states[90].append(b.state_dict())
                else:  # the position of 90% of the epoch, written as the batcher writes it
                    st = b.state_dict()
                    st["consumed"] = target * row["kw"]["batch_size"]
                    states[90].append(st)
        new = row.get("new", old)
        row["ds"] = Dataset(row["data"], partition=0, partitions=new, **row.get("open", {}))
        row["states"] = {k: (v if new != old else v[0]) for k, v in states.items()}
    return rows


def first_batch_after_resume(row: dict, at: int) -> float:
    t0 = time.perf_counter()
    with row["ds"].sampled_batcher(**row["kw"]) as b:
        b.load_state_dict(row["states"][at])
        next(iter(b))
        return time.perf_counter() - t0


def bench_resume(reps: int, quick: bool) -> list[str]:
    with tempfile.TemporaryDirectory(prefix="bench-elastic-") as tmp:
        rows = _resume_rows(Path(tmp), quick)
        times = {(r["name"], at): [] for r in rows for at in (0, 90)}
        for rep in range(reps):
            for row in rows:
                order = (0, 90) if rep % 2 == 0 else (90, 0)
                for at in order:
                    times[(row["name"], at)].append(first_batch_after_resume(row, at))
    lines = ["| index | at 0% s | at 90% s | 90% / 0% |", "|---|---:|---:|---:|"]
    for row in rows:
        a, b = times[(row["name"], 0)], times[(row["name"], 90)]
        ratio = statistics.median(y / x for x, y in zip(a, b, strict=True))
        lines.append(f"| {row['name']} | {_median(a)} | {_median(b)} | {ratio:.2f}x |")
    return lines


# ----------------------------------------------------------------------------- save


def bench_save(reps: int) -> list[str]:
    import s3fs
    import torch

    from bench.step_time import make_model
    from distlearn import Checkpoint, ipc
    from distlearn.dataset import Dataset

    sys.path.insert(0, str(REPO))
    from tests.moto_server import moto_s3

    model, shape = make_model("convnet")
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, *shape)).sum().backward()
    opt.step()  # Adam's moments exist
    data = {"x": torch.zeros(1000, 1), "y": torch.zeros(1000, dtype=torch.long)}
    batcher = Dataset(data).sampled_batcher(batch_size=10, input_dims=(1,))
    state = {"model": model, "optim": opt, "data": batcher}
    tree = ipc.LocalhostTree(0, 1, key=f"bench-elastic-{os.getpid()}")
    out = {}
    with tempfile.TemporaryDirectory(prefix="bench-ckpt-") as tmp, moto_s3() as storage:
        s3fs.S3FileSystem(**storage).mkdir("bench")
        s3 = Checkpoint("s3://bench/run", tree, keep=1, storage_options=storage, signals=())
        targets = {"local folder": Checkpoint(tmp, tree, keep=1, signals=()),
                   "S3 (moto on 127.0.0.1)": s3}  # fmt: skip
        for name in targets:
            out[name] = {"save": [], "restore": []}
        for rep in range(reps):
            for name, ckpt in targets.items():
                t0 = time.perf_counter()
                ckpt.save(rep + 1, state)
                out[name]["save"].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                ckpt.restore(state)
                out[name]["restore"].append(time.perf_counter() - t0)
        local = next(Path(tmp).glob("step-*"))
        size = sum(f.stat().st_size for f in local.iterdir())
    tree.close()
    batcher.close()
    lines = [f"The conv net ({params / 1e6:.1f}M parameters) with Adam's moments and a batcher: "
             f"{size / 1e6:.0f} MB a checkpoint.", "",
             "| where | save s | restore s |", "|---|---:|---:|"]  # fmt: skip
    for name, t in out.items():
        lines.append(f"| {name} | {_median(t['save'])} | {_median(t['restore'])} |")
    return lines


# ----------------------------------------------------------------------------- lost steps


def _job(folder: Path, world: int, survive: bool, die_at: int, every: int) -> list[list[dict]]:
    """One job of tests/elastic_train.py (4 ranks, rank 1 SIGKILLed at step `die_at`):
    with a restart (torchrun --max-restarts=1, a checkpoint every `every` steps) or
    without (the survivors go on). Its ledgers."""
    import json
    import random
    import subprocess

    import torch

    n = 2000
    data = folder / "data.pt"
    torch.save({"x": torch.arange(n, dtype=torch.float32).view(n, 1), "y": torch.arange(n) % 3},
               data)  # fmt: skip
    train = REPO / "tests" / "elastic_train.py"
    args = [str(train), "--data", str(data), "--ckpt", str(folder / "ckpt"), "--ledger",
            str(folder / "ledger"), "--epochs", "1", "--batch", "8", "--every", str(every),
            "--die-at", str(die_at), "--die-rank", "1", "--sleep", "0.02"]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(REPO), TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    if survive:
        port = random.randint(20000, 40000)
        procs = [subprocess.Popen([sys.executable, *args, "--survive"],
                                  env=dict(env, RANK=str(r), WORLD_SIZE=str(world),
                                           LOCAL_WORLD_SIZE=str(world),
                                           MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)),
                                  stderr=subprocess.DEVNULL)
                 for r in range(world)]  # fmt: skip
        for p in procs:
            p.wait(timeout=600)
    else:
        port = random.randint(20000, 40000)
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nnodes=1",
                        f"--nproc-per-node={world}", "--max-restarts=1", "--rdzv-backend=c10d",
                        f"--rdzv-endpoint=127.0.0.1:{port}", "--monitor-interval=0.2", *args],
                       env=env, stderr=subprocess.DEVNULL, check=True, timeout=600)  # fmt: skip
    return [[json.loads(x) for x in f.open()] for f in (folder / "ledger").glob("*.jsonl")]


def _lost(ledgers: list[list[dict]]) -> tuple[int, float]:
    """(steps taken twice, seconds from the kill to the next step anyone took), from the
    ledgers of every process (one list each, its start line first)."""
    steps = [x for p in ledgers for x in p if "ids" in x]
    # the kill: the last step of the first process of rank 1 (a restart takes that step
    # again later, and the round it dies at need not be its step number)
    first = min((p for p in ledgers if p[0]["rank"] == 1), key=lambda p: p[0]["t"])
    victim = [x for x in first if "ids" in x][-1]
    # the next step anyone took: the survivors' step after it, or the restart's first
    # (the others' lines for the killed step itself may be written just after it)
    after = min(x["t"] for x in steps if x["t"] > victim["t"] and x["step"] != victim["step"])
    ranks = {x["rank"] for x in steps}
    taken = sum(1 for x in steps if x["rank"] == min(ranks))  # one rank's steps, all attempts
    unique = len({x["step"] for x in steps if x["rank"] == min(ranks)})
    return taken - unique, after - victim["t"]


def bench_lost(reps: int) -> list[str]:
    rows = {"with a restart (torchrun --max-restarts=1, a checkpoint every 20 steps)": False,
            "without (distlearn.survivors)": True}  # fmt: skip
    out: dict[str, list] = {name: [] for name in rows}
    with tempfile.TemporaryDirectory(prefix="bench-lost-") as tmp:
        for rep in range(reps):
            for i, (name, survive) in enumerate(rows.items()):
                folder = Path(tmp) / f"{rep}-{i}"
                folder.mkdir()
                out[name].append(_lost(_job(folder, 4, survive, 35, 20)))
    lines = ["| one of 4 ranks killed at step 35 | steps taken again | seconds to the next step |",
             "|---|---:|---:|"]  # fmt: skip
    for name, got in out.items():
        lost = [float(a) for a, _ in got]
        secs = [b for _, b in got]
        lines.append(f"| {name} | {statistics.median(lost):.0f} ({min(lost):.0f}-"
                     f"{max(lost):.0f}) | {_median(secs)} |")  # fmt: skip
    return lines


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--quick", action="store_true", help="smaller indexes")
    p.add_argument("--only", choices=("resume", "save", "lost"), default=None)
    p.add_argument("--out-dir", default=str(BENCH))
    args = p.parse_args(argv)
    stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    cmd = "python -m bench.elastic" + (f" --reps {args.reps}" if args.reps != 7 else "")
    lines = ["# Surviving: resuming mid-epoch, saving", "",
             f"`{cmd}` — {stamp}, {os.cpu_count()} cores, load average "
             f"{os.getloadavg()[0]:.1f} at the start; {args.reps} repetitions, median (min-max).",
             "", "<!-- --8<-- [start:figures] -->"]  # fmt: skip
    if args.only in (None, "resume"):
        lines += ["## Time to the first batch after a resume, at 90% of an epoch against 0%",
                  "", *bench_resume(args.reps, args.quick), ""]  # fmt: skip
    if args.only in (None, "save"):
        lines += ["## One save (and restore) with Checkpoint, one node", "",
                  *bench_save(args.reps), ""]  # fmt: skip
    if args.only in (None, "lost"):
        lines += ["## Steps lost to a killed rank, with a restart and without", "",
                  *bench_lost(min(args.reps, 3)), ""]  # fmt: skip
    lines += ["<!-- --8<-- [end:figures] -->"]
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    name = "RESULTS-elastic.md" if args.only is None else f"RESULTS-elastic-{args.only}.md"
    (out / name).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {out / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
