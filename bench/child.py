"""One repetition of one loader row, in a fresh process: `python -m bench.child < SPEC_JSON`.

Prints one JSON line, prefixed RESULT, with the row's counts and clocks. Clocks:
`t_start` is taken after imports and untimed setup, just before the loader is
built; `ttfb` is from there to the first batch; the steady rate counts the
samples after the first batch over the time after it, the rate with start-up
counts all samples over the whole time. CPU seconds cover this process and
every worker it started, over the same window.
"""

from __future__ import annotations

import json
import sys
import time

import torch

from bench.loaders import ROWS, SETUP, Ctx
from bench.procs import own_cpu_seconds


def check_batch(b, batch_size: int) -> int:
    """The sample count of one batch; every row must yield float [n, 1, 28, 28]."""
    if isinstance(b, int):
        return b
    if (
        not isinstance(b, torch.Tensor)
        or b.dtype != torch.float32
        or tuple(b.shape[1:])
        != (
            1,
            28,
            28,
        )
    ):
        raise TypeError(
            f"row yielded {type(b).__name__} {getattr(b, 'shape', '')}, not float [n,1,28,28]"
        )
    if not 0 < b.shape[0] <= batch_size:
        raise ValueError(f"batch of {b.shape[0]} > batch_size {batch_size}")
    return b.shape[0]


def run(spec: dict) -> dict:
    ctx = Ctx(**spec["ctx"])
    name, params = spec["row"], spec.get("params", {})
    prepared = SETUP[name](ctx) if name in SETUP else None
    args = (ctx, prepared) if name in SETUP else (ctx,)
    cpu0 = own_cpu_seconds()
    t_start = time.perf_counter()
    it = ROWS[name](*args, **params)
    n = batches = n_first = 0
    t_first = None
    for b in it:
        n += check_batch(b, ctx.batch_size)
        batches += 1
        if t_first is None:
            t_first = time.perf_counter()
            n_first = n
    t_end = time.perf_counter()
    cpu = own_cpu_seconds() - cpu0
    if t_first is None:
        raise RuntimeError(f"row {name} yielded no batch")
    steady = t_end - t_first
    return {
        "samples": n,
        "batches": batches,
        "ttfb_s": t_first - t_start,
        "elapsed_s": t_end - t_start,
        "rate_incl": n / (t_end - t_start),
        "rate_excl": (n - n_first) / steady if steady > 0 and n > n_first else float("nan"),
        "cpu_s": cpu,
        "cpu_pct": 100.0 * cpu / (t_end - t_start),
    }


def main() -> int:
    spec = json.load(sys.stdin)
    result = run(spec)
    sys.stdout.write("RESULT " + json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
