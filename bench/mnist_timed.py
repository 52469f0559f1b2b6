"""examples/mnist.py with per-phase timers, for the bench's training row.

    python examples/launch.py --script bench/mnist_timed.py --nodes N --epochs 1 ...

The same training as examples/mnist.py (its AllReduceSGD algorithm, options and
loop), timed through the loop's public hooks: a forward pre-hook on the model
marks the end of waiting for a batch, `after_backward` brackets the gradient
allreduce, `after_step` ends the optimizer step. Per step:

    loading   = previous step's end (or start) -> forward begins
    compute   = forward + backward + optimizer step
    allreduce = sum_and_normalize_gradients (+ the epoch-end synchronize): with
                buckets sent during backward, the wait for what has not arrived

$BENCH_DDP=1 (with --backend gloo) trains with torch's DistributedDataParallel
instead, timed the same way, so the allreduce share has a reference measured on
the same machine: its all-reduce runs inside backward, so its phase runs from
the moment its gradient bucket is ready (DDP's comm hook is called, the moment
AllReduceSGD's one bucket would leave) to the end of backward (DDP waits there
and copies the mean back into `.grad`). DDP needs every rank to take the same
number of steps: examples/mnist.py's 60,000 items split evenly over 2 or 4.

Each rank writes its totals to $BENCH_PHASES_DIR/rank{RANK}.json, with the moments
(time.perf_counter: CLOCK_MONOTONIC, one clock for every process of a host) each
step began loading, began its forward, entered and left sum_and_normalize_gradients,
from which bench/training.py splits the allreduce phase into waiting for the last
rank to arrive and the rest, and the waiting into what made the last rank late.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
sys.path.insert(0, str(EXAMPLES))

import mnist  # noqa: E402  (examples/ is a folder of scripts, not a package)


def _cpu_jiffies() -> tuple[int, int] | None:
    """(idle, total) jiffies of every core of the host since boot (/proc/stat), or None."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return fields[3] + fields[4], sum(fields[:8])  # idle + iowait; user .. steal


class TimedSGD(mnist.SGD):
    """examples/mnist.py's AllReduceSGD with timers around each phase of a step.

    $BENCH_OVERLAP=0 turns off the buckets during backward (AllReduceSGD's
    overlap=False: one all-reduce after backward), for before/after figures;
    $BENCH_FIRST_BUCKET_BYTES sets AllReduceSGD's first_bucket_bytes.
    """

    def __init__(self, **options):
        options["overlap"] = os.environ.get("BENCH_OVERLAP", "1") != "0"
        if os.environ.get("BENCH_FIRST_BUCKET_BYTES"):
            options["first_bucket_bytes"] = int(os.environ["BENCH_FIRST_BUCKET_BYTES"])
        super().__init__(**options)

    def start(self, comm, model):
        self.phases = {"loading_s": 0.0, "compute_s": 0.0, "allreduce_s": 0.0}
        self.steps = 0
        self.began: list[float] = []  # per step: the previous step ended (loading begins)
        self.fwd: list[float] = []  # the batch arrived (forward begins)
        self.entered: list[float] = []  # sum_and_normalize_gradients called
        self.left: list[float] = []  # and returned
        self.training = True
        t0 = time.perf_counter()
        self._start_algorithm(comm, model)
        # the first synchronize also waits for the slowest rank to start: set-up, not the epoch
        self.setup_sync_s = time.perf_counter() - t0
        model.register_forward_pre_hook(self._before_forward)
        self.t_start = self.last = time.perf_counter()
        self.cpu_start = time.process_time()
        self.jiffies_start = _cpu_jiffies()

    def _start_algorithm(self, comm, model):
        super().start(comm, model)

    def _before_forward(self, module, inputs):
        if self.training:  # evaluation forwards are not part of the epoch's phases
            self.t_fwd = time.perf_counter()
            self.phases["loading_s"] += self.t_fwd - self.last
            self.began.append(self.last)
            self.fwd.append(self.t_fwd)

    def after_backward(self, model):
        entered = self._reduce(model)
        self.t_reduced = time.perf_counter()
        self.phases["compute_s"] += entered - self.t_fwd
        self.phases["allreduce_s"] += self.t_reduced - entered
        self.entered.append(entered)
        self.left.append(self.t_reduced)

    def _reduce(self, model) -> float:
        """The gradient all-reduce; returns when it began (the loop's call)."""
        t0 = time.perf_counter()
        super().after_backward(model)
        return t0

    def after_step(self, model):
        t0 = time.perf_counter()
        self.phases["compute_s"] += t0 - self.t_reduced
        super().after_step(model)
        self.steps += 1
        self.last = time.perf_counter()

    def end_epoch(self, model):
        t0 = time.perf_counter()
        evaluated = self._end_epoch(model)
        t1 = time.perf_counter()
        cpu_s = time.process_time() - self.cpu_start
        jiffies = _cpu_jiffies()
        idle = None
        if jiffies and self.jiffies_start and jiffies[1] > self.jiffies_start[1]:
            idle = (jiffies[0] - self.jiffies_start[0]) / (jiffies[1] - self.jiffies_start[1])
        self.phases["allreduce_s"] += t1 - t0
        self.training = False
        out = os.environ.get("BENCH_PHASES_DIR")
        if out:
            rank = int(os.environ.get("RANK", "0"))
            record = {**self.phases, "steps": self.steps, "epoch_s": t1 - self.t_start,
                      "cpu_s": cpu_s, "host_idle": idle,
                      "setup_sync_s": self.setup_sync_s, "began": self.began, "fwd": self.fwd,
                      "entered": self.entered, "left": self.left,
                      "buckets": self._buckets()}  # fmt: skip
            Path(out, f"rank{rank}.json").write_text(json.dumps(record))
        return evaluated

    def _end_epoch(self, model):
        return super().end_epoch(model)

    def _buckets(self) -> dict:
        """How this rank's gradients travelled: buckets per step, and how many of them
        left during backward (AllReduceSGD.stats; none: one all-reduce after backward)."""
        stats = self.sgd.stats
        if not stats["modules"]:
            return {"buckets": 0, "in_backward_per_step": 0.0}
        mod = stats["modules"][0]
        return {
            "buckets": len(mod["bucket_bytes"]),
            "bucket_bytes": mod["bucket_bytes"],
            "in_backward_per_step": mod["started_in_backward"] / max(1, mod["steps"]),
        }


class TimedDDP(TimedSGD):
    """DistributedDataParallel (its defaults, the built-in all-reduce's C++ path aside)
    in the example's loop, with TimedSGD's timers: the reference for the allreduce
    share. The loop calls `model(x)`, so the model's own forward goes through DDP's."""

    name = "DistributedDataParallel"

    def start(self, comm, model):
        import torch.distributed as dist
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        if not dist.is_initialized():
            raise SystemExit("BENCH_DDP=1 needs --backend gloo (a torch.distributed group)")
        self.ddp = ddp = torch.nn.parallel.DistributedDataParallel(model)  # broadcasts
        forward = model.forward

        def ddp_forward(*args, **kwargs):
            # DDP.forward without its call of the module (which would come back here)
            args, kwargs = ddp._pre_forward(*args, **kwargs)
            return ddp._post_forward(forward(*args, **kwargs))

        model.forward = ddp_forward
        self.t_ready = 0.0

        def hook(state, bucket):
            # this rank's gradients (a bucket of them) are ready: its all-reduce begins
            self.t_ready = time.perf_counter()
            return default_hooks.allreduce_hook(state, bucket)

        ddp.register_comm_hook(None, hook)
        super().start(comm, model)

    def _start_algorithm(self, comm, model):
        pass  # DDP's constructor gave every rank rank 0's parameters

    def _reduce(self, model) -> float:
        return self.t_ready  # DDP waited for it at the end of backward

    def _end_epoch(self, model):
        return model  # DDP's ranks are in step (they must take the same steps)

    def _buckets(self) -> dict:
        return {}


def main(argv: list[str] | None = None) -> int:
    # mnist.main builds its algorithm from the module's `SGD` when it runs: point that
    # at the timed subclass, so the example's own options and defaults stay in force
    mnist.SGD = TimedDDP if os.environ.get("BENCH_DDP") == "1" else TimedSGD
    return mnist.main(argv)


if __name__ == "__main__":
    sys.exit(main())
