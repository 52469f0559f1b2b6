"""distlearn: AllReduceSGD and AllReduceEA over any communicator.

One import namespace: `distlearn.dataset` (loading), `distlearn.ipc` (the process
tree) and this package. The communicator is the `ipc` tree (the default),
`torch.distributed` through `distlearn.backends.TorchDistributed`, or XLA
through `distlearn.backends.XLA`.
"""

__version__ = "0.1.0"

from .comm import Communicator
from .ea import AllReduceEA
from .sgd import AllReduceSGD
from .state import broadcast_state_dict, synchronize_optimizer

__all__ = [
    "AllReduceEA",
    "AllReduceSGD",
    "Communicator",
    "broadcast_state_dict",
    "synchronize_optimizer",
]
