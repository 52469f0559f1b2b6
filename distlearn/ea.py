"""AllReduceEA: elastic averaging SGD (Zhang, Choromanska, LeCun 2015, arXiv:1412.6651)
as one all-reduce per average."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from . import preemption
from .comm import (
    Communicator,
    check_communicator,
    check_same_layout,
    start_all_reduce,
    supports_async,
)
from .tensors import parameters_of, reusable, state_of


def _storage(t: torch.Tensor) -> tuple:
    """Where a tensor's values live: the same for a parameter and its detached view."""
    return (t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride())


class AllReduceEA:
    """Nodes train independently and are pulled towards a shared center every `tau` steps.

    Every node keeps its own copy of the center. Every `tau` steps::

        delta = alpha * (params - center)
        params -= delta
        center += all_reduce(delta)        # the same sum on every node

    so the centers stay identical (up to float rounding, which `synchronize_center`
    removes) with one all-reduce per average and no parameter server. `alpha=0`
    leaves the nodes independent.

    The center, not any node's own parameters, is the model the job produces: evaluate
    and save `ea.center_model(model)`.

    With `overlap=True` and a communicator with the asynchronous all-reduce, an
    average's all-reduce runs while the next steps compute: nothing reads the center
    before the next average (or `center`, `synchronize_*`), which wait for it first.
    The numbers are the same either way. Off by default: on a CPU host whose cores all
    compute, the all-reduce only competes with the steps for them (measured: no gain,
    bench/RESULTS-step-time.md); it can pay where communication has resources of its
    own (a network card, a GPU's NCCL stream).

    Args:
        comm: The communicator (see `AllReduceSGD`).
        tau: Steps between two averages.
        alpha: The elastic pull, in [0, 1].
        overlap: Let an average's all-reduce run during the next steps, where the
            communicator can.

    Raises:
        ValueError: `tau` is not a positive int, or `alpha` is outside [0, 1].
        TypeError: `comm` lacks a communicator's methods.
    """

    def __init__(
        self, comm: Communicator, tau: int = 10, alpha: float = 0.2, *, overlap: bool = False
    ) -> None:
        if not isinstance(tau, int) or tau < 1:
            raise ValueError(f"tau must be a positive int (steps between averages), got {tau!r}")
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1] (the elastic pull), got {alpha!r}")
        self.comm = check_communicator(comm)
        self.tau = tau
        self.alpha = float(alpha)
        self.steps = 0  # steps since the last synchronisation
        self._center: list[torch.Tensor] | None = None
        self._given: list[torch.Tensor] = []  # the tensors averaged (detached views)
        self._from_module = False  # ... in module order: given as an nn.Module
        self._delta: list[torch.Tensor] = []
        self._active: torch.Tensor | None = None
        self.overlap = bool(overlap) and supports_async(comm)
        self._pending: Any = None  # the last average's all-reduce, while in flight

    @property
    def center(self) -> list[torch.Tensor]:
        """This node's copy of the center, one tensor per parameter.

        Raises:
            RuntimeError: Before the first call that averages or synchronizes.
        """
        if self._center is None:
            raise RuntimeError("the center exists after the first AllReduceEA call")
        self._land()
        return self._center

    def _land(self, ask_active: bool = False) -> bool:
        """Wait for the average in flight, if any, and move the center by its sum;
        with `ask_active`, returns whether any node was still active in it (a read
        back to the host: on CUDA a sync, which only the end of an epoch needs). The
        stop flag (distlearn.preemption) is handed on unread."""
        if self._pending is None:
            return False
        handle, self._pending = self._pending, None
        handle.wait()
        with torch.no_grad():
            torch._foreach_add_(self._center, self._delta)
        # (read when asked, not here: no sync)
        preemption.observe(self._active[1:], self._active[:1], self.comm.num_nodes)
        return ask_active and bool(self._active[0].real.item() > 0)

    def center_model(self, model: nn.Module) -> nn.Module:
        """A copy of `model` whose parameters are the center.

        The model to evaluate or save (after `synchronize_center`, the same on every
        node). Buffers (BatchNorm statistics) are this node's: elastic averaging
        averages parameters only. `model` itself is left as it is and keeps training.

        Args:
            model: The module this AllReduceEA averages.

        Returns:
            A new module holding the center.

        Raises:
            TypeError: `model` is not an `nn.Module`.
        """
        if not isinstance(model, nn.Module):
            raise TypeError(f"center_model needs an nn.Module, got {type(model).__name__}")
        center = [self.center[i] for i in self._center_order(list(model.parameters()))]
        out = copy.deepcopy(model)
        out.zero_grad(set_to_none=True)  # the copy is for inference or saving, not training
        with torch.no_grad():
            for p, c in zip(out.parameters(), center, strict=True):
                p.copy_(c)
        return out

    def _center_order(self, params: list[torch.Tensor]) -> list[int]:
        """For each of `model`'s parameters, its place in the center.

        By memory first: the tensors averaged may have come as a dict (walked in sorted
        key order: "10" before "2") or a list in any order. Otherwise (the model was
        moved or copied) in module order, which only a module's own average had."""
        self.center  # noqa: B018 (raises before the first call)
        where = {_storage(t): i for i, t in enumerate(self._given)}
        order = [where.get(_storage(p.detach())) for p in params]
        if len(params) == len(where) and None not in order:
            return order  # type: ignore[return-value]
        fits = len(params) == len(self._center) and all(
            p.shape == c.shape for p, c in zip(params, self._center, strict=True)
        )
        if self._from_module and fits:
            return list(range(len(params)))
        raise ValueError(
            "center_model: the model's parameters are not those being averaged"
            + ("" if self._from_module else
               " (AllReduceEA was given tensors, not this module: pass the module itself "
               "to average_parameters, or rebuild the model from `center`)")
        )  # fmt: skip

    def _init(self, params: list[torch.Tensor], x: Any) -> None:
        if self._center is None:
            # The first call of any method, on every node: its first collective.
            check_same_layout(self.comm, params, "AllReduceEA")
            # What center_model maps a module's parameters through (see _center_order).
            self._given = list(params)
            self._from_module = isinstance(x, nn.Module)
            with torch.no_grad():
                self._center = [p.detach().clone() for p in params]
                self._delta = [torch.zeros_like(p) for p in params]
            # 0/1: is this node still in its epoch? And was it asked to stop
            # (distlearn.preemption)? They ride in the delta all-reduce (same dtype as the
            # first parameter, so a packing communicator sends one buffer).
            self._active = torch.zeros(2, dtype=params[0].dtype, device=params[0].device)
        elif len(params) != len(self._center) or any(
            p.shape != c.shape for p, c in zip(params, self._center, strict=True)
        ):
            raise ValueError("AllReduceEA was given different parameters than on its first call")

    def _average(self, params: list[torch.Tensor], active: bool, wait: bool = True) -> bool:
        """One elastic average; returns whether any node was still active in it (with
        `wait=False` it returns at once, and the center moves when it lands)."""
        self._land()
        center, delta = self._center, self._delta
        with torch.no_grad():
            torch._foreach_copy_(delta, params)
            torch._foreach_sub_(delta, center)
            torch._foreach_mul_(delta, self.alpha)
            torch._foreach_sub_(params, delta)
            self._active[0].fill_(1 if active else 0)
            self._active[1].fill_(preemption.local_flag())
        # The flag rides with the deltas: a node that finished its epoch still sends
        # its real delta (it keeps averaging) but does not count as active.
        self._pending = start_all_reduce(self.comm, [*delta, self._active])
        return True if not wait else self._land(ask_active=True)

    def average_parameters(self, x: Any) -> None:
        """Call once per training step; every `tau`-th call averages with the center.

        Args:
            x: A module, an iterable of tensors, or a dict: the same on every call.

        Raises:
            ValueError: Other parameters than on the first call.
        """
        params = parameters_of(x)
        self._init(params, x)
        self.steps += 1
        if self.steps % self.tau == 0:
            self._average(params, active=True, wait=False)
            if not self.overlap:
                self._land()

    def _handle_uneven_steps(self, params: list[torch.Tensor]) -> None:
        # Nodes that took fewer averaging steps keep averaging (as "finished") until
        # every node has arrived, so all centers receive the same sequence of sums. The
        # last round, with everyone finished, is one more complete elastic average.
        self._land()
        while self._average(params, active=False):
            pass
        self.steps = 0

    def synchronize_center(self, x: Any) -> None:
        """End of epoch: wait out the nodes with more steps, then give every node the
        root's center, bit for bit (erasing float drift).

        Args:
            x: The parameters, as given to `average_parameters`.
        """
        params = parameters_of(x)
        self._init(params, x)
        self._handle_uneven_steps(params)
        self.comm.scatter(self._center)

    def synchronize_parameters(self, x: Any) -> None:
        """Give every node the root's parameters (and a module's buffers) and reset the
        center to them.

        Call it at the start, or whenever the replicas must agree exactly.

        Args:
            x: A module, an iterable of tensors, or a dict.
        """
        x = reusable(x)
        params = parameters_of(x)
        self._init(params, x)
        self._handle_uneven_steps(params)
        self.comm.scatter(state_of(x))
        with torch.no_grad():
            torch._foreach_copy_(self._center, params)
