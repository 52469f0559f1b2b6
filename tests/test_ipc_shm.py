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
import time

from distlearn.ipc.collectives import shm, shm_layout

BARRIERS = 100_000
SEEN = 1000  # counter moves the watcher must see before the barriers may stop
DEADLINE_S = 120.0


def _watch(ctl: mmap.mmap, at: int, flag: mmap.mmap, ready, results) -> None:
    """Read node 0's arrival line until told to stop: count the reads where the counter
    had moved since the last one, and those where it went backwards or the pid was
    neither unset nor the parent's. flag[1] says SEEN moves were watched."""
    words = memoryview(ctl).cast("Q")
    parent = os.getppid()
    last, moves, backwards, bad_pid = 0, 0, 0, 0
    ready.set()
    while not flag[0]:
        for _ in range(1000):
            arrived, pid = words[at + shm_layout.ARRIVED], words[at + shm_layout.PID]
            backwards += arrived < last
            moves += arrived > last
            last = max(last, arrived)
            bad_pid += pid not in (0, parent)
        if moves >= SEEN:
            flag[1] = 1
    results.put((moves, backwards, bad_pid, last))


def test_peers_never_see_a_control_word_half_written(tmp_path):
    prefix = f"ipc-test{os.getpid():x}"
    control = shm.create_control(prefix, os.getpid(), 1)
    flag = mmap.mmap(-1, mmap.PAGESIZE)
    # node 0's arrival line, in words
    at = shm_layout.arrival(0)
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
        # Barriers go on until the watcher has seen the counter move SEEN times, not for
        # a fixed count: on a loaded machine the watcher may sleep through 100,000 of them.
        done, deadline = 0, time.monotonic() + DEADLINE_S
        while (done < BARRIERS or not flag[1]) and time.monotonic() < deadline:
            for _ in range(1000):
                group.barrier()
            done += 1000
        flag[0] = 1
        moves, backwards, bad_pid, last = results.get(timeout=30)
        group.close()
    finally:
        flag[0] = 1
        watcher.join(30)
    assert last == done
    assert moves >= SEEN, f"the watcher saw the counter move {moves} times in {done} barriers"
    assert (backwards, bad_pid) == (0, 0), f"{backwards} counters went back, {bad_pid} bad pids"


def test_the_control_page_is_its_named_structure():
    """The offsets the group packs at (struct, and single words for the arrival line)
    are the fields of shm_layout's ctypes structures: a page written through the named
    structure reads back through the group's accessors, for every node and parity."""
    import ctypes

    from distlearn.ipc.collectives.shm_layout import NodeLines

    n = 3
    page = bytearray(shm_layout.page_bytes(n))
    nodes = (NodeLines * n).from_buffer(page)
    for j in range(n):
        for parity in (0, 1):
            c = nodes[j].control[parity]
            c.seq, c.contributes, c.signature = 100 * j + parity, 1, b"sig%d-%d" % (j, parity)
            c.nbytes, c.offered = 4096 + j, 2 + parity
            for k in range(shm_layout.MAX_GROUPS):
                nodes[j].addresses[parity][k] = (j << 32) | (parity << 16) | k
            nodes[j].signatures[parity].value = b"%d/%d" % (j, parity) * 8
        a = nodes[j].arrival
        a.arrived, a.asleep, a.pid, a.probe_address = 7 + j, 3 + j, 1000 + j, 0xABC0 + j
        a.probe_value, a.can_read, a.grow_gen, a.grow_ok = 99 + j, 1, 5 + j, j % 2
    words = memoryview(page).cast("Q")
    for j in range(n):
        for parity in (0, 1):
            got = shm_layout.CONTROL.unpack_from(page, shm_layout.control(j, parity))
            sig = (b"sig%d-%d" % (j, parity)).ljust(8, b"\0")
            assert got == (100 * j + parity, 1, sig, 4096 + j, 2 + parity)
            got = shm_layout.ADDRESSES.unpack_from(page, shm_layout.addresses(j, parity))
            assert got == tuple((j << 32) | (parity << 16) | k for k in range(8))
            sig = shm_layout.SIGNATURES.unpack_from(page, shm_layout.signatures(j, parity))[0]
            assert sig == (b"%d/%d" % (j, parity) * 8).ljust(shm_layout.SIGNATURES.size, b"\0")
        at = shm_layout.arrival(j)
        assert [words[at + k] for k in (shm_layout.ARRIVED, shm_layout.ASLEEP, shm_layout.PID,
                shm_layout.PROBE_ADDRESS, shm_layout.PROBE_VALUE, shm_layout.CAN_READ,
                shm_layout.GROW_GEN, shm_layout.GROW_OK)] == [
            7 + j, 3 + j, 1000 + j, 0xABC0 + j, 99 + j, 1, 5 + j, j % 2]  # fmt: skip
    # every line of every node starts its own cache line: nodes never share one
    starts = [shm_layout.control(j, p) for j in range(n) for p in (0, 1)]
    starts += [shm_layout.arrival(j) * 8 for j in range(n)]
    starts += [f(j, p) for f in (shm_layout.addresses, shm_layout.signatures)
               for j in range(n) for p in (0, 1)]  # fmt: skip
    assert len(set(starts)) == len(starts) == 7 * n
    assert all(s % shm_layout.LINE == 0 for s in starts)
    assert ctypes.sizeof(NodeLines) * n == len(page)
    del words, nodes
