"""`python -m bench.mix`: what mixing costs: a mix of sources against one source, same run.

    python -m bench.mix                      # -> bench/RESULTS-mix.md
    python -m bench.mix --reps 3 --quick     # smoke, printed only

The worst case for the mix's own work: tensor rows (nothing to fetch or decode, items
copied inline), batch 256, so the loader's time is the stream's. Rows, each a rank's
batches per second over a fixed number of batches:

- one tensor source of N rows (the baseline);
- the same N rows as a mix of three tensor sources (weights 0.5/0.3/0.2, ``cycle``);
- rank 0 of 8 of each: a rank of 8 computes the allocation of the whole global batch
  (8 x 256 examples a step) and reads its 256;
- a common case: small files on disk listed by a CSV, read by 2 thread workers, one CSV
  against the same files as three CSVs mixed.

Baseline and mix alternate, repetition after repetition, in one process; figures are
medians (min-max). The machine is shared: compare the ratios, not absolute rates.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent


def _rate(make, batches: int) -> float:
    with make() as b:
        b.next_batch()  # the first batch (orders made) is not the steady state
        t0 = time.perf_counter()
        for _ in range(batches):
            b.next_batch()
        return batches / (time.perf_counter() - t0)


def measure(reps: int, quick: bool) -> list[tuple[str, list[float], list[float]]]:
    import torch

    from distlearn.dataset import Dataset, Mix

    n = 60_000 if quick else 600_000
    batches = 40 if quick else 200
    sizes = (n // 2, n * 3 // 10, n - n // 2 - n * 3 // 10)
    whole = {"x": torch.arange(float(n))[:, None], "y": torch.arange(n) % 10}
    parts, at = [], 0
    for size in sizes:
        parts.append({"x": whole["x"][at : at + size], "y": whole["y"][at : at + size]})
        at += size
    kw = dict(batch_size=256, input_dims=(1,), sampler="permutation")

    def single(rank, world):
        return lambda: Dataset(whole, rank, world).sampled_batcher(**kw)

    def mixed(rank, world):
        weights = (0.5, 0.3, 0.2)
        entries = {f"s{i}": (Dataset(p, rank, world), weights[i]) for i, p in enumerate(parts)}
        return lambda: Mix(entries, exhausted="cycle").sampled_batcher(**kw)

    rows = []
    for world in (1, 8):
        base, mix = [], []
        for _ in range(reps):
            base.append(_rate(single(0, world), batches))
            mix.append(_rate(mixed(0, world), batches))
        rows.append((f"{n:,} tensor rows, rank 0 of {world}", base, mix))
    rows.append(_files_row(reps, quick))
    return rows


def parse_int(data, opt, out):
    out[0] = float(data)
    return True


def _files_row(reps: int, quick: bool) -> tuple[str, list[float], list[float]]:
    """Small files read from disk by 2 thread workers: one CSV of them all against the
    same files as three CSVs mixed 0.5/0.3/0.2."""
    import tempfile

    from distlearn.dataset import Dataset, Mix

    n = 1_200 if quick else 6_000
    batches = 20 if quick else 60
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        lines = []
        for i in range(n):
            (root / f"{i:06d}.txt").write_text(str(i))
            lines.append(f"{i:06d}.txt,L{i % 10}")
        (root / "all.csv").write_text("filename,label\n" + "\n".join(lines) + "\n")
        cuts = (0, n // 2, n * 8 // 10, n)
        for k in range(3):
            part = lines[cuts[k] : cuts[k + 1]]
            (root / f"s{k}.csv").write_text("filename,label\n" + "\n".join(part) + "\n")
        kw = dict(batch_size=64, input_dims=(1,), sampler="permutation", processor=parse_int,
                  workers="thread", num_workers=2)  # fmt: skip

        def single():
            return Dataset(str(root / "all.csv")).sampled_batcher(**kw)

        def mixed():
            entries = {f"s{k}": (Dataset(str(root / f"s{k}.csv")), w)
                       for k, w in enumerate((0.5, 0.3, 0.2))}  # fmt: skip
            return Mix(entries, exhausted="cycle").sampled_batcher(**kw)

        base, mix = [], []
        for _ in range(reps):
            base.append(_rate(single, batches))
            mix.append(_rate(mixed, batches))
    return f"{n:,} small files (CSV), 2 thread workers, batch 64, rank 0 of 1", base, mix


def _fmt(xs: list[float]) -> str:
    return f"{statistics.median(xs):,.0f} ({min(xs):,.0f}-{max(xs):,.0f})"


def report(rows, reps: int, quick: bool) -> str:
    lines = [
        "<!-- --8<-- [start:mix] -->",
        "| what | one source (batches/s) | mix of three (batches/s) | mix / one |",
        "|---|---:|---:|---:|",
    ]
    for name, base, mix in rows:
        ratio = statistics.median(m / b for m, b in zip(mix, base, strict=True))
        lines.append(f"| {name} | {_fmt(base)} | {_fmt(mix)} | {ratio:.2f}x |")
    lines.append("<!-- --8<-- [end:mix] -->")
    head = [
        "# Mixing: a mix of three sources against one source",
        "",
        f"`python -m bench.mix --reps {reps}{' --quick' if quick else ''}`, "
        f"{datetime.date.today()}, Python {sys.version.split()[0]}, "
        f"{os.cpu_count()} cores shared with other work (load average "
        f"{os.getloadavg()[0]:.1f} at the end). Tensor rows: batch 256, nothing fetched "
        "or decoded (the mix's own work is all there is); files: batch 64 read from disk. "
        "Medians (min-max) of "
        f"{reps} repetitions, baseline and mix alternating; the ratio is the median of "
        "each repetition's.",
        "",
    ]
    return "\n".join(head + lines) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="a smoke run, printed only")
    args = ap.parse_args(argv)
    text = report(measure(args.reps, args.quick), args.reps, args.quick)
    print(text)
    if not args.quick:
        (BENCH / "RESULTS-mix.md").write_text(text)


if __name__ == "__main__":
    main()
