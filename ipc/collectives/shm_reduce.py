"""The reductions of a same-host collective: over the slots, or read out of the peers.

Small buffers (up to SMALL) are reduced by every node on its own, folding every node's
slot in the same order (identical bits everywhere). Large ones are reduced in
parallel: node i reduces the i-th slice, publishes it in its slot, and after a barrier
everyone gathers the slices. Where the host lets processes read each other's memory
(ipc.collectives.cma), node i reads its slice straight out of the peers' tensors.
"""

from __future__ import annotations

import torch

from ..errors import PeerError
from . import cma
from .hostops import copy
from .shm_layout import ADDRESSES, addresses

__all__ = ["ReduceMixin"]

# The sliced reduction works through its slice in pieces of this size, so the
# accumulator stays in the core's L2 cache from the first add to the publish
# (measured: 9.6 ms instead of 15 ms for a 16 MiB slice and 3 peers).
REDUCE_CHUNK = 256 << 10
# A sliced reduction of several groups (a fused run of queued buckets) gathers after
# every this many bytes of groups, behind a barrier of their own, instead of once at
# the end: the slices the peers just published are then still in the shared cache
# (8 fused buckets of 4 MiB, 2 nodes: gathering once at the end made them slower
# than 8 calls in a row).
GATHER_BYTES = 4 << 20


class ReduceMixin:
    """`SharedMemoryGroup`'s copies into the slots and its reductions. It reads the
    group's `node`, `n`, `capacity`, `_slots`, `_ctl` and `_pids`; it keeps
    `_views_cache` and `_scratches`, and calls the group's `barrier` between the
    reduction and the gather of each run of groups."""

    def _views(self, parity: int, off: int, g: torch.Tensor) -> list[torch.Tensor]:
        """Every node's copy of group `g` (at `off` in the `parity` half of its slot)."""
        key = (parity, off, g.numel(), g.dtype)
        views = self._views_cache.get(key)
        if views is None:
            # The same layout comes back every step: slicing and viewing a tensor
            # costs microseconds, which is most of a small all-reduce.
            if len(self._views_cache) > 4096:
                self._views_cache.clear()
            start = parity * self.capacity + off
            stop = start + g.numel() * g.element_size()
            views = self._views_cache[key] = [
                slot[start:stop].view(g.dtype) for slot in self._slots
            ]
        return views

    def _bounds(self, numel: int, i: int) -> tuple[int, int]:
        """Node i's slice of a group in the sliced reduction."""
        step = -(-numel // self.n)
        return min(numel, i * step), min(numel, (i + 1) * step)

    def _copy_in(self, groups, offsets, parity: int, sliced: bool) -> None:
        for g, off in zip(groups, offsets, strict=True):
            dst = self._views(parity, off, g)[self.node]
            if not sliced:
                copy(dst, g)
                continue
            # Only the slices other nodes reduce: ours never needs to leave our tensor.
            lo, hi = self._bounds(g.numel(), self.node)
            copy(dst[:lo], g[:lo])
            copy(dst[hi:], g[hi:])

    def _reduce_all(self, groups, offsets, parity, contributors, reduce) -> None:
        # Every node folds all slots in the same order: identical bits everywhere.
        for g, off in zip(groups, offsets, strict=True):
            views = self._views(parity, off, g)
            copy(g, views[contributors[0]])
            for j in contributors[1:]:
                reduce(g, views[j])

    def _reduce_sliced(self, groups, offsets, parity, contributors, reduce, direct) -> None:
        # Node i reduces slice i of every group in its own tensor, publishes it in
        # its slot, and after a barrier everyone gathers the other slices. The
        # peers' slices come from their slots or, `direct`, straight out of their
        # tensors (ipc.collectives.cma: they skipped the copy into their slots), piece by piece
        # into a scratch buffer that stays in cache.
        me = self.node
        if direct:
            ctl = self._ctl
            addrs = [ADDRESSES.unpack_from(ctl, addresses(j, parity)) for j in range(self.n)]
        peers = [j for j in contributors if j != me]
        reduced, reduced_bytes = [], 0  # groups reduced but not yet gathered
        for gi, (g, off) in enumerate(zip(groups, offsets, strict=True)):
            lo, hi = self._bounds(g.numel(), me)
            slots = self._views(parity, off, g)
            mine = slots[me]
            es = g.element_size()
            if direct:
                tmp = self._scratch(g.dtype)
            else:
                views = [slots[j] for j in peers]
            step = max(1, REDUCE_CHUNK // es)
            for s in range(lo, hi, step):
                e = min(hi, s + step)
                acc = g[s:e]
                for k, j in enumerate(peers):
                    if direct:
                        src = tmp[: e - s]
                        self._read(j, addrs[j][gi] + s * es, src.data_ptr(), (e - s) * es)
                    else:
                        src = views[k][s:e]
                    if k == 0 and me not in contributors:  # we add nothing: start from j's
                        copy(acc, src)
                    else:
                        reduce(acc, src)
                copy(mine[s:e], acc)  # still in cache: publishing it is nearly free
            reduced.append((g, off))
            reduced_bytes += g.numel() * es
            # Every node has the same groups: all take this barrier at the same group.
            if reduced_bytes >= GATHER_BYTES or gi == len(groups) - 1:
                self.barrier()
                self._gather(reduced, parity)
                reduced, reduced_bytes = [], 0

    def _gather(self, groups: list[tuple[torch.Tensor, int]], parity: int) -> None:
        """Copy the slices the other nodes reduced and published into our groups."""
        for g, off in groups:
            slots = self._views(parity, off, g)
            for j in range(self.n):
                lo, hi = self._bounds(g.numel(), j)
                if j != self.node and lo < hi:
                    copy(g[lo:hi], slots[j][lo:hi])

    def _scratch(self, dtype: torch.dtype) -> torch.Tensor:
        """A REDUCE_CHUNK-byte buffer of `dtype` for one piece of a peer's slice."""
        tmp = self._scratches.get(dtype)
        if tmp is None:
            raw = torch.empty(REDUCE_CHUNK, dtype=torch.uint8)
            tmp = self._scratches[dtype] = raw.view(dtype)
        return tmp

    def _read(self, j: int, remote: int, local: int, nbytes: int) -> None:
        try:
            cma.read(self._pids[j], remote, local, nbytes)
        except OSError as err:
            raise PeerError(
                f"node {self.node}: cannot read node {j}'s tensor (pid {self._pids[j]}): "
                f"{err.strerror or err}; did it die?",
                node=j,
            ) from None
