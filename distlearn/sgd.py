"""AllReduceSGD: one mini-batch split across nodes, gradients summed by all-reduce."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from . import preemption
from .buckets import GradientBuckets, _zero_at, compressed_scale, wire_dtype
from .comm import Communicator, check_communicator, check_same_layout, supports_async
from .state import broadcast_state_dict, from_node
from .tensors import grad_or_zeros, gradient_holders, gradients_of, leaves, reusable, state_of

_MiB = 1 << 20
_WIRE_DTYPES = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}

# The buckets whose hooks are live on a module: the most recent AllReduceSGD's to see
# it, so an AllReduceSGD made again for the same model does not start every bucket
# twice. Weakly: buckets (and their hooks) go with their AllReduceSGD, or a model
# trained on alone would keep starting all-reduces that no other node joins.
_OWNERS: weakref.WeakKeyDictionary[nn.Module, weakref.ref[GradientBuckets]] = (
    weakref.WeakKeyDictionary()
)


def _owner(module: nn.Module) -> GradientBuckets | None:
    ref = _OWNERS.get(module)
    return ref() if ref is not None else None


def _check_grad_dtype(grad_dtype: Any) -> torch.dtype | None:
    if grad_dtype is None or grad_dtype in (torch.bfloat16, torch.float16):
        return grad_dtype
    if isinstance(grad_dtype, str) and grad_dtype in _WIRE_DTYPES:
        return _WIRE_DTYPES[grad_dtype]
    raise ValueError(
        f"grad_dtype must be None, torch.bfloat16 or torch.float16 (or one of "
        f"{sorted(_WIRE_DTYPES)}), got {grad_dtype!r}"
    )


def _positive_bytes(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive number of bytes, got {value!r}")
    return value


class AllReduceSGD:
    """Keep N replicas of a model in lock step by all-reducing their gradients.

    A training loop stays a plain single-process loop plus two calls::

        sgd = AllReduceSGD(comm)
        sgd.synchronize_parameters(model)          # everyone starts from the root's weights
        for batch in batcher:                      # this node's share of the data
            loss_fn(model(batch.input), batch.target).backward()
            sgd.sum_and_normalize_gradients(model) # the mean gradient over the nodes
            optimizer.step(); optimizer.zero_grad()
        sgd.synchronize_parameters(model, optimizer)  # end of epoch: uneven steps are fine

    Given a module and a communicator with the asynchronous all-reduce (the `ipc` tree,
    TorchDistributed), the gradients are all-reduced in buckets while backward is still
    running (distlearn.buckets), as DDP does; `sum_and_normalize_gradients` waits for
    the last bucket. Otherwise (tensors, `overlap=False`, XLA) it all-reduces every
    gradient in one call after backward. The results are the same either way.

    A parameter that no contributing node had a `.grad` for (a branch nobody's batch
    took) keeps `.grad = None` after the sum, as in one process on the whole batch and
    under DDP, so optimizers skip it; one that some nodes used gets the mean, with
    zeros from the others.

    Nodes may take different numbers of steps in an epoch: `synchronize_parameters`
    keeps the early finishers taking part (with zeros) until all are done, then gives
    everyone the parameters (and, given the optimizer, its state) of the node that took
    the most steps.

    Args:
        comm: The communicator: an `ipc.Tree`, `backends.TorchDistributed` or
            `backends.XLA` (anything with `distlearn.Communicator`'s methods).
        overlap: All-reduce buckets during backward where the communicator can (its
            `all_reduce` takes `async_op`) and a module is given; False sends every
            gradient in one call after backward.
        bucket_bytes: The size of a gradient bucket.
        first_bucket_bytes: The size of the first bucket, smaller so that
            communication starts early in backward.
        grad_dtype: `torch.bfloat16` or `torch.float16` (or `"bf16"`, `"fp16"`...):
            float gradients travel in half the bytes; None sends them as they are.

    Raises:
        TypeError: `comm` lacks a communicator's methods.
        ValueError: A byte size that is not a positive int, or another `grad_dtype`.
    """

    def __init__(
        self,
        comm: Communicator,
        *,
        overlap: bool = True,
        bucket_bytes: int = 25 * _MiB,
        first_bucket_bytes: int = 1 * _MiB,
        grad_dtype: torch.dtype | str | None = None,
    ) -> None:
        self.comm = check_communicator(comm)
        self.bucket_bytes = _positive_bytes("bucket_bytes", bucket_bytes)
        self.first_bucket_bytes = _positive_bytes("first_bucket_bytes", first_bucket_bytes)
        self.grad_dtype = _check_grad_dtype(grad_dtype)
        # Overlap needs a module to hook and a communicator that returns at once.
        self.overlap = bool(overlap) and supports_async(comm)
        self.steps = 0  # gradient steps this node took since the last synchronisation
        # (dtype, device, shape) of the last gradients as sent, so a finished node can
        # keep joining the others' gradient all-reduces with zeros of the same layout.
        self._layout: list[tuple[torch.dtype, torch.device, torch.Size]] | None = None
        # The parameters the last sum since the last synchronisation took (the plain path),
        # by id (a tensor's == is elementwise, so no set of tensors).
        self._owners: dict[int, weakref.ref] = {}
        self._buckets: weakref.WeakKeyDictionary[nn.Module, GradientBuckets] = (
            weakref.WeakKeyDictionary()
        )
        self._no_sync = 0
        self._layout_checked = False
        # Elements that ride every step's gradient all-reduce after the flags (set before
        # the first step): `rider.size` of them, `rider.fill(view)`, `rider.read(values)`.
        # distlearn.survivors keeps every rank's data position in them.
        self.rider: Any = None

    def _check_layout(self, x: Any) -> None:
        """The first collective of this AllReduceSGD on every node, whichever call makes
        it (synchronize_parameters at the start, a first step, a drain): the nodes'
        models must match (comm.check_same_layout)."""
        if not self._layout_checked:
            held = [*x.parameters(), *x.buffers()] if isinstance(x, nn.Module) else leaves(x)
            check_same_layout(self.comm, held, "AllReduceSGD")
            self._layout_checked = True

    # -- gradients ----------------------------------------------------------------------

    def sum_gradients(self, x: Any) -> int:
        """All-reduce (sum) the gradients of `x` in place.

        Args:
            x: A module (its parameters' `.grad`), or gradient tensors (a tensor that
                requires grad stands for its `.grad`).

        Returns:
            How many nodes contributed (those not finished with their epoch).

        Raises:
            ValueError: The nodes' models differ, a sparse gradient, or a trainable set
                changed on some nodes only.
        """
        return self._reduce(x, normalize=False)

    def sum_and_normalize_gradients(self, x: Any) -> int:
        """Sum the gradients, then divide by the number of nodes that contributed.

        Fewer than `num_nodes` contribute near the end of an uneven epoch; the mean is
        over those that did. Call it after `backward()` and before `optimizer.step()`.

        Args:
            x: A module (its parameters' `.grad`), or gradient tensors.

        Returns:
            How many nodes contributed.

        Raises:
            ValueError: As for `sum_gradients`.
        """
        return self._reduce(x, normalize=True)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation: backward passes inside only accumulate into `.grad`.

        The next backward outside (or the next `sum_*_gradients`) sends the total. Like
        DDP's `no_sync()`. Without it, accumulating several backward passes still gives
        the right sum, but sends the gradients more than once.

        Returns:
            A context manager.
        """
        self._no_sync += 1
        self._set_syncing()
        try:
            yield
        finally:
            self._no_sync -= 1
            self._set_syncing()

    @property
    def stats(self) -> dict:
        """How the gradients travelled.

        Returns:
            `overlap` (whether buckets are started during backward), and under
            `modules`, for each hooked module, its bucket sizes in bytes, steps, buckets
            started during backward and steps resent.
        """
        modules = [
            {
                "module": type(module).__name__,
                "bucket_bytes": [b.flat.numel() * b.flat.element_size() for b in buckets.buckets],
                **buckets.stats,
            }
            for module, buckets in self._buckets.items()
        ]
        return {"overlap": self.overlap, "modules": modules}

    def _set_syncing(self) -> None:
        for buckets in self._buckets.values():
            buckets.syncing = self._no_sync == 0

    def _buckets_for(self, x: Any) -> GradientBuckets | None:
        """The buckets of module `x` (hooked on first sight), or None: the plain path."""
        if not self.overlap or not isinstance(x, nn.Module):
            return None
        buckets = self._buckets.get(x)
        if buckets is None:
            if not any(p.requires_grad for p in x.parameters()):
                return None
            previous = _owner(x)
            if previous is not None:
                previous.remove_hooks()
            buckets = GradientBuckets(
                x, self.comm, self.bucket_bytes, self.first_bucket_bytes, self.grad_dtype,
                self.rider,
            )  # fmt: skip
            buckets.syncing = self._no_sync == 0
            self._buckets[x] = buckets
            _OWNERS[x] = weakref.ref(buckets)
        elif _owner(x) is not buckets:
            raise RuntimeError(
                "a newer AllReduceSGD has taken over this module's gradient hooks; "
                "use one AllReduceSGD per model"
            )
        return buckets

    def _reduce(self, x: Any, normalize: bool) -> int:
        x = reusable(x)
        self._check_layout(x)
        buckets = self._buckets_for(x)
        if buckets is not None:
            n = buckets.finish_step(normalize)
        else:
            n = self._reduce_plain(x, normalize)
        self.steps += 1
        return n

    def _wire(self, dtype: torch.dtype) -> torch.dtype:
        return wire_dtype(dtype, self.grad_dtype)

    def _took(self, p: torch.Tensor) -> bool:
        """Whether the last sum took `p` (the plain path)."""
        ref = self._owners.get(id(p))
        return ref is not None and ref() is p

    def _reduce_plain(self, x: Any, normalize: bool) -> int:
        """Every gradient in one all-reduce, after backward (converted for `grad_dtype`).

        One more tensor travels with them: for each parameter, how many nodes had a
        `.grad`. One that no contributing node had stays None, as it would in one
        process on the whole batch (and under DDP), so the optimizer skips it instead
        of stepping on zeros (momentum, weight decay and Adam would move it).
        """
        holders = gradient_holders(x)
        # Parameters that stopped requiring grad since the last sum (after backward, say)
        # are summed once more: the optimizer still steps on their `.grad`, which must be
        # the mean, as in one process and under DDP (and as the buckets do), not this
        # node's own. Every node's last sum had the same parameters, so they agree.
        params = x.parameters() if isinstance(x, nn.Module) else ()
        frozen = [p for p in params if not p.requires_grad and self._took(p)]
        owners = [t for t in holders if t.requires_grad] + frozen
        had = [t.grad is not None for t in owners]
        grads = gradients_of(holders) + [grad_or_zeros(p) for p in frozen]
        wires = [self._wire(g.dtype) for g in grads]
        nodes = self.comm.num_nodes
        scales = [compressed_scale(g.dtype, w, nodes) for g, w in zip(grads, wires, strict=True)]
        aliased = all(w == g.dtype for w, g in zip(wires, grads, strict=True))
        with torch.no_grad():
            if aliased:
                sent = list(grads)
            else:
                sent = [torch.empty_like(g, dtype=w) for g, w in zip(grads, wires, strict=True)]
                for t, g, s in zip(sent, grads, scales, strict=True):
                    torch.mul(g, s, out=t)
            extra = self.rider.size if self.rider is not None else 0
            k = len(owners)
            if owners:  # in the first tensor's dtype and device: the same collective
                # Made on the device, not copied from the host (on CUDA, a sync); more
                # elements: the nodes asked to stop (distlearn.preemption), a rider's.
                flags = torch.ones(k + 1 + extra, dtype=wires[0], device=grads[0].device)
                flags[k:].zero_()
                flags[k].fill_(preemption.local_flag())
                if extra:
                    self.rider.fill(flags[k + 1 :])
                if not all(had):
                    _zero_at(flags, [j for j, mine in enumerate(had) if not mine])
                sent.append(flags)
            n = self.comm.all_reduce(sent)
            if owners:
                preemption.observe(flags[k : k + 1], n, nodes)
                if extra:
                    self.rider.read(flags[k + 1 :].tolist())
            divisor = n if normalize and n > 1 else 1
            if aliased:
                if divisor > 1:
                    torch._foreach_div_(grads, float(divisor))
            else:
                for g, t, s in zip(grads, sent, scales, strict=False):  # (sent: + flags)
                    g.copy_(t).mul_(1.0 / s / divisor)
        if not all(had):  # only a parameter this node had no .grad for can stay None
            for t, mine, total in zip(owners, had, sent[-1].tolist()[:k], strict=True):
                if not mine and total == 0:
                    t.grad = None
        self._layout = [(t.dtype, t.device, t.shape) for t in sent]
        self._owners = {id(t): weakref.ref(t) for t in holders if t.requires_grad}
        return n

    # -- parameters ---------------------------------------------------------------------

    def synchronize_parameters(self, x: Any, optimizer: Any = None) -> None:
        """Give every node the same parameters (and, for a module, buffers).

        At the start (nobody has stepped) that is the root's; after an epoch it is the
        parameters of the node that took the most steps (the lowest index among ties).
        A node that gets here first keeps joining the others' gradient all-reduces
        until every node has. Every node must call this at the same point of its loop.

        Pass the `optimizer` when it keeps state (momentum, Adam's moments): every node
        then gets that same node's optimizer state too. A node that took fewer steps
        never ran the optimizer on the steps it sat out, so without it its momentum
        differs from the others', and the replicas drift apart again in the next epoch.

        Args:
            x: A module, an iterable of tensors (`model.parameters()`), or a dict.
            optimizer: This node's optimizer over `x`'s parameters (anything with
                `state_dict` and `load_state_dict`), or None to leave it alone.

        Raises:
            ValueError: The nodes' models differ (shapes, dtypes, trainable parameters).
            TypeError: `optimizer` has no `state_dict` / `load_state_dict`.
        """
        if optimizer is not None and not (
            callable(getattr(optimizer, "state_dict", None))
            and callable(getattr(optimizer, "load_state_dict", None))
        ):
            raise TypeError(
                f"optimizer must have state_dict() and load_state_dict() (a torch.optim "
                f"optimizer), got {type(optimizer).__name__}"
            )
        x = reusable(x)
        self._check_layout(x)
        params = state_of(x)
        self._drain(x)
        # Who took the most steps? One small all-reduce of every node's count.
        device = params[0].device if params else None  # NCCL reduces only CUDA tensors
        steps = torch.zeros(self.comm.num_nodes, dtype=torch.int64, device=device)
        steps[self.comm.node_index] = self.steps
        self.comm.all_reduce(steps)
        self.steps = 0
        self._layout = None
        self._owners = {}
        winner = int(steps.argmax())  # the first index among ties; the root if none stepped
        from_node(self.comm, params, winner)
        if optimizer is not None:
            mine = optimizer.state_dict() if self.comm.node_index == winner else None
            state = broadcast_state_dict(self.comm, mine, device=device, src=winner)
            if self.comm.node_index != winner:
                optimizer.load_state_dict(state)

    def _drain(self, x: Any) -> None:
        """Join the gradient all-reduces of nodes still in their epoch, contributing
        zeros, until every node has finished (the count of contributors drops to 0)."""
        buckets = self._buckets_for(x)
        if buckets is not None:
            # The same sequence of bucket all-reduces as a step, as a finished node.
            while buckets.finish_step(normalize=False, contribute=False) > 0:
                pass
            return
        if self._layout is None:
            # No step since the last sync: gradients are laid out like the parameters
            # (a module's trainable ones), which is what the other nodes are sending,
            # and their flags (_reduce_plain).
            like = gradient_holders(x)
            layout = [(self._wire(t.dtype), t.device, t.shape) for t in like]
            owners = sum(t.requires_grad for t in like)
            extra = self.rider.size if self.rider is not None else 0
            if owners:  # (and the stop flag, a rider's elements)
                layout.append((layout[0][0], layout[0][1], torch.Size([owners + 1 + extra])))
        else:
            layout = self._layout
        if not layout:
            return  # nothing to send (a frozen module): no node can be stepping it
        zeros = [torch.zeros(shape, dtype=dtype, device=device) for dtype, device, shape in layout]
        extra = self.rider.size if self.rider is not None else 0
        flags = zeros[-1]
        k = len(flags) - 1 - extra  # (the per-parameter counts, then the stop flag)
        while (n := self.comm.all_reduce(zeros, finished=True)) > 0:
            preemption.observe(flags[k : k + 1], n, self.comm.num_nodes)  # the others' flags
            if extra:
                self.rider.read(flags[k + 1 :].tolist())
            for z in zeros:
                z.zero_()
