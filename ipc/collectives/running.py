"""How a `Tree` runs a collective: queued or inline, fused on shared memory, or on the links.

A synchronous call made while nothing is in flight runs in the caller's thread, under
the engine's lock, with no thread hand-off; otherwise it queues behind what is in
flight (handles.py). On shared memory, large all-reduces queued one behind another
run fused, as one collective (`RunningMixin._fusable`, ipc.collectives.shm.run_fused),
each with its own call's results; everything else goes to shared memory alone or to
the engine over the links.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from ..errors import IPCError
from . import hostops
from . import shm as shm_mod
from .pack import Packed

if TYPE_CHECKING:  # (handles.py imports this module)
    from .handles import Handle

__all__ = ["Op", "RunningMixin"]

# At most this many queued all-reduces, of this many bytes together, run as one
# collective (ipc.collectives.shm.run_fused; Horovod's fusion buffer is 64 MiB too): the
# slots in /dev/shm grow to hold them, twice over.
FUSE_MAX = shm_mod.MAX_GROUPS
FUSE_BYTES = 64 << 20

Op = str | Callable[[torch.Tensor, torch.Tensor], torch.Tensor | None]


# The named ops: their collective's kind and in-place reducer, made once (a small
# all-reduce costs tens of microseconds, so its per-call Python counts).
_NAMED_OPS: dict[str, tuple[str, Callable[[torch.Tensor, torch.Tensor], None]]] = {
    "sum": ("all_reduce:sum", hostops.add),
    "max": ("all_reduce:max", hostops.maximum),
    "min": ("all_reduce:min", hostops.minimum),
}
# The ops whose queued all-reduces may run fused (each job's own reduce is the same).
_FUSABLE = frozenset(kind for kind, _ in _NAMED_OPS.values())


def _op(op: Op) -> tuple[str, Callable[[torch.Tensor, torch.Tensor], None]]:
    """The all-reduce's kind and its in-place `acc = op(acc, src)` on two 1-D chunks
    (torch ops release the GIL)."""
    if isinstance(op, str):
        if op in _NAMED_OPS:
            return _NAMED_OPS[op]
    elif callable(op):

        def apply(acc: torch.Tensor, src: torch.Tensor) -> None:
            out = op(acc, src)
            if out is not None and out is not acc:
                acc.copy_(out)

        return "all_reduce:callable", apply
    raise ValueError(f"all_reduce op must be 'sum', 'max', 'min' or a callable, got {op!r}")


class RunningMixin:
    """`Tree`'s running of collectives. It reads the tree's `_comm` (the queue),
    `_order` and `_lock` (submission order, the engine), `_engine`, `_shm`,
    `node_index`, `num_nodes`, `chunk_bytes`, `_closed` and `_pid`; it counts
    `_collectives` and `_collective_time`, and in a forked child sets `_closed` and
    closes its copies of `_endpoint`'s sockets. The communication thread calls its
    `_collective_fused` and `_service`, and `_check` from a forked child."""

    # ---- running collectives ------------------------------------------------------

    def _check(self) -> None:
        if self._closed:
            # A forked child's trees are closed at the fork (os.register_at_fork): the
            # pid, a system call, is read only to say why.
            if os.getpid() != self._pid:
                raise IPCError(
                    f"node {self.node_index}: this tree belongs to process {self._pid}; a "
                    "forked child cannot use it (make a tree in the child, or fork before "
                    "making it)",
                    node=self.node_index,
                )
            raise IPCError(f"node {self.node_index}: tree is closed", node=self.node_index)

    def _submit(self, args: tuple, async_op: bool) -> Handle | int | None:
        """Start a collective in submission order: queued behind what is in flight, or,
        synchronous with nothing in flight, run right here (no thread hand-off)."""
        comm = self._comm
        with self._order:  # another thread (an autograd hook) cannot slip in between
            if async_op:
                return comm.submit(args)
            # Idle: nothing queued and nobody running. Read without comm's mutex: under
            # _order no job can be queued meanwhile, and a runner finishing takes its job
            # off the queue and clears `runner` in one step under that mutex, so at worst
            # we see it still running and queue behind it.
            if not comm.queue and comm.runner is None:
                try:
                    with self._lock:
                        return self._collective(*args)
                finally:
                    comm.active = time.monotonic()
            handle = comm.submit(args)
        return handle.wait()

    def _run_inline(self, *args) -> int | None:
        """A collective during set-up (before the communication thread exists)."""
        return self._collective(*args)

    def _service(self) -> None:
        if self._engine is not None and not self._closed:
            self._engine.service()

    def _collective(
        self, leaves: list[torch.Tensor], kind: str, reduce, up: bool, contribute: bool
    ) -> int | None:
        return self._collective_fused([(leaves, kind, reduce, up, contribute)])[0]

    def _fusable(self, packed: Packed, jobs: list[tuple]) -> list[tuple[list, bytes]]:
        """What this node offers to run fused with `packed` (the first of `jobs`, two or
        more): the queued all-reduces right behind it with the same op and `finished`,
        each a single contiguous CPU tensor (reduced in place, nothing to pack), large
        enough that shared memory reads it out of the peers' memory (ipc.collectives.shm.fusable),
        none overlapping another. Every node offers what it has queued; they run the
        longest run that all of them offered."""
        shm = self._shm
        _, kind, _, up, contribute = jobs[0]
        if not up or kind not in _FUSABLE or len(packed.groups) != 1:
            return []
        head = packed.groups[0]
        if not head.aliased or not shm.fusable([head.flat]):
            return []
        size = shm_mod.aligned_bytes
        offers, nbytes = [([head.flat], b"")], size([head.flat])
        spans = [_span(head.flat)]
        for leaves, k, _, _, c in jobs[1:]:
            if k != kind or c != contribute or len(leaves) != 1:
                break
            t = leaves[0]
            flat = [t.view(-1)] if t.device.type == "cpu" and t.is_contiguous() else []
            if not flat or len(offers) >= FUSE_MAX or not shm.fusable(flat):
                break
            # A tensor reduced twice in a row must see the first result: not fused with it.
            lo, hi = span = _span(flat[0])
            if any(lo < b and a < hi for a, b in spans):
                break
            nbytes += size(flat)
            if nbytes > min(shm.limit, FUSE_BYTES):
                break
            spans.append(span)
            offers.append((flat, Packed([t]).signature(kind)))
        return offers if len(offers) > 1 else []

    def _collective_fused(self, jobs: list[tuple]) -> tuple[int | None, int]:
        """Run the first of `jobs` (args as for `_collective`) and, on shared memory, those
        behind it that every node has queued too, as one collective: returns its result
        and how many jobs it ran (each one's result is the same count of contributors)."""
        leaves, kind, reduce, up, contribute = jobs[0]
        engine = self._engine
        start = time.perf_counter()
        done = 1
        try:
            # begin() inside: a Ctrl-C that lands as it returns is still told to the peers
            engine.begin(kind)
            packed = Packed(leaves)
            sig = packed.signature(kind)
            total = None
            if self.num_nodes == 1:
                total = 1 if contribute else 0
                if total == 0 and up:
                    for g in packed.groups:
                        g.flat.zero_()
            elif self._shm is not None:
                offers = self._fusable(packed, jobs) if len(jobs) > 1 else None
                if offers:
                    offers[0] = (offers[0][0], sig)
                    total, done = self._shm.run_fused(offers, reduce, contribute)
                    engine.fused(done - 1)
                else:
                    total = self._shm.run(
                        [g.flat for g in packed.groups], sig, reduce, contribute, scatter=not up
                    )
            if total is None:
                total = engine.run(packed, sig, reduce, up, contribute, self.chunk_bytes)
            packed.unpack()
        except BaseException as exc:
            # Whatever made us leave (a peer's failure, a custom op that raised, Ctrl-C),
            # our neighbours hear of it now instead of waiting for us (once).
            if exc is not engine.broken:
                engine.fail(exc)
            raise
        finally:
            engine.end()
        self._collectives += done
        self._collective_time += time.perf_counter() - start
        return (None if kind == "scatter" or kind == "barrier" else total), done

    def _forked(self) -> None:
        """In a forked child (os.register_at_fork): let go of the parent's sockets."""
        self._closed = True
        if self._endpoint is not None:
            self._endpoint.close_inherited_fds()


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes a contiguous tensor covers in memory."""
    return t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
