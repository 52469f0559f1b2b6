"""A static HTTP file server on loopback, standing in for a CDN.

    python -m distlearn.dataset.serve DIR [--host 127.0.0.1] [--port 0] [--port-file F]

Serves DIR with keep-alive and HTTP Range support (aiohttp's FileResponse), so
examples, tests and benchmarks fetch real bytes over real sockets. Port 0 (the
default) takes a free port; when an explicit port is busy the server falls back
to a free one and says so, so a stale server never blocks a script. The bound
port is written to --port-file once the socket listens.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys
from pathlib import Path

from aiohttp import web

log = logging.getLogger(__name__)


def make_app(root: str | os.PathLike) -> web.Application:
    """An aiohttp app that serves files below `root` (no listings, no symlinks out)."""
    root = Path(root).resolve()

    async def handle(request: web.Request) -> web.StreamResponse:
        rel = request.match_info["path"]
        path = (root / rel).resolve()
        if root not in path.parents or not path.is_file():
            raise web.HTTPNotFound(text=f"not found: /{rel}\n")
        return web.FileResponse(path, chunk_size=256 * 1024)

    app = web.Application()
    app.router.add_get("/{path:.+}", handle)
    return app


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on (host, port); a free port if that one is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        if port == 0:
            raise
        log.warning("port %d on %s is in use (%s); taking a free port", port, host, err)
        sock.bind((host, 0))
    sock.listen(1024)
    sock.setblocking(False)
    return sock


async def serve(root: str | os.PathLike, sock: socket.socket, port_file: str | None = None) -> None:
    """Serve `root` on an already bound socket until cancelled or signalled."""
    runner = web.AppRunner(make_app(root), access_log=None, handle_signals=False)
    await runner.setup()
    site = web.SockSite(runner, sock)
    await site.start()
    port = sock.getsockname()[1]
    if port_file:
        tmp = f"{port_file}.tmp"
        with open(tmp, "w") as f:
            f.write(f"{port}\n")
        os.replace(tmp, port_file)  # readers never see a half-written port
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m distlearn.dataset.serve", description=__doc__.split("\n")[0]
    )
    p.add_argument("root", help="directory to serve")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback)")
    p.add_argument("--port", type=int, default=0, help="port; 0 or a busy port takes a free one")
    p.add_argument("--port-file", help="write the bound port here once listening")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="serve: %(message)s")
    if not os.path.isdir(args.root):
        print(f"serve: not a directory: {args.root}", file=sys.stderr)
        return 2
    sock = bind(args.host, args.port)
    log.info("serving %s on http://%s:%d/", args.root, args.host, sock.getsockname()[1])
    asyncio.run(serve(args.root, sock, args.port_file))
    return 0


if __name__ == "__main__":
    sys.exit(main())
