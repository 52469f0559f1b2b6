"""`python -m bench`: distlearn against the loaders and collectives users would pick instead.

    python -m bench                 # full suite -> bench/RESULTS.md, bench/results.png
    python -m bench --quick         # smoke: smaller sweep, 4,000 samples -> bench/out/
    python -m bench --only loaders  # or allreduce, training

Every loader row runs in a fresh process per repetition, against one HTTP server
(nginx when installed) over the same data; repetitions go round all rows in turn,
alternating direction, so a noisy neighbour slows every row alike. Each figure is
the median of the repetitions, with min and max. Ratios are what to compare:
absolute figures drift with the machine's load, ratios taken side by side do not.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench import allreduce, report
from bench.data import prepare
from bench.loaders import Ctx, shard_pattern
from bench.procs import MemorySampler, kill_group
from bench.servers import Server, ensure_nginx

log = logging.getLogger("bench")
BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent


@dataclass
class Row:
    """One configuration to measure: a loader row name and its parameters."""

    group: str  # ceiling | peer | distlearn
    row: str
    params: dict = field(default_factory=dict)
    label: str = ""

    def __post_init__(self):
        if not self.label:
            args = ", ".join(f"{k}={v}" for k, v in self.params.items())
            self.label = f"{self.row}({args})" if args else self.row


def have_dataset(part_url: str | None = None) -> str | None:
    """None when our loader is importable (and opens `part_url` as part files), else why not."""
    try:
        from distlearn import dataset
        from distlearn.dataset import processors  # noqa: F401
    except ImportError as err:
        return f"dataset loader not available yet ({err})"
    if not hasattr(dataset, "Dataset"):
        return "dataset.Dataset not available yet"
    if part_url:
        try:  # opening is cheap (a brace pattern needs no listing); reading starts later
            dataset.Dataset(part_url, cache_parts=False)
        except Exception as err:
            return f"Dataset({part_url!r}) raised {type(err).__name__}: {err}"
    return None


def loader_rows(quick: bool, part_url: str) -> tuple[list[Row], list[str]]:
    """The loader rows for this mode, and notes on rows skipped because a piece is missing.

    Quick mode keeps one setting per peer (the best of full runs on a 2-core
    machine), the two ceilings the targets use, and fewer distlearn settings.
    """
    if quick:
        rows = [
            Row("ceiling", "pil-decode"),
            Row("ceiling", "aiohttp", {"procs": 2, "decode": True}),
            Row("peer", "dataloader-requests", {"num_workers": 8}),
            Row("peer", "webdataset", {"num_workers": 4}),
        ]
    else:
        rows = [Row("ceiling", "pil-decode")]
        rows += [
            Row("ceiling", "aiohttp", {"procs": p, "decode": d})
            for p in (1, 2)
            for d in (False, True)
        ]
        rows += [Row("peer", "dataloader-requests", {"num_workers": w}) for w in (2, 4, 8)]
        rows += [Row("peer", "webdataset", {"num_workers": w}) for w in (2, 4)]
    notes = []
    why = have_dataset()
    if why:
        notes.append(f"distlearn Dataset rows skipped: {why}")
    else:
        rows.append(Row("distlearn", "dataset-csv", label="dataset-csv(defaults)"))
        pools = (64,) if quick else (16, 64)
        for workers in ("thread", "process"):
            rows += [
                Row("distlearn", "dataset-csv", {"workers": workers, "pool_size": p}) for p in pools
            ]
        if not quick:  # small items: decoded on the fetch thread, no hand-off (examples/)
            rows.append(
                Row("distlearn", "dataset-csv", {"workers": "thread", "pool_size": 64,
                                                 "num_workers": 0})
            )  # fmt: skip
    why = have_dataset(part_url)
    if why:
        notes.append(f"distlearn tar-shard rows skipped: {why}")
    else:
        rows.append(Row("distlearn", "dataset-shards", label="dataset-shards(defaults)"))
        if not quick:
            rows += [
                Row("distlearn", "dataset-shards", {"workers": w}) for w in ("thread", "process")
            ]
    return rows, notes


def run_child(spec: dict, server: Server, timeout: float) -> dict:
    """One repetition of one row in a fresh process, with its memory sampled from outside."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    cpu_server0 = server.cpu_seconds()
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.child"],
        env=env,
        stdin=subprocess.PIPE,  # the spec: 20,000 URLs are too long for one argv string
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        with MemorySampler(proc.pid) as mem:
            out, err = proc.communicate(json.dumps(spec), timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        return {"error": f"timed out after {timeout:.0f}s"}
    finally:
        kill_group(proc)  # workers a row left behind die with it
    result_line = next((ln for ln in reversed(out.splitlines()) if ln.startswith("RESULT ")), None)
    if proc.returncode != 0 or result_line is None:
        tail = (err or out).strip().splitlines()[-6:]
        return {"error": f"exit {proc.returncode}: " + " | ".join(tail)}
    result = json.loads(result_line[len("RESULT ") :])
    result["peak_rss_mib"] = mem.peak_rss_kib / 1024
    result["peak_pss_mib"] = mem.peak_pss_kib / 1024
    result["server_cpu_pct"] = 100.0 * (server.cpu_seconds() - cpu_server0) / result["elapsed_s"]
    return result


def run_loaders(args, data, emit) -> list[dict]:
    items = data.items()
    if args.server != "serve" and not args.quick and not args.no_install:
        ensure_nginx()
    with Server(data.root, kind=args.server, workers=args.server_workers) as server:
        emit({"kind": "server", "text": server.describe(), "url": server.url})
        log.info("serving %s with %s at %s", data.root, server.describe(), server.url)
        ctx = Ctx(
            base_url=server.url,
            root=str(data.root),
            files=[f for f, _ in items],
            labels=[lab for _, lab in items],
            shards=data.shards,
            batch_size=args.batch_size,
        )
        rows, notes = loader_rows(args.quick, shard_pattern(ctx))
        if args.rows:
            rows = [r for r in rows if any(pat in r.label for pat in args.rows)]
        for note in notes:
            log.warning(note)
            emit({"kind": "note", "text": note})
        results: dict[str, list[dict]] = {r.label: [] for r in rows}
        for rep in range(args.reps):
            order = rows if rep % 2 == 0 else rows[::-1]
            for r in order:
                spec = {"row": r.row, "params": r.params, "ctx": asdict(ctx)}
                res = run_child(spec, server, args.row_timeout)
                results[r.label].append(res)
                if "error" in res:
                    log.warning("rep %d %s: %s", rep + 1, r.label, res["error"])
                else:
                    log.info(
                        "rep %d %-44s %8.0f samples/s (%6.0f with start-up), first batch %.2fs",
                        rep + 1, r.label, res["rate_excl"], res["rate_incl"], res["ttfb_s"],
                    )  # fmt: skip
    out = []
    for r in rows:
        reps = results[r.label]
        ok = [x for x in reps if "error" not in x]
        rec = {
            "kind": "loader",
            "group": r.group,
            "row": r.row,
            "params": r.params,
            "label": r.label,
        }
        if not ok:
            rec["error"] = reps[0]["error"] if reps else "not run"
        else:
            rec["reps"] = ok
            rec["samples"] = ok[0]["samples"]
            rec.update(report.summarize(ok))
            if len(ok) < len(reps):
                rec["failed_reps"] = len(reps) - len(ok)
        emit(rec)
        out.append(rec)
    return out


def run_allreduce(args, emit) -> list[dict]:
    sizes = allreduce.SIZES if not args.allreduce_sizes else {
        k: v for k, v in allreduce.SIZES.items() if k in args.allreduce_sizes
    }  # fmt: skip
    out = []
    for world in args.worlds:
        log.info("allreduce, %d processes: %s", world, ", ".join(sizes))
        try:
            recs = allreduce.run(world, sizes, reps=args.reps, target_s=args.allreduce_target_s)
        except (RuntimeError, TimeoutError) as err:
            log.warning("allreduce with %d processes failed: %s", world, err)
            rec = {"kind": "allreduce", "world": world, "error": str(err)[-2000:]}
            emit(rec)
            out.append(rec)
            continue
        for rec in recs:
            rec = {"kind": "allreduce", "world": world, **rec}
            if "times_s" in rec:
                rec.update(report.summarize_times(rec["times_s"], rec["bytes"], world))
                log.info(
                    "  %-4s %-6s %9.3f ms/op  algbw %7.1f MB/s",
                    rec["impl"], rec["size"], rec["median_s"] * 1e3, rec["algbw_MBps"],
                )  # fmt: skip
            else:
                log.warning("  %s: %s", rec["impl"], rec["error"])
            emit(rec)
            out.append(rec)
    return out


def run_data_and_loaders(args, emit) -> list[dict]:
    source = "synthetic" if args.synthetic else args.data
    # one folder per size, so quick and full runs do not rebuild each other's data
    name = f"{'synthetic' if args.synthetic else 'www'}-{args.samples}"
    data = prepare(
        Path(args.data_dir) / name, args.samples, source=args.data, synthetic=args.synthetic
    )
    emit({"kind": "data", "source": data.source, "samples": data.n, "bytes": data.bytes,
          "shards": len(data.shards), "requested": source})  # fmt: skip
    return run_loaders(args, data, emit)


def run_training(args, emit) -> list[dict]:
    from bench import training

    return training.run(args, emit)


PARTS = {"loaders": run_data_and_loaders, "allreduce": run_allreduce, "training": run_training}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="small sweep, fewer samples (CI smoke)")
    p.add_argument("--only", nargs="+", choices=("loaders", "allreduce", "training"))
    p.add_argument("--data", help="source folder (labels = sub-folders) or CSV; default MNIST")
    p.add_argument("--synthetic", action="store_true", help="drawn digits instead of MNIST")
    p.add_argument("--samples", type=int, help="samples per epoch (default 20000; quick 4000)")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--reps", type=int, default=3, help="repetitions per row (median, min, max)")
    p.add_argument("--rows", nargs="+", help="only loader rows whose label contains one of these")
    p.add_argument("--server", choices=("auto", "nginx", "serve"), default="auto")
    p.add_argument(
        "--no-install",
        action="store_true",
        help="full mode installs nginx via apt-get when missing and root; not with this",
    )
    p.add_argument("--server-workers", type=int, default=1, help="nginx worker processes")
    p.add_argument("--row-timeout", type=float, default=300.0)
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4], help="allreduce process counts")
    p.add_argument("--allreduce-sizes", nargs="+", help=f"subset of {list(allreduce.SIZES)}")
    p.add_argument("--allreduce-target-s", type=float, help="seconds per timed repetition")
    p.add_argument(
        "--train-nodes",
        type=int,
        nargs="+",
        default=[1, 2, 4],
        help="process counts for the training row",
    )
    p.add_argument(
        "--train-backends",
        nargs="+",
        choices=("ipc", "gloo"),
        default=["ipc"],
        help="communicators for the training row (mnist.py --backend)",
    )
    p.add_argument(
        "--train-reps",
        type=int,
        help="repetitions of each training job (default --reps; quick mode 1)",
    )
    p.add_argument("--train-timeout", type=float, default=900.0, help="seconds per training job")
    p.add_argument(
        "--report-from",
        metavar="JSONL",
        help="only rebuild RESULTS.md and the chart from a results.jsonl",
    )
    p.add_argument("--data-dir", default=str(BENCH / "data"), help="where prepared data goes")
    p.add_argument(
        "--out-dir", help="results folder (default: bench/ in full mode, bench/out quick)"
    )
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.samples is None:
        args.samples = 4000 if args.quick else 20000
    if args.train_reps is None:
        args.train_reps = 1 if args.quick else args.reps
    if args.allreduce_target_s is None:
        args.allreduce_target_s = 0.15 if args.quick else 0.5
    if args.out_dir is None:
        args.out_dir = str(BENCH / "out") if args.quick else str(BENCH)
    if args.reps < 1:
        p.error("--reps must be >= 1")
    return args


def write_report(records: list[dict], args, elapsed: float, out_dir: Path) -> list[dict]:
    """RESULTS.md and results.png in `out_dir` from the records; prints the targets."""
    machine = next(r["machine"] for r in records if r.get("kind") == "run")
    checks = [r for r in records if r.get("kind") == "target"] or report.check_targets(records)
    (out_dir / "RESULTS.md").write_text(report.markdown(records, checks, machine, args, elapsed))
    chart = report.chart(records, out_dir / "results.png")
    print(report.targets_text(checks))
    log.info("wrote %s%s", out_dir / "RESULTS.md", f" and {chart}" if chart else "")
    return checks


def rerender(path: str, out_dir: str | None) -> int:
    """Rebuild the report from a results.jsonl, e.g. after the run was cut short."""
    records = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    run = next((r for r in records if r.get("kind") == "run"), None)
    if run is None:
        raise SystemExit(f"{path}: no run record; not a bench results.jsonl")
    args = parse_args(run["argv"])
    out = Path(out_dir or args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    done = next((r for r in records if r.get("kind") == "done"), {})
    write_report(records, args, done.get("elapsed_s", float("nan")), out)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    # SIGTERM unwinds like Ctrl-C, so the server and every row's processes are stopped
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    if args.report_from:
        return rerender(args.report_from, args.out_dir if "--out-dir" in args.argv else None)
    only = set(args.only or ("loaders", "allreduce", "training"))
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # raw JSON lines never go into the committed bench/ folder itself
    jsonl = (BENCH / "out" if out_dir.resolve() == BENCH else out_dir) / "results.jsonl"
    jsonl.parent.mkdir(parents=True, exist_ok=True)
    started = time.time()
    machine = report.machine()
    records: list[dict] = []
    with open(jsonl, "w") as f:

        def emit(rec: dict) -> None:
            """Every record goes to the JSON lines as it comes, and to the report at the end."""
            records.append(rec)
            f.write(json.dumps(rec) + "\n")
            f.flush()

        mode = "quick" if args.quick else "full"
        emit({"kind": "run", "mode": mode, "argv": args.argv, "machine": machine})
        for part in ("loaders", "allreduce", "training"):
            if part not in only:
                continue
            try:  # a part that breaks must not cost the figures of the others
                PARTS[part](args, emit)
            except Exception as err:
                log.exception("%s failed", part)
                emit({"kind": "note", "text": f"{part} failed: {type(err).__name__}: {err}"})
        for c in report.check_targets(records):
            emit({"kind": "target", **c})
        elapsed = time.time() - started
        emit({"kind": "done", "elapsed_s": elapsed})
    write_report(records, args, elapsed, out_dir)
    log.info("raw figures in %s; %.0f s in all", jsonl, elapsed)
    return 0
