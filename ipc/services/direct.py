"""A direct Unix stream socket between a Server and a Client of one host.

A round trip through ZeroMQ costs four hand-offs to its I/O threads; on one host the
services take a plain socket instead, bound to the authenticated link by a one-time
nonce (how: direct_setup.py). Here: one bound socket, `Direct`, and its framing.

Framing (every length checked against its cap before anything is read past it):
    prefix  <B kind, B dtype code, H ndim, I nbytes or frame count>
    TENSOR  prefix, ndim x int64 shape, the tensor's bytes (one contiguous CPU tensor)
    FRAMES  prefix, count x uint32 lengths, then the frames of an ipc.transport.wire message
            (its JSON header first; large payloads may lie in shared memory, ipc.services.bulk)
    BYE     prefix only: the sender is leaving; end of stream follows.
The socket is non-blocking; waits go through poll() in slices of SLICE seconds, so a
caller can look after the ZeroMQ link (heartbeats, a frozen peer) meanwhile. A send
that cannot finish reads what the peer sends meanwhile (two peers sending large
messages at once never deadlock). End of stream without a BYE: the peer died.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import math
import os
import select
import socket
import struct
import time
import weakref
from collections import deque
from collections.abc import Callable

import torch

from distlearn.common.envvars import env_flag, env_float

from ..transport import WireError, wire

__all__ = [
    "BYE",
    "FRAMES",
    "PREFIX",
    "SLICE",
    "TENSOR",
    "Closed",
    "Direct",
    "DirectError",
    "copy_of",
    "enabled",
    "frames_message",
    "send_all",
    "tensor_message",
    "tensor_of",
]

SLICE = 0.05  # longest wait on a socket before the caller's `service` runs
# A blocked reader polls without sleeping for this long first ($IPC_DIRECT_SPIN_US):
# a reply that comes within a round trip is then read without a sleep and a wake-up,
# which on an idle virtual machine (a halted vCPU to wake) cost more than the trip.
SPIN_S = env_float("IPC_DIRECT_SPIN_US", 100.0, low=0) * 1e-6
FAST_MAX = 64 << 10  # tensors up to this size go as TENSOR (larger: FRAMES, maybe bulk)
MAX_DIMS = 32
BUF = 256 << 10
IOV_MAX = 512  # buffers in one sendmsg (the kernel takes at most 1024)

PREFIX = struct.Struct("<BBHI")
TENSOR, FRAMES, BYE = 1, 2, 3
_BYE = PREFIX.pack(BYE, 0, 0, 0)
_SHAPES = [struct.Struct(f"<{n}q") for n in range(MAX_DIMS + 1)]
_HEADS = [struct.Struct(f"<BBHI{n}q") for n in range(MAX_DIMS + 1)]
# Complex tensors may carry a conjugate bit that raw bytes would lose: they take FRAMES.
_DTYPES = [dt for dt in wire.DTYPES.values() if not dt.is_complex]
_CODES = {dt: i for i, dt in enumerate(_DTYPES)}
_ITEMSIZE = [torch.empty(0, dtype=dt).element_size() for dt in _DTYPES]
_POLLIN = select.POLLIN | select.POLLHUP | select.POLLERR
_FLAGS = socket.MSG_NOSIGNAL


def enabled() -> bool:
    """$IPC_DIRECT=0 turns the direct path off (everything goes over ZeroMQ)."""
    return env_flag("IPC_DIRECT", True)


class DirectError(WireError):
    """The peer broke the framing: the connection is dropped."""


class Closed(Exception):
    """The peer's end is gone; `bye` says whether it said BYE first."""

    def __init__(self, bye: bool):
        super().__init__("said goodbye" if bye else "its connection closed")
        self.bye = bye


_open: weakref.WeakSet = weakref.WeakSet()  # sockets to drop in a forked child


def _after_fork_in_child() -> None:
    # A child must not keep its parent's sockets open: the peer would not see the
    # parent die. Closing the child's copies leaves the parent's as they are.
    for owner in list(_open):
        owner.close_inherited()


os.register_at_fork(after_in_child=_after_fork_in_child)


# ---- one bound connection ----------------------------------------------------------------


def tensor_message(t: object) -> list | None:
    """The buffers of a TENSOR message for `t` if it is a contiguous CPU tensor of at most
    FAST_MAX bytes (one buffer, its bytes copied), else None."""
    if type(t) is not torch.Tensor or not t.is_cpu or t.layout is not torch.strided:
        return None
    code = _CODES.get(t.dtype)
    if code is None or not t.is_contiguous() or t.is_neg():
        return None
    n = t.nbytes
    if n > FAST_MAX:
        return None
    shape = t.shape
    head = _HEADS[len(shape)].pack(TENSOR, code, len(shape), n, *shape)
    return [head + ctypes.string_at(t.data_ptr(), n)] if n else [head]


def frames_message(frames: list) -> list:
    """The buffers of a FRAMES message for an ipc.transport.wire message (its header frame first):
    one if it is small, else a header and the frames themselves (not copied)."""
    lens = [len(f.buffer) if hasattr(f, "buffer") else len(f) for f in frames]
    head = PREFIX.pack(FRAMES, 0, 0, len(frames)) + struct.pack(f"<{len(lens)}I", *lens)
    bufs = [f.buffer if hasattr(f, "buffer") else f for f in frames]
    if sum(lens) < 4096:  # one small write
        return [head + b"".join(bufs)]
    return [head, *bufs]


class _Left:
    """What is still to be written of a message: views of its buffers, and its size."""

    __slots__ = ("total", "views")

    def __init__(self, views: deque, total: int):
        self.views, self.total = views, total


def send_all(
    messages: list[tuple[Direct, list]], service: Callable[[Direct], None]
) -> dict[Direct, BaseException]:
    """Send one message (its buffers) on each of several sockets, each at its reader's
    pace: while one reader is not reading, the others' messages go on (a broadcast
    waits for its slowest reader, but nobody waits behind it). Every SLICE seconds,
    however busy the others are, `service(direct)` runs for each socket still sending,
    and may raise to give it up. Returns the sockets given up, with why (Closed, or
    what `service` raised)."""
    failed: dict[Direct, BaseException] = {}
    pending: dict[int, tuple[Direct, _Left]] = {}
    for d, bufs in messages:
        try:
            left = d._start(bufs)
        except Closed as why:
            failed[d] = why
            continue
        if left is not None:
            pending[d.fileno()] = (d, left)
    serviced = time.monotonic()
    while pending:
        poll = select.poll()
        for fd in pending:
            poll.register(fd, select.POLLOUT | _POLLIN)
        for fd, ev in poll.poll(int(SLICE * 1000)):
            d, left = pending[fd]
            try:
                if ev & _POLLIN:
                    d._fill(block=False)  # never deadlock with a peer that sends too
                if d._push(left) is None:
                    del pending[fd]
            except Closed as why:
                failed[d] = why
                del pending[fd]
        if time.monotonic() - serviced >= SLICE:  # every SLICE, busy sockets or not
            serviced = time.monotonic()
            for fd, (d, _) in list(pending.items()):
                try:
                    service(d)
                except Exception as why:  # (a peer known dead by its heartbeats)
                    failed[d] = why
                    del pending[fd]
    return failed


class Direct:
    """One end of a bound direct socket. `max_frame` caps every frame the peer sends
    (as the link's Limits do); `service()` runs between slices of a wait and raises
    when the peer is known dead by other means (heartbeats)."""

    def __init__(self, sock: socket.socket, max_frame: int):
        sock.setblocking(False)
        self.sock = sock
        self.max_frame = max_frame
        self._poll = select.poll()
        self._poll.register(sock, _POLLIN)
        self._set_buf(bytearray(BUF))
        self._lo = self._hi = 0
        self.closed: Closed | None = None  # the peer's end, once seen
        self.msgs_sent = self.bytes_sent = self.msgs_recv = self.bytes_recv = 0
        _open.add(self)

    def _set_buf(self, buf: bytearray) -> None:
        self._buf = buf
        self._view = memoryview(buf)
        self._addr = ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf))

    def fileno(self) -> int:
        return self.sock.fileno()

    def close(self, bye: bool = True) -> None:
        """Say BYE (best effort, never waits) and close."""
        if self.sock.fileno() < 0:
            return
        if bye and self.closed is None:
            with contextlib.suppress(OSError):
                self.sock.send(_BYE, _FLAGS)
        self.sock.close()
        # Nothing is read from a closed socket: its buffer (BUF, or as large as its
        # largest message) goes now, not when the last reference to us does.
        self._set_buf(bytearray(1))
        self._lo = self._hi = 0

    def close_inherited(self) -> None:
        self.sock.close()

    # ---- sending ---------------------------------------------------------------------

    def send_tensor(self, t: object, service: Callable[[], None]) -> bool:
        """Send `t` as one TENSOR message if it is a contiguous CPU tensor of at most
        FAST_MAX bytes (True); False (nothing sent) for anything else."""
        bufs = tensor_message(t)
        if bufs is None:
            return False
        self._send(bufs, service)
        return True

    def send_frames(self, frames: list, service: Callable[[], None]) -> None:
        """Send an ipc.transport.wire message (its header frame first)."""
        self._send(frames_message(frames), service)

    def _send(self, bufs: list, service: Callable[[], None]) -> None:
        """Send one message, waiting for room while the peer reads (see `_wait_writable`)."""
        left = self._start(bufs)
        while left is not None:
            self._wait_writable(service)
            left = self._push(left)

    def _start(self, bufs: list) -> _Left | None:
        """Write what the socket takes of a message now; the rest, or None if it all went."""
        if self.closed is not None:
            raise self.closed
        n = self._write(bufs) if len(bufs) == 1 else None
        if n is not None and n == len(bufs[0]):  # the common case: one small message
            self._sent(n)
            return None
        left = _Left(deque(memoryview(b).cast("B") for b in bufs), sum(len(b) for b in bufs))
        return self._push(left, n)

    def _push(self, left: _Left, n: int | None = None) -> _Left | None:
        """Write more of a message (`n`: bytes of it already written, not yet dropped)."""
        views = left.views
        while True:
            if n is None:
                bufs = list(itertools.islice(views, IOV_MAX)) if len(views) > 1 else [views[0]]
                n = self._write(bufs)
            wrote = n
            while views and n >= len(views[0]):  # drop what went out (and empty frames)
                n -= len(views[0])
                views.popleft()
            if n:
                views[0] = views[0][n:]
            if not views:
                self._sent(left.total)
                return None
            if wrote == 0:  # the socket is full
                return left
            n = None

    def _write(self, bufs: list) -> int:
        try:
            if len(bufs) == 1:
                return self.sock.send(bufs[0], _FLAGS)
            return self.sock.sendmsg(bufs[:IOV_MAX], (), _FLAGS)
        except (BlockingIOError, InterruptedError):
            return 0
        except OSError:
            self.closed = Closed(False)
            raise self.closed from None

    def _sent(self, nbytes: int) -> None:
        self.msgs_sent += 1
        self.bytes_sent += nbytes

    def _wait_writable(self, service: Callable[[], None]) -> None:
        p = select.poll()
        p.register(self.sock, select.POLLOUT | _POLLIN)
        events = p.poll(int(SLICE * 1000))
        if not events:
            service()
            return
        if events[0][1] & _POLLIN:
            self._fill(block=False)  # never deadlock with a peer that sends too

    # ---- receiving -------------------------------------------------------------------

    def _fill(self, block: bool) -> bool:
        """Read what the socket has (waiting up to SLICE if `block`); False if nothing."""
        buf = self._buf
        if self._lo == self._hi:
            self._lo = self._hi = 0
            if len(buf) > 4 * BUF:  # a large message passed: give its buffer back
                self._set_buf(bytearray(BUF))
                buf = self._buf
        elif len(buf) - self._hi < BUF // 4:  # little room left: move what is unread
            k = self._hi - self._lo  # to the front, or to a larger buffer
            new = buf if k <= len(buf) // 2 else bytearray(2 * len(buf))
            if new is buf:
                buf[:k] = buf[self._lo : self._hi]
            else:
                new[:k] = buf[self._lo : self._hi]
                self._set_buf(new)
            self._lo, self._hi = 0, k
        if block and not self._spin() and not self._poll.poll(int(SLICE * 1000)):
            return False
        try:
            n = self.sock.recv_into(self._view[self._hi :])
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            n = 0
        if n == 0:
            if self.closed is None:
                self.closed = Closed(False)
            return False
        self._hi += n
        return True

    def _spin(self) -> bool:
        """Whether the socket became readable within SPIN_S, polled without sleeping."""
        poll, clock = self._poll.poll, time.perf_counter
        end = clock() + SPIN_S
        while True:
            if poll(0):
                return True
            if clock() >= end:
                return False

    def _need(self, n: int) -> None:
        """Make room for a message of n bytes from `_lo` (a new buffer if it is larger)."""
        if n > len(self._buf) - self._lo:
            new = bytearray(max(n, len(self._buf)))
            k = self._hi - self._lo
            new[:k] = self._buf[self._lo : self._hi]
            self._set_buf(new)
            self._lo, self._hi = 0, k

    def _parse(self) -> tuple | list | None:
        """The next whole message in the buffer, or None. A TENSOR is (dtype, shape,
        address, nbytes), valid until the next read; FRAMES are views, likewise."""
        lo, avail = self._lo, self._hi - self._lo
        if avail < 8:
            return None
        buf = self._buf
        kind, code, ndim, n = PREFIX.unpack_from(buf, lo)
        if kind == TENSOR:
            if code >= len(_DTYPES) or ndim > MAX_DIMS or n > self.max_frame:
                raise DirectError(f"bad tensor header ({code}, {ndim} dims, {n} bytes)")
            need = 8 + 8 * ndim + n
            if avail < need:
                self._need(need)
                return None
            shape = _SHAPES[ndim].unpack_from(buf, lo + 8)
            if min(shape, default=0) < 0 or math.prod(shape) * _ITEMSIZE[code] != n:
                raise DirectError(f"{n} bytes for {_DTYPES[code]} of shape {list(shape)}")
            self._lo = lo + need
            self.msgs_recv += 1
            self.bytes_recv += need
            return (_DTYPES[code], shape, self._addr + lo + need - n, n)
        if kind == FRAMES:
            if code or ndim or not 1 <= n <= wire.MAX_FRAMES + 1:
                raise DirectError(f"bad message header ({n} frames)")
            head = 8 + 4 * n
            if avail < head:
                self._need(head)
                return None
            lens = struct.unpack_from(f"<{n}I", buf, lo + 8)
            if lens[0] > wire.MAX_CONTROL or max(lens) > self.max_frame:
                raise DirectError(
                    f"a frame of {max(lens)} bytes (limit {self.max_frame}; header "
                    f"{wire.MAX_CONTROL})"
                )
            need = head + sum(lens)
            if avail < need:
                self._need(need)
                return None
            frames, at = [], lo + head
            for k in lens:
                frames.append(self._view[at : at + k])
                at += k
            self._lo = lo + need
            self.msgs_recv += 1
            self.bytes_recv += need
            return frames
        if kind == BYE and not (code or ndim or n):
            self._lo = lo + 8
            self.closed = Closed(True)
            return None
        raise DirectError(f"unknown message kind {kind}")

    def read(self, block: bool, service: Callable[[], None] | None = None,
             deadline: float | None = None) -> tuple | list | None:  # fmt: skip
        """The next message; None if there is none (`block=False`) or the deadline
        passed. Raises Closed once the peer's end is gone and its messages are read,
        DirectError for a broken frame."""
        while True:
            msg = self._parse()
            if msg is not None:
                return msg
            if self.closed is not None:
                raise self.closed
            if self._fill(block):
                continue
            if self.closed is not None:
                continue  # parse what is left, then raise
            if not block:
                return None
            if service is not None:
                service()
            if deadline is not None and time.monotonic() >= deadline:
                return None


def copy_of(msg: tuple | list) -> tuple | list:
    """A message that outlives the next read (for a queue of pending messages)."""
    if isinstance(msg, list):
        return [bytes(f) for f in msg]
    dtype, shape, addr, n = msg
    return (dtype, shape, ctypes.string_at(addr, n), n)


def tensor_of(msg: tuple, into: object) -> torch.Tensor:
    """The tensor a TENSOR message carries: written into `into` if it is a tensor (same
    dtype and shape required, as ipc.transport.wire's), else a new one."""
    dtype, shape, src, n = msg
    if isinstance(into, torch.Tensor):
        if into.dtype != dtype or into.shape != shape:
            raise WireError(
                f"value: received {dtype} {list(shape)}, `into` has {into.dtype} {list(into.shape)}"
            )
        dst = into
    else:
        dst = torch.empty(shape, dtype=dtype)
    if n:
        if isinstance(src, bytes):
            src = ctypes.cast(ctypes.c_char_p(src), ctypes.c_void_p).value
        if dst.is_cpu and dst.is_contiguous() and not dst.is_neg():
            ctypes.memmove(dst.data_ptr(), src, n)
        else:
            raw = (ctypes.c_char * n).from_address(src)
            dst.detach().copy_(torch.frombuffer(raw, dtype=torch.uint8).view(dtype).view(shape))
    return dst
