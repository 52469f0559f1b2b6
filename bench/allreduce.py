"""Allreduce rows: torch.distributed gloo vs the ipc tree, side by side in the same processes.

`run(world, sizes, ...)` starts `world` processes (`python -m bench.allreduce`);
each joins a gloo group and, when `ipc` is importable, an `ipc.LocalhostTree`.
For every size both are checked for a correct sum once, then timed in
alternating order (gloo, tree, then tree, gloo, ...) so drift on a shared
machine hits both alike. A repetition times `iters` back-to-back ops after a
barrier; the figure is rank 0's seconds per op. algbw = bytes / time, busbw =
algbw * 2 (n - 1) / n (the NCCL convention: what each link carries).

`python -m bench.allreduce --report` measures the ipc tree against itself
(bench/RESULTS-ipc.md): the tree of another git ref (`--baseline main`) and of
this checkout in alternating fresh process sets, with a third set of the
other ref again to show the noise (A/A); the socket transport
encrypted (CURVE) and not; 8 buckets of 4 MiB all-reduced asynchronously
(in flight together) and one after the other; and a training-like step with
the tree's heartbeats on and off.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import netns
from bench.procs import free_port, wait_ranks

REPO = Path(__file__).resolve().parent.parent

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
    mode: str = "allreduce",
    path_first: str | None = None,
    env_extra: dict[str, str] | None = None,
    hosts: list | None = None,
) -> list[dict]:
    """Run the allreduce rows for `world` processes; one dict per (impl, size).

    `mode` "async" times 8 buckets in flight against 8 calls in a row, "step" a
    training-like step; `path_first` puts another checkout's packages (see
    `baseline_path`) ahead of this one; `env_extra` is added to the ranks' environment;
    `hosts` ([(namespace, address)] from bench.netns.hosts) puts each rank on a host of
    its own, for the tree-hosts impls (a fresh IPC_TOKEN per run)."""
    env = dict(os.environ)
    if hosts:
        env["BENCH_HOSTS"] = json.dumps(hosts)
        env["IPC_TOKEN"] = secrets.token_hex(32)
    first = [path_first] if path_first else []
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [*first, str(REPO), env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(env_extra or {})
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="bench-allreduce-") as tmp:
        out = Path(tmp, "result.json")
        args = [
            "--world", str(world), "--port", str(port), "--reps", str(reps),
            "--target-s", str(target_s), "--sizes", json.dumps(sizes),
            "--impls", ",".join(impls), "--out", str(out), "--mode", mode,
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
        logs = wait_ranks(procs, timeout)
        if logs is None:
            raise TimeoutError(f"allreduce with {world} processes ran past {timeout}s")
        bad = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode != 0]
        if bad or not out.exists():
            detail = "\n".join(f"--- rank {r}:\n{logs[r][-3000:]}" for r, _ in bad or [(0, 0)])
            raise RuntimeError(f"allreduce ranks failed {bad}:\n{detail}")
        return json.loads(out.read_text())


def _worker(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    # BENCH_HOSTS (see run's `hosts`): this rank is a host of its own, a network namespace
    hosts = json.loads(os.environ.get("BENCH_HOSTS") or "null")
    address = "127.0.0.1"
    if hosts:
        netns.enter(hosts[a.rank][0])
        address = hosts[0][1]
    dist.init_process_group(
        "gloo", init_method=f"tcp://{address}:{a.port}", rank=a.rank, world_size=a.world
    )
    ops = {}
    errors = {}
    if "gloo" in a.impls:
        ops["gloo"] = lambda t: dist.all_reduce(t)
    trees = []
    for impl in [i for i in a.impls if i.startswith("tree")]:
        # tree: the default (shared memory on one host); tree-sockets: the socket
        # transport every multi-host link uses; tree-curve: the same, encrypted;
        # tree-hosts: a StaticTree across the hosts of BENCH_HOSTS, the code's default
        # for them (CURVE now; in the clear before this became the default), tree-hosts-plain:
        # the same with encrypt=False.
        opts = {"tree-sockets": {"shm": False}, "tree-curve": {"shm": False, "encrypt": True},
                "tree-hosts-plain": {"encrypt": False}}  # fmt: skip
        try:
            from distlearn import ipc

            key = f"bench-allreduce-{a.port}-{impl}"
            if impl.startswith("tree-hosts"):
                k = 1 + list(a.impls).index(impl)  # a port of its own per tree
                tree = ipc.StaticTree(a.rank, a.world, address, a.port + k, shm=False,
                                      **opts.get(impl, {}))  # fmt: skip
            else:
                tree = ipc.LocalhostTree(a.rank, a.world, key=key, **opts.get(impl, {}))
            trees.append(tree)
            ops[impl] = tree.all_reduce
        except Exception as err:  # the tree may not be built yet: report gloo alone
            errors[impl] = f"{type(err).__name__}: {err}"
    # every rank must agree on which implementations run
    for impl in [i for i in a.impls if i.startswith("tree")]:
        have = torch.tensor([1 if impl in ops else 0])
        dist.all_reduce(have, op=dist.ReduceOp.MIN)
        if not have.item() and impl in ops:
            del ops[impl]
    if a.mode == "async":
        results = _time_async(a, ops, dist)
    elif a.mode == "step":
        results = _time_step(a, ops, dist)
    elif a.mode == "idle":
        results = _time_idle(a, ops, dist)
    else:
        results = _time_allreduce(a, ops, dist)
    for name, err in errors.items():
        results.append({"impl": name, "error": err})
    if a.rank == 0:
        Path(a.out).write_text(json.dumps(results))
    dist.barrier()
    for tree in trees:
        tree.close()
    dist.destroy_process_group()


def _time_allreduce(a: argparse.Namespace, ops: dict, dist) -> list[dict]:
    import torch

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
    return results


BUCKETS, BUCKET_BYTES = 8, 4 << 20


def _time_async(a: argparse.Namespace, ops: dict, dist) -> list[dict]:
    """8 buckets of 4 MiB: all_reduce(async_op=True) on all, then wait, against 8 calls in
    a row; alternating, `iters` rounds per repetition. Checked once for the right sums."""
    import torch

    tree_op = ops["tree"]
    buckets = [torch.empty(BUCKET_BYTES // 4) for _ in range(BUCKETS)]

    def in_a_row():
        for b in buckets:
            tree_op(b)

    def in_flight():
        for h in [tree_op(b, async_op=True) for b in buckets]:
            h.wait()

    for fn in (in_a_row, in_flight):
        for i, b in enumerate(buckets):
            b.fill_(float(a.rank + i))
        fn()
        for i, b in enumerate(buckets):
            want = sum(r + i for r in range(a.world))
            if not torch.all(b == want):
                raise AssertionError(f"{fn.__name__}: bucket {i} is {b[:2].tolist()}, want {want}")
    for b in buckets:
        b.zero_()
    times: dict[str, list[float]] = {"in a row": [], "in flight": []}
    fns = {"in a row": in_a_row, "in flight": in_flight}
    iters = 10
    for rep in range(a.reps):
        names = list(fns) if rep % 2 == 0 else list(fns)[::-1]
        for name in names:
            fns[name]()
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                fns[name]()
            times[name].append((time.perf_counter() - t0) / iters)
    return [
        {"impl": f"tree {name}", "size": f"{BUCKETS} x 4 MiB", "bytes": BUCKETS * BUCKET_BYTES,
         "iters": iters, "times_s": ts}
        for name, ts in times.items()
    ]  # fmt: skip


def _time_idle(a: argparse.Namespace, ops: dict, dist) -> list[dict]:
    """CPU seconds per second this process burns (every thread: the tree's communication
    thread, libzmq's I/O thread) while it sleeps with the tree open: the background cost."""
    import resource

    import torch

    ops["tree"](torch.ones(1))  # the tree has run one collective
    times = []
    for _ in range(a.reps):
        dist.barrier()
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        time.sleep(3.0)
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        times.append((r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime) / 3.0)
    return [{"impl": "tree idle", "size": "3 s", "bytes": 0, "iters": 1, "times_s": times}]


def _time_step(a: argparse.Namespace, ops: dict, dist) -> list[dict]:
    """A training-like step: about 20 ms of matrix products, then an all_reduce of 1 MiB of
    gradients; seconds per step over `iters` steps (after a warm-up)."""
    import torch

    tree_op = ops["tree"]
    x = torch.randn(384, 384)
    grads = torch.zeros(1 << 18)

    def step():
        y = x
        for _ in range(12):
            y = torch.tanh(y @ x) * 0.01
        grads.add_(y.view(-1)[: grads.numel()].sum() * 0)
        tree_op(grads)

    for _ in range(5):
        step()
    times = []
    for _ in range(a.reps):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(50):
            step()
        times.append((time.perf_counter() - t0) / 50)
    return [{"impl": "tree step", "size": "20 ms + 1 MiB", "bytes": 1 << 20, "iters": 50,
             "times_s": times}]  # fmt: skip


# ---- the tree against itself: bench/RESULTS-ipc.md ----------------------------------


def baseline_path(ref: str, tmp: Path) -> str:
    """A folder where `distlearn.ipc` is git `ref`'s ipc/ (with its distlearn and dataset),
    to put first on PYTHONPATH."""
    src, path = tmp / "src", tmp / "path"
    src.mkdir()
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", ref, "ipc", "distlearn", "dataset"],
        capture_output=True, check=True,
    )  # fmt: skip
    subprocess.run(["tar", "-x", "-C", str(src)], input=archive.stdout, check=True)
    shutil.copytree(src / "distlearn", path / "distlearn")
    (path / "distlearn" / "ipc").symlink_to(src / "ipc")
    (path / "distlearn" / "dataset").symlink_to(src / "dataset")
    return str(path)


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _spread(xs: list[float], scale: float = 1e3, digits: int = 3) -> str:
    if not xs:
        return "-"
    f = f"{{:,.{digits}f}}"
    return (
        f"{f.format(_median(xs) * scale)} ({f.format(min(xs) * scale)}-{f.format(max(xs) * scale)})"
    )


def _ratios(a: list[float], b: list[float]) -> str:
    rs = [x / y for x, y in zip(a, b, strict=False)]
    return f"{_median(rs):.2f}x ({min(rs):.2f}-{max(rs):.2f})" if rs else "-"


def report(a: argparse.Namespace) -> None:
    """Run the four comparisons and write `a.out_md`."""
    started = time.time()
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True).stdout.strip()  # fmt: skip
    base = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", a.baseline],
                          capture_output=True, text=True).stdout.strip()  # fmt: skip
    lines = [
        "# The ipc tree against itself",
        "",
        f"`python -m bench.allreduce --report --baseline {a.baseline} --reps {a.reps}`, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, commit `{head}` against "
        f"`{a.baseline}` (`{base}`); {os.cpu_count()} cores, load average at start "
        f"{os.getloadavg()[0]:.2f}. Figures: median (min-max) of the repetitions, each in "
        "fresh processes (rows compared within one process set alternate their order; in "
        "the before/after rows a repetition's figure is the median of three timed runs in "
        "its process set). Ratios are taken repetition by repetition.",
        "",
    ]
    with tempfile.TemporaryDirectory(prefix="bench-baseline-") as tmp:
        base_path = baseline_path(a.baseline, Path(tmp))
        lines += [
            f"## all_reduce: {a.baseline} vs this commit (float32 sum, LocalhostTree defaults)",
            "",
            f"The last column is the noise: {a.baseline} against itself, a third process set "
            "in each repetition, its ratio taken as the others'. A before/after ratio inside "
            "that column's range is within noise.",
            "",
            f"| processes | size | {a.baseline} ms/op | this commit ms/op | {a.baseline}/this "
            f"| {a.baseline}/{a.baseline} (A/A) |",
            "|---:|---|---:|---:|---:|---:|",
        ]
        for world in a.worlds:
            times: dict[tuple[str, str], list[float]] = {}
            for rep in range(a.reps):
                order = [("base", base_path), ("this", None), ("again", base_path)]
                k = rep % len(order)  # each set goes first, second and third in turn
                for name, path in order[k:] + order[:k]:
                    # Three timed runs in each process set, their median its figure: a
                    # burst of load elsewhere hits one run, not the set's figure.
                    recs = run(world, SIZES, reps=3, target_s=a.target_s / 3, impls=("tree",),
                               path_first=path)  # fmt: skip
                    for r in recs:
                        if "times_s" in r:
                            times.setdefault((name, r["size"]), []).append(_median(r["times_s"]))
                print(f"before/after, {world} processes, repetition {rep + 1}", flush=True)
            for size in SIZES:
                b, t, b2 = (times.get((name, size), []) for name in ("base", "this", "again"))
                lines.append(
                    f"| {world} | {size} | {_spread(b)} | {_spread(t)} | {_ratios(b, t)} "
                    f"| {_ratios(b, b2)} |"
                )
        lines.append("")

    lines += hosts_section(a, base_path_ref=a.baseline)
    print("across hosts done", flush=True)

    enc_sizes = {k: SIZES[k] for k in ("1 MiB", "64 MiB")}
    recs = run(2, enc_sizes, reps=a.reps, target_s=a.target_s, impls=("tree-sockets", "tree-curve"))
    by = {(r["impl"], r["size"]): r["times_s"] for r in recs if "times_s" in r}
    lines += [
        "## Encryption: the socket transport with and without CURVE (2 processes)",
        "",
        "`shm=False` (what links between hosts use) over Unix sockets, `encrypt=False` vs "
        "`encrypt=True`, alternating in the same processes.",
        "",
        "| size | plain ms/op | CURVE ms/op | CURVE/plain | CURVE MB/s (algbw) |",
        "|---|---:|---:|---:|---:|",
    ]
    for size, nbytes in enc_sizes.items():
        p, c = by.get(("tree-sockets", size), []), by.get(("tree-curve", size), [])
        bw = f"{nbytes / _median(c) / 1e6:,.0f}" if c else "-"
        lines.append(f"| {size} | {_spread(p)} | {_spread(c)} | {_ratios(c, p)} | {bw} |")
    lines.append("")
    print("encryption done", flush=True)

    lines += [
        "## Asynchronous all_reduce: 8 buckets of 4 MiB in flight vs 8 calls in a row",
        "",
        "`all_reduce(bucket, async_op=True)` on all 8, then `wait()` on each, against 8 "
        "synchronous calls; alternating in the same processes, 10 rounds per repetition.",
        "",
        "| processes | in a row ms | in flight ms | in a row / in flight |",
        "|---:|---:|---:|---:|",
    ]
    for world in a.worlds:
        recs = run(world, {}, reps=a.reps * 2, impls=("tree",), mode="async")
        by = {r["impl"]: r["times_s"] for r in recs if "times_s" in r}
        row, fl = by.get("tree in a row", []), by.get("tree in flight", [])
        lines.append(f"| {world} | {_spread(row)} | {_spread(fl)} | {_ratios(row, fl)} |")
    lines.append("")
    print("async done", flush=True)

    steps: dict[str, list[float]] = {"on": [], "off": []}
    for rep in range(a.reps * 2):
        order = [("on", {}), ("off", {"IPC_HEARTBEAT_INTERVAL": "0"})]
        for name, env in order if rep % 2 == 0 else order[::-1]:
            recs = run(2, {}, reps=3, impls=("tree",), mode="step", env_extra=env)
            steps[name] += [t for r in recs for t in r.get("times_s", [])]
    idle: dict[str, list[float]] = {"on": [], "off": []}
    for rep in range(a.reps):
        order = [("on", {}), ("off", {"IPC_HEARTBEAT_INTERVAL": "0"})]
        for name, env in order if rep % 2 == 0 else order[::-1]:
            recs = run(2, {}, reps=2, impls=("tree",), mode="idle", env_extra=env)
            idle[name] += [t for r in recs for t in r.get("times_s", [])]
    lines += [
        "## Heartbeats: cost in a training-like step (2 processes)",
        "",
        "A step is about 20 ms of matrix products then an all_reduce of 1 MiB; heartbeats "
        "on (the defaults) vs off (`IPC_HEARTBEAT_INTERVAL=0`), alternating fresh process "
        "sets, 50 steps per repetition.",
        "",
        "| heartbeats on ms/step | off ms/step | on/off |",
        "|---:|---:|---:|",
        f"| {_spread(steps['on'], digits=2)} | {_spread(steps['off'], digits=2)} "
        f"| {_ratios(steps['on'], steps['off'])} |",
        "",
        "In the background, a rank that sleeps with its tree open burns "
        f"{_spread(idle['on'], digits=2)} ms of CPU per second with heartbeats on and "
        f"{_spread(idle['off'], digits=2)} ms/s with them off (every thread of the process, "
        "getrusage over 3 s sleeps).",
        "",
        f"Reproduce: `python -m bench.allreduce --report` ({time.time() - started:.0f} s).",
        "",
    ]
    Path(a.out_md).write_text("\n".join(lines))
    print(f"wrote {a.out_md}")


HOSTS_SIZES = {k: SIZES[k] for k in ("64 KiB", "1 MiB", "16 MiB")}


def hosts_section(a: argparse.Namespace, base_path_ref: str) -> list[str]:
    """Two hosts (network namespaces, links of `a.hosts_rate`), a StaticTree on TCP: the
    baseline's default against this commit's (CURVE), alternating fresh process sets with
    an A/A set; then CURVE against encrypt=False in the same processes."""
    why = netns.missing()
    if why:
        return ["## Across hosts", "", f"Not measured: {why}.", ""]
    lines = [
        f"## Across hosts: {base_path_ref}'s default vs this commit's (2 hosts, TCP)",
        "",
        f"Two network namespaces joined through links of {a.hosts_rate} (bench/netns.py: "
        "separate hosts' bandwidth, this machine's cores), a `StaticTree` over TCP with "
        f"`$IPC_TOKEN`, float32 sum. {base_path_ref}'s default sends in the clear; this "
        "commit's encrypts and authenticates every message (CURVE). A/A: "
        f"{base_path_ref} against itself.",
        "",
        f"| size | {base_path_ref} ms/op | this commit ms/op | this/{base_path_ref} "
        f"| {base_path_ref}/{base_path_ref} (A/A) | this commit MB/s (algbw) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    times: dict[tuple[str, str], list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-baseline-") as tmp:
        base_path = baseline_path(base_path_ref, Path(tmp))
        for rep in range(a.reps):
            order = [("base", base_path), ("this", None), ("again", base_path)]
            k = rep % len(order)
            for name, path in order[k:] + order[:k]:
                with netns.hosts(2, a.hosts_rate) as hs:
                    recs = run(2, HOSTS_SIZES, reps=3, target_s=a.target_s / 3,
                               impls=("tree-hosts",), path_first=path, hosts=hs)  # fmt: skip
                for r in recs:
                    if "times_s" in r:
                        times.setdefault((name, r["size"]), []).append(_median(r["times_s"]))
            print(f"across hosts, repetition {rep + 1}", flush=True)
    for size, nbytes in HOSTS_SIZES.items():
        b, t, b2 = (times.get((name, size), []) for name in ("base", "this", "again"))
        bw = f"{nbytes / _median(t) / 1e6:,.0f}" if t else "-"
        lines.append(f"| {size} | {_spread(b)} | {_spread(t)} | {_ratios(t, b)} "
                     f"| {_ratios(b2, b)} | {bw} |")  # fmt: skip
    with netns.hosts(2, a.hosts_rate) as hs:
        recs = run(2, HOSTS_SIZES, reps=a.reps, target_s=a.target_s,
                   impls=("tree-hosts-plain", "tree-hosts"), hosts=hs)  # fmt: skip
    by = {(r["impl"], r["size"]): r["times_s"] for r in recs if "times_s" in r}
    lines += [
        "",
        "This commit alone, the same two processes: `encrypt=False` (in the clear, for a "
        "trusted network) against the default, alternating.",
        "",
        "| size | encrypt=False ms/op | default (CURVE) ms/op | CURVE/plain |",
        "|---|---:|---:|---:|",
    ]
    for size in HOSTS_SIZES:
        p, c = by.get(("tree-hosts-plain", size), []), by.get(("tree-hosts", size), [])
        lines.append(f"| {size} | {_spread(p)} | {_spread(c)} | {_ratios(c, p)} |")
    lines.append("")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.allreduce")
    p.add_argument("--report", action="store_true", help="measure the tree against itself")
    p.add_argument("--baseline", default="main", help="git ref of the tree to compare against")
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    p.add_argument("--out-md", default=str(REPO / "bench" / "RESULTS-ipc.md"))
    p.add_argument("--rank", type=int)
    p.add_argument("--world", type=int)
    p.add_argument("--port", type=int)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--target-s", type=float, default=0.5)
    p.add_argument("--sizes", type=json.loads, default=SIZES)
    p.add_argument("--impls", type=lambda s: tuple(s.split(",")), default=("gloo", "tree"))
    p.add_argument("--mode", choices=("allreduce", "async", "step", "idle"), default="allreduce")
    p.add_argument("--out")
    p.add_argument("--hosts-rate", default="10gbit", help="the links between hosts (netns)")
    p.add_argument("--hosts-only", action="store_true",
                   help="with --report: only the across-hosts section, to --out-md")  # fmt: skip
    a = p.parse_args(argv)
    if a.report and a.hosts_only:
        Path(a.out_md).write_text("\n".join(hosts_section(a, a.baseline)))
        print(f"wrote {a.out_md}")
        return 0
    if a.report:
        report(a)
        return 0
    if a.rank is None or a.world is None or a.port is None or a.out is None:
        p.error("a rank needs --rank, --world, --port and --out (or use --report)")
    _worker(a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
