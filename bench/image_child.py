"""One repetition of one image row, in a fresh process: `python -m bench.image_child < SPEC`.

Prints one line, RESULT {json}, with each epoch's samples, seconds, CPU
seconds of the whole tree and of the main process alone. Epoch 1 is cold: its
clock starts before the loader is built (after imports and the row's untimed
setup), so it holds start-up, worker spawning and the first downloads. Epoch 2
is the same loader's next `for`, warm. Runs in whichever venv the row needs, so
it imports nothing beyond the rows' own needs.
"""

from __future__ import annotations

import json
import resource
import sys
import time

import torch

from bench.image_aug import SIZE
from bench.image_rows import ROWS, Ctx
from bench.procs import own_cpu_seconds


def count(batch, batch_size: int) -> int:
    """Samples in one batch; every row yields float [n, 3, SIZE, SIZE] (ceilings: counts)."""
    if isinstance(batch, int):
        return batch
    if not isinstance(batch, torch.Tensor) or batch.dtype != torch.float32:
        raise TypeError(f"row yielded {type(batch).__name__}, not a float tensor")
    if tuple(batch.shape[1:]) != (3, SIZE, SIZE) or not 0 < batch.shape[0] <= batch_size:
        raise ValueError(
            f"row yielded shape {tuple(batch.shape)}, not [<={batch_size}, 3, 224, 224]"
        )
    return batch.shape[0]


def main_cpu_seconds() -> float:
    """This process alone (its threads included), not its workers."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    return me.ru_utime + me.ru_stime


def run(spec: dict) -> dict:
    ctx = Ctx(**spec["ctx"])
    r = ROWS[spec["row"]]
    args = (ctx, r.setup(ctx)) if r.setup else (ctx,)
    epochs = []
    cpu0, main0, t0 = own_cpu_seconds(), main_cpu_seconds(), time.perf_counter()
    loader = r.make(*args, **spec.get("params", {}))
    try:
        for _ in range(spec.get("epochs", 2)):
            n = 0
            for batch in loader:
                n += count(batch, ctx.batch_size)
            cpu1, main1, t1 = own_cpu_seconds(), main_cpu_seconds(), time.perf_counter()
            epochs.append(
                {"samples": n, "s": t1 - t0, "cpu_s": cpu1 - cpu0, "main_cpu_s": main1 - main0}
            )
            cpu0, main0, t0 = cpu1, main1, t1
    finally:
        close = getattr(loader, "close", None)
        if close is not None:
            close()
    return {"epochs": epochs}


def main() -> int:
    result = run(json.load(sys.stdin))
    sys.stdout.write("RESULT " + json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
