"""One HTTP/1.1 connection: an asyncio.Protocol with a deadline for every phase."""

from __future__ import annotations

import asyncio
import logging
import mimetypes
import os
import time
from email.utils import formatdate
from typing import Protocol

from .files import Files
from .limits import MAX_HEAD, MIN_SEND_RATE, REASONS, SMALL_FILE, BadRequest
from .requests import parse_head, parse_range

__all__ = ["HttpConnection", "ServerState"]

log = logging.getLogger(__name__)


class ServerState(Protocol):
    """What a connection needs of the server that accepted it (`server.Server`)."""

    files: Files
    head_timeout: float
    idle_timeout: float
    send_timeout: float
    max_connections: int
    connections: set[HttpConnection]


class _Date:
    """The Date header, formatted once a second."""

    second = -1
    value = b""

    @classmethod
    def now(cls) -> bytes:
        t = int(time.time())
        if t != cls.second:
            cls.second, cls.value = t, formatdate(t, usegmt=True).encode()
        return cls.value


def _content_type(path: bytes, _types: dict[bytes, bytes] = {}) -> bytes:  # noqa: B006 (a cache)
    ext = path.rpartition(b".")[2].lower() if b"." in path.rpartition(b"/")[2] else b""
    kind = _types.get(ext)
    if kind is None:
        guess = mimetypes.guess_type("x." + ext.decode("latin-1"))[0]
        kind = _types[ext] = (guess or "application/octet-stream").encode()
    return kind


class HttpConnection(asyncio.Protocol):
    """One client connection: requests parsed and answered in order.

    Backpressure: while the kernel buffer is full (`pause_writing`) or a large
    file is being sent, the connection stops reading, so a client that pipelines
    requests without reading the answers costs one socket buffer, not memory.

    Deadlines: the connection is always in one phase, whose deadline is set when
    the phase begins and never moved by the bytes that arrive in it: ``head``
    (from the first byte of a request, or from the connection), ``send`` (an
    answer the client has not taken: sendfile, or a full socket buffer) and
    ``idle`` (keep-alive between requests). The server's sweep aborts a
    connection past its deadline, so a client that trickles a byte at a time, or
    reads nothing, holds its connection and file for a bounded time.
    """

    def __init__(self, server: ServerState) -> None:
        self.server = server
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None
        self.write_paused = False  # the kernel buffer is full
        self.sending_file = False  # a large file is on its way (sendfile)
        self.send_task: asyncio.Future | None = None  # held: the loop keeps weak refs
        self.closing = False
        self.phase, self.deadline = "head", 0.0

    def connection_made(self, transport) -> None:
        self.transport = transport
        self._phase("head")
        if len(self.server.connections) >= self.server.max_connections:
            self._error(BadRequest(503, "too many connections"), keep_alive=False)
            return
        self.server.connections.add(self)

    def connection_lost(self, exc) -> None:
        self.server.connections.discard(self)
        self.closing = True

    def _phase(self, phase: str, nbytes: int = 0) -> None:
        """Enter `phase`; its deadline counts from now (``send``: for `nbytes` more)."""
        server = self.server
        if phase == "head":
            limit = server.head_timeout
        elif phase == "idle":
            limit = server.idle_timeout
        else:
            limit = server.send_timeout + nbytes / MIN_SEND_RATE
        self.phase, self.deadline = phase, time.monotonic() + limit

    def _settle(self) -> None:
        """The phase after an answer went out: sending, a next head begun, or idle."""
        if self.blocked:
            return
        self._phase("head" if self.buf else "idle")

    @property
    def blocked(self) -> bool:
        return self.write_paused or self.sending_file

    def pause_writing(self) -> None:
        self.write_paused = True
        self.transport.pause_reading()
        if not self.sending_file:  # (sendfile's phase counts its own bytes)
            self._phase("send", self.transport.get_write_buffer_size())

    def resume_writing(self) -> None:
        self.write_paused = False
        self._settle()
        self._process()

    def data_received(self, data: bytes) -> None:
        if self.phase == "idle":  # a new request begins: its head has head_timeout
            self._phase("head")
        self.buf += data
        self._process()

    def past_deadline(self, now: float) -> bool:
        return not self.closing and now > self.deadline

    def abort(self) -> None:
        """Drop the connection now. A sendfile in flight is cancelled and aborts it once it
        has let go of the socket: a transport aborted under asyncio's sendfile left the
        socket's number registered with epoll, and the next connection to get that number
        was never answered."""
        self.closing = True
        if self.sending_file and self.send_task is not None and not self.send_task.done():
            self.send_task.cancel()
        else:
            self.transport.abort()

    def _process(self) -> None:
        try:
            self._process_requests()
        except Exception:  # a bug here must cost this connection, never a file or the server
            log.exception("internal error; closing the connection")
            self.closing = True
            self.transport.abort()

    def _process_requests(self) -> None:
        while not self.blocked and not self.closing:
            end = self.buf.find(b"\r\n\r\n", 0, MAX_HEAD + 4)
            if end < 0:
                if len(self.buf) > MAX_HEAD:
                    self._error(BadRequest(431, "request head over 16 KiB"), keep_alive=False)
                elif not self.transport.is_closing():
                    self.transport.resume_reading()
                return
            head = bytes(self.buf[:end])
            del self.buf[: end + 4]
            try:
                method, path, keep_alive, headers = parse_head(head)
            except BadRequest as err:
                self._error(err, keep_alive=False)
                return
            self._answer(method, path, keep_alive, headers)
            self._settle()

    def _answer(self, method: bytes, path: bytes, keep_alive: bool, headers: dict) -> None:
        if method not in (b"GET", b"HEAD"):
            self._error(
                BadRequest(405, f"{method!r} not allowed"), keep_alive, b"Allow: GET, HEAD\r\n"
            )
            return
        try:
            opened = self.server.files.open(path)
        except BadRequest as err:  # out of files or memory: 503, which a client retries
            self._error(err, keep_alive=False)
            return
        if opened is None:
            self._error(BadRequest(404, "not found"), keep_alive)
            return
        fd, st = opened
        try:  # the file is closed on every way out, unless sendfile took it
            fd = self._answer_with(fd, st, method, path, keep_alive, headers)
        finally:
            if fd is not None:
                os.close(fd)

    def _answer_with(self, fd: int, st: os.stat_result, method: bytes, path: bytes,
                     keep_alive: bool, headers: dict) -> int | None:  # fmt: skip
        """Answer from the open file `fd`; returns it if it is still the caller's to close
        (None once a send task owns it)."""
        size = st.st_size
        status, start, end, extra = 200, 0, size, b""
        if b"range" in headers:
            span = parse_range(headers[b"range"], size)
            if span is False:
                self._error(
                    BadRequest(416, "range not satisfiable"),
                    keep_alive,
                    b"Content-Range: bytes */%d\r\n" % size,
                )
                return fd
            if span is not None:
                status, (start, end) = 206, span
                extra = b"Content-Range: bytes %d-%d/%d\r\n" % (start, end - 1, size)
        head = self._head(status, end - start, keep_alive, _content_type(path), extra)
        if method == b"HEAD":
            self._send(head, keep_alive)
            return fd
        if size <= SMALL_FILE:
            data = self.server.files.small(path, fd, st)
            self._send(head + data[start:end] if status == 206 else head + data, keep_alive)
            return fd
        self.transport.write(head)
        self.sending_file = True
        self._phase("send", len(head) + end - start)
        self.transport.pause_reading()
        self.send_task = asyncio.ensure_future(self._send_file(fd, start, end - start, keep_alive))
        return None

    async def _send_file(self, fd: int, offset: int, count: int, keep_alive: bool) -> None:
        loop = asyncio.get_running_loop()
        try:
            with os.fdopen(fd, "rb") as f:
                await loop.sendfile(self.transport, f, offset, count)
        except (OSError, RuntimeError) as err:  # the client went away mid-file
            log.debug("sendfile: %s", err)
            self.transport.abort()
            return
        except asyncio.CancelledError:  # past its deadline (see abort): sendfile let go of
            self.transport.abort()  # the socket first, so its file number can be reused
            return
        if not keep_alive:
            self.transport.close()
            return
        self.sending_file = False
        self._settle()
        self._process()

    @staticmethod
    def _head(status: int, length: int, keep_alive: bool, ctype: bytes, extra: bytes) -> bytes:
        return b"".join(
            (
                b"HTTP/1.1 %d %s\r\nServer: distlearn\r\nDate: "
                % (status, REASONS[status].encode()),
                _Date.now(),
                b"\r\nContent-Type: ",
                ctype,
                b"\r\nContent-Length: %d\r\nAccept-Ranges: bytes\r\n" % length,
                extra,
                b"" if keep_alive else b"Connection: close\r\n",
                b"\r\n",
            )
        )

    def _send(self, response: bytes, keep_alive: bool) -> None:
        self.transport.write(response)
        if not keep_alive:
            self.closing = True
            self.transport.close()

    def _error(self, err: BadRequest, keep_alive: bool, extra: bytes = b"") -> None:
        body = f"{err.status} {REASONS[err.status]}: {err}\n".encode()
        self._send(
            self._head(err.status, len(body), keep_alive, b"text/plain", extra) + body, keep_alive
        )
