"""Flatten a nested structure of tensors into one contiguous host buffer per dtype.

A model's 50 parameter tensors then cost one exchange instead of 50, and a
single contiguous CPU tensor is used as is (no copy at all).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from .hostops import copy

__all__ = ["Group", "Nested", "Packed", "flatten"]

Nested = torch.Tensor | list | tuple | dict
_SIGNATURES: dict[tuple, bytes] = {}


def flatten(tensors: Nested, where: str = "tensors") -> list[torch.Tensor]:
    """Leaves of a tensor or nested list/tuple/dict, in a deterministic order."""
    if isinstance(tensors, torch.Tensor):  # the common case, without the walk
        # Detach (0.3 us, a tenth of a small all-reduce's bookkeeping) only where
        # autograd would refuse the in-place write: a tensor that requires grad.
        return [tensors.detach() if tensors.requires_grad else tensors]
    out: list[torch.Tensor] = []

    def walk(obj: object, path: str) -> None:
        if isinstance(obj, torch.Tensor):
            # Detached views share the caller's storage, so results still land in
            # place, while autograd no longer refuses in-place writes into leaves
            # that require grad (model parameters), as torch.distributed allows.
            out.append(obj.detach())
        elif isinstance(obj, dict):
            for k in sorted(obj, key=str):
                walk(obj[k], f"{path}[{k!r}]")
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                walk(v, f"{path}[{i}]")
        else:
            raise TypeError(
                f"{path}: expected a tensor or list/tuple/dict of tensors, got {type(obj)}"
            )

    walk(tensors, where)
    return out


@dataclass(slots=True)
class Group:
    """The tensors of one dtype and the flat buffer that carries them."""

    dtype: torch.dtype
    tensors: list[torch.Tensor]
    flat: torch.Tensor  # 1-D, contiguous, on the CPU (pinned where a tensor is on CUDA)
    aliased: bool  # flat *is* the user's memory: no unpack needed


class Packed:
    """One flat CPU buffer per dtype for a list of tensors; `unpack` writes results back."""

    def __init__(self, leaves: list[torch.Tensor]):
        if len(leaves) == 1:  # the common case (one tensor or bucket) without the loop
            by_dtype = {leaves[0].dtype: leaves}
        else:
            by_dtype = {}
            for t in leaves:
                by_dtype.setdefault(t.dtype, []).append(t)
        self.groups: list[Group] = []
        for dtype, ts in by_dtype.items():
            t = ts[0]
            if len(ts) == 1 and t.is_cpu and t.is_contiguous() and not (t.is_conj() or t.is_neg()):
                # Zero-copy: reduce straight into the caller's tensor (not a lazy
                # conjugate, x.conj(): its memory holds the values before conjugation).
                flat = t if t.dim() == 1 else t.view(-1)
                self.groups.append(Group(dtype, ts, flat, aliased=True))
                continue
            total = sum(t.numel() for t in ts)
            # CUDA tensors are staged in pinned (page-locked) host memory: the copy is
            # then one DMA, where a copy to pageable memory goes through a staging
            # buffer of the driver's, and torch's caching host allocator hands the
            # same pages back every step. (Its gain was not measured on its own: every
            # CUDA run in bench/RESULTS-step-time.md staged through pinned memory.)
            pinned = any(t.is_cuda for t in ts)
            flat = torch.empty(total, dtype=dtype, pin_memory=pinned)
            off = 0
            for t in ts:
                copy(flat[off : off + t.numel()].view(t.shape), t)
                off += t.numel()
            self.groups.append(Group(dtype, ts, flat, aliased=False))

    def signature(self, kind: str) -> bytes:
        """8 bytes that differ when two nodes' collectives would not line up."""
        groups = self.groups
        if len(groups) == 1 and len(groups[0].tensors) == 1:  # one tensor: a cheaper key
            key = (kind, groups[0].dtype, groups[0].tensors[0].shape)
            shapes = ((key[1], key[2]),)
        else:
            shapes = tuple([(g.dtype, *[t.shape for t in g.tensors]) for g in groups])
            key = (kind, shapes)
        sig = _SIGNATURES.get(key)
        if sig is None:
            # The same structure is all-reduced every step: hash it once.
            text = repr((kind, [(str(d), [list(s) for s in ss]) for d, *ss in shapes]))
            sig = hashlib.blake2b(text.encode(), digest_size=8).digest()
            if len(_SIGNATURES) > 4096:
                _SIGNATURES.clear()
            _SIGNATURES[key] = sig
        return sig

    def unpack(self) -> None:
        """Copy the reduced flat buffers back into the caller's tensors."""
        for g in self.groups:
            if g.aliased:
                continue
            off = 0
            for t in g.tensors:
                copy(t, g.flat[off : off + t.numel()].view(t.shape))
                off += t.numel()

    def chunks(self, chunk_bytes: int) -> Iterator[torch.Tensor]:
        """1-D views of at most `chunk_bytes` each, covering every group in order."""
        any_chunk = False
        for g in self.groups:
            step = max(1, chunk_bytes // g.flat.element_size())
            for start in range(0, g.flat.numel(), step):
                any_chunk = True
                yield g.flat[start : start + step]
        if not any_chunk:
            # Nothing to carry (barrier, empty list): one empty chunk keeps the protocol uniform.
            yield torch.empty(0, dtype=torch.uint8)
