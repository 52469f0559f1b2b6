"""Communicators besides the `ipc` tree: `torch.distributed` (gloo, NCCL) and XLA.

All implement the protocol of `distlearn.Communicator`, so the algorithms never know
which one they run on.
"""

from .torch_distributed import TorchDistributed
from .xla import XLA

__all__ = ["XLA", "TorchDistributed"]
