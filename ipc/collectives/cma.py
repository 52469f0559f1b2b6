"""Cross-memory attach: copy from another process's memory in one kernel pass.

Linux's ``process_vm_readv`` reads straight out of a peer's address space,
which is how MPI libraries move large messages between processes of one
host. For an all-reduce it removes the copy into a shared segment: a node
reads its slice of every peer's tensor where it lies, and later the reduced
slices from the peers' tensors, so each byte is copied once instead of twice.

It needs the right to ptrace the peer: the same user, and no Yama
restriction (``/proc/sys/kernel/yama/ptrace_scope`` 0) or seccomp filter in
the way. :func:`usable` probes for it; the caller falls back to shared
slots when any node of the group cannot use it. Nothing here changes the
process's ptrace settings.
"""

from __future__ import annotations

import ctypes
import os

from distlearn.common.envvars import env_flag

__all__ = ["Probe", "read", "usable"]


class _IOVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _load():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.process_vm_readv
    except (OSError, AttributeError):
        return None
    fn.argtypes = [
        ctypes.c_int,
        ctypes.POINTER(_IOVec),
        ctypes.c_ulong,
        ctypes.POINTER(_IOVec),
        ctypes.c_ulong,
        ctypes.c_ulong,
    ]
    fn.restype = ctypes.c_ssize_t
    return fn


_readv = _load()


def read(pid: int, remote: int, local: int, nbytes: int) -> None:
    """Copy `nbytes` at address `remote` of process `pid` to our address `local`."""
    while nbytes > 0:
        lv, rv = _IOVec(local, nbytes), _IOVec(remote, nbytes)
        got = _readv(pid, ctypes.byref(lv), 1, ctypes.byref(rv), 1, 0)
        if got <= 0:
            err = ctypes.get_errno() if got < 0 else 0
            raise OSError(err, f"process_vm_readv from pid {pid}: {os.strerror(err)}")
        # A partial read stops at a page boundary: go on from there.
        remote, local, nbytes = remote + got, local + got, nbytes - got


class Probe:
    """A word of ours with a known value, for a peer to test :func:`read` against."""

    def __init__(self, value: int):
        self.value = value
        self._word = ctypes.c_uint64(value)
        self.address = ctypes.addressof(self._word)


def usable(pid: int, address: int, value: int) -> bool:
    """True when reading process `pid`'s probe word at `address` gives `value`."""
    if _readv is None or not env_flag("IPC_SHM_CMA", True):
        return False
    out = ctypes.c_uint64(0)
    try:
        read(pid, address, ctypes.addressof(out), 8)
    except OSError:
        return False
    return out.value == value
