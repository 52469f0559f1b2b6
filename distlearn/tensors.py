"""Turn what users pass (a module, tensors, nested lists/dicts) into flat lists of tensors.

Every communicator and algorithm walks structures the same way, so two nodes that
pass structures built by the same code exchange the same tensors in the same order.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

__all__ = [
    "check_dense",
    "gradient_holders",
    "gradients_of",
    "leaves",
    "parameters_of",
    "reusable",
    "state_of",
]


def _sorted_keys(mapping: Mapping) -> list:
    # Sorted, so dicts built in a different order on different nodes still line up;
    # keys that cannot be compared (mixed types) keep their insertion order.
    try:
        return sorted(mapping)
    except TypeError:
        return list(mapping)


def leaves(tensors: Any) -> list[torch.Tensor]:
    """The tensors of a tensor or a nested list/tuple/dict of tensors, in a fixed order."""
    out: list[torch.Tensor] = []

    def walk(x: Any, path: str) -> None:
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, Mapping):
            for key in _sorted_keys(x):
                walk(x[key], f"{path}[{key!r}]")
        elif isinstance(x, (list, tuple)):
            for i, item in enumerate(x):
                walk(item, f"{path}[{i}]")
        else:
            raise TypeError(
                f"expected a tensor or a nested list/tuple/dict of tensors, "
                f"found {type(x).__name__} at {path or 'the top level'}"
            )

    walk(tensors, "")
    return out


def reusable(x: Any) -> Any:
    """`x`, or the list of what it yields when it is a one-shot iterable (the generator
    `model.parameters()`): the algorithms walk what they are given more than once."""
    if isinstance(x, (nn.Module, torch.Tensor, Mapping, list, tuple)):
        return x
    if isinstance(x, Iterable):
        return list(x)
    return x  # (refused, with its type named, by the walk)


def _as_list(x: Any, what: str) -> list:
    x = reusable(x)  # (e.g. model.parameters(), a generator)
    if isinstance(x, (torch.Tensor, Mapping, list, tuple)):
        return leaves(x)
    raise TypeError(f"{what}: expected an nn.Module, a tensor or tensors, found {type(x).__name__}")


def parameters_of(x: Any) -> list[torch.Tensor]:
    """The trainable state of `x`: a module's parameters, or the tensors given.

    Detached (same storage, no autograd), so any communicator may write into them in
    place without tripping autograd's check on leaves that require grad.
    """
    if isinstance(x, nn.Module):
        return [p.detach() for p in x.parameters()]
    return [t.detach() for t in _as_list(x, "parameters")]


def state_of(x: Any) -> list[torch.Tensor]:
    """What must match across nodes: a module's parameters and buffers (e.g. BatchNorm
    running statistics), or the tensors given; detached like `parameters_of`."""
    if isinstance(x, nn.Module):
        return [t.detach() for t in (*x.parameters(), *x.buffers())]
    return [t.detach() for t in _as_list(x, "parameters")]


def check_dense(grad: torch.Tensor, of: torch.Tensor) -> None:
    """Gradients are summed as dense buffers: say so, naming the parameter's shape,
    where a sparse one (nn.Embedding(sparse=True)) would otherwise fail deep in a copy."""
    if grad.layout != torch.strided:
        raise ValueError(
            f"AllReduceSGD sums dense gradients; the parameter of shape {tuple(of.shape)} "
            f"has a {grad.layout} gradient (nn.Embedding or EmbeddingBag with "
            f"sparse=True?): make it dense (sparse=False)"
        )


def gradient_holders(x: Any) -> list[torch.Tensor]:
    """What `gradients_of(x)` takes each gradient from, in the same order: a module's
    parameters that require grad, or the tensors given (not detached)."""
    if isinstance(x, nn.Module):
        return [p for p in x.parameters() if p.requires_grad]
    return _as_list(x, "gradients")


def gradients_of(x: Any) -> list[torch.Tensor]:
    """The gradients to all-reduce for `x`.

    A module gives the `.grad` of every parameter that requires grad; a missing `.grad`
    (a parameter this node's batch did not reach) becomes zeros, so every node sends
    the same list. A tensor that requires grad (an `nn.Parameter`, say) also stands for
    its `.grad`, because summing parameters where gradients were meant would silently
    ruin training. Other tensors are the gradients themselves.
    """
    grads = []
    for p in gradient_holders(x):
        if p.requires_grad:
            grads.append(grad_or_zeros(p))
        else:
            check_dense(p, p)
            grads.append(p)
    return grads


def grad_or_zeros(p: torch.Tensor) -> torch.Tensor:
    """`p.grad`, made zeros where missing (checked dense)."""
    if p.grad is None:
        p.grad = torch.zeros_like(p)
    check_dense(p.grad, p)
    return p.grad
