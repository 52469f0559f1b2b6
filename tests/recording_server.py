"""A real aiohttp file server on 127.0.0.1, in a thread of the test, that keeps what
every request brought (path and headers): to see where credentials went.

    with recording(root, redirects={"hop.bin": "http://127.0.0.1:PORT/x"}) as srv:
        srv.url          # http://127.0.0.1:PORT/
        srv.seen         # [(path, {header: value}), ...] in arrival order
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

__all__ = ["Recording", "recording"]


@dataclass
class Recording:
    url: str
    port: int
    seen: list[tuple[str, dict[str, str]]] = field(default_factory=list)

    def headers_for(self, path: str) -> list[dict[str, str]]:
        return [h for p, h in self.seen if p == path]


@contextlib.contextmanager
def recording(root: Path | None = None, redirects: dict[str, str] | None = None,
              host: str = "127.0.0.1") -> Iterator[Recording]:  # fmt: skip
    """Serve `root` (every path answers 4 bytes ``b"seen"`` when `root` is None);
    `redirects` maps a path to the Location of a 302 for it."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.bind((host, 0))
    sock.listen(128)
    port = sock.getsockname()[1]
    rec = Recording(f"http://{'[' + host + ']' if ':' in host else host}:{port}/", port)
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    stop: list[asyncio.Event] = []

    async def handle(request: web.Request) -> web.StreamResponse:
        rel = request.match_info["path"]
        rec.seen.append((rel, dict(request.headers)))
        if redirects and rel in redirects:
            raise web.HTTPFound(redirects[rel])
        if root is None:
            return web.Response(body=b"seen")
        path = root / rel
        if not path.is_file():
            raise web.HTTPNotFound()
        return web.FileResponse(path)

    async def main() -> None:
        app = web.Application()
        app.router.add_get("/{path:.*}", handle)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.SockSite(runner, sock).start()
        stop.append(asyncio.Event())
        ready.set()
        await stop[0].wait()
        await runner.cleanup()

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    if not ready.wait(10):
        raise RuntimeError("the recording server did not start")
    try:
        yield rec
    finally:
        loop.call_soon_threadsafe(stop[0].set)
        thread.join(10)
        loop.close()
        sock.close()
