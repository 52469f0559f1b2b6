"""The communicator protocol over torch_xla collectives (TPU, GPU or CPU via PJRT).

torch_xla is imported when an `XLA()` is made, so `distlearn` itself never needs it.
XLA tensors are lazy: collectives join the traced graph, and reading the contributor
count (a Python int, as the protocol promises) cuts the graph with a sync. That costs
one graph execution per collective, which training does once per step anyway.

No asynchronous form (`async_op`): on XLA the backward pass is traced, not run, so
there is nothing to overlap with while it is traced, and hooks that started collectives
mid-backward would cut the step's graph into pieces. The gradient all-reduce joins the
step's graph after backward instead, where XLA's own scheduler overlaps collectives
with computation (on TPU and GPU); AllReduceSGD therefore takes its synchronous path.
"""

from __future__ import annotations

from typing import Any

import torch

from ..comm import Op
from ._flat import FlatCommunicator


class XLA(FlatCommunicator):
    """Every XLA device of the job (one per process, as `torch_xla.launch` starts them).

    Synchronous only: the all-reduce joins the traced graph after backward, where XLA's
    own scheduler overlaps it with computation.

    Raises:
        ImportError: torch_xla is not installed.
    """

    # Lazy tensors allocate nothing until the graph runs; a cached buffer would only
    # chain in-place updates across steps into the traced graph.
    reuse_buffers = False
    # The count always rides in the data's collective: one graph op, not two.
    direct_bytes = None

    def __init__(self) -> None:
        super().__init__()
        try:
            import torch_xla
            import torch_xla.core.xla_model as xm
            import torch_xla.runtime as xr
        except ImportError as e:
            raise ImportError(
                "distlearn.backends.XLA needs torch_xla (pip install torch_xla matching "
                "your torch version; see tests/run-xla.sh)"
            ) from e
        self._xla = torch_xla
        self._xm = xm
        self.node_index = xr.global_ordinal()
        self.num_nodes = xr.world_size()
        self._ops = {"sum": xm.REDUCE_SUM, "max": xm.REDUCE_MAX, "min": xm.REDUCE_MIN}

    @property
    def device(self) -> torch.device:
        """This process's XLA device: put the model and batches here.

        Returns:
            The device.
        """
        return self._xla.device()

    def all_reduce(self, tensors: Any, op: Op = "sum", finished: bool = False) -> int:
        """Reduce across the XLA processes, in place (the synchronous form only).

        Args:
            tensors: A tensor or nested list/tuple/dict of tensors on the XLA device.
            op: `"sum"`, `"max"`, `"min"`, or a function `op(acc, x)`.
            finished: This node contributes nothing.

        Returns:
            How many processes contributed.
        """
        return super().all_reduce(tensors, op, finished)

    def _sync(self) -> None:
        self._xla.sync()

    def _all_reduce_flat(self, buf: torch.Tensor, op: str) -> None:
        self._xm.all_reduce(self._ops[op], [buf])  # a list is reduced in place

    def _all_gather_flat(self, buf: torch.Tensor) -> list[torch.Tensor]:
        gathered = self._xm.all_gather(buf.unsqueeze(0), dim=0)
        return list(gathered.unbind(0))

    def _broadcast_flat(self, buf: torch.Tensor) -> None:
        self._xm.collective_broadcast([buf], root_ordinal=0)

    def barrier(self) -> None:
        """Wait until every XLA process reaches this point."""
        self._xm.rendezvous("distlearn.barrier")

    def __repr__(self) -> str:
        return f"XLA(node {self.node_index} of {self.num_nodes})"
