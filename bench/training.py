"""Training row: one epoch of examples/mnist.py with 1, 2 and 4 processes, phase by phase.

Each run is a whole job as a user starts it (examples/launch.py: data served
over HTTP, N processes), with bench/mnist_timed.py in place of mnist.py so
every rank reports how its epoch split into loading, compute and allreduce.
samples/s is the example's own figure: training items of all ranks over the
epoch's training seconds.

`python -m bench` runs it with AllReduceSGD's defaults. On its own it also
compares the gradient buckets sent during backward with one all-reduce after it
(`overlap=False`, the loop before issue 16), and with DistributedDataParallel in
the same loop timed the same way (`ddp`, gloo), job by job in alternating order:

    python -m bench.training --nodes 4 --backends ipc gloo --overlap on off ddp --reps 3

`--before DIR` adds a row "before": the same epoch run by another checkout's own
example, launcher and bench/mnist_timed.py (say, `git worktree add DIR 6f284f1`,
the code before issue 16), in the same alternating order, so a change's effect on
samples/s and on the allreduce share is measured side by side on one machine.

Its table also splits the allreduce share by arrival (`arrival_split`): waiting for
the last rank to call the all-reduce, and the all-reduce after it; and says how
many of a step's gradient buckets left during backward (with one bucket, "on" has
nothing to overlap and is the same all-reduce after backward as "off").
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.procs import kill_group
from bench.report import spread

log = logging.getLogger(__name__)
REPO = Path(__file__).resolve().parent.parent
LAUNCH = REPO / "examples" / "launch.py"
MNIST = REPO / "examples" / "mnist.py"
PHASES = ("loading_s", "compute_s", "allreduce_s")


def missing() -> str | None:
    """Why the training row cannot run here, or None."""
    for path in (LAUNCH, MNIST, REPO / "examples" / "mnist_lib.py"):
        if not path.exists():
            return f"{path.relative_to(REPO)} not available yet"
    return None


def run_once(
    nodes: int,
    backend: str,
    quick: bool,
    timeout: float,
    overlap: bool = True,
    extra=(),
    first_bucket_bytes: int | None = None,
    ddp: bool = False,
    repo: Path = REPO,
) -> dict:
    """One epoch as one job; the example's log plus every rank's phase totals.
    `repo`: the checkout whose examples/launch.py and bench/mnist_timed.py run it."""
    with tempfile.TemporaryDirectory(prefix="bench-train-") as tmp:
        phases_dir = Path(tmp, "phases")
        phases_dir.mkdir()
        cmd = [
            sys.executable, str(repo / "examples" / "launch.py"),
            "--script", str(repo / "bench" / "mnist_timed.py"),
            "--nodes", str(nodes), "--output", str(Path(tmp, "out")), "--epochs", "1",
            "--backend", backend, *extra,
        ] + (["--quick"] if quick else [])  # fmt: skip
        env = dict(os.environ, BENCH_PHASES_DIR=str(phases_dir), BENCH_OVERLAP=str(int(overlap)))
        if ddp:  # DistributedDataParallel in the same loop, the reference (mnist_timed)
            env["BENCH_DDP"] = "1"
        if first_bucket_bytes:
            env["BENCH_FIRST_BUCKET_BYTES"] = str(first_bucket_bytes)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(repo), env.get("PYTHONPATH")]))
        t0 = time.perf_counter()
        proc = subprocess.Popen(
            cmd, cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True,
        )  # fmt: skip
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_group(proc)
            out, _ = proc.communicate()  # what the job said before it was stopped
            # A job stopped before its first line (Python and torch still loading on a
            # busy machine) says so, rather than "timed out" and nothing after it.
            lines = out.splitlines()[-8:]
            said = " | ".join(lines) or f"no output yet: {Path(cmd[1]).name} was starting"
            return {"error": f"timed out after {timeout:.0f}s: {said}"}
        finally:
            kill_group(proc)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            return {"error": f"exit {proc.returncode}: " + " | ".join(out.splitlines()[-8:])}
        log_json = Path(tmp, "out", "log.json")
        if not log_json.exists():
            return {"error": f"no {log_json.name}: " + " | ".join(out.splitlines()[-5:])}
        log_record = json.loads(log_json.read_text())
        epoch = log_record["epochs"][0]
        ranks = [json.loads(p.read_text()) for p in sorted(phases_dir.glob("rank*.json"))]
        if len(ranks) != nodes:
            return {"error": f"{len(ranks)} of {nodes} ranks reported their phases"}
        res = {
            "algorithm": log_record.get("algorithm"),
            "items_per_s": epoch["items_per_s"],
            "train_items": epoch["train_items"],
            "test_accuracy": epoch.get("test_accuracy"),
            "job_wall_s": wall,
            "epoch_s": max(r["epoch_s"] for r in ranks),
            "steps": max(r["steps"] for r in ranks),
        }
        if all("cpu_s" in r for r in ranks):
            # What the ranks (with their loader threads) used of the machine over the
            # epoch: near 100%, a rank's waiting is time another rank computes in.
            cores = len(os.sched_getaffinity(0))
            res["ranks_cpu_pct"] = 100 * sum(r["cpu_s"] for r in ranks) / (res["epoch_s"] * cores)
        if ranks[0].get("host_idle") is not None:
            # ... and what nobody used: near 0, the waiting is not lost capacity.
            res["host_idle_pct"] = 100 * ranks[0]["host_idle"]
        # share of each phase in the epoch, averaged over ranks
        for ph in PHASES:
            res[ph.replace("_s", "_pct")] = 100 * sum(r[ph] / r["epoch_s"] for r in ranks) / nodes
        res.update(arrival_split(ranks))
        if "buckets" in ranks[0]:
            res["buckets"] = ranks[0]["buckets"]
        return res


def arrival_split(ranks: list[dict]) -> dict:
    """The per-step allreduce split in two, as shares of the epoch averaged over ranks:
    `wait_last_pct`, from a rank's call until the last rank's (no all-reduce can end
    before every rank has called it: the price of the slowest), and `after_last_pct`,
    from the last rank's call until this rank's return (what communication itself
    costs). Steps every rank took; the rest of the allreduce phase (epoch-end
    synchronize, a longer rank's extra steps) is in neither.

    The waiting is then split by what made the last rank late (`late_split`)."""
    if not all(r.get("entered") for r in ranks):
        return {}
    steps = min(len(r["entered"]) for r in ranks)
    last = [max(r["entered"][s] for r in ranks) for s in range(steps)]
    wait = after = 0.0
    for r in ranks:
        w = sum(min(last[s], r["left"][s]) - r["entered"][s] for s in range(steps))
        a = sum(max(0.0, r["left"][s] - last[s]) for s in range(steps))
        wait += w / r["epoch_s"]
        after += a / r["epoch_s"]
    out = {"wait_last_pct": 100 * wait / len(ranks), "after_last_pct": 100 * after / len(ranks)}
    out.update(back_split(ranks, last, steps))
    out.update(late_split(ranks))
    return out


def back_split(ranks: list[dict], last: list[float], steps: int) -> dict:
    """After the last rank's call, per step, in ms (medians over steps):

    first_back_ms  until the first rank returned: the all-reduce itself, as fast
                   as the scheduler let any rank out of it
    back_ms        until a rank returned, the mean over ranks: the first rank's
                   figure plus the time the others, their results ready, waited
                   for a core (4 ranks on 2 cores cannot all run at once)
    """
    if steps == 0:
        return {}
    first = sorted(min(r["left"][s] for r in ranks) - last[s] for s in range(steps))
    mean = sorted(sum(r["left"][s] for r in ranks) / len(ranks) - last[s] for s in range(steps))
    return {"first_back_ms": 1e3 * first[steps // 2], "back_ms": 1e3 * mean[steps // 2]}


def late_split(ranks: list[dict]) -> dict:
    """What the waiting for the last rank is made of, as shares of the epoch averaged
    over ranks. A rank that waits in step s waits `last - entered`; both ranks began the
    step when they left the previous all-reduce (nearly together), so the wait is exactly
    the last rank's lead in each phase of the step over this rank's:

        late_loading_pct   it waited longer for its batch (loading)
        late_compute_pct   its forward + backward took longer (computing, or descheduled
                           while computing: 4 processes on 2 cores)
        late_other_pct     the rest: it left the previous all-reduce later, or its
                           optimizer step took longer

    and `last_same_pct`: the share of steps in which the rank that was last most often
    was last (100 / N for a draw each step: jitter; near 100: one rank is always slow)."""
    if not all(r.get("began") and r.get("fwd") for r in ranks):
        return {}
    steps = min(min(len(r["entered"]), len(r["fwd"]), len(r["began"])) for r in ranks)
    if steps == 0:
        return {}
    lasts = [max(range(len(ranks)), key=lambda i: ranks[i]["entered"][s]) for s in range(steps)]
    loading = compute = other = 0.0
    for r in ranks:
        lo = co = ot = 0.0
        for s, li in enumerate(lasts):
            late = ranks[li]
            wait = min(late["entered"][s], r["left"][s]) - r["entered"][s]
            if wait <= 0:
                continue  # the last rank itself
            dl = (late["fwd"][s] - late["began"][s]) - (r["fwd"][s] - r["began"][s])
            dc = (late["entered"][s] - late["fwd"][s]) - (r["entered"][s] - r["fwd"][s])
            lo, co, ot = lo + dl, co + dc, ot + wait - dl - dc
        loading += lo / r["epoch_s"]
        compute += co / r["epoch_s"]
        other += ot / r["epoch_s"]
    n = len(ranks)
    return {
        "late_loading_pct": 100 * loading / n,
        "late_compute_pct": 100 * compute / n,
        "late_other_pct": 100 * other / n,
        "last_same_pct": 100 * max(lasts.count(i) for i in range(n)) / steps,
    }


def sent(buckets: dict | None) -> str:
    """What "overlap" did in a job: how many of a step's buckets left during backward
    (the rest, always the last, leave when the loop calls the all-reduce)."""
    if not buckets:
        return "-"
    if not buckets["buckets"]:
        return "none (one all-reduce after backward)"
    kib = "+".join(f"{b / 1024:.0f}" for b in buckets["bucket_bytes"])
    return f"{buckets['in_backward_per_step']:.1f} of {buckets['buckets']} ({kib} KiB)"


def run(args, emit) -> list[dict]:
    why = missing()
    if why:
        rec = {"kind": "note", "text": f"training rows skipped: {why}"}
        log.warning(rec["text"])
        emit(rec)
        return [rec]
    # one process needs no communicator: its row is the same whatever the backend
    configs = [
        (n, b)
        for b in args.train_backends
        for n in args.train_nodes
        if n > 1 or b == args.train_backends[0]
    ]
    results: dict[tuple[int, str], list[dict]] = {c: [] for c in configs}
    for rep in range(args.train_reps):
        for nodes, backend in configs if rep % 2 == 0 else configs[::-1]:
            res = run_once(nodes, backend, args.quick, args.train_timeout)
            results[(nodes, backend)].append(res)
            what = f"training rep {rep + 1}, {nodes} processes ({backend})"
            if "error" in res:
                log.warning("%s: %s", what, res["error"])
            else:
                log.info(
                    "%s: %6.0f samples/s, loading %2.0f%% compute %2.0f%% allreduce %2.0f%%",
                    what, res["items_per_s"], res["loading_pct"], res["compute_pct"],
                    res["allreduce_pct"],
                )  # fmt: skip
    out = []
    keys = ("items_per_s", "epoch_s", "job_wall_s", "loading_pct", "compute_pct", "allreduce_pct")
    for nodes, backend in configs:
        ok = [r for r in results[(nodes, backend)] if "error" not in r]
        rec = {"kind": "training", "nodes": nodes, "backend": backend, "quick": args.quick}
        if not ok:
            rec["error"] = results[(nodes, backend)][0]["error"]
        else:
            rec["reps"] = ok
            rec["train_items"] = ok[0]["train_items"]
            rec.update({k: spread([r[k] for r in ok]) for k in keys})
        emit(rec)
        out.append(rec)
    return out


def revision(repo: Path) -> str:
    """The commit a checkout is at, or why it cannot be said. git looks upwards for
    a repository, so a tree exported into another checkout would report that one's
    commit: the answer counts only when `repo` is the repository's own top level."""
    try:
        out = subprocess.run(
            ["git", "-C", str(repo), "rev-parse", "--show-toplevel", "--short", "HEAD"],
            capture_output=True, text=True, timeout=10,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"commit unknown: {e}"
    lines = out.stdout.split()
    if out.returncode != 0 or len(lines) != 2 or Path(lines[0]).resolve() != repo.resolve():
        return "commit unknown: not the top of a git checkout"
    return lines[1]


def main(argv: list[str] | None = None) -> int:
    import argparse
    import statistics

    p = argparse.ArgumentParser(prog="python -m bench.training", description=__doc__.split("\n")[0])
    p.add_argument("--nodes", type=int, nargs="+", default=[4])
    p.add_argument("--backends", nargs="+", choices=("ipc", "gloo"), default=["ipc", "gloo"])
    p.add_argument(
        "--overlap",
        nargs="+",
        default=["on", "off"],
        help="on, off, on@KIB (buckets during backward with a first bucket of KIB KiB), or "
        "ddp: DistributedDataParallel in the same loop, timed the same way (gloo only)",
    )
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument(
        "--before",
        type=Path,
        help="a checkout of an earlier commit: its own example runs as row 'before' "
        "(its defaults; --extra is not passed to it)",
    )
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="to mnist.py")
    a = p.parse_args(argv)
    if a.before is not None:
        a.before = a.before.resolve()
        for name in ("examples/launch.py", "bench/mnist_timed.py"):
            if not (a.before / name).is_file():
                p.error(f"--before {a.before}: no {name} there")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    # DDP runs over torch.distributed: a gloo job, whatever the backends asked for
    configs = [
        (n, b, o)
        for n in a.nodes
        for b in a.backends
        for o in a.overlap + (["before"] if a.before else [])
        if o != "ddp" or b == "gloo"
    ]
    results: dict[tuple, list[dict]] = {c: [] for c in configs}
    for rep in range(a.reps):
        for cfg in configs if rep % 2 == 0 else configs[::-1]:
            first = int(cfg[2].split("@")[1]) << 10 if "@" in cfg[2] else None
            before = cfg[2] == "before"
            res = run_once(
                cfg[0],
                cfg[1],
                a.quick,
                a.timeout,
                cfg[2] != "off",
                () if before else a.extra,
                first_bucket_bytes=first,
                ddp=cfg[2] == "ddp",
                repo=a.before if before else REPO,
            )
            results[cfg].append(res)
            log.info("rep %d %s: %s", rep + 1, cfg, res.get("error") or {
                k: round(v, 1) for k, v in res.items() if k.endswith(("_pct", "_per_s"))
            })  # fmt: skip
    cmd = " ".join(["python -m bench.training", *(argv if argv is not None else sys.argv[1:])])
    print(f"`{cmd}`, one epoch of examples/mnist.py per job, median (min-max) of {a.reps}.\n")
    if a.before:
        print(f"Row before: {a.before} ({revision(a.before)}).\n")
    print("| processes | backend | overlap | buckets sent during backward | samples/s | "
          "allreduce % | waiting for the last rank % | ... its loading / compute / other "
          "lead % | same rank last % | after the last rank called % | "
          "... first rank back / a rank back, ms a step | "
          "loading % | compute % | ranks' CPU % of the cores | cores idle % | "
          "test accuracy |")  # fmt: skip
    print("|---:|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for cfg in configs:
        ok = [r for r in results[cfg] if "error" not in r]
        if not ok:
            print(f"| {cfg[0]} | {cfg[1]} | {cfg[2]} | error: "
                  f"{results[cfg][0]['error'][:100]} | | | | | | | | | | | | |")  # fmt: skip
            continue

        def col(key, digits=0, ok=ok):
            vals = [r[key] for r in ok if r.get(key) is not None]
            if not vals:
                return "-"
            med = statistics.median(vals)
            return f"{med:,.{digits}f} ({min(vals):,.{digits}f}-{max(vals):,.{digits}f})"

        print(f"| {cfg[0]} | {cfg[1]} | {cfg[2]} | {sent(ok[0].get('buckets'))} | "
              f"{col('items_per_s')} | "
              f"{col('allreduce_pct', 1)} | {col('wait_last_pct', 1)} | "
              f"{col('late_loading_pct', 1)} / {col('late_compute_pct', 1)} / "
              f"{col('late_other_pct', 1)} | {col('last_same_pct')} | "
              f"{col('after_last_pct', 1)} | "
              f"{col('first_back_ms', 2)} / {col('back_ms', 2)} | "
              f"{col('loading_pct', 1)} | {col('compute_pct', 1)} | "
              f"{col('ranks_cpu_pct')} | {col('host_idle_pct')} | "
              f"{col('test_accuracy', 4)} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
