"""Same-host collectives through shared memory, synchronised by named pipes.

When every node of a tree runs on one host, tensors do not need to cross
sockets at all: each node copies its buffer into its own slot of a
/dev/shm segment, and after one barrier every node can read every slot.
Large buffers are reduced in parallel (node i reduces the i-th slice of
every slot, then everyone gathers the slices); small ones are reduced by
every node on its own, which needs no second barrier. Slots alternate
between two halves, so a collective never overwrites data a slower node
may still be reading from the previous one.

The barrier is one all-to-all round over FIFOs: blocking reads wake the
waiting process directly (no busy polling, no broker thread), and the waits also poll the
ZeroMQ links, so a dead peer or a failure elsewhere still raises.
Files are unlinked as soon as every node has opened them: nothing is left
behind in /dev/shm even if a process is killed.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
from collections.abc import Callable
from pathlib import Path

import torch

from .errors import MismatchError

# Per node and parity: sequence, contributes (0/1), signature, payload bytes.
CONTROL = struct.Struct("<QQ8sQ")
CONTROL_SLOT = 64
ALIGN = 64
# Up to this many bytes every node reduces the whole buffer itself (one barrier);
# above it, nodes reduce one slice each in parallel and then gather (two barriers).
SMALL = 1 << 20
SHM_DIR = Path("/dev/shm")


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _map(path: Path, size: int, create: bool) -> mmap.mmap:
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
    fd = os.open(path, flags, 0o600)
    try:
        if create:
            os.ftruncate(fd, size)
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


class SharedMemoryGroup:
    """Shared slots and a FIFO barrier for the `n` nodes of one host."""

    def __init__(
        self,
        node: int,
        n: int,
        prefix: str,
        fifo_dir: Path,
        sync: Callable[[], None],
        wait_readable: Callable[[int], None],
    ):
        """`sync()` is a barrier over the sockets (used during setup only);
        `wait_readable(fd)` blocks until fd is readable, raising on peer failure."""
        self.node, self.n, self.prefix = node, n, prefix
        self._wait_readable = wait_readable
        self._seq = 0
        self._gen = 0
        self._barriers = 0
        self._posted = [0] * 256
        self.capacity = 0  # bytes per slot
        self._maps: list[mmap.mmap] = []
        self._slots: list[torch.Tensor] = []
        ctl_path = SHM_DIR / f"distlearn-{prefix}-ctl"
        fifo = fifo_dir / f"{prefix}-{node}.fifo"
        os.mkfifo(fifo, 0o600)
        # O_RDWR keeps the pipe open (no EOF between writers); O_NONBLOCK: we poll it.
        self._rfd = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)
        ctl_size = n * 2 * CONTROL_SLOT
        self._wfd: dict[int, int] = {}
        try:
            if node == 0:
                self._ctl = _map(ctl_path, ctl_size, create=True)
            sync()
            if node != 0:
                self._ctl = _map(ctl_path, ctl_size, create=False)
            for j in (j for j in range(n) if j != node):
                self._wfd[j] = os.open(fifo_dir / f"{prefix}-{j}.fifo", os.O_WRONLY | os.O_NONBLOCK)
            sync()
        finally:
            # Everyone has opened everything (or we failed): the names are no longer needed.
            with contextlib.suppress(OSError):
                os.unlink(fifo)
            if node == 0:
                with contextlib.suppress(OSError):
                    os.unlink(ctl_path)

    # ---- barrier -----------------------------------------------------------

    def barrier(self) -> None:
        """Every node posts a tagged byte to every other and waits for n-1 of its tag.

        One round: the last node to arrive wakes all others directly. A node can
        be at most one barrier ahead of another, so the tag (barrier count mod
        256) keeps early posts for the next barrier apart from this one's.
        """
        self._barriers += 1
        tag = self._barriers & 0xFF
        post = bytes([tag])
        for fd in self._wfd.values():
            os.write(fd, post)
        while self._posted[tag] < self.n - 1:
            try:
                data = os.read(self._rfd, 4096)
            except BlockingIOError:
                self._wait_readable(self._rfd)
                continue
            for b in data:
                self._posted[b] += 1
        self._posted[tag] -= self.n - 1

    # ---- slots -------------------------------------------------------------

    def _grow(self, need: int) -> None:
        """Every node maps a bigger segment; called by all nodes with the same `need`."""
        cap = 1 << max(16, (need - 1).bit_length())
        self._gen += 1
        path = SHM_DIR / f"distlearn-{self.prefix}-{self.node}-{self._gen}"
        mine = _map(path, 2 * cap, create=True)
        try:
            self.barrier()
            maps = []
            for j in range(self.n):
                if j == self.node:
                    maps.append(mine)
                else:
                    name = SHM_DIR / f"distlearn-{self.prefix}-{j}-{self._gen}"
                    maps.append(_map(name, 2 * cap, create=False))
            self.barrier()
        finally:
            os.unlink(path)
        self._release()
        self._maps = maps
        self._slots = [torch.frombuffer(m, dtype=torch.uint8) for m in maps]
        self.capacity = cap

    def _release(self) -> None:
        self._slots = []
        for m in self._maps:
            # BufferError: a caller still holds a view; the mapping goes away with it.
            with contextlib.suppress(BufferError):
                m.close()
        self._maps = []

    def close(self) -> None:
        self._release()
        for fd in [self._rfd, *self._wfd.values()]:
            with contextlib.suppress(OSError):
                os.close(fd)
        with contextlib.suppress(BufferError):
            self._ctl.close()

    # ---- the collective ----------------------------------------------------

    def run(
        self,
        groups: list[torch.Tensor],
        sig: bytes,
        reduce: Callable[[torch.Tensor, torch.Tensor], None] | None,
        contribute: bool,
        scatter: bool = False,
    ) -> int:
        """All-reduce (or, with `scatter`, broadcast node 0's) flat buffers in place.

        Returns the number of contributing nodes.
        """
        self._seq += 1
        seq, parity = self._seq, self._seq & 1
        offsets, nbytes = [], 0
        for g in groups:
            offsets.append(nbytes)
            nbytes = _align(nbytes + g.numel() * g.element_size())
        writes = contribute and (not scatter or self.node == 0)
        CONTROL.pack_into(
            self._ctl, (self.node * 2 + parity) * CONTROL_SLOT, seq, int(writes), sig, nbytes
        )
        fits = nbytes <= self.capacity
        sliced = not scatter and reduce is not None and nbytes > SMALL
        if fits and writes:
            self._copy_in(groups, offsets, parity, sliced)
        self.barrier()
        contributors = []
        for j in range(self.n):
            j_seq, j_contrib, j_sig, j_bytes = CONTROL.unpack_from(
                self._ctl, (j * 2 + parity) * CONTROL_SLOT
            )
            if j_seq != seq or j_sig != sig or j_bytes != nbytes:
                raise MismatchError(
                    f"node {self.node}: node {j} is in a different collective "
                    f"(sequence {j_seq} vs {seq}, {j_bytes} vs {nbytes} bytes, "
                    f"{'same' if j_sig == sig else 'different'} op/shapes/dtypes)",
                    node=j,
                )
            if j_contrib:
                contributors.append(j)
        if not fits:
            self._grow(nbytes)
            if writes:
                self._copy_in(groups, offsets, parity, sliced)
            self.barrier()
        total = len(contributors)
        if nbytes == 0:
            return total
        if not contributors:
            for g in groups:
                g.zero_()
            return 0
        if sliced:
            self._reduce_sliced(groups, offsets, parity, contributors, reduce)
        else:
            self._reduce_all(groups, offsets, parity, contributors, reduce)
        return total

    def _view(self, j: int, parity: int, off: int, g: torch.Tensor) -> torch.Tensor:
        start = parity * self.capacity + off
        raw = self._slots[j][start : start + g.numel() * g.element_size()]
        return raw.view(g.dtype)

    def _bounds(self, numel: int, i: int) -> tuple[int, int]:
        """Node i's slice of a group in the sliced reduction."""
        step = -(-numel // self.n)
        return min(numel, i * step), min(numel, (i + 1) * step)

    def _copy_in(self, groups, offsets, parity: int, sliced: bool) -> None:
        for g, off in zip(groups, offsets, strict=True):
            dst = self._view(self.node, parity, off, g)
            if not sliced:
                dst.copy_(g)
                continue
            # Only the slices other nodes reduce: ours never needs to leave our tensor.
            lo, hi = self._bounds(g.numel(), self.node)
            dst[:lo].copy_(g[:lo])
            dst[hi:].copy_(g[hi:])

    def _reduce_all(self, groups, offsets, parity, contributors, reduce) -> None:
        # Every node folds all slots in the same order: identical bits everywhere.
        for g, off in zip(groups, offsets, strict=True):
            g.copy_(self._view(contributors[0], parity, off, g))
            for j in contributors[1:]:
                reduce(g, self._view(j, parity, off, g))

    def _reduce_sliced(self, groups, offsets, parity, contributors, reduce) -> None:
        # Node i reduces slice i of every group in its own tensor, publishes it in
        # its slot, and after a barrier everyone gathers the other slices.
        me = self.node
        for g, off in zip(groups, offsets, strict=True):
            lo, hi = self._bounds(g.numel(), me)
            if lo == hi:
                continue
            acc = g[lo:hi]
            others = [j for j in contributors if j != me]
            if me not in contributors:
                acc.copy_(self._view(others[0], parity, off, g)[lo:hi])
                others = others[1:]
            for j in others:
                reduce(acc, self._view(j, parity, off, g)[lo:hi])
            self._view(me, parity, off, g)[lo:hi].copy_(acc)
        self.barrier()
        for g, off in zip(groups, offsets, strict=True):
            for j in range(self.n):
                lo, hi = self._bounds(g.numel(), j)
                if j != me and lo < hi:
                    g[lo:hi].copy_(self._view(j, parity, off, g)[lo:hi])
