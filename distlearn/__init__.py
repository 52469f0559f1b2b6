"""distlearn: AllReduceSGD and AllReduceEA over any communicator.

One import namespace: `distlearn.dataset` (loading), `distlearn.ipc` (the process
tree) and this package. The communicator is the `ipc` tree (the default),
`torch.distributed` through `distlearn.backends.TorchDistributed`, or XLA
through `distlearn.backends.XLA`. `Checkpoint` saves and restores a job (model,
optimizer, loader position) at any world size; `distlearn.preemption` turns SIGTERM
into a stop that every rank takes after the same step.
"""

__version__ = "0.1.0"

from .checkpoint import Checkpoint
from .comm import Communicator
from .ea import AllReduceEA
from .sgd import AllReduceSGD
from .state import broadcast_state_dict, synchronize_optimizer

__all__ = [
    "AllReduceEA",
    "AllReduceSGD",
    "Checkpoint",
    "Communicator",
    "broadcast_state_dict",
    "synchronize_optimizer",
]
