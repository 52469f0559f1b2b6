"""Same-host collectives through shared memory, synchronised by a shared counter page.

When every node of a tree runs on one host, tensors do not need to cross
sockets at all: each node copies its buffer into its own slot of a
/dev/shm segment, and after one barrier every node can read every slot.
Small buffers (up to SMALL) are reduced by every node on its own, which
needs no second barrier. Large ones are reduced in parallel: node i reduces
the i-th slice, publishes it in its slot, and after a second barrier
everyone gathers the slices. Where the host lets processes read each other's
memory (:mod:`ipc.collectives.cma`), a large reduction skips the copy into the slots:
node i reads its slice straight out of the peers' tensors. Slots alternate
between two halves, so a collective never overwrites data a slower node
may still be reading from the previous one.

Several large all-reduces queued one after another (asynchronous handles)
can run as one collective (`run_fused`): each node offers the ones it has
queued, the barrier that starts the collective shows every node's offer,
and all reduce the longest run of jobs that every node offered with the
same signatures. One collective of eight 4 MiB buckets costs nine barriers
instead of sixteen (one to start, then one before each bucket's gather,
while the slices just published are still in the shared cache); each
bucket's result, bit for bit, and its count of contributors are those of
its own call.

The barrier (counters to spin on in the shared control page, FIFOs to sleep on)
is shm_barrier.py, the reductions shm_reduce.py and the control page's layout
shm_layout.py; the group's set-up, slots and collectives are here.

Files are unlinked as soon as every node has opened them, so nothing is
left behind in /dev/shm once a collective runs; a file whose creator was
killed in the milliseconds before that is named after its pid, and the next
tree on the host removes it.

Segments are allocated (posix_fallocate), not only sized: on a small
/dev/shm (Docker's 64 MB) a sized but unallocated segment raises SIGBUS on
first touch. When any node cannot allocate, all of them learn it at the same
barrier, log it, and send collectives that big over the sockets instead.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ..errors import MismatchError
from . import cma
from . import shm_layout as layout
from .shm_barrier import SPIN_S, BarrierMixin
from .shm_layout import (
    ADDRESSES,
    CAN_READ,
    CONTROL,
    GROW_GEN,
    GROW_OK,
    MAX_GROUPS,
    PID,
    PROBE_ADDRESS,
    PROBE_VALUE,
    SIGNATURES,
)
from .shm_reduce import ReduceMixin

__all__ = [
    "SHM_DIR",
    "SMALL",
    "SharedMemoryGroup",
    "ShmFull",
    "aligned_bytes",
    "create_control",
    "sweep_stale",
]

log = logging.getLogger(__name__)

ALIGN = 64
# Up to this many bytes every node reduces the whole buffer itself (one barrier);
# above it, nodes reduce one slice each in parallel and then gather (two barriers).
SMALL = 1 << 20
SHM_DIR = Path("/dev/shm")


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def aligned_bytes(groups: list[torch.Tensor]) -> int:
    """The bytes flat buffers take in a slot, one after another."""
    return sum(_align(g.numel() * g.element_size()) for g in groups)


def _segment(prefix: str, what: str, pid: int) -> Path:
    """Where a segment lives while the nodes open it; named after its creator's pid."""
    return SHM_DIR / f"distlearn-{prefix}-{what}.{pid}"


def sweep_stale(min_age: float = 60.0) -> None:
    """Remove our segments whose creator is dead: killed between creating one and
    every node opening it (a window of milliseconds at setup), it left the name.

    Only our own regular files (lstat: a link another user planted in the shared,
    sticky /dev/shm is never followed, nor is removing it tried), and only files older
    than `min_age` seconds: a process in another pid namespace sharing /dev/shm looks
    dead from here, but its files are never that old. Whatever it cannot judge or
    remove it leaves: a sweep never stops a tree from starting."""
    for path in SHM_DIR.glob("distlearn-ipc-*.*"):
        try:
            pid = int(path.suffix[1:])
            st = path.lstat()
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
                continue
            if time.time() - st.st_mtime < min_age:
                continue
            os.kill(pid, 0)
        except ProcessLookupError:
            with contextlib.suppress(OSError):  # gone meanwhile, or not ours to remove
                path.unlink()
        except (ValueError, OSError):
            continue  # not one of ours, alive, or not ours to judge


class ShmFull(OSError):
    """/dev/shm has no room for a segment."""


def _map(path: Path, size: int, create: bool) -> mmap.mmap:
    flags = os.O_RDWR | os.O_NOFOLLOW | (os.O_CREAT | os.O_EXCL if create else 0)
    fd = os.open(path, flags, 0o600)
    try:
        if create:
            try:
                # Allocate the pages now: a segment that is only sized would raise SIGBUS
                # when a collective first touches a page the tmpfs cannot give.
                os.posix_fallocate(fd, 0, size)
            except OSError as err:
                os.unlink(path)
                if err.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
                    raise ShmFull(
                        err.errno, f"{SHM_DIR} cannot hold {size >> 10} KiB more"
                    ) from None
                raise
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


def create_control(prefix: str, pid: int, n: int) -> mmap.mmap:
    """Node 0's control page for a group of n nodes (raises ShmFull if there is no room)."""
    return _map(_segment(prefix, "ctl", pid), layout.page_bytes(n), create=True)


class SharedMemoryGroup(BarrierMixin, ReduceMixin):
    """Slots and a barrier (counters to spin on, FIFOs to sleep on) for the nodes of one host."""

    def __init__(
        self,
        node: int,
        n: int,
        prefix: str,
        root_pid: int,
        fifo_dir: Path,
        sync: Callable[[], None],
        wait_readable: Callable[[int, float], None],
        timeout: float,
        control: mmap.mmap | None = None,
        on_stall: Callable[[float, list[int]], None] | None = None,
        stall_warning: float = 30.0,
    ):
        """`sync()` is a barrier over the sockets (used during setup only);
        `wait_readable(fd, seconds)` returns when fd is readable or after `seconds`,
        raising on peer failure; a barrier waiting longer than `timeout` raises.
        Node 0 passes the `control` page it made with `create_control`; a barrier that
        has waited `stall_warning` s calls `on_stall(waited, late nodes)`, then every
        minute."""
        self.node, self.n, self.prefix = node, n, prefix
        self._wait_readable = wait_readable
        self.timeout = timeout
        self._on_stall = on_stall
        self.stall_warning = stall_warning
        self.limit = 1 << 62  # collectives above this many bytes go over the sockets
        self._seq = 0
        self._gen = 0
        self._barriers = 0
        self._spin = SPIN_S  # the current spin budget, in seconds (see SPIN_S)
        self._fence = threading.Lock()  # a memory barrier (see barrier)
        # where each node's arrival line starts, in 64-bit words
        self._arrivals = [layout.arrival(j) for j in range(n)]
        self._controls = [[layout.control(j, p) for j in range(n)] for p in (0, 1)]  # parity
        # collectives run here, their bytes, and how many read peers' tensors directly
        # (and "fused": all-reduces that ran inside another one's collective)
        self.stats = {"collectives": 0, "bytes": 0, "direct": 0, "fused": 0}
        self.capacity = 0  # bytes per slot
        self._views_cache: dict[tuple, list[torch.Tensor]] = {}
        self._scratches: dict[torch.dtype, torch.Tensor] = {}
        self._maps: list[mmap.mmap] = []
        self._slots: list[torch.Tensor] = []
        if node == 0:
            sweep_stale()
        ctl_path = _segment(prefix, "ctl", root_pid)
        fifo = fifo_dir / f"{prefix}-{node}.fifo"
        os.mkfifo(fifo, 0o600)
        # O_RDWR keeps the pipe open (no EOF between writers); O_NONBLOCK: we poll it.
        self._rfd = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)
        ctl_size = layout.page_bytes(n)
        self._wfd: dict[int, int] = {}
        try:
            if node == 0:
                self._ctl = control
            sync()
            if node != 0:
                self._ctl = _map(ctl_path, ctl_size, create=False)
            self._words = words = memoryview(self._ctl).cast("Q")
            for j in (j for j in range(n) if j != node):
                self._wfd[j] = os.open(fifo_dir / f"{prefix}-{j}.fifo", os.O_WRONLY | os.O_NONBLOCK)
            probe = cma.Probe(int.from_bytes(os.urandom(7), "little"))
            at = self._arrivals[node]
            words[at + PID] = os.getpid()
            words[at + PROBE_ADDRESS] = probe.address
            words[at + PROBE_VALUE] = probe.value
            sync()
            # Cross-memory reads need every node to reach every peer: probe them all,
            # then agree, so all nodes take the same path in every collective.
            self._pids = [words[a + PID] for a in self._arrivals]
            ok = all(
                cma.usable(pid, words[a + PROBE_ADDRESS], words[a + PROBE_VALUE])
                for j, (a, pid) in enumerate(zip(self._arrivals, self._pids, strict=True))
                if j != node
            )
            words[at + CAN_READ] = int(ok)  # peers may still be reading our pid
            sync()
            self.cma = all(words[a + CAN_READ] for a in self._arrivals)
        finally:
            # Everyone has opened everything (or we failed): the names are no longer needed.
            with contextlib.suppress(OSError):
                os.unlink(fifo)
            if node == 0:
                with contextlib.suppress(OSError):
                    os.unlink(ctl_path)

    # ---- slots -------------------------------------------------------------

    def _grow(self, need: int) -> bool:
        """Every node maps a bigger segment; called by all nodes with the same `need`.

        False (on every node alike) when any node could not allocate its segment: the
        group then keeps its slots and sends collectives above them over the sockets."""
        cap = 1 << max(16, (need - 1).bit_length())
        self._gen += 1
        path = _segment(self.prefix, f"{self.node}-{self._gen}", os.getpid())
        words, mine_at = self._words, self._arrivals[self.node]
        try:
            mine = _map(path, 2 * cap, create=True)
        except OSError as err:
            # No room (ShmFull), or the name taken: /dev/shm is everyone's, and another
            # user may create our next segment's name first (O_EXCL refuses to share it).
            # Either way the group goes on over the sockets, never fails.
            mine = None
            if not isinstance(err, ShmFull):
                log.warning("ipc: node %d cannot create %s (%s)", self.node, path, err)
        words[mine_at + GROW_GEN] = self._gen
        words[mine_at + GROW_OK] = int(mine is not None)
        self.barrier()
        failed = [
            j for j, at in enumerate(self._arrivals)
            if (words[at + GROW_GEN], words[at + GROW_OK]) != (self._gen, 1)
        ]  # fmt: skip
        if failed:
            if mine is not None:
                mine.close()
                os.unlink(path)
            self.limit = self.capacity
            if self.node == 0:
                log.warning(
                    "ipc: %s cannot hold %d nodes' slots of %d MiB (nodes %s could not allocate; "
                    "or their names were taken: see their warnings): collectives above %d KiB "
                    "go through the sockets instead. Give the container a larger /dev/shm "
                    "(e.g. docker run --shm-size=1g)",
                    SHM_DIR, self.n, 2 * cap >> 20, failed, self.capacity >> 10,
                )  # fmt: skip
            return False
        try:
            maps = []
            for j in range(self.n):
                if j == self.node:
                    maps.append(mine)
                else:
                    name = _segment(self.prefix, f"{j}-{self._gen}", self._pids[j])
                    maps.append(_map(name, 2 * cap, create=False))
            self.barrier()
        finally:
            os.unlink(path)
        self._release()
        self._maps = maps
        self._slots = [torch.frombuffer(m, dtype=torch.uint8) for m in maps]
        self.capacity = cap
        return True

    def _release(self) -> None:
        self._slots = []
        self._views_cache.clear()
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
        self._words.release()  # an export would keep the page mapped
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
    ) -> int | None:
        """All-reduce (or, with `scatter`, broadcast node 0's) flat buffers in place.

        Returns the number of contributing nodes, or None (on every node alike) when
        /dev/shm has no room for the collective: the caller then uses the sockets.
        """
        return self._run([(groups, sig)], reduce, contribute, scatter)[0]

    def fusable(self, groups: list[torch.Tensor]) -> bool:
        """Whether an all-reduce of these flat buffers may be offered to `run_fused`: one
        that reads the peers' tensors directly (no copy into the slots before it starts,
        so offering it and then leaving it for later costs nothing)."""
        nbytes = aligned_bytes(groups)
        return self.cma and 0 < len(groups) <= MAX_GROUPS and SMALL < nbytes <= self.limit

    def run_fused(
        self,
        jobs: list[tuple[list[torch.Tensor], bytes]],
        reduce: Callable[[torch.Tensor, torch.Tensor], None],
        contribute: bool,
    ) -> tuple[int | None, int]:
        """All-reduce the first k of `jobs` ((flat buffers, signature) each, every one
        `fusable`, together at most MAX_GROUPS buffers and `limit` bytes) as one
        collective, in place: k (at least 1) is the longest run of jobs that every node
        offered with the same signatures. Returns (contributors, k); contributors as for
        `run`, the same for each of the k jobs."""
        return self._run(jobs, reduce, contribute, False)

    def _run(self, jobs, reduce, contribute: bool, scatter: bool) -> tuple[int | None, int]:
        offsets, nbytes, ends = [], 0, []
        for groups, _ in jobs:
            for g in groups:
                offsets.append(nbytes)
                nbytes = _align(nbytes + g.numel() * g.element_size())
            ends.append((len(offsets), nbytes))
        head_groups, sig = jobs[0]
        offered = len(jobs)
        head_bytes = ends[0][1]
        if head_bytes > self.limit:
            return None, 1
        self._seq += 1
        seq, parity = self._seq, self._seq & 1
        me, ctl = self.node, self._ctl
        controls = self._controls[parity]
        writes = contribute and (not scatter or me == 0)
        CONTROL.pack_into(ctl, controls[me], seq, int(writes), sig, head_bytes, offered)
        sliced = not scatter and reduce is not None and head_bytes > SMALL
        # Large reductions read the peers' tensors where they lie when the host allows.
        direct = sliced and self.cma and len(head_groups) <= MAX_GROUPS
        if offered > 1:  # only fusable jobs are offered: direct, whatever k turns out
            sigs = b"".join(s for _, s in jobs)
            SIGNATURES.pack_into(ctl, layout.signatures(me, parity), sigs)
        if direct:
            ptrs = [g.data_ptr() for gs, _ in jobs for g in gs]
            zeros = [0] * (MAX_GROUPS - len(ptrs))
            ADDRESSES.pack_into(ctl, layout.addresses(me, parity), *ptrs, *zeros)
        groups = head_groups
        if 0 < head_bytes <= self.capacity and writes and not direct:
            self._copy_in(groups, offsets, parity, sliced)
        self.barrier()
        contributors = []
        fused = offered
        for j, at in enumerate(controls):
            j_seq, j_contrib, j_sig, j_bytes, j_offered = CONTROL.unpack_from(ctl, at)
            if j_seq != seq or j_sig != sig or j_bytes != head_bytes:
                raise MismatchError(
                    f"node {me}: node {j} is in a different collective "
                    f"(sequence {j_seq} vs {seq}, {j_bytes} vs {head_bytes} bytes, "
                    f"{'same' if j_sig == sig else 'different'} op/shapes/dtypes)",
                    node=j,
                )
            if j_contrib:
                contributors.append(j)
            if j_offered < fused:
                fused = j_offered
        if fused > 1:
            # The longest run every node offered alike (a job whose signatures differ runs
            # on its own later, and raises there as its own call would).
            mine = SIGNATURES.unpack_from(ctl, layout.signatures(me, parity))[0]
            for j in range(self.n):
                theirs = SIGNATURES.unpack_from(ctl, layout.signatures(j, parity))[0]
                while fused > 1 and theirs[: 8 * fused] != mine[: 8 * fused]:
                    fused -= 1
            count, nbytes = ends[fused - 1]
            groups = [g for gs, _ in jobs[:fused] for g in gs]
            offsets = offsets[:count]
        else:
            nbytes = head_bytes
            offsets = offsets[: len(groups)]
        if nbytes > self.capacity:
            grown = self._grow(nbytes)
            if not grown and fused > 1 and head_bytes <= self.capacity:
                # No room for the fused slots (the limit is now what we have, so no
                # later run asks again): the first job alone, as its own call would.
                fused, nbytes, groups = 1, head_bytes, head_groups
                offsets = offsets[: len(groups)]
            elif not grown:
                return None, 1
            if writes and not direct:
                self._copy_in(groups, offsets, parity, sliced)
            self.barrier()
        self.stats["collectives"] += 1
        self.stats["bytes"] += nbytes
        self.stats["direct"] += direct
        self.stats["fused"] += fused - 1
        total = len(contributors)
        if nbytes == 0:
            return total, fused
        if not contributors:
            for g in groups:
                g.zero_()
            return 0, fused
        if sliced:
            self._reduce_sliced(groups, offsets, parity, contributors, reduce, direct)
        else:
            self._reduce_all(groups, offsets, parity, contributors, reduce)
        return total, fused
