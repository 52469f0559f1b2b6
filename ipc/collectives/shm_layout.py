"""The layout of the shared control page of a same-host tree (see shm.py).

Each node has LINES lines of CONTROL_SLOT bytes (64 bytes apart, so nodes never share a
cache line): its control line for parity 0 and 1 (CONTROL), its arrival line (the
barrier counters and its setup facts, one 64-bit word each at the offsets below), its
addresses for parity 0 and 1 (ADDRESSES), then the signatures it offers to run fused
for parity 0 and 1 (SIGNATURES).
"""

from __future__ import annotations

import struct

__all__ = [
    "ADDRESSES",
    "ARRIVED",
    "ASLEEP",
    "CAN_READ",
    "CONTROL",
    "CONTROL_SLOT",
    "GROW_GEN",
    "GROW_OK",
    "LINES",
    "MAX_GROUPS",
    "PID",
    "PROBE_ADDRESS",
    "PROBE_VALUE",
    "SIGNATURES",
]

__all__ = [
    "ADDRESSES", "ARRIVED", "ASLEEP", "CAN_READ", "CONTROL", "CONTROL_SLOT", "GROW_GEN",
    "GROW_OK", "LINES", "MAX_GROUPS", "PID", "PROBE_ADDRESS", "PROBE_VALUE", "SIGNATURES",
]  # fmt: skip

# Per node and parity: sequence, contributes (0/1), signature, payload bytes, and how
# many queued jobs it offers to run fused (see run_fused; 1: only this one). Written
# before a barrier and read after it, never while peers read it (parity).
CONTROL = struct.Struct("<QQ8sQQ")
# Each node's arrival line (line 2) is eight 64-bit words that peers read while the
# owner may be rewriting them, so they are stored one aligned word at a time (see
# SharedMemoryGroup._words), never with struct.pack_into: it zero-fills its whole
# span before writing, and a peer reading in between once saw node 0's pid as 0.
ARRIVED = 0  # the last barrier it arrived at
ASLEEP = 1  # the barrier it sleeps in (0: awake)
PID = 2  # written once at setup: pid, address and value of its cross-memory probe
PROBE_ADDRESS = 3
PROBE_VALUE = 4
CAN_READ = 5  # and whether it can read every peer's memory (0/1)
GROW_GEN = 6  # the last slot generation it tried to allocate,
GROW_OK = 7  # and whether it could
# Per node and parity: where its groups lie, for peers to read them (see ipc.collectives.cma).
MAX_GROUPS = 8
ADDRESSES = struct.Struct(f"<{MAX_GROUPS}Q")
# Per node and parity: the signatures of the jobs it offers to run fused.
SIGNATURES = struct.Struct(f"<{MAX_GROUPS * 8}s")
# Each node's lines: control for parity 0 and 1, its arrival line, its addresses
# for parity 0 and 1, then its offered signatures for parity 0 and 1; 64 bytes
# apart so nodes never share a cache line.
CONTROL_SLOT = 64
LINES = 7
