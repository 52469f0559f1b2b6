"""distlearn: AllReduceSGD and AllReduceEA over any communicator.

The communicator is the `ipc` tree (the default), `torch.distributed` through
`distlearn.backends.TorchDistributed`, or XLA through `distlearn.backends.XLA`.
"""

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
