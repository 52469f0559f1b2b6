"""The small protocol every communicator implements: the `ipc` tree, TorchDistributed, XLA."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch

Op = str | Callable[[torch.Tensor, torch.Tensor], torch.Tensor | None]


@runtime_checkable
class Communicator(Protocol):
    """Collectives over a fixed set of nodes; node 0 is the root.

    `tensors` is a tensor or a nested list/tuple/dict of tensors, changed in place.
    """

    node_index: int
    num_nodes: int

    def all_reduce(self, tensors: Any, op: Op = "sum", finished: bool = False) -> int:
        """Reduce across nodes; a `finished` node contributes nothing. Returns how many
        nodes contributed."""
        ...

    def scatter(self, tensors: Any) -> None:
        """Copy the root's values to every node."""
        ...

    def barrier(self) -> None: ...

    def close(self) -> None: ...


def check_communicator(comm: Any) -> Communicator:
    """Fail early, naming what is missing, rather than at the first collective."""
    missing = [
        name
        for name in ("node_index", "num_nodes", "all_reduce", "scatter", "barrier")
        if not hasattr(comm, name)
    ]
    if missing:
        raise TypeError(
            f"{type(comm).__name__} is not a communicator: it has no {', '.join(missing)}"
        )
    return comm
