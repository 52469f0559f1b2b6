"""A static HTTP/1.1 file server on loopback, standing in for a CDN.

    python -m distlearn.dataset.serve DIR [--host 127.0.0.1] [--port 0] [--port-file F]
                                          [--workers 1]
    distlearn-serve DIR ...                       (the same, as a console script)

Serves the regular files below DIR to GET and HEAD, with keep-alive, pipelining
and single byte ranges (`Range: bytes=a-b`, `a-`, `-n`), so examples, tests and
benchmarks fetch real bytes over real sockets. Port 0 (the default) takes a free
port; a port given explicitly that is busy is an error. The bound port is
written to --port-file once the socket listens.

Why not a web framework: 4 training processes on 2 cores read thousands of
small files a second from it, and aiohttp's FileResponse spent about 660 us of
CPU per request (nginx: 46 us), taking the cores from training. This is one
asyncio.Protocol with a total, size-bounded request parser, an in-memory cache
of small files and sendfile for large ones.

One process answered 23,000 small files a second on a 16-core host, 4 processes
40,000 (bench/RESULTS-serving.md). `--workers N` (Linux) serves from N processes,
each with its own socket on the same port (SO_REUSEPORT: the kernel spreads
connections over them, and only sockets of this user can join the port) and its
own cache, under a process that supervises them: a worker that dies stops the
server with an error, SIGINT or SIGTERM stops them all, and the workers die with
the supervisor.

What it refuses: anything not below DIR and any symbolic link on the way
(opened with openat2's RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS, or a component
walk with O_NOFOLLOW where the kernel lacks openat2), directories (no
listings), request bodies, headers over 16 KiB, and clients that stall. Every
phase of a connection has a deadline that trickling bytes cannot move: a
request head must be whole within 20 s of its first byte (or of the
connection), an answer must be taken by the client within 60 s plus a second
for every 8 MiB of it, and an idle keep-alive connection closes after 75 s.

What it never does: hold a file past its request (every path closes it, an
error's included), or answer 404 for want of resources. It raises its soft
limit on open files to the hard one (as ipc's servers do: the default 1024
exists for select(), not used here), takes at most as many connections as its
files allow (beyond, a 503 and a close), and answers 503 when it cannot open a
file for want of files or memory: a client retries a 503, but takes a 404 for
"no such file".
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import ctypes
import errno
import logging
import mimetypes
import os
import resource
import signal
import socket
import stat
import sys
import time
from email.utils import formatdate
from typing import NoReturn
from urllib.parse import unquote_to_bytes

from distlearn.common.procs import die_with_parent

__all__ = [
    "CACHE_BYTES",
    "HEAD_TIMEOUT_S",
    "IDLE_TIMEOUT_S",
    "MAX_CONNECTIONS",
    "MAX_HEAD",
    "MIN_SEND_RATE",
    "REASONS",
    "SEND_TIMEOUT_S",
    "SMALL_FILE",
    "BadRequest",
    "Files",
    "HttpConnection",
    "Server",
    "bind",
    "bind_group",
    "main",
    "max_connections",
    "parse_head",
    "parse_range",
    "raise_file_limit",
    "serve_in_processes",
    "write_port_file",
]

log = logging.getLogger(__name__)

MAX_HEAD = 16 * 1024  # request line and headers together
SMALL_FILE = 256 * 1024  # files up to this size are answered from memory
CACHE_BYTES = 256 * 1024 * 1024  # total bytes of small files kept
HEAD_TIMEOUT_S = 20.0  # a request head must be whole within this of its first byte
IDLE_TIMEOUT_S = 75.0  # keep-alive connections with no request
SEND_TIMEOUT_S = 60.0  # an answer must be taken within this, plus the time below
MIN_SEND_RATE = 8 << 20  # bytes a second the slowest reader is given (loopback clients)
MAX_CONNECTIONS = 4096  # at most (fewer where the file limit is lower: max_connections())

REASONS = {
    200: "OK",
    206: "Partial Content",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    413: "Content Too Large",
    416: "Range Not Satisfiable",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    503: "Service Unavailable",
    505: "HTTP Version Not Supported",
}


# ----------------------------------------------------------------------------- files


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_SYS_OPENAT2 = {"x86_64": 437, "aarch64": 437}.get(os.uname().machine)
_RESOLVE_NO_SYMLINKS, _RESOLVE_BENEATH = 0x04, 0x08
_OPEN_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
_OUT_OF = (errno.EMFILE, errno.ENFILE, errno.ENOMEM)


class Files:
    """Opens request paths strictly below `root` and caches small files' bytes.

    `open(path)` returns (fd, stat) or None; the fd is the caller's to close.
    The kernel enforces the boundary (no `..`, no symlink, no other mount
    escape) on each open, so a tree that changes under the server cannot make
    it read outside `root`.
    """

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = os.path.realpath(root)
        self.root_fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self._cache: collections.OrderedDict[str, tuple[tuple, bytes]] = collections.OrderedDict()
        self._cached_bytes = 0
        self._openat2 = self._probe_openat2()

    def _probe_openat2(self):
        if _SYS_OPENAT2 is None:
            return None
        try:
            syscall = ctypes.CDLL(None, use_errno=True).syscall
        except (OSError, AttributeError):
            return None
        how = _OpenHow(_OPEN_FLAGS | os.O_DIRECTORY, 0, _RESOLVE_BENEATH | _RESOLVE_NO_SYMLINKS)
        fd = syscall(_SYS_OPENAT2, self.root_fd, b".", ctypes.byref(how), ctypes.sizeof(how))
        if fd < 0:  # ENOSYS (old kernel) or EPERM (a seccomp filter): walk instead
            return None
        os.close(fd)
        how = _OpenHow(_OPEN_FLAGS, 0, _RESOLVE_BENEATH | _RESOLVE_NO_SYMLINKS)
        size = ctypes.sizeof(how)
        ref = ctypes.byref(how)
        return lambda rel: syscall(_SYS_OPENAT2, self.root_fd, rel, ref, size)

    def _open_fd(self, parts: list[bytes]) -> int:
        if self._openat2 is not None:
            fd = self._openat2(b"/".join(parts))
            if fd < 0:
                raise OSError(ctypes.get_errno(), "openat2")
            return fd
        fd = self.root_fd
        try:  # one component at a time, never following a link
            for part in parts[:-1]:
                nxt = os.open(part, _OPEN_FLAGS | os.O_DIRECTORY, dir_fd=fd)
                if fd != self.root_fd:
                    os.close(fd)
                fd = nxt
            return os.open(parts[-1], _OPEN_FLAGS, dir_fd=fd)
        finally:
            if fd != self.root_fd:
                os.close(fd)

    def open(self, path: bytes) -> tuple[int, os.stat_result] | None:
        """The regular file at URL path `path` (percent-encoded, '/'-rooted), or None.

        BadRequest(503) when it cannot be opened for want of files or memory: that
        is not "no such file", and a client must not take it for one."""
        try:
            raw = unquote_to_bytes(path)
        except (TypeError, ValueError):
            return None
        parts = [p for p in raw.split(b"/") if p and p != b"."]
        if not parts or b".." in parts or any(b"\x00" in p for p in parts):
            return None
        try:
            fd = self._open_fd(parts)
        except OSError as err:
            if err.errno in _OUT_OF:
                raise BadRequest(503, f"out of resources ({os.strerror(err.errno)})") from None
            return None
        try:
            st = os.fstat(fd)
        except BaseException:
            os.close(fd)
            raise
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            return None
        return fd, st

    def small(self, key: bytes, fd: int, st: os.stat_result) -> bytes:
        """The bytes of a small file, from the cache while its identity is unchanged."""
        ident = (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)
        hit = self._cache.get(key)
        if hit is not None and hit[0] == ident:
            self._cache.move_to_end(key)
            return hit[1]
        data = os.pread(fd, st.st_size, 0)
        if hit is not None:
            self._cached_bytes -= len(hit[1])
        self._cache[key] = (ident, data)
        self._cached_bytes += len(data)
        while self._cached_bytes > CACHE_BYTES:
            _, (_, old) = self._cache.popitem(last=False)
            self._cached_bytes -= len(old)
        return data

    def close(self) -> None:
        os.close(self.root_fd)


# ----------------------------------------------------------------------------- requests


class BadRequest(Exception):
    def __init__(self, status: int, why: str) -> None:
        super().__init__(why)
        self.status = status


def parse_head(head: bytes) -> tuple[bytes, bytes, bool, dict[bytes, bytes]]:
    """(method, path, keep_alive, headers) of one request head, or BadRequest.

    Total over any bytes: every malformed line is refused, never guessed at.
    Header names are lower-cased; repeated headers we act on are refused.
    """
    lines = head.split(b"\r\n")
    request = lines[0].split(b" ")
    if len(request) != 3 or not request[0].isalpha() or not request[1]:
        raise BadRequest(400, "malformed request line")
    method, target, version = request
    if version not in (b"HTTP/1.1", b"HTTP/1.0"):
        if not version.startswith(b"HTTP/"):
            raise BadRequest(400, "malformed request line")
        raise BadRequest(505, "only HTTP/1.0 and HTTP/1.1")
    headers: dict[bytes, bytes] = {}
    for line in lines[1:]:
        name, colon, value = line.partition(b":")
        if not colon or not name or name != name.strip() or b" " in name or b"\t" in name:
            raise BadRequest(400, "malformed header line")  # incl. obsolete line folding
        name = name.lower()
        if name in headers and name in (b"content-length", b"transfer-encoding", b"range"):
            raise BadRequest(400, f"repeated {name.decode('latin-1')} header")
        headers[name] = value.strip()
    if b"transfer-encoding" in headers or headers.get(b"content-length", b"0") != b"0":
        raise BadRequest(413, "request bodies are not accepted")
    connection = headers.get(b"connection", b"").lower()
    if version == b"HTTP/1.1":
        keep_alive = b"close" not in connection
    else:
        keep_alive = b"keep-alive" in connection
    if target.startswith((b"http://", b"https://")):  # absolute form: drop scheme and host
        target = b"/" + target.split(b"/", 3)[3] if target.count(b"/") >= 3 else b"/"
    if not target.startswith(b"/"):
        raise BadRequest(400, "request target is not a path")
    path = target.split(b"?", 1)[0].split(b"#", 1)[0]
    return method.upper(), path, keep_alive, headers


_HUGE = 1 << 63  # any position past every file


def _position(digits: bytes) -> int:
    """A byte position of a Range header: ASCII digits, any number of them (more than
    18 is past any file; int() would refuse over 4300, and cost time before that)."""
    digits = digits.lstrip(b"0") or b"0"
    return int(digits) if len(digits) <= 18 else _HUGE


def parse_range(value: bytes, size: int) -> tuple[int, int] | bool | None:
    """(start, end exclusive) of a single `bytes=` range; None to send the whole
    file (no range, several ranges, or a syntax we ignore, as RFC 9110 allows);
    False when the range cannot be satisfied. Total: it never raises."""
    if not value.startswith(b"bytes=") or b"," in value:
        return None
    first, dash, last = value[6:].strip().partition(b"-")
    if not dash or not _digits(first) or not _digits(last):
        return None
    if not first:  # suffix: the last n bytes
        if not last:
            return None
        n = _position(last)
        return (max(0, size - n), size) if n > 0 and size > 0 else False
    start = _position(first)
    end = min(size, _position(last) + 1) if last else size
    if last and _position(last) < start:
        return None
    return (start, end) if start < size else False


def _digits(field: bytes) -> bool:
    """Empty, or ASCII digits only (bytes.isdigit() is ASCII-only; str's is not)."""
    return not field or field.isdigit()


# ----------------------------------------------------------------------------- the protocol


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

    def __init__(self, server: Server) -> None:
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


# ----------------------------------------------------------------------------- the server


def raise_file_limit() -> None:
    """Raise the soft limit on open files to the hard one, as ipc's servers do
    (distlearn.ipc.fdlimit): the default soft limit of 1024 exists for select(),
    which asyncio's epoll loop does not use, and each connection holds a file."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard if hard != resource.RLIM_INFINITY else 1 << 20, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (OSError, ValueError) as err:
            log.warning("could not raise the open-file limit from %d: %s", soft, err)


def max_connections() -> int:
    """Connections taken at once: each may hold two files (its socket, and a file being
    sent), and an eighth of the limit (at least 32) stays free for the rest."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    limit = 1 << 20 if soft == resource.RLIM_INFINITY else soft
    return max(1, min(MAX_CONNECTIONS, (limit - max(32, limit // 8)) // 2))


class Server:
    """Serves `root` on a bound socket; `await serve()` runs until `stop()`.

    Args:
        root: The folder to serve; nothing outside it, and no symbolic link.
        sock: A listening socket (`bind`).
        head_timeout: Seconds a request's head may take to arrive.
        idle_timeout: Seconds an idle keep-alive connection stays open.

    Raises:
        ValueError: A timeout that is not positive.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        sock: socket.socket,
        head_timeout: float = HEAD_TIMEOUT_S,
        idle_timeout: float = IDLE_TIMEOUT_S,
        send_timeout: float = SEND_TIMEOUT_S,
    ) -> None:
        if head_timeout <= 0 or idle_timeout <= 0 or send_timeout <= 0:
            raise ValueError("timeouts must be positive")
        self.files = Files(root)
        self.sock = sock
        self.head_timeout, self.idle_timeout = head_timeout, idle_timeout
        self.send_timeout = send_timeout
        self.max_connections = max_connections()
        self.connections: set[HttpConnection] = set()
        self._stop: asyncio.Event | None = None

    @property
    def port(self) -> int:
        """The port the socket is bound to."""
        return self.sock.getsockname()[1]

    async def serve(self) -> None:
        """Serve until `stop()`; then close every connection and the open files."""
        loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        server = await loop.create_server(lambda: HttpConnection(self), sock=self.sock)
        sweeper = asyncio.ensure_future(self._sweep())
        try:
            await self._stop.wait()
        finally:
            sweeper.cancel()
            server.close()
            for conn in list(self.connections):
                conn.abort()
            self.files.close()

    def stop(self) -> None:
        """Make `serve()` return (from the loop's thread)."""
        if self._stop is not None:
            self._stop.set()

    async def _sweep(self) -> None:
        """Abort connections past their phase's deadline (see HttpConnection)."""
        tick = min(1.0, self.head_timeout / 4, self.send_timeout / 4, self.idle_timeout / 4)
        while True:
            await asyncio.sleep(tick)
            now = time.monotonic()
            for conn in list(self.connections):
                if conn.past_deadline(now):
                    log.debug("closing a connection past its %s deadline", conn.phase)
                    conn.abort()


def bind(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    """A listening, non-blocking socket on (host, port).

    Args:
        host: The address to bind (IPv6 when it holds a colon).
        port: The port; 0 for a free one.
        reuse_port: Set SO_REUSEPORT (for a group of sockets on one port).

    Returns:
        The socket.

    Raises:
        OSError: The address is taken or cannot be bound, naming it.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sock.listen(1024)
    except OSError as err:
        sock.close()
        if err.errno == errno.EADDRINUSE:
            raise OSError(
                err.errno,
                f"port {port} on {host} is in use; pick another with "
                "--port, or --port 0 for a free one",
            ) from None
        raise OSError(err.errno, f"cannot listen on {host}:{port}: {err.strerror}") from None
    sock.setblocking(False)
    return sock


def bind_group(host: str, port: int, n: int) -> list[socket.socket]:
    """`n` listening sockets on one port (SO_REUSEPORT), one for each worker process.

    The port is first bound without SO_REUSEPORT, which fails if any socket holds it
    (ours, another program's, or another group's): joining a group already there
    would share its connections. Port 0 takes the kernel's pick, tried again if the
    port is taken in the moment between that check and the group's bind."""
    for _attempt in range(5):
        probe = bind(host, port)
        chosen = probe.getsockname()[1]
        probe.close()
        socks: list[socket.socket] = []
        try:
            for _ in range(n):
                socks.append(bind(host, chosen, reuse_port=True))
            return socks
        except OSError as err:
            for sock in socks:
                sock.close()
            if port or err.errno != errno.EADDRINUSE:
                raise
    raise OSError(errno.EADDRINUSE, f"no free port on {host} after 5 attempts")


def write_port_file(path: str, port: int) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(f"{port}\n")
    os.replace(tmp, path)  # readers never see a half-written port


async def _run(args: argparse.Namespace, sock: socket.socket, worker: bool = False) -> None:
    server = Server(args.root, sock, args.head_timeout, args.idle_timeout, args.send_timeout)
    loop = asyncio.get_running_loop()
    # A worker stops on its supervisor's SIGTERM only: Ctrl-C reaches the whole
    # process group, and the supervisor must not mistake a worker that ended on it
    # for one that died.
    for sig in (signal.SIGTERM,) if worker else (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, server.stop)
    if not worker and args.port_file:  # the socket listens: early clients wait in its backlog
        write_port_file(args.port_file, server.port)
    await server.serve()


class _Stop(Exception):
    """SIGINT or SIGTERM reached the supervising process."""


def _raise_stop(_signum: int, _frame) -> None:
    raise _Stop


def _worker(
    args: argparse.Namespace, socks: list[socket.socket], mine: int, parent: int
) -> NoReturn:
    """A forked worker process: serve on `socks[mine]` until SIGTERM. Never returns."""
    code = 1
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # (see _run)
        die_with_parent(parent, signal.SIGTERM)  # (SIGTERM: it stops as when told to)
        for i, sock in enumerate(socks):
            if i != mine:
                sock.close()
        asyncio.run(_run(args, socks[mine], worker=True))
        code = 0
    except BaseException:  # a worker reports and exits, whatever happened
        log.exception("worker %d failed", os.getpid())
    finally:
        os._exit(code)


def serve_in_processes(args: argparse.Namespace, socks: list[socket.socket]) -> int:
    """One forked worker per socket; this process supervises them.

    Args:
        args: The parsed command line (`root`, the timeouts).
        socks: The listening sockets (`bind_group`), one per worker.

    Returns:
        The exit status: 0 once stopped by SIGINT or SIGTERM, 1 when a worker died first.
    """
    parent, pids, port = os.getpid(), [], socks[0].getsockname()[1]
    try:
        for mine in range(len(socks)):
            pid = os.fork()
            if pid == 0:
                _worker(args, socks, mine, parent)
            pids.append(pid)
    finally:
        for sock in socks:  # the workers hold them
            sock.close()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _raise_stop)
    code = 0
    try:
        if args.port_file:
            write_port_file(args.port_file, port)
        pid, status = os.wait()  # the first worker to end ends the server
        pids.remove(pid)
        log.error("worker %d %s; stopping the others", pid, _describe(status))
        code = 1
    except _Stop:
        pass
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)  # the cleanup below is bounded: let it run
        _stop_workers(pids)
    return code


def _describe(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"was killed by {signal.Signals(os.WTERMSIG(status)).name}"
    return f"exited with status {os.waitstatus_to_exitcode(status)}"


def _stop_workers(pids: list[int], grace: float = 5.0) -> None:
    """SIGTERM every worker left, SIGKILL those still there after `grace` seconds."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while pids:
        pid, _ = os.waitpid(-1, os.WNOHANG)
        if pid in pids:
            pids.remove(pid)
            continue
        if time.monotonic() > deadline:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            return
        time.sleep(0.02)


def main(argv: list[str] | None = None) -> int:
    """`distlearn-serve DIR [--host H] [--port P] [--port-file F] [--workers N] ...`.

    Args:
        argv: The command line's arguments; None: `sys.argv[1:]`.

    Returns:
        The exit status.
    """
    p = argparse.ArgumentParser(
        prog="python -m distlearn.dataset.serve", description=__doc__.split("\n")[0]
    )
    p.add_argument("root", help="directory to serve")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback)")
    p.add_argument("--port", type=int, default=0, help="port (default 0: a free one)")
    p.add_argument("--port-file", help="write the bound port here once listening")
    p.add_argument(
        "--head-timeout",
        type=float,
        default=HEAD_TIMEOUT_S,
        help="seconds a started request head may take (default %(default)s)",
    )
    p.add_argument(
        "--idle-timeout",
        type=float,
        default=IDLE_TIMEOUT_S,
        help="seconds an idle keep-alive connection stays open (default %(default)s)",
    )
    p.add_argument(
        "--send-timeout",
        type=float,
        default=SEND_TIMEOUT_S,
        help="seconds a client may take to read an answer, plus one per 8 MiB of it "
        "(default %(default)s)",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=1,
        help="processes serving the port (Linux, SO_REUSEPORT; default %(default)s)",
    )
    args = p.parse_args(argv)
    if args.head_timeout <= 0 or args.idle_timeout <= 0 or args.send_timeout <= 0:
        p.error("timeouts must be positive")
    if args.workers < 1:
        p.error(f"--workers must be at least 1, not {args.workers}")
    if args.workers > 1 and not (sys.platform == "linux" and hasattr(socket, "SO_REUSEPORT")):
        p.error("--workers above 1 needs Linux (SO_REUSEPORT)")
    logging.basicConfig(level=logging.INFO, format="serve: %(message)s")
    raise_file_limit()  # before the workers fork: they inherit it
    if not os.path.isdir(args.root):
        print(f"serve: not a directory: {args.root}", file=sys.stderr)
        return 2
    try:
        socks = (
            [bind(args.host, args.port)]
            if args.workers == 1
            else bind_group(args.host, args.port, args.workers)
        )
    except OSError as err:
        print(f"serve: {err.strerror}", file=sys.stderr)
        return 2
    port = socks[0].getsockname()[1]
    log.info("serving %s on http://%s:%d/ (%d process(es))", args.root, args.host, port, len(socks))
    if len(socks) == 1:
        asyncio.run(_run(args, socks[0]))
        return 0
    return serve_in_processes(args, socks)


if __name__ == "__main__":
    sys.exit(main())
