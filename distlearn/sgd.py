"""AllReduceSGD: one mini-batch split across nodes, gradients summed by all-reduce."""

from __future__ import annotations

from typing import Any

import torch

from .comm import Communicator, check_communicator
from .tensors import gradients_of, state_of


class AllReduceSGD:
    """Keep N replicas of a model in lock step by all-reducing their gradients.

    A training loop stays a plain single-process loop plus two calls::

        sgd = AllReduceSGD(comm)
        sgd.synchronize_parameters(model)          # everyone starts from the root's weights
        for batch in batcher:                      # this node's share of the data
            loss_fn(model(batch.input), batch.target).backward()
            sgd.sum_and_normalize_gradients(model) # the mean gradient over the nodes
            optimizer.step(); optimizer.zero_grad()
        sgd.synchronize_parameters(model)          # end of epoch: uneven step counts are fine

    Nodes may take different numbers of steps in an epoch: `synchronize_parameters`
    keeps the early finishers taking part (with zeros) until all are done, then gives
    everyone the parameters of the node that took the most steps.
    """

    def __init__(self, comm: Communicator) -> None:
        self.comm = check_communicator(comm)
        self.steps = 0  # gradient steps this node took since the last synchronisation
        # (dtype, device, shape) of the last gradients, so a finished node can keep
        # joining the others' gradient all-reduces with zeros of the same layout.
        self._layout: list[tuple[torch.dtype, torch.device, torch.Size]] | None = None

    def sum_gradients(self, x: Any) -> int:
        """All-reduce (sum) the gradients of `x` in place; returns how many nodes contributed.

        `x` is a module (its parameters' `.grad`), or gradient tensors.
        """
        grads = gradients_of(x)
        n = self.comm.all_reduce(grads)
        self.steps += 1
        self._layout = [(g.dtype, g.device, g.shape) for g in grads]
        return n

    def sum_and_normalize_gradients(self, x: Any) -> int:
        """Sum the gradients, then divide by the number of nodes that contributed this
        step (fewer than `num_nodes` near the end of an uneven epoch)."""
        grads = gradients_of(x)
        n = self.comm.all_reduce(grads)
        if n > 1:
            torch._foreach_div_(grads, float(n))
        self.steps += 1
        self._layout = [(g.dtype, g.device, g.shape) for g in grads]
        return n

    def synchronize_parameters(self, x: Any) -> None:
        """Give every node the same parameters (and, for a module, buffers).

        At the start (nobody has stepped) that is the root's; after an epoch it is the
        parameters of the node that took the most steps (the lowest index among ties).
        Every node must call this at the same point of its loop.
        """
        params = state_of(x)
        self._drain(x)
        # Who took the most steps? One small all-reduce of every node's count.
        device = params[0].device if params else None  # NCCL reduces only CUDA tensors
        steps = torch.zeros(self.comm.num_nodes, dtype=torch.int64, device=device)
        steps[self.comm.node_index] = self.steps
        self.comm.all_reduce(steps)
        self.steps = 0
        self._layout = None
        if int(steps.max()) == 0:
            self.comm.scatter(params)
            return
        winner = int(steps.argmax())  # the first index among ties
        if self.comm.node_index != winner:
            with torch.no_grad():
                for p in params:
                    p.zero_()
        # Everyone else sends zeros, so the sum is exactly the winner's values.
        self.comm.all_reduce(params)

    def _drain(self, x: Any) -> None:
        """Join the gradient all-reduces of nodes still in their epoch, contributing
        zeros, until every node has finished (the count of contributors drops to 0)."""
        if self._layout is None:
            # No step since the last sync: gradients are laid out like the parameters
            # (a module's trainable ones), which is what the other nodes are sending.
            if isinstance(x, torch.nn.Module):
                like = [p for p in x.parameters() if p.requires_grad]
            else:
                like = state_of(x)
            layout = [(t.dtype, t.device, t.shape) for t in like]
        else:
            layout = self._layout
        zeros = [torch.zeros(shape, dtype=dtype, device=device) for dtype, device, shape in layout]
        while self.comm.all_reduce(zeros, finished=True) > 0:
            for z in zeros:
                z.zero_()
