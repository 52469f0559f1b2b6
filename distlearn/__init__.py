"""distlearn: AllReduceSGD and AllReduceEA over any communicator.

One import namespace: `distlearn.dataset` (loading), `distlearn.ipc` (the process
tree), `distlearn.common` (the helpers both share) and this package. The
communicator is the `ipc` tree (the default), `torch.distributed` through
`distlearn.backends.TorchDistributed`, or XLA through `distlearn.backends.XLA`.
`Checkpoint` saves and restores a job (model, optimizer, loader position) at any
world size; `distlearn.preemption` turns SIGTERM into a stop that every rank takes
after the same step.
"""

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = [
    "AllReduceEA",
    "AllReduceSGD",
    "Checkpoint",
    "Communicator",
    "broadcast_state_dict",
    "synchronize_optimizer",
]

# Imported on first use (PEP 562): `distlearn.common`, `distlearn.dataset.serve` and
# `distlearn.ipc` below this package start without importing torch for it.
_LAZY = {
    "Checkpoint": "checkpoint",
    "Communicator": "comm",
    "AllReduceEA": "ea",
    "AllReduceSGD": "sgd",
    "broadcast_state_dict": "state",
    "synchronize_optimizer": "state",
}

if TYPE_CHECKING:
    from .checkpoint import Checkpoint
    from .comm import Communicator
    from .ea import AllReduceEA
    from .sgd import AllReduceSGD
    from .state import broadcast_state_dict, synchronize_optimizer


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
