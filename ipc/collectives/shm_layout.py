"""The layout of the shared control page of a same-host tree (see shm.py), as named
structures: where each node's words are is read off them, never written as offsets.

The page is :class:`NodeLines` once per node, node 0 first. A node's lines are 64
bytes apart (a cache line each), so nodes never share one, and a node's lines for
parity 0 and 1 alternate collectives, so a collective never rewrites what a slower
peer still reads from the previous one:

    control[parity]      :class:`Control`: what it enters the collective with
    arrival              :class:`Arrival`: the barrier counters and its setup facts
    addresses[parity]    where its buffers lie, for peers to read (ipc.collectives.cma)
    signatures[parity]   the signatures of the jobs it offers to run fused

The code reads and writes the page through ``struct`` (:data:`CONTROL`,
:data:`ADDRESSES`, :data:`SIGNATURES`, at the offsets :func:`control`,
:func:`addresses` and :func:`signatures` give) and the arrival line one aligned 64-bit
word at a time (:func:`arrival` gives its first word; :data:`ARRIVED` and the others
are word indices into it, taken from :class:`Arrival`'s fields): peers read those words
while their owner rewrites them, and ``struct.pack_into`` zero-fills its whole span
before it writes (a peer once saw node 0's pid as 0 in between).
"""

from __future__ import annotations

import ctypes
import struct

__all__ = [
    "ADDRESSES",
    "ARRIVED",
    "ASLEEP",
    "CAN_READ",
    "CONTROL",
    "GROW_GEN",
    "GROW_OK",
    "LINE",
    "MAX_GROUPS",
    "PID",
    "PROBE_ADDRESS",
    "PROBE_VALUE",
    "SIGNATURES",
    "Arrival",
    "Control",
    "NodeLines",
    "addresses",
    "arrival",
    "control",
    "page_bytes",
    "signatures",
]

LINE = 64  # bytes of a cache line
MAX_GROUPS = 8  # buffers one collective (or a fused run of them) takes, at most
_u64 = ctypes.c_uint64


class Control(ctypes.Structure):
    """A node's control line for one parity: written before a barrier and read after it,
    never while peers read it."""

    _fields_ = [
        ("seq", _u64),  # the collective's sequence number
        ("contributes", _u64),  # 0/1
        ("signature", ctypes.c_char * 8),  # the op, shapes and dtypes, hashed
        ("nbytes", _u64),  # payload bytes
        ("offered", _u64),  # queued jobs it offers to run fused (see run_fused; 1: this one)
        ("_pad", ctypes.c_char * (LINE - 40)),
    ]


class Arrival(ctypes.Structure):
    """A node's arrival line: eight 64-bit words that peers read while their owner may be
    rewriting them (so each is stored alone, an aligned word: see the module's text)."""

    _fields_ = [
        ("arrived", _u64),  # the last barrier it arrived at
        ("asleep", _u64),  # the barrier it sleeps in (0: awake)
        ("pid", _u64),  # written once at setup: its pid, and the address and value
        ("probe_address", _u64),  # of its cross-memory probe (ipc.collectives.cma)
        ("probe_value", _u64),
        ("can_read", _u64),  # whether it can read every peer's memory (0/1)
        ("grow_gen", _u64),  # the last slot generation it tried to allocate,
        ("grow_ok", _u64),  # and whether it could
    ]


class NodeLines(ctypes.Structure):
    """One node's lines of the control page, in order."""

    _fields_ = [
        ("control", Control * 2),  # by parity
        ("arrival", Arrival),
        ("addresses", (_u64 * MAX_GROUPS) * 2),  # by parity: its buffers' addresses
        ("signatures", (ctypes.c_char * (8 * MAX_GROUPS)) * 2),  # by parity: offered jobs'
    ]


# How the code packs a line (see the module's text); each the size of its field.
CONTROL = struct.Struct("<QQ8sQQ")
ADDRESSES = struct.Struct(f"<{MAX_GROUPS}Q")
SIGNATURES = struct.Struct(f"<{MAX_GROUPS * 8}s")

# Word indices into a node's arrival line (its first word: `arrival`).
ARRIVED, ASLEEP, PID, PROBE_ADDRESS, PROBE_VALUE, CAN_READ, GROW_GEN, GROW_OK = (
    getattr(Arrival, name).offset // 8 for name, _ in Arrival._fields_
)

_NODE = ctypes.sizeof(NodeLines)
_CONTROL = NodeLines.control.offset
_ARRIVAL = NodeLines.arrival.offset
_ADDRESSES = NodeLines.addresses.offset
_SIGNATURES = NodeLines.signatures.offset


def page_bytes(n: int) -> int:
    """The control page's size for `n` nodes."""
    return n * _NODE


def control(node: int, parity: int) -> int:
    """Where `node`'s :class:`Control` line for `parity` starts (bytes; pack with CONTROL)."""
    return node * _NODE + _CONTROL + parity * ctypes.sizeof(Control)


def arrival(node: int) -> int:
    """Where `node`'s :class:`Arrival` line starts, in 64-bit words (add ARRIVED...)."""
    return (node * _NODE + _ARRIVAL) // 8


def addresses(node: int, parity: int) -> int:
    """Where `node`'s buffer addresses for `parity` start (bytes; pack with ADDRESSES)."""
    return node * _NODE + _ADDRESSES + parity * ADDRESSES.size


def signatures(node: int, parity: int) -> int:
    """Where `node`'s offered signatures for `parity` start (bytes; pack with SIGNATURES)."""
    return node * _NODE + _SIGNATURES + parity * SIGNATURES.size


def _check() -> None:
    """The packing formats fit their fields, every line starts a cache line, and a node's
    lines fill whole cache lines: checked at import, so a change to either side fails."""
    assert CONTROL.size <= ctypes.sizeof(Control) == LINE
    assert ctypes.sizeof(Arrival) == LINE
    assert ADDRESSES.size == ctypes.sizeof(_u64 * MAX_GROUPS) == LINE
    assert SIGNATURES.size == 8 * MAX_GROUPS == LINE
    assert all(off % LINE == 0 for off in (_CONTROL, _ARRIVAL, _ADDRESSES, _SIGNATURES))
    assert _NODE % LINE == 0
    fields = [getattr(Control, name).offset for name, _ in Control._fields_][:5]
    assert fields == [0, 8, 16, 24, 32]  # CONTROL's "<QQ8sQQ", field by field


_check()
