"""The barrier of a same-host tree: counters to spin on in the shared control page, FIFOs
to sleep on.

A node posts its arrival in its counter, then spins briefly on the others' counters
(yielding the core between looks), which is what makes a small all-reduce cost tens of
microseconds instead of one process wake-up per peer. A node still waiting after the
spin goes to sleep on its FIFO and the last node to arrive wakes the sleepers with one
byte each; the sleep also polls the ZeroMQ links, so a dead peer or a failure elsewhere
still raises.
"""

from __future__ import annotations

import contextlib
import os
import time

from distlearn.common.envvars import env_float

from ..errors import IPCTimeoutError
from .shm_layout import ARRIVED, ASLEEP

__all__ = ["BarrierMixin"]

# How long a node may spin on the counters before it sleeps on its FIFO: enough to
# cover the skew of back-to-back small collectives. The budget adapts (see
# barrier): it halves, down to SPIN_MIN_S, each time a spin ends in sleep anyway
# (a training step's skew is milliseconds of compute: spinning would only take
# the core from data-loading workers, 4% of MNIST throughput measured) and
# doubles back each time a spin succeeds.
SPIN_S = env_float("IPC_SHM_SPIN_US", 1000.0, low=0) * 1e-6
SPIN_MIN_S = min(SPIN_S, 20e-6)
# A sleeper re-reads the counters this often even without a wake-up byte: the
# backstop for a wake-up lost between its "sleeping" mark and the last arrival.
NAP_S = 0.002


class BarrierMixin:
    """`SharedMemoryGroup`'s barrier. It reads the group's `node`, `timeout`,
    `stall_warning`, `_on_stall`, `_wait_readable`, `_words` (the control page),
    `_arrivals` (each node's arrival line), `_fence` (a lock: a memory barrier), `_rfd`
    (our FIFO) and `_wfd` (the others');
    it keeps `_barriers` (barriers entered) and `_spin` (the spin budget), and writes
    our own ARRIVED and ASLEEP words."""

    # ---- barrier -----------------------------------------------------------

    def _all_arrived(self, b: int) -> bool:
        words = self._words
        return all(words[at] >= b for at in self._arrivals)

    def _drain(self) -> None:
        """Read stale wake-up bytes. The pipe lock it takes is also a full memory
        barrier on x86, which orders our counter store before the loads after it."""
        with contextlib.suppress(BlockingIOError):
            while os.read(self._rfd, 4096):
                pass

    def barrier(self) -> None:
        """Return once every node has called `barrier` as often as this one.

        Arrive (post our counter), spin on the counters for up to the current
        spin budget, then sleep on our FIFO until the last node to arrive writes
        a wake-up byte.
        """
        self._barriers += 1
        b = self._barriers
        mine = self._arrivals[self.node]
        words = self._words
        words[mine + ARRIVED] = b
        # Our counter store must be visible before we read the others' (and their
        # sleep marks in _wake): a lock's atomic instruction is a full memory barrier
        # on x86, at a tenth of the cost of draining the FIFO here (a read that fails
        # with EAGAIN). Stale wake-up bytes are drained by the sleep below, the only
        # place where they matter.
        with self._fence:
            pass
        if self._all_arrived(b):
            self._wake(b)  # we are the last: wake whoever went to sleep
            return
        spin = self._spin
        spin_end = time.perf_counter() + spin
        while time.perf_counter() < spin_end:
            os.sched_yield()  # a waiting node lets a working one have the core
            if self._all_arrived(b):
                self._spin = min(SPIN_S, 2 * spin)
                return
        self._spin = max(SPIN_MIN_S, spin / 2)
        words[mine + ASLEEP] = b
        start = time.monotonic()
        deadline = start + self.timeout
        stall = start + self.stall_warning
        try:
            while True:
                self._drain()
                if self._all_arrived(b):
                    return
                now = time.monotonic()
                remaining = deadline - now
                if now >= stall and self._on_stall is not None:
                    stall = now + max(60.0, self.stall_warning)
                    self._on_stall(now - start, self._late(b))
                if remaining <= 0:
                    late = self._late(b)
                    raise IPCTimeoutError(
                        f"node {self.node}: nodes {late} did not reach shared-memory "
                        f"barrier {b} within {self.timeout}s",
                        node=late[0] if late else self.node,
                    )
                self._wait_readable(self._rfd, min(NAP_S, remaining))
        finally:
            words[mine + ASLEEP] = 0

    def _late(self, b: int) -> list[int]:
        """Nodes that have not arrived at barrier b."""
        words = self._words
        return [j for j, at in enumerate(self._arrivals) if words[at + ARRIVED] < b]

    def _wake(self, b: int) -> None:
        for j, fd in self._wfd.items():
            if self._words[self._arrivals[j] + ASLEEP] == b:
                # A full pipe: it is awake anyway. A broken one (EPIPE): its reader is
                # gone, so there is nobody to wake. The sleeper woke on its own (the
                # nap) and closed its group between our look at its mark and this
                # write, or it died asleep: then the links name it, as for any death.
                with contextlib.suppress(BlockingIOError, BrokenPipeError):
                    os.write(fd, b"\x01")
