"""The shared-memory group's control page as a peer on another core reads it.

Peers read a node's arrival line (barrier counters, sleep mark, pid, grow flags)
while that node rewrites it. A word must go from its old value to its new one
with nothing in between: the old code wrote with struct.pack_into, which
zero-fills first, and a peer once read node 0's pid as 0 and failed to open
its segment.
"""

from __future__ import annotations

import mmap
import multiprocessing as mp
import os

from distlearn.ipc.collectives import shm, shm_layout

BARRIERS = 100_000


def _watch(ctl: mmap.mmap, at: int, flag: mmap.mmap, ready, results) -> None:
    """Read node 0's arrival line until told to stop: count the reads, and the ones
    where a counter went backwards or the pid was neither unset nor the parent's."""
    words = memoryview(ctl).cast("Q")
    parent = os.getppid()
    last, reads, backwards, bad_pid = 0, 0, 0, 0
    ready.set()
    while not flag[0]:
        for _ in range(1000):
            arrived, pid = words[at + shm_layout.ARRIVED], words[at + shm_layout.PID]
            backwards += arrived < last
            last = max(last, arrived)
            bad_pid += pid not in (0, parent)
            reads += 1
    results.put((reads, backwards, bad_pid, last))


def test_peers_never_see_a_control_word_half_written(tmp_path):
    prefix = f"ipc-test{os.getpid():x}"
    control = shm.create_control(prefix, os.getpid(), 1)
    flag = mmap.mmap(-1, mmap.PAGESIZE)
    # node 0's arrival line, in words
    at = (0 * shm_layout.LINES + 2) * shm_layout.CONTROL_SLOT // 8
    ctx = mp.get_context("fork")  # the child shares both mappings
    ready, results = ctx.Event(), ctx.Queue()
    watcher = ctx.Process(target=_watch, args=(control, at, flag, ready, results))
    watcher.start()
    try:
        assert ready.wait(30)
        group = shm.SharedMemoryGroup(
            0, 1, prefix, os.getpid(), tmp_path,
            sync=lambda: None, wait_readable=lambda fd, s: None, timeout=10, control=control,
        )  # fmt: skip
        for _ in range(BARRIERS):
            group.barrier()
        flag[0] = 1
        reads, backwards, bad_pid, last = results.get(timeout=30)
        group.close()
    finally:
        flag[0] = 1
        watcher.join(30)
    assert last == BARRIERS
    assert reads > BARRIERS  # it really watched while the barriers ran
    assert (backwards, bad_pid) == (0, 0), f"{backwards} counters went back, {bad_pid} bad pids"
