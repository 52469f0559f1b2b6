"""The small protocol every communicator implements: the `ipc` tree, TorchDistributed, XLA.

Synchronous form: `all_reduce(tensors, op, finished) -> int` returns once the result is
in `tensors`. Asynchronous form, for communicators that can overlap communication with
computation: `all_reduce(tensors, op, finished, async_op=True) -> Handle` returns at
once; the result is in `tensors` after `handle.wait()`, which returns the contributor
count. Until then the caller must neither read nor write `tensors`. Several handles may
be in flight, and every node must start its collectives in the same order; wait for
each handle whose tensors you read, since one handle's completion says nothing of
another's (the tree completes them in the order they were started; TorchDistributed
finishes a small all-reduce that it reduces at the root before returning it).

A communicator offers the asynchronous form if its `all_reduce` takes `async_op`
(`supports_async`); `start_all_reduce` gives callers one way to use either.

The flat backends (backends/_flat.py) also offer `all_reduce_counted(flat, finished,
async_op)`: the sum of one 1-D buffer whose last element the caller left free for the
count, so the count needs neither a copy of the data nor a collective of its own.
Gradient buckets use it where it exists (distlearn.buckets).
"""

from __future__ import annotations

import functools
import hashlib
import inspect
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch

Op = str | Callable[[torch.Tensor, torch.Tensor], torch.Tensor | None]

__all__ = [
    "Communicator",
    "Completed",
    "Handle",
    "check_communicator",
    "check_same_layout",
    "start_all_reduce",
    "supports_async",
]


@runtime_checkable
class Handle(Protocol):
    """An all-reduce in flight."""

    def wait(self) -> int:
        """Block until the result is in the tensors.

        Returns:
            How many nodes contributed; waiting again returns the same count.

        Raises:
            Exception: What the synchronous call would have raised (a dead peer...).
        """
        ...

    def is_completed(self) -> bool:
        """Whether `wait()` would return without blocking on communication.

        Returns:
            True once the result is in the tensors (or the collective failed).
        """
        ...


@runtime_checkable
class Communicator(Protocol):
    """Collectives over a fixed set of nodes; node 0 is the root.

    `tensors` is a tensor or a nested list/tuple/dict of tensors, changed in place.
    Communicators that can overlap also accept `async_op=True` in `all_reduce` and then
    return a `Handle` (see the module docstring).

    Attributes:
        node_index: This node's index, 0-based; node 0 is the root.
        num_nodes: How many nodes take part.
    """

    node_index: int
    num_nodes: int

    def all_reduce(self, tensors: Any, op: Op = "sum", finished: bool = False) -> int:
        """Reduce across nodes, in place.

        Args:
            tensors: A tensor or nested list/tuple/dict of tensors, the same shapes and
                dtypes on every node.
            op: `"sum"`, `"max"`, `"min"`, or a function `op(acc, x)`.
            finished: This node has run out of data: it takes part, contributing
                nothing (the op's identity), so the others do not hang.

        Returns:
            How many nodes contributed (were not `finished`).
        """
        ...

    def scatter(self, tensors: Any) -> None:
        """Copy the root's values to every node, in place.

        Args:
            tensors: A tensor or nested list/tuple/dict of tensors, the same shapes
                and dtypes on every node.
        """
        ...

    def barrier(self) -> None:
        """Return once every node has reached the barrier."""
        ...

    def close(self) -> None:
        """Leave: finish what is in flight and release the connections."""
        ...


class Completed:
    """The handle of an all-reduce that already ran (a synchronous communicator's).

    Args:
        count: How many nodes contributed, what `wait()` returns.
    """

    __slots__ = ("count",)

    def __init__(self, count: int) -> None:
        self.count = count

    def wait(self) -> int:
        """The contributor count, at once."""
        return self.count

    def is_completed(self) -> bool:
        """Always True."""
        return True

    def __repr__(self) -> str:
        return f"Completed(count={self.count})"


def check_communicator(comm: Any) -> Communicator:
    """Fail early, naming what is missing, rather than at the first collective.

    Args:
        comm: The object to check.

    Returns:
        `comm` itself.

    Raises:
        TypeError: `comm` lacks `node_index`, `num_nodes`, `all_reduce`, `scatter` or
            `barrier`, named.
    """
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


def supports_async(comm: Any) -> bool:
    """Whether `comm.all_reduce` has the asynchronous form (takes `async_op`).

    Args:
        comm: A communicator.

    Returns:
        True where `all_reduce(..., async_op=True)` returns a `Handle`.
    """
    if "all_reduce" in getattr(comm, "__dict__", {}) or not hasattr(type(comm), "all_reduce"):
        return _takes_async_op(comm.all_reduce)  # set on the instance: look every time
    return _class_supports_async(type(comm))


@functools.cache
def _class_supports_async(cls: type) -> bool:
    return _takes_async_op(cls.all_reduce)


def _takes_async_op(method: Callable) -> bool:
    try:
        return "async_op" in inspect.signature(method).parameters
    except (TypeError, ValueError):  # a builtin without a signature
        return False


def start_all_reduce(
    comm: Communicator, tensors: Any, op: Op = "sum", finished: bool = False
) -> Handle:
    """Start an all-reduce and return its handle, whatever the communicator.

    A communicator without the asynchronous form runs it to completion here.

    Args:
        comm: The communicator.
        tensors: What to reduce, in place.
        op: The reduction, as for `Communicator.all_reduce`.
        finished: This node contributes nothing.

    Returns:
        A `Handle`: the communicator's own, or a `Completed` one.
    """
    if supports_async(comm):
        return comm.all_reduce(tensors, op=op, finished=finished, async_op=True)
    return Completed(comm.all_reduce(tensors, op=op, finished=finished))


def check_same_layout(comm: Communicator, tensors: list[torch.Tensor], who: str) -> None:
    """Raise ValueError, on every node alike, unless all nodes hold tensors of the same
    shapes, dtypes and `requires_grad` in the same order: one all-reduce of six integers.

    What DDP checks when it is built. Without it nodes with different models meet in
    collectives of different sizes: gloo then aborts the process from one of its
    threads, and other backends fail on a message that does not say why.

    Args:
        comm: The communicator.
        tensors: This node's tensors, in order.
        who: Names the caller in the error.

    Raises:
        ValueError: The nodes' tensors differ, with the counts on each side.
    """
    layout = ";".join(f"{tuple(t.shape)}:{t.dtype}:{t.requires_grad:d}" for t in tensors)
    digest = hashlib.blake2b(layout.encode(), digest_size=8).digest()
    h = int.from_bytes(digest, "little") >> 1  # 63 bits: fits int64 with its negation
    n, numel = len(tensors), sum(t.numel() for t in tensors)
    device = tensors[0].device if tensors else None  # NCCL reduces only CUDA tensors
    sig = torch.tensor([h, -h, n, -n, numel, -numel], dtype=torch.int64, device=device)
    comm.all_reduce(sig, op="max")
    top = sig.tolist()
    if top[0] != h or -top[1] != h:
        raise ValueError(
            f"{who}: the nodes' models differ (tensors per node: {-top[3]} to {top[2]}, "
            f"elements per node: {-top[5]} to {top[4]}; node {comm.node_index} has {n} "
            f"tensors, {numel} elements): every node must build the same model, with "
            f"the same parameters trainable"
        )
