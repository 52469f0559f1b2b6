"""The arenas that large messages of the services travel in between processes of one host.

Each process keeps one *arena* for what it sends: an anonymous memfd (MFD_CLOEXEC,
mode 0600). It has no name in /dev/shm or anywhere else, so nothing is left behind
whoever is SIGKILLed when: its pages go with the last process that maps it. A peer on
the same host maps it (`attach`) only once it has checked that it is an anonymous
memfd of ours of exactly the offered size whose first bytes are the offer's nonce.
Blocks are allocated lowest offset first and released by their reader, who zeroes
their slot word (see bulk.py for the messages that use them).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import threading
import weakref
from dataclasses import dataclass

from distlearn.common.envvars import env_flag, env_int

from ..procs import pid_alive
from ..transport import WireError, runtime, wire

__all__ = ["Arena", "Block", "PeerArena", "attach", "local_arena"]

log = logging.getLogger(__name__)


NONCE = 16
SLOTS = 1024  # blocks in use at once, at most
SLOT_TABLE = 64  # where the slot words start (after the nonce)
DATA = 16 << 10  # where blocks start
ALIGN = 64
MAX_ARENA = 1 << 40
MEMFD_NAME = "distlearn-bulk"


def enabled() -> bool:
    """$IPC_BULK=0 turns the shared-memory path off (everything goes over the wire)."""
    return env_flag("IPC_BULK", True)


def arena_bytes() -> int:
    return env_int("IPC_BULK_ARENA_MB", 256, low=1, high=MAX_ARENA >> 20) << 20


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _is_int(v: object, lo: int, hi: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v < hi


class _Memory:
    """An arena mapped in this process: ours or a peer's."""

    def __init__(self, m: mmap.mmap, size: int, nonce: bytes):
        self.map = m
        self.size = size
        self.nonce = nonce
        self.view = memoryview(m)
        # 8-byte aligned words: a load or store of one is never torn.
        self.slots = self.view[SLOT_TABLE : SLOT_TABLE + 8 * SLOTS].cast("Q")

    def release(self, slot: int, gen: int) -> None:
        """The block is read (or dropped): its sender may reuse it."""
        if _is_int(slot, 0, SLOTS) and self.slots[slot] == gen:
            self.slots[slot] = 0

    def payload(self, ref: object, inline: list) -> list:
        """The payload frames of a message whose large ones lie here (`ref`), the others
        being `inline`; WireError for any reference that does not fit."""
        if not isinstance(ref, dict):
            raise WireError("bad shared-memory reference")
        slot, gen, off, spans = ref.get("s"), ref.get("g"), ref.get("o"), ref.get("f")
        if not (_is_int(slot, 0, SLOTS) and _is_int(gen, 1, 1 << 63)):
            raise WireError("bad shared-memory slot")
        if self.slots[slot] != gen:
            raise WireError(f"shared-memory slot {slot} does not hold block {gen}")
        if not _is_int(off, DATA, self.size) or not isinstance(spans, list):
            raise WireError("bad shared-memory offset")
        total = len(inline) + len(spans)
        if not spans or total > wire.MAX_FRAMES:
            raise WireError(f"{total} payload frames")
        out: list = [None] * total
        at = off
        for span in spans:
            if not (isinstance(span, list) and len(span) == 2):
                raise WireError("bad shared-memory span")
            i, n = span
            if not (_is_int(i, 0, total) and _is_int(n, 0, self.size)) or out[i] is not None:
                raise WireError(f"bad shared-memory span {str(span)[:40]}")
            if at + n > self.size:
                raise WireError(f"a shared-memory span past the arena's {self.size} bytes")
            out[i] = self.view[at : at + n]
            at += n
        rest = iter(inline)
        return [next(rest) if f is None else f for f in out]


@dataclass
class Block:
    slot: int
    gen: int
    offset: int


class Arena(_Memory):
    """This process's arena: blocks for the large messages it sends."""

    def __init__(self, size: int):
        fd = os.memfd_create(MEMFD_NAME, os.MFD_CLOEXEC)
        try:
            os.fchmod(fd, 0o600)
            os.ftruncate(fd, size)
            m = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            raise
        nonce = os.urandom(NONCE)
        m[:NONCE] = nonce
        super().__init__(m, size, nonce)
        self.fd = fd
        self.pid = os.getpid()
        self.lock = threading.Lock()  # a queue's broker thread and its owner both send
        self.live: dict[int, tuple[int, int, int]] = {}  # slot -> (start, end, gen)
        self.readers: dict[int, int] = {}  # slot -> pid of the process it was sent to
        self.free_slots = list(range(SLOTS - 1, -1, -1))
        self.gen = 0
        self.allocated = DATA  # pages reserved (fallocate) so far
        self.offer = {
            "pid": self.pid,
            "fd": fd,
            "size": size,
            "nonce": nonce.hex(),
            "boot": _boot_id(),
        }

    def alloc(self, n: int) -> Block | None:
        """A block of n bytes, or None when the arena is full."""
        with self.lock:
            self._reclaim(dead_readers=False)
            start = self._fit(n)
            if start is None:
                # Full: take back the blocks whose reader died before it read them.
                self._reclaim(dead_readers=True)
                start = self._fit(n)
                if start is None:
                    return None
            if start + n > self.allocated:
                try:
                    # Reserve the pages now: a mapping that cannot get a page raises
                    # SIGBUS where it is touched; this raises ENOSPC/ENOMEM here instead.
                    os.posix_fallocate(self.fd, self.allocated, start + n - self.allocated)
                except OSError as err:
                    log.warning("ipc: no room for a %d-byte shared-memory block: %s", n, err)
                    return None
                self.allocated = start + n
            slot = self.free_slots.pop()
            self.gen += 1
            self.slots[slot] = self.gen
            self.live[slot] = (start, start + n, self.gen)
            return Block(slot, self.gen, start)

    def _fit(self, n: int) -> int | None:
        """The lowest offset with room for n bytes (None: none, or no slot left)."""
        if not self.free_slots:
            return None
        start = DATA
        for s, e, _ in sorted(self.live.values()):
            if s - start >= n:
                break
            start = max(start, _align(e))
        return start if self.size - start >= n else None

    def _reclaim(self, dead_readers: bool) -> None:
        for slot, (_, _, gen) in list(self.live.items()):
            free = self.slots[slot] != gen  # released by its reader
            if not free and dead_readers and slot in self.readers:
                free = not pid_alive(self.readers[slot])
            if free:
                del self.live[slot]
                self.readers.pop(slot, None)
                self.free_slots.append(slot)

    def lend(self, slot: int, gen: int, pid: object) -> None:
        """The block went to process `pid` (from its authenticated handshake): if that
        process dies before releasing it, the block is ours again."""
        if _is_int(pid, 1, 1 << 31):
            with self.lock:
                if self.live.get(slot, (0, 0, -1))[2] == gen:
                    self.readers[slot] = pid

    def close_inherited(self) -> None:
        """In a forked child: drop the parent's arena (the child makes its own)."""
        with contextlib.suppress(OSError):
            os.close(self.fd)


class PeerArena(_Memory):
    """Another process's arena, mapped here to read its blocks."""


_local: Arena | None = None
_local_lock = threading.Lock()
# (pid, fd, nonce) -> the mapping, while a link or a stored item uses it
_attached: weakref.WeakValueDictionary[tuple, PeerArena] = weakref.WeakValueDictionary()


def local_arena() -> Arena | None:
    """This process's arena (made on first use); None when the path is off or the host
    has no memfd."""
    global _local
    if not enabled():
        return None
    with _local_lock:
        if _local is None or _local.pid != os.getpid():
            try:
                _local = Arena(arena_bytes())
            except (OSError, AttributeError) as err:  # AttributeError: no os.memfd_create
                log.info("ipc: no shared-memory arena (%s); large messages use the wire", err)
                return None
        return _local


def _after_fork_in_child() -> None:
    global _local, _local_lock
    _local_lock = threading.Lock()
    if _local is not None:
        _local.close_inherited()
        _local = None
    _attached.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


def attach(offer: object) -> PeerArena | None:
    """Map the arena a peer offered, when it is one of ours on this host; else None."""
    if not enabled() or not isinstance(offer, dict):
        return None
    pid, fd, size, boot = (offer.get(k) for k in ("pid", "fd", "size", "boot"))
    try:
        nonce = bytes.fromhex(offer.get("nonce"))
    except (TypeError, ValueError):
        return None
    ok = _is_int(pid, 1, 1 << 31) and _is_int(fd, 0, 1 << 31) and _is_int(size, DATA, MAX_ARENA)
    if not ok or len(nonce) != NONCE or not boot or boot != _boot_id():
        return None  # another host (or junk): the wire
    peer = _attached.get((pid, fd, nonce))
    if peer is not None:
        return peer
    path = f"/proc/{pid}/fd/{fd}"
    try:
        # Only an anonymous memfd of our name is opened: never a FIFO or a device that
        # another pid namespace's process numbers would point us at.
        if not os.readlink(path).startswith(f"/memfd:{MEMFD_NAME} "):
            return None
        hfd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        st = os.fstat(hfd)
        if not runtime.private_file(st) or st.st_nlink != 0 or st.st_size != size:
            return None
        m = mmap.mmap(hfd, size)
    except OSError:
        return None
    finally:
        os.close(hfd)
    if m[:NONCE] != nonce:  # a reused pid or fd number: not the arena that was offered
        m.close()
        return None
    peer = PeerArena(m, size, nonce)
    _attached[pid, fd, nonce] = peer
    return peer
