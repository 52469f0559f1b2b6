"""Large messages between processes of one host through shared memory, for the services.

Each process keeps one *arena* for what it sends: an anonymous memfd (MFD_CLOEXEC,
mode 0600). It has no name in /dev/shm or anywhere else, so nothing is left behind
whoever is SIGKILLed when: its pages go with the last process that maps it.

1. Offer: an endpoint of the services puts its arena in its handshake info (pid, fd
   number, size, the host's boot id, and a random 16-byte nonce that is also the
   arena's first bytes). The info is covered by the link's authentication.
2. Map: a peer on the same host (same boot id) opens /proc/<pid>/fd/<fd> (the kernel
   lets only the same user, or root, open it), checks that it is an anonymous memfd
   of ours of exactly the offered size (before mapping it) whose first bytes are the
   nonce, maps it, and says so with a BULK_OK message naming the nonce.
3. Send: only to a peer that said BULK_OK, a message whose large payloads add up to
   MIN_BYTES or more is copied into a block of the arena; the message on the link is
   the usual JSON header plus where the bytes lie (slot, generation, offset, sizes)
   and the small payloads. Everything else goes over the wire as before: small
   messages, peers on other hosts or in other pid namespaces, a full arena.
4. Receive: the receiver checks the reference against the arena (bounds, and that
   the slot still holds that generation), copies the bytes out (into `into`'s
   tensors, or new ones) and releases the block by zeroing its slot word, which the
   sender sees at its next allocation. So a 4 MB tensor costs two memcpys and no
   socket traffic, against two copies and a socket each way before.

Released blocks are reused lowest offset first, so a steady exchange keeps touching
the same, already mapped pages. A block given to a peer that never reads it (dropped,
dead) stays taken; when the arena is full, messages go over the wire.
"""

from __future__ import annotations

import contextlib
import json
import logging
import mmap
import os
import threading
import weakref
from dataclasses import dataclass

import zmq

from ..errors import PeerError
from ..procs import pid_alive
from ..transport import Link, WireError, runtime, wire

log = logging.getLogger(__name__)

BULK_OK = 40  # a link message kind (the users' range): "I have mapped your arena"
LARGE_FRAME = 64 << 10  # payload frames from this size go into the arena ...
MIN_BYTES = 256 << 10  # ... when they add up to this much (below: the wire is as fast)
NONCE = 16
SLOTS = 1024  # blocks in use at once, at most
SLOT_TABLE = 64  # where the slot words start (after the nonce)
DATA = 16 << 10  # where blocks start
ALIGN = 64
MAX_ARENA = 1 << 40
MEMFD_NAME = "distlearn-bulk"


def enabled() -> bool:
    """$IPC_BULK=0 turns the shared-memory path off (everything goes over the wire)."""
    return os.environ.get("IPC_BULK", "1") != "0"


def arena_bytes() -> int:
    try:
        mb = int(os.environ.get("IPC_BULK_ARENA_MB", "256"))
    except ValueError:
        raise ValueError(f"$IPC_BULK_ARENA_MB={os.environ['IPC_BULK_ARENA_MB']!r}") from None
    if not 1 <= mb <= MAX_ARENA >> 20:
        raise ValueError(f"$IPC_BULK_ARENA_MB must be in [1, {MAX_ARENA >> 20}], not {mb}")
    return mb << 20


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


def _header(frames: list) -> bytes:
    first = frames[0]
    return first.bytes if hasattr(first, "bytes") else bytes(first)


class Bulk:
    """One endpoint's use of the arenas: what it offers, which peers read our arena
    (they said BULK_OK), and the peers' arenas we read. Links are added by `up` once
    their handshake is done, and dropped by `forget`."""

    def __init__(self):
        self.arena = local_arena()
        self.peers: dict[Link, PeerArena] = {}
        self.readers: set[Link] = set()
        self.sent: dict[Link, list[int]] = {}  # link -> [messages, bytes] through the arena
        self.received = 0  # messages whose payloads were read out of an arena

    def info(self) -> dict:
        """What to add to the endpoint's handshake info."""
        return {"bulk": self.arena.offer} if self.arena is not None else {}

    def up(self, link: Link) -> None:
        """A link is up: map its peer's arena if we can and tell the peer."""
        peer = attach(link.info.get("bulk"))
        if peer is None:
            return
        self.peers[link] = peer
        body = json.dumps({"nonce": peer.nonce.hex()}).encode()
        with contextlib.suppress(PeerError, zmq.ZMQError):
            link.send(bytes([BULK_OK]) + body)

    def control(self, link: Link, frames: list) -> bool:
        """True (and handled) when `frames` is our own BULK_OK, not a user's message."""
        header = _header(frames)
        if not header or header[0] != BULK_OK:
            return False
        try:
            body = wire.parse_control(header, {"nonce": wire.hex_of(NONCE)})
        except WireError:
            return True
        if self.arena is not None and bytes.fromhex(body["nonce"]) == self.arena.nonce:
            self.readers.add(link)
        return True

    def forget(self, link: Link) -> None:
        """`link` is gone for good: drop its arena's mapping and its counts (a caller that
        reports them reads `stats` first)."""
        self.peers.pop(link, None)
        self.readers.discard(link)
        self.sent.pop(link, None)

    def stats(self, link: Link) -> dict:
        msgs, nbytes = self.sent.get(link, (0, 0))
        return {"shm_msgs_sent": msgs, "shm_bytes_sent": nbytes, "shm": link in self.readers}

    # ---- messages ----------------------------------------------------------------

    def store(self, obj: object) -> tuple[list, Arena | None]:
        """A message carrying `obj` to keep (in a queue) for whichever reader: its frames
        and the arena its large payloads went to (None: all in the frames)."""
        frames, used = self._pack(obj, None)
        return frames, (self.arena if used else None)

    def pack(self, obj: object, link: Link | None) -> list:
        """The frames of a message carrying `obj`, its large payloads in our arena when
        `link`'s peer reads it (`link=None`: keep them there for whichever reader, see
        `for_link`; the small payloads are then copied, so `obj` may change once this
        returns; with a link, `send` copies them into the socket)."""
        return self._pack(obj, link)[0]

    def _pack(self, obj: object, link: Link | None) -> tuple[list, bool]:
        meta, frames = wire.encode(obj)
        used = False
        if self.arena is not None and (link is None or link in self.readers):
            big = [i for i, f in enumerate(frames) if len(f) >= LARGE_FRAME]
            total = sum(len(frames[i]) for i in big)
            block = self.arena.alloc(total) if total >= MIN_BYTES else None
            used = block is not None
            if used:
                view, at, spans = self.arena.view, block.offset, []
                for i in big:
                    n = len(frames[i])
                    view[at : at + n] = frames[i]
                    spans.append([i, n])
                    at += n
                meta["shm"] = {"s": block.slot, "g": block.gen, "o": block.offset, "f": spans}
                if link is not None:
                    self.arena.lend(block.slot, block.gen, link.info.get("pid"))
                    count = self.sent.setdefault(link, [0, 0])
                    count[0] += 1
                    count[1] += total
                bigset = set(big)
                frames = [f for i, f in enumerate(frames) if i not in bigset]
        if link is None:  # kept in a queue: a copy of what is not in the arena
            frames = [f if isinstance(f, bytes) else bytes(f) for f in frames]
        return [wire.control(wire.Kind.MESSAGE, meta), *frames], used

    def send(self, link: Link, obj: object) -> None:
        """Send `obj` on `link`; its tensors may change as soon as this returns. Bytes not
        in the arena are copied into ZeroMQ's buffers: for a message that is written out at
        once, a copy costs less than tracking when ZeroMQ lets go of our memory (about 0.2
        ms against 3 ms a megabyte)."""
        frames = self.pack(obj, link)
        try:
            link.send_frames(frames, copy=True)
        except BaseException:
            self.drop(frames, self.arena)
            raise

    def for_link(self, frames: list, memory: _Memory | None, link: Link) -> list:
        """The frames of a stored message (its large payloads in `memory`) to send on
        `link`: as they are when its peer reads that memory (our arena), else with the
        payloads copied out of it (and the block released)."""
        if memory is None:
            if "shm" in wire.parse_control(_header(frames)):
                # Its arena is not ours to read (a peer we never mapped, or one gone before
                # its write was taken in): sent on, the reader would look the reference up
                # in our arena and read another item's bytes.
                raise WireError("a shared-memory reference from a peer whose arena is not mapped")
            return frames
        if memory is self.arena and link in self.readers:
            ref = wire.parse_control(_header(frames)).get("shm")
            if isinstance(ref, dict):
                self.arena.lend(ref.get("s"), ref.get("g"), link.info.get("pid"))
            return frames
        meta = wire.parse_control(_header(frames))
        ref = meta.pop("shm", None)
        if ref is None:
            return frames
        if not isinstance(ref, dict):
            raise WireError("a shared-memory reference that is not an object")
        try:
            payload = memory.payload(ref, list(frames[1:]))
            return [wire.control(wire.Kind.MESSAGE, meta), *(bytes(f) for f in payload)]
        finally:
            memory.release(ref.get("s"), ref.get("g"))

    def memory_of(self, link: Link) -> PeerArena | None:
        """The arena that large payloads received on `link` lie in."""
        return self.peers.get(link)

    def unpack(
        self, frames: list, memory: _Memory | None, into: object = None, release: bool = True
    ) -> object:
        """The value of a message (a received or stored one whose large payloads lie in
        `memory`), tensors copied out (into `into`'s where it has them); the block is
        released then (`release=False`: only if decoding fails; the caller releases it
        with `drop` later). WireError for a malformed message."""
        if not frames:
            raise WireError("no frames")
        meta = wire.parse_control(_header(frames))
        ref = meta.get("shm")
        if ref is None:
            return wire.decode(meta, list(frames[1:]), into=into)
        if memory is None:
            raise WireError("a shared-memory reference from a peer whose arena is not mapped")
        self.received += 1
        done = False
        try:
            value = wire.decode(meta, memory.payload(ref, list(frames[1:])), into=into)
            done = True
            return value
        finally:
            if isinstance(ref, dict) and (release or not done):
                memory.release(ref.get("s"), ref.get("g"))

    def take_back(self, frames: list, memory: _Memory | None) -> bool:
        """A message lent to a reader that died before reading it comes back: False when
        its block was released meanwhile (its bytes are gone), else True (kept for the
        next reader, no longer counted as the dead reader's)."""
        if memory is None:
            return True
        try:
            ref = wire.parse_control(_header(frames)).get("shm")
        except WireError:
            return False
        if not isinstance(ref, dict):
            return True
        slot, gen = ref.get("s"), ref.get("g")
        if not (_is_int(slot, 0, SLOTS) and memory.slots[slot] == gen):
            return False
        if memory is self.arena:
            with self.arena.lock:
                self.arena.readers.pop(slot, None)
        return True

    @staticmethod
    def drop(frames: list, memory: _Memory | None) -> None:
        """A message that will never be read: release its block."""
        if memory is None or not frames:
            return
        with contextlib.suppress(WireError):
            ref = wire.parse_control(_header(frames)).get("shm")
            if isinstance(ref, dict):
                memory.release(ref.get("s"), ref.get("g"))
