"""`python -m bench.metrics`: what the loader's metrics cost, and whether their verdict is right.

    python -m bench.metrics                        # -> bench/RESULTS-metrics.md
    python -m bench.metrics --reps 3 --windows 2 --window 2 --out /tmp/r.md   # smoke

- **Overhead**: loader throughput with the metrics on (the default) against
  ``metrics=False`` (no timer at all), in the same run, A and B alternating, each trial a
  fresh batcher timed after its first batch. Two loaders: small PNGs (MNIST's 28x28) over
  HTTP from ``distlearn.dataset.serve`` with process workers and the ``Image`` processor,
  as examples/mnist.sh reads them; and in-memory rows decoded inline by a cheap processor,
  the most items a second one thread can take, where a per-item cost shows most.
- **Verdicts** in windows of ``--window`` seconds (10), with one bottleneck put there at
  a time: the HTTP server throttled (tests/faulty_server.py "throttle": one answer at a
  time, 5 ms each), a processor that sleeps 20 ms an item, a training loop that sleeps
  100 ms a step with a fast loader (the small PNGs, local server), rows already in memory
  sent to process workers (the main process pickles every row: the loader's own
  machinery, ``workers``); and three ranks of an
  ipc tree taking an all_reduce a step, rank 1's processor sleeping 10 ms an item, the
  loader metrics riding in a step's all_reduce once per window. A window is right when
  its verdict names that stage (the rank: that rank as the straggler, bound by decode);
  every window counts, the first too. ``explained`` is the share of the window's stall
  that the stage times account for.

Figures are medians (min-max) on this machine, shared with other work: compare the
ratios taken side by side, not the absolute rates.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent


class Sleepy:
    """Copies the row after `seconds` (a processor as slow as a big image's decode)."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def __call__(self, data, opt, out):
        if self.seconds:
            time.sleep(self.seconds)
        out.copy_(data)


def _copy(data, opt, out):
    out.copy_(data)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def _serve(root: Path):
    """The bundled server over `root`: (process, base URL)."""
    port_file = root.parent / f"port-{uuid.uuid4().hex}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "distlearn.dataset.serve", str(root), "--port-file", str(port_file)],
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    for _ in range(600):
        if port_file.exists() and port_file.read_text().strip():
            return proc, f"http://127.0.0.1:{port_file.read_text().strip()}/"
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError("the server did not start")


def _stop(proc) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# ----------------------------------------------------------------------------- overhead


def _cpu() -> float:
    """CPU seconds of this process and of its reaped children (a closed batcher's workers)."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def _rate(make, batches: int) -> tuple[float, float]:
    """(items a second, CPU microseconds an item) over `batches` batches of a fresh
    batcher, after its first; the CPU is every thread's and every worker's (reaped as the
    batcher closes), the first batch's and the start's too."""
    c0 = _cpu()
    with make() as b:
        b.next_batch()
        n, t0 = 0, time.perf_counter()
        for _ in range(batches):
            n += len(b.next_batch().target)
        rate = n / (time.perf_counter() - t0)
    return rate, (_cpu() - c0) / n * 1e6


def overhead(tmp: Path, reps: int) -> list[dict]:
    import torch

    from bench.metrics import _copy as copy
    from distlearn.dataset import Dataset
    from distlearn.dataset.processors import Image
    from tests.faulty_server import make_pngs

    index = make_pngs(tmp / "pngs", 3000, labels=10, size=28)
    proc, url = _serve(tmp / "pngs")
    rows = []
    try:
        http = Dataset(url + index.name)
        n = 200_000
        mem = Dataset({"x": torch.randn(n, 16), "y": torch.zeros(n, dtype=torch.long)})
        loaders = [
            (
                "3000 PNGs 28x28 over HTTP (distlearn.dataset.serve), 2 process workers, "
                "Image processor, batch 64",
                lambda on: http.sampled_batcher(
                    batch_size=64,
                    input_dims=(1, 28, 28),
                    sampler="permutation",
                    processor=Image(mode="L"),
                    workers="process",
                    num_workers=2,
                    metrics=on,
                ),
                60,
            ),
            (
                "in-memory rows (16 floats), a copy processor inline (num_workers=0), batch 64",
                lambda on: mem.sampled_batcher(
                    batch_size=64,
                    input_dims=(16,),
                    processor=copy,
                    sampler="permutation",
                    workers="thread",
                    num_workers=0,
                    metrics=on,
                ),
                600,
            ),
        ]
        for name, make, batches in loaders:
            on, off = [], []
            for _ in range(reps):  # A and B alternate, so a load that comes and goes hits both
                off.append(_rate(lambda make=make: make(False), batches))
                on.append(_rate(lambda make=make: make(True), batches))
            rows.append({
                "loader": name,
                "on": [r for r, _ in on],
                "off": [r for r, _ in off],
                "ratio": [a[0] / b[0] for a, b in zip(on, off, strict=True)],
                "cpu_on": [c for _, c in on],
                "cpu_off": [c for _, c in off],
                "cpu_ratio": [a[1] / b[1] for a, b in zip(on, off, strict=True)],
            })  # fmt: skip
            print(f"overhead: {name}: on/off {statistics.median(rows[-1]['ratio']):.3f}, "
                  f"CPU {statistics.median(rows[-1]['cpu_ratio']):.3f}", flush=True)  # fmt: skip
    finally:
        _stop(proc)
    return rows


def _tiny(data, opt, out):
    out[0] = len(data)


def timers_alone(tmp: Path, trials: int) -> dict:
    """What the timers cost, alone, in CPU time of the one thread that runs them: a
    worker's fill() of 64 local 1 KiB files with its Activity and probe against without,
    interleaved `trials` times (medians); and the main process's calls for one batch
    (asked, sampled, batch, answered, and the profiler ranges' checks), over 20,000."""
    import asyncio

    import torch

    from distlearn.dataset.fetch.fetcher import Fetcher
    from distlearn.dataset.metrics.export import stage
    from distlearn.dataset.metrics.loader import LoaderMetrics
    from distlearn.dataset.metrics.probe import Activity, now
    from distlearn.dataset.workers.fill import fill

    folder = tmp / "small"
    folder.mkdir()
    sources = []
    for i in range(64):
        (folder / f"{i}.bin").write_bytes(os.urandom(1024))
        sources.append(str(folder / f"{i}.bin"))
    out = torch.empty(64, 4)

    async def run() -> tuple[list[float], list[float]]:
        fetcher, activity = Fetcher(), Activity()
        on, off = [], []
        try:
            for i in range(trials):
                for arm in (on, off) if i % 2 else (off, on):
                    t0 = time.thread_time()  # (this thread's CPU: not another process's turn)
                    await fill(fetcher, sources, out, _tiny, None, None, None,
                               activity if arm is on else None)  # fmt: skip
                    arm.append(time.thread_time() - t0)
        finally:
            await fetcher.aclose()
        return on, off

    on, off = asyncio.run(run())
    worker_us = (statistics.median(on) - statistics.median(off)) * 1e6 / 64
    m = LoaderMetrics(window=1e9)
    probe = {"fetch_s": 0.01, "fetches": 64, "lat": {40: 60, 44: 4}, "decode_s": 0.001,
             "decodes": 64, "worker": 0, "sent": 0.0}  # fmt: skip
    probe["activity"] = Activity().snapshot()
    n = 20_000
    t0 = time.thread_time()
    for _ in range(n):
        m.asked()
        with stage("dataset.next"), stage("dataset.sampling"):
            m.sampled(1e-5)
        with stage("dataset.wait_workers"), stage("dataset.handoff"):
            t = now()
        m.batch(probe, t, t, t, 4, 1)
        m.answered(64)
    main_us = (time.thread_time() - t0) * 1e6 / n
    print(f"timers alone: {worker_us:.2f} us an item in a worker, {main_us:.1f} us a batch "
          f"in the main process", flush=True)  # fmt: skip
    return {"worker_us_item": worker_us, "main_us_batch": main_us,
            "fill_off_us_item": statistics.median(off) * 1e6 / 64}  # fmt: skip


# ----------------------------------------------------------------------------- verdicts


def _drive(b, windows: int, step_s: float) -> dict:
    """Take batches (sleeping `step_s` a step) until `windows` windows have closed."""
    while True:
        b.next_batch()
        if step_s:
            time.sleep(step_s)
        if len(b._metrics.closed) >= windows:  # (metrics() would summarise it all each step)
            return b.metrics()


def verdicts(tmp: Path, windows: int, window: float) -> list[dict]:
    import torch

    from distlearn.dataset import Dataset
    from distlearn.dataset.processors import Image
    from tests.faulty_server import make_pngs, running

    index = make_pngs(tmp / "vpngs", 2000, labels=10, size=28)
    n = 200_000
    mem = Dataset({"x": torch.randn(n, 16), "y": torch.zeros(n, dtype=torch.long)})
    rows = []

    def record(name: str, want: str, m: dict) -> None:
        got = [w["verdict"] for w in m["windows"]]
        explained = [w["explained"] for w in m["windows"] if w["stall_s"] > 0]
        rows.append({"case": name, "want": want, "got": got, "explained": explained,
                     "why": [w["why"] for w in m["windows"]]})  # fmt: skip
        print(f"verdicts: {name}: {got}", flush=True)

    with running(tmp / "vpngs", {"*": ["throttle"]}, stall=0.005) as (url, _):
        ds = Dataset(url + index.name)
        with ds.sampled_batcher(batch_size=64, input_dims=(1, 28, 28), processor=Image(mode="L"),
                                workers="process", num_workers=2,
                                metrics_window=window) as b:  # fmt: skip
            record("HTTP server throttled (one answer at a time, 5 ms each)", "source",
                   _drive(b, windows, 0.0))  # fmt: skip
    from bench.metrics import Sleepy as Slow  # (by its module's name: workers unpickle it)

    with mem.sampled_batcher(batch_size=16, input_dims=(16,), processor=Slow(0.02),
                             workers="process", num_workers=2,
                             metrics_window=window) as b:  # fmt: skip
        record("processor sleeps 20 ms an item (2 process workers)", "decode",
               _drive(b, windows, 0.0))  # fmt: skip
    proc, url = _serve(tmp / "vpngs")
    try:
        ds = Dataset(url + index.name)
        with ds.sampled_batcher(batch_size=16, input_dims=(1, 28, 28), processor=Image(mode="L"),
                                workers="process", num_workers=2,
                                metrics_window=window) as b:  # fmt: skip
            record("training loop sleeps 100 ms a step of 16 PNGs over HTTP", "consumer",
                   _drive(b, windows, 0.1))  # fmt: skip
    finally:
        _stop(proc)
    from bench.metrics import _copy as copy

    big = Dataset({"x": torch.randn(50_000, 1024), "y": torch.zeros(50_000, dtype=torch.long)})
    with big.sampled_batcher(batch_size=256, input_dims=(1024,), processor=copy,
                             workers="process", num_workers=2,
                             metrics_window=window) as b:  # fmt: skip
        record("rows in memory (1024 floats) pickled to 2 process workers, batch 256",
               "workers", _drive(b, windows, 0.0))  # fmt: skip
    rows.append(ranks(tmp, windows, window))
    return rows


def ranks(tmp: Path, windows: int, window: float) -> dict:
    """Three ranks of an ipc tree; rank 1's processor slow."""
    key = f"bench-metrics-{uuid.uuid4().hex}"
    outs = [tmp / f"rank{r}.json" for r in range(3)]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "bench.metrics",
                "--rank",
                str(r),
                "--key",
                key,
                "--windows",
                str(windows),
                "--window",
                str(window),
                "--out",
                str(outs[r]),
            ],
            env=_env(),
            cwd=REPO,
        )
        for r in range(3)
    ]
    try:
        for p in procs:
            p.wait(timeout=windows * window * 3 + 120)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    got, explained = [], []
    for out in outs:
        for result in json.loads(out.read_text()):
            right = result["straggler"] == 1 and result["verdict"] == "decode"
            got.append("rank 1, decode" if right else f"{result['straggler']}, {result['verdict']}")
    print(f"verdicts: ranks: {got}", flush=True)
    return {"case": "3 ranks, an all_reduce a step; rank 1's processor sleeps 10 ms an item "
            "(each rank's view)", "want": "rank 1, decode", "got": got, "explained": explained,
            "why": []}  # fmt: skip


def rank_main(rank: int, key: str, windows: int, window: float, out: str) -> None:
    import torch

    from distlearn import ipc
    from distlearn.dataset import Dataset

    tree = ipc.LocalhostTree(rank, 3, key=key)
    n = 300_000
    ds = Dataset({"x": torch.randn(n, 16), "y": torch.zeros(n, dtype=torch.long)},
                 partition=rank, partitions=3)  # fmt: skip
    grad = torch.zeros(100_000)
    results = []
    with ds.sampled_batcher(batch_size=8, input_dims=(16,), workers="thread", num_workers=1,
                            processor=Sleepy(0.01 if rank == 1 else 0.0)) as b:  # fmt: skip
        last = time.monotonic()
        flag = torch.zeros(1)
        while len(results) < windows:
            b.next_batch()
            due = flag.item() > 0  # decided together in the step before: every rank rides
            # rank 0's clock says when a window is over; the flag rides in this step's sum
            flag = torch.tensor(
                [float(rank == 0 and not due and time.monotonic() - last >= window)]
            )
            if due:
                table = b.metrics_tensor(tree)
                tree.all_reduce([grad, flag, table])
                results.append(b.metrics(ranks=table)["ranks"])
                last = time.monotonic()
            else:
                tree.all_reduce([grad, flag])
    tree.close()
    Path(out).write_text(json.dumps(results))


# ----------------------------------------------------------------------------- report


def _mm(xs: list[float], fmt: str = "{:.0f}") -> str:
    return f"{fmt.format(statistics.median(xs))} ({fmt.format(min(xs))}-{fmt.format(max(xs))})"


NOTES = """
Notes. Whole-loader throughput on a shared machine moves by tens of percent between
trials, far more than the timers cost, so on/off ratios of throughput and CPU scatter
around 1 both ways; the timers alone, in one thread's CPU time, are what resolves their
cost. A window's `explained` is the stage times' sum over its stall, each measured apart
from the stall timer; where the loop hardly waits (the consumer case: a few ms a 10 s
window) the batcher's own bookkeeping in `next()` is a larger share of the little stall
there is.
"""


def report(over: list[dict], alone: dict | None, ver: list[dict], args, command: str) -> str:
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "# Loader metrics: their cost, and whether the verdict is right",
        "",
        f"`{command}` — {when}, {os.cpu_count()} cores shared with other work; "
        f"{args.reps} repetitions, median (min-max).",
        "",
        "## Overhead: loader throughput, metrics on against off (same run, alternating)",
        "",
        "Throughput (items/s, after the first batch) and CPU time an item (us, every thread",
        "and worker process of the loader, its start included), each as on / off per pair.",
        "",
        "| loader | off items/s | on items/s | on / off | off CPU us/item | on CPU us/item "
        "| on / off |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in over:
        ratio, cpu_ratio = _mm(r["ratio"], "{:.3f}"), _mm(r["cpu_ratio"], "{:.3f}")
        cpu_off, cpu_on = _mm(r["cpu_off"], "{:.1f}"), _mm(r["cpu_on"], "{:.1f}")
        lines.append(f"| {r['loader']} | {_mm(r['off'])} | {_mm(r['on'])} | {ratio} | "
                     f"{cpu_off} | {cpu_on} | {cpu_ratio} |")  # fmt: skip
    if alone is not None:
        w, b = alone["worker_us_item"], alone["main_us_batch"]
        lines += [
            "",
            "The timers alone, which the noise above hides: in a worker, "
            f"{w:.2f} us an item (fill() of 64 local 1 KiB files with a trivial processor, "
            f"{alone['fill_off_us_item']:.1f} us an item without them; the thread's CPU time, "
            f"{40 * args.reps} interleaved trials, medians); in the main process {b:.1f} us "
            "a batch. Against the CPU an item of the HTTP loader above with the metrics off, "
            "an item's timers and a 64th of a batch's come to "
            f"{100 * (w + b / 64) / statistics.median(over[0]['cpu_off']):.2f}%.",
        ]
    lines += [
        "",
        f"## Verdicts in {args.window:.0f} s windows",
        "",
        "| bottleneck put there | want | windows right | explained (median, min) |",
        "|---|---|---:|---:|",
    ]
    for r in ver:
        right = sum(g == r["want"] for g in r["got"])
        ex = r["explained"]
        exs = f"{100 * statistics.median(ex):.0f}%, {100 * min(ex):.0f}%" if ex else "-"
        lines.append(f"| {r['case']} | {r['want']} | {right}/{len(r['got'])} "
                     f"({100 * right / max(1, len(r['got'])):.0f}%) | {exs} |")  # fmt: skip
    lines += ["", "Each window's verdict, in order (the ranks: every rank's view of each "
              "exchange):", ""]  # fmt: skip
    for r in ver:
        lines.append(f"- {r['case']}: {'; '.join(r['got'])}")
    lines.append(NOTES)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--windows", type=int, default=6, help="windows per verdict case")
    p.add_argument("--window", type=float, default=10.0, help="seconds per window")
    p.add_argument("--out", default=str(BENCH / "RESULTS-metrics.md"))
    p.add_argument("--skip-overhead", action="store_true")
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)  # a rank of the ranks case
    p.add_argument("--key", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rank is not None:
        rank_main(args.rank, args.key, args.windows, args.window, args.out)
        return 0
    sys.path.insert(0, str(REPO))
    command = "python -m bench.metrics" + (" " + " ".join(argv or sys.argv[1:])).rstrip()
    with tempfile.TemporaryDirectory() as tmp:
        over = [] if args.skip_overhead else overhead(Path(tmp), args.reps)
        alone = None if args.skip_overhead else timers_alone(Path(tmp), 40 * args.reps)
        ver = verdicts(Path(tmp), args.windows, args.window)
    text = report(over, alone, ver, args, command)
    Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
