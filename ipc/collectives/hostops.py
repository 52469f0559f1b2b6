"""Copies and reductions of host tensors on the calling thread alone.

The nodes of a host already work in parallel: each reduces its own slice of a
collective and waits for the others at a barrier. A torch op on more than
`GRAIN` elements also runs on the process's intra-op (OpenMP) pool, whose
workers spin for a while after each op; with as many torch threads as cores, the
spinning workers take the cores that the peer nodes need to reach the barrier.
Measured: 2 nodes of 2 torch threads on 2 cores all-reduced 38 MB in 60 ms
instead of 5.4 ms (6.7 ms with OMP_WAIT_POLICY=PASSIVE); on a 16-core GPU host
with 8 threads a process, the tree's overlapped step took 2.3x DDP's.

So the tree's data path uses these instead of `Tensor.copy_` and `add_`:
numpy's `copyto` and ufuncs run on the calling thread, release the GIL and are as
fast as torch's single-threaded kernels. numpy adds float16 35x slower than torch
and has no bfloat16: those reduce with torch, in pieces of fewer than `GRAIN`
elements, which torch runs on the calling thread. Tensors off the host (CUDA) go
to torch as they are.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

__all__ = ["GRAIN", "Reduce", "add", "copy", "maximum", "minimum"]

# at::internal::GRAIN_SIZE: torch runs an elementwise op on fewer elements inline.
GRAIN = 32768
# A copy moves bits: any dtype is viewed as the integer of its width.
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# Where numpy's arithmetic is as fast as torch's (float16's is not).
_NUMPY_MATH = frozenset(
    {
        torch.float32,
        torch.float64,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.uint8,
        torch.bool,
    }
)

Reduce = Callable[[torch.Tensor, torch.Tensor], None]


def _plain(t: torch.Tensor) -> bool:
    """Host memory numpy can see as it is (no lazy conjugate or negation)."""
    return t.is_cpu and not (t.is_conj() or t.is_neg())


def copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """`dst.copy_(src)` for two tensors of the same shape."""
    # Below GRAIN torch copies inline, 1-2 us sooner than numpy through its views.
    if dst.numel() >= GRAIN and dst.dtype == src.dtype and _plain(dst) and _plain(src):
        bits = _BITS.get(dst.element_size())
        if bits is not None:
            np.copyto(dst.view(bits).numpy(), src.view(bits).numpy())
            return
    dst.copy_(src)


def _elementwise(ufunc: np.ufunc, inplace: Reduce) -> Reduce:
    """`acc = op(acc, src)` on two 1-D tensors of one dtype, on the calling thread."""

    def apply(acc: torch.Tensor, src: torch.Tensor) -> None:
        if acc.numel() < GRAIN or not (_plain(acc) and _plain(src)):
            inplace(acc, src)  # inline below GRAIN, and sooner than numpy's views
        elif acc.dtype in _NUMPY_MATH:
            a = acc.numpy()
            ufunc(a, src.numpy(), out=a)
        else:
            for s in range(0, acc.numel(), GRAIN):
                inplace(acc[s : s + GRAIN], src[s : s + GRAIN])

    return apply


add = _elementwise(np.add, lambda acc, src: acc.add_(src))
maximum = _elementwise(np.maximum, lambda acc, src: torch.maximum(acc, src, out=acc))
minimum = _elementwise(np.minimum, lambda acc, src: torch.minimum(acc, src, out=acc))
