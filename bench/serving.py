"""Serving rows: `distlearn.dataset.serve` against nginx, the static server it stands in for.

    python -m bench.serving [--reps 3] [--requests 40000] [--no-training]
                            [--servers serve nginx] [--clients 2]

Two measures, the servers alternating within each repetition (`serve@4`: serve
with 4 worker processes; `nginx@4`: 4 nginx workers):

1. requests: `--clients` processes (aiohttp, 16 keep-alive requests in flight each)
   fetch the MNIST training PNGs of examples/data/mnist until `--requests` in
   all; per server, requests/s and the server's own CPU per request (user+sys
   of its processes over the run, from /proc). CPU per request is the figure
   that matters on a shared host: it is taken from the training processes.
2. training: one epoch of examples/mnist.py with 4 processes, as mnist.sh runs
   it (`examples/launch.py --server nginx|serve`, `--server-workers` for serve@N):
   items/s of the training job.

Writes bench/RESULTS-serving.md (or --out) and prints the table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.procs import kill_group
from bench.servers import Server, find_nginx

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / "examples" / "data" / "mnist"
IN_FLIGHT = 16


async def _fetch_all(base: str, paths: list[str]) -> int:
    import aiohttp

    conn = aiohttp.TCPConnector(limit=IN_FLIGHT)
    async with aiohttp.ClientSession(connector=conn) as session:
        queue = iter(paths)
        total = 0

        async def worker() -> None:
            nonlocal total
            for path in queue:
                async with session.get(base + path) as r:
                    if r.status != 200:
                        raise RuntimeError(f"{base + path}: HTTP {r.status}")
                    total += len(await r.read())

        await asyncio.gather(*(worker() for _ in range(IN_FLIGHT)))
        return total


def client_main(base: str, paths_file: str) -> None:
    """One client process: fetch every path listed in the file."""
    paths = Path(paths_file).read_text().split()
    asyncio.run(_fetch_all(base, paths))


def requests_row(server: Server, files: list[str], n: int, clients: int) -> dict:
    """`n` requests from `clients` processes; requests/s and server CPU us per request."""
    per_client = [[files[(i * clients + c) % len(files)] for i in range(n // clients)]
                  for c in range(clients)]  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        lists = []
        for c, paths in enumerate(per_client):
            lists.append(Path(tmp, f"paths{c}"))
            lists[-1].write_text("\n".join(paths))
        cmd = [sys.executable, "-c", "import sys; from bench.serving import client_main; "
               "client_main(sys.argv[1], sys.argv[2])"]  # fmt: skip
        env = dict(os.environ, PYTHONPATH=str(REPO))
        cpu0, t0 = server.cpu_seconds(), time.perf_counter()
        procs = [subprocess.Popen([*cmd, server.url, str(p)], env=env) for p in lists]
        codes = [p.wait() for p in procs]
        wall, cpu = time.perf_counter() - t0, server.cpu_seconds() - cpu0
    if any(codes):
        raise RuntimeError(f"a client failed: exit codes {codes}")
    done = sum(len(p) for p in per_client)
    return {"requests_per_s": done / wall, "server_cpu_us": 1e6 * cpu / done}


def training_row(kind: str, workers: int, timeout: float = 900) -> dict:
    """One epoch of mnist.py, 4 processes, served by `kind`: the job's items/s."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, str(REPO / "examples" / "launch.py"), "--script",
               str(REPO / "examples" / "mnist.py"), "--server", kind, "--epochs", "1",
               "--output", tmp]  # fmt: skip
        if kind == "serve":
            cmd += ["--server-workers", str(workers)]
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)  # fmt: skip
        try:
            out, _ = proc.communicate(timeout=timeout)
        finally:
            kill_group(proc)
        if proc.returncode != 0:
            raise RuntimeError(f"training with {kind}: exit {proc.returncode}: {out[-1500:]}")
        epoch = json.loads(Path(tmp, "log.json").read_text())["epochs"][0]
        return {"items_per_s": epoch["items_per_s"], "test_accuracy": epoch["test_accuracy"]}


def parse_spec(spec: str) -> tuple[str, int]:
    """`serve`, `nginx`, or either with `@N` processes (N >= 1): (kind, N)."""
    kind, _, n = spec.partition("@")
    if kind not in ("serve", "nginx") or (n and (not n.isdigit() or int(n) < 1)):
        raise argparse.ArgumentTypeError(f"{spec!r}: serve or nginx, with @N (N >= 1) or not")
    return kind, int(n or 1)


def server_spec(spec: str) -> str:
    """argparse's check of a --servers entry; the entry itself names its rows."""
    parse_spec(spec)
    return spec


def med(xs: list[float]) -> str:
    return f"{statistics.median(xs):,.0f} ({min(xs):,.0f}-{max(xs):,.0f})"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.serving", description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--requests", type=int, default=40000)
    p.add_argument("--no-training", action="store_true", help="only the requests rows")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "RESULTS-serving.md")
    p.add_argument("--servers", nargs="+", default=["serve", "nginx"], type=server_spec,
                   help="serve or nginx, @N for N processes (default: serve nginx)")  # fmt: skip
    p.add_argument("--clients", type=int, default=2, help="client processes (default 2)")
    args = p.parse_args(argv)
    if args.clients < 1:
        p.error("--clients must be at least 1")
    if not args.no_training and any(
        k.startswith("nginx@") and k != "nginx@1" for k in args.servers
    ):
        p.error("nginx@N: the training row's nginx (examples/launch.py) has one worker; "
                "add --no-training")  # fmt: skip
    if any(k.startswith("nginx") for k in args.servers) and not find_nginx():
        raise SystemExit("nginx is not installed (apt-get install nginx): nothing to compare")
    if not (DATA / "train.csv").exists():
        subprocess.run([sys.executable, str(REPO / "examples" / "prepare_mnist.py")], check=True)
    files = [line.split(",")[0] for line in (DATA / "train.csv").read_text().split()[1:]]
    kinds = args.servers
    res: dict[str, dict[str, list[float]]] = {k: {} for k in kinds}
    for rep in range(args.reps):
        for spec in kinds if rep % 2 == 0 else kinds[::-1]:
            kind, workers = parse_spec(spec)
            with Server(DATA, kind=kind, workers=workers) as server:
                row = requests_row(server, files, args.requests, args.clients)
            if not args.no_training:
                row.update(training_row(kind, workers))
            for k, v in row.items():
                res[spec].setdefault(k, []).append(v)
            print(f"rep {rep + 1} {spec:>7}: " + ", ".join(f"{k} {v:,.3f}" for k, v in row.items()),
                  flush=True)  # fmt: skip
    lines = [
        "# Serving: distlearn.dataset.serve vs nginx",
        "",
        f"`python -m bench.serving --reps {args.reps} --requests {args.requests} --servers "
        f"{' '.join(kinds)} --clients {args.clients}`"
        + (" --no-training" if args.no_training else "")
        + "; medians (min-max) of "
        f"{args.reps} repetitions, servers alternating. Requests: {args.clients} aiohttp client "
        f"processes, {IN_FLIGHT} keep-alive requests in flight each, over the 60,000 MNIST "
        "training PNGs (about 300 bytes each). Training: one epoch of examples/mnist.py, "
        "4 processes, served by each.",
        "",
        "| server | processes | requests/s | server CPU per request (us) "
        "| training items/s (4 processes) |",
        "|---|---:|---|---|---|",
    ]
    for spec in kinds:
        r = res[spec]
        kind, workers = parse_spec(spec)
        train = med(r["items_per_s"]) if "items_per_s" in r else "not run"
        name = "nginx" if kind == "nginx" else "distlearn.dataset.serve"
        lines.append(f"| {name} | {workers} | {med(r['requests_per_s'])} | "
                     f"{med(r['server_cpu_us'])} | {train} |")  # fmt: skip
    base = kinds[0]
    for spec in kinds[1:]:
        for key, what in (("requests_per_s", "requests/s"), ("server_cpu_us", "CPU per request"),
                          ("items_per_s", "training items/s")):  # fmt: skip
            if key in res[base]:
                ratio = [a / b for a, b in zip(res[base][key], res[spec][key], strict=True)]
                lines.append(f"{what}, {base} / {spec}, per repetition: "
                             + ", ".join(f"{x:.2f}x" for x in ratio) + ".")  # fmt: skip
    text = "\n".join(lines) + "\n"
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
