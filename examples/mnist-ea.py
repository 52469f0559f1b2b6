"""Train a CNN on MNIST over HTTP with elastic averaging (AllReduceEA).

    python examples/mnist-ea.py                   # one process, data in examples/data/mnist
    examples/mnist-ea.sh                          # 4 processes, data over HTTP (the usual way)
    torchrun --nproc-per-node=4 examples/mnist-ea.py --data-url http://127.0.0.1:PORT/

Every node trains its own replica on its own partition and, every `tau` steps,
is pulled towards a shared center by `alpha` (one all-reduce per average).
Each epoch ends with `synchronize_center`; the center is what is evaluated.
"""

from __future__ import annotations

import sys

import mnist_lib

from distlearn import AllReduceEA


class EA(mnist_lib.Algorithm):
    def __init__(self, tau: int, alpha: float) -> None:
        self.tau, self.alpha = tau, alpha
        self.name = f"AllReduceEA (tau {tau}, alpha {alpha})"

    def start(self, comm, model):
        self.ea = AllReduceEA(comm, tau=self.tau, alpha=self.alpha)
        self.ea.synchronize_parameters(model)  # same weights, and the center starts there

    def after_step(self, model):
        self.ea.average_parameters(model)

    def end_epoch(self, model):
        self.ea.synchronize_center(model)
        return self.ea.center_model(model)  # the center is the model to evaluate


def main(argv: list[str] | None = None) -> int:
    p = mnist_lib.parser(__doc__.split("\n")[0], lr=0.05, epochs=4, batch_size=32)
    g = p.add_argument_group("elastic averaging")
    g.add_argument(
        "--tau", type=int, default=10, help="steps between averages (default %(default)s)"
    )
    g.add_argument("--alpha", type=float, default=0.2, help="elastic pull (default %(default)s)")
    return mnist_lib.main("mnist-ea.py", lambda args: EA(args.tau, args.alpha), p, argv)


if __name__ == "__main__":
    sys.exit(main())
