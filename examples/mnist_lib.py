"""What examples/mnist.py (AllReduceSGD) and examples/mnist-ea.py (AllReduceEA) share.

The data flow of both: a CSV index of PNG files, served over HTTP, read by
``Dataset(url, partition=rank, partitions=N)`` with the ``permutation`` sampler
and the ``Image`` processor; a small CNN; a communicator (the ``ipc`` tree, or
``torch.distributed`` gloo) that the algorithm uses to keep the nodes together.
Each epoch ends with an evaluation on the test set split across the nodes, whose
confusion matrix is all-reduced so that every node reports the same numbers.

The two scripts differ only in the :class:`Algorithm` they pass to :func:`main`.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.append(str(HERE.parent))  # a checkout that is not pip-installed still runs

from distlearn.dataset import Dataset  # noqa: E402
from distlearn.dataset.metrics.ranks import describe_ranks  # noqa: E402
from distlearn.dataset.processors import Image  # noqa: E402

log = logging.getLogger("mnist")

CLASSES = 10
QUICK_TRAIN_ITEMS = 4000  # --quick: items per epoch over all nodes
QUICK_TEST_ITEMS = 2000
# The training set's pixel mean and standard deviation: centred inputs suit tanh units.
MEAN, STD = 0.1307, 0.3081
# Training batches in flight per process. The Dataset's own default (2, and 2 per
# loader process) covers a few steps; this model's step is 7-9 ms on 16 cores, where
# 1 step in 100 waited 6-11 ms or more for its batch (up to 173 ms), and the 3 other
# ranks waited for that one (12-18 points of the epoch). 16 (1.6 MB of batches of 32
# 28x28 images) rode most of it out: 1.28-1.35x samples/s at 4 processes
# (bench/RESULTS-training.md, issue 16); on 2 cores it changed nothing.
PREFETCH = 16


class Net(nn.Module):
    """The Lua example's CNN (two 5x5 convolutions with 16 maps, tanh, 2x2 max-pooling,
    a linear layer) with one hidden tanh layer of 128 before the output.

    The hidden layer costs ~5% more compute per item and buys ~0.2 points of test
    accuracy at 4 epochs (98.9-99.0% instead of 98.7-98.8%, single-process runs with
    the same schedule), the margin that keeps mnist.sh above 98.5%.
    """

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 5),
            nn.Tanh(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 16, 5),
            nn.Tanh(),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(
            nn.Linear(16 * 4 * 4, 128),
            nn.Tanh(),
            nn.Linear(128, CLASSES),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x).flatten(1))


class Algorithm:
    """How the nodes stay together; the hooks run at fixed points of the training loop.

    The loop calls every hook under ``torch.no_grad()``: they write into parameters
    and gradients in place, which is communication, not part of the autograd graph.
    """

    name = "single process"
    optimizer: Any = None  # the loop's, set before `start` (its state is synchronized too)

    def start(self, comm: Any, model: nn.Module) -> None:
        """Before the first step: every node begins from the same weights."""

    def after_backward(self, model: nn.Module) -> None:
        """Gradients are in `.grad`; the optimizer steps next."""

    def after_step(self, model: nn.Module) -> None:
        """The optimizer has stepped."""

    def end_epoch(self, model: nn.Module) -> nn.Module:
        """After the last step of an epoch; returns the model to evaluate."""
        return model


# ----------------------------------------------------------------------------- options


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, not {value}")
    return value


def parser(description: str, lr: float, epochs: int, batch_size: int) -> argparse.ArgumentParser:
    """Options shared by both scripts; each script passes its own tuned defaults."""
    p = argparse.ArgumentParser(description=description)
    g = p.add_argument_group("nodes")
    g.add_argument(
        "--node-index",
        type=int,
        default=None,
        help="0-based index of this process (default $RANK, else 0)",
    )
    g.add_argument(
        "--num-nodes",
        type=int,
        default=None,
        help="number of processes (default $WORLD_SIZE, else 1)",
    )
    g.add_argument(
        "--backend",
        choices=["ipc", "gloo"],
        default="ipc",
        help="communicator: the ipc tree (default) or torch.distributed gloo",
    )
    g.add_argument(
        "--master-port",
        type=int,
        default=29500,
        help="gloo rendezvous port when not launched by torchrun (default %(default)s)",
    )
    g = p.add_argument_group("training")
    g.add_argument("--epochs", type=int, default=epochs, help="default %(default)s")
    g.add_argument(
        "--batch-size",
        type=int,
        default=batch_size,
        help="per node; the effective batch is N times this (default %(default)s)",
    )
    g.add_argument("--lr", type=float, default=lr, help="peak learning rate (default %(default)s)")
    g.add_argument("--momentum", type=float, default=0.9, help="default %(default)s")
    g.add_argument(
        "--warmup",
        type=float,
        default=0.0,
        help="epochs of linear warm-up before the cosine decay (default %(default)s)",
    )
    g.add_argument("--seed", type=int, default=0, help="weights and sampling order")
    g.add_argument(
        "--quick",
        action="store_true",
        help=f"one epoch of {QUICK_TRAIN_ITEMS} items, {QUICK_TEST_ITEMS} test items",
    )
    g = p.add_argument_group("data and output")
    g.add_argument(
        "--data-url",
        default=str(HERE / "data" / "mnist"),
        help="folder or URL holding train.csv and test.csv (default %(default)s)",
    )
    g.add_argument(
        "--loader",
        choices=["auto", "thread", "process"],
        default="auto",
        help="Dataset workers: thread fetches and decodes on one thread of this process, "
        "process in worker processes; auto takes process where this host has 2 cores or "
        "more per training process, else thread (default %(default)s)",
    )
    g.add_argument(
        "--loader-workers",
        type=_positive_int,
        default=None,
        help="worker processes per training process; with --loader auto it takes them "
        "(default: the process's cores less its torch threads, at least 1)",
    )
    g.add_argument(
        "--threads",
        type=_positive_int,
        default=None,
        help="torch threads per process (default: cores / processes on this host with the "
        "thread loader, half of them with the process loader; at least 1)",
    )
    g.add_argument(
        "--prefetch",
        type=_positive_int,
        default=PREFETCH,
        help="training batches in flight per process: fetched ahead of the step that needs "
        "them, so a late answer from the data server delays the step only if it is later "
        "than that many steps (default %(default)s)",
    )
    g.add_argument(
        "--output",
        type=Path,
        default=None,
        help="where node 0 writes log.json and plot.png (default: a new folder per run, "
        "examples/output/SCRIPT/TIME, with examples/output/SCRIPT/latest pointing to it)",
    )
    p.add_argument(
        "--check-args",
        action="store_true",
        help=argparse.SUPPRESS,  # the launcher's one check of the options, before it starts N
    )
    return p


# ----------------------------------------------------------------------------- setup


def connect(args: argparse.Namespace) -> Any:
    """The communicator: ipc tree or gloo, from explicit options or torchrun's environment."""
    explicit = args.node_index is not None or args.num_nodes is not None
    node = args.node_index if args.node_index is not None else int(os.environ.get("RANK", 0))
    nodes = args.num_nodes if args.num_nodes is not None else int(os.environ.get("WORLD_SIZE", 1))
    if not 0 <= node < nodes:
        raise SystemExit(f"--node-index {node} is not in [0, {nodes})")
    if args.backend == "ipc":
        from distlearn import ipc

        if not explicit and "RANK" in os.environ:
            return ipc.Tree.from_env()
        return ipc.LocalhostTree(node, nodes)
    from distlearn.backends import TorchDistributed

    if explicit or "RANK" not in os.environ:  # started by hand: rendezvous on this host
        os.environ.update(
            RANK=str(node),
            WORLD_SIZE=str(nodes),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(args.master_port),
        )
    # close() destroys the group. A stopped rank fails the job after 5 minutes, as over
    # the ipc tree (its default timeout), rather than after torch's 30.
    return TorchDistributed.from_env("gloo", timeout=300.0)


def check_data(url: str) -> None:
    """A local data folder without its index gets a message that says what to run."""
    if "://" in url:
        return
    missing = [n for n in ("train.csv", "test.csv") if not (Path(url) / n).is_file()]
    if missing:
        raise SystemExit(
            f"no MNIST in {url} ({', '.join(missing)} missing): run "
            "`python examples/prepare_mnist.py` once to make it (or ./examples/mnist.sh, "
            "which prepares, serves and trains), or point --data-url at a folder or URL "
            "holding train.csv and test.csv"
        )


def run_folder(script: str) -> Path:
    """examples/output/SCRIPT/TIME, new for this run, and SCRIPT/latest pointing to it."""
    base = HERE / "output" / Path(script).stem
    stamp = time.strftime("%Y%m%d-%H%M%S")
    folder = base / stamp
    n = 1
    while folder.exists():  # two runs within one second
        n += 1
        folder = base / f"{stamp}-{n}"
    folder.mkdir(parents=True)
    tmp = base / f".latest-{os.getpid()}"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(folder.name)
    os.replace(tmp, base / "latest")  # atomic: a reader never sees no link
    return folder


def plural(n: int, word: str) -> str:
    """`1 epoch`, `4 epochs`, `1 process`, `4 processes`."""
    return f"{n} {word}" if n == 1 else f"{n} {word}{'es' if word.endswith('s') else 's'}"


def join(base: str, name: str) -> str:
    """`name` inside the folder or URL `base`."""
    if "://" in base:
        return base.rstrip("/") + "/" + name
    return str(Path(base) / name)


def cores_per_process(nodes: int) -> int:
    """This host's cores over the training processes on it, at least 1."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", nodes))
    return max(1, (os.cpu_count() or 1) // max(1, local))


def loader_plan(args: argparse.Namespace, nodes: int) -> tuple[dict[str, Any], int]:
    """(the Dataset's worker options, torch threads) for this process.

    The thread loader's fetch thread runs aiohttp's Python (about 150 us an item) under
    the GIL that the training thread needs between its torch calls, so where a core is
    free for it, the fetching goes to worker processes instead, with half the cores for
    torch threads and half for the workers: one training process on 2 cores trains
    1.98x faster so, 4 on 16 cores 2.0-2.4x (bench/RESULTS-training.md, issue 16). Where
    there is no spare core (4 processes on 2 cores), more processes only take turns on
    the cores, and one thread that fetches and decodes (num_workers=0) costs least: a
    28x28 PNG takes ~30 us to decode, about what handing it to a decode thread and back
    costs (the loader rows of `python -m bench --only loaders --rows workers=thread`).
    """
    cores = cores_per_process(nodes)
    kind = args.loader
    if kind == "auto":
        kind = "process" if cores >= 2 or args.loader_workers is not None else "thread"
    if kind == "thread":
        return dict(workers="thread", num_workers=0), args.threads or cores
    threads = args.threads or max(1, cores // 2)
    workers = args.loader_workers or max(1, cores - threads)
    return dict(workers="process", num_workers=workers), threads


def describe_loader(loader: dict[str, Any], threads: int) -> str:
    if loader["workers"] == "thread":
        fetch = "one loader thread"
    else:
        fetch = plural(loader["num_workers"], "loader process")
    return f"{fetch} and {plural(threads, 'torch thread')} a process"


class Schedule:
    """Linear warm-up, then cosine decay to zero over the whole run (per step)."""

    def __init__(self, lr: float, total_steps: int, warmup_steps: int) -> None:
        self.lr, self.total, self.warmup = lr, max(1, total_steps), max(0, warmup_steps)

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        progress = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
        return self.lr * 0.5 * (1.0 + math.cos(math.pi * progress))


# ----------------------------------------------------------------------------- evaluation


@torch.no_grad()
def evaluate(model: nn.Module, batches: Any, comm: Any, limit: int | None) -> dict[str, Any]:
    """Loss, accuracy and confusion matrix over every node's share of the test set,
    all-reduced so that every node gets the same numbers."""
    model.eval()
    confusion = torch.zeros(CLASSES, CLASSES, dtype=torch.int64)
    loss_sum = torch.zeros(1, dtype=torch.float64)
    seen = 0
    for batch in batches:
        if limit is not None and seen >= limit:
            break
        out = model(batch.input)
        loss_sum += F.cross_entropy(out, batch.target, reduction="sum").item()
        pred = out.argmax(1)
        confusion.view(-1).index_add_(
            0, batch.target * CLASSES + pred, torch.ones_like(pred, dtype=torch.int64)
        )
        seen += len(batch.target)
    model.train()
    comm.all_reduce([confusion, loss_sum])
    total = int(confusion.sum())
    return {
        "test_loss": float(loss_sum) / max(1, total),
        "test_accuracy": float(confusion.diag().sum()) / max(1, total),
        "test_items": total,
        "confusion": confusion.tolist(),
    }


def format_confusion(confusion: list[list[int]]) -> str:
    """Rows: true digit; columns: predicted; last column: per-class accuracy."""
    lines = ["true\\pred " + " ".join(f"{c:>5}" for c in range(CLASSES)) + "   acc"]
    for true, row in enumerate(confusion):
        acc = row[true] / max(1, sum(row))
        lines.append(f"{true:>9} " + " ".join(f"{v:>5}" for v in row) + f" {100 * acc:5.1f}%")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- output


def write_outputs(output: Path, record: dict[str, Any]) -> tuple[Path, Path | None]:
    """log.json, and plot.png when matplotlib is installed: the training loss as it
    went (every few steps) and the test loss and accuracy after each epoch, against
    epochs, so a one-epoch run draws a curve, not a dot."""
    output.mkdir(parents=True, exist_ok=True)
    log_path = output / "log.json"
    tmp = log_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(tmp, log_path)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed (pip install -e .[examples]): no plot")
        return log_path, None
    epochs = [e["epoch"] for e in record["epochs"]]
    accuracy = [100 * e["test_accuracy"] for e in record["epochs"]]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    steps = record["train_curve"]
    ax1.plot([x for x, _ in steps], [y for _, y in steps], "-", label="train (node 0)")
    ax1.plot(epochs, [e["test_loss"] for e in record["epochs"]], "o", label="test")
    ax1.set(xlabel="epoch", ylabel="cross-entropy loss", title="loss", ylim=(0, None))
    ax1.legend()
    ax2.plot(epochs, accuracy, "o-")
    low = max(0.0, min(accuracy) - 2.0)
    ax2.set(xlabel="epoch", ylabel="test accuracy (%)", title="test accuracy", ylim=(low, 100))
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.set_xlim(0, max(epochs) * 1.03)  # room for the last epoch's markers
    args = record["args"]
    fig.suptitle(
        f"{record['script']}: {record['algorithm']}, {plural(record['nodes'], 'process')} "
        f"({record['backend']}), batch {args['batch_size']} per node, lr {args['lr']}"
    )
    fig.tight_layout()
    plot_path = output / "plot.png"
    fig.savefig(plot_path, dpi=100)
    plt.close(fig)
    return log_path, plot_path


# ----------------------------------------------------------------------------- the loop


def main(
    script: str,
    make_algorithm: Callable[[argparse.Namespace], Algorithm],
    p: argparse.ArgumentParser,
    argv: list[str] | None = None,
) -> int:
    """Parse options, connect, train for the epochs, evaluate each, write the outputs."""
    args = p.parse_args(argv)
    if args.loader == "thread" and args.loader_workers is not None:
        p.error("--loader-workers needs worker processes: --loader process or auto")
    if args.check_args:
        return 0
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    # the epoch line says where the loader's time went; its 10 s windows stay quiet
    logging.getLogger("distlearn.dataset.metrics").setLevel(logging.WARNING)
    if args.quick:
        args.epochs = 1
    check_data(args.data_url)
    started = time.perf_counter()
    comm = connect(args)
    node, nodes = comm.node_index, comm.num_nodes
    lead = node == 0
    loader, threads = loader_plan(args, nodes)
    torch.set_num_threads(threads)
    torch.manual_seed(args.seed)  # the same initial weights everywhere; the algorithm checks
    algorithm = make_algorithm(args)

    train_ds = Dataset(join(args.data_url, "train.csv"), partition=node, partitions=nodes)
    test_ds = Dataset(join(args.data_url, "test.csv"), partition=node, partitions=nodes)
    train = train_ds.sampled_batcher(
        batch_size=args.batch_size,
        input_dims=(1, 28, 28),
        sampler="permutation",
        processor=Image(mode="L", mean=MEAN, std=STD),
        seed=args.seed,
        prefetch=args.prefetch,
        **loader,
    )
    test = test_ds.sampled_batcher(
        batch_size=500,
        input_dims=(1, 28, 28),
        # --quick evaluates on a part of the test set: a seeded sample of every digit,
        # not the first labels in index order (linear gave digits 0-4 only).
        sampler="permutation" if args.quick else "linear",
        seed=0,
        processor=Image(mode="L", mean=MEAN, std=STD),
        **loader,
    )
    train_limit = QUICK_TRAIN_ITEMS // nodes if args.quick else None
    test_limit = QUICK_TEST_ITEMS // nodes if args.quick else None
    steps_per_epoch = (
        len(train) if train_limit is None else math.ceil(train_limit / args.batch_size)
    )

    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    schedule = Schedule(
        args.lr, steps_per_epoch * args.epochs, round(args.warmup * steps_per_epoch)
    )
    algorithm.optimizer = optimizer
    with torch.no_grad():
        algorithm.start(comm, model)
    if lead:
        print(
            f"{script}: {algorithm.name}, {plural(nodes, 'process')} "
            f"({args.backend}), {len(train_ds.index)} train items on node 0, "
            f"batch {args.batch_size} x {nodes}, lr {args.lr}, {plural(args.epochs, 'epoch')}; "
            f"{describe_loader(loader, threads)}",
            flush=True,
        )
    record: dict[str, Any] = {
        "script": script,
        "algorithm": algorithm.name,
        "nodes": nodes,
        "backend": args.backend,
        "loader": {**loader, "torch_threads": threads, "prefetch": args.prefetch},
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "epochs": [],
        "train_curve": [],  # (fractional epoch, node 0's mean loss since the last point)
    }
    curve_every = max(1, steps_per_epoch // 50)
    curve_loss = 0.0
    step = 0
    try:
        for epoch in range(1, args.epochs + 1):
            t0 = time.perf_counter()
            stats = torch.zeros(3, dtype=torch.float64)  # loss sum, items, steps
            bar = None
            if lead:
                from tqdm import tqdm

                bar = tqdm(total=steps_per_epoch, desc=f"epoch {epoch}", unit="step", leave=False)
            for batch in train:
                if train_limit is not None and stats[1] >= train_limit:
                    break
                for group in optimizer.param_groups:
                    group["lr"] = schedule(step)
                loss = F.cross_entropy(model(batch.input), batch.target)
                optimizer.zero_grad(set_to_none=False)
                loss.backward()
                with torch.no_grad():
                    algorithm.after_backward(model)
                optimizer.step()
                with torch.no_grad():
                    algorithm.after_step(model)
                n = len(batch.target)
                stats += torch.tensor([loss.item() * n, n, 1], dtype=torch.float64)
                step += 1
                curve_loss += loss.item()
                if step % curve_every == 0:
                    x = epoch - 1 + min(1.0, stats[2].item() / steps_per_epoch)
                    record["train_curve"].append((round(x, 4), curve_loss / curve_every))
                    curve_loss = 0.0
                if bar is not None:
                    bar.update()
                    bar.set_postfix(loss=f"{loss.item():.3f}", refresh=False)
            if bar is not None:
                bar.close()
            with torch.no_grad():
                evaluated = algorithm.end_epoch(model)
            train_seconds = time.perf_counter() - t0
            # the loader's metrics since the last epoch ride in this all_reduce
            loader_ranks = train.metrics_tensor(comm)
            comm.all_reduce([stats, loader_ranks])
            loader_verdict = train.metrics(ranks=loader_ranks)["ranks"]
            result = evaluate(evaluated, test, comm, test_limit)
            seconds = time.perf_counter() - t0
            entry = {
                "epoch": epoch,
                "train_loss": float(stats[0] / max(1, stats[1])),
                "train_items": int(stats[1]),
                "items_per_s": float(stats[1]) / train_seconds,
                "seconds": seconds,
                "loader": describe_ranks(loader_verdict),
                **result,
            }
            record["epochs"].append(entry)
            if lead:
                print(
                    f"epoch {epoch}/{args.epochs}: train loss {entry['train_loss']:.4f}, "
                    f"test loss {entry['test_loss']:.4f}, "
                    f"test accuracy {100 * entry['test_accuracy']:.2f}% "
                    f"({entry['test_items']} items), {entry['items_per_s']:.0f} items/s, "
                    f"{seconds:.0f} s; loader: {entry['loader']}",
                    flush=True,
                )
        if lead:
            print(format_confusion(record["epochs"][-1]["confusion"]), flush=True)
            record["stats"] = {"train": str(train.stats), "test": str(test.stats)}
            output = args.output or run_folder(script)
            log_path, plot_path = write_outputs(output, record)
            print(f"wrote {log_path}" + (f" and {plot_path}" if plot_path else ""), flush=True)
            last = record["epochs"][-1]
            print(  # the result: the last line of the job
                f"{script}: final test accuracy {100 * last['test_accuracy']:.2f}% after "
                f"{plural(len(record['epochs']), 'epoch')}, {plural(nodes, 'process')}, "
                f"{time.perf_counter() - started:.0f} s",
                flush=True,
            )
    finally:
        train.close()
        test.close()
        comm.close()
    return 0
