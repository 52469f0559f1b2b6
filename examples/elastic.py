"""MNIST on 4 processes, one of them killed mid-epoch: the other 3 take over its examples
and finish, with no restart, every training example used exactly once an epoch.

    examples/elastic.sh                          # 4 processes, rank 1 SIGKILLed at step 300
    examples/elastic.sh --kill-at 50 --kill-rank 0 --quick
    examples/elastic.sh --come-back              # ... and started again: it rejoins

The loop is examples/mnist.py's with distlearn.survivors.Survivors in place of
AllReduceSGD: `job.step(closure)` sums the gradients and steps the optimizer, and when a
rank has died the survivors re-form the tree, take up what it had not trained on, and
redo the step. With --come-back the launcher starts the killed process again: it
finds the running job, is taken in at its next step with the root's parameters and a
share of the rest of the epoch, and the job ends on 4 processes. Every process writes
the names of the examples it trained on (a ledger, in the run's folder); at the end
rank 0 reads them all and says whether every training example was used exactly once in
each epoch, then prints the test accuracy.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from collections import Counter
from pathlib import Path

import mnist_lib
import torch
import torch.nn.functional as F

from distlearn.dataset import Dataset
from distlearn.dataset.processors import Image
from distlearn.state import share_bytes
from distlearn.survivors import Survivors


def main(argv: list[str] | None = None) -> int:
    p = mnist_lib.parser(__doc__.split("\n")[0], lr=0.05, epochs=4, batch_size=32)
    g = p.add_argument_group("the fault")
    g.add_argument(
        "--kill-at",
        type=int,
        default=300,
        help="the step at which --kill-rank is SIGKILLed (0: none; default 300)",
    )
    g.add_argument("--kill-rank", type=int, default=1, help="default %(default)s")  # fmt: skip
    g.add_argument(
        "--come-back",
        action="store_true",
        help="the launcher starts the killed process again; it rejoins the running job",
    )
    args = p.parse_args(argv)
    if args.backend != "ipc":
        p.error("--backend gloo cannot re-form without a dead rank: this example is the tree's")
    if args.check_args:
        return 0
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    if args.quick:
        args.epochs = 1
    mnist_lib.check_data(args.data_url)
    started = time.perf_counter()
    comm = mnist_lib.connect(args)
    node, nodes = comm.node_index, comm.num_nodes
    loader, threads = mnist_lib.loader_plan(args, nodes)
    torch.set_num_threads(threads)
    torch.manual_seed(args.seed)
    process = Image(mode="L", mean=mnist_lib.MEAN, std=mnist_lib.STD)
    train = Dataset(mnist_lib.join(args.data_url, "train.csv"), partition=node,
                    partitions=nodes).sampled_batcher(
        batch_size=args.batch_size, input_dims=(1, 28, 28), sampler="permutation",
        processor=process, seed=args.seed, prefetch=args.prefetch, **loader)  # fmt: skip
    items = len(Dataset(mnist_lib.join(args.data_url, "train.csv"), partition=0, partitions=1))
    steps_per_epoch = len(train)
    model = mnist_lib.Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    schedule = mnist_lib.Schedule(args.lr, steps_per_epoch * args.epochs,
                                  round(args.warmup * steps_per_epoch))  # fmt: skip
    job = Survivors(comm, model, optimizer, train)
    # rank 0 makes the run's folder; every process writes its ledger there (a process that
    # came back has it from the launcher: the others are past this point)
    if job.came_back:
        if not args.output:
            p.error("--come-back: the launcher gives every process --output")
        folder = Path(args.output)
    else:
        folder = args.output or (mnist_lib.run_folder("elastic.py") if node == 0 else None)
        folder = Path(share_bytes(comm, str(folder).encode() if node == 0 else None).decode())
    (folder / "ledger").mkdir(parents=True, exist_ok=True)
    ledger = open(folder / "ledger" / f"rank{node}-{os.getpid()}.txt", "a")  # noqa: SIM115
    if node == 0:
        print(f"elastic.py: AllReduceSGD that survives, {mnist_lib.plural(nodes, 'process')}, "
              f"batch {args.batch_size} x {nodes}, rank {args.kill_rank} killed at step "
              f"{args.kill_at}", flush=True)  # fmt: skip
    step, first_rank = 0, node
    try:
        while True:
            position = train.state_dict()
            if position["epoch"] >= args.epochs and not position["rest"]:
                break
            epoch, t0 = position["epoch"] + 1, time.perf_counter()
            for batch in train:
                for group in optimizer.param_groups:
                    group["lr"] = schedule(job.steps)  # the job's step: one that came back too

                def closure(batch=batch):
                    optimizer.zero_grad()
                    loss = F.cross_entropy(model(batch.input), batch.target)
                    loss.backward()
                    return loss

                job.step(closure)
                ledger.write("".join(f"{train.epoch} {url}\n" for url in batch.urls))
                ledger.flush()
                step += 1
                if step == args.kill_at and first_rank == args.kill_rank and not job.came_back:
                    os.kill(os.getpid(), signal.SIGKILL)  # the fault: no goodbye
            job.end_epoch()
            result = mnist_lib.evaluate(model, test_batches(args, job, loader, process),
                                        job.comm, None)  # fmt: skip
            if job.comm.node_index == 0:
                print(f"epoch {epoch}: test accuracy {100 * result['test_accuracy']:.2f}%, "
                      f"{job.comm.num_nodes} processes, {time.perf_counter() - t0:.0f} s",
                      flush=True)  # fmt: skip
        ledger.close()
        job.comm.barrier()  # every ledger is complete
        if job.comm.node_index == 0:
            for death in job.deaths:
                print(f"rank {death['dead']} died; {death['world'][1]} ranks took over its "
                      f"examples in {death['seconds']:.2f} s", flush=True)  # fmt: skip
            for back in job.comebacks:
                print(f"a process came back; {back['world'][1]} ranks go on from the same step "
                      f"(taken in in {back['seconds']:.2f} s)", flush=True)  # fmt: skip
            print(exactly_once(folder / "ledger", items, args.epochs), flush=True)
            print(f"elastic.py: final test accuracy {100 * result['test_accuracy']:.2f}% after "
                  f"{mnist_lib.plural(args.epochs, 'epoch')}, {job.comm.num_nodes} of {nodes} "
                  f"processes at the end, {time.perf_counter() - started:.0f} s",
                  flush=True)  # fmt: skip
    finally:
        train.close()
        job.comm.close()
    return 0


def test_batches(args, job, loader, process):
    """The test set, split over the ranks there are now."""
    ds = Dataset(mnist_lib.join(args.data_url, "test.csv"), partition=job.comm.node_index,
                 partitions=job.comm.num_nodes)  # fmt: skip
    with ds.sampled_batcher(batch_size=500, input_dims=(1, 28, 28), sampler="linear",
                            processor=process, **loader) as b:  # fmt: skip
        yield from b


def exactly_once(folder: Path, items: int, epochs: int) -> str:
    """What the ledgers say: each epoch should hold every training example once."""
    seen: dict[int, Counter] = {}
    for f in folder.glob("rank*.txt"):
        for line in f.open():
            epoch, url = line.rstrip("\n").split(" ", 1)
            seen.setdefault(int(epoch), Counter())[url] += 1
    lines = []
    ok = True
    for epoch in range(epochs):
        counts = seen.get(epoch, Counter())
        twice = sum(1 for c in counts.values() if c > 1)
        missing = items - len(counts)
        ok &= twice == 0 and missing == 0
        lines.append(f"  epoch {epoch + 1}: {len(counts)} of {items} examples, {twice} "
                     f"used more than once, {missing} never")  # fmt: skip
    head = ("every training example was used exactly once in each epoch" if ok else
            "NOT EXACTLY ONCE: some training examples were repeated or skipped")  # fmt: skip
    return "\n".join([head, *lines])


if __name__ == "__main__":
    sys.exit(main())
