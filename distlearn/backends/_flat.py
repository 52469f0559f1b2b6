"""The communicator protocol implemented once over three flat-buffer primitives.

Backends (torch.distributed, XLA) only provide all-reduce, all-gather and broadcast of
one 1-D buffer. Packing the user's tensors into one buffer per (device, dtype), the
`finished` flags and the contributor count all live here, so every backend has the same
semantics as the `ipc` tree: finished nodes contribute the identity of the reduction
("nothing") and the count of contributors travels inside the same collective as the
data, which is what lets ranks with uneven step counts end an epoch without a deadlock.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from ..tensors import leaves

Op = str | Callable[[torch.Tensor, torch.Tensor], torch.Tensor | None]
_OPS = ("sum", "max", "min")


def _exact_integers(dtype: torch.dtype) -> int:
    """The largest count a dtype holds exactly (a sum of 0/1 flags must not round)."""
    if dtype.is_floating_point:
        return int(2 / torch.finfo(dtype).eps)  # 2 ** (mantissa bits + 1)
    if dtype == torch.bool:
        return 1
    return torch.iinfo(dtype).max


def _identity(op: str, dtype: torch.dtype) -> float | int | bool:
    """What a finished node contributes: the value that leaves the reduction unchanged."""
    if op == "sum":
        return 0
    if dtype == torch.bool:
        return op == "min"
    if dtype.is_floating_point:
        return -math.inf if op == "max" else math.inf
    info = torch.iinfo(dtype)
    return info.min if op == "max" else info.max


def _groups(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Tensors grouped by (device, dtype), groups in order of first appearance."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    return list(groups.values())


class FlatCommunicator:
    """Base of the backends: `all_reduce`, `scatter` and `barrier` over flat buffers.

    Subclasses set `node_index` and `num_nodes` and implement `_all_reduce_flat`,
    `_all_gather_flat`, `_broadcast_flat` and `barrier`.
    """

    node_index: int
    num_nodes: int
    #: Reuse one buffer per (device, dtype) between calls, so a training step does not
    #: allocate (and page-fault) a gradient-sized buffer every time. It costs one
    #: extra copy of the largest structure reduced so far, like DDP's buckets.
    reuse_buffers: bool = True

    def __init__(self) -> None:
        self._buffers: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

    # -- primitives -------------------------------------------------------------------

    def _all_reduce_flat(self, buf: torch.Tensor, op: str) -> None:
        raise NotImplementedError

    def _all_gather_flat(self, buf: torch.Tensor) -> list[torch.Tensor]:
        raise NotImplementedError

    def _broadcast_flat(self, buf: torch.Tensor) -> None:
        raise NotImplementedError

    def barrier(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Drop the cached buffers (the process group itself belongs to its creator)."""
        self._buffers.clear()

    def _sync(self) -> None:
        """Hook for lazy backends: materialise pending work before results are read."""

    # -- packing ----------------------------------------------------------------------

    def _buffer(self, like: torch.Tensor, numel: int) -> torch.Tensor:
        key = (like.device, like.dtype)
        if not self.reuse_buffers:
            return torch.empty(numel, dtype=like.dtype, device=like.device)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=like.dtype, device=like.device)
            self._buffers[key] = buf
        return buf[:numel]

    def _pack(self, members: list[torch.Tensor], extra: int) -> tuple[torch.Tensor, int]:
        numel = sum(t.numel() for t in members)
        buf = self._buffer(members[0], numel + extra)
        if numel:
            with torch.no_grad():  # parameters require grad; `out=` refuses autograd
                torch.cat([t.reshape(-1) for t in members], out=buf[:numel])
        return buf, numel

    @staticmethod
    def _unpack(buf: torch.Tensor, members: list[torch.Tensor]) -> None:
        offset = 0
        with torch.no_grad():
            for t in members:
                n = t.numel()
                t.copy_(buf[offset : offset + n].view(t.shape))
                offset += n

    # -- the protocol -----------------------------------------------------------------

    def all_reduce(self, tensors: Any, op: Op = "sum", finished: bool = False) -> int:
        """Reduce `tensors` across nodes in place; returns how many nodes contributed.

        A `finished` node keeps taking part (so the others do not hang) but contributes
        nothing; its tensors receive the result like everyone else's.
        """
        members = leaves(tensors)
        if callable(op):
            return self._all_reduce_callable(members, op, finished)
        if op not in _OPS:
            raise ValueError(f"op must be one of {_OPS} or a callable, got {op!r}")
        if not members:
            raise ValueError("all_reduce needs at least one tensor (to carry the count)")
        count = 0
        for i, group in enumerate(_groups(members)):
            dtype = group[0].dtype
            slots = 0
            if i == 0:
                # One slot holds the sum of 0/1 flags where the dtype counts exactly;
                # otherwise (and for max/min, which cannot count) one slot per node.
                exact = op == "sum" and self.num_nodes <= _exact_integers(dtype)
                slots = 1 if exact else self.num_nodes
            buf, numel = self._pack(group, slots)
            if finished:
                buf[:numel].fill_(_identity(op, dtype))
            if slots == 1:
                buf[numel] = 0 if finished else 1
            elif slots:
                flags = buf[numel:]
                on, off = (0, 1) if op == "min" else (1, 0)
                flags.fill_(off)
                flags[self.node_index] = off if finished else on
            self._all_reduce_flat(buf, op)
            self._sync()
            if slots == 1:
                count = round(buf[numel].item())
            elif slots:
                count = int((buf[numel:] == on).sum().item())
            self._unpack(buf, group)
        return count

    def _all_reduce_callable(
        self, members: list[torch.Tensor], op: Callable, finished: bool
    ) -> int:
        """All-gather, then fold `op(a, b)` over the contributors in node order.

        `op` may work in place on `a` and return None, or return the reduced tensor.
        If every node is finished the tensors are left as they were.
        """
        count = 0
        contributors: list[int] = []
        for i, group in enumerate(_groups(members)):
            slots = 1 if i == 0 else 0
            buf, numel = self._pack(group, slots)
            if slots:
                buf[numel] = 0 if finished else 1
            gathered = self._all_gather_flat(buf)
            self._sync()
            if i == 0:
                contributors = [r for r, g in enumerate(gathered) if g[numel].item() == 1]
                count = len(contributors)
            if not contributors:
                continue
            offset = 0
            with torch.no_grad():
                for t in group:
                    n = t.numel()
                    parts = [gathered[r][offset : offset + n].view(t.shape) for r in contributors]
                    acc = parts[0].clone()
                    for part in parts[1:]:
                        out = op(acc, part)
                        acc = acc if out is None else out
                    t.copy_(acc)
                    offset += n
        return count

    def scatter(self, tensors: Any) -> None:
        """Copy the root's (node 0's) values into every node's `tensors`, in place."""
        for group in _groups(leaves(tensors)):
            buf, _ = self._pack(group, 0)
            self._broadcast_flat(buf)
            self._sync()
            self._unpack(buf, group)
