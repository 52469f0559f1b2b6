"""The listening sockets, one process or several (SO_REUSEPORT), and `main`."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import logging
import os
import resource
import signal
import socket
import sys
import time
from typing import NoReturn

from distlearn.common.procs import die_with_parent

from .files import Files
from .limits import HEAD_TIMEOUT_S, IDLE_TIMEOUT_S, MAX_CONNECTIONS, SEND_TIMEOUT_S
from .protocol import HttpConnection

__all__ = [
    "Server",
    "bind",
    "bind_group",
    "main",
    "max_connections",
    "raise_file_limit",
    "serve_in_processes",
    "write_port_file",
]

log = logging.getLogger(__name__)


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
