"""Train a CNN on MNIST over HTTP with AllReduceSGD: gradients averaged every step.

    python examples/mnist.py                      # one process, data in examples/data/mnist
    examples/mnist.sh                             # 4 processes, data over HTTP (the usual way)
    torchrun --nproc-per-node=4 examples/mnist.py --data-url http://127.0.0.1:PORT/ [--backend gloo]

Every node reads its own partition of the training set, computes gradients on
its mini-batch, and `sum_and_normalize_gradients` makes them the mean over the
nodes, so N nodes with batch B train like one process with batch N*B. Each
epoch ends with `synchronize_parameters` and an evaluation on the test set.
"""

from __future__ import annotations

import sys

import mnist_lib

from distlearn import AllReduceSGD


class SGD(mnist_lib.Algorithm):
    name = "AllReduceSGD"

    def __init__(self, **options) -> None:
        self.options = options  # AllReduceSGD's: grad_dtype, bucket sizes, overlap

    def start(self, comm, model):
        self.sgd = AllReduceSGD(comm, **self.options)
        self.sgd.synchronize_parameters(model)  # everyone starts from node 0's weights

    def after_backward(self, model):
        self.sgd.sum_and_normalize_gradients(model)

    def end_epoch(self, model):
        # uneven step counts end here too; the momentum of the node that took the most
        # steps goes with its weights
        self.sgd.synchronize_parameters(model, self.optimizer)
        return model


def main(argv: list[str] | None = None) -> int:
    p = mnist_lib.parser(__doc__.split("\n")[0], lr=0.05, epochs=4, batch_size=32)
    p.add_argument(
        "--grad-dtype",
        choices=("bfloat16", "float16"),
        help="send gradients in 16 bits (default: their own float32)",
    )
    return mnist_lib.main("mnist.py", lambda args: SGD(grad_dtype=args.grad_dtype), p, argv)


if __name__ == "__main__":
    sys.exit(main())
