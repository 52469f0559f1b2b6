"""The communicator protocol over an initialised `torch.distributed` process group."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from ._flat import FlatCommunicator

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


class TorchDistributed(FlatCommunicator):
    """`torch.distributed` (gloo for CPU tensors, NCCL for CUDA tensors) as a communicator.

    Tensors are packed into one flat buffer per (device, dtype), so a model's many
    parameters cost one collective per dtype; the contributor count rides in the first
    buffer. `all_reduce(..., async_op=True)` returns a handle at once (torch's
    `async_op=True` underneath). `group` defaults to the world group. Node 0 is the
    group's rank 0.
    """

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "TorchDistributed needs an initialised process group: call "
                "torch.distributed.init_process_group(...) first, or use "
                "TorchDistributed.from_env()"
            )
        self.group = group
        self.node_index = dist.get_rank(group)
        self.num_nodes = dist.get_world_size(group)
        self._root = dist.get_global_rank(group, 0) if group is not None else 0
        self._owns_group = False
        # What the asynchronous all-reduce calls the process group with (see below).
        self._pg = group if group is not None else dist.group.WORLD
        self._async_opts = {}
        for name, op in _REDUCE_OPS.items():
            opts = dist.AllreduceOptions()
            opts.reduceOp = op
            opts.asyncOp = True
            self._async_opts[name] = opts

    @classmethod
    def from_env(cls, backend: str | None = None) -> TorchDistributed:
        """Initialise the default process group from torchrun's environment
        (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and wrap it; `close()` destroys it.

        `backend` defaults to NCCL when CUDA is available, else gloo.
        """
        missing = [
            k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ
        ]
        if missing:
            raise RuntimeError(
                f"TorchDistributed.from_env: {', '.join(missing)} not set (launch with torchrun)"
            )
        if backend is None:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend=backend, init_method="env://")
        comm = cls()
        comm._owns_group = True
        return comm

    def _all_reduce_flat(self, buf: torch.Tensor, op: str) -> None:
        dist.all_reduce(buf, op=_REDUCE_OPS[op], group=self.group)

    def _start_all_reduce_flat(self, buf: torch.Tensor, op: str) -> dist.Work:
        # gloo runs it on its own threads, NCCL on its own stream (after the work
        # already queued on the current one): the caller's thread goes on at once.
        # Straight to the process group: `dist.all_reduce`'s checks and logging wrapper
        # cost a third of the call, once per gradient bucket (the buffers are ours:
        # flat, dense, and this node is in the group).
        if buf.is_complex():
            buf = torch.view_as_real(buf)  # as dist.all_reduce does
        return self._pg.allreduce([buf], self._async_opts[op])

    def _all_gather_flat(self, buf: torch.Tensor) -> list[torch.Tensor]:
        out = [torch.empty_like(buf) for _ in range(self.num_nodes)]
        dist.all_gather(out, buf.contiguous(), group=self.group)
        return out

    def _broadcast_flat(self, buf: torch.Tensor) -> None:
        dist.broadcast(buf, src=self._root, group=self.group)

    def barrier(self) -> None:
        """Wait until every node of the group reaches this point."""
        dist.barrier(group=self.group)

    def close(self) -> None:
        """Drop cached buffers; destroy the process group if `from_env` created it."""
        super().close()
        # Our references would keep the group alive past destroy_process_group(), its
        # gloo threads running until the interpreter shuts down: one that then frees a
        # failed all-reduce (a peer died) needs the GIL, which a finalizing interpreter
        # refuses by ending the thread, and the process aborts (std::terminate).
        self._pg = self._async_opts = None
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
            self._owns_group = False

    def __repr__(self) -> str:
        backend = dist.get_backend(self.group) if dist.is_initialized() else "closed"
        return f"TorchDistributed({backend}, node {self.node_index} of {self.num_nodes})"
