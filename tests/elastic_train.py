"""A training job that survives, for the fault-tolerance tests: one rank of it.

    torchrun --nproc-per-node=4 tests/elastic_train.py --data D --ckpt C --ledger L ...
    srun -n 4 python tests/elastic_train.py ...            # Slurm's variables

Every rank trains a small model with AllReduceSGD on its share of the data (examples
whose features are their ids), restores and saves with distlearn.Checkpoint (model,
optimizer, the batcher's position), and writes a *ledger*: after every step's
all-reduce, the ids it trained on; after every save, the folder saved; at start, the
folder restored. The test reads the ledgers of every attempt: the steps an attempt took
before the save the next attempt restored from are committed, the ones after it were
lost with the process; over every attempt the committed ids must hold each example
exactly once per epoch.

Faults on request: ``--die-at ROUND --die-rank R`` SIGKILLs rank R of the first attempt
(the first process of rank R to write in the ledger folder) at that step;
``--stop-at ROUND`` raises the stop flag on rank 0 (as a SIGTERM would);
``--eval-s S`` spends S seconds "evaluating" after every epoch (no all-reduce);
``--save-s S`` makes every save take S seconds more on rank 0 (a large model's write),
in the middle of the save: its rank file written, the model's not yet, nothing published.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path

import torch
from torch import nn

from distlearn import AllReduceSGD, Checkpoint, preemption
from distlearn.dataset import Dataset


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--comm", choices=("ipc", "gloo"), default="ipc")
    p.add_argument("--data", required=True)
    p.add_argument("--ckpt", required=True)
    p.add_argument("--ledger", required=True)
    p.add_argument("--storage", default=None, help="fsspec storage options (JSON)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--sampler", default="permutation")
    p.add_argument("--workers", default="thread")
    p.add_argument("--num-workers", type=int, default=0)
    p.add_argument("--sleep", type=float, default=0.0, help="seconds a step")
    p.add_argument("--eval-s", type=float, default=0.0)
    p.add_argument("--save-s", type=float, default=0.0)
    p.add_argument("--die-at", type=int, default=None)
    p.add_argument("--die-rank", type=int, default=0)
    p.add_argument(
        "--die-in-drain",
        action="store_true",
        help="--die-rank dies as it ends its first epoch (the others may still step)",
    )
    p.add_argument("--stop-at", type=int, default=None)
    p.add_argument(
        "--die-when-back",
        action="store_true",
        help="a process that came back dies as soon as it has joined the grown tree",
    )
    p.add_argument(
        "--die-after-admission",
        action="store_true",
        help="a process coming back dies once its knock is answered, before it joins",
    )
    p.add_argument(
        "--admit-s",
        type=float,
        default=None,
        help="how long a growing tree waits for the processes it takes in (lobby.ADMIT_S)",
    )
    p.add_argument(
        "--hold",
        default=None,
        help="after a death, steps take 0.5 s more while this file exists (the test's "
        "harness removes it once the process started again is done)",
    )
    p.add_argument("--deterministic", action="store_true")
    p.add_argument(
        "--survive",
        action="store_true",
        help="no restart: the survivors of a death go on (distlearn.survivors)",
    )
    return p.parse_args(argv)


def make_comm(kind: str):
    if kind == "gloo":
        from distlearn.backends import TorchDistributed

        return TorchDistributed.from_env(backend="gloo", timeout=120)
    from distlearn import ipc

    return ipc.Tree.from_env(timeout=120)


def ids_of(batch) -> list[int]:
    return [int(v) for v in batch.input[:, 0].tolist()]


def part_record(record, opt, out):
    """A part-file record ``{"__key__": ..., "txt": b"<id>"}`` as its id."""
    out[0] = float(int(record["txt"]))
    return True


def joined_first(rows, opt, out):
    """A joined item (a row of each index): the first index's id."""
    out[0] = rows[0][0]
    return True


class SlowSave:
    """A replicated object (rank 0 saves it) whose state takes `seconds` to write; the
    ledger says when a save is in it."""

    def __init__(self, seconds: float, ledger: Ledger):
        self.seconds, self.ledger = seconds, ledger

    def state_dict(self) -> dict:
        self.ledger.write(saving=True)
        time.sleep(self.seconds)
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class Ledger:
    def __init__(self, folder: Path, rank: int):
        folder.mkdir(parents=True, exist_ok=True)
        self.f = open(folder / f"rank{rank}-{os.getpid()}.jsonl", "a")  # noqa: SIM115
        self.rank = rank

    def write(self, **fields) -> None:
        self.f.write(json.dumps({"rank": self.rank, "pid": os.getpid(), "t": time.time(),
                                 **fields}) + "\n")  # fmt: skip
        self.f.flush()
        os.fsync(self.f.fileno())


def main(argv=None) -> int:
    args = parse(argv)
    if args.deterministic:
        torch.use_deterministic_algorithms(True)
        torch.set_num_threads(1)
    if args.admit_s is not None:
        from distlearn.ipc.rendezvous import lobby

        lobby.Lobby.admit_s = args.admit_s
    if args.die_after_admission:  # the fault, around the library's own knock
        from distlearn.ipc.rendezvous import lobby

        knock = lobby.Lobby.knock

        def knock_and_die(self, rank):
            knock(self, rank)
            os.kill(os.getpid(), signal.SIGKILL)

        lobby.Lobby.knock = knock_and_die
    comm = make_comm(args.comm)
    if args.die_when_back and getattr(comm, "came_back", False):
        os.kill(os.getpid(), signal.SIGKILL)
    rank, world = comm.node_index, comm.num_nodes
    opts: dict = {}
    processor, data = None, args.data
    if "," in data:  # a joined index, aligned: the first one's id
        data, processor = data.split(","), joined_first
    elif not data.endswith(".pt"):
        opts["cache_parts"] = False
        processor = part_record
        if args.storage:
            opts["storage_options"] = json.loads(args.storage)
    ds = Dataset(data, partition=rank, partitions=world, **opts)
    batcher = ds.sampled_batcher(batch_size=args.batch, input_dims=(1,), sampler=args.sampler,
                                 processor=processor, workers=args.workers,
                                 num_workers=args.num_workers, seed=7)  # fmt: skip
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    if args.survive:
        return survive(args, comm, batcher, model, opt, Ledger(Path(args.ledger), rank))
    sgd = AllReduceSGD(comm)
    storage = json.loads(args.storage) if args.storage else None
    ckpt = Checkpoint(args.ckpt, comm, keep=3, every=args.every, storage_options=storage)
    # The first attempt is the one no earlier process of this rank wrote a ledger for
    # (not "restored nothing": a kill before the first save restores nothing either, and
    # the restart would die at the same step again).
    first_attempt = not any(Path(args.ledger).glob(f"rank{rank}-*.jsonl"))
    ledger = Ledger(Path(args.ledger), rank)
    state = {"model": model, "optim": opt, "data": batcher}
    if args.save_s:
        state["slow"] = SlowSave(args.save_s, ledger)
    step = ckpt.restore(state) or 0
    ledger.write(start=True, world=world, restored=ckpt.restored_from, step=step,
                 restart=os.environ.get("TORCHELASTIC_RESTART_COUNT"),
                 slurm_restart=os.environ.get("SLURM_RESTART_COUNT"))  # fmt: skip
    sgd.synchronize_parameters(model, opt)
    try:
        while True:
            position = batcher.state_dict()
            if position["epoch"] >= args.epochs and not position["rest"]:
                break
            for batch in batcher:
                x = batch.input / 100.0
                loss = (model(x) - x.sin()).square().mean()
                opt.zero_grad()
                loss.backward()
                sgd.sum_and_normalize_gradients(model)
                opt.step()
                step += 1
                ledger.write(step=step, ids=ids_of(batch), loss=loss.item())
                rounds = preemption.exchanges()
                if first_attempt and args.die_at == rounds and rank == args.die_rank:
                    os.kill(os.getpid(), signal.SIGKILL)
                if args.stop_at == rounds and rank == 0:
                    preemption.request("--stop-at")
                before = ckpt.last_saved
                try:
                    ckpt.step(step, state)
                finally:
                    if ckpt.last_saved != before:
                        ledger.write(saved=ckpt.last_saved, step=step)
                if args.sleep:
                    time.sleep(args.sleep)
            sgd.synchronize_parameters(model, opt)
            if args.eval_s:
                ledger.write(evaluating=batcher.epoch)
                time.sleep(args.eval_s)  # an evaluation: no collective
        ledger.write(saved=ckpt.save(step, state), step=step)  # the end: a rerun has nothing to do
        ledger.write(done=True, step=step)
    finally:
        batcher.close()
    comm.close()
    return 0


def survive(args, comm, batcher, model, opt, ledger) -> int:
    """The loop without restarts: a death is survived in place (distlearn.survivors)."""
    from distlearn.survivors import Survivors

    job = Survivors(comm, model, opt, batcher)
    ledger.write(start=True, world=job.comm.num_nodes, restored=None, step=0,
                 came_back=job.came_back)  # fmt: skip
    step, first = 0, comm.node_index
    while True:
        position = batcher.state_dict()
        if position["epoch"] >= args.epochs and not position["rest"]:
            break
        for batch in batcher:

            def closure(batch=batch):
                opt.zero_grad()
                x = batch.input / 100.0
                loss = (model(x) - x.sin()).square().mean()
                loss.backward()
                return loss

            # the parameters the step starts from, and the tree's generation (a rank that
            # came back starts from the root's)
            gen = job.comm.generation
            digest = sum(float(p.detach().double().sum()) for p in model.parameters())
            loss = job.step(closure)
            step += 1
            ledger.write(step=step, ids=ids_of(batch), loss=None if loss is None else loss.item(),
                         world=job.comm.num_nodes, gen=gen, digest=digest)  # fmt: skip
            if args.die_at == step and first == args.die_rank and not job.deaths \
                    and not job.came_back:  # fmt: skip
                os.kill(os.getpid(), signal.SIGKILL)
            if args.sleep:
                time.sleep(args.sleep)
            if args.hold and job.deaths and os.path.exists(args.hold):
                time.sleep(0.5)  # the job is still there when the process started again knocks
        if args.die_in_drain and first == args.die_rank and not job.deaths and not job.came_back:
            os.kill(os.getpid(), signal.SIGKILL)
        job.end_epoch()
    ledger.write(done=True, step=step, deaths=job.deaths, comebacks=job.comebacks,
                 came_back=job.came_back, world=job.comm.num_nodes)  # fmt: skip
    batcher.close()
    job.comm.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
