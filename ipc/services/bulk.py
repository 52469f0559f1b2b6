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
dead) stays taken; when the arena is full, messages go over the wire. The arenas
themselves (allocation, offer, checks before mapping) are arena.py; here, `Bulk`: one
endpoint's use of them for its messages.
"""

from __future__ import annotations

import contextlib
import json

import zmq

from ..errors import PeerError
from ..transport import Link, WireError, wire
from .arena import NONCE, SLOTS, Arena, PeerArena, _is_int, _Memory, attach, local_arena

__all__ = ["BULK_OK", "Bulk"]

BULK_OK = 40  # a link message kind (the users' range): "I have mapped your arena"
LARGE_FRAME = 64 << 10  # payload frames from this size go into the arena ...
MIN_BYTES = 256 << 10  # ... when they add up to this much (below: the wire is as fast)


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
            # Not lent to the reader's pid: the broker releases the block when the reader
            # is done, or takes the item back when it dies (the arena reclaiming the block
            # of a dead reader would free the bytes of an item coming back).
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
